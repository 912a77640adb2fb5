"""`cotangent bench --distributed N [--fsdp2]`: the update phase under DistributedDataParallel
(or FSDP2's `fully_shard`) on N ranks.

Four arms per (shape, native implementation), each with its own copy of the model wrapped in
`DistributedDataParallel`, alternating repeat by repeat (the order flips every repeat):

- ``native-ddp``: ``clip_grad_norm_(params, max_norm)`` + `torch.optim.AdamW`;
- ``cotangent-ddp``: `cotangent.AdamW(..., max_norm=max_norm)`;
- ``native-zero``: ``clip_grad_norm_`` + `torch.distributed.optim.ZeroRedundancyOptimizer`
  over `torch.optim.AdamW` (it broadcasts the updated parameters inside `step()`);
- ``cotangent-zero1``: `cotangent.AdamW(..., shard="zero1")` (broadcast inside `step()`).

Each repeat first runs a real DDP forward and backward (untimed): the module's output is
``sum_i (p_i * g_i).sum()`` for fixed rank-seeded tensors ``g_i``, so backward gives each rank
``g_i`` exactly and DDP's reducer averages them across ranks as in training. Then the update
(clip + step) is timed on every rank from a common start (a barrier); a step is as slow as its
slowest rank, so each repeat's time is the maximum over ranks. Medians over the repeats after
the warm-up ones.
`comm_ms` is the exposed communication of `cotangent-zero1`: the median time of its parameter
broadcast alone (`cotangent.sharding.broadcast_shares`, timed separately after the run).
Every row then checks that the four arms hold the same parameters, gradients and total norms
byte for byte, and reports the optimizer-state bytes each rank holds.

With ``--fsdp2``: two arms on fully_shard copies of the model (`shard_fsdp2`), native's clip +
AdamW on the DTensor parameters and `cotangent.AdamW`, after a real forward and backward of
each rank's batch (`_rank_row_fsdp2`), timed over the update and the whole iteration.
"""

from __future__ import annotations

import copy
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import cotangent
from cotangent import sharding
from cotangent.harness.bench import BENCH_ADAMW_ARGS, IMPLS, _same_bytes, bench_model
from cotangent.harness.model import shard_fsdp2
from cotangent.harness.records import environment
from cotangent.harness.train import end_rank_process
from cotangent.harness.packed import PackedAdamW

ARMS = ("native-ddp", "cotangent-ddp", "native-zero", "cotangent-zero1")
DISTRIBUTED_SHAPES = ("many-small", "transformer-small", "causal-conv", "gated-gqa")


class GradientSource(nn.Module):
    """Wraps a model so that a forward and backward through DDP deliver fixed gradients:
    ``forward()`` returns ``sum_i (p_i * g_i).sum()``, whose gradient for ``p_i`` is ``g_i``."""

    def __init__(self, model: nn.Module, grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.grads = grads

    def forward(self) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.model.parameters(), self.grads))


def _state_bytes(opt) -> int:
    if isinstance(opt, (cotangent.AdamW, PackedAdamW)):
        return opt.state_bytes()
    state = opt.optim.state if hasattr(opt, "optim") else opt.state
    return sum(v.numel() * v.element_size() for st in state.values() for v in st.values()
               if torch.is_tensor(v))


def _rank_row(shape: str, impl: str, *, repeats: int, warmup: int, max_norm: float) -> dict:
    """Run one row on this rank (a collective); returns this rank's measurements."""
    rank = dist.get_rank()
    base = bench_model(shape)
    gen = torch.Generator().manual_seed(1000 + rank)
    grads = [torch.randn(p.shape, generator=gen) * 0.01 for p in base.parameters()]
    kw = dict(BENCH_ADAMW_ARGS, **IMPLS[impl])
    arms = {}
    for name in ARMS:
        model = copy.deepcopy(base)
        ddp = nn.parallel.DistributedDataParallel(GradientSource(model, grads))
        params = list(model.parameters())
        if name == "native-ddp":
            opt = torch.optim.AdamW(params, **kw)
        elif name == "native-zero":
            opt = ZeroRedundancyOptimizer(params, torch.optim.AdamW, **kw)
        else:
            opt = cotangent.AdamW(params, max_norm=max_norm, **kw,
                                  shard="zero1" if name == "cotangent-zero1" else None)
        arms[name] = (ddp, params, opt)
    totals: dict[str, torch.Tensor] = {}
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    order = list(ARMS)
    for _ in range(warmup + repeats):
        for name in order:
            ddp, params, opt = arms[name]
            opt.zero_grad()
            ddp().backward()
            dist.barrier()
            t0 = time.perf_counter()
            if name.startswith("native"):
                totals[name] = torch.nn.utils.clip_grad_norm_(params, max_norm)
                opt.step()
            else:
                opt.step()
                totals[name] = opt.last_total_norm
            times[name].append(time.perf_counter() - t0)
            dist.barrier()  # no rank starts the next backward early
        order.reverse()
    bitwise = all(_same_bytes(totals[ARMS[0]], totals[name]) for name in ARMS[1:])
    reference = arms[ARMS[0]][1]
    for name in ARMS[1:]:
        for a, b in zip(reference, arms[name][1]):
            bitwise = bitwise and _same_bytes(a, b) and _same_bytes(a.grad, b.grad)
    ours = arms["cotangent-zero1"][2]
    shares = ours._shares
    comm = []
    for _ in range(warmup + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        sharding.broadcast_shares(shares.params, shares.shares, shares.zero)
        comm.append(time.perf_counter() - t0)
    return dict(
        times={name: t[warmup:] for name, t in times.items()}, comm=comm[warmup:],
        bitwise=bool(bitwise), params=sum(p.numel() for p in reference),
        tensors=len(reference), state_bytes={name: _state_bytes(arms[name][2]) for name in ARMS})


FSDP2_ARMS = ("native-fsdp2", "cotangent-fsdp2")


def _rank_row_fsdp2(shape: str, impl: str, *, repeats: int, warmup: int,
                    max_norm: float) -> dict:
    """One FSDP2 row on this rank (a collective): native ``clip_grad_norm_`` +
    `torch.optim.AdamW` on the DTensor parameters against `cotangent.AdamW(max_norm=...)`,
    each on its own fully_shard copy of the model; every repeat a real forward and backward
    (this rank's batch, the same for both arms), then the update (clip + step) timed from a
    barrier, then ``zero_grad``; returns this rank's times (update and whole iteration) and
    whether every loss, total norm, local parameter shard, local gradient shard and moment
    agreed byte for byte."""
    from cotangent import dtensor
    from cotangent.harness.bench import BATCH_SIZE, SEQ_LEN, bench_batches, bench_loss

    rank = dist.get_rank()
    base = bench_model(shape)
    batches = bench_batches(base, warmup + repeats, batch_size=BATCH_SIZE, seq_len=SEQ_LEN,
                            seed=2 + rank)
    kw = dict(BENCH_ADAMW_ARGS, **IMPLS[impl])
    arms = {}
    for name in FSDP2_ARMS:
        model = shard_fsdp2(copy.deepcopy(base))
        params = list(model.parameters())
        opt = (torch.optim.AdamW(params, **kw) if name == "native-fsdp2"
               else cotangent.AdamW(params, max_norm=max_norm, **kw))
        arms[name] = (model, params, opt)
    losses: dict[str, list] = {name: [] for name in FSDP2_ARMS}
    totals: dict[str, list] = {name: [] for name in FSDP2_ARMS}
    times = {name: {"update": [], "loop": []} for name in FSDP2_ARMS}
    order = list(FSDP2_ARMS)
    for i in range(warmup + repeats):
        for name in order:
            model, params, opt = arms[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = bench_loss(model, batches[i])
            loss.backward()
            dist.barrier()
            t1 = time.perf_counter()
            if name == "native-fsdp2":
                total = torch.nn.utils.clip_grad_norm_(params, max_norm)
                opt.step()
            else:
                opt.step()
                total = opt.last_total_norm
            t2 = time.perf_counter()
            times[name]["update"].append(t2 - t1)
            times[name]["loop"].append(t2 - t0)
            losses[name].append(loss.detach())
            totals[name].append(dtensor.local(total).clone())
            if name == "native-fsdp2":  # (the gradients compared below: the last step's)
                grads = [dtensor.local(p.grad).clone() for p in params]
            else:
                ours_grads = [dtensor.local(p.grad).clone() for p in params]
            opt.zero_grad()
        order.reverse()
    (_, p1, o1), (_, p2, o2) = arms["native-fsdp2"], arms["cotangent-fsdp2"]
    bitwise = all(_same_bytes(a, b) for a, b in zip(losses["native-fsdp2"],
                                                    losses["cotangent-fsdp2"]))
    bitwise &= all(_same_bytes(a, b) for a, b in zip(totals["native-fsdp2"],
                                                     totals["cotangent-fsdp2"]))
    bitwise &= all(_same_bytes(a, b) for a, b in zip(grads, ours_grads))
    for a, b in zip(p1, p2):
        bitwise &= _same_bytes(dtensor.local(a.detach()), dtensor.local(b.detach()))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            bitwise &= _same_bytes(dtensor.local(o1.state[a][key]), dtensor.local(o2.state[b][key]))
    return dict(times={name: {k: v[warmup:] for k, v in t.items()} for name, t in times.items()},
                bitwise=bool(bitwise), params=sum(p.numel() for p in base.parameters()),
                tensors=len(p1), path=o2.update_path()["path"])


def _combine_fsdp2(shape: str, impl: str, ranks: list[dict]) -> dict:
    """One FSDP2 row: per repeat the slowest rank, then medians (ms) and ratios."""
    def median_ms(name: str, what: str) -> float:
        return 1e3 * statistics.median(max(ts) for ts in zip(*[r["times"][name][what]
                                                                 for r in ranks]))

    nat_u, cot_u = median_ms("native-fsdp2", "update"), median_ms("cotangent-fsdp2", "update")
    nat_l, cot_l = median_ms("native-fsdp2", "loop"), median_ms("cotangent-fsdp2", "loop")
    return dict(shape=shape, native_impl=impl, params=ranks[0]["params"],
                tensors=ranks[0]["tensors"], world=len(ranks), fsdp2=True,
                native_update_ms=nat_u, cotangent_update_ms=cot_u, update_ratio=cot_u / nat_u,
                native_loop_ms=nat_l, cotangent_loop_ms=cot_l, loop_ratio=cot_l / nat_l,
                bitwise=all(r["bitwise"] for r in ranks), path=ranks[0]["path"],
                repeats=len(ranks[0]["times"]["native-fsdp2"]["update"]))


def _rank_main(rank: int, world: int, port: int, jobs: list, settings: dict, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(settings["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=settings["timeout_s"]))
    try:
        fsdp2 = settings.get("fsdp2", False)
        row, combine = (_rank_row_fsdp2, _combine_fsdp2) if fsdp2 else (_rank_row, _combine)
        for shape, impl in jobs:
            mine = row(shape, impl, repeats=settings["repeats"], warmup=settings["warmup"],
                       max_norm=settings["max_norm"])
            everyone: list = [None] * world
            dist.all_gather_object(everyone, mine)
            if rank == 0:
                results.put(combine(shape, impl, everyone))
    finally:
        dist.destroy_process_group()
    end_rank_process(0)  # DDP's reducer keeps gloo alive: skip the teardown (see there)


def _combine(shape: str, impl: str, ranks: list[dict]) -> dict:
    """One row from every rank's measurements: per repeat the slowest rank, then medians."""
    def median_ms(series: list[list[float]]) -> float:
        return 1e3 * statistics.median(max(ts) for ts in zip(*series))

    ms = {name: median_ms([r["times"][name] for r in ranks]) for name in ARMS}
    return dict(
        shape=shape, native_impl=impl, params=ranks[0]["params"], tensors=ranks[0]["tensors"],
        world=len(ranks), **{f"{name}_ms": v for name, v in ms.items()},
        ddp_ratio=ms["cotangent-ddp"] / ms["native-ddp"],
        zero_ratio=ms["cotangent-zero1"] / ms["native-zero"],
        zero1_vs_native_ddp=ms["cotangent-zero1"] / ms["native-ddp"],
        comm_ms=median_ms([r["comm"] for r in ranks]),
        bitwise=all(r["bitwise"] for r in ranks),
        state_bytes_per_rank={name: [r["state_bytes"][name] for r in ranks] for name in ARMS},
        repeats=len(ranks[0]["comm"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed_bench(world: int, shapes=DISTRIBUTED_SHAPES, impls=("fused",), *,
                          repeats: int = 20, warmup: int = 3, max_norm: float = 1.0,
                          threads: int | None = None, timeout_s: float = 600,
                          log=print, fsdp2: bool = False) -> dict:
    """Spawn `world` CPU ranks (gloo on 127.0.0.1) and run every (shape, impl) row: the four
    DDP / ZeRO arms, or with `fsdp2` the two FSDP2 arms (`_rank_row_fsdp2`).

    Returns {environment, world, threads_per_rank, rows, table}. Raises RuntimeError when a
    rank fails (torch.multiprocessing reports its traceback) or reports nothing in `timeout_s`.
    """
    if world < 1:
        raise ValueError(f"--distributed needs at least 1 rank, got {world}")
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.SimpleQueue()
    jobs = [(shape, impl) for shape in shapes for impl in impls]
    settings = dict(repeats=repeats, warmup=warmup, max_norm=max_norm, threads=threads,
                    timeout_s=timeout_s, fsdp2=fsdp2)
    procs = torch.multiprocessing.start_processes(
        _rank_main, args=(world, _free_port(), jobs, settings, results), nprocs=world,
        join=False, start_method="spawn")
    rows = []
    deadline = time.monotonic() + timeout_s
    while len(rows) < len(jobs):
        if not results.empty():
            row = results.get()
            if fsdp2:
                log(f"  {row['shape']:<19} {row['native_impl']:<8} FSDP2 update native "
                    f"{row['native_update_ms']:7.2f} ms cotangent "
                    f"{row['cotangent_update_ms']:7.2f} ms | iteration native "
                    f"{row['native_loop_ms']:7.2f} ms cotangent {row['cotangent_loop_ms']:7.2f}"
                    f" ms | bitwise {row['bitwise']}")
            else:
                log(f"  {row['shape']:<19} {row['native_impl']:<8} DDP native "
                    f"{row['native-ddp_ms']:7.2f} ms cotangent {row['cotangent-ddp_ms']:7.2f} "
                    f"ms | ZeRO native {row['native-zero_ms']:7.2f} ms cotangent "
                    f"{row['cotangent-zero1_ms']:7.2f} ms | bitwise {row['bitwise']}")
            rows.append(row)
            continue
        if procs.join(timeout=0.2):  # every rank exited (an error raises here)
            if not results.empty():
                continue
            break
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise RuntimeError(f"distributed bench: no result within {timeout_s} s")
    while not procs.join(timeout=5):
        pass
    if len(rows) < len(jobs):
        raise RuntimeError(f"distributed bench: {len(rows)} of {len(jobs)} rows came back")
    table = (format_fsdp2_table if fsdp2 else format_distributed_table)(rows, world, threads)
    return dict(environment=environment(), world=world, threads_per_rank=threads, rows=rows,
                table=table)


def format_fsdp2_table(rows: list[dict], world: int, threads: int) -> str:
    lines = [f"{world} CPU ranks (gloo, {threads} thread(s) each), FSDP2 (fully_shard per block "
             "and the root); update = clip + step, iteration = forward + backward + update; "
             "median over repeats of the slowest rank, ms",
             f"{'shape':<19}{'params':>11}  {'native':<9}{'upd nat':>8}{'upd cot':>8}"
             f"{'ratio':>7}{'iter nat':>9}{'iter cot':>9}{'ratio':>7}  bitwise  path"]
    for r in rows:
        lines.append(
            f"{r['shape']:<19}{r['params']:>11,}  {r['native_impl']:<9}"
            f"{r['native_update_ms']:>8.2f}{r['cotangent_update_ms']:>8.2f}"
            f"{r['update_ratio']:>7.3f}{r['native_loop_ms']:>9.2f}{r['cotangent_loop_ms']:>9.2f}"
            f"{r['loop_ratio']:>7.3f}  {'yes' if r['bitwise'] else 'NO':<7}  {r['path']}")
    return "\n".join(lines)


def format_distributed_table(rows: list[dict], world: int, threads: int) -> str:
    lines = [f"{world} CPU ranks (gloo, {threads} thread(s) each); update phase = clip + step, "
             "median over repeats of the slowest rank, ms",
             f"{'shape':<19}{'params':>11}  {'native':<7}{'ddp nat':>8}{'ddp cot':>8}{'ratio':>7}"
             f"{'zero nat':>9}{'zero1 cot':>10}{'ratio':>7}{'comm':>7}  bitwise  "
             "state MiB/rank native / zero1"]
    for r in rows:
        state = r["state_bytes_per_rank"]
        per_rank = "/".join(f"{b / 2**20:.2f}" for b in state["cotangent-zero1"])
        lines.append(
            f"{r['shape']:<19}{r['params']:>11,}  {r['native_impl']:<7}"
            f"{r['native-ddp_ms']:>8.2f}{r['cotangent-ddp_ms']:>8.2f}{r['ddp_ratio']:>7.3f}"
            f"{r['native-zero_ms']:>9.2f}{r['cotangent-zero1_ms']:>10.2f}{r['zero_ratio']:>7.3f}"
            f"{r['comm_ms']:>7.2f}  {'yes' if r['bitwise'] else 'NO':<7}  "
            f"{state['native-ddp'][0] / 2**20:.2f} / {per_rank}")
    return "\n".join(lines)
