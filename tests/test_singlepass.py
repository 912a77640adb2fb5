"""The single-pass AdamW kernel (cotangent.singlepass) against native torch.optim.AdamW, byte for
byte: for-loop and foreach, float32 CPU, over flat buffers holding several native tensors; then
cotangent.AdamW with the single pass in its update (and its gates: a failing probe, no compiler,
COTANGENT_SINGLE_PASS=0, re-probing on edits) against clip_grad_norm_ + torch.optim.AdamW."""

from __future__ import annotations

import array
import ctypes
import warnings
from pathlib import Path

import pytest
import torch

import cotangent
from bitwise import (assert_same_bits, assert_same_update, require_register_path,
                     require_single_pass_kernel, same_bits, threads)
from cases import drive, Side
from cotangent import _build, calibration, tensorlists
from cotangent import singlepass as sp
from cotangent.calibration import sprinkle_special_values
from mutants import use_mutant

require_single_pass_kernel()

# around the vector unit (16) and the thread split (GRAIN_SIZE), one above 2 * GRAIN_SIZE whose
# two thread chunks (2 threads) end in scalar tails
LENGTHS = (1, 7, 15, 16, 17, 33, 100, 1000, 2049, 32769, 65553)


def run_both(*, implementation="for-loop", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
             weight_decay=0.01, maximize=False, amsgrad=False, steps=3, lengths=LENGTHS,
             seed=0, our_lr=None, our_threads=None, grid=True, plain=False, grid_copies=1,
             step_buffer=False, each_step=True):
    """torch.optim.AdamW on one tensor per segment of the probe layout (`sp.probe_data`: random
    lengths with special values sprinkled in, and with `grid` every combination of special
    gradient / moment values in vector-body and scalar-tail segments) vs the single pass over
    the flat buffers. `plain`: random values only. `each_step`: every byte compared after each
    step too (a difference a later step overwrites still counts). Returns (native params,
    native states, our views of param / exp_avg / exp_avg_sq / max_exp_avg_sq, our steps)."""
    segments, state, start, grad = sp.probe_data(tuple(lengths), seed, grid, grid_copies)
    if plain:
        gen = torch.Generator().manual_seed(seed)
        for key in state:
            state[key] = torch.rand(state[key].numel(), generator=gen) * 1e-3
        grad = lambda k: torch.randn(state["param"].numel(), generator=gen)  # noqa: E731
    views = lambda t: [t[o:o + n] for o, n in segments]  # noqa: E731
    params = [torch.nn.Parameter(t.clone()) for t in views(state["param"])]
    opt = torch.optim.AdamW(params, lr=lr.clone() if torch.is_tensor(lr) else lr, betas=betas,
                            eps=eps, weight_decay=weight_decay, maximize=maximize,
                            amsgrad=amsgrad, foreach=implementation == "foreach",
                            fused=implementation == "fused")
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    for i, q in enumerate(params):
        opt.state[q] = dict(step=torch.tensor(start[i]))
        opt.state[q].update({k: views(state[k])[i].clone() for k in keys})
    ours = [state[k] for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
    our_steps = torch.tensor(start) if step_buffer else [torch.tensor(s) for s in start]
    for k in range(steps):
        g = grad(k)
        for q, t in zip(params, views(g)):
            q.grad = t.clone()
        opt.step()
        with torch.no_grad():
            sp.single_pass_adamw_(
                ours[0], g, ours[1], ours[2], ours[3] if amsgrad else None, our_steps,
                segments=segments, implementation=implementation,
                lr=lr if our_lr is None else our_lr, beta1=betas[0], beta2=betas[1], eps=eps,
                weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad,
                threads=our_threads)
        if each_step:
            assert_all_equal(params, [opt.state[q] for q in params], [views(t) for t in ours],
                             our_steps, amsgrad, f"after step {k}")
    return params, [opt.state[q] for q in params], [views(t) for t in ours], our_steps


def assert_all_equal(params, states, ours, our_steps, amsgrad, what):
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    for i, (q, st) in enumerate(zip(params, states)):
        assert_same_bits(ours[0][i], q.detach(), f"{what}: param {i} ({q.numel()} elements)")
        for j, key in enumerate(keys):
            assert_same_bits(ours[1 + j][i], st[key], f"{what}: {key} {i}")
        assert_same_bits(our_steps[i], st["step"], f"{what}: step {i}")


SETTINGS = [
    dict(),
    dict(weight_decay=0.0),
    dict(maximize=True, amsgrad=True, weight_decay=0.1),
    dict(amsgrad=True, weight_decay=0.0),
    dict(betas=(0.3, 0.5), eps=0.0, weight_decay=0.5),  # lerp's large-weight branch
    dict(betas=(0.0, 0.0), lr=10.0, weight_decay=0.3, amsgrad=True),
    dict(lr=float("inf"), weight_decay=0.1),  # decay -inf, step size inf: generated NaNs
    dict(lr=1e-30, betas=(0.999999, 0.9999999), eps=1e-30),
]


@pytest.mark.parametrize("implementation", sp.KINDS)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in
                                                                     s.items()) or "defaults")
def test_single_pass_equals_native(implementation, setting):
    with threads(2):
        out = run_both(implementation=implementation, **setting)
    assert_all_equal(*out, setting.get("amsgrad", False), f"{implementation} {setting}")


@pytest.mark.parametrize("lr", [torch.tensor(1e-3), torch.tensor(3e-4, dtype=torch.float64),
                                torch.tensor([2e-3])], ids=["f32", "f64", "1-d"])
def test_tensor_lr_for_loop(lr):
    with threads(2):
        out = run_both(lr=lr, weight_decay=0.2, amsgrad=True, maximize=True)
    assert_all_equal(*out, True, f"tensor lr {lr}")


def test_steps_as_one_buffer():
    """The step counts may be one 1-D float32 tensor (a shared step buffer) instead of 0-d
    tensors: same bits, native's step values."""
    with threads(2):
        out = run_both(step_buffer=True, amsgrad=True, weight_decay=0.1)
    assert_all_equal(*out, True, "1-D step buffer")


def test_one_thread_and_three_million_plain_values():
    with threads(1):
        out = run_both(amsgrad=True, weight_decay=0.1, steps=3)
    assert_all_equal(*out, True, "1 thread")
    with threads(2):
        out = run_both(lengths=(3_000_001,), steps=3, grid=False, plain=True, weight_decay=0.1)
    assert_all_equal(*out, False, "3M elements, 2 threads")


def test_controls_the_comparison_catches_differences():
    # another lr: other bytes
    with threads(2):
        params, states, ours, steps = run_both(our_lr=1.0001e-3, steps=2, each_step=False)
    assert not same_bits(ours[0][9], params[9].detach())  # 32769 random elements
    # amsgrad with the tails of a 1-thread split while native split its work over 2 threads:
    # the NaNs torch.maximum writes in the tails of the thread chunks differ (0x7FC00000 vs
    # 0xFFFFFFFF), so where native's tails are is part of the result
    with threads(2):
        params, states, ours, steps = run_both(amsgrad=True, lengths=(65553,), our_threads=1,
                                               steps=3, grid=False, each_step=False)
    assert not same_bits(ours[3][0], states[0]["max_exp_avg_sq"])


def test_hardware_square_root_is_not_torch_sqrt(monkeypatch):
    """torch.sqrt (float32, CPU, MKL build) is MKL's vmsSqrt, not a correctly rounded square
    root; a pass with the hardware square root gives other parameters and the probe says so."""
    if sp.sqrt_kind() not in ("mkl", "emulated", "emulated14"):
        pytest.skip("this torch build's sqrt is not MKL's")
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    assert not same_bits(torch.sqrt(x), x.double().sqrt().float())  # CR sqrt != torch's
    kw = dict(implementation="for-loop", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01, maximize=False, amsgrad=False, lengths=(1000, 40000), steps=3)
    with threads(2):
        assert sp.matches_native(**kw)
        monkeypatch.setattr(sp.kernel, "sqrt_kind", lambda: "hardware")
        assert not sp.matches_native(**kw)


# float32 bit patterns at every edge of the MKL square root imitations' branches: zeros,
# subnormals, the smallest normals, 2**-100, 1 and 4 (exponent parities), the top 4096 finite values
# (taken apart: MKL is correctly rounded there), infinities, NaN payloads of both signs,
# negative subnormals and normals
SQRT_EDGES = (0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x00800001,
              0x0D7FFFFF, 0x0D800000, 0x0D800001,  # (2**-100: the Intel imitation scales below)
              0x3F800000, 0x3F800001, 0x407FFFFF, 0x40800000, 0x7F7FEFFF, 0x7F7FF000,
              0x7F7FF001, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF,
              0xFF800000, 0xFF800001, 0xFFC00000, 0xFFFFFFFF, 0x80000001, 0x807FFFFF,
              0x80800000, 0xBF800000, 0xFF7FFFFF)


def _edge_patterns() -> torch.Tensor:
    bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in SQRT_EDGES],
                        dtype=torch.int64)
    near = (bits[:, None] + torch.arange(-40, 41)).clamp(-(1 << 31), (1 << 31) - 1)
    return near.reshape(-1).to(torch.int32).view(torch.float32).contiguous()


EMULATIONS = ("emulated", "emulated14")  # the imitations of MKL's vmsSqrt (AMD, Intel AVX-512)


def _emulated_sqrt(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    sp.kernel._lib().cot_singlepass_sqrt(x.numel(), x.data_ptr(), out.data_ptr(),
                                         sp.sqrt_address(sp.sqrt_kind()), sp.MKL_SQRT_MODE)
    return out


def test_emulated_square_root_is_torch_sqrt_at_every_edge():
    """Where `sqrt_kind` chose an imitation of MKL's vmsSqrt (the AMD one on Zen 5 and an AVX2
    EPYC, the Intel one on an AVX-512 Xeon, each after checking 2.17G inputs there), it gives
    torch.sqrt's bytes at every branch edge (3 more lengths than a block: the masked
    remainder), also with subnormals flushed in the calling thread (MKL runs with flushing off,
    so does the imitation, and the caller's MXCSR comes back unchanged)."""
    if sp.sqrt_kind() not in EMULATIONS:
        pytest.skip("no MKL square root imitation was proven on this CPU (another estimate "
                    "table or MKL code path): the kernel calls MKL instead")
    x = _edge_patterns()
    for n in (x.numel(), 17, 5):
        assert_same_bits(_emulated_sqrt(x[:n]), torch.sqrt(x[:n]), f"{n} edge patterns")
    before = sp.mxcsr()
    torch.set_flush_denormal(True)
    try:
        flushing = sp.mxcsr()
        assert flushing != before
        assert_same_bits(_emulated_sqrt(x), torch.sqrt(x), "flushing thread")
        assert sp.mxcsr() == flushing
    finally:
        torch.set_flush_denormal(False)
    # control: a correctly rounded square root is not torch.sqrt on the same kind of inputs
    y = torch.rand(4096, generator=torch.Generator().manual_seed(3)) + 1.0
    assert not same_bits(y.double().sqrt().float(), torch.sqrt(y))


def test_emulation_gate_keeps_the_mkl_call_when_a_pattern_differs(monkeypatch, tmp_path):
    """`emulation_matches` reports one differing pattern among those it checks; `sqrt_kind`
    then keeps calling MKL (the previous path), and the verdict is cached per CPU model and
    build."""
    if sp.emulated_sqrt_address() is None or sp.mkl_sqrt_address() is None:
        pytest.skip("no MKL square root imitation in this build or no MKL")
    span = (range(0x3F800000, 0x3F800000 + 70_000),)
    kind = sp.sqrt_kind()
    address = sp.sqrt_address(kind) if kind in EMULATIONS else sp.emulated_sqrt_address()

    def off_by_one_bit(x, out):
        torch.sqrt(x, out=out)
        out.view(torch.int32)[x.view(torch.int32) == 0x3F80F00D] ^= 1
        return out

    if kind in EMULATIONS:
        assert sp.emulation_matches(address, patterns=span, chunk=1 << 14)
    assert not sp.emulation_matches(address, off_by_one_bit, patterns=span, chunk=1 << 14)
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sp.kernel, "emulation_matches", lambda address: False)
    sp.sqrt_kind.cache_clear()
    try:
        assert sp.sqrt_kind() == "mkl"
    finally:
        sp.sqrt_kind.cache_clear()


@pytest.mark.parametrize("unstable", ["first call", "every call"])
def test_the_square_roots_reference_is_two_calls_that_agree(monkeypatch, unstable):
    """A process's first torch.sqrt over NaN and negative inputs was seen to differ from later
    calls in one thread's share (an Intel Xeon VM, about one process in eight): `sqrt_kind`
    takes its reference once two calls in a row agree (the kind it chooses unchanged), and
    chooses none when no two calls do."""
    kind = sp.sqrt_kind()
    if kind is None:
        pytest.skip("no square root reproduces torch.sqrt here")
    real = torch.sqrt
    calls = []

    def sqrt(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        if args or kwargs:  # (emulation_matches' reference, called with out=)
            return out
        calls.append(1)
        if unstable == "every call" or len(calls) == 1:
            out = out.clone()
            out.view(torch.int32)[: out.numel() // 2] += len(calls)  # one thread's share, off
        return out

    monkeypatch.setattr(torch, "sqrt", sqrt)
    sp.sqrt_kind.cache_clear()
    try:
        chosen = sp.sqrt_kind()
    finally:
        monkeypatch.undo()
        sp.sqrt_kind.cache_clear()
    assert len(calls) >= 2
    assert chosen == (kind if unstable == "first call" else None)
    assert sp.sqrt_kind() == kind


def test_probe_passes_for_default_settings():
    with threads(2):
        for implementation in ("for-loop", "foreach"):
            assert sp.matches_native(implementation=implementation, lr=1e-3, beta1=0.9,
                                     beta2=0.95, eps=1e-8, weight_decay=0.1, maximize=False,
                                     amsgrad=True)


def test_native_foreach_equals_native_for_loop_on_cpu():
    """Recorded fact (CPU, float32): both native implementations give the same bytes here."""
    with threads(2):
        a = run_both(implementation="for-loop", amsgrad=True, steps=3)
        b = run_both(implementation="foreach", amsgrad=True, steps=3)
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        for sa, sb in zip(a[1], b[1]):
            assert_same_bits(sa[key], sb[key], key)
    for pa, pb in zip(a[0], b[0]):
        assert_same_bits(pa.detach(), pb.detach(), "param")


def test_refusals_leave_everything_unmodified():
    n = 40
    bufs = [torch.randn(n) for _ in range(4)]
    before = [t.clone() for t in bufs]
    step = torch.tensor(0.0)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False,
              amsgrad=False)
    cases = [
        (ValueError, dict(kw, beta1=torch.tensor(0.9))),
        (ValueError, dict(kw, lr=torch.tensor(1e-3), implementation="foreach")),
        (ValueError, dict(kw, implementation="fusedd")),
        (ValueError, dict(kw, lr=torch.tensor(1e-3), implementation="fused")),
        (ValueError, dict(kw, segments=[(0, 30), (30, 10)])),  # two segments, one step
        (ValueError, dict(kw, segments=[(30, 20)])),  # past the end of the buffers
    ]
    for error, args in cases:
        with pytest.raises(error):
            sp.single_pass_adamw_(*bufs, None, [step], **args)
    with pytest.raises(ValueError):
        sp.single_pass_adamw_(bufs[0], bufs[1][:30], bufs[2], bufs[3], None, [step], **kw)
    with pytest.raises(TypeError):
        sp.single_pass_adamw_(bufs[0].double(), *bufs[1:], None, [step], **kw)
    for a, b in zip(bufs, before):
        assert_same_bits(a, b, "buffer after a refused call")
    assert step.item() == 0.0


def test_build_is_cached_and_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    """The builder compiles a source once into the kernel cache and loads it from there
    afterwards (the library's name is its build key); without `COTANGENT_KERNEL_CACHE_DIR` that
    cache is the `kernels` folder of `COTANGENT_CACHE_DIR`, with it there, `off`: a folder of
    the process's own. The kernel itself comes from the kernel cache the same way. Shown on a
    one-function source (each build of the kernel itself takes 6-14 s)."""
    source, flags = "extern \"C\" int cot_answer() { return 42; }\n", ("-shared", "-fPIC")
    monkeypatch.delenv("COTANGENT_KERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    first = _build.compile_cached("answer", source, flags)
    second = _build.compile_cached("answer", source, flags)
    assert not first.cached and first.compile_s > 0
    assert second.cached and second.path == first.path and second.compile_s == 0.0
    assert first.path.parent == tmp_path / "kernels"
    assert ctypes.CDLL(str(first.path)).cot_answer() == 42
    other = _build.compile_cached("answer", source, flags + ("-O1",))
    assert not other.cached and other.path != first.path  # (flags are part of the key)
    monkeypatch.setenv("COTANGENT_KERNEL_CACHE_DIR", str(tmp_path / "elsewhere"))
    third = _build.compile_cached("answer", source, flags)
    assert not third.cached and third.path.parent == tmp_path / "elsewhere"
    assert third.path.name == first.path.name
    monkeypatch.setenv("COTANGENT_KERNEL_CACHE_DIR", "off")
    assert _build.cache_dir() is None
    monkeypatch.undo()
    kernel = sp.build()  # this session's kernel: from the session's kernel cache
    assert Path(kernel.path).parent == _build.cache_dir()
    monkeypatch.setattr(_build, "compiler", lambda: None)
    monkeypatch.setattr(tensorlists, "_STATE", {})  # (the reader too: restored afterwards)
    with pytest.raises(sp.SinglePassUnavailable, match="no C\\+\\+ compiler"):
        sp.kernel._build_locked()


def test_native_pieces_follow_aten_thread_split():
    assert sp.thread_chunks(32768, 2) == [(0, 32768)]  # not above the grain: one chunk
    assert sp.thread_chunks(32769, 2) == [(0, 16385), (16385, 32769)]
    assert sp.thread_chunks(100, 1) == [(0, 100)]
    pieces = sp.native_pieces((33, 32769), 2, 16, True).tolist()
    assert pieces == [[0, 32, 0, 0], [32, 1, 0, 1], [0, 16384, 1, 0], [16384, 1, 1, 1],
                      [16385, 16384, 1, 0]]
    assert sp.aten_vector_unit() in (16, 32)  # 2 x Vectorized<float>: AVX2 16, AVX512 32


@pytest.mark.slow
def test_probe_catches_a_kernel_that_rounds_one_branch_differently(monkeypatch):
    """A kernel whose scalar-tail lerp (weight 1: beta1 = 0) used the vector body's formula
    differs from native only in the sign of some zeros; the probe's special-value grid in
    tail segments finds it, and the shipped kernel passes the same probe."""
    kw = dict(implementation="for-loop", lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8,
              weight_decay=0.1, maximize=False, amsgrad=False, lengths=(33,), steps=2)
    with threads(2):
        assert sp.matches_native(**kw)
        use_mutant(monkeypatch, "tail-lerp-as-body")  # (general and register paths)
        sp.sqrt_kind.cache_clear()
        try:
            assert not sp.matches_native(**kw)
        finally:
            sp.sqrt_kind.cache_clear()


# each path's addcdiv_ division through the reciprocal (other bytes wherever that path runs)
@pytest.mark.parametrize("mutated,plain,equal", [
    ("register-div-reciprocal", True, False),  # clean vectors take the register path
    ("general-div-reciprocal", True, True),    # ... and never the general one
    ("general-div-reciprocal", False, False),  # vectors with a NaN are redone by the general path
], ids=["register-clean", "general-clean", "general-nan"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.slow
def test_register_path_takes_clean_vectors_and_the_general_path_those_with_a_nan(
        mutated, plain, equal, amsgrad, monkeypatch):
    """Which path updates which vector, shown by breaking one path at a time: the kernel keeps
    a vector in registers unless one of its lanes meets a NaN, and then redoes it element by
    element. (Both unbroken paths give native's bytes: the other tests.)"""
    require_register_path()
    assert sp.sqrt_kind() in (*EMULATIONS, "hardware")  # the kinds the register path takes
    use_mutant(monkeypatch, mutated)
    with threads(2):
        params, states, ours, steps = run_both(plain=plain, steps=2, weight_decay=0.1,
                                               amsgrad=amsgrad, each_step=False)
    same = all(same_bits(o, q.detach()) for o, q in zip(ours[0], params))
    assert same == equal


# register-path edits a plausible rewrite could make, each giving other bytes somewhere: the
# tail's maximum computed like the body's differs only for a -0.0 maximum against a +0.0
# second moment, in the state of one step (the next step overwrites it); a NaN maximum left in
# the register path misses torch.maximum's own NaN
REGISTER_MUTATIONS = ("tail-maximum-as-body", "body-maximum-as-tail", "nan-maximum-kept")


@pytest.mark.parametrize("name", REGISTER_MUTATIONS)
@pytest.mark.slow
def test_probe_rejects_a_register_path_that_differs_from_native(name, monkeypatch):
    kw = dict(implementation="for-loop", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.1, maximize=False, amsgrad=True)
    require_register_path()
    with threads(2):
        assert sp.matches_native(**kw)  # the shipped kernel
        use_mutant(monkeypatch, name)
        assert not sp.matches_native(**kw)


# ------------------------------------------------------------ cotangent.AdamW with the single pass



IN = 49


def small_model() -> torch.nn.Module:
    """34,300 + 700 + 3,500 + 5 + 5 + 5 parameters in 6 tensors: one above ATen's grain size
    (at 2 threads two chunks of 17,150, each ending in a 14-element scalar tail; at 1 thread
    one chunk with a 12-element tail), the others tail-only or body + tail."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 700), torch.nn.GELU(),
                               torch.nn.Linear(700, 5), torch.nn.LayerNorm(5))


def write_specials(grad: torch.Tensor, shift: int) -> None:
    """Special values (inf, NaN of both signs and all-ones bits, signed zeros, a subnormal)
    at a few positions, and cycling through every element around the middle (where a 2-thread
    split puts a chunk's scalar tail) and in the last 40 elements (the last tail)."""
    flat = grad.view(-1)
    sprinkle_special_values([flat], shift=shift)
    n, k = flat.numel(), len(calibration.SPECIAL_VALUES)
    for i in list(range(max(0, n // 2 - 24), min(n, n // 2 + 24))) + list(range(max(0, n - 40),
                                                                              n)):
        calibration.write_special(flat, i, calibration.SPECIAL_VALUES[(i + shift) % k])


def without_single_pass(verdicts: dict) -> dict:
    return {k: v for k, v in verdicts.items() if not k.startswith(sp.PROBE_KIND + "|")}


@pytest.fixture
def fresh_verdicts(tmp_path, monkeypatch):
    """No single-pass verdict known: a new calibration cache file, no single-pass verdict in
    memory (the other probes' verdicts are kept: they are not what these tests are about)."""
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", without_single_pass(calibration._MEMORY))
    monkeypatch.setattr(calibration, "_LOADED", set())
    monkeypatch.setattr(sp.verdicts, "_VERDICTS", {})
    monkeypatch.setattr(sp.verdicts, "_PROBES", 0)
    monkeypatch.setattr(sp.verdicts, "_PROBE_S", 0.0)
    monkeypatch.delenv(sp.ENV_SWITCH, raising=False)
    return tmp_path


def native_vs_cotangent(*, foreach: bool, steps: int = 4, max_norm=None, specials=False,
                        edit=None, models=None, path="single-pass", clip_in_pass=None,
                        fused: bool = False, **adamw):
    """`steps` steps of native (clip_grad_norm_ + torch.optim.AdamW) and cotangent.AdamW on
    copies of `small_model` with a real backward on the same batch; every parameter, gradient,
    moment and step compared byte for byte after each step, and the path cotangent took
    (`update_path()["path"]`) checked against `path` (a string, or a function of the step), and
    its ``clip_in_pass`` count against `clip_in_pass` where given (the same).
    `specials`: after each backward, both arms' gradients get inf, NaN (both signs, payloads),
    signed zeros and a subnormal written in. `edit(step, model, opt)` runs on both arms before
    a step. A pattern run by `cases.drive`. Returns (native model, native optimizer, our model,
    our optimizer)."""
    m1, m2 = models or (small_model(), small_model())
    native_adamw = {k: v.clone() if torch.is_tensor(v) else v for k, v in adamw.items()}
    ref = torch.optim.AdamW(m1.parameters(), foreach=foreach, fused=fused, **native_adamw)
    opt = cotangent.AdamW(m2.parameters(), foreach=foreach, fused=fused, max_norm=max_norm,
                          **adamw)
    what = f"foreach={foreach} {adamw} max_norm={max_norm}"

    def loop(side):  # (a pattern for `cases.drive`)
        model, o = side.model, side.opts[0]
        gen = torch.Generator().manual_seed(1)
        for step in range(steps):
            x = torch.randn(4, IN, generator=gen).to(next(model.parameters()).dtype)
            if edit is not None:
                edit(step, model, o)
            model(x).square().mean().backward()
            if specials:
                for p in model.parameters():
                    write_specials(p.grad, step)
            side.step(o, max_norm=max_norm)
            yield step
            o.zero_grad()

    def check_path(step):
        want = path(step) if callable(path) else path
        assert opt.update_path()["path"] == want, (what, step, opt.update_path())
        if clip_in_pass is not None:
            want = clip_in_pass(step) if callable(clip_in_pass) else clip_in_pass
            assert opt.update_path()["clip_in_pass"] == want, (what, step, opt.update_path())

    drive(loop, Side(m1, True, opts=(ref,)), Side(m2, False, opts=(opt,)), what,
          at_point=check_path)
    return m1, ref, m2, opt


ADAMW_SETTINGS = [
    dict(max_norm=1.0),
    dict(max_norm=0.05, amsgrad=True, maximize=True, weight_decay=0.1, betas=(0.0, 0.99)),
    dict(weight_decay=0.0, specials=True, amsgrad=True),
    dict(lr=3.0, betas=(0.3, 0.5), eps=0.0, weight_decay=0.5, specials=True),
]


@pytest.mark.parametrize("impl", sp.KINDS)
@pytest.mark.parametrize("setting", ADAMW_SETTINGS, ids=lambda s: ",".join(
    f"{k}={v}" for k, v in s.items()))
def test_adamw_single_pass_gives_native_bytes(impl, setting):
    with threads(2):
        *_, opt = native_vs_cotangent(foreach=impl == "foreach", fused=impl == "fused",
                                      **setting)
    summary = opt.update_path()
    assert summary["single_pass"] == 6 and summary["native"] == 0, summary


def test_adamw_single_pass_tensor_lr_and_one_thread():
    """A tensor lr (for-loop: native foreach refuses it), and the thread count changed mid-run
    (the scalar tails move: a new verdict for 1 thread, then back to 2)."""
    def edit(step, model, opt):
        torch.set_num_threads(1 if step == 2 else 2)

    with threads(2):
        native_vs_cotangent(foreach=False, lr=torch.tensor(2e-3), amsgrad=True, max_norm=1.0,
                            weight_decay=0.2, edit=edit)


def test_adamw_single_pass_with_missing_gradients_and_a_strided_parameter():
    """A parameter without a gradient at some steps (native skips it: the single pass gets the
    others' tensors and their step counts), and a transposed (non-contiguous but dense)
    parameter, which the pass updates in memory order, as ATen's iterator does (its gradient
    and moments share its strides)."""
    def models():
        pair = []
        for _ in range(2):
            m = small_model()
            torch.manual_seed(2)
            m[2].weight = torch.nn.Parameter(torch.randn(700, 5).t() * 0.03)
            assert not m[2].weight.is_contiguous()
            pair.append(m)
        return pair

    def edit(step, model, opt):
        model[0].bias.requires_grad_(step % 2 == 0)

    with threads(2):
        *_, opt = native_vs_cotangent(foreach=False, models=models(), edit=edit, max_norm=1.0,
                                      amsgrad=True)
        assert opt.update_path()["native"] == 0 and opt.update_path()["single_pass"] == 5
        native_vs_cotangent(foreach=True, models=models(), edit=edit)


def test_version_counters_are_bumped_like_native():
    """Native's in-place update bumps each parameter's version counter, so a backward through
    a graph that saved the old values raises; the single pass writes memory directly and
    must bump them itself: checked parameter by parameter."""
    with threads(2):
        model = small_model()
        opt = cotangent.AdamW(model.parameters(), foreach=False)
        model(torch.ones(2, IN)).sum().backward()
        opt.step()
        saved = [(p * p).sum() for p in model.parameters()]  # each graph saves one parameter
        opt.step()
        assert opt.update_path()["path"] == "single-pass"
        for i, loss in enumerate(saved):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()


def test_a_failing_probe_keeps_the_native_path(fresh_verdicts, monkeypatch):
    calls = []

    def wrong_probe(**kw):
        calls.append(kw)
        return False

    monkeypatch.setattr(sp.probes, "matches_native", wrong_probe)
    with threads(2):
        *_, opt = native_vs_cotangent(foreach=False, max_norm=1.0, path="native")
    # one probe with the clip multiply joined (the coefficient's class), one without (what
    # runs once that fails: the clip apart, then the update); neither passes, native runs
    assert len(calls) == 2 and {c["implementation"] for c in calls} == {"for-loop"}
    assert [c["clip_coef"] is None for c in calls] == [False, True]
    assert any("probe" in n for n in opt.update_path()["single_pass_notes"])
    assert opt.update_path()["clip_in_pass"] == 0


@pytest.mark.slow
def test_a_wrong_kernel_fails_its_probe_and_native_runs(fresh_verdicts, monkeypatch):
    """A kernel that divides by the square root through its reciprocal (a plausible
    optimisation) gives other parameter bytes: forced past the gate it differs from native
    (the control), gated its probe fails and the update keeps native's path and bytes."""
    use_mutant(monkeypatch, "general-div-reciprocal", "register-div-reciprocal")
    monkeypatch.setattr(sp.verdicts, "_UNAVAILABLE", sp.verdicts._NOT_CHECKED)
    sp.sqrt_kind.cache_clear()
    try:
        with threads(2):
            with monkeypatch.context() as forced:  # (every verdict: "the pass may take it")
                forced.setattr(sp.verdicts, "decide_remembered", lambda *args: None)
                with pytest.raises(AssertionError, match="differ"):
                    native_vs_cotangent(foreach=False, steps=3)
            *_, opt = native_vs_cotangent(foreach=False, steps=3, path="native")
        assert sp.verdicts._PROBES == 1
    finally:
        sp.sqrt_kind.cache_clear()


def test_no_compiler_native_path_and_one_warning(fresh_verdicts, monkeypatch):
    monkeypatch.setattr(_build, "compiler", lambda: None)
    monkeypatch.setattr(tensorlists, "_STATE", {})  # (the reader too: restored afterwards)
    for name in ("_LIB", "_BUILD", "_FAILURE"):
        monkeypatch.setattr(sp.kernel, name, None)
    monkeypatch.setattr(sp.verdicts, "_UNAVAILABLE", sp.verdicts._NOT_CHECKED)
    monkeypatch.setattr(sp.verdicts, "_WARNED", False)
    sp.sqrt_kind.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught, threads(2):
            warnings.simplefilter("always")
            for foreach in (False, True):
                *_, opt = native_vs_cotangent(foreach=foreach, steps=2, max_norm=1.0,
                                              path="native")
        messages = [str(w.message) for w in caught if issubclass(w.category,
                                                                 sp.SinglePassWarning)]
        assert len(messages) == 1 and "no C++ compiler" in messages[0]
        assert any("no C++ compiler" in n for n in opt.update_path()["single_pass_notes"])
    finally:
        sp.sqrt_kind.cache_clear()


def test_spans_disjoint_gives_the_same_answer_without_the_library(monkeypatch):
    """`spans_disjoint` in C and its Python fallback (`spans.overlapping_pair`, used where the
    kernel library cannot be built) agree on random spans, touching and empty ones included."""
    from cotangent.spans import overlapping_pair

    gen = torch.Generator().manual_seed(5)
    cases = [([0, 8, 16], [8, 8, 8]), ([0, 7], [8, 8]), ([0, 0], [0, 8]), ([], [])]
    for _ in range(200):
        n = int(torch.randint(1, 8, (), generator=gen))
        cases.append((torch.randint(0, 64, (n,), generator=gen).tolist(),
                      torch.randint(0, 12, (n,), generator=gen).tolist()))
    answers = [sp.spans_disjoint(a, b) for a, b in cases]
    assert answers[:4] == [True, False, True, True] and False in answers[4:]
    assert answers == [overlapping_pair(a, b) is None for a, b in cases]
    monkeypatch.setattr(sp.kernel, "_lib", lambda: (_ for _ in ()).throw(
        sp.SinglePassUnavailable("no C++ compiler found (a test)")))
    assert [sp.spans_disjoint(a, b) for a, b in cases] == answers


def test_zero1_without_a_compiler_steps_with_natives_bits(fresh_verdicts, monkeypatch,
                                                          single_rank_group):
    """ZeRO-1 asks whether its tensors share memory at every step, kernel or not: without a
    compiler that answer comes from Python, and the step is native's."""
    monkeypatch.setattr(_build, "compiler", lambda: None)
    monkeypatch.setattr(tensorlists, "_STATE", {})
    for name in ("_LIB", "_BUILD", "_FAILURE"):
        monkeypatch.setattr(sp.kernel, name, None)
    monkeypatch.setattr(sp.verdicts, "_UNAVAILABLE", sp.verdicts._NOT_CHECKED)
    sp.sqrt_kind.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sp.SinglePassWarning)
            gen = torch.Generator().manual_seed(3)
            ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (10, 30, 7)]
            qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
            native = torch.optim.AdamW(ps, foreach=False)
            ours = cotangent.AdamW(qs, foreach=False, max_norm=0.1, shard="zero1")
            for _ in range(2):
                for p, q in zip(ps, qs):
                    p.grad = torch.randn(p.shape, generator=gen)
                    q.grad = p.grad.clone()
                torch.nn.utils.clip_grad_norm_(ps, 0.1)
                native.step()
                ours.step()
        assert ours.update_path()["path"] == "native"
        assert_same_update(ps, native.state, qs, ours.state, "ZeRO-1 without a compiler")
    finally:
        sp.sqrt_kind.cache_clear()


def test_switched_off_by_the_environment_then_on(fresh_verdicts, monkeypatch):
    """COTANGENT_SINGLE_PASS=0 runs native's op sequence (no probe, no warning); switching it
    back on mid-run continues with the same bytes."""
    def edit(step, model, opt):
        if step == 2:
            monkeypatch.delenv(sp.ENV_SWITCH, raising=False)

    monkeypatch.setenv(sp.ENV_SWITCH, "0")
    with warnings.catch_warnings(), threads(2):
        warnings.simplefilter("error", sp.SinglePassWarning)
        *_, opt = native_vs_cotangent(foreach=True, edit=edit, max_norm=1.0,
                                      path=lambda step: "native" if step < 2 else "single-pass")
    assert sp.verdicts._PROBES == 1
    # the one-off costs, reported apart from step times (cotangent bench prints them)
    report = sp.process_report()
    assert report["unavailable_reason"] is None and report["probes"] == 1
    assert 0 < report["probe_s"] < 60
    b = report["build"]
    assert b["key"] == sp.build().key and b["flags"] == list(sp.compile_flags())
    assert (b["compile_s"] == 0.0) == b["cached"]


def test_hyperparameter_edits_probe_again_only_when_the_key_changes(fresh_verdicts):
    """An lr schedule keeps the verdict (the kernel has no branch on the lr's value); beta1 = 0
    (another lerp formula), weight decay off, maximize on, eps = 0 each change the key and
    probe again (with the group's own values). A second optimizer and a new process (memory
    cleared, the cache file read) probe nothing."""
    probes = {}

    def edit(step, model, opt):
        g = opt.param_groups[0]
        g["lr"] = 1e-3 * (0.5 ** step)  # every step: no new probe
        if step == 2:
            g["betas"] = (0.0, 0.999)
        if step == 3:
            g["weight_decay"] = 0.0
        if step == 4:
            g["maximize"] = True
        if step == 5:
            g["eps"] = 0.0
        probes[step] = sp.verdicts._PROBES

    with threads(2):
        native_vs_cotangent(foreach=False, steps=7, edit=edit, max_norm=1.0)
    # probes[k] is read before step k: step 0 probes once, steps 2, 3, 4, 5 once each
    assert [probes[k] for k in range(7)] == [0, 1, 1, 2, 3, 4, 5] and sp.verdicts._PROBES == 5
    with threads(2):
        native_vs_cotangent(foreach=False, steps=2, max_norm=1.0)
        assert sp.verdicts._PROBES == 5
        sp.verdicts._VERDICTS.clear()
        calibration._MEMORY = without_single_pass(calibration._MEMORY)
        calibration._LOADED.clear()
        native_vs_cotangent(foreach=False, steps=2, max_norm=1.0)
        assert sp.verdicts._PROBES == 5  # read from the calibration file
    rows = [r for r in calibration.table() if r["kind"] == sp.PROBE_KIND]
    assert len(rows) == 5 and all(r["verdict"] for r in rows)


def test_single_pass_adds_no_persistent_bytes(monkeypatch):
    """The kernel updates parameters and state in place: the same storages before and after,
    and the same bytes held (gradients included) as with native's op sequence."""
    def held(model, opt, grads=False):
        tensors = list(model.parameters())
        tensors += [p.grad for p in model.parameters()] if grads else []
        tensors += [v for st in opt.state.values() for v in st.values()]
        return {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}

    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(sp.ENV_SWITCH, switch)
        with threads(2):
            model = small_model()
            opt = cotangent.AdamW(model.parameters(), foreach=False, max_norm=1.0)
            after_step, with_grads = [], []
            for _ in range(3):
                model(torch.ones(2, IN)).sum().backward()
                opt.step()
                after_step.append(held(model, opt))
                with_grads.append(held(model, opt, grads=True))
                opt.zero_grad()
            assert after_step[1] == after_step[2]
            assert opt.update_path()["path"] == ("native" if switch == "0" else "single-pass")
        results[switch] = (opt.state_bytes(), sum(n for _, n in with_grads[2]))
    assert results["0"] == results["1"]


def test_avx512_build_only_where_aten_runs_avx512_kernels(monkeypatch):
    """The kernel gets AVX-512 code only where ATen itself dispatches to its AVX512 kernels (so
    the CPU has them); the flags are part of the build hash, hence of every verdict's key."""
    for capability, extra in (("AVX2", ()), ("AVX512", sp.AVX512_FLAGS), ("DEFAULT", ())):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert sp.compile_flags() == sp.COMPILE_FLAGS + extra


# ---------------------------------------------------------------------- the clip in the pass


def _inf_gradient(step, model, opt):
    """From step 1 on, one element of the first weight's gradient is +inf (hooked on the
    parameter, so both arms get it from their backward): the total norm is inf, the clip
    coefficient 0, and inf * 0 makes a NaN inside the clip multiply."""
    if step == 1:
        idx = torch.tensor([3])
        model[0].weight.register_hook(lambda g: g.flatten().index_fill(0, idx, float("inf"))
                                      .view_as(g))


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("case", [
    # clipping (norm > max_norm): the multiply joins every parameter's pass
    dict(max_norm=0.01, clip_in_pass=6),
    dict(max_norm=0.01, amsgrad=True, maximize=True, betas=(0.0, 0.99), clip_in_pass=6),
    # an inf gradient at step 1: coefficient 0, inf * 0 = NaN in the pass, as in native's
    # multiply; from step 2 the NaN parameter makes every gradient NaN: multiplied apart
    dict(max_norm=0.01, edit=_inf_gradient, clip_in_pass=lambda step: 6 if step < 2 else 0),
    # not clipping (coefficient exactly 1.0): no multiply anywhere, as Clipper skips it
    dict(max_norm=1e9, clip_in_pass=0),
    # NaN gradients: NaN coefficient, multiplied apart (ATen's NaN-NaN choice is positional)
    dict(max_norm=0.01, specials=True, clip_in_pass=0),
], ids=["clips", "clips-amsgrad-maximize-beta1=0", "inf-gradient", "coefficient-1", "nan-norm"])
def test_clip_multiply_joins_the_pass_where_it_is_exact(foreach, case):
    """The clip multiply of step()'s clip runs inside the single pass (the clipped gradients
    written back) and everything stays native's bytes: gradients, parameters, moments and the
    total norm, step after step (native: clip_grad_norm_ then torch.optim.AdamW)."""
    with threads(2):
        native_vs_cotangent(foreach=foreach, **case)


def test_clip_multiply_stays_apart_where_something_could_see_the_gradients_between():
    """A step pre-hook runs between native's clip and its update and sees clipped gradients:
    with one registered the multiply stays in the clip (the hook sees native's bytes); an
    explicit clip_grad_norm_() returns clipped gradients, so nothing is deferred either; a
    closure's clip (inside the step, after the hooks) may join."""
    seen = {"native": [], "cotangent": []}

    def edit(step, model, opt):
        if step == 0:
            arm = "cotangent" if isinstance(opt, cotangent.AdamW) else "native"
            opt.register_step_pre_hook(lambda o, args, kwargs: seen[arm].append(
                [p.grad.clone() for p in model.parameters()]))

    with threads(2):
        native_vs_cotangent(foreach=False, max_norm=0.01, edit=edit, clip_in_pass=0)
    assert len(seen["native"]) == len(seen["cotangent"]) == 4
    for a, b in zip(seen["native"], seen["cotangent"]):
        for x, y in zip(a, b):
            assert_same_bits(y, x, "gradients a step pre-hook sees")

    m1, m2 = small_model(), small_model()
    ref = torch.optim.AdamW(m1.parameters())
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.01)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(3))
    with threads(2):
        for m in (m1, m2):
            m(x).square().mean().backward()
        total = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.01)
        assert_same_bits(opt.clip_grad_norm_(), total, "explicit clip")
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert_same_bits(q.grad, p.grad, "gradients returned clipped")
        ref.step()
        opt.step()
        assert opt.update_path()["clip_in_pass"] == 0
        assert_same_update(m1.parameters(), ref.state, m2.parameters(), opt.state, "explicit")

        def closure(m):
            def run():
                loss = m(x).square().mean()
                loss.backward()
                return loss
            return run

        ref.zero_grad()
        opt.zero_grad()
        with torch.enable_grad():
            closure(m1)()
        torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.01)
        ref.step()
        opt.step(closure(m2))
        assert opt.update_path()["clip_in_pass"] == 6
        assert_same_update(m1.parameters(), ref.state, m2.parameters(), opt.state, "closure")


def test_clip_multiply_never_reaches_parameters_the_clip_leaves_out():
    """clip_order without the last layer's weight: native clips the others only; the pass
    over that group's list would multiply that weight too, so the multiply stays apart
    (bytes: the left-out weight's gradient unclipped, as native's). A param group whose
    settings run natively (a tensor beta) gets native's multiply, the other group's pass its
    own."""
    m1, m2 = small_model(), small_model()
    keep = lambda m: [p for n, p in m.named_parameters() if n != "2.weight"]  # noqa: E731
    ref = torch.optim.AdamW(m1.parameters())
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.01, clip_order=keep(m2))
    gen = torch.Generator().manual_seed(4)
    with threads(2):
        for step in range(3):
            x = torch.randn(4, IN, generator=gen)
            for m in (m1, m2):
                m(x).square().mean().backward()
            total = torch.nn.utils.clip_grad_norm_(keep(m1), 0.01)
            ref.step()
            opt.step()
            assert_same_bits(opt.last_total_norm, total, "total norm")
            assert_same_update(m1.parameters(), ref.state, m2.parameters(), opt.state,
                               f"clip_order, step {step}")
            assert opt.update_path()["clip_in_pass"] == 0
            assert opt.update_path()["path"] == "single-pass"
            ref.zero_grad()
            opt.zero_grad()

    m1, m2 = small_model(), small_model()
    groups = lambda m: [dict(params=list(m[0].parameters())),  # noqa: E731
                        dict(params=list(m[2].parameters()) + list(m[3].parameters()),
                             betas=(torch.tensor(0.9), torch.tensor(0.999)))]
    ref = torch.optim.AdamW(groups(m1))
    opt = cotangent.AdamW(groups(m2), max_norm=0.01, clip_order=m2)  # native clips the model
    with threads(2):
        for step in range(3):
            x = torch.randn(4, IN, generator=gen)
            for m in (m1, m2):
                m(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.01)
            ref.step()
            opt.step()
            assert_same_update(m1.parameters(), ref.state, m2.parameters(), opt.state,
                               f"tensor betas group, step {step}")
            assert opt.update_path()["path"] == "mixed"
            # the first group's pass multiplies its own gradients (all of them clipped)
            assert opt.update_path()["clip_in_pass"] == 2
            ref.zero_grad()
            opt.zero_grad()


def test_a_clip_multiply_left_to_a_pass_happens_when_the_kernel_refuses(monkeypatch):
    """If the kernel refuses a call whose clip multiply was left to it (it raises before
    modifying anything), the multiply runs natively and native's update follows: the bytes
    are native's and the path says why."""
    m1, m2 = small_model(), small_model()
    ref = torch.optim.AdamW(m1.parameters(), foreach=False)
    opt = cotangent.AdamW(m2.parameters(), foreach=False, max_norm=0.01)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(5))

    def refuse(*args, **kwargs):
        raise ValueError("refused for the test")

    with threads(2):
        for m in (m1, m2):
            m(x).square().mean().backward()
        total = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.01)
        monkeypatch.setattr(sp, "launch", refuse)
        ref.step()
        opt.step()
    assert_same_bits(opt.last_total_norm, total, "total norm")
    assert_same_update(m1.parameters(), ref.state, m2.parameters(), opt.state, "refused pass")
    path = opt.update_path()
    assert path["path"] == "native" and path["clip_in_pass"] == 0
    assert any("refused for the test" in n for n in path["single_pass_notes"])


# ---------------------------------------------------------------------- bfloat16 parameters


def _bf16_models():
    return small_model().to(torch.bfloat16), small_model().to(torch.bfloat16)


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("setting", [
    dict(max_norm=1.0),
    # large updates and eps: every scalar's rounding (float, or bfloat16 first) shows
    dict(max_norm=0.01, lr=0.1, weight_decay=0.5, eps=1e-3, betas=(0.9, 0.95)),
    dict(betas=(0.0, 0.95), maximize=True, weight_decay=0.0, specials=True),
    dict(lr=3.0, eps=0.0, specials=True),
], ids=["clip", "large-steps", "beta1=0-maximize-specials", "lr=3-eps=0-specials"])
def test_bfloat16_parameters_take_the_single_pass_with_native_bytes(foreach, setting):
    """bfloat16 parameters (and so bfloat16 gradients and moments): each native op computes
    in float and rounds to bfloat16, NaNs become 0xFFFF (vector body) or 0x7FC0 (scalar tail),
    add_ rounds eps to bfloat16 and _foreach_mul_ its scalar; the single pass does the same,
    byte for byte over several steps (34,300 elements: two thread chunks with tails)."""
    with threads(2):
        *_, opt = native_vs_cotangent(foreach=foreach, models=_bf16_models(), **setting)
    assert opt.update_path()["single_pass"] == 6


def test_bfloat16_amsgrad_runs_natively_and_the_scalar_rounding_is_what_the_probe_proves(
        fresh_verdicts, monkeypatch):
    """amsgrad with bfloat16 (torch.maximum not reproduced) keeps native's path. Control: a
    single pass that leaves the scalars in float where ATen rounds them to bfloat16 gives
    other bytes when forced past the gate, fails its probe (the probe's stress settings make the
    rounding show even under default hyperparameters), and native runs."""
    with threads(2):
        *_, opt = native_vs_cotangent(foreach=False, models=_bf16_models(), amsgrad=True,
                                      path="native")
        assert any("amsgrad" in n for n in opt.update_path()["single_pass_notes"])
        monkeypatch.setattr(sp.probes, "_bf16_value", lambda x: x)
        with monkeypatch.context() as forced:  # (every verdict: "the pass may take it")
            forced.setattr(sp.verdicts, "decide_remembered", lambda *args: None)
            with pytest.raises(AssertionError, match="differ"):
                native_vs_cotangent(foreach=True, models=_bf16_models(), lr=0.1, eps=1e-3,
                                    weight_decay=0.5, betas=(0.9, 0.95))
        for foreach in (False, True):  # default hyperparameters: only the stress probe sees it
            *_, opt = native_vs_cotangent(foreach=foreach, models=_bf16_models(),
                                          path="native")
            assert any("probe" in n for n in opt.update_path()["single_pass_notes"])


def test_zero_grad_outside_a_process_group_writes_nothing_and_gives_native_bytes(monkeypatch):
    """`zero_grad` is native's: it neither refills anything (`fill_` is never called) nor keeps
    gradients: ``.grad`` reads None, and
    each backward's fresh gradients, zeros of both signs among them, are read where autograd
    left them, with native's bytes."""
    class SignedZeroGradients(torch.nn.Module):
        """`w`'s gradient is a scalar times `c`: zeros of both signs among other values."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.lin = torch.nn.Linear(IN, 3)
            self.w = torch.nn.Parameter(torch.randn(64))
            c = torch.randn(64)
            c[::3], c[1::3] = 0.0, -0.0
            self.register_buffer("c", c)

        def forward(self, x):
            return self.lin(x) + (self.w * self.c).sum()

    with threads(2):
        for models in (None, (SignedZeroGradients(), SignedZeroGradients())):
            native_vs_cotangent(foreach=False, steps=4, max_norm=1.0, models=models)
        model = SignedZeroGradients()
        opt = cotangent.AdamW(model.parameters(), max_norm=1.0)
        for _ in range(2):
            model(torch.ones(2, IN)).sum().backward()
            opt.step()
            grads = [p.grad for p in model.parameters()]
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "fill_", lambda *a: pytest.fail("fill_ called"))
                opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            assert not {g.untyped_storage().data_ptr() for g in grads} & params


# ---------------------------------------------------------------------- the fused bits, the norms

def test_fused_vector_unit_and_pieces():
    """ATen's fused CPU AdamW runs its AVX2 build here (8 lanes, a scalar tail of numel % 8);
    a tensor of one cache line (16 floats), or any tensor on one thread, runs in the inline copy
    of its loop (flag bit 1), the tail is flag bit 0."""
    assert sp.fused_vector_unit() == 8
    rows = sp.fused_pieces((16, 17, 7, 0), threads=2, unit=8).tolist()
    assert rows == [[0, 16, 0, 2], [0, 16, 1, 0], [16, 1, 1, 1], [0, 7, 2, 3]]
    assert {r[3] & 2 for r in sp.fused_pieces((4099,), threads=1, unit=8).tolist()} == {2}


@pytest.mark.parametrize("nthreads", [1, 2])
@pytest.mark.parametrize("setting", [
    dict(), dict(maximize=True, amsgrad=True), dict(beta1=0.0, weight_decay=0.0),
    dict(beta1=0.3, maximize=True, clip_coef=0.25)], ids=["plain", "max-ams", "beta1=0", "clip"])
def test_fused_bits_equal_native_on_both_copies_of_its_loop(setting, nthreads):
    """The probe (every special value in body, tail, inline and parallel-region positions) passes
    for the fused bits; NaN gradients under maximize at lengths on both sides of the 16-element
    cache line show the two copies' signs (the inline copy's NaN exp_avg_sq has the negated
    gradient's sign, the other's the gradient's own)."""
    kw = dict(implementation="fused", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01, maximize=False, amsgrad=False)
    kw.update(setting)
    with threads(nthreads):
        assert sp.matches_native(**kw)
        for n in (7, 16, 17, 40):
            grads = [torch.full((n,), float("nan")) for _ in range(2)]
            grads[1].view(torch.int32)[:] = 0x7FA00001  # a signalling NaN of positive sign
            ours, theirs = [], []
            for out, run in ((ours, "kernel"), (theirs, "native")):
                params = [torch.ones(n) for _ in grads]
                m = [torch.zeros(n) for _ in grads]
                v = [torch.full((n,), 1e-4) for _ in grads]
                steps = [torch.tensor(0.0) for _ in grads]
                g = [t.clone() for t in grads]
                if run == "kernel":
                    sp.single_pass_adamw_lists_(params, g, m, v, [], steps, **dict(
                        kw, amsgrad=False, maximize=True, clip_coef=None))
                else:
                    sp.probes._native_adamw("fused", params, g, m, v, [], steps, **{
                        k: kw[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")},
                        maximize=True, amsgrad=False)
                out += params + m + v
            for a, b in zip(ours, theirs):
                assert_same_bits(a, b, f"{n} elements, {nthreads} threads")


@pytest.mark.slow
def test_norms_equal_native_and_a_kernel_that_fuses_every_tail_square_is_caught(
        monkeypatch):
    """`tensor_norms` gives native clipping's per-tensor norms byte for byte on the probe's
    tensors (and the probe passes); control: a kernel whose norm fuses every tail square into
    the sum, and whose fused AdamW forgets the inline copy's NaN sign, fails both probes."""
    with threads(2):
        assert sp.norms_match_native()
        tensors = sp.norm_probe_tensors(seed=1)
        from cotangent.norms import native_tensor_norms

        assert_same_bits(sp.tensor_norms(tensors),
                         torch.stack(native_tensor_norms(tensors, 2.0, None)), "norms")
        kw = dict(implementation="fused", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01, maximize=True, amsgrad=False)
        assert sp.matches_native(**kw)
        use_mutant(monkeypatch, "norm-tail-fused", "fused-inline-sign-lost")
        assert not sp.norms_match_native()
        assert not sp.matches_native(**kw)


def _two_nan_tensors(lengths) -> list[torch.Tensor]:
    """Tensors of ones with two quiet NaNs of opposite signs and distinct payloads, at every
    pair of positions, in both orders."""
    a, b = (torch.tensor([bits], dtype=torch.int32).view(torch.float32)[0]
            for bits in (0x7FC00001, -0x3FFFFE))  # (0xFFC00002)
    out = []
    for n in lengths:
        for i in range(n):
            for j in range(i + 1, n):
                for first, second in ((a, b), (b, a)):
                    t = torch.ones(n)
                    t[i], t[j] = first, second
                    out.append(t)
    return out


def test_norms_keep_natives_nan_where_two_nans_meet():
    """Where two NaNs meet in the norm's sum, x86 keeps the first operand's, and a compiler may
    swap an add's operands: the kernel's adds are pinned to ATen's order (a rebuild once
    swapped some, and half of these tensors then had the other NaN). Every pair of positions
    of two NaNs of opposite signs, tensors of 2 to 41 elements (vector body, lane fold, the
    four rounded squares, the fused tail), one and two threads: native's bytes."""
    from cotangent.norms import native_tensor_norms

    tensors = _two_nan_tensors(range(2, 42))
    for nthreads in (1, 2):
        with threads(nthreads):
            assert_same_bits(sp.tensor_norms(tensors),
                             torch.stack(native_tensor_norms(tensors, 2.0, None)),
                             f"two-NaN norms, {nthreads} threads")


@pytest.mark.parametrize("impl", sp.KINDS)
@pytest.mark.parametrize("setting", [dict(), dict(weight_decay=0.0, amsgrad=True),
                                     dict(max_norm=1e-3)], ids=["decay", "ams", "clip"])
def test_version_counters_are_bumped_as_natives_ops_bump_them(impl, setting):
    """After two steps every parameter, gradient and state tensor has native's version count
    (for-loop / foreach: one per in-place op; fused: only the steps'; the clip multiply: one
    per gradient)."""
    setting = dict(setting)
    max_norm = setting.pop("max_norm", None)
    flags = dict(foreach=impl == "foreach", fused=impl == "fused")
    counts = []
    for make in (torch.optim.AdamW, cotangent.AdamW):
        torch.manual_seed(0)
        model = small_model()
        kw = dict(flags, **setting)
        opt = make(model.parameters(), **kw) if make is torch.optim.AdamW else make(
            model.parameters(), max_norm=max_norm, **kw)
        for _ in range(2):
            model(torch.randn(4, IN)).square().mean().backward()
            if make is torch.optim.AdamW and max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        counts.append([(p._version, p.grad._version, *(t._version for t in opt.state[p].values()))
                       for p in model.parameters()])
        if make is cotangent.AdamW:
            assert opt.update_path()["path"] == "single-pass", opt.update_path()
    assert counts[0] == counts[1]


def _reader_lists(n=6, requires_grad=False):
    """A call's lists as `_gather` hands them to `prepare_lists`: parameters (shapes of 0, 1,
    many elements, 2-D), gradients, exp_avg, exp_avg_sq, max_exp_avg_sq, float32 steps."""
    shapes = [(0,), (1,), (17,), (3, 5), (40,), (2, 2, 2)][:n]
    params = [torch.randn(s).requires_grad_(requires_grad) for s in shapes]
    rest = [[torch.randn(s) for s in shapes] for _ in range(4)]
    steps = [torch.tensor(float(i)) for i in range(n)]
    return [params, *rest, steps]


def _neg_view(t):
    return t._neg_view()


class _PlainTensor(torch.Tensor):
    """A tensor subclass that adds nothing (the compiled reader reads only torch.Tensor and
    nn.Parameter objects; the Python checks take this one)."""


# (what is changed, how, whether the C++ reader takes the lists, whether they are disjoint):
# each row edits tensor 2 of one list; the Python checks are the reference for every row
READER_CASES = [
    ("nothing", None, None, True, True),
    ("transposed gradient", 1, lambda t: torch.randn(5, 3).t(), False, None),
    ("gradient of another shape", 1, lambda t: torch.randn(17, 1), False, None),
    ("float64 exp_avg", 2, lambda t: t.double(), False, None),
    ("exp_avg_sq missing", 3, lambda t: None, False, None),
    ("gradient as a negative view", 1, _neg_view, False, None),
    ("inference-mode exp_avg", 2, lambda t: _inference_copy(t), False, None),
    ("a Parameter as gradient", 1, lambda t: torch.nn.Parameter(t, requires_grad=False),
     True, True),
    ("gradient is the exp_avg", 1, "alias", True, False),
    ("a plain Tensor subclass as exp_avg", 2, lambda t: t.as_subclass(_PlainTensor), False,
     None),
    ("ZeroTensor exp_avg_sq", 3, lambda t: torch._efficientzerotensor(t.shape), False, None),
    ("step as a negative-bit view", 5, lambda t: (-t)._neg_view(), False, None),
    ("step of one dimension", 5, lambda t: t.reshape(1), False, None),
    ("float64 step", 5, lambda t: t.double(), True, True),
    ("step shared with the next", 5, "shared-step", False, None),
]


def _inference_copy(t):
    with torch.inference_mode():
        return t.clone()


@pytest.mark.parametrize("case", READER_CASES, ids=[c[0] for c in READER_CASES])
def test_compiled_list_reader_matches_the_python_checks(case, monkeypatch):
    """`tensorlists.read_lists` (C++) takes exactly the lists `prepare_lists`'s Python checks
    take as the contiguous case, with the same addresses, numels, step flags and, where it says
    so, the verdict of `spans_disjoint`; where it declines, the Python checks decide (and raise)
    as before."""
    _, index, edit, taken, disjoint = case
    read = tensorlists.reader()
    assert read is not None, tensorlists.why_not()
    lists = _reader_lists()
    if edit == "alias":
        lists[index][2] = lists[2][2]
    elif edit == "shared-step":
        lists[5][2] = lists[5][3]
    elif edit is not None:
        lists[index][2] = edit(lists[index][2])
    table = array.array("q", bytes(8 * 7 * 6))
    with torch.no_grad():
        code = read(lists[:5], lists[5], torch.is_grad_enabled(), table)
    assert bool(code) == taken
    if taken:
        assert bool(code & 4) == disjoint and bool(code & 2) == (case[0] != "float64 step")

    def prepared(with_reader: bool):
        if not with_reader:
            monkeypatch.setattr(tensorlists, "reader", lambda: None)
        try:
            with torch.no_grad():
                p = sp.prepare_lists(*lists)
        except (TypeError, ValueError, RuntimeError) as e:
            return type(e), str(e)
        finally:
            monkeypatch.undo()
        return (p.bases, p.numels, p.step_bases, p.float32_steps,
                sp.spans_disjoint(*p.spans()), p.disjoint)

    fast, reference = prepared(True), prepared(False)
    if taken:
        assert fast[:5] == reference[:5] and fast[5] == fast[4] == disjoint
        assert fast[0][1][2] == lists[1][2].data_ptr() and reference[5] is None
    else:
        assert fast == reference  # the Python checks ran both times


def test_compiled_list_reader_refuses_parameters_requiring_grad_in_grad_mode():
    read = tensorlists.reader()
    lists = _reader_lists(requires_grad=True)
    table = array.array("q", bytes(8 * 7 * 6))
    assert read(lists[:5], lists[5], True, table) == 0
    assert read(lists[:5], lists[5], False, table) & 1
    with pytest.raises(RuntimeError, match="torch.no_grad"):
        sp.prepare_lists(*lists)


def test_kernel_sources_are_package_files_in_the_code_hash(tmp_path, monkeypatch):
    """The C++ sources are files in the package (`csrc/`), the kernel's text is the file's, and
    the code hash every run records covers them."""
    import shutil

    import cotangent.harness.records as records

    csrc = Path(sp.__file__).parent.parent / "csrc"
    assert sp.kernel._SOURCE == (csrc / "singlepass.cpp").read_text()
    assert tensorlists.SOURCE_PATH == csrc / "tensorlists.cpp" and tensorlists.SOURCE_PATH.exists()
    copy = tmp_path / "cotangent"
    shutil.copytree(Path(cotangent.__file__).parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cotangent, "__file__", str(copy / "__init__.py"))
    before = records.source_sha256()
    (copy / "csrc" / "singlepass.cpp").write_text(sp.kernel._SOURCE + "// edited\n")
    assert records.source_sha256() != before


def test_a_compiler_that_writes_nothing_is_a_clear_build_failure(tmp_path, monkeypatch):
    """A "compiler" that exits 0 without writing the library (CXX=/bin/true) fails the build
    with a message (the kernel then says unavailable), not a FileNotFoundError at a step."""
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "compiler", lambda: "/bin/true")
    with pytest.raises(_build.BuildFailed, match="left no library"):
        _build.compile_cached("nothing", "int x;", ("-shared",))
    with pytest.raises(sp.SinglePassUnavailable, match="left no library"):
        sp.kernel._build_locked()


@pytest.mark.parametrize("make", [
    lambda n: memoryview(array.array("q", bytes(16 * n)))[::2],   # strided
    lambda n: memoryview(array.array("q", bytes(16 * n)))[::-1][:n],  # reversed
    lambda n: array.array("d", bytes(8 * n)),                      # float64
    lambda n: array.array("q", bytes(8 * (n - 1))),                # one short
], ids=["strided", "reversed", "float64", "short"])
def test_compiled_list_reader_declines_an_output_buffer_it_cannot_fill_in_order(make):
    read = tensorlists.reader()
    lists = _reader_lists()
    n = 7 * 6
    assert read(lists[:5], lists[5], False, make(n)) == 0
    assert read(lists[:5], lists[5], False, array.array("q", bytes(8 * n))) & 1
