"""Adversarial checks of the bfloat16 single-pass AdamW (`cotangent.singlepass`:
`cot_singlepass_adamw_bf16`, `_bf16_value`, the bfloat16 branches of `single_pass_adamw_`, the
gate) as `cotangent.AdamW` uses it: against ``torch.nn.utils.clip_grad_norm_`` +
``torch.optim.AdamW`` on CPU bfloat16 parameters, byte for byte after every step (parameters,
gradients, exp_avg, exp_avg_sq, step, total norm), or native's path, or native's error.

The review found no divergence (torch 2.13.0+cpu, 2-core AVX-512 CPU). Kept here:
- `test_kernel_matches_native_on_bf16_boundaries`: the kernel itself (`single_pass_adamw_`,
  no probe, no gate) against native `torch.optim.adam.adam` on segments of 1-65 elements and one
  above ATen's grain size, at 1 and 2 threads, for every scalar near a bfloat16 rounding
  boundary (lr, betas including beta1 = 0 and lerp weights around 0.5, beta2 rounding to 1.0
  under foreach, eps of every magnitude including 0, subnormal, negative, beyond bfloat16,
  decay rounding to 1, 0 or below), tensor lr of four dtypes, maximize, and data holding every
  special bfloat16 value (NaNs of both signs and payloads, infinities, signed zeros,
  subnormals, 0x7F7F, values whose square overflows, negative exp_avg_sq);
- `test_attack_held`: a case table through `cotangent.AdamW` (clip of every norm, mixed
  bfloat16 / float32 / float16 groups, hyperparameter edits mid-run, state dicts through native
  with special moments, thread changes, step dtypes, strided gradients, foreach=None);
- controls: each comparison does report a changed setting or one changed bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import cotangent
from bitwise import (assert_same_bits, group_edit, require_single_pass_kernel,
                     run_against_native, thread_flip, threads)
from cotangent import singlepass as sp
from cotangent.verify import first_difference

require_single_pass_kernel()

BF = torch.bfloat16
INF, NAN = float("inf"), float("nan")
# zeros, infinities, NaNs (quiet/signalling payloads, both signs, all ones), subnormals (the
# smallest, the largest), smallest normal, max finite of both signs, 1, -1, 2**64 (square:
# 2**128 overflows float32), 2**-64
SPECIAL_BITS = (0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0xFFFF, 0x7FFF, 0x7F81, 0xFF81,
                0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80, 0x5F80, 0x1F80)


def _bits(values) -> torch.Tensor:
    return torch.tensor([b - 65536 if b >= 32768 else b for b in values], dtype=torch.int16)


def special_data(n: int, seed: int, scale: float = 1.0, every: int = 10) -> torch.Tensor:
    """bfloat16 randn * scale with a special value (`SPECIAL_BITS`, cycling) every `every`-th
    element from a seed-dependent phase (so they land in ATen's vector bodies and tails)."""
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(BF)
    bits = _bits(SPECIAL_BITS)
    idx = torch.arange(seed % every, n, every)
    x.view(torch.int16)[idx] = bits[(idx // every + seed) % len(bits)]
    return x


# ---------------------------------------------------------------------- the kernel itself


def kernel_vs_native(implementation: str, lengths, *, lr, beta1, beta2, eps, weight_decay,
                     maximize=False, steps=3, seed=0, scales=(1.0, 1.0, 1.0)):
    """`steps` steps of native `torch.optim.adam.adam` (one tensor per length) and
    `single_pass_adamw_` over the same values in flat buffers; returns the first byte
    difference (or differing errors) as a string, or None."""
    segments, off = [], 0
    for n in lengths:
        segments.append((off, n))
        off += n
    total = off
    p = special_data(total, seed, scales[0])
    m = special_data(total, seed + 1)
    v = special_data(total, seed + 2, scales[1])  # negative values too: state loaded from outside
    views = lambda t: [t[o:o + n] for o, n in segments]  # noqa: E731
    native = [[t.clone() for t in views(x)] for x in (p, m, v)]
    ours = [x.clone() for x in (p, m, v)]
    native_steps = [torch.tensor(float(k)) for k in range(len(segments))]  # differing steps
    our_steps = [s.clone() for s in native_steps]
    for k in range(steps):
        g = special_data(total, seed + 10 + k, scales[2])
        errors = []
        try:
            sp.probes._native_adamw(implementation, native[0], [t.clone() for t in views(g)],
                             native[1], native[2], [], native_steps,
                             lr=lr.clone() if torch.is_tensor(lr) else lr, beta1=beta1,
                             beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
                             amsgrad=False)
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - compared with ours
            errors.append(type(e).__name__)
        try:
            with torch.no_grad():
                sp.single_pass_adamw_(ours[0], g, ours[1], ours[2], None, our_steps,
                                      segments=segments, implementation=implementation, lr=lr,
                                      beta1=beta1, beta2=beta2, eps=eps,
                                      weight_decay=weight_decay, maximize=maximize,
                                      amsgrad=False)
            errors.append(None)
        except (ValueError, TypeError, ArithmeticError) as e:
            errors.append(type(e).__name__)  # a refusal: AdamW runs native's path then
        if errors[1] is not None:
            return None  # refused before modifying anything: native's path (and error) runs
        if errors[0] is not None:
            return f"step {k}: native raised {errors[0]}, the single pass ran"
        for name, mine, theirs in zip(("param", "exp_avg", "exp_avg_sq"), ours, native):
            for i, (a, b) in enumerate(zip(views(mine), theirs)):
                d = first_difference(a, b)
                if d is not None:
                    return f"step {k}, {name} of segment {i} ({lengths[i]} elements): {d}"
        for a, b in zip(our_steps, native_steps):
            d = first_difference(a, b)
            if d is not None:
                return f"step {k}, step counts: {d}"
    return None


LENGTHS = (1, 16, 17, 31, 32, 33, 65, 100)
# every value at or next to a bfloat16 rounding boundary, or a branch of ATen's kernels
BOUNDARY = [
    # (lr, beta1, beta2, eps, weight_decay)
    (1e-3, 0.9, 0.999, 1e-8, 1e-2),
    (0.1, 0.9, 0.95, 1e-3, 0.5),
    (3.0, 0.0, 0.999, 0.0, 1e-2),                 # beta1 = 0: lerp weight 1, eps 0
    (0.5, 0.5, 0.99609375, 1e-3, 0.3),            # weight 0.5 (not small); beta2 = 1 - 2**-8
    (0.5, 0.50390625, 0.998046875, 1e-3, 0.3),    # weight just below 0.5; beta2 a tie -> 1.0
    (0.5, 0.49609375, 0.9995, 1e-3, 0.3),         # weight just above 0.5; beta2 rounds to 1.0
    (0.5, 0.4999, 0.9961, 1.00390625, 0.3),       # eps a tie between 1 and 1 + 2**-7
    (0.5, -0.5, 0.0, 1e-45, 0.3),                 # weight 1.5; beta2 0; eps subnormal
    (0.5, 1 - 1e-8, 1.0, 1.1754942e-38, 0.3),     # weight ~1e-8; beta2 1; eps -> normal in bf16
    (1.7, 0.9, 0.95, -1e-8, 0.3),                 # negative eps
    (0.1, 0.9, 0.95, 3.5e38, 0.0),                # eps beyond bfloat16 (and float32)
    (0.1, 0.9, 0.95, 1e-40, 0.0),                 # eps subnormal, no decay
    (1e-3, 0.9, 0.95, 1e-8, 0.5),                 # 1 - lr*wd rounds to 1.0 in bfloat16
    (10.0, 0.9, 0.95, 1e-8, 0.1),                 # 1 - lr*wd = 0
    (20.0, 0.9, 0.95, 1e-8, 0.1),                 # 1 - lr*wd = -1
    (2.5, 0.95, 0.999, 1e-30, 0.8),               # 1 - lr*wd = -1 again, tiny eps
    (1e-45, 0.9, 0.999, 1e-8, 1.0),               # subnormal lr
    (-0.1, 0.9, 0.999, 1e-8, 1e-2),               # negative lr
    (1.0, 0.9, 0.95, 1e-8, 3.4e38),               # decay -> -inf (bf16 rounding, foreach)
]
TENSOR_LRS = [torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64),
              torch.tensor(0.3, dtype=BF), torch.tensor([0.3])]


def _kernel_cases():
    cases = []
    for impl in sp.IMPLEMENTATIONS:
        for k, (lr, b1, b2, eps, wd) in enumerate(BOUNDARY):
            cases.append((impl, LENGTHS, dict(lr=lr, beta1=b1, beta2=b2, eps=eps,
                                              weight_decay=wd, maximize=k % 3 == 1)))
    for lr in TENSOR_LRS:  # for-loop only (native foreach refuses a tensor lr)
        cases.append(("for-loop", LENGTHS, dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-3,
                                                weight_decay=0.5)))
    return cases


def test_kernel_matches_native_on_bf16_boundaries():
    problems = []
    with threads(2):
        for impl, lengths, hp in _kernel_cases():
            d = kernel_vs_native(impl, lengths, steps=2, **hp)
            if d is not None:
                problems.append(f"{impl} {hp}: {d}")
    # above ATen's grain size (at 2 threads two chunks, each with its own scalar tail; at 1 one),
    # parameters, moments and gradients spanning magnitudes (updates a parameter's last bit;
    # roots near eps)
    for n in (1, 2):
        with threads(n):
            for impl in sp.IMPLEMENTATIONS:
                for scales in ((1e-3, 1e-6, 1e-3), (1e30, 1e-30, 1e20)):
                    d = kernel_vs_native(impl, (32769, 33), lr=0.1, beta1=0.9, beta2=0.95,
                                         eps=1e-3, weight_decay=0.5, steps=2, scales=scales)
                    if d is not None:
                        problems.append(f"{impl} {n} threads {scales}: {d}")
    assert not problems, problems


def test_kernel_control_a_scalar_left_unrounded_is_caught(monkeypatch):
    """Control: a single pass that keeps eps / the foreach decay and beta2 in float (where ATen
    rounds them to bfloat16) gives other bytes in this comparison."""
    monkeypatch.setattr(sp.probes, "_bf16_value", lambda x: x)
    for impl in sp.IMPLEMENTATIONS:
        d = kernel_vs_native(impl, LENGTHS, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-3,
                             weight_decay=0.5, scales=(1.0, 1e-6, 1e-3))  # roots near eps
        assert d is not None, impl


# ---------------------------------------------------------------------- through cotangent.AdamW

SHAPES = [(), (1,), (17,), (3, 33), (40002,), (31,), (32,), (65,), (0,)]


def rgrad(step, i, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))
            * scale).to(dtype)


def special_grad(step, i, shape, dtype):
    """Random values with a special value every 37th element (bfloat16: every special bit
    pattern, payloads kept)."""
    g = rgrad(step, i, shape, dtype).reshape(-1).clone()
    if dtype == BF:
        bits = _bits(SPECIAL_BITS)
        for k in range(step % 37, g.numel(), 37):
            g.view(torch.int16)[k] = bits[(k // 37) % len(bits)]
    else:
        for k in range(step % 37, g.numel(), 37):
            g[k] = (0.0, -0.0, INF, -INF, NAN, 1e-40)[(k // 37) % 6]
    return g.view(shape)


def compare(*, foreach, max_norm=None, steps=2, grads=special_grad, edit=None, adamw=None,
            groups=None, dtypes=None, shapes=SHAPES, norm_type=2.0, strided_grads=False):
    """`bitwise.run_against_native` on parameters of `shapes` (`dtypes`, default bfloat16),
    gradients ``grads(step, i, shape, dtype)`` assigned (payloads kept; with `strided_grads`,
    1-D ones as every other element of a larger tensor). Returns [(step, first problem or
    None, update_path)]."""
    dtypes = dtypes or [BF] * len(shapes)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]

    def deliver(step, params):
        for i, p in enumerate(params):
            g = grads(step, i, p.shape, p.dtype)
            if strided_grads and g.dim() == 1 and g.numel() > 1:
                g = torch.stack([g, g], 1)[:, 0]
            p.grad = g

    out = run_against_native(base, foreach=foreach, deliver=deliver, steps=steps,
                             max_norm=max_norm, norm_type=norm_type, edit=edit, adamw=adamw,
                             groups=groups)
    return [row[:3] for row in out]


def special_state_through_native(step, params, opt):
    """At step 1: the state dict saved, special bit patterns (NaNs, infinities, subnormals,
    max finite, negative exp_avg_sq) written into its moments, one step count set to 1000,
    loaded into a native AdamW over the same parameters and that one's state dict loaded."""
    if step != 1:
        return
    sd = copy.deepcopy(opt.state_dict())
    bits = _bits(SPECIAL_BITS + (0xBF80, 0xC000))
    for k, st in sd["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            flat = st[name].reshape(-1).view(torch.int16)
            for j in range(k % 5, flat.numel(), 7):
                flat[j] = bits[(j // 7) % len(bits)]
        if k == 2:
            st["step"] = torch.tensor(1000.0)
    tmp = torch.optim.AdamW(params, foreach=opt.defaults["foreach"])
    tmp.load_state_dict(sd)
    opt.load_state_dict(copy.deepcopy(tmp.state_dict()))


def float64_steps(step, params, opt):
    if step == 1:
        for p in params:
            opt.state[p]["step"] = opt.state[p]["step"].double()


MIXED = [BF, torch.float32, BF, BF, torch.float32, BF, torch.float32, BF, BF]
# (id, compare() arguments, the path every step must take: "single-pass", "native", "mixed",
# or None: byte equality only (and equal errors))
HELD = [
    ("large updates", dict(adamw=dict(lr=0.5, weight_decay=0.1, eps=1e-3, betas=(0.9, 0.95))),
     "single-pass"),
    ("clip, special gradients (NaN norm)", dict(max_norm=1.0), "single-pass"),
    ("clip norm inf", dict(max_norm=0.1, norm_type=INF, grads=rgrad, shapes=SHAPES[:-1]),
     "single-pass"),
    ("clip, grad*grad overflows", dict(max_norm=0.1, grads=lambda s, i, sh, d: rgrad(
        s, i, sh, d, scale=1e37)), "single-pass"),
    ("clip, subnormal gradients", dict(max_norm=0.1, grads=lambda s, i, sh, d: rgrad(
        s, i, sh, d, scale=1e-39)), "single-pass"),
    ("bf16 + float32 params, clip", dict(dtypes=MIXED, max_norm=0.5, grads=rgrad,
                                         adamw=dict(lr=0.2)), "single-pass"),
    ("bf16 + float16 params, clip", dict(dtypes=[BF, torch.float16] * 4 + [BF], max_norm=0.5,
                                         grads=rgrad, adamw=dict(lr=0.2)), "mixed"),
    ("amsgrad", dict(adamw=dict(amsgrad=True, lr=0.3)), "native"),
    # native: KeyError; Cotangent: a RuntimeError naming it, by design (both raise)
    ("amsgrad switched on mid-run (an error)", dict(edit=group_edit(1, amsgrad=True)), None),
    ("beta1=0, maximize, eps=0, no decay from step 1", dict(edit=group_edit(
        1, lr=1.7, betas=(0.0, 0.9995), eps=0.0, weight_decay=0.0, maximize=True)),
     "single-pass"),
    ("special moments through a native state dict", dict(
        edit=special_state_through_native, adamw=dict(lr=0.3), steps=3), "single-pass"),
    ("threads 2 -> 1 -> 2", dict(edit=thread_flip, steps=3), "single-pass"),
    ("float64 step counts", dict(edit=float64_steps, adamw=dict(lr=0.3)), "single-pass"),
    ("gradients with gaps (stride 2)", dict(strided_grads=True), "mixed"),
]


# every case for-loop and foreach; foreach=None (the for-loop on the CPU) once
RUNS = [(case, foreach) for case in HELD for foreach in (False, True)] + [(HELD[1], None)]


@pytest.mark.parametrize("case,foreach", RUNS, ids=[
    f"{c[0]}-{ {False: 'for-loop', True: 'foreach', None: 'None'}[f]}" for c, f in RUNS])
def test_attack_held(case, foreach):
    name, kwargs, expect = case
    try:
        with threads(2):
            results = compare(foreach=foreach, **kwargs)
    finally:
        torch.set_num_threads(2)
    for step, problem, _ in results:
        assert problem is None, f"{name}, step {step}: {problem}"
    if expect is not None:
        paths = [path["path"] for _, _, path in results]
        assert paths == [expect] * len(paths), (name, paths, results[-1][2])


def test_tensor_lr_for_loop_and_foreach_refusal():
    """A tensor lr: for-loop takes the single pass with native's bytes (0-d float32 here; the
    other dtypes and shapes in the kernel test); with foreach both constructors raise native's
    ValueError."""
    with threads(2):
        results = compare(foreach=False, adamw=dict(lr=torch.tensor(0.3)), steps=2)
    for step, problem, path in results:
        assert problem is None, (step, problem)
        assert path["path"] == "single-pass", path
    p = torch.nn.Parameter(torch.ones(3, dtype=BF))
    for lr in TENSOR_LRS:
        for make in (torch.optim.AdamW, cotangent.AdamW):
            with pytest.raises(ValueError, match="lr as a Tensor"):
                make([p], lr=lr.clone(), foreach=True)


def test_control_the_comparison_sees_one_setting_or_bit_changed():
    """The AdamW comparison reports another lr on our arm only, and one bit of one bfloat16
    exp_avg element changed after the first step."""
    def our_lr(step, params, opt):
        if isinstance(opt, cotangent.AdamW):
            opt.param_groups[0]["lr"] = 1.01e-3

    with threads(2):
        results = compare(foreach=False, edit=our_lr, grads=rgrad)
    assert all(problem is not None for _, problem, _ in results)

    def nudge(step, params, opt):
        if isinstance(opt, cotangent.AdamW) and step == 1:
            opt.state[params[4]]["exp_avg"].view(-1).view(torch.int16)[7] ^= 1

    with threads(2):
        results = compare(foreach=True, edit=nudge, grads=rgrad, steps=2)
    assert results[0][1] is None and results[1][1] is not None, results
    a = torch.tensor([1.0], dtype=BF)
    b = a.clone()
    b.view(torch.int16)[0] ^= 1
    with pytest.raises(AssertionError):
        assert_same_bits(a, b, "one bit")
