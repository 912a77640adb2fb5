"""The single-pass AdamW kernel (cotangent.singlepass) against native torch.optim.AdamW, byte for
byte: for-loop and foreach, float32 CPU, over flat buffers holding several native tensors."""

from __future__ import annotations

import contextlib
import platform

import pytest
import torch

from bitwise import assert_same_bits, same_bits
from cotangent import singlepass as sp

if platform.machine().lower() not in ("x86_64", "amd64"):
    pytest.skip("the single-pass kernel is x86-64 only", allow_module_level=True)
try:
    sp.build()
except sp.SinglePassUnavailable as e:
    pytest.skip(f"single-pass kernel unavailable here: {e}", allow_module_level=True)

# around the vector unit (16) and the thread split (GRAIN_SIZE), one above 2 * GRAIN_SIZE whose
# two thread chunks (2 threads) end in scalar tails
LENGTHS = (1, 7, 15, 16, 17, 33, 100, 1000, 2049, 32769, 65553)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_both(*, implementation="for-loop", lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
             weight_decay=0.01, maximize=False, amsgrad=False, steps=3, lengths=LENGTHS,
             seed=0, our_lr=None, our_threads=None, grid=True, plain=False, grid_copies=1,
             step_buffer=False):
    """torch.optim.AdamW on one tensor per segment of the probe layout (`sp.probe_data`: random
    lengths with special values sprinkled in, and with `grid` every combination of special
    gradient / moment values in vector-body and scalar-tail segments) vs the single pass over
    the flat buffers. `plain`: random values only. Returns (native params, native states, our
    views of param / exp_avg / exp_avg_sq / max_exp_avg_sq, our steps)."""
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
                            amsgrad=amsgrad, foreach=implementation == "foreach")
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


@pytest.mark.parametrize("implementation", ["for-loop", "foreach"])
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
        params, states, ours, steps = run_both(our_lr=1.0001e-3, steps=2)
    assert not same_bits(ours[0][9], params[9].detach())  # 32769 random elements
    # amsgrad with the tails of a 1-thread split while native split its work over 2 threads:
    # the NaNs torch.maximum writes in the tails of the thread chunks differ (0x7FC00000 vs
    # 0xFFFFFFFF), so where native's tails are is part of the result
    with threads(2):
        params, states, ours, steps = run_both(amsgrad=True, lengths=(65553,), our_threads=1,
                                               steps=3, grid=False)
    assert not same_bits(ours[3][0], states[0]["max_exp_avg_sq"])


def test_hardware_square_root_is_not_torch_sqrt(monkeypatch):
    """torch.sqrt (float32, CPU, MKL build) is MKL's vmsSqrt, not a correctly rounded square
    root; a pass with the hardware square root gives other parameters and the probe says so."""
    if sp.sqrt_kind() != "mkl":
        pytest.skip("this torch build's sqrt is not MKL's")
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    assert not same_bits(torch.sqrt(x), x.double().sqrt().float())  # CR sqrt != torch's
    kw = dict(implementation="for-loop", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01, maximize=False, amsgrad=False, lengths=(1000, 40000), steps=3)
    with threads(2):
        assert sp.matches_native(**kw)
        monkeypatch.setattr(sp, "sqrt_kind", lambda: "hardware")
        assert not sp.matches_native(**kw)


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
        (ValueError, dict(kw, implementation="fused")),
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
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    _, first = sp._build_locked()
    _, second = sp._build_locked()
    assert not first.cached and first.compile_s > 0
    assert second.cached and second.path == first.path and second.compile_s == 0.0
    assert str(tmp_path) in first.path
    monkeypatch.setattr(sp, "_compiler", lambda: None)
    with pytest.raises(sp.SinglePassUnavailable, match="no C\\+\\+ compiler"):
        sp._build_locked()


def test_native_pieces_follow_aten_thread_split():
    assert sp.thread_chunks(32768, 2) == [(0, 32768)]  # not above the grain: one chunk
    assert sp.thread_chunks(32769, 2) == [(0, 16385), (16385, 32769)]
    assert sp.thread_chunks(100, 1) == [(0, 100)]
    pieces = sp.native_pieces(((0, 33), (48, 32769)), 2, 16, True).tolist()
    assert pieces == [[0, 32, 0, 0], [32, 1, 0, 1], [48, 16384, 1, 0], [48 + 16384, 1, 1, 1],
                      [48 + 16385, 16384, 1, 0]]
    assert sp.aten_vector_unit() in (16, 32)  # 2 x Vectorized<float>: AVX2 16, AVX512 32


def test_probe_catches_a_kernel_that_rounds_one_branch_differently(tmp_path, monkeypatch):
    """A kernel whose scalar-tail lerp (weight 1: beta1 = 0) used the vector body's formula
    differs from native only in the sign of some zeros; the probe's special-value grid in
    tail segments finds it, and the shipped kernel passes the same probe."""
    kw = dict(implementation="for-loop", lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8,
              weight_decay=0.1, maximize=False, amsgrad=False, lengths=(33,), steps=2)
    with threads(2):
        assert sp.matches_native(**kw)
        wrong = sp._SOURCE.replace("TAIL       ? __builtin_fmaf(-d, omw, g)",
                                   "TAIL       ? __builtin_fmaf(wm1, d, g)")
        assert wrong != sp._SOURCE
        monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(sp, "_SOURCE", wrong)
        monkeypatch.setattr(sp, "_LIB", None)
        monkeypatch.setattr(sp, "_BUILD", None)
        monkeypatch.setattr(sp, "_FAILURE", None)
        sp.sqrt_kind.cache_clear()
        try:
            assert not sp.matches_native(**kw)
        finally:
            sp.sqrt_kind.cache_clear()
