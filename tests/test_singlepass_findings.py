"""The single pass against native on adversarial inputs: the findings of the kernel's reviews,
each a test (what each review did and found: docs/reviews.md). Every comparison is byte for byte
against ``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW`` (or native
`torch.optim.adam.adam` for the kernel alone), on the CPU, torch 2.13.

- the for-loop / foreach pass and the clip multiply inside it: `test_attack_held` (a case table
  of attacks that held) and one test per divergence found and fixed;
- the register path: `CASES` (direct `single_pass_adamw_` against native per segment), float
  modes that send the pass to its general path, amsgrad under denormals-are-zero;
- the bfloat16 pass: `test_kernel_matches_native_on_bf16_boundaries`, `test_bf16_attack_held`;
- the work split among threads: `split_compare` over shapes, dtypes and thread counts;
- controls: each comparison reports a changed setting or one changed bit.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import io
import math
import os
import subprocess
import sys
import textwrap

import cotangent
import pytest
import torch
from cotangent import singlepass as sp
from cotangent.verify import first_difference
from torch.optim.optimizer import (
    register_optimizer_step_post_hook, register_optimizer_step_pre_hook,
)

from bitwise import (
    assert_same_bits, assert_same_update, flush_denormal, group_edit, require_register_path,
    require_single_pass_kernel, run_against_native, thread_flip, threads,
)
from mutants import use_mutant


require_single_pass_kernel()


INF, NAN = float("inf"), float("nan")


# 1 element (all scalar tail), 17 (body 16 + tail 1), a 2-D one, one above ATen's grain size
# (two thread chunks at 2 threads, each with its own scalar tail), one 17 again (a bucket)
SHAPES = [(1,), (17,), (3, 33), (40000,), (17,)]


def random_grad(step: int, i: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))


def special_grad(step: int, i: int, shape) -> torch.Tensor:
    """Random values with zeros of both signs, infinities, NaNs of both signs, subnormals and
    huge values every 37th element (shifted by the step)."""
    values = (0.0, -0.0, INF, -INF, NAN, -NAN, 1e-40, -1e-40, 3e38, -3e38)
    g = random_grad(step, i, shape).reshape(-1)
    for k in range(step % 37, g.numel(), 37):
        g[k] = values[(k // 37) % len(values)]
    return g.view(shape)


def mild_grad(step: int, i: int, shape) -> torch.Tensor:
    """Random values with zeros of both signs and subnormals every 23rd element: a finite
    total norm, so the clip coefficient is a finite number the pass multiplies by."""
    values = (0.0, -0.0, 1e-40, -1e-40, 1e-30)
    g = random_grad(step, i, shape).reshape(-1)
    for k in range(step % 23, g.numel(), 23):
        g[k] = values[(k // 23) % len(values)]
    return g.view(shape)


def zero_grad_(step, i, shape):
    return torch.zeros(shape)


def big_grad(step, i, shape):  # grad * grad overflows float32
    return random_grad(step, i, shape) * 3e37


def one_inf_grad(step, i, shape):
    g = random_grad(step, i, shape)
    if i == 3:
        g.view(-1)[123] = INF
    return g


def sometimes_none(step, i, shape):
    return None if (i + step) % 3 == 0 else random_grad(step, i, shape)


def compare(*, foreach: bool, max_norm=1e-3, steps: int = 3, grads=mild_grad, edit=None,
            adamw=None, groups=None, norm_type=2.0, clip_order=None, set_grad="backward",
            set_to_none=True, shapes=SHAPES):
    """`bitwise.run_against_native` on float32 parameters of `shapes`, gradients
    ``grads(step, i, shape)`` (None: no gradient) delivered by a backward of ``(p * g).sum()``,
    which gives exactly g, or assigned to ``p.grad`` with ``set_grad="assign"``."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in shapes]

    def deliver(step, params):
        for i, p in enumerate(params):
            g = grads(step, i, p.shape) if p.requires_grad else None
            if g is None:
                continue
            if set_grad == "assign":
                p.grad = g.clone()
            else:
                (p * g).sum().backward()

    return run_against_native(base, foreach=foreach, deliver=deliver, steps=steps,
                              max_norm=max_norm, norm_type=norm_type, edit=edit, adamw=adamw,
                              groups=groups, clip_order=clip_order, set_to_none=set_to_none)


def toggles(step, params, opt):
    for g in opt.param_groups:
        g["maximize"] = step % 2 == 1
        g["amsgrad"] = step != 1  # built with amsgrad (native's state has max_exp_avg_sq)
        g["betas"] = ((0.0, 0.999), (0.9, 0.0), (0.5, 0.999))[step % 3]
        g["lr"] = torch.tensor(2e-3) if step == 1 and not opt.defaults["foreach"] else 1e-3


def switch_flip(step, params, opt):
    if isinstance(opt, cotangent.AdamW):
        os.environ[sp.ENV_SWITCH] = "0" if step == 1 else "1"


def requires_grad_flip(step, params, opt):
    params[3].requires_grad_(step % 2 == 0)
    params[0].requires_grad_(step != 1)


def round_trip_through_native(step, params, opt):
    """At step 1, the optimizer's state dict is saved, loaded into a native AdamW over the same
    parameters, and that one's state dict loaded back (Cotangent: packed again)."""
    if step == 1:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        tmp = torch.optim.AdamW(params, foreach=opt.defaults["foreach"])
        tmp.load_state_dict(torch.load(buf))
        opt.load_state_dict(copy.deepcopy(tmp.state_dict()))


def int64_steps(step, params, opt):
    if step == 1:
        for p in params:
            opt.state[p]["step"] = torch.tensor(int(opt.state[p]["step"]))


def step_pre_hook_doubling(step, params, opt):
    if step == 1:
        opt.register_step_pre_hook(
            lambda o, a, k: [p.grad.mul_(2.0) for p in params if p.grad is not None])


def step_post_hook_adding(step, params, opt):
    if step == 1:
        opt.register_step_post_hook(
            lambda o, a, k: [p.grad.add_(1.0) for p in params if p.grad is not None])


# (id, compare() arguments, where the single pass must have run: "all" = every step's path is
# "single-pass", "clip" = and the clip multiply ran in the pass at the last step, None = no check)
HELD = [
    # hyperparameters edited mid-run (constructor checks bypassed): each a new verdict key
    ("lr=0", dict(edit=group_edit(1, lr=0.0)), "clip"),
    ("decay=0 (lr*wd=1)", dict(edit=group_edit(1, lr=10.0, weight_decay=0.1)), "clip"),
    ("decay<0 (lr*wd=2)", dict(edit=group_edit(1, lr=20.0, weight_decay=0.1)), "clip"),
    ("decay subnormal lr", dict(edit=group_edit(1, lr=1e-45, weight_decay=1.0)), "clip"),
    ("huge decay", dict(edit=group_edit(1, weight_decay=1e40)), None),
    ("eps=0", dict(edit=group_edit(1, eps=0.0)), "clip"),
    ("eps subnormal", dict(edit=group_edit(1, eps=1e-45)), "clip"),
    ("eps=inf", dict(edit=group_edit(1, eps=INF)), None),
    ("eps<0", dict(edit=group_edit(1, eps=-1e-8)), "clip"),
    ("beta1=0", dict(edit=group_edit(1, betas=(0.0, 0.999))), "clip"),
    ("beta1=0.5 (lerp weight 0.5)", dict(edit=group_edit(1, betas=(0.5, 0.999))), "clip"),
    ("beta1 just above 0.5", dict(edit=group_edit(1, betas=(0.50000006, 0.999))), "clip"),
    ("beta1 near 1", dict(edit=group_edit(1, betas=(1 - 1e-8, 0.999))), "clip"),
    ("beta1<0", dict(edit=group_edit(1, betas=(-0.5, 0.999))), "clip"),
    ("beta2=0", dict(edit=group_edit(1, betas=(0.9, 0.0))), "clip"),
    ("beta2=1", dict(edit=group_edit(1, betas=(0.9, 1.0))), "clip"),
    ("beta2 rounds to 1", dict(edit=group_edit(1, betas=(0.9, 1 - 1e-9))), "clip"),
    ("lr float->tensor, betas/maximize/amsgrad toggled",
     dict(edit=toggles, steps=4, adamw=dict(amsgrad=True)), "all"),
    ("amsgrad+maximize+beta1=0", dict(adamw=dict(amsgrad=True, maximize=True,
                                                 betas=(0.0, 0.99))), "clip"),
    ("amsgrad+beta1=0, NaN/inf gradients, no clip",
     dict(max_norm=None, grads=special_grad, adamw=dict(amsgrad=True, betas=(0.0, 0.99))), "all"),
    ("eps=0, weight decay, NaN/inf gradients",
     dict(grads=special_grad, edit=group_edit(1, eps=0.0, weight_decay=0.5)), "all"),
    # the clip: coefficients of every class, norms of every kind, extreme gradients
    ("max_norm=0", dict(max_norm=0.0, grads=random_grad), "clip"),
    ("max_norm<0", dict(max_norm=-1.0, grads=random_grad), "clip"),
    ("max_norm=inf", dict(max_norm=INF, grads=random_grad), "all"),
    ("max_norm=nan", dict(max_norm=NAN, grads=random_grad), "all"),
    ("max_norm subnormal", dict(max_norm=1e-45, grads=random_grad), "clip"),
    ("norm inf", dict(norm_type=INF, grads=random_grad), "clip"),
    ("norm 1", dict(norm_type=1.0), "clip"),
    ("NaN gradients (NaN coefficient: multiplied apart)", dict(grads=special_grad), "all"),
    ("norm 0.5", dict(norm_type=0.5, grads=random_grad), "clip"),
    ("norm 0 with NaN gradients", dict(norm_type=0.0, max_norm=1.0, grads=special_grad), "clip"),
    ("all-zero gradients (norm 0)", dict(grads=zero_grad_), "all"),
    ("grad*grad overflows", dict(grads=big_grad), "clip"),
    ("one inf gradient (coefficient 0)", dict(grads=one_inf_grad), "clip"),
    ("no clip, special gradients", dict(max_norm=None, grads=special_grad), "all"),
    # what is clipped and what shares a buffer
    ("clip_order with a duplicate", dict(clip_order=lambda p: [p[0], p[0]] + p[1:]), "all"),
    ("clip_order with the big one twice", dict(clip_order=lambda p: [p[3]] + p), "all"),
    ("clip_order subset", dict(clip_order=lambda p: [p[1], p[3]], grads=random_grad), "all"),
    ("clip_order reversed", dict(clip_order=lambda p: p[::-1], grads=random_grad), "clip"),
    ("groups sharing a buffer", dict(clip_order=lambda p: p, grads=random_grad, groups=[
        dict(params=[0, 3]), dict(params=[1, 2], lr=0.1, amsgrad=True),
        dict(params=[4], betas=(0.0, 0.5), maximize=True, weight_decay=0.0)]), "clip"),
    ("for-loop and foreach groups in one buffer", dict(clip_order=lambda p: p, groups=[
        dict(params=[0, 3], foreach=True), dict(params=[1, 2, 4], foreach=False)]), "clip"),
    ("a fused group in the buffer", dict(clip_order=lambda p: p, groups=[
        dict(params=[0, 3], fused=True), dict(params=[1, 2, 4])]), None),
    ("gradients missing at some steps", dict(grads=sometimes_none, steps=4), "all"),
    ("requires_grad toggled", dict(edit=requires_grad_flip, grads=random_grad), "all"),
    ("set_to_none=False", dict(set_to_none=False, grads=sometimes_none, steps=4), "all"),
    ("gradients assigned", dict(set_grad="assign"), "all"),
    # hooks, threads, the switch, checkpoints
    ("step pre-hook added after step 0", dict(edit=step_pre_hook_doubling), "all"),
    ("step post-hook added after step 0", dict(edit=step_post_hook_adding), "clip"),
    ("threads 2 -> 1 -> 2", dict(edit=thread_flip), "clip"),
    ("COTANGENT_SINGLE_PASS=0 at step 1 only", dict(edit=switch_flip), None),
    ("state dict through native AdamW", dict(edit=round_trip_through_native,
                                              adamw=dict(amsgrad=True)), "clip"),
]


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("case", HELD, ids=[c[0] for c in HELD])
def test_attack_held(case, foreach, monkeypatch):
    name, kwargs, expect = case
    monkeypatch.setenv(sp.ENV_SWITCH, "1")
    with threads(2):
        results = compare(foreach=foreach, **kwargs)
    for step, problem, _, errors in results:
        assert problem is None, f"{name}, step {step}: {problem}"
    if expect is not None:
        paths = [path["path"] for _, _, path, _ in results]
        assert paths == ["single-pass"] * len(paths), (name, paths, results[-1][2])
    if expect == "clip":
        assert results[-1][2]["clip_in_pass"] > 0, (name, results[-1][2])


def test_global_step_hooks_are_followed():
    """A global step pre-hook (gradients doubled: the clip multiply stays apart) and a global
    post-hook (gradients edited after the update), registered after the first step."""
    handles = []

    def edit(step, params, opt):
        if step == 1 and not isinstance(opt, cotangent.AdamW):
            def pre(o, a, k):
                for g in o.param_groups:
                    for p in g["params"]:
                        p.grad.mul_(2.0)

            def post(o, a, k):
                for g in o.param_groups:
                    for p in g["params"]:
                        p.grad.add_(0.5)
            handles.extend([register_optimizer_step_pre_hook(pre),
                            register_optimizer_step_post_hook(post)])

    try:
        with threads(2):
            results = compare(foreach=False, edit=edit, grads=random_grad)
    finally:
        for h in handles:
            h.remove()
    for step, problem, path, _ in results:
        assert problem is None, f"step {step}: {problem}"
        assert path["path"] == "single-pass"
    assert [r[2]["clip_in_pass"] for r in results] == [5, 0, 0]


def test_int64_step_counts_for_loop():
    with threads(2):
        results = compare(foreach=False, edit=int64_steps)
    for step, problem, path, _ in results:
        assert problem is None, f"step {step}: {problem}"
        assert path["path"] == "single-pass"


def test_control_the_comparison_sees_one_setting_changed():
    """The comparison catches a difference: another lr on our arm only, and one ULP on one
    gradient element, are reported."""
    def our_lr(step, params, opt):
        if isinstance(opt, cotangent.AdamW):
            opt.param_groups[0]["lr"] = 1.0001e-3

    with threads(2):
        results = compare(foreach=False, edit=our_lr, grads=random_grad)
    assert all(problem is not None for _, problem, _, _ in results)

    def nudge(step, params, opt):
        if isinstance(opt, cotangent.AdamW) and step == 1:
            opt.state[params[3]]["exp_avg"].view(-1).view(torch.int32)[7] += 1

    with threads(2):
        results = compare(foreach=True, edit=nudge, max_norm=None)
    assert results[0][1] is None and results[1][1] is not None, results


def _first_step_then(edit_after_first, *, foreach=False, **kw):
    def edit(step, params, opt):
        if step == 1:
            edit_after_first(params, opt)
    return compare(foreach=foreach, edit=edit, steps=2, **kw)


def test_flush_denormal_after_the_thread_pool_started_keeps_the_native_path():
    """torch.set_flush_denormal(True) after ATen's pool started reaches the calling thread only:
    native then flushes in its first thread chunk and not in the second (before the fix the
    single pass, which splits blocks differently, differed in ~15,300 exp_avg_sq elements with
    path "single-pass"). The single pass reads every OpenMP thread's float modes and refuses
    (here native's per-tensor ops run, with native's chunks: the same bytes)."""
    with threads(2):
        torch.ones(1 << 17).add_(1.0)  # the pool's worker thread exists, without FTZ/DAZ
        gen = torch.Generator().manual_seed(0)
        base = [torch.randn(100, generator=gen), torch.randn(65536, generator=gen)]
        p1 = [torch.nn.Parameter(b.clone()) for b in base]
        p2 = [torch.nn.Parameter(b.clone()) for b in base]
        native = torch.optim.AdamW(p1, foreach=False)
        ours = cotangent.AdamW(p2, foreach=False)
        with flush_denormal():
            size, modes = sp.team()
            assert size == 2 and len(set(modes)) == 2  # the premise: the modes differ
            for params in (p1, p2):
                for i, p in enumerate(params):
                    p.grad = random_grad(0, i, p.shape) * 1e-20  # grad * grad is subnormal
            native.step()
            ours.step()
        path = ours.update_path()
        assert path["path"] == "native" and any("float modes" in n
                                                for n in path["single_pass_notes"]), path
        assert_same_update(p1, native.state, p2, ours.state, "flush_denormal after pool start")


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_step_size_beyond_float32_raises_like_native(foreach):
    with threads(2):
        results = _first_step_then(
            lambda params, opt: opt.param_groups[0].update(lr=1e38), foreach=foreach,
            adamw=dict(weight_decay=0.0), grads=random_grad, max_norm=None)
    native_error, our_error = results[1][3]
    assert native_error is not None and "overflow" in native_error
    assert our_error is not None, f"native raised ({native_error}), Cotangent did not"


def test_foreach_integer_step_counts_raise_like_native():
    with threads(2):
        results = compare(foreach=True, edit=int64_steps, grads=random_grad, steps=2)
    native_error, our_error = results[1][3]
    assert native_error is not None
    assert our_error is not None, f"native raised ({native_error[:80]}), Cotangent did not"


def test_signalling_nan_gradient_and_coefficient_one():
    def snan(step, i, shape):
        g = random_grad(step, i, shape)
        g.view(-1).view(torch.int32)[0] = 0x7F800001
        return g

    with threads(2):
        results = compare(foreach=False, max_norm=1e9, norm_type=0.0, grads=snan,
                          set_grad="assign", steps=1)
    assert results[0][1] is None, results[0][1]


def test_subnormal_gradient_and_coefficient_one_under_daz():
    def subnormal(step, i, shape):
        g = random_grad(step, i, shape)
        g.view(-1).view(torch.int32)[::3] = 1000
        return g

    with threads(1), flush_denormal():
        results = compare(foreach=False, max_norm=1e9, grads=subnormal, set_grad="assign",
                          steps=1, shapes=[(20,), (40,)])
    assert results[0][1] is None, results[0][1]


@pytest.mark.parametrize("key", ["exp_avg", "step"])
def test_state_version_counters_bumped_like_native(key):
    with threads(2):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(17)), torch.nn.Parameter(torch.randn(40000))]
        opt = cotangent.AdamW(params, foreach=False)
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = random_grad(step, i, p.shape)
            if step == 1:
                w = torch.ones((), requires_grad=True)
                saved = (w * opt.state[params[0]][key]).sum()
            opt.step()
        assert opt.update_path()["path"] == "single-pass"
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()


def test_clip_bumps_gradient_version_counters():
    with threads(2):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(17)), torch.nn.Parameter(torch.randn(40000))]
        opt = cotangent.AdamW(params, foreach=False, max_norm=1e-3)
        for i, p in enumerate(params):
            (p * random_grad(0, i, p.shape)).sum().backward()
        w = torch.ones((), requires_grad=True)
        saved = (w * params[0].grad).sum()
        opt.step()
        assert opt.update_path()["clip_in_pass"] == 2
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()


@pytest.mark.slow
def test_omp_thread_limit_below_torch_threads():
    script = textwrap.dedent("""
        import sys, torch, cotangent
        sys.path.insert(0, sys.argv[1])
        from bitwise import assert_same_update
        torch.set_num_threads(2)
        base = torch.randn(65553, generator=torch.Generator().manual_seed(0))
        p1, p2 = torch.nn.Parameter(base.clone()), torch.nn.Parameter(base.clone())
        native = torch.optim.AdamW([p1], amsgrad=True, betas=(0.0, 0.99), foreach=False)
        ours = cotangent.AdamW([p2], amsgrad=True, betas=(0.0, 0.99), foreach=False)
        for p in (p1, p2):
            p.grad = torch.full((65553,), float("nan"))
        native.step()
        ours.step()
        assert ours.update_path()["path"] == "single-pass", ours.update_path()
        assert_same_update([p1], native.state, [p2], ours.state, "OMP_THREAD_LIMIT=1")
        print("SAME BYTES")
    """)
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SAME BYTES" in proc.stdout, proc.stderr[-1500:]


def test_nan_beta1_in_the_merged_native_path():
    def neg_nan(step, i, shape):
        return torch.full(shape, -NAN) if step == 1 else random_grad(step, i, shape)

    with threads(2):
        results = _first_step_then(
            lambda params, opt: opt.param_groups[0].update(betas=(NAN, 0.999)),
            grads=neg_nan, set_grad="assign", max_norm=None, shapes=[(1,), (1,)])
    assert results[1][2]["path"] == "native"
    assert results[1][1] is None, results[1][1]


def test_bits_helpers_are_the_ones_used():
    """The comparison in this file is `cotangent.verify.first_difference` (bytes, ULP), the
    helpers of tests/bitwise.py: a NaN payload and a zero sign count."""
    a = torch.tensor([0.0, NAN])
    b = a.clone()
    b.view(torch.int32)[1] |= 1
    assert first_difference(a, b) is not None
    assert first_difference(torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    assert_same_bits(a, a.clone(), "same")
    assert math.isnan(a[1].item())


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
    assert sp.sqrt_kind() in ("emulated", "emulated14", "hardware")  # (the register path's)
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


BF = torch.bfloat16


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


BF16_LENGTHS = (1, 16, 17, 31, 32, 33, 65, 100)


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
            cases.append((impl, BF16_LENGTHS, dict(lr=lr, beta1=b1, beta2=b2, eps=eps,
                                              weight_decay=wd, maximize=k % 3 == 1)))
    for lr in TENSOR_LRS:  # for-loop only (native foreach refuses a tensor lr)
        cases.append(("for-loop", BF16_LENGTHS, dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-3,
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
        d = kernel_vs_native(impl, BF16_LENGTHS, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-3,
                             weight_decay=0.5, scales=(1.0, 1e-6, 1e-3))  # roots near eps
        assert d is not None, impl


BF16_SHAPES = [(), (1,), (17,), (3, 33), (40002,), (31,), (32,), (65,), (0,)]


def rgrad(step, i, shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i))
            * scale).to(dtype)


def bf16_special_grad(step, i, shape, dtype):
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


def bf16_compare(*, foreach, max_norm=None, steps=2, grads=bf16_special_grad, edit=None, adamw=None,
            groups=None, dtypes=None, shapes=BF16_SHAPES, norm_type=2.0, strided_grads=False):
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


# (id, bf16_compare() arguments, the path every step must take: "single-pass", "native", "mixed",
# or None: byte equality only (and equal errors))
BF16_HELD = [
    ("large updates", dict(adamw=dict(lr=0.5, weight_decay=0.1, eps=1e-3, betas=(0.9, 0.95))),
     "single-pass"),
    ("clip, special gradients (NaN norm)", dict(max_norm=1.0), "single-pass"),
    ("clip norm inf", dict(max_norm=0.1, norm_type=INF, grads=rgrad, shapes=BF16_SHAPES[:-1]),
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
RUNS = [(case, foreach) for case in BF16_HELD for foreach in (False, True)] + [(BF16_HELD[1], None)]


@pytest.mark.parametrize("case,foreach", RUNS, ids=[
    f"{c[0]}-{ {False: 'for-loop', True: 'foreach', None: 'None'}[f]}" for c, f in RUNS])
def test_bf16_attack_held(case, foreach):
    name, kwargs, expect = case
    try:
        with threads(2):
            results = bf16_compare(foreach=foreach, **kwargs)
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
        results = bf16_compare(foreach=False, adamw=dict(lr=torch.tensor(0.3)), steps=2)
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
        results = bf16_compare(foreach=False, edit=our_lr, grads=rgrad)
    assert all(problem is not None for _, problem, _ in results)

    def nudge(step, params, opt):
        if isinstance(opt, cotangent.AdamW) and step == 1:
            opt.state[params[4]]["exp_avg"].view(-1).view(torch.int16)[7] ^= 1

    with threads(2):
        results = bf16_compare(foreach=True, edit=nudge, grads=rgrad, steps=2)
    assert results[0][1] is None and results[1][1] is not None, results
    a = torch.tensor([1.0], dtype=BF)
    b = a.clone()
    b.view(torch.int16)[0] ^= 1
    with pytest.raises(AssertionError):
        assert_same_bits(a, b, "one bit")


BLOCK = 16384  # the kernel's block (elements per array)


def _tiny(count: int, seed: int = 1) -> list[tuple[int, ...]]:
    sizes = torch.randint(1, 18, (count,), generator=torch.Generator().manual_seed(seed))
    return [(int(s),) for s in sizes]


# (id, shapes, thread counts)
LAYOUTS = [
    ("120 x 1-element, large last", [(1,)] * 120 + [(40003,)], (2,)),
    ("large first, 120 x 1-element", [(40003,)] + [(1,)] * 120, (4,)),
    ("tiny 1..17 around a large one", _tiny(60) + [(40003,)] + _tiny(60, 2), (3,)),
    ("2 blocks exactly (share ends on a block start)", [(BLOCK,), (BLOCK,)], (2,)),
    ("4 blocks exactly at 4 threads", [(BLOCK,)] * 4, (4,)),
    ("16384, 16385, 16383, 1", [(BLOCK,), (BLOCK + 1,), (BLOCK - 1,), (1,)], (2, 3)),
    ("a single 1-element tensor (empty shares)", [(1,)], (1, 4, 16)),
    ("one tensor of 3 blocks + 1", [(3 * BLOCK + 1,)], (2, 16)),
]


# (id, dtype, foreach, max_norm, amsgrad); bfloat16: no amsgrad in the pass
CONFIGS = [
    ("f32 for-loop clip amsgrad", torch.float32, False, 1e-2, True),
    ("f32 foreach", torch.float32, True, None, False),
    ("bf16 foreach clip", torch.bfloat16, True, 1e-2, False),
    ("bf16 for-loop", torch.bfloat16, False, None, False),
]


def split_compare(shapes, dtype, foreach, max_norm, amsgrad, nthreads, lr=1e-3, steps=2):
    """`run_against_native` with gradients assigned, None where (i + step) % 3 == 1."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    delivered = []

    def deliver(step, params):
        n = 0
        for i, p in enumerate(params):
            if (i + step) % 3 == 1:
                continue
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            p.grad = g.to(dtype)
            n += 1
        delivered.append(n)

    with threads(nthreads):
        results = run_against_native(
            base, foreach=foreach, deliver=deliver, steps=steps, max_norm=max_norm,
            adamw=dict(lr=lr, amsgrad=amsgrad, weight_decay=0.1))
    return results, delivered[::2]  # each step delivers to both arms


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_split_layouts(layout, config, monkeypatch):
    monkeypatch.setenv(sp.ENV_SWITCH, "1")
    name, shapes, counts = layout
    cname, dtype, foreach, max_norm, amsgrad = config
    for n in counts:
        results, delivered = split_compare(shapes, dtype, foreach, max_norm, amsgrad, n)
        for (step, problem, path, _), got in zip(results, delivered):
            assert problem is None, f"{name}, {cname}, {n} threads, step {step}: {problem}"
            if got:  # a step where some gradient exists ran the single pass
                assert path["path"] == "single-pass", (name, cname, n, step, path)


def test_split_control_sees_another_lr(monkeypatch):
    """The byte comparison does report a difference: native at lr 1e-3, ours at 2e-3."""
    monkeypatch.setenv(sp.ENV_SWITCH, "1")
    shapes = [(1,)] * 120 + [(40003,)]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in shapes]

    def deliver(step, params):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))

    def edit(step, params, opt):
        if step == 0 and isinstance(opt, cotangent.AdamW):
            for g in opt.param_groups:
                g["lr"] = 2e-3

    with threads(2):
        results = run_against_native(base, foreach=False, deliver=deliver, steps=1, edit=edit)
    assert results[0][2]["path"] == "single-pass", results[0][2]
    assert results[0][1] is not None and "parameter" in results[0][1], results[0][1]


def _direct(segments, n, nthreads, dtype=torch.float32, amsgrad=False, clip=None,
            implementation="for-loop"):
    """`single_pass_adamw_` over buffers of `n` elements on `segments` against native
    `torch.optim.adam.adam` (decoupled decay) on each segment as its own tensor (after
    ``mul_(clip)`` when given); elements outside every segment must keep their bytes."""
    from torch.optim.adam import adam

    gen = torch.Generator().manual_seed(n + len(segments))
    bufs = [torch.randn(n, generator=gen).to(dtype) for _ in range(3)]
    bufs += [torch.rand(n, generator=gen).to(dtype) for _ in range(2 if amsgrad else 1)]
    bufs += [None] * (5 - len(bufs))
    native = [[t[o:o + k].clone() for o, k in segments] if t is not None else None for t in bufs]
    ours = [t.clone() if t is not None else None for t in bufs]
    native_steps = [torch.tensor(float(i)) for i in range(len(segments))]
    our_steps = [s.clone() for s in native_steps]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False,
              amsgrad=amsgrad)
    foreach = implementation == "foreach"
    with threads(nthreads), torch.no_grad():
        if segments:
            if clip is not None:
                for g in native[1]:
                    g.mul_(clip)
            adam(native[0], native[1], native[2], native[3], native[4] if amsgrad else [],
                 native_steps, foreach=foreach, decoupled_weight_decay=True, **kw)
        sp.single_pass_adamw_(*ours, our_steps, segments=segments, clip_coef=clip,
                              implementation=implementation, **kw)
    covered = torch.zeros(n, dtype=torch.bool)
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    for j, (o, k) in enumerate(segments):
        covered[o:o + k] = True
        for i, what in enumerate(names):
            if bufs[i] is not None:
                assert_same_bits(ours[i][o:o + k], native[i][j],
                                 f"{what} of segment {j} ({o}, {k}), {nthreads} threads")
        assert_same_bits(our_steps[j], native_steps[j], f"step of segment {j}")
    for i, what in enumerate(names):
        if bufs[i] is not None:
            assert_same_bits(ours[i][~covered], bufs[i][~covered], f"{what} outside segments")


@pytest.mark.parametrize("nthreads", [1, 2, 3, 4, 16])
def test_direct_kernel_segments(nthreads):
    _direct([], 100, nthreads)
    _direct([], 0, nthreads)
    _direct([(0, 0), (5, 0), (100, 0)], 100, nthreads)
    _direct([(0, 0), (3, 1), (4, 0), (10, BLOCK + 1), (BLOCK + 11, 0), (BLOCK + 11, BLOCK)],
            40000, nthreads, amsgrad=True, clip=0.5)
    small = [(2 * i, 1) for i in range(300)]  # padding between them
    _direct(small + [(600, 70001)], 70601, nthreads, amsgrad=True, clip=0.25,
            implementation="foreach")
    _direct([(0, 70001)] + [(o + 70001, k) for o, k in small], 70601, nthreads,
            dtype=torch.bfloat16)
    _direct([(0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, BLOCK), (3 * BLOCK, BLOCK)], 4 * BLOCK,
            nthreads, amsgrad=True)


def test_direct_kernel_control():
    """`_direct` reports a difference: native's gradient of segment 0 changed before the step."""
    from torch.optim import adam as adam_module

    real = adam_module.adam

    def tampered(params, grads, *a, **k):
        grads[0][0] += 1.0
        return real(params, grads, *a, **k)

    adam_module.adam = tampered
    try:
        with pytest.raises(AssertionError, match="segment 0"):
            _direct([(0, 5), (5, BLOCK + 3)], BLOCK + 8, 2)
    finally:
        adam_module.adam = real


@pytest.mark.slow
def test_omp_thread_limit_with_many_small_tensors():
    """OMP_THREAD_LIMIT=1 with torch.set_num_threads(2): a team of one takes every block."""
    script = textwrap.dedent("""
        import os, sys, torch
        sys.path.insert(0, sys.argv[1])
        from bitwise import run_against_native
        os.environ["COTANGENT_SINGLE_PASS"] = "1"
        torch.set_num_threads(2)
        gen = torch.Generator().manual_seed(0)
        shapes = [(1,)] * 100 + [(40003,)] + [(3,)] * 50
        for dtype, foreach, max_norm, ams in [(torch.float32, False, 1e-2, True)]:
            base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
            def deliver(step, params):
                for i, p in enumerate(params):
                    if (i + step) % 3 != 1:
                        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(
                            100 * step + i)).to(dtype)
            res = run_against_native(base, foreach=foreach, deliver=deliver, steps=3,
                                     max_norm=max_norm, adamw=dict(amsgrad=ams))
            for step, problem, path, _ in res:
                assert problem is None, (dtype, foreach, step, problem)
                assert path["path"] == "single-pass", path
        print("SAME BYTES")
    """)
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SAME BYTES" in proc.stdout, proc.stderr[-1500:]
