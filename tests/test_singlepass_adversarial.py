"""Adversarial checks of the single-pass for-loop/foreach AdamW and the clip multiply inside it
(`cotangent.singlepass`, `cotangent.AdamW._defer_clip` / `_settle_clip`): cotangent.AdamW against
``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW`` on CPU float32, byte for byte after
every step (gradients, parameters, moments, step counts, total norm), and the same errors.

Two parts:
- `test_attack_held`: a case table of the attacks that held (hyperparameter edits mid-run, clip
  settings and extreme gradients, param groups sharing a buffer, hooks, thread and switch
  changes, checkpoints through native), each must keep native's bytes and, where the case is
  about it, take the single pass / clip in the pass;
- one test per divergence the review found (fixed since; each failed before its fix): scalars
  beyond float32 and foreach with non-float step tensors raise like native, a clip coefficient
  of 1.0 multiplies where that changes bits (a signalling NaN, flushed subnormals), version
  counters of state and gradients are bumped like native's in-place ops, ATen's real OpenMP
  team size (OMP_THREAD_LIMIT) places the scalar tails, a NaN hyperparameter keeps merged
  ranges apart, and threads flushing subnormals differently are a clear error.
"""

from __future__ import annotations

import copy
import io
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import cotangent
from bitwise import (assert_same_bits, assert_same_update, flush_denormal, group_edit,
                     require_single_pass_kernel, run_against_native, thread_flip, threads)
from cotangent import singlepass as sp
from cotangent.verify import first_difference

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


# ---------------------------------------------------------------------- divergences found


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
