"""The `cotangent train` loop: the arms trained interleaved, step by step, then evaluated
(`run_train`)."""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import cotangent
from cotangent import singlepass
from cotangent.muon_adamw import recompile_room
from cotangent.harness import contention, records
from cotangent.harness.data import (
    BITS_PER_NAT,
    TRAIN_FRACTION,
    Corpus,
    WindowSampler,
    eval_windows,
)
from cotangent.harness.train import arm_setup, config, distributed, run_records


def evaluate_bpb(model: torch.nn.Module, windows: torch.Tensor, *, batch: int,
                 device: torch.device, autocast,
                 data_parallel: distributed.DataParallel | None = None) -> tuple[float, int]:
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


def run_train(cfg: config.TrainConfig, corpus: Corpus, *, show_progress: bool | None = None,
              log=print, config_toml: str | None = None, progress_every_s: float = 0.0,
              data_parallel: distributed.DataParallel | None = None,
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
        if cfg.model.compile:
            torch.use_deterministic_algorithms(True)
        return _run_train(cfg, corpus, show_progress=show_progress, log=log,
                          config_toml=config_toml, progress_every_s=progress_every_s,
                          data_parallel=data_parallel, tensorboard=tensorboard)
    finally:
        torch.use_deterministic_algorithms(previous)


def _run_train(cfg: config.TrainConfig, corpus: Corpus, *, show_progress: bool | None, log,
               config_toml: str | None, progress_every_s: float = 0.0,
               data_parallel: distributed.DataParallel | None = None,
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
    summary_writer = run_records.tensorboard_writer_class() if tensorboard is not None else None
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
               root=Path(cfg.out) / f"{stamp[0]}-{cfg.model.name}-seed{cfg.seed}",
               data_parallel=dp)
    env = records.environment()
    arms = {name: arm_setup.Arm(name, cfg, device, dp) for name in cfg.arms}
    context = arms[cfg.arms[0]].model.cfg.context
    windows = _eval_windows(cfg, corpus, context)
    seed = distributed.rank_sampler_seed(cfg.seed, 0 if dp is None else dp.rank)
    samplers = {name: WindowSampler(corpus.splits["train"], seed=seed,
                                    batch_size=cfg.data.batch_size, context=context)
                for name in cfg.arms}
    counts = {name: run_records._count(arm.model) for name, arm in arms.items()}
    if writer:
        run_records._start_records(run, arms, corpus, env, precision, config_toml)
    for arm in arms.values():
        arm.optimizer.zero_grad(set_to_none=True)
    if any(name not in ("native", "native-fsdp2", *config.STUDY_ARMS) for name in cfg.arms):
        log(_single_pass_ready())
    setup_s = time.perf_counter() - t_start
    if len(set(counts.values())) == 1:
        n_params, n_tensors = counts[cfg.arms[0]]
        size = f"{n_params:,} parameters, {n_tensors} tensors"
    else:  # study arms: the sharing variants differ
        size = "; ".join(f"{name} {n:,} parameters, {t} tensors"
                         for name, (n, t) in counts.items())
    log(f"training {cfg.model.name} ({size}) for {cfg.steps} "
        f"steps per arm on {device.type} in {precision}, arms interleaved: {', '.join(cfg.arms)}"
        + ("" if dp is None else
           f"; data-parallel: {dp.world_size} ranks ({dp.backend}), {dp.threads} torch "
           f"thread(s) and {cfg.data.batch_size} windows per step on each rank"))
    tb = None
    if summary_writer is not None and writer:
        tb = run_records.TensorBoardCurves(Path(tensorboard) / run.root.name, cfg.arms,
                                           summary_writer)
        log(f"tensorboard: {tb.root}")
    curves = run_records._Curves(run.root, cfg.arms, write=writer, tensorboard=tb)
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
        distributed._compare_ranks(result, cfg.arms, dp)
    if writer:
        run_records._finish_records(run, curves, result)
    result["arms"] = list(cfg.arms)
    result["study_arms"] = [name for name in cfg.arms if name in config.STUDY_ARMS]
    result["identical_final_hash"] = len(
        {result[name]["final_model_sha256"] for name in cfg.arms
         if name not in config.STUDY_ARMS}) <= 1
    return result


@dataclass(frozen=True, kw_only=True, slots=True)
class _Run:
    """What every step of one `cotangent train` run shares."""

    cfg: config.TrainConfig
    device: torch.device
    autocast: Callable  # () -> the context manager of the forward passes
    root: Path  # parent of the arms' run directories
    t_start: float  # time.perf_counter() at the start of the run
    data_parallel: distributed.DataParallel | None = None  # None: this process alone


def _autocast(device: torch.device, precision: str) -> Callable:
    """The forward passes' context: bf16 autocast, or nothing for fp32."""
    if precision == "bf16":
        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return autocast
    return nullcontext


def _single_pass_ready() -> str:
    """Build or load the single-pass kernel and the list reader now, in the setup rather than
    in a Cotangent arm's first timed step (a first build takes about half a minute); one line
    saying which."""
    if not singlepass.switched_on():
        return f"single pass: switched off ({singlepass.ENV_SWITCH}=0): native's op sequence"
    reason = singlepass.unavailable_reason()  # (builds or loads both, once per process)
    if reason is not None:
        return f"single pass: unavailable ({reason}): native's op sequence"
    report = singlepass.process_report()
    build, lists = report["build"], report["list_reader"]
    built = ("loaded from the kernel cache" if build["cached"]
             else f"built in {build['compile_s']:.1f} s (first use; cached for later runs)")
    if lists is not None and lists["available"] and not lists["cached"]:
        built += f"; list reader built in {lists['compile_s']:.1f} s"
    return f"single pass: kernel {built}"


def _eval_windows(cfg: config.TrainConfig, corpus: Corpus, context: int) -> dict:
    """The valid, test and (with eval_every) probe windows, built before training so that a
    split too short for `context` fails now, not after training."""
    tail = corpus.splits["train"][int(len(corpus.splits["train"]) * TRAIN_FRACTION):]
    return {"valid": eval_windows(corpus.splits["valid"], context, cfg.eval.val_bytes),
            "test": eval_windows(corpus.splits["test"], context, cfg.eval.val_bytes),
            "probe": eval_windows(tail, context, cfg.eval.probe_bytes) if cfg.eval.every > 0
            else None}


def _train_loop(run: _Run, arms: dict[str, arm_setup.Arm], samplers: dict[str, WindowSampler],
                curves: run_records._Curves, probe: torch.Tensor | None,
                show_progress: bool | None, log, progress_every_s: float) -> dict:
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
            if probe is not None and (step + 1) % cfg.eval.every == 0:
                bpb, _ = evaluate_bpb(arms[name].model, probe, batch=cfg.eval.batch,
                                      device=run.device, autocast=run.autocast,
                                      data_parallel=arms[name].eval_parallel(run.data_parallel))
                curves.add(name, {"probe": len(curves.probes[name]), "step": step + 1,
                                  "probe_bpb": bpb, "training_s": curves.trained_s[name],
                                  "elapsed_s": time.perf_counter() - run.t_start})
        order.reverse()
        now = time.perf_counter()
        if progress_every_s > 0 and (now - last_line >= progress_every_s
                                     or step == cfg.steps - 1):
            log(run_records.progress_line(step + 1, cfg.steps, now - loop_start, since_line))
            since_line = {name: [] for name in cfg.arms}
            last_line = now
    return {"host": host, "threads": threads, "load_avg_1m_start": load_start,
            "load_avg_1m_end": contention.load_average_1m()}


def _train_step(run: _Run, arm: arm_setup.Arm, sampler: WindowSampler, step: int,
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
    config.sync(device)
    # Machine load around the step, read outside the timed region.
    h0 = host.sample()
    c0 = time.process_time()
    t0 = time.perf_counter()
    with run.autocast():
        logits = arm.forward(batch[:, :-1])  # (B, T, 256)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    loss.backward()
    config.sync(device)
    t1 = time.perf_counter()
    total = arm.update_phase()
    config.sync(device)
    t2 = time.perf_counter()
    c1 = time.process_time()
    h1 = host.sample()
    arm.scheduler.step()
    loss_nats, cpu_s = distributed._across_ranks(run.data_parallel, loss.item(), c1 - c0)
    row = {"step": step, "loss_bpb": loss_nats * BITS_PER_NAT, "lr": lr,
           "grad_norm": total.item(), "step_s": t2 - t0, "update_s": t2 - t1, "cpu_s": cpu_s}
    if h0 is not None and h1 is not None:
        row["host_cpu_s"] = h1[0] - h0[0]
        row["host_steal_s"] = h1[1] - h0[1]
    if arm.occurrence is not None:
        row.update({key: arm.occurrence[key] for key in config.OCCURRENCE_KEYS})
    return row


def _summarize_arm(run: _Run, name: str, arm: arm_setup.Arm, curves: run_records._Curves,
                   windows: dict, load: dict, setup_s: float) -> dict:
    """Evaluate arm `name`'s final model on valid and test, and summarize its steps: medians
    and sums of the times, BPB, final hash, machine load and timing flags (summary.json); a
    replicated-core study arm adds `max_sync_error` and `max_relative_norm_mismatch` over its
    steps. A run whose host load was not measured at every step drops the partial host
    columns."""
    cfg, device, dp = run.cfg, run.device, run.data_parallel
    val_bpb, val_targets = evaluate_bpb(arm.model, windows["valid"], batch=cfg.eval.batch,
                                        device=device, autocast=run.autocast,
                                        data_parallel=arm.eval_parallel(dp))
    test_bpb, test_targets = evaluate_bpb(arm.model, windows["test"], batch=cfg.eval.batch,
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
