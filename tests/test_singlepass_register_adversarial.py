"""Adversarial checks of the single pass's register path (`fused` / `fused_step` in
`cotangent.singlepass`): each 16-lane (AVX-512) or 8-lane (AVX2) float32 vector goes from
load to store in registers, and a vector with a NaN lane (in the clipped gradient, grad -
exp_avg, value * exp_avg or its quotient, or with amsgrad an operand of the maximum) is redone
element by element by the general path. The claim attacked: on every input, native
``torch.optim.AdamW``'s bytes (for-loop and foreach, float32, CPU).

The review (torch 2.13.0+cpu, 2-core AMD EPYC with AVX-512, emulated square root) ran three
seeded searches, none finding a register-path divergence:
- 1,030 kernel-level configurations, the register path against the general path (the same
  source with the register path's condition switched off), random bit patterns and biased
  special values in every buffer, NaNs of every payload at rates 0-30%, every hyperparameter
  class (inf, 0, subnormal, negative), random segment layouts and tail flags, 1-3 threads,
  both square roots (the emulated one; the hardware one, also under directed rounding and
  flush-to-zero): byte-equal in all;
- 1,690 direct `single_pass_adamw_` configurations against native `torch.optim.adam.adam`
  per segment, 3 steps, every byte after each step (lr float/tensor/0/inf/subnormal/1e30,
  beta1 0/0.5/0.49999997/2, beta2 0/1/1e-45, eps 0/inf, weight decay up to 1e30, clip
  coefficients 0, 1e-45, 3e38, maximize, amsgrad, 1-3 threads, directed rounding and
  flush-to-zero in one thread, random layouts with zero-length segments and padding): 4
  differed, all under ``torch.set_flush_denormal(True)`` with amsgrad and a subnormal maximum
  (below), none where the register path runs;
- 210 `cotangent.AdamW` configurations against ``clip_grad_norm_`` + ``torch.optim.AdamW``
  (`run_against_native`): byte-equal in all.

The one divergence found is the general path's, not the register path's: under
denormals-are-zero (``torch.set_flush_denormal(True)``, every thread), native's
``torch.maximum(max_exp_avg_sq, exp_avg_sq)`` keeps a subnormal maximum as it is or flushes it
to zero by the element's place in ATen's compiled loops (of 5 tail elements, the first 4 keep
0x00000001 against a zero second moment, the 5th gives 0x00000000), which the kernel does not
follow; the probe passed, its subnormals being zeros already when built under flush-to-zero.
A state with subnormal maxima (a checkpoint saved without flushing) made cotangent.AdamW's
max_exp_avg_sq differ from native's silently (4 of 5 elements, path "single-pass"). Fixed:
amsgrad under denormals-are-zero takes the native path (`singlepass.AMSGRAD_DAZ`) and
`matches_native` answers False there (`test_amsgrad_under_denormals_are_zero_*`).

Kept here, the strongest cases: `CASES` (direct `single_pass_adamw_` against native on each
segment, every byte after every step, for-loop and foreach), float modes that send the pass
to its general path, the amsgrad / denormals-are-zero fix, and controls showing a difference
is caught.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest
import torch

from bitwise import flush_denormal, require_register_path, run_against_native, threads
from cotangent import singlepass as sp
from mutants import use_mutant

require_register_path()

# float32 bit patterns (written as bits: no float conversion, which flush-to-zero would flush)
PZ, NZ = 0x00000000, 0x80000000
SUB, NSUB, SUB2 = 0x00000001, 0x80000001, 0x000116C2  # smallest subnormals, ~1e-40
FMIN, FMAX = 0x00800000, 0x7F7FFFFF
ONE, NONE, TWO_N = 0x3F800000, 0xBF800000, 0xC0000000  # 1, -1, -2
SMALL, NSMALL = 0x3A83126F, 0xBB23D70A  # 1e-3, -2.5e-3
CENT, NCENT, TINY4 = 0x3C23D70A, 0xBC23D70A, 0x38D1B717  # 1e-2, -1e-2, 1e-4
BIG, NBIG, E19 = 0x7F61B1E6, 0xFF61B1E6, 0x5F800000  # 3e38, -3e38, 2**64 (its square: inf)
E30 = 0x7149F2CA  # 1e30
INF, NINF = 0x7F800000, 0xFF800000
QNAN, NNAN, ONES, SNAN, PAY = 0x7FC00000, 0xFFC00000, 0xFFFFFFFF, 0x7F800001, 0x7FC000AB

# NaN-free values (register-path vectors): every pairing through coprime cycle lengths
CLEAN = dict(grad=[PZ, NZ, SUB, NSUB, SMALL, NSMALL, BIG, ONE, E19 - 1, SUB2, NBIG],
             exp_avg=[PZ, NZ, SUB, CENT, NCENT, E30],
             exp_avg_sq=[PZ, NZ, SUB, TINY4, INF, FMIN, FMAX],
             max_exp_avg_sq=[PZ, TINY4, INF, NZ, SUB, E30, FMIN, SUB2],
             param=[ONE, NZ, PZ, TWO_N, INF, NINF, SUB, BIG, NSUB])


def bits(values: list[int], n: int, shift: int = 0) -> torch.Tensor:
    """float32 tensor of `n` elements cycling through the bit patterns `values` from `shift`."""
    idx = (torch.arange(n) + shift) % len(values)
    pattern = torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values],
                           dtype=torch.int64).to(torch.int32)
    return pattern[idx].view(torch.float32).clone()


def layout(lengths: list[int], gaps: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Segments of `lengths` with `gaps[i % len(gaps)]` padding elements before each and 17
    after the last; returns (segments, buffer length)."""
    segments, pos = [], 0
    for i, n in enumerate(lengths):
        pos += gaps[i % len(gaps)]
        segments.append((pos, n))
        pos += n
    return segments, pos + 17  # trailing padding: a full-width store past the end lands in it


def with_lanes(values: dict, size: int, lanes: dict[str, list[tuple[int, int]]],
               grad_shift: int = 0) -> dict[str, torch.Tensor]:
    """The CLEAN values over `size` elements (each key at its own phase), with the bit
    patterns of `lanes` {key: [(index, bits), ...]} written in."""
    out = {k: bits(v, size, 3 * j + (grad_shift if k == "grad" else 0))
           for j, (k, v) in enumerate(values.items())}
    for key, writes in lanes.items():
        for i, b in writes:
            out[key].view(torch.int32)[i % size] = b - (1 << 32) if b >= 1 << 31 else b
    return out


def step_both(segments, size, make, *, implementation, steps=2, lr=1e-3, beta1=0.9,
              beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False, amsgrad=False,
              clip_coef=None, our_lr=None):
    """Native `torch.optim.adam.adam` on one tensor per segment against `single_pass_adamw_`
    over the flat buffers; `make(step)` gives the flat buffers (step 0: every buffer; later
    steps: the gradient). Every byte of parameters, moments, maximum, clipped gradient and
    step counts after every step; raises AssertionError at the first difference."""
    views = lambda t: [t[o:o + n] for o, n in segments]  # noqa: E731
    state = make(0)
    keys = ["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    native = {k: [t.clone() for t in views(state[k])] for k in keys}
    ours = {k: state[k].clone() for k in keys}
    start = [float(i % 3) for i in range(len(segments))]
    native_steps = [torch.tensor(s) for s in start]
    our_steps = [torch.tensor(s) for s in start]
    coef = None if clip_coef is None else torch.tensor(clip_coef, dtype=torch.float32)
    for k in range(steps):
        g = state["grad"] if k == 0 else make(k)["grad"]
        native_grads = [t.clone() for t in views(g)]
        if coef is not None:
            for t in native_grads:
                t.mul_(coef)  # clip_grad_norm_'s multiply
        sp.probes._native_adamw(implementation, native["param"], native_grads, native["exp_avg"],
                         native["exp_avg_sq"], native["max_exp_avg_sq"] if amsgrad else [],
                         native_steps, lr=lr.clone() if torch.is_tensor(lr) else lr,
                         beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                         maximize=maximize, amsgrad=amsgrad)
        ours_g = g.clone()
        with torch.no_grad():
            sp.single_pass_adamw_(
                ours["param"], ours_g, ours["exp_avg"], ours["exp_avg_sq"],
                ours["max_exp_avg_sq"] if amsgrad else None, our_steps, segments=segments,
                implementation=implementation, lr=lr if our_lr is None else our_lr,
                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                maximize=maximize, amsgrad=amsgrad, clip_coef=clip_coef)
        pairs = [("gradient", native_grads, views(ours_g))]
        pairs += [(key, native[key], views(ours[key])) for key in keys[:4 if amsgrad else 3]]
        for what, theirs, mine in pairs:
            for j, (a, b) in enumerate(zip(theirs, mine)):
                ai, bi = a.view(torch.int32), b.view(torch.int32)
                if not torch.equal(ai, bi):
                    d = (ai != bi).nonzero().flatten()
                    i = int(d[0])
                    raise AssertionError(
                        f"step {k}: {what} of segment {j} {segments[j]}: {len(d)} elements "
                        f"differ; first at {i}: native {int(ai[i]) & 0xFFFFFFFF:#010x}, "
                        f"single pass {int(bi[i]) & 0xFFFFFFFF:#010x}")
        assert [s.item() for s in native_steps] == [s.item() for s in our_steps]
        inside = torch.zeros(size, dtype=torch.bool)
        for o, n in segments:
            inside[o:o + n] = True
        for key, mine, before in [(key, ours[key], state[key]) for key in keys] + [
                ("gradient", ours_g, g)]:  # padding neither read into nor written
            assert torch.equal(mine.view(torch.int32)[~inside],
                               before.view(torch.int32)[~inside]), f"padding of {key} written"


def clean(size, lanes=None):
    """`make` for step_both: CLEAN values, the gradient moving by 5 elements a step, with
    `lanes` written in at every step (a gradient lane: in each step's gradient)."""
    return lambda k: with_lanes(CLEAN, size, lanes or {}, grad_shift=5 * k)


# every tail length 1..33 at many alignments mod 16 (gaps 0..15 cycle against the lengths),
# and zero-length segments (nothing to read or write)
TAILS = layout([0] + list(range(1, 17)) + [0] + list(range(17, 34)), list(range(16)))
# one vector per lane position: 17 vectors of 16 in one segment, then 15-element tails
LANES = layout([16 * 17, 15, 15, 7, 1], [0, 5])
BLOCKS = layout([16383, 16384, 16385, 16384 + 15], [0, 3])


def one_per_vector(key: str, patterns: list[int], lane_offset: int = 0, start: int = 0,
                   count: int = 17) -> dict[str, list[tuple[int, int]]]:
    """Vector v (16 elements from `start`) gets patterns[v % len] at lane (v + lane_offset)."""
    return {key: [(start + 16 * v + (v + lane_offset) % 16, patterns[v % len(patterns)])
                  for v in range(count)]}


def merge(*dicts):
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out.setdefault(k, []).extend(v)
    return out


TOP_G = [0x5F7FFFF0 + 3 * i for i in range(5)]  # squares in the top 4096 finite floats
SUB_G = [0x1E3CE508, 0x1D5E0000, 0x1F000000, 0x1F7FFFFF]  # squares subnormal / near FLT_MIN
LANES_START = LANES[0][0][0]
# (id, layout, make(size), step_both keywords, threads)
CASES = [
    ("clean-tails-beta1-0-amsgrad", TAILS, clean, dict(beta1=0.0, amsgrad=True), 2),
    ("clean-tails-maximize-clip", TAILS, clean,
     dict(maximize=True, amsgrad=True, clip_coef=0.5, weight_decay=0.0), 2),
    ("clean-tails-large-weight", TAILS, clean, dict(beta1=0.49999997, beta2=0.0), 1),
    # beta1 = 0 and maximize: the negated gradient's zero sign reaches exp_avg in the body
    ("clean-tails-maximize-beta1-0", TAILS, clean, dict(beta1=0.0, maximize=True), 2),
    ("nan-grad-one-lane-each-vector", LANES,
     lambda n: clean(n, merge(one_per_vector("grad", [QNAN, NNAN, ONES, SNAN, PAY],
                                             start=LANES_START),
                              {"grad": [(LANES[0][1][0] + 3, SNAN)]})),
     dict(amsgrad=True), 2),
    ("nan-exp-avg-and-max-lanes", LANES,
     lambda n: clean(n, merge(one_per_vector("exp_avg", [NNAN, SNAN, PAY], 3, LANES_START),
                              one_per_vector("max_exp_avg_sq", [ONES, QNAN], 7, LANES_START))),
     dict(amsgrad=True, beta1=0.0), 2),
    # NaNs of other payloads in one lane's gradient, exp_avg, exp_avg_sq and maximum: which
    # one a fused multiply-add keeps depends on its operand order (the flags must catch it)
    ("nan-everywhere-in-one-lane", LANES,
     lambda n: clean(n, merge(one_per_vector("grad", [PAY, SNAN, QNAN], 2, LANES_START),
                              one_per_vector("exp_avg", [NNAN, ONES], 2, LANES_START),
                              one_per_vector("exp_avg_sq", [ONES, PAY, SNAN], 2, LANES_START),
                              one_per_vector("max_exp_avg_sq", [SNAN, NNAN], 2, LANES_START))),
     dict(amsgrad=True), 2),
    ("nan-gradient-and-second-moment", LANES,
     lambda n: clean(n, merge(one_per_vector("grad", [PAY, SNAN, NNAN], 11, LANES_START),
                              one_per_vector("exp_avg_sq", [ONES, QNAN, SNAN], 11,
                                             LANES_START))),
     dict(beta1=0.0), 2),
    # a NaN exp_avg (or inf - inf) in vectors shorter than 16 lanes, large lerp weight: there
    # the compiled tail formula fma(-d, 1 - w, grad) flips a NaN's sign (measured: a kernel
    # without the NaN flags gave 0xFFC00001 for native's 0x7FC00001)
    ("nan-in-partial-vectors-large-weight", TAILS,
     lambda n: clean(n, {"exp_avg": [(o + k // 2, [SNAN, QNAN, PAY, INF][j % 4])
                                     for j, (o, k) in enumerate(TAILS[0])],
                         "grad": [(o + k // 2, INF) for j, (o, k) in enumerate(TAILS[0])
                                  if j % 4 == 3]}),
     dict(beta1=0.49999997, weight_decay=0.01), 2),
    ("negative-second-moment-alone", LANES,
     lambda n: clean(n, one_per_vector("exp_avg_sq", [NONE, NSUB, NBIG, NINF], 1,
                                       LANES_START)), dict(), 2),
    ("negative-second-moment-amsgrad", LANES,
     lambda n: clean(n, one_per_vector("exp_avg_sq", [NONE, NSUB, NINF], 2, LANES_START)),
     dict(amsgrad=True), 2),
    ("nan-parameter-alone-no-decay", LANES,
     lambda n: clean(n, one_per_vector("param", [SNAN, NNAN, ONES, PAY], 4, LANES_START)),
     dict(weight_decay=0.0), 2),
    ("nan-parameter-alone-decay", LANES,
     lambda n: clean(n, one_per_vector("param", [SNAN, QNAN, ONES], 9, LANES_START)),
     dict(weight_decay=0.5), 2),
    ("inf-minus-inf-in-lerp", LANES,
     lambda n: clean(n, merge(one_per_vector("grad", [INF, NINF], 0, LANES_START),
                              one_per_vector("exp_avg", [NINF, INF, PZ], 0, LANES_START))),
     dict(beta1=0.0), 2),
    ("inf-gradient-small-weight", LANES,
     lambda n: clean(n, one_per_vector("grad", [INF, NINF], 5, LANES_START)),
     dict(amsgrad=True), 2),
    ("second-moment-overflow", LANES,
     lambda n: (lambda k: with_lanes(dict(CLEAN, grad=[BIG, E19, E19 - 1, NBIG, FMAX, ONE]),
                                     n, {}, 5 * k)),
     dict(beta2=0.0, amsgrad=True), 2),
    ("emulated-sqrt-edges-in-registers", TAILS,
     lambda n: (lambda k: with_lanes(dict(CLEAN, grad=TOP_G + SUB_G + [PZ, FMIN]), n, {}, k)),
     dict(beta2=0.0, eps=0.0, weight_decay=0.0), 2),
    ("beta2-one", LANES, clean, dict(beta2=1.0, amsgrad=True), 2),
    ("eps-zero", LANES, clean, dict(eps=0.0), 2),
    ("lr-zero-signed-zeros", TAILS, clean, dict(lr=0.0, weight_decay=0.5), 2),
    ("lr-inf", LANES, clean, dict(lr=float("inf"), weight_decay=0.01), 2),
    ("huge-weight-decay", LANES, clean, dict(weight_decay=1e30, amsgrad=True), 2),
    ("clip-zero-maximize", LANES,
     lambda n: clean(n, one_per_vector("grad", [INF, NZ, NINF], 6, LANES_START)),
     dict(clip_coef=0.0, maximize=True), 2),
    ("clip-subnormal", TAILS, clean, dict(clip_coef=float(torch.tensor(1e-45)), beta1=0.0), 2),
    ("block-edges-nan-in-last-vector", BLOCKS,
     lambda n: clean(n, {"grad": [(o + k - 1 - j, QNAN) for o, k in BLOCKS[0] for j in (0, 9)],
                         "exp_avg_sq": [(o + 16384 - 2, NONE) for o, _ in BLOCKS[0]]}),
     dict(amsgrad=True, beta1=0.0), 2),
    ("thread-chunks-1", layout([40000, 65537, 32769, 17], [0, 7]), clean,
     dict(amsgrad=True, beta1=0.0), 1),
    ("thread-chunks-2", layout([40000, 65537, 32769, 17], [0, 7]), clean,
     dict(amsgrad=True, beta1=0.0, maximize=True), 2),
    ("thread-chunks-3", layout([40000, 65537, 32769, 17], [0, 7]), clean,
     dict(amsgrad=True, beta1=0.0), 3),
]


@pytest.mark.parametrize("implementation", sp.IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_register_path_cases(case, implementation):
    name, (segments, size), make, kw, nthreads = case
    assert sp.sqrt_kind() in ("emulated", "hardware")  # the kinds the register path takes
    with threads(nthreads):
        step_both(segments, size, make(size), implementation=implementation, **kw)


def test_tensor_lr_for_loop():
    segments, size = TAILS
    for dtype in (torch.float32, torch.float64):
        with threads(2):
            step_both(segments, size, clean(size), implementation="for-loop",
                      lr=torch.tensor(1e-3, dtype=dtype), amsgrad=True)


def test_control_the_comparison_sees_another_lr():
    """Control: the same case with the single pass at another lr is reported."""
    segments, size = TAILS
    with threads(2), pytest.raises(AssertionError, match="differ"):
        step_both(segments, size, clean(size), implementation="for-loop", our_lr=2e-3)


@pytest.mark.slow
def test_control_a_kernel_without_the_nan_flags_is_caught(monkeypatch):
    """Control: the kernel built without those flags (NaN vectors then stay in registers)
    fails the partial-vector case (measured with g++ here: exp_avg 0xFFC00001 for native's
    0x7FC00001, a NaN whose sign flipped); the shipped one passes it (above). Either flag
    alone is redundant here: each one's NaNs reach the other too."""
    use_mutant(monkeypatch, "register-nan-flags-dropped")  # (grad - exp_avg, the quotient)
    name, (segments, size), make, kw, nthreads = next(
        c for c in CASES if c[0] == "nan-in-partial-vectors-large-weight")
    with threads(nthreads), pytest.raises(AssertionError, match="differ"):
        step_both(segments, size, make(size), implementation="for-loop", **kw)


# ------------------------------------------------------------------ float modes (general path)

LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6") if sys.platform.startswith(
    "linux") else None


@pytest.mark.skipif(LIBM is None, reason="fesetround through glibc's libm: Linux only")
@pytest.mark.parametrize("mode", [0x800, 0x400, 0xC00], ids=["upward", "downward", "zero"])
def test_directed_rounding_one_thread(mode):
    """The calling thread rounding otherwise (one ATen thread: the team is that thread): the
    imitated square root needs the default MXCSR, so the general path runs; native's bytes."""
    segments, size = TAILS
    make = clean(size)
    with threads(1):
        assert LIBM.fesetround(mode) == 0
        try:
            step_both(segments, size, make, implementation="for-loop", amsgrad=True,
                      beta1=0.0)
        finally:
            LIBM.fesetround(0)


@pytest.mark.parametrize("implementation", sp.IMPLEMENTATIONS)
def test_flush_to_zero_without_amsgrad(implementation):
    """Flush-to-zero and denormals-are-zero (torch.set_flush_denormal), subnormals in every
    buffer: without amsgrad the general path gives native's bytes."""
    segments, size = TAILS
    make = clean(size)
    with threads(1), flush_denormal():
        step_both(segments, size, make, implementation=implementation, beta1=0.0)


def _subnormal_maximum(n: int = 5) -> dict:
    return dict(param=bits([PZ], n), grad=bits([PZ], n), exp_avg=bits([PZ], n),
                exp_avg_sq=bits([PZ], n), max_exp_avg_sq=bits([SUB], n))


def test_amsgrad_under_denormals_are_zero_native_depends_on_position():
    """Why amsgrad is refused there: native's maximum (``torch.maximum(max_exp_avg_sq,
    exp_avg_sq)``, one thread, flushing on) keeps the same subnormal maximum against the same
    +0.0 in the first 4 of 5 elements and flushes it in the 5th, a rule of ATen's compiled loops
    (measured on torch 2.13.0 with AVX-512 and with AVX2). On the AVX-512 machine the kernel
    gave 0x00000000 in 4 of those 5 elements; on an AVX2 one it happened to agree on these 5,
    which says nothing about other lengths and positions."""
    buffers = _subnormal_maximum()
    with threads(1), flush_denormal():
        out = torch.maximum(buffers["max_exp_avg_sq"], buffers["exp_avg_sq"])
    assert out.view(torch.int32).tolist() == [SUB, SUB, SUB, SUB, PZ]


def test_amsgrad_under_denormals_are_zero_probe_and_gate_refuse():
    group = dict(betas=(0.9, 0.999), lr=1e-3, weight_decay=0.01, eps=1e-8, amsgrad=True,
                 maximize=False)
    with threads(1):
        assert sp.matches_native(implementation="for-loop", lr=1e-3, beta1=0.9, beta2=0.999,
                                 eps=1e-8, weight_decay=0.01, maximize=False, amsgrad=True,
                                 lengths=(17,), grid=False, steps=1)
        with flush_denormal():
            assert not sp.matches_native(implementation="for-loop", lr=1e-3, beta1=0.9,
                                         beta2=0.999, eps=1e-8, weight_decay=0.01,
                                         maximize=False, amsgrad=True, lengths=(17,),
                                         grid=False, steps=1)
            assert sp.key_parts("for-loop", group) == sp.AMSGRAD_DAZ
            assert isinstance(sp.key_parts("for-loop", dict(group, amsgrad=False)), tuple)


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_amsgrad_under_denormals_are_zero_cotangent_adamw(foreach):
    """cotangent.AdamW, every thread flushing (one thread), a subnormal maximum loaded into
    the state after the first step (as from a checkpoint saved without flushing) and zero
    gradients: before the fix max_exp_avg_sq differed in 4 of 5 elements, path "single-pass";
    now native's path and bytes."""
    def deliver(step, params):
        for p in params:
            p.grad = bits([SMALL if step == 0 else PZ], p.numel()).reshape(p.shape)

    def edit(step, params, opt):
        if step == 1:
            for p in params:
                opt.state[p]["max_exp_avg_sq"].view(torch.int32).fill_(SUB)
                opt.state[p]["exp_avg_sq"].view(torch.int32).fill_(PZ)

    with threads(1), flush_denormal():
        rows = run_against_native([torch.zeros(5), torch.zeros(37), torch.zeros(31)],
                                  foreach=foreach, deliver=deliver, steps=3, edit=edit,
                                  adamw=dict(amsgrad=True))
    problems = [(step, problem) for step, problem, _, _ in rows if problem]
    assert not problems, problems
    paths = [path for _, _, path, _ in rows]
    assert all(p["path"] == "native" for p in paths), paths
    assert any(sp.AMSGRAD_DAZ in n for n in paths[1]["single_pass_notes"]), paths[1]
