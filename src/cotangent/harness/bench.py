"""`cotangent bench`: update-phase time, native vs Cotangent, with a bandwidth floor.

The update phase is what a training loop spends between the backward and the next forward:
native `torch.nn.utils.clip_grad_norm_(params, max_norm)` + `torch.optim.AdamW.step()` +
`zero_grad()` against `cotangent.AdamW(..., max_norm=max_norm).step()` + `zero_grad()` with the
same AdamW arguments, for each native implementation: `default` (what torch picks with no flag:
the for-loop on CPU), `foreach` and `fused`. Both arms live in one process and alternate repeat
by repeat (their order rotates every repeat, so that each arm takes each position equally
often). Each repeat gets its gradients by one of `METHODS`:

    real-backward    (default) a forward + backward of the arm's model on a small random batch
                     (`BATCH_SIZE` x `SEQ_LEN` tokens, the same batch for both arms), as in
                     training: native's backward allocates fresh gradients, Cotangent's
                     accumulates into its -0.0 gradient views.
    synthetic-grads  `torch.autograd.backward(params, grads)` with the same fixed random
                     gradients every repeat (the method before issue #15): no model compute
                     between updates, so the update starts with the gradients just written and
                     little else in the caches. Measured: Cotangent's clip + step is 0.1-0.4 ms
                     faster than after a real backward, native's about the same, so its ratios
                     read lower than a training loop's (docs/benchmarks.md); it
                     also hides Cotangent's accumulation cost (native clones `grads` there).

The gradient phase, clip + step and zero_grad are each timed between device synchronisations
(the gradient phase untimed in `native_ms`/`cotangent_ms`, reported as `*_backward_ms`).
Medians over the repeats after the warm-up ones; every row then checks every loss of the run,
the total norm, the clipped gradients, parameters, both moments and step counts byte for byte.
Each row and the run record how busy the machine was (`others_cpus`), since on a small machine
other work moves the ratios more than anything in the method.

Every row (default, foreach, fused: `OFF_ARM_IMPLS`) also times a third arm in the same
interleaving: Cotangent with its single pass switched off (``COTANGENT_SINGLE_PASS=0``,
native's op sequence over merged ranges: the path before issue #15), so before and after come
from one run; every row names the path Cotangent's steps took (`cotangent.AdamW.update_path`),
and the run reports the kernel's one-off costs (build or cache load, probes) apart from the
per-step times (`cotangent.singlepass.process_report`).

Floor: a pass over N elements costs what one pass costs in a large elementwise op
(`torch.add(a, b, out=c)` over 2**25 float32 elements = 3 passes), timed once per repeat in the
row's own interleaving (median over the row's repeats: on a VM whose memory bandwidth drifts
between minutes, a pass cost measured once per run describes other minutes than most rows);
the update needs at least 10 passes (norm read, clip read + write, AdamW's 4 reads and 3
writes): floor10_ms = 10 * N * that.
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
import torch.nn.functional as F

import cotangent
from cotangent import singlepass
from cotangent.harness.contention import BUSY_DEMAND_RATIO, HostSampler
from cotangent.harness.model import build_model
from cotangent.harness.records import environment
from cotangent.harness.train import sync
from cotangent.harness.packed import PackedAdamW

IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
SHAPES = ("many-small", "transformer-small", "causal-conv", "gated-gqa", "transformer-medium",
          "transformer-50m")
# How each repeat gets its gradients (see bench_row); the first is the default.
METHODS = ("real-backward", "synthetic-grads")
BATCH_SIZE, SEQ_LEN = 1, 64  # real-backward: sequences per forward, tokens per sequence
BENCH_ADAMW_ARGS = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ALLOC_ALIGN = 64  # bytes: c10's CPU allocator hands out 64-byte aligned blocks
SINGLE_PASS_IMPLS = ("default", "foreach")  # native's op sequences: the single pass's own targets
OFF_ARM_IMPLS = tuple(IMPLS)  # rows that also time Cotangent with the pass off: every one


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


PASS_ELEMENTS = 1 << 25  # float32 elements of the pass-cost probe (3 x 128 MiB, beyond caches)


def pass_probe(elements: int = PASS_ELEMENTS, device: str = "cpu"):
    """A function timing one pass-cost measurement: `torch.add(a, b, out=c)` over `elements`
    float32 elements (3 passes), returning milliseconds per element per pass."""
    dev = torch.device(device)
    a, b, c = (torch.rand(elements, device=dev), torch.rand(elements, device=dev),
               torch.empty(elements, device=dev))

    def once() -> float:
        sync(dev)
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        sync(dev)
        return 1e3 * (time.perf_counter() - t0) / (3 * elements)

    return once


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


FORWARD_END = "cotangent.bench.end_of_forward"  # the profiler range marking each forward's end


def forward_end_bytes(model: nn.Module, make_optimizer, update, batches: list,
                      loss=None) -> list[int]:
    """Bytes the CPU allocator holds at the end of each forward of a short training loop, counted
    from the profiler's memory accounting (every allocation and free torch makes, `torch.profiler`
    with ``profile_memory=True``; not the process's RSS) since just before the optimizer is
    built: what the loop keeps alive into the forward (gradients, optimizer state, buffers of
    its own) plus the forward's activations; the model's parameters are not counted.

    Each iteration: ``opt.zero_grad()``, the forward (`bench_loss`, or `loss`), the marker, the
    backward, ``update(opt)``. `make_optimizer(params)` builds the optimizer inside the
    profiled region. Returns one count per batch (the first forward holds no state yet).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    loss = bench_loss if loss is None else loss
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt = make_optimizer(list(model.parameters()))
        for batch in batches:
            opt.zero_grad()
            value = loss(model, batch)
            with record_function(FORWARD_END):
                pass
            value.backward()
            update(opt)
        del opt, value
    events = prof.events()
    marks = sorted(e.time_range.start for e in events if e.name == FORWARD_END)
    # an op's own allocations minus frees (self_: nested ops are counted once); frees outside
    # any op are "[memory]" events
    memory = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in events
                    if e.self_cpu_memory_usage)
    return [sum(b for t, b in memory if t <= mark) for mark in marks]


def _same_bytes(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def _many_small_batch(gen: torch.Generator, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (tokens, 80) float32, targets (tokens,) int64 in [0, 257)) for many-small."""
    return torch.randn(tokens, 80, generator=gen), torch.randint(0, 257, (tokens,), generator=gen)


def bench_batches(model: nn.Module, count: int, *, batch_size: int, seq_len: int,
                  device: str = "cpu", seed: int = 2) -> list:
    """`count` random batches for `bench_loss`: for a harness language model, byte ids of shape
    (batch_size, T + 1) with T = min(seq_len, the model's context); for many-small, inputs
    (batch_size * seq_len, 80) and targets. Raises ValueError for batch_size or seq_len < 1."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    if isinstance(model, nn.Sequential):
        return [tuple(t.to(dev) for t in _many_small_batch(gen, batch_size * seq_len))
                for _ in range(count)]
    seq = min(seq_len, model.cfg.context)
    return [torch.randint(0, 256, (batch_size, seq + 1), generator=gen).to(dev)
            for _ in range(count)]


def bench_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy of one batch of `bench_batches` (0-d float32 tensor): next-byte
    prediction for a language model, 257-way classification for many-small."""
    if isinstance(model, nn.Sequential):
        x, y = batch
        return F.cross_entropy(model(x), y)
    logits = model(batch[:, :-1])  # (B, T, 256)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


@dataclass
class Row:
    shape: str
    params: int
    tensors: int
    native_impl: str
    method: str  # "real-backward" or "synthetic-grads" (METHODS)
    native_ms: float  # update phase: clip + step + zero_grad, median over repeats
    cotangent_ms: float
    ratio: float  # cotangent_ms / native_ms
    native_step_ms: float  # clip + step alone (what this bench timed before #15)
    cotangent_step_ms: float
    step_ratio: float
    native_zero_grad_ms: float
    cotangent_zero_grad_ms: float
    native_backward_ms: float  # what ran before the update: forward + backward, or the
    cotangent_backward_ms: float  # synthetic-grads backward
    native_loop_ms: float  # backward + update of the same repeat, median
    cotangent_loop_ms: float
    loop_ratio: float
    floor10_ms: float  # 10 * params * pass_ms
    cotangent_over_floor: float  # cotangent_ms / floor10_ms
    pass_ms: float  # ms per element per pass, measured in this row's interleaving (median)
    bitwise: bool
    extra_persistent_bytes: int  # allocator blocks (64 B granules): cotangent - native
    padding_bytes: int  # requested bytes: cotangent - native (the 64-byte segment alignment)
    native_alloc_bytes: int  # temporaries allocated during one clip + step, in total
    cotangent_alloc_bytes: int
    native_largest_alloc_bytes: int  # the largest single temporary of one clip + step
    cotangent_largest_alloc_bytes: int
    repeats: int
    batch_size: int | None  # real-backward: the batch of each forward; None for synthetic
    seq_len: int | None
    others_cpus: float | None  # CPUs other work kept busy during the row (see run_bench)
    busy: bool | None  # (others_cpus + torch threads) / CPUs > BUSY_DEMAND_RATIO; None: unknown
    # backward of Cotangent's arm over native's (gradient phase, medians)
    backward_ratio: float | None = None
    # bytes the allocator holds at the end of the forward (`forward_end_bytes`, the third
    # iteration of a fresh copy: state exists, the previous step's gradients were zeroed)
    native_forward_end_bytes: int | None = None
    cotangent_forward_end_bytes: int | None = None
    cotangent_path: str | None = None  # update_path()["path"] of Cotangent's last step
    cotangent_path_notes: tuple[str, ...] = ()  # why the single pass did not take some
    # OFF_ARM_IMPLS rows: Cotangent with COTANGENT_SINGLE_PASS=0 in the same interleaving
    # (update phase, median ms; its ratio to native); None on other rows
    cotangent_off_ms: float | None = None
    off_ratio: float | None = None
    cotangent_off_path: str | None = None  # update_path()["path"] of that arm ("native")
    # PackedAdamW (the packed design before issue 26) in the same interleaving:
    # update phase (median ms), its ratio to native, its gradient phase, its loop ratio
    packed_ms: float | None = None
    packed_ratio: float | None = None
    packed_backward_ms: float | None = None
    packed_loop_ratio: float | None = None


@contextlib.contextmanager
def _single_pass_off():
    """Cotangent's single pass switched off (its documented environment switch, read at every
    step) for the duration; the previous value restored."""
    old = os.environ.get(singlepass.ENV_SWITCH)
    os.environ[singlepass.ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[singlepass.ENV_SWITCH]
        else:
            os.environ[singlepass.ENV_SWITCH] = old


def _others_cpus(sampler: HostSampler, host0, cpu0: float, wall0: float) -> float | None:
    """CPUs that other processes (and the hypervisor) kept busy on average since (host0,
    cpu0, wall0): host busy seconds minus this process's CPU seconds, per wall second."""
    host1, cpu1, wall1 = sampler.sample(), time.process_time(), time.perf_counter()
    if host0 is None or host1 is None or wall1 <= wall0:
        return None
    return ((host1[0] - host0[0]) - (cpu1 - cpu0)) / (wall1 - wall0)


def _busy(others: float | None, cpus: int | None) -> bool | None:
    """The harness's busy rule (`cotangent.harness.contention`): this process's threads and
    the other work wanted more than BUSY_DEMAND_RATIO x the CPUs; None when not measured."""
    if others is None or not cpus:
        return None
    return (others + torch.get_num_threads()) / cpus > BUSY_DEMAND_RATIO


def bench_row(shape: str, impl: str, *, pass_ms: float | None = None, repeats: int,
              warmup: int, method: str = "real-backward", batch_size: int = BATCH_SIZE,
              seq_len: int = SEQ_LEN, max_norm: float = 1.0, device: str = "cpu") -> Row:
    """One row: native clip_grad_norm_ + torch.optim.AdamW(**IMPLS[impl]) against
    cotangent.AdamW(max_norm=max_norm) on two copies of model `shape` (a name of SHAPES, or
    any harness model name such as "tiny-transformer"), arms interleaved.

    Each repeat, for each arm (the order rotates every repeat): the gradients (`method`
    "real-backward": forward + backward of `bench_loss` on this repeat's batch, the same batch
    for both arms; "synthetic-grads": `torch.autograd.backward(params, grads)` with the same
    fixed random gradients every repeat), then clip + step, then zero_grad, each timed between
    device synchronisations. Medians over the repeats after `warmup`; times in ms. Bitwise:
    every loss of the run, then after one more gradient + clip + step the total norm, the
    clipped gradients, parameters, both moments and step counts, byte for byte. For `impl` in
    OFF_ARM_IMPLS a third arm, Cotangent with its single pass switched off, runs in the
    same interleaving and the same byte checks (`cotangent_off_ms`). The floor's pass cost: a
    `pass_probe` before every repeat's arms, median over the timed repeats (`pass_ms` None, the
    default), or the given `pass_ms` (ms per element per pass).
    Raises ValueError for an unknown method, batch_size or seq_len < 1."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    dev = torch.device(device)
    sampler = HostSampler()
    host0, cpu0, wall0 = sampler.sample(), time.process_time(), time.perf_counter()
    m1 = bench_model(shape).to(dev)
    m2 = copy.deepcopy(m1)
    p1, p2 = list(m1.parameters()), list(m2.parameters())
    with_off = impl in OFF_ARM_IMPLS
    m3 = copy.deepcopy(m1) if with_off else None
    gen = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=gen) * 0.01).to(dev) for p in p1]  # norm > 1
    batches = bench_batches(m1, warmup + repeats + 1, batch_size=batch_size, seq_len=seq_len,
                            device=device) if method == "real-backward" else []
    native = torch.optim.AdamW(p1, **BENCH_ADAMW_ARGS, **IMPLS[impl])
    ours = cotangent.AdamW(p2, max_norm=max_norm, **BENCH_ADAMW_ARGS, **IMPLS[impl])
    totals: dict[str, torch.Tensor] = {}
    losses: dict[str, list[torch.Tensor]] = {"native": [], "cotangent": [], "cotangent-off": [],
                                             "packed": []}

    def native_update():
        totals["native"] = torch.nn.utils.clip_grad_norm_(p1, max_norm)
        native.step()

    def our_update():
        ours.step()
        totals["cotangent"] = ours.last_total_norm

    arms = {"native": (m1, native, p1, native_update), "cotangent": (m2, ours, p2, our_update)}
    if with_off:
        p3 = list(m3.parameters())
        off = cotangent.AdamW(p3, max_norm=max_norm, **BENCH_ADAMW_ARGS, **IMPLS[impl])

        def off_update():
            with _single_pass_off():
                off.step()
            totals["cotangent-off"] = off.last_total_norm

        arms["cotangent-off"] = (m3, off, p3, off_update)
    # the design before issue 26 (parameters and gradients packed), in the same interleaving
    m4 = copy.deepcopy(m1)
    p4 = list(m4.parameters())
    packed = PackedAdamW(p4, max_norm=max_norm, **BENCH_ADAMW_ARGS, **IMPLS[impl])

    def packed_update():
        packed.step()
        totals["packed"] = packed.last_total_norm

    arms["packed"] = (m4, packed, p4, packed_update)

    def gradients(name: str, i: int) -> None:
        model, _, params, _ = arms[name]
        if method == "real-backward":
            loss = bench_loss(model, batches[i])
            loss.backward()
            losses[name].append(loss.detach().clone())
        else:
            torch.autograd.backward(params, grads)

    phases = ("backward", "step", "zero_grad", "update", "loop")
    times = {name: {ph: [] for ph in phases} for name in arms}
    order = list(arms)
    probe = pass_probe(device=device) if pass_ms is None else None
    pass_costs = []
    for i in range(warmup + repeats):
        if probe is not None:
            cost = probe()
            if i >= warmup:
                pass_costs.append(cost)
        for name in order:
            _, opt, _, update = arms[name]
            sync(dev)
            t0 = time.perf_counter()
            gradients(name, i)
            sync(dev)
            t1 = time.perf_counter()
            update()
            sync(dev)
            t2 = time.perf_counter()
            opt.zero_grad()
            sync(dev)
            t3 = time.perf_counter()
            if i >= warmup:
                for ph, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t1, t3 - t0)):
                    times[name][ph].append(dt)
        # rotate (not reverse): with three or four arms a reversal leaves the middle ones in the
        # middle every repeat (Cotangent's fused rows read 1.03-1.19 of native there, the same
        # step 1.01 in a two-arm alternation); rotated, every arm takes every position equally
        # often
        order.append(order.pop(0))
    allocs = {}
    for name, (_, _, _, update) in arms.items():  # one more (profiled) step for each
        gradients(name, warmup + repeats)
        allocs[name] = temp_alloc_bytes(update)
    bitwise = True
    for name, (_, opt, params, _) in arms.items():
        if name == "native":
            continue
        bitwise &= _same_bytes(totals["native"], totals[name])
        bitwise &= len(losses["native"]) == len(losses[name]) and all(
            _same_bytes(a, b) for a, b in zip(losses["native"], losses[name]))
        for a, b in zip(p1, params):
            bitwise &= _same_bytes(a, b) and _same_bytes(a.grad, b.grad)
            for key in native.state[a]:
                bitwise &= _same_bytes(native.state[a][key], opt.state[b][key])
    ms = {name: {ph: 1e3 * statistics.median(v) for ph, v in t.items()}
          for name, t in times.items()}
    nat, cot = ms["native"], ms["cotangent"]
    n = sum(p.numel() for p in p1)
    if probe is not None:
        del probe  # its 384 MiB
        pass_ms = statistics.median(pass_costs)
    floor10 = 10 * n * pass_ms
    native_exact, native_blocks = persistent_bytes(p1, native)
    ours_exact, ours_blocks = persistent_bytes(p2, ours)
    real = method == "real-backward"
    path = ours.update_path()
    end_bytes = {}
    kept = {}  # each arm's last total norm stays alive, as the timed arms keep theirs
    if real:
        m0 = bench_model(shape).to(dev)
        m0.load_state_dict(m1.state_dict())  # (any weights: memory depends on shapes only)
        for name, make, update in (
                ("native", lambda p: torch.optim.AdamW(p, **BENCH_ADAMW_ARGS, **IMPLS[impl]),
                 lambda o: (kept.__setitem__("native", torch.nn.utils.clip_grad_norm_(
                     [q for g in o.param_groups for q in g["params"]], max_norm)), o.step())),
                ("cotangent", lambda p: cotangent.AdamW(p, max_norm=max_norm, **BENCH_ADAMW_ARGS,
                                                        **IMPLS[impl]),
                 lambda o: o.step())):
            end_bytes[name] = forward_end_bytes(copy.deepcopy(m0), make, update,
                                                batches[:3])[-1]
    off_ms = ms["cotangent-off"]["update"] if with_off else None
    return Row(
        shape=shape, params=n, tensors=len(p1), native_impl=impl, method=method,
        native_ms=nat["update"], cotangent_ms=cot["update"],
        ratio=cot["update"] / nat["update"],
        native_step_ms=nat["step"], cotangent_step_ms=cot["step"],
        step_ratio=cot["step"] / nat["step"],
        native_zero_grad_ms=nat["zero_grad"], cotangent_zero_grad_ms=cot["zero_grad"],
        native_backward_ms=nat["backward"], cotangent_backward_ms=cot["backward"],
        native_loop_ms=nat["loop"], cotangent_loop_ms=cot["loop"],
        loop_ratio=cot["loop"] / nat["loop"],
        floor10_ms=floor10, cotangent_over_floor=cot["update"] / floor10, pass_ms=pass_ms,
        backward_ratio=cot["backward"] / nat["backward"],
        native_forward_end_bytes=end_bytes.get("native"),
        cotangent_forward_end_bytes=end_bytes.get("cotangent"),
        bitwise=bool(bitwise), extra_persistent_bytes=ours_blocks - native_blocks,
        padding_bytes=ours_exact - native_exact,
        native_alloc_bytes=allocs["native"][0], cotangent_alloc_bytes=allocs["cotangent"][0],
        native_largest_alloc_bytes=allocs["native"][1],
        cotangent_largest_alloc_bytes=allocs["cotangent"][1], repeats=repeats,
        batch_size=batch_size if real else None,
        seq_len=(seq_len if isinstance(m1, nn.Sequential) else batches[0].shape[1] - 1)
        if real else None,
        others_cpus=(others := _others_cpus(sampler, host0, cpu0, wall0)),
        busy=_busy(others, sampler.cpus), cotangent_path=path["path"],
        cotangent_path_notes=tuple(path["single_pass_notes"]), cotangent_off_ms=off_ms,
        off_ratio=None if off_ms is None else off_ms / nat["update"],
        cotangent_off_path=arms["cotangent-off"][1].update_path()["path"] if with_off else None,
        packed_ms=ms["packed"]["update"], packed_ratio=ms["packed"]["update"] / nat["update"],
        packed_backward_ms=ms["packed"]["backward"],
        packed_loop_ratio=ms["packed"]["loop"] / nat["loop"])


# The project's goals, checked on every run (issue 26): (native implementation, shape
# predicate, quantity, bound, description, strict); `ratio` = cotangent_ms / native_ms (the
# update phase), `loop_ratio` the same over gradient phase + update, `backward_ratio` over the
# gradient phase alone; met when value <= bound (value < bound when strict). The
# implementation: a name, a tuple of names, or None (every row).
TARGETS = [
    (None, lambda r: True, "loop_ratio", 1.0, "whole iteration faster than native", True),
    ("fused", lambda r: r.shape == "many-small", "ratio", 0.40, "vs fused, many-small", False),
    ("fused", lambda r: r.params >= 3_000_000, "ratio", 0.90, "vs fused, shapes >= 3M", False),
    (SINGLE_PASS_IMPLS, lambda r: True, "ratio", 0.45, "for-loop/foreach update vs native",
     False),
    (SINGLE_PASS_IMPLS, lambda r: True, "loop_ratio", 0.60,
     "for-loop/foreach whole iteration vs native", False),
    (None, lambda r: r.backward_ratio is not None, "backward_ratio", 1.03,
     "backward within 3% of native's", False),
    (None, lambda r: True, "ratio", 1.0, "update never slower than native", False),
]


def check_targets(rows: list[Row]) -> list[dict]:
    """One entry per (target, row) it applies to: value, bound, met."""
    out = []
    for impl, applies, field, bound, desc, strict in TARGETS:
        for r in rows:
            names = impl if isinstance(impl, tuple) else (impl,)
            if (impl is None or r.native_impl in names) and applies(r):
                value = getattr(r, field)
                out.append(dict(target=desc, shape=r.shape, native_impl=r.native_impl,
                                field=field, value=value, bound=bound,
                                met=value < bound if strict else value <= bound))
    out += [dict(target="bitwise", shape=r.shape, native_impl=r.native_impl, field="bitwise",
                 value=r.bitwise, bound=True, met=r.bitwise) for r in rows]
    out += [dict(target="bytes at the end of the forward <= native's", shape=r.shape,
                 native_impl=r.native_impl, field="cotangent_forward_end_bytes",
                 value=r.cotangent_forward_end_bytes, bound=r.native_forward_end_bytes,
                 met=r.cotangent_forward_end_bytes <= r.native_forward_end_bytes)
            for r in rows if r.native_forward_end_bytes is not None]
    out += [dict(target="extra persistent memory 0 bytes", shape=r.shape,
                 native_impl=r.native_impl, field="extra_persistent_bytes",
                 value=r.extra_persistent_bytes, bound=0, met=r.extra_persistent_bytes <= 0)
            for r in rows]
    return out


def method_line(method: str, batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN) -> str:
    """One line saying how each repeat got its gradients."""
    if method == "real-backward":
        return (f"method: real-backward (before each update, forward + backward of the model on "
                f"{batch_size} x {seq_len} tokens, the same batch for both arms)")
    return ("method: synthetic-grads (before each update, torch.autograd.backward(params, grads)"
            " with the same fixed random gradients every repeat)")


def format_table(rows: list[Row], pass_ms: float, method: str = "real-backward",
                 batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN,
                 others_cpus: float | None = None, host_cpus: int | None = None,
                 single_pass: dict | None = None) -> str:
    head = (f"{'shape':<19}{'params':>11}{'tensors':>8}  {'native':<8}{'native_ms':>10}"
            f"{'cotangent_ms':>13}{'ratio':>7}  {'path':<12}{'off_ms':>8}{'off':>7}"
            f"{'step':>7}{'zero_grad n/c':>14}"
            f"{'bwd n/c':>16}{'loop':>7}{'pass_ns':>8}{'floor10_ms':>11}{'/floor':>7}  bitwise  "
            f"{'extra_B':>7}{'largest temp n/c (KiB)':>24}{'fwd-end n/c (MiB)':>19}"
            f"{'packed upd/bwd/loop':>21}{'others':>8}")
    lines = [method_line(method, batch_size, seq_len),
             "update = clip + step + zero_grad (native_ms, cotangent_ms, ratio = cotangent / "
             "native); step: the ratio of clip + step alone; bwd: the gradient phase before it "
             "(ms); loop: the ratio of gradient phase + update (the whole iteration); fwd-end: "
             "bytes the allocator holds at the end of a forward (profiler memory events, third "
             "iteration of a fresh copy; real-backward only); packed: PackedAdamW "
             "(the packed design before issue 26) in the same interleaving: update ratio, "
             "gradient phase ms, loop ratio",
             "path: what updated Cotangent's parameters (single-pass kernel, native's op "
             "sequence, mixed); off_ms / off: Cotangent with COTANGENT_SINGLE_PASS=0 in the "
             "same interleaving (update phase; ratio to native): the path before the single "
             "pass",
             f"pass cost: {pass_ms * 1e6:.3f} ns per element (large float32 add, 3 passes; "
             f"median of the rows' own, each timed in its row's interleaving: "
             f"pass_ns, floor10_ms = 10 passes at that cost)",
             head]
    for r in rows:
        others = "-" if r.others_cpus is None else f"{r.others_cpus:.2f}"
        off = ("" if r.cotangent_off_ms is None else
               f"{r.cotangent_off_ms:>8.2f}{r.off_ratio:>7.3f}").rjust(15)
        lines.append(
            f"{r.shape:<19}{r.params:>11,}{r.tensors:>8}  {r.native_impl:<8}{r.native_ms:>10.2f}"
            f"{r.cotangent_ms:>13.2f}{r.ratio:>7.3f}  {str(r.cotangent_path):<12}{off}"
            f"{r.step_ratio:>7.3f}"
            f"{r.native_zero_grad_ms:>8.2f} /{r.cotangent_zero_grad_ms:>5.2f}"
            f"{r.native_backward_ms:>9.2f} /{r.cotangent_backward_ms:>6.2f}{r.loop_ratio:>7.3f}"
            f"{r.pass_ms * 1e6:>8.3f}{r.floor10_ms:>11.2f}{r.cotangent_over_floor:>7.2f}  "
            f"{'yes' if r.bitwise else 'NO':<7}"
            f"{r.extra_persistent_bytes:>8}{r.native_largest_alloc_bytes / 1024:>13.0f} / "
            f"{r.cotangent_largest_alloc_bytes / 1024:<8.0f}{_mib(r.native_forward_end_bytes):>9} /"
            f"{_mib(r.cotangent_forward_end_bytes):>8}{_packed(r):>21}{others:>8}"
            f"{'*' if r.busy else ''}")
    if others_cpus is not None:
        lines.append(f"load: other work kept {others_cpus:.2f} of {host_cpus} CPUs busy on average "
                     f"during the run (others: per row); ratios move with it on a small machine")
    if single_pass is not None:
        lines.append(single_pass_line(single_pass))
    busy = [r for r in rows if r.busy]
    if busy:
        lines.append(f"warning: {len(busy)} of {len(rows)} rows ran on a busy machine (others + "
                     f"threads > {BUSY_DEMAND_RATIO} x CPUs; marked *): their times say more "
                     f"about the other work than about the code")
    return "\n".join(lines)


def _packed(r: Row) -> str:
    if r.packed_ratio is None:
        return "-"
    return f"{r.packed_ratio:.3f}/{r.packed_backward_ms:.2f}/{r.packed_loop_ratio:.3f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def single_pass_line(report: dict) -> str:
    """One line on the single-pass kernel's one-off costs in this run (`cotangent.singlepass.
    process_report`): built (seconds) or loaded from the cache, probes and their seconds, the
    square root it reproduces torch.sqrt with (and the seconds checking it took, when not
    cached); or why it could not run."""
    reason, b = report["unavailable_reason"], report["build"]
    if not singlepass.switched_on():
        return (f"single pass: switched off ({singlepass.ENV_SWITCH}="
                f"{os.environ.get(singlepass.ENV_SWITCH)}); for-loop/foreach rows ran native's op "
                f"sequence")
    if reason == "not checked":
        return "single pass: not asked for in this run (no for-loop/foreach row)"
    if reason is not None:
        return (f"single pass: unavailable ({reason}); for-loop/foreach rows ran native's op "
                f"sequence")
    built = ("loaded from the kernel cache (built by an earlier process)" if b["cached"] else
             f"built in {b['compile_s']:.2f} s by {b['compiler']}")
    probes = report["probes"]
    root, check = report["square_root"], report["sqrt_check_s"]
    root = f"; square root: {root}" + (f" (checked against torch.sqrt in {check:.2f} s)"
                                       if check else "")
    lists = report.get("list_reader")
    if lists is None:
        lists = ""
    elif lists["available"]:
        lists = ("; list reader: loaded from the kernel cache" if lists["cached"] else
                 f"; list reader: built in {lists['compile_s']:.2f} s")
    else:
        lists = f"; list reader: unavailable ({lists['why_not']}), lists checked in Python"
    return (f"single pass: kernel {b['key']} {built}; {probes} probe{'' if probes == 1 else 's'} "
            f"in {report['probe_s']:.2f} s{root}{lists} (one-off costs, in no row's times)")


def run_bench(shapes=SHAPES, impls=tuple(IMPLS), *, repeats: int = 20, warmup: int = 3,
              method: str = "real-backward", batch_size: int = BATCH_SIZE, seq_len: int = SEQ_LEN,
              device: str = "cpu", log=print) -> dict:
    """Run every (shape, impl) row with `method` (METHODS; see bench_row).

    Returns {environment, device, method, batch_size, seq_len (None for synthetic-grads),
    pass_ms_per_element (the median of the rows' own pass costs), loadavg_start, loadavg_end,
    host_cpus, others_cpus (CPUs other work kept busy on average during the run, from
    /proc/stat as `cotangent.harness.contention`; None where unreadable), busy_rows (rows
    measured on a busy machine), wall_s, single_pass (`cotangent.singlepass.process_report` at
    the end: build and probe costs), rows, targets,
    table}. Raises ValueError for an unknown
    method, batch_size or seq_len < 1."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    load_start = os.getloadavg()
    sampler = HostSampler()
    host0, cpu0, wall0 = sampler.sample(), time.process_time(), time.perf_counter()
    rows = []
    for shape in shapes:
        for impl in impls:
            row = bench_row(shape, impl, repeats=repeats, warmup=warmup, method=method,
                            batch_size=batch_size, seq_len=seq_len, device=device)
            log(f"  {shape:<19} {impl:<8} native {row.native_ms:8.2f} ms  cotangent "
                f"{row.cotangent_ms:8.2f} ms  ratio {row.ratio:.3f}  path {row.cotangent_path}"
                f"  bitwise {row.bitwise}")
            rows.append(row)
    pass_ms = statistics.median(r.pass_ms for r in rows)  # the header's summary only
    others = _others_cpus(sampler, host0, cpu0, wall0)
    real = method == "real-backward"
    return dict(environment=environment(), device=device, method=method,
                batch_size=batch_size if real else None, seq_len=seq_len if real else None,
                pass_ms_per_element=pass_ms, loadavg_start=list(load_start),
                loadavg_end=list(os.getloadavg()), host_cpus=sampler.cpus, others_cpus=others,
                busy_rows=sum(bool(r.busy) for r in rows),
                wall_s=time.perf_counter() - wall0, single_pass=(sp := singlepass.process_report()),
                rows=[r.__dict__ for r in rows], targets=check_targets(rows),
                table=format_table(rows, pass_ms, method, batch_size, seq_len, others,
                                   sampler.cpus, sp))


def result_json(result: dict) -> str:
    return json.dumps({k: v for k, v in result.items() if k != "table"}, sort_keys=True)
