"""`cotangent train`: the same seed trained with the native and the Cotangent update phase.

Bitwise arms (every arm gives native's bits):
    native              `torch.nn.utils.clip_grad_norm_(params, max_norm)` (foreach=None) then
                        `torch.optim.AdamW(..., fused=True)` - the fastest native CPU path.
    cotangent           `cotangent.AdamW(..., fused=True, max_norm=max_norm)`: the product,
                        reading every tensor where it is.
The seed study's 2x2 factorial {batched norms} x {packing} (native is neither):
    batched-norms-only  `cotangent.harness.factorial.BatchedNormsOnly`: stacked batched norms,
                        native tensors, native clip multiply and AdamW.
    packing-only        `PackedAdamW(..., batched_norms=False)`: packed buffers,
                        merged AdamW calls, native per-tensor norms.
    packed              `PackedAdamW(...)`: both (the seed study's `cotangent` arm).

Study arms (occurrence aggregation of a shared recurrent core; a study, not a bitwise family:
their final hashes are recorded, never required to agree), each on a `recurrent-*` model and
trained with `cotangent.MuonAdamW` (Muon for the block matrices, AdamW for the token
embedding and the head, settings `muon_*`; no gradient clipping; the warmup + cosine schedule
`lr_factor` on every group):
    U                   untied core: every occurrence of a core block has its own weights.
    S                   shared core: one module per core block, reused at each occurrence.
    P, A, AP, PA        replicated core (one replica leaf per occurrence, identical at init)
                        kept in sync by `cotangent.occurrence.OccurrenceAggregator` in mode
                        pooled, averaged, ap, pa; every step must end with the replicas equal
                        (`sync_error` 0.0), else the run stops (`OccurrenceSyncError`).
Bitwise arms on a recurrent model train its untied variant.

The arms run interleaved in one process (step i of both before step i + 1, their order
alternating), each from `torch.manual_seed(seed)` and its own window sampler, so machine drift
hits both alike. Timed regions are bracketed by a device synchronisation. The update phase is
clip + AdamW step + zero_grad (the moment the gradients are ready until the next backward may
start); the whole step adds forward and backward.

Data parallel (`cotangent train --nproc N`, or started by `torchrun`): every rank runs every
arm, each arm's model wrapped in `DistributedDataParallel` (gloo on CPU, nccl on cuda with
device cuda:LOCAL_RANK), from the same initial model; rank r draws its own windows
(`rank_sampler_seed`). Only rank 0 prints and writes records; its clock times the steps. The
final model hashes of every rank are gathered and compared (`ranks_agree`).
"""

from __future__ import annotations

from cotangent.harness.train import arm_setup, config, distributed, loop, run_records
from cotangent.harness.train.config import (
    BITWISE_ARMS,
    DEFAULT_ARMS,
    FSDP2_ARMS,
    NATIVE_PATH,
    OCCURRENCE_KEYS,
    OccurrenceSyncError,
    STUDY_ARMS,
    TRAIN_ARMS,
    DataSettings,
    EvalSettings,
    ModelSettings,
    MuonSettings,
    OptimizerSettings,
    TrainConfig,
    check_device,
    check_fsdp2_arms,
    check_study_arms,
    format_config,
    lr_factor,
    schedule_sha256,
    settings_of,
    sync,
    train_config,
    validate_config,
    warmup_steps,
)
from cotangent.harness.train.distributed import (
    BACKENDS,
    DataParallel,
    LAUNCHER_ENV,
    SAMPLER_SEED_FORMULA,
    SINGLE_PROCESS_RECORD,
    _across_ranks,
    _compare_ranks,
    _cores,
    check_data_parallel_device,
    end_rank_process,
    launcher_env,
    process_group,
    rank_sampler_seed,
)
from cotangent.harness.train.arm_setup import (
    Arm,
)
from cotangent.harness.train.run_records import (
    TENSORBOARD_EXTRA,
    TENSORBOARD_SKIP,
    TensorBoardCurves,
    _Curves,
    _count,
    _device_name,
    _finish_records,
    _start_records,
    canonical_sha256,
    format_comparison,
    progress_line,
    result_json,
    tensorboard_writer_class,
)
from cotangent.harness.train.loop import (
    _Run,
    _autocast,
    _eval_windows,
    _nll_sum,
    _run_train,
    _summarize_arm,
    _train_loop,
    _train_step,
    evaluate_bpb,
    run_train,
)

__all__ = ["arm_setup", "config", "distributed", "loop", "run_records", "BITWISE_ARMS",
           "DEFAULT_ARMS", "FSDP2_ARMS", "NATIVE_PATH", "OCCURRENCE_KEYS",
           "OccurrenceSyncError", "STUDY_ARMS", "TRAIN_ARMS", "TrainConfig", "DataSettings",
           "EvalSettings", "ModelSettings", "MuonSettings", "OptimizerSettings", "settings_of",
           "train_config",
           "check_device", "check_fsdp2_arms", "check_study_arms", "format_config", "lr_factor",
           "schedule_sha256", "sync", "validate_config", "warmup_steps", "BACKENDS",
           "DataParallel", "LAUNCHER_ENV", "SAMPLER_SEED_FORMULA",
           "SINGLE_PROCESS_RECORD", "_across_ranks", "_compare_ranks", "_cores",
           "check_data_parallel_device", "end_rank_process", "launcher_env",
           "process_group", "rank_sampler_seed", "Arm", "TENSORBOARD_EXTRA",
           "TENSORBOARD_SKIP", "TensorBoardCurves", "_Curves", "_count", "_device_name",
           "_finish_records", "_start_records", "canonical_sha256", "format_comparison",
           "progress_line", "result_json", "tensorboard_writer_class", "_Run",
           "_autocast", "_eval_windows", "_nll_sum", "_run_train", "_summarize_arm",
           "_train_loop", "_train_step", "evaluate_bpb", "run_train"]
