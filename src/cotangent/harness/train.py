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

import hashlib
import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import cotangent
from cotangent.muon_adamw import recompile_room
from cotangent.harness import contention, records, schema
from cotangent.harness.data import (
    BITS_PER_NAT,
    TRAIN_FRACTION,
    Corpus,
    WindowSampler,
    eval_windows,
)
from cotangent.harness.factorial import BatchedNormsOnly
from cotangent.harness.model import MODEL_CONFIGS, build_model, shard_fsdp2
from cotangent.harness.schema import setting
from cotangent.harness.packed import PackedAdamW

BITWISE_ARMS = ("native", "cotangent", "batched-norms-only", "packing-only", "packed",
                "cotangent-zero1", "native-fsdp2", "cotangent-fsdp2")
# FSDP2 arms: the model `fully_shard`ed (`shard_fsdp2`), native's clip + fused AdamW or
# cotangent.AdamW on the DTensor parameters; data-parallel only
FSDP2_ARMS = ("native-fsdp2", "cotangent-fsdp2")
# Study arm -> (the recurrent model's sharing, the OccurrenceAggregator mode or None).
STUDY_ARMS: dict[str, tuple[str, str | None]] = {
    "U": ("untied", None), "S": ("shared", None), "P": ("replicated", "pooled"),
    "A": ("replicated", "averaged"), "AP": ("replicated", "ap"), "PA": ("replicated", "pa")}
TRAIN_ARMS = BITWISE_ARMS + tuple(STUDY_ARMS)
DEFAULT_ARMS = ("native", "cotangent")
OCCURRENCE_KEYS = ("pooled_norm", "averaged_norm", "target_norm", "realized_norm",
                   "relative_norm_mismatch", "cosine", "sync_error", "autograd_order")
NATIVE_PATH = "clip_grad_norm_(foreach=None) + torch.optim.AdamW(fused=True)"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One `cotangent train` run (all its arms). Each field's type, bounds or choices and
    meaning are declared once (`cotangent.harness.schema`): `validate_config`, the CLI's flags
    and a campaign protocol's `[train]` table are all checked against them."""

    model: str = setting("byte-level model (cotangent.harness.model)", "transformer-small",
                         choices=tuple(sorted(MODEL_CONFIGS)))
    steps: int = setting("optimizer updates per arm", 300, low=1)
    seed: int = setting("model init: torch.manual_seed(seed); windows: "
                        "default_rng(seed + 100000 + rank * 2**63), rank 0 in a single "
                        "process", 0, low=0, high=2**63 - 100_000,
                        high_open=True, want="an integer in [0, 2**63 - 100000)")
    batch_size: int = setting("windows per step, each context + 1 bytes", 8, low=1)
    lr: float = setting("peak learning rate", 1e-3, low=0.0)
    betas: tuple[float, float] = setting("AdamW betas", (0.9, 0.95), low=0.0, high=1.0,
                                         high_open=True)
    eps: float = setting("AdamW eps", 1e-8, low=0.0)
    weight_decay: float = setting("AdamW decoupled weight decay", 0.1, low=0.0)
    max_norm: float = setting("gradient clipping threshold (global L2 norm)", 1.0, low=0.0)
    device: str = setting("device type", "cpu", choices=("cpu", "cuda", "mps"))
    precision: str = setting("auto: fp32 on CPU, bf16 autocast (fp32 weights) on cuda/mps",
                             "auto", choices=("auto", "fp32", "bf16"))
    val_bytes: int = setting("final valid and test BPB on the first this many bytes; 0 = all",
                             131_072, low=0)
    eval_every: int = setting("probe BPB on the held-out last 5% of train every this many "
                              "steps; 0 = never", 0, low=0)
    probe_bytes: int = setting("bytes of that held-out tail each probe evaluates", 65_536,
                               low=1)
    eval_batch: int = setting("windows per evaluation forward pass", 16, low=1)
    compile: bool = setting("torch.compile the model (the update phase stays outside it)",
                            False)
    out: str = setting("parent directory of run directories", "runs")
    arms: tuple[str, ...] = setting("which arms, trained interleaved; the first is the "
                                    "baseline", DEFAULT_ARMS, choices=TRAIN_ARMS, min_items=1,
                                    distinct=True)
    # The study arms (U, S, P, A, AP, PA): cotangent.MuonAdamW settings (nanochat's defaults,
    # without its (width / 768) ** -0.5 scaling of the AdamW lrs); lr, betas, eps,
    # weight_decay and max_norm above are the bitwise arms' and do not apply to them.
    muon_lr: float = setting("study arms: peak Muon lr (block matrices)", 0.02, low=0.0)
    muon_momentum: float = setting("study arms: Muon Nesterov momentum", 0.95, low=0.0,
                                   high=1.0, high_open=True)
    muon_ns_steps: int = setting("study arms: Polar Express iterations", 5, low=1, high=5)
    muon_beta2: float = setting("study arms: Muon (NorMuon) second-moment decay", 0.95, low=0.0,
                                high=1.0, high_open=True)
    muon_weight_decay: float = setting("study arms: Muon cautious weight decay", 0.0, low=0.0)
    muon_embedding_lr: float = setting("study arms: peak AdamW lr of the token embedding", 0.2,
                                       low=0.0)
    muon_head_lr: float = setting("study arms: peak AdamW lr of the head", 0.004, low=0.0)
    muon_adamw_betas: tuple[float, float] = setting("study arms: AdamW betas (embedding, head)",
                                                    (0.8, 0.95), low=0.0, high=1.0,
                                                    high_open=True)
    muon_adamw_eps: float = setting("study arms: AdamW eps", 1e-10, low=0.0)
    muon_adamw_weight_decay: float = setting("study arms: AdamW decoupled weight decay", 0.0,
                                             low=0.0)
    muon_compile: bool = setting("study arms: torch.compile MuonAdamW's step functions", False)

    def resolved_precision(self) -> str:
        """fp32 or bf16: `precision`, with auto resolved for `device`."""
        if self.precision == "auto":
            return "fp32" if self.device == "cpu" else "bf16"
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be auto, fp32 or bf16, not {self.precision!r}")
        return self.precision


def validate_config(cfg: TrainConfig) -> None:
    """Check every setting of `cfg` before anything is built or written.

    Raises:
        ValueError: one line naming the first bad setting (a value of the wrong type, outside
            its bounds or not among its choices, per `TrainConfig`'s field descriptions), or an
            `out` path that is a file.
    """
    schema.check(TrainConfig, {f.name: getattr(cfg, f.name) for f in fields(cfg)})
    check_study_arms(cfg.arms, cfg.model)
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ValueError(f"out {cfg.out} exists and is not a directory")


def check_study_arms(arms, model: str) -> None:
    """Raise ValueError (one line) when a study arm is asked of a model that is not recurrent."""
    study = [a for a in arms if a in STUDY_ARMS]
    family = MODEL_CONFIGS[model].family if model in MODEL_CONFIGS else None
    if study and family != "recurrent":
        recurrent = sorted(n for n, c in MODEL_CONFIGS.items() if c.family == "recurrent")
        raise ValueError(f"arm(s) {', '.join(study)} train a recurrent model ("
                         f"{' or '.join(recurrent)}), not {model}")


class OccurrenceSyncError(RuntimeError):
    """A replicated-core study arm ended a step with replicas that differ (sync_error != 0)."""


def check_device(name: str) -> None:
    """Raise ValueError when this torch build cannot see device type `name`."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build sees no CUDA device")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: this torch build sees no MPS device")


def warmup_steps(steps: int) -> int:
    """Linear warmup length: min(100, max(20, steps // 10))."""
    return min(100, max(20, steps // 10))


def lr_factor(step: int, steps: int) -> float:
    """Multiplier of the peak lr at update `step` (0-based): linear warmup to 1, then cosine to
    0.1."""
    w = warmup_steps(steps)
    if step < w:
        return (step + 1) / w
    progress = (step - w) / max(1, steps - w)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def sync(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ---------------------------------------------------------------------------------------------
# Data parallelism

# Set by torchrun (and torch.distributed's elastic launcher) in every rank it starts.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # device type -> process group backend
SAMPLER_SEED_FORMULA = "numpy.random.default_rng(seed + 100000 + rank * 2**63)"


def rank_sampler_seed(seed: int, rank: int) -> int:
    """The `seed` given to rank `rank`'s `WindowSampler`: `seed + rank * 2**63`.

    The sampler draws from `numpy.random.default_rng(seed + 100000 + rank * 2**63)`
    (`SAMPLER_SEED_FORMULA`). Rank 0, and a run without data parallelism, draws exactly the
    windows of a one-process run of the same seed. The map (seed, rank) -> generator seed is
    one-to-one because `TrainConfig` bounds seed + 100000 below 2**63.

    Raises:
        ValueError: a negative seed or rank.
    """
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be >= 0, got seed {seed}, rank {rank}")
    return seed + rank * 2**63


@dataclass(frozen=True, kw_only=True, slots=True)
class DataParallel:
    """This process's place in a data-parallel run (an initialised default process group)."""

    rank: int  # global rank, 0 .. world_size - 1
    world_size: int  # ranks in the run
    local_rank: int  # rank on this machine (the CUDA device index on cuda)
    local_world_size: int  # ranks on this machine; torchrun gives ranks 0 .. this - 1 to rank 0's
    backend: str  # gloo (cpu) or nccl (cuda)
    threads: int  # torch intra-op threads of each rank
    threads_from: str  # "OMP_NUM_THREADS" (set by the user or torchrun) or "cores // local ranks"

    @property
    def on_rank0_host(self) -> bool:
        """Whether this rank shares rank 0's machine (torchrun numbers ranks node by node)."""
        return self.rank < self.local_world_size

    def record(self) -> dict:
        """The metadata.json entry `data_parallel`."""
        return {"world_size": self.world_size, "backend": self.backend,
                "local_world_size": self.local_world_size, "threads_per_rank": self.threads,
                "threads_from": self.threads_from, "sampler_seed": SAMPLER_SEED_FORMULA,
                "model": "torch.nn.parallel.DistributedDataParallel per arm (defaults: "
                         "gradient_as_bucket_view=False, broadcast_buffers=True), the optimizer "
                         "over the unwrapped model's parameters",
                "loss_bpb": "mean over ranks of each rank's batch loss",
                "timing": "rank 0's clock; cpu_s: the CPU seconds of every rank on rank 0's "
                          "machine",
                "evaluation": "windows split into world_size contiguous parts, NLL sums "
                              "gathered and added in rank order"}


SINGLE_PROCESS_RECORD = {"world_size": 1, "backend": None, "sampler_seed": SAMPLER_SEED_FORMULA}


def launcher_env(environ: Mapping[str, str] = os.environ) -> dict[str, int | str] | None:
    """The rank variables torchrun sets (`LAUNCHER_ENV`), or None when none of them is set.

    Returns:
        {RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE: int, MASTER_ADDR: str, MASTER_PORT: int}.

    Raises:
        ValueError: some but not all of them are set, one is not an integer where one is
            needed, or the ranks are out of range (RANK not below WORLD_SIZE, ...).
    """
    present = [k for k in LAUNCHER_ENV if k in environ]
    if not present:
        return None
    missing = [k for k in LAUNCHER_ENV if k not in environ]
    if missing:
        raise ValueError(f"incomplete torchrun environment: {', '.join(present)} set but not "
                         f"{', '.join(missing)}; start data-parallel runs with torchrun or "
                         "--nproc, or unset these variables")
    env: dict[str, int | str] = {"MASTER_ADDR": environ["MASTER_ADDR"]}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        try:
            env[key] = int(environ[key])
        except ValueError:
            raise ValueError(f"environment variable {key} must be an integer, got "
                             f"{environ[key]!r}") from None
    if not (0 <= env["RANK"] < env["WORLD_SIZE"]
            and 0 <= env["LOCAL_RANK"] < env["LOCAL_WORLD_SIZE"] <= env["WORLD_SIZE"]):
        raise ValueError("torchrun environment out of range: RANK {RANK}, WORLD_SIZE "
                         "{WORLD_SIZE}, LOCAL_RANK {LOCAL_RANK}, LOCAL_WORLD_SIZE "
                         "{LOCAL_WORLD_SIZE}".format(**env))
    return env


def check_data_parallel_device(device_type: str, local_ranks: int) -> None:
    """Raise ValueError unless `local_ranks` data-parallel ranks per machine can train on
    `device_type`: cpu (gloo), or cuda (nccl, one CUDA device per rank)."""
    if device_type not in BACKENDS:
        raise ValueError(f"data-parallel training runs on {' or '.join(BACKENDS)}, not "
                         f"{device_type}")
    if device_type == "cuda" and torch.cuda.device_count() < local_ranks:
        raise ValueError(f"{local_ranks} ranks per machine on cuda need one CUDA device each; "
                         f"this machine has {torch.cuda.device_count()}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def process_group(env: dict | None, device_type: str) -> Iterator[DataParallel | None]:
    """Join the data-parallel run described by `env` (`launcher_env`) for the block, or yield
    None when `env` is None (one process, nothing changed).

    Before joining: torch's intra-op threads become max(1, cores // LOCAL_WORLD_SIZE) (cores:
    this process's CPU affinity set) unless OMP_NUM_THREADS is set (torchrun sets it to 1 when
    unset and it starts more than one process per machine; `cotangent train --nproc` does
    not); on cuda the current device becomes cuda:LOCAL_RANK. The default process group
    (gloo on cpu, nccl on cuda, rendezvous through MASTER_ADDR:MASTER_PORT) is destroyed when
    the block ends, also on an error.

    Raises:
        ValueError: a device type without a backend here, or too few CUDA devices.
    """
    if env is None:
        yield None
        return
    check_data_parallel_device(device_type, env["LOCAL_WORLD_SIZE"])
    if "OMP_NUM_THREADS" in os.environ:
        threads_from = "OMP_NUM_THREADS"
    else:
        torch.set_num_threads(max(1, _cores() // env["LOCAL_WORLD_SIZE"]))
        threads_from = "cores // local ranks"
    backend = BACKENDS[device_type]
    if device_type == "cuda":
        torch.cuda.set_device(env["LOCAL_RANK"])
    dist.init_process_group(backend, rank=env["RANK"], world_size=env["WORLD_SIZE"])
    try:
        yield DataParallel(rank=env["RANK"], world_size=env["WORLD_SIZE"],
                           local_rank=env["LOCAL_RANK"],
                           local_world_size=env["LOCAL_WORLD_SIZE"], backend=backend,
                           threads=torch.get_num_threads(), threads_from=threads_from)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------


class Arm:
    """One arm's model, optimizer and update phase.

    With `data_parallel`, `forward` is the model wrapped in `DistributedDataParallel` (after
    the optimizer is built over the unwrapped model's parameters); `model` stays the unwrapped
    model, which the clip, the evaluation and the hashes use.

    A study arm (`STUDY_ARMS`) has `aggregator` (P, A, AP, PA; else None) and, after each
    update phase, its diagnostics in `occurrence` (`OCCURRENCE_KEYS`; None for U and S).
    `lr_group` is the param group whose lr the curve records (a study arm's first Muon group).
    """

    def __init__(self, name: str, cfg: TrainConfig, device: torch.device,
                 data_parallel: DataParallel | None = None) -> None:
        if name not in TRAIN_ARMS:
            raise ValueError(f"unknown arm {name!r}; known: {', '.join(TRAIN_ARMS)}")
        if name == "cotangent-zero1" and data_parallel is None:
            raise ValueError("the cotangent-zero1 arm shards the optimizer state over ranks: "
                             "run it data-parallel (--nproc N or torchrun)")
        if name in FSDP2_ARMS and data_parallel is None:
            raise ValueError(f"the {name} arm shards the model over ranks (fully_shard): run "
                             "it data-parallel (--nproc N or torchrun)")
        if name in FSDP2_ARMS and cfg.compile:
            raise ValueError(f"the {name} arm does not run under torch.compile here: leave "
                             "compile off")
        check_study_arms([name], cfg.model)
        self.name = name
        self.fsdp2 = False
        self.update = None
        self.aggregator = None
        self.occurrence: dict | None = None
        self.lr_group = 0
        if name in STUDY_ARMS:
            if data_parallel is not None:
                raise ValueError(f"the study arms ({', '.join(STUDY_ARMS)}) run in one process, "
                                 "not data-parallel")
            self._build_study(name, cfg, device)
            self.forward = self.model
            if cfg.compile:  # after packing: MuonAdamW moves the matrices' storage
                self.forward = torch.compile(self.forward)
            return
        self.model = build_model(cfg.model, cfg.seed).to(device)
        self.init_sha256 = records.model_sha256(self.model)
        self.fsdp2 = name in FSDP2_ARMS
        if self.fsdp2:  # every parameter a DTensor, this rank's shard local
            shard_fsdp2(self.model)
        params = list(self.model.parameters())
        self.forward = self.model
        kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  fused=True)
        if name in ("native", "native-fsdp2"):
            self.update = cotangent.ReferenceUpdate(params, max_norm=cfg.max_norm, **kw)
            self.optimizer = self.update.optimizer
        elif name == "batched-norms-only":
            self.update = BatchedNormsOnly(params, max_norm=cfg.max_norm, **kw)
            self.optimizer = self.update.optimizer
        else:
            # cotangent-zero1: each rank keeps the AdamW state of its share (ZeRO-1);
            # packing-only / packed: the packed design without / with batched norms
            if name in ("packing-only", "packed"):
                self.optimizer = PackedAdamW(
                    params, max_norm=cfg.max_norm, batched_norms=name == "packed", **kw)
            else:
                self.optimizer = cotangent.AdamW(
                    params, max_norm=cfg.max_norm,
                    shard="zero1" if name == "cotangent-zero1" else None, **kw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.steps))
        if data_parallel is not None and not self.fsdp2:  # gradients averaged in backward
            self.forward = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if cfg.compile:  # after packing: PackedAdamW moves parameter storage
            self.forward = torch.compile(self.forward)

    def _build_study(self, name: str, cfg: TrainConfig, device: torch.device) -> None:
        """The study arm's model variant, aggregator, MuonAdamW and schedule."""
        from cotangent.occurrence import OccurrenceAggregator

        sharing, mode = STUDY_ARMS[name]
        self.model = build_model(cfg.model, cfg.seed, sharing=sharing).to(device)
        self.init_sha256 = records.model_sha256(self.model)
        muon_params = self.model.matrix_parameters()
        if mode is not None:  # its pooled leaves join the optimizer
            self.aggregator = OccurrenceAggregator(self.model.occurrence_groups(), mode)
            muon_params += self.aggregator.pooled_leaves()
        self.optimizer = cotangent.MuonAdamW(
            [{"params": [self.model.tok_emb.weight], "lr": cfg.muon_embedding_lr},
             {"params": [self.model.head.weight], "lr": cfg.muon_head_lr}],
            muon_params, adamw_betas=cfg.muon_adamw_betas, adamw_eps=cfg.muon_adamw_eps,
            adamw_weight_decay=cfg.muon_adamw_weight_decay, muon_lr=cfg.muon_lr,
            muon_momentum=cfg.muon_momentum, muon_ns_steps=cfg.muon_ns_steps,
            muon_beta2=cfg.muon_beta2, muon_weight_decay=cfg.muon_weight_decay,
            compile=cfg.muon_compile)
        self.lr_group = next(i for i, g in enumerate(self.optimizer.param_groups)
                             if g["kind"] == "muon")
        # every group's lr: its own peak (initial_lr) * lr_factor, as for the bitwise arms
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.steps))

    def eval_parallel(self, dp: DataParallel | None) -> DataParallel | None:
        """What `evaluate_bpb` gets as `data_parallel` for this arm: `dp`, except for an FSDP2
        arm, whose sharded forward (its all-gathers) must run alike on every rank: there every
        rank evaluates every window (None)."""
        return None if self.fsdp2 else dp

    def state_sha256(self) -> str:
        """The model's SHA-256 now (`records.model_sha256`); an FSDP2 arm's over its full
        parameters, each gathered from every rank (a collective: every rank calls it)."""
        if not self.fsdp2:
            return records.model_sha256(self.model)
        from cotangent import dtensor

        return records.state_sha256({k: v.full_tensor() if dtensor.is_dtensor(v) else v
                                     for k, v in self.model.state_dict().items()})

    def study_record(self) -> dict | None:
        """metadata.json's `study` entry (None for a bitwise arm)."""
        if self.name not in STUDY_ARMS:
            return None
        sharing, mode = STUDY_ARMS[self.name]
        groups = self.optimizer.param_groups
        muon = [p for g in groups if g["kind"] == "muon" for p in g["params"]]
        return {"sharing": sharing, "occurrence_mode": mode,
                "optimizer": "cotangent.MuonAdamW(compile="
                             f"{bool(self.optimizer.compile)})",
                "muon_groups": [list(g["params"][0].shape) for g in groups
                                if g["kind"] == "muon"],
                "muon_tensors": len(muon), "muon_parameters": sum(p.numel() for p in muon),
                "pooled_leaves": 0 if self.aggregator is None
                else len(self.aggregator.pooled_leaves()),
                "gradient_clipping": None,
                "update_phase": "gradient norm (recorded, not clipped)"
                                + (", aggregator.before_step" if self.aggregator else "")
                                + ", MuonAdamW.step"
                                + (", aggregator.after_step" if self.aggregator else "")
                                + ", zero_grad(set_to_none=True)"}

    def update_phase(self) -> torch.Tensor:
        """Clip, step, zero_grad; returns the total gradient norm before clipping.

        A study arm: the L2 norm of every gradient the backward gave (replicas and shared
        leaves as they are, before any aggregation; nothing is clipped), then
        `aggregator.before_step()`, the MuonAdamW step, `aggregator.after_step()` (its
        diagnostics in `occurrence`) and zero_grad."""
        if self.name in STUDY_ARMS:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if self.aggregator is not None:
                self.aggregator.before_step()
            self.optimizer.step()
            if self.aggregator is not None:
                self.occurrence = self.aggregator.after_step()
            self.optimizer.zero_grad(set_to_none=True)
            return total
        if self.update is not None:
            total = self.update.step()
        else:
            self.optimizer.step()
            total = self.optimizer.last_total_norm
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def check_sync(self, row: dict) -> None:
        """Raise OccurrenceSyncError unless the step of curve row `row` left a replicated
        core's replicas equal (sync_error exactly 0.0); nothing for the other arms."""
        if self.aggregator is None:
            return
        error = row["sync_error"]
        if not error == 0.0:
            raise OccurrenceSyncError(
                f"arm {self.name}: the replicas of the recurrent core differ after update "
                f"{row['step']} (sync_error {error!r}, max |replica - replica 0|; must be 0.0): "
                "the run is stopped, its records stay INCOMPLETE")


def evaluate_bpb(model: torch.nn.Module, windows: torch.Tensor, *, batch: int,
                 device: torch.device, autocast,
                 data_parallel: DataParallel | None = None) -> tuple[float, int]:
    """Bits per byte over `windows` (N, T + 1): total next-byte NLL / targets / ln 2.

    With `data_parallel`, every rank must call it (collectively): rank r evaluates
    `torch.tensor_split(windows, world_size)[r]` with the unwrapped `model`, and every rank
    returns the same value, the NLL sums gathered and added in rank order (so the float64
    sum may round differently from one process's, never differently between arms or ranks).

    Returns:
        (bits per byte, number of targets), over all of `windows`.
    """
    if data_parallel is None:
        total_nll, targets = _nll_sum(model, windows, batch=batch, device=device,
                                      autocast=autocast)
    else:
        part = torch.tensor_split(windows, data_parallel.world_size)[data_parallel.rank]
        parts: list = [None] * data_parallel.world_size
        dist.all_gather_object(parts, _nll_sum(model, part, batch=batch, device=device,
                                                autocast=autocast))
        total_nll, targets = 0.0, 0
        for nll, n in parts:
            total_nll += nll
            targets += n
    return total_nll / targets * BITS_PER_NAT, targets


@torch.no_grad()
def _nll_sum(model: torch.nn.Module, windows: torch.Tensor, *, batch: int,
             device: torch.device, autocast) -> tuple[float, int]:
    """(total next-byte NLL in nats, number of targets) over `windows` (N, T + 1), `batch`
    windows per forward pass, the model in eval mode meanwhile."""
    model.eval()
    total_nll, targets = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        with autocast():
            logits = model(w[:, :-1])  # (b, T, 256)
        nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1),
                              reduction="sum")
        total_nll += nll.item()
        targets += w[:, 1:].numel()
    model.train()
    return total_nll, targets


def schedule_sha256(cfg: TrainConfig, arm: str | None = None) -> str:
    """SHA-256 of the learning rate of every update (repr of the floats, in order): the
    curve's `lr` column, `cfg.lr` scaled by `lr_factor`, or `cfg.muon_lr` for a study arm."""
    peak = cfg.muon_lr if arm in STUDY_ARMS else cfg.lr
    lrs = [peak * lr_factor(step, cfg.steps) for step in range(cfg.steps)]
    return hashlib.sha256(repr(lrs).encode()).hexdigest()


def run_train(cfg: TrainConfig, corpus: Corpus, *, show_progress: bool | None = None,
              log=print, config_toml: str | None = None, progress_every_s: float = 0.0,
              data_parallel: DataParallel | None = None,
              tensorboard: str | os.PathLike | None = None) -> dict:
    """Run `_run_train`; with `compile`, under `torch.use_deterministic_algorithms(True)`.

    Why: inductor's CPU code for the embedding backward accumulates in an order that depends
    on thread scheduling, so two compiled copies of the same native model gave different
    gradients here (2 threads); deterministic mode makes it reproducible, so the arms can be
    compared bit for bit.

    `show_progress`: a tqdm bar on stderr (default None: tqdm's `disable=None`, a bar only
    when stderr is a terminal).
    `progress_every_s`: when > 0, one plain progress line through `log` at most every this
    many seconds of the training loop, and one after the last step (`progress_line`); the
    CLI turns it on when stdout is not a terminal.
    `data_parallel`: this rank's place in a data-parallel run (`process_group`); every rank
    calls `run_train` with the same arguments; only rank 0 writes records.
    `tensorboard`: a directory; every curve row (steps and probes) is also written as
    TensorBoard scalars (`TensorBoardCurves`), one run subdirectory per arm,
    `tensorboard/<run directory name>/<arm>` (rank 0 only). An extra output: the records
    stay the evidence, and nothing reads the event files back.

    Raises:
        ValueError: `tensorboard` given and the tensorboard package not installed (one line
            naming the extra; checked before anything is built or written), and the errors of
            `_run_train`.
    """
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        if cfg.compile:
            torch.use_deterministic_algorithms(True)
        return _run_train(cfg, corpus, show_progress=show_progress, log=log,
                          config_toml=config_toml, progress_every_s=progress_every_s,
                          data_parallel=data_parallel, tensorboard=tensorboard)
    finally:
        torch.use_deterministic_algorithms(previous)


def _run_train(cfg: TrainConfig, corpus: Corpus, *, show_progress: bool | None, log,
               config_toml: str | None, progress_every_s: float = 0.0,
               data_parallel: DataParallel | None = None,
               tensorboard: str | os.PathLike | None = None) -> dict:
    """Train the arms interleaved, probe, evaluate, write records; returns the comparison dict.

    Each arm's run directory holds `metadata.json` (written first), `curve.jsonl` and
    `summary.json`, each written atomically, and an `INCOMPLETE` marker that is removed only
    after the summary is written: a killed run stays marked incomplete. A run directory that
    already exists is never reused. In a data-parallel run only rank 0 writes them.

    The dict has `arms`, `identical_final_hash` (every bitwise arm ended with the same final
    model SHA-256; vacuously true with fewer than two: the study arms' hashes are recorded,
    never compared), `study_arms` and, per arm, `update_ms` and `step_ms` (medians over
    steps), `val_bpb`, `test_bpb`, `final_model_sha256`, `run_dir` and the rest of the summary,
    including the machine-load record and timing flags of `cotangent.harness.contention`
    (`cpu_s`, `host_cpu_s`, ..., `step_outliers`, `busy`, `flagged`; replicated-core study
    arms: `max_sync_error`, `max_relative_norm_mismatch`). A study arm whose replicas differ
    after a step stops the run (`OccurrenceSyncError`, raised after that step's curve row is
    written). A data-parallel run adds `ranks_agree` (every rank ended with the same final
    model SHA-256 in every arm) and `data_parallel` (world_size, backend, ...); each arm's
    summary has `data_parallel` with the per-rank hashes.
    """
    t_start = time.perf_counter()
    dp = data_parallel
    writer = dp is None or dp.rank == 0
    summary_writer = tensorboard_writer_class() if tensorboard is not None else None
    device = torch.device(cfg.device)
    if dp is not None and device.type == "cuda":
        device = torch.device("cuda", dp.local_rank)
    precision = cfg.resolved_precision()
    if not cfg.arms or len(set(cfg.arms)) != len(cfg.arms):
        raise ValueError(f"arms must be distinct and at least one, got {cfg.arms}")
    stamp = [datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")]
    if dp is not None:  # every rank names rank 0's run directories
        dist.broadcast_object_list(stamp, src=0)
    run = _Run(cfg=cfg, device=device, autocast=_autocast(device, precision), t_start=t_start,
               root=Path(cfg.out) / f"{stamp[0]}-{cfg.model}-seed{cfg.seed}",
               data_parallel=dp)
    env = records.environment()
    arms = {name: Arm(name, cfg, device, dp) for name in cfg.arms}
    context = arms[cfg.arms[0]].model.cfg.context
    windows = _eval_windows(cfg, corpus, context)
    seed = rank_sampler_seed(cfg.seed, 0 if dp is None else dp.rank)
    samplers = {name: WindowSampler(corpus.splits["train"], seed=seed,
                                    batch_size=cfg.batch_size, context=context)
                for name in cfg.arms}
    counts = {name: _count(arm.model) for name, arm in arms.items()}
    if writer:
        _start_records(run, arms, corpus, env, precision, config_toml)
    for arm in arms.values():
        arm.optimizer.zero_grad(set_to_none=True)
    setup_s = time.perf_counter() - t_start
    if len(set(counts.values())) == 1:
        n_params, n_tensors = counts[cfg.arms[0]]
        size = f"{n_params:,} parameters, {n_tensors} tensors"
    else:  # study arms: the sharing variants differ
        size = "; ".join(f"{name} {n:,} parameters, {t} tensors"
                         for name, (n, t) in counts.items())
    log(f"training {cfg.model} ({size}) for {cfg.steps} "
        f"steps per arm on {device.type} in {precision}, arms interleaved: {', '.join(cfg.arms)}"
        + ("" if dp is None else
           f"; data-parallel: {dp.world_size} ranks ({dp.backend}), {dp.threads} torch "
           f"thread(s) and {cfg.batch_size} windows per step on each rank"))
    tb = None
    if summary_writer is not None and writer:
        tb = TensorBoardCurves(Path(tensorboard) / run.root.name, cfg.arms, summary_writer)
        log(f"tensorboard: {tb.root}")
    curves = _Curves(run.root, cfg.arms, write=writer, tensorboard=tb)
    try:
        with recompile_room(*(arm.optimizer for arm in arms.values()
                              if isinstance(arm.optimizer, cotangent.MuonAdamW))):
            load = _train_loop(run, arms, samplers, curves, windows["probe"],
                               show_progress if writer else False, log, progress_every_s)
    finally:  # also on Ctrl-C or an error: the event files hold every row written so far
        if tb is not None:
            tb.close()
    result: dict = {}
    log(f"evaluating the final models: {len(windows['valid'])} valid and "
        f"{len(windows['test'])} test windows per arm")
    for name, arm in arms.items():
        t_eval = time.perf_counter()
        result[name] = _summarize_arm(run, name, arm, curves, windows, load, setup_s)
        log(f"  {name}: valid {result[name]['val_bpb']:.4f} BPB, test "
            f"{result[name]['test_bpb']:.4f} BPB ({time.perf_counter() - t_eval:.1f} s)")
    if dp is not None:
        _compare_ranks(result, cfg.arms, dp)
    if writer:
        _finish_records(run, curves, result)
    result["arms"] = list(cfg.arms)
    result["study_arms"] = [name for name in cfg.arms if name in STUDY_ARMS]
    result["identical_final_hash"] = len(
        {result[name]["final_model_sha256"] for name in cfg.arms if name not in STUDY_ARMS}) <= 1
    return result


def _count(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, tensors) of `model`."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def canonical_sha256(model: torch.nn.Module) -> str | None:
    """A recurrent model's `canonical_state()` hashed as `records.model_sha256` hashes a state
    dict (the same for every sharing variant of one seed at init); None for other models."""
    if not hasattr(model, "canonical_state"):
        return None
    return records.state_sha256(model.canonical_state())


def _finish_records(run: _Run, curves: _Curves, result: dict) -> None:
    """Each arm's curve.jsonl and summary.json, then the removal of its INCOMPLETE marker."""
    for name in run.cfg.arms:
        curves.finish(name)
        records.write_json(run.root / name / "summary.json", result[name])
        (run.root / name / "INCOMPLETE").unlink()  # only now is the run complete


def _compare_ranks(result: dict, arms: tuple[str, ...], dp: DataParallel) -> None:
    """Gather every rank's final model hashes (collective); add each arm summary's
    `data_parallel` entry and the result's `ranks_agree` and `data_parallel`."""
    mine = {name: result[name]["final_model_sha256"] for name in arms}
    every: list = [None] * dp.world_size
    dist.all_gather_object(every, mine)
    agree = all(other == mine for other in every)
    for name in arms:
        hashes = [other[name] for other in every]
        result[name]["data_parallel"] = {
            "world_size": dp.world_size, "backend": dp.backend,
            "rank_final_model_sha256": hashes, "ranks_agree": len(set(hashes)) == 1,
            "timed_rank": 0, "busy_rule_threads": dp.threads * dp.local_world_size}
    result["ranks_agree"] = agree
    result["data_parallel"] = {"world_size": dp.world_size, "backend": dp.backend,
                               "threads_per_rank": dp.threads}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Run:
    """What every step of one `cotangent train` run shares."""

    cfg: TrainConfig
    device: torch.device
    autocast: Callable  # () -> the context manager of the forward passes
    root: Path  # parent of the arms' run directories
    t_start: float  # time.perf_counter() at the start of the run
    data_parallel: DataParallel | None = None  # None: this process alone


def _autocast(device: torch.device, precision: str) -> Callable:
    """The forward passes' context: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return autocast
    return nullcontext


def _eval_windows(cfg: TrainConfig, corpus: Corpus, context: int) -> dict:
    """The valid, test and (with eval_every) probe windows, built before training so that a
    split too short for `context` fails now, not after training."""
    tail = corpus.splits["train"][int(len(corpus.splits["train"]) * TRAIN_FRACTION):]
    return {"valid": eval_windows(corpus.splits["valid"], context, cfg.val_bytes),
            "test": eval_windows(corpus.splits["test"], context, cfg.val_bytes),
            "probe": eval_windows(tail, context, cfg.probe_bytes) if cfg.eval_every > 0
            else None}


def _start_records(run: _Run, arms: dict[str, Arm], corpus: Corpus, env: dict, precision: str,
                   config_toml: str | None) -> None:
    """Create each arm's run directory (never an existing one) with its INCOMPLETE marker,
    metadata.json and config.toml. A recurrent model's metadata adds
    `init_canonical_sha256` (`canonical_sha256`: equal for every arm of one seed, whatever the
    sharing); a study arm's adds `study` (`Arm.study_record`) and has no `native_path`."""
    cfg = run.cfg
    dp = run.data_parallel
    for name, arm in arms.items():
        run_dir = run.root / name
        run_dir.mkdir(parents=True, exist_ok=False)  # never reuse or overwrite a run
        records.write_atomic(run_dir / "INCOMPLETE", "this run has not finished\n")
        n_params, n_tensors = _count(arm.model)
        meta = {
            "arm": name,
            "config": asdict(cfg),
            "precision": precision,
            "seed": cfg.seed,
            "environment": env,
            "device_name": _device_name(run.device),
            "data": corpus.manifest(),
            "native_path": None if name in STUDY_ARMS else NATIVE_PATH,
            "parameters": n_params,
            "tensors": n_tensors,
            "init_model_sha256": arm.init_sha256,
            "schedule_sha256": schedule_sha256(cfg, name),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "command": sys.argv,
            "data_parallel": SINGLE_PROCESS_RECORD if dp is None else dp.record(),
        }
        if isinstance(arm.optimizer, PackedAdamW):
            meta["layout"] = arm.optimizer.layout_summary()
            meta["buckets"] = sum(layout["buckets"] for layout in meta["layout"])
        canonical = canonical_sha256(arm.model)
        if canonical is not None:
            meta["init_canonical_sha256"] = canonical
        if name in STUDY_ARMS:
            meta["study"] = arm.study_record()
        records.write_json(run_dir / "metadata.json", meta)
        if config_toml is not None:
            records.write_atomic(run_dir / "config.toml", config_toml + "\n")


TENSORBOARD_EXTRA = "pip install 'cotangent[tensorboard]'"
# Curve-row keys that are not TensorBoard scalars: `step` is the global step, `probe` the
# probe's index; non-numbers (autograd_order: true, false or null) are left out too.
TENSORBOARD_SKIP = ("step", "probe")


def tensorboard_writer_class() -> type:
    """`torch.utils.tensorboard.SummaryWriter`, imported now.

    Raises:
        ValueError: one line naming the `tensorboard` extra when the tensorboard package is
            not installed (or too old for torch).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        why = (f"{exc.name} is not installed" if isinstance(exc, ModuleNotFoundError)
               and exc.name else str(exc).splitlines()[0])
        raise ValueError(f"--tensorboard needs the tensorboard extra ({why}): "
                         f"{TENSORBOARD_EXTRA}") from None
    return SummaryWriter


class TensorBoardCurves:
    """Curve rows as TensorBoard scalars: one `SummaryWriter` (event file) per arm, in
    `root/<arm>`.

    Each row's numbers (int or float, not bool) become scalars whose tag is the curve key
    itself, with its unit (`loss_bpb`: bits per byte, `lr`, `grad_norm`, `step_s`, `update_s`,
    `cpu_s`, `host_cpu_s`, `host_steal_s` in seconds; probes: `probe_bpb`, `training_s`,
    `elapsed_s`; study arms: the `OCCURRENCE_KEYS` numbers), at global_step = the row's `step`
    (a step row: the update's 0-based index; a probe row: the updates done). TensorBoard
    stores float32 (`simple_value`): each scalar is float32(the curve value), rounded to
    nearest. Written as the rows come, so the event files match curve.partial.jsonl (a run
    that drops its partial host columns from curve.jsonl keeps them here). Never read back.
    """

    def __init__(self, root: Path, names: tuple[str, ...], writer_class: type) -> None:
        self.root = Path(root)
        self.writers = {name: writer_class(log_dir=str(self.root / name), flush_secs=10)
                        for name in names}

    def add(self, name: str, row: dict) -> None:
        """Write the numbers of arm `name`'s curve row `row` at global_step `row["step"]`."""
        writer = self.writers[name]
        for key, value in row.items():
            if (key in TENSORBOARD_SKIP or isinstance(value, bool)
                    or not isinstance(value, (int, float))):
                continue
            writer.add_scalar(key, value, global_step=row["step"])

    def close(self) -> None:
        """Flush and close every arm's event file (each one, even if another fails)."""
        errors = []
        for writer in self.writers.values():
            try:
                writer.close()
            except Exception as exc:  # close the others first
                errors.append(exc)
        if errors:
            raise errors[0]


class _Curves:
    """Each arm's curve rows (steps and probes) in memory and, one flushed line each, in its
    run directory's curve.partial.jsonl, so a killed run keeps its curve; `finish` replaces
    that file by curve.jsonl, written atomically. With `write` False (a data-parallel rank
    other than 0) the rows stay in memory only. With `tensorboard`, each row is also given to
    it as it is written (`TensorBoardCurves.add`)."""

    def __init__(self, root: Path, names: tuple[str, ...], *, write: bool = True,
                 tensorboard: TensorBoardCurves | None = None) -> None:
        self.root = root
        self.tensorboard = tensorboard
        self.rows: dict[str, list[dict]] = {name: [] for name in names}
        self.probes: dict[str, list[dict]] = {name: [] for name in names}
        self.trained_s = {name: 0.0 for name in names}  # sum of the arm's step_s so far
        self._partial = {name: open(root / name / "curve.partial.jsonl", "a", encoding="utf-8")
                         for name in names} if write else None

    def add(self, name: str, row: dict) -> None:
        """Record one row of arm `name` (a step row has step_s, a probe row probe_bpb)."""
        if "probe_bpb" in row:
            self.probes[name].append(row)
        else:
            self.trained_s[name] += row["step_s"]
        self.rows[name].append(row)
        if self._partial is not None:
            self._partial[name].write(json.dumps(row, sort_keys=True) + "\n")
            self._partial[name].flush()
        if self.tensorboard is not None:
            self.tensorboard.add(name, row)

    def finish(self, name: str) -> None:
        """Write arm `name`'s curve.jsonl and remove its curve.partial.jsonl (`write` only)."""
        run_dir = self.root / name
        self._partial[name].close()
        records.write_jsonl(run_dir / "curve.jsonl", self.rows[name])
        (run_dir / "curve.partial.jsonl").unlink()


def _train_loop(run: _Run, arms: dict[str, Arm], samplers: dict[str, WindowSampler],
                curves: _Curves, probe: torch.Tensor | None, show_progress: bool | None, log,
                progress_every_s: float) -> dict:
    """Step i of every arm before step i + 1 (their order alternating), a probe every
    eval_every steps, a progress line every `progress_every_s` seconds, a tqdm bar on stderr
    when `show_progress` (None: only when stderr is a terminal); returns the load
    record around the loop (`host`: the HostSampler, `threads`, 1-minute load averages)."""
    cfg = run.cfg
    host = contention.HostSampler()
    threads = torch.get_num_threads()
    load_start = contention.load_average_1m()
    loop_start = last_line = time.perf_counter()
    since_line: dict[str, list[dict]] = {name: [] for name in cfg.arms}
    order = list(cfg.arms)
    # show_progress None: tqdm's disable=None, a bar only when its stream (stderr) is a terminal
    bar = tqdm(range(cfg.steps), disable=None if show_progress is None else not show_progress,
               desc="steps", unit="step")
    for step in bar:
        for name in order:
            row = _train_step(run, arms[name], samplers[name], step, host)
            curves.add(name, row)
            arms[name].check_sync(row)  # after the row is on disk (curve.partial.jsonl)
            since_line[name].append(row)
            if probe is not None and (step + 1) % cfg.eval_every == 0:
                bpb, _ = evaluate_bpb(arms[name].model, probe, batch=cfg.eval_batch,
                                      device=run.device, autocast=run.autocast,
                                      data_parallel=arms[name].eval_parallel(run.data_parallel))
                curves.add(name, {"probe": len(curves.probes[name]), "step": step + 1,
                                  "probe_bpb": bpb, "training_s": curves.trained_s[name],
                                  "elapsed_s": time.perf_counter() - run.t_start})
        order.reverse()
        now = time.perf_counter()
        if progress_every_s > 0 and (now - last_line >= progress_every_s
                                     or step == cfg.steps - 1):
            log(progress_line(step + 1, cfg.steps, now - loop_start, since_line))
            since_line = {name: [] for name in cfg.arms}
            last_line = now
    return {"host": host, "threads": threads, "load_avg_1m_start": load_start,
            "load_avg_1m_end": contention.load_average_1m()}


def _train_step(run: _Run, arm: Arm, sampler: WindowSampler, step: int,
                host: contention.HostSampler) -> dict:
    """One timed step of one arm (forward, backward, update phase; then the LR schedule);
    returns its curve row: loss in bits per byte, lr, gradient norm, step_s, update_s and the
    machine load (cpu_s; host_cpu_s, host_steal_s where measured); a replicated-core study arm
    adds the occurrence diagnostics (`OCCURRENCE_KEYS`).

    Data parallel (collective): loss_bpb is the mean over ranks of each rank's batch loss and
    cpu_s the CPU seconds of every rank on rank 0's machine (so that the contention rules do
    not count this run's own ranks as other work); step_s and update_s are this rank's."""
    device = run.device
    batch = sampler.next_batch().to(device)
    lr = arm.optimizer.param_groups[arm.lr_group]["lr"]
    sync(device)
    # Machine load around the step, read outside the timed region.
    h0 = host.sample()
    c0 = time.process_time()
    t0 = time.perf_counter()
    with run.autocast():
        logits = arm.forward(batch[:, :-1])  # (B, T, 256)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    loss.backward()
    sync(device)
    t1 = time.perf_counter()
    total = arm.update_phase()
    sync(device)
    t2 = time.perf_counter()
    c1 = time.process_time()
    h1 = host.sample()
    arm.scheduler.step()
    loss_nats, cpu_s = _across_ranks(run.data_parallel, loss.item(), c1 - c0)
    row = {"step": step, "loss_bpb": loss_nats * BITS_PER_NAT, "lr": lr,
           "grad_norm": total.item(), "step_s": t2 - t0, "update_s": t2 - t1, "cpu_s": cpu_s}
    if h0 is not None and h1 is not None:
        row["host_cpu_s"] = h1[0] - h0[0]
        row["host_steal_s"] = h1[1] - h0[1]
    if arm.occurrence is not None:
        row.update({key: arm.occurrence[key] for key in OCCURRENCE_KEYS})
    return row


def _across_ranks(dp: DataParallel | None, loss: float, cpu_s: float) -> tuple[float, float]:
    """(loss, cpu_s) unchanged in one process; data parallel (collective, one float64
    all_reduce, outside the timed region): (mean loss over ranks, the CPU seconds summed over
    the ranks on rank 0's machine)."""
    if dp is None:
        return loss, cpu_s
    device = torch.device("cuda", dp.local_rank) if dp.backend == "nccl" else torch.device("cpu")
    both = torch.tensor([loss, cpu_s if dp.on_rank0_host else 0.0], dtype=torch.float64,
                        device=device)
    dist.all_reduce(both)
    total_loss, host_cpu_s = both.tolist()
    return total_loss / dp.world_size, host_cpu_s


def _summarize_arm(run: _Run, name: str, arm: Arm, curves: _Curves, windows: dict, load: dict,
                   setup_s: float) -> dict:
    """Evaluate arm `name`'s final model on valid and test, and summarize its steps: medians
    and sums of the times, BPB, final hash, machine load and timing flags (summary.json); a
    replicated-core study arm adds `max_sync_error` and `max_relative_norm_mismatch` over its
    steps. A run whose host load was not measured at every step drops the partial host
    columns."""
    cfg, device, dp = run.cfg, run.device, run.data_parallel
    val_bpb, val_targets = evaluate_bpb(arm.model, windows["valid"], batch=cfg.eval_batch,
                                        device=device, autocast=run.autocast,
                                        data_parallel=arm.eval_parallel(dp))
    test_bpb, test_targets = evaluate_bpb(arm.model, windows["test"], batch=cfg.eval_batch,
                                          device=device, autocast=run.autocast,
                                          data_parallel=arm.eval_parallel(dp))
    steps = [r for r in curves.rows[name] if "loss_bpb" in r]
    step_s = [r["step_s"] for r in steps]
    update_s = [r["update_s"] for r in steps]
    cpu_s = [r["cpu_s"] for r in steps]
    measured = all("host_cpu_s" in r for r in steps)
    if not measured:  # /proc/stat failed for some step: the run's load is not measured
        for r in steps:
            r.pop("host_cpu_s", None)
            r.pop("host_steal_s", None)
    host_cpu_s = [r["host_cpu_s"] for r in steps] if measured else None
    host_cpus = load["host"].cpus if measured else None
    # Data parallel: cpu_s covers every rank on rank 0's machine, so do the threads.
    threads = load["threads"] * (1 if dp is None else dp.local_world_size)
    flags = contention.assess(step_s, cpu_s, host_cpu_s, host_cpus, threads)
    occurrence = {}
    if arm.aggregator is not None:
        occurrence = {"max_sync_error": max(r["sync_error"] for r in steps),
                      "max_relative_norm_mismatch": max(r["relative_norm_mismatch"]
                                                        for r in steps)}
    return {
        "arm": name,
        "steps": cfg.steps,
        "update_ms": 1e3 * statistics.median(update_s),
        "step_ms": 1e3 * statistics.median(step_s),
        "update_ms_mean": 1e3 * statistics.fmean(update_s),
        "step_ms_mean": 1e3 * statistics.fmean(step_s),
        "setup_s": setup_s,
        "training_s": sum(step_s),
        "update_s": sum(update_s),
        "total_s": time.perf_counter() - run.t_start,
        "probes": curves.probes[name],
        "final_loss_bpb": steps[-1]["loss_bpb"],
        "val_bpb": val_bpb,
        "val_targets": val_targets,
        "test_bpb": test_bpb,
        "test_targets": test_targets,
        "final_model_sha256": arm.state_sha256(),
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "run_dir": str(run.root / name),
        # machine load while the steps were timed, and the timing flags (contention.py)
        "cpu_s": sum(cpu_s),
        "host_cpu_s": sum(host_cpu_s) if measured else None,
        "host_steal_s": sum(r["host_steal_s"] for r in steps) if measured else None,
        "host_cpus": host_cpus,
        "threads": load["threads"],
        "load_avg_1m_start": load["load_avg_1m_start"],
        "load_avg_1m_end": load["load_avg_1m_end"],
        **{k: v for k, v in flags.items() if k != "median_step_s"},
        **occurrence,
    }


def progress_line(done: int, steps: int, elapsed_s: float, rows: dict[str, list[dict]]) -> str:
    """One plain progress line: steps done, seconds of the training loop so far and the
    estimated seconds left, each arm's median step time (ms) over the `rows` since the last
    line, and how many CPUs other work kept busy meanwhile (when measured)."""
    eta = elapsed_s / done * (steps - done)
    parts = [f"step {done}/{steps} ({100 * done / steps:.0f}%), {elapsed_s:.1f} s, "
             f"ETA {eta:.0f} s"]
    medians = [f"{name} {1e3 * statistics.median(r['step_s'] for r in arm_rows):.1f}"
               for name, arm_rows in rows.items() if arm_rows]
    if medians:
        parts.append("median step ms " + ", ".join(medians))
    flat = [r for arm_rows in rows.values() for r in arm_rows]
    wall = sum(r["step_s"] for r in flat)
    if flat and wall > 0 and all("host_cpu_s" in r for r in flat):
        others = (sum(r["host_cpu_s"] for r in flat) - sum(r["cpu_s"] for r in flat)) / wall
        parts.append(f"other work {others:.2f} CPUs")
    return "progress: " + "; ".join(parts)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine()


def format_config(cfg: TrainConfig) -> str:
    """The resolved config as TOML lines (loadable again with --config)."""
    lines = []
    for key, value in asdict(cfg).items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (tuple, list)):
            text = json.dumps(list(value))
        else:
            text = json.dumps(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines)


def format_comparison(result: dict) -> str:
    """Human-readable comparison table of `run_train`'s result (a data-parallel run adds
    whether every rank ended with the same hashes). Only the bitwise arms are compared by
    hash; the study arms are listed as such, the replicated-core ones with their largest
    sync_error and relative_norm_mismatch."""
    arms = result["arms"]
    lines = [f"{'arm':<19} {'update_ms':>10} {'step_ms':>9} {'val_bpb':>8} {'test_bpb':>8}  "
             "final_model_sha256"]
    for name in arms:
        r = result[name]
        lines.append(f"{name:<19} {r['update_ms']:>10.2f} {r['step_ms']:>9.1f} "
                     f"{r['val_bpb']:>8.4f} {r['test_bpb']:>8.4f}  {r['final_model_sha256']}")
    base = result[arms[0]]
    study = [name for name in arms if name in STUDY_ARMS]
    bitwise = [name for name in arms if name not in STUDY_ARMS]
    if len(arms) == 1:
        lines.append("one arm: no comparison")
    elif len(bitwise) > 1:
        which = f" ({', '.join(bitwise)})" if study else ""
        lines.append(f"identical final model SHA-256{which}: "
                     f"{'yes' if result['identical_final_hash'] else 'NO'}")
    if study:
        lines.append(f"study arms {', '.join(study)}: final hashes recorded, not required to "
                     "agree (an occurrence-aggregation study, not a bitwise family)")
    for name in study:
        r = result[name]
        if "max_sync_error" in r:
            lines.append(f"{name}: replicas in sync after every step (max sync_error "
                         f"{r['max_sync_error']!r}), max relative_norm_mismatch "
                         f"{r['max_relative_norm_mismatch']:.3g}")
    dp = result.get("data_parallel")
    if dp is not None:
        lines.append(f"same final model SHA-256 on all {dp['world_size']} ranks "
                     f"({dp['backend']}): {'yes' if result['ranks_agree'] else 'NO'}; "
                     "the times are rank 0's")
    for name in arms[1:]:
        r = result[name]
        lines.append(f"{name} / {arms[0]} (medians per step): update phase "
                     f"{r['update_ms'] / base['update_ms']:.3f}, whole step "
                     f"{r['step_ms'] / base['step_ms']:.3f}")
    for name in arms:
        r = result[name]
        for reason in contention.reasons({**r, "median_step_s": r["step_ms"] / 1e3},
                                         r["host_cpus"]):
            lines.append(f"WARNING: {name}: {reason}; its times may not reflect the code")
    lines.append(f"records: {Path(base['run_dir']).parent}")
    return "\n".join(lines)


def result_json(result: dict) -> str:
    """One-line JSON of the comparison (the last line of `cotangent train --json`); a
    data-parallel run adds `ranks_agree` and `data_parallel` (world_size, backend,
    threads_per_rank); study arms add `study_arms` and, replicated-core ones,
    `max_sync_error` and `max_relative_norm_mismatch` in their entries."""
    keys = ("update_ms", "step_ms", "val_bpb", "test_bpb", "final_model_sha256", "run_dir",
            "max_sync_error", "max_relative_norm_mismatch")
    obj = {"identical_final_hash": result["identical_final_hash"]}
    obj.update({name: {k: result[name][k] for k in keys if k in result[name]}
                for name in result["arms"]})
    if result.get("study_arms"):
        obj["study_arms"] = result["study_arms"]
    if "data_parallel" in result:
        obj["ranks_agree"] = result["ranks_agree"]
        obj["data_parallel"] = result["data_parallel"]
    return json.dumps(obj, sort_keys=True)


def end_rank_process(code: int) -> None:
    """End this data-parallel rank's process with exit status `code`, skipping the
    interpreter's teardown (`os._exit` after flushing logging, stdout and stderr).

    Why: `DistributedDataParallel`'s reducer keeps the gloo process group alive after
    `destroy_process_group` (torch 2.13 here), so its worker threads outlive the Python code. A
    worker that releases the tensors of a finished collective while the interpreter shuts down
    needs the GIL and aborts the process (SIGABRT, "terminate called without an active
    exception"): seen in about 1 of 20 two-rank runs on a busy 2-core machine, always after the
    run's records were complete. Records are written atomically and the calibration cache
    synchronously, so nothing is lost by skipping the teardown.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
