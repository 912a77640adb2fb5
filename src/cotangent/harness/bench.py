"""`cotangent bench`: update-phase time, native vs Cotangent, with a bandwidth floor.

The update phase is "gradients ready -> parameters updated": native
`torch.nn.utils.clip_grad_norm_(params, max_norm)` + `torch.optim.AdamW.step()` against
`cotangent.AdamW(..., max_norm=max_norm).step()` with the same AdamW arguments, for each native
implementation: `default` (what torch picks with no flag: the for-loop on CPU), `foreach` and
`fused`. Both arms live in one process and alternate repeat by repeat (their order flips every
repeat); each repeat first lays down the same gradients through autograd
(`torch.autograd.backward(params, grads)`, untimed, so Cotangent's hooks and in-buffer
accumulation run as in training), then times the update between device synchronisations. Medians
over the repeats after the warm-up ones; every row then checks parameters, gradients, both moments
and step counts byte for byte.

Floor: a pass over N elements costs what one pass costs in a large elementwise op
(`torch.add(a, b, out=c)` over 2**25 float32 elements = 3 passes); the update needs at least 10
passes (norm read, clip read + write, AdamW's 4 reads and 3 writes): floor10_ms = 10 * N * that.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

import cotangent
from cotangent.harness.model import build_model
from cotangent.harness.records import environment
from cotangent.harness.train import sync

IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SHAPES = ("many-small", "transformer-small", "causal-conv", "gated-gqa", "transformer-medium",
          "transformer-50m")
BENCH_ADAMW_ARGS = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ALLOC_ALIGN = 64  # bytes: c10's CPU allocator hands out 64-byte aligned blocks


def many_small_model() -> nn.Module:
    """~0.64M parameters in 146 tensors: 24 small MLP blocks (LayerNorm, two biased linears)
    and a 257-way biased head, the shape of models whose update phase is all per-tensor overhead."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.LayerNorm(80), nn.Linear(80, 160), nn.Linear(160, 80)]
    layers.append(nn.Linear(80, 257))
    return nn.Sequential(*layers)


def bench_model(shape: str) -> nn.Module:
    return many_small_model() if shape == "many-small" else build_model(shape, 0)


def pass_ms_per_element(repeats: int = 15) -> float:
    """Milliseconds per element per pass of a large float32 elementwise op (2**25 elements)."""
    n = 1 << 25
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:]) / (3 * n)


def persistent_bytes(params, opt) -> tuple[int, int]:
    """(bytes, bytes rounded per storage to the allocator's 64-byte blocks) of parameters,
    gradients and optimizer state."""
    tensors = list(params) + [p.grad for p in params if p.grad is not None]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    seen, exact, rounded = set(), 0, 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        exact += s.nbytes()
        rounded += -(-s.nbytes() // ALLOC_ALIGN) * ALLOC_ALIGN
    return exact, rounded


@contextlib.contextmanager
def _quiet_stderr():
    """Silence fd 2 (the profiler backend logs start/stop lines there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def temp_alloc_bytes(fn) -> tuple[int, int]:
    """(total bytes, largest single allocation in bytes) that torch ops allocate while `fn` runs:
    the update's temporaries, from the profiler's memory accounting (CPU allocator)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocations = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return int(sum(allocations)), int(max(allocations, default=0))


def _same_bytes(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


@dataclass
class Row:
    shape: str
    params: int
    tensors: int
    native_impl: str
    native_ms: float
    cotangent_ms: float
    ratio: float
    floor10_ms: float
    cotangent_over_floor: float
    bitwise: bool
    extra_persistent_bytes: int  # allocator blocks (64 B granules): cotangent - native
    padding_bytes: int  # requested bytes: cotangent - native (the 64-byte segment alignment)
    native_alloc_bytes: int  # temporaries allocated during one update, in total
    cotangent_alloc_bytes: int
    native_largest_alloc_bytes: int  # the largest single temporary of one update
    cotangent_largest_alloc_bytes: int
    repeats: int


def bench_row(shape: str, impl: str, *, pass_ms: float, repeats: int, warmup: int,
              max_norm: float = 1.0, device: str = "cpu") -> Row:
    dev = torch.device(device)
    m1 = bench_model(shape).to(dev)
    m2 = copy.deepcopy(m1)
    p1, p2 = list(m1.parameters()), list(m2.parameters())
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=gen) * 0.01).to(dev) for p in p1]  # norm > 1
    native = torch.optim.AdamW(p1, **BENCH_ADAMW_ARGS, **IMPLS[impl])
    ours = cotangent.AdamW(p2, max_norm=max_norm, **BENCH_ADAMW_ARGS, **IMPLS[impl])
    totals: dict[str, torch.Tensor] = {}

    def native_update():
        totals["native"] = torch.nn.utils.clip_grad_norm_(p1, max_norm)
        native.step()

    def our_update():
        ours.step()
        totals["cotangent"] = ours.last_total_norm

    arms = {"native": (native, p1, native_update), "cotangent": (ours, p2, our_update)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for _ in range(warmup + repeats):
        for name in order:
            opt, params, update = arms[name]
            opt.zero_grad()
            torch.autograd.backward(params, grads)
            sync(dev)
            t0 = time.perf_counter()
            update()
            sync(dev)
            times[name].append(time.perf_counter() - t0)
        order.reverse()
    allocs = {}
    for name, (opt, params, update) in arms.items():  # one more (profiled) step for each
        opt.zero_grad()
        torch.autograd.backward(params, grads)
        allocs[name] = temp_alloc_bytes(update)
    bitwise = _same_bytes(totals["native"], totals["cotangent"])
    for a, b in zip(p1, p2):
        bitwise &= _same_bytes(a, b) and _same_bytes(a.grad, b.grad)
        for key in native.state[a]:
            bitwise &= _same_bytes(native.state[a][key], ours.state[b][key])
    native_ms = 1e3 * statistics.median(times["native"][warmup:])
    ours_ms = 1e3 * statistics.median(times["cotangent"][warmup:])
    n = sum(p.numel() for p in p1)
    floor10 = 10 * n * pass_ms
    native_exact, native_blocks = persistent_bytes(p1, native)
    ours_exact, ours_blocks = persistent_bytes(p2, ours)
    return Row(shape, n, len(p1), impl, native_ms, ours_ms, ours_ms / native_ms, floor10,
               ours_ms / floor10, bool(bitwise), ours_blocks - native_blocks,
               ours_exact - native_exact, *allocs["native"][:1], *allocs["cotangent"][:1],
               allocs["native"][1], allocs["cotangent"][1], repeats)


# The project's update-phase goals, checked on every run: (native implementation, shape
# predicate, quantity, bound, description); `ratio` = cotangent_ms / native_ms,
# `cotangent_over_floor` = cotangent_ms / floor10_ms. None as the implementation: every row.
TARGETS = [
    ("fused", lambda r: r.shape == "many-small", "ratio", 0.35, "vs fused, many-small"),
    ("fused", lambda r: r.shape in ("transformer-small", "causal-conv"), "ratio", 0.75,
     "vs fused, 3.35M/3.75M shapes"),
    ("fused", lambda r: r.params >= 3_000_000, "cotangent_over_floor", 1.2,
     "vs floor, shapes >= 3M"),
    ("default", lambda r: r.shape == "many-small", "ratio", 0.5, "vs default, many-small"),
    (None, lambda r: True, "ratio", 1.0, "never slower than native"),
]


def check_targets(rows: list[Row]) -> list[dict]:
    """One entry per (target, row) it applies to: value, bound, met."""
    out = []
    for impl, applies, field, bound, desc in TARGETS:
        for r in rows:
            if (impl is None or r.native_impl == impl) and applies(r):
                value = getattr(r, field)
                out.append(dict(target=desc, shape=r.shape, native_impl=r.native_impl,
                                field=field, value=value, bound=bound, met=value <= bound))
    out += [dict(target="bitwise", shape=r.shape, native_impl=r.native_impl, field="bitwise",
                 value=r.bitwise, bound=True, met=r.bitwise) for r in rows]
    out += [dict(target="extra persistent memory 0 bytes", shape=r.shape,
                 native_impl=r.native_impl, field="extra_persistent_bytes",
                 value=r.extra_persistent_bytes, bound=0, met=r.extra_persistent_bytes <= 0)
            for r in rows]
    return out


def format_table(rows: list[Row], pass_ms: float) -> str:
    head = (f"{'shape':<19}{'params':>11}{'tensors':>8}  {'native':<8}{'native_ms':>10}"
            f"{'cotangent_ms':>13}{'ratio':>7}{'floor10_ms':>11}{'/floor':>7}  bitwise  "
            f"{'extra_B':>7}{'largest temp native/cot (KiB)':>31}")
    lines = [f"pass cost: {pass_ms * 1e6:.3f} ns per element (large float32 add, 3 passes)",
             head]
    for r in rows:
        lines.append(
            f"{r.shape:<19}{r.params:>11,}{r.tensors:>8}  {r.native_impl:<8}{r.native_ms:>10.2f}"
            f"{r.cotangent_ms:>13.2f}{r.ratio:>7.3f}{r.floor10_ms:>11.2f}"
            f"{r.cotangent_over_floor:>7.2f}  {'yes' if r.bitwise else 'NO':<7}"
            f"{r.extra_persistent_bytes:>8}{r.native_largest_alloc_bytes / 1024:>14.0f} / "
            f"{r.cotangent_largest_alloc_bytes / 1024:<9.0f}")
    return "\n".join(lines)


def run_bench(shapes=SHAPES, impls=tuple(IMPLS), *, repeats: int = 20, warmup: int = 3,
              device: str = "cpu", log=print) -> dict:
    """Run every (shape, impl) row; returns {environment, pass_ms_per_element, rows, targets}."""
    pass_ms = pass_ms_per_element()
    rows = []
    for shape in shapes:
        for impl in impls:
            row = bench_row(shape, impl, pass_ms=pass_ms, repeats=repeats, warmup=warmup,
                            device=device)
            log(f"  {shape:<19} {impl:<8} native {row.native_ms:8.2f} ms  cotangent "
                f"{row.cotangent_ms:8.2f} ms  ratio {row.ratio:.3f}  bitwise {row.bitwise}")
            rows.append(row)
    pass_ms = min(pass_ms, pass_ms_per_element())  # re-measured at the end; the faster one
    for r in rows:
        r.floor10_ms = 10 * r.params * pass_ms
        r.cotangent_over_floor = r.cotangent_ms / r.floor10_ms
    return dict(environment=environment(), device=device, pass_ms_per_element=pass_ms,
                rows=[r.__dict__ for r in rows], targets=check_targets(rows),
                table=format_table(rows, pass_ms))


def result_json(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "table"}, sort_keys=True)
