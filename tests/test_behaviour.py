"""Behaviour against native: the parity table, properties (hypothesis), and single behaviours.

Behaviour that is not a training scenario of the case table: checkpoints, hooks, zero_grad
variants, errors, copies and caches, each compared byte for byte with the native oracle
(`cotangent.ReferenceUpdate`) through `cotangent.verify.first_difference`. CPU, torch 2.13.0.

`cotangent.AdamW` vs `clip_grad_norm_` + `torch.optim.AdamW` over the case table, byte for byte.

Holds for: CPU (x86-64), the installed torch (2.13.0 in CI), float32 weights with FP32 or BF16
autocast, plus bfloat16 / float16 parameters where a case says so; each native AdamW
implementation (fused, foreach, for-loop) with `clip_grad_norm_(foreach=None)`.

Property tests (hypothesis): random parameter lists, dtypes, lengths and hyperparameters,
cotangent vs native compared byte for byte (CPU).
"""

from __future__ import annotations

import copy
import io

import cotangent
import pytest
import torch
import torch.nn as nn
from cotangent.harness.packed import PackedAdamW
from hypothesis import given, settings, strategies as st

from bitwise import assert_same_bits, assert_same_update, assert_step_refused, same_bits
from cases import (CASES, drive, HP, lockstep, mlp, OBSERVATIONS, run_case, Side,
                   SINGLE_PASS_OBSERVATIONS)


def compare(m1, o1, m2, o2, what):
    """Every parameter, gradient and state entry of two (model, optimizer) pairs, byte for byte."""
    assert_same_update(m1.parameters(), o1.state, m2.parameters(), o2.state, what,
                       [n for n, _ in m1.named_parameters()])


# the model-level driver on itself: (points of the native side, of Cotangent's, a nudge of one
# ULP into Cotangent's parameter at point 2) -> the error it must raise (None: none)
DRIVE_SELF_CHECKS = {
    "equal sides": (3, 3, False, None),
    "native's side one point longer": (3, 2, False, r"after 2 points \(Cotangent's side ended"),
    "Cotangent's side one point longer": (2, 3, False, r"after 2 points \(native's side ended"),
    "one ULP in a parameter": (3, 3, True, r"point 2 .*parameter 0\.weight.*\(1 ULP\)"),
}


@pytest.mark.parametrize("name", list(DRIVE_SELF_CHECKS))
def test_the_driver_sees_sides_that_end_apart_or_differ(name):
    """`cases.drive` compares at every point and insists both patterns end together, whichever
    side runs longer (a point of one side left uncompared would hide a difference)."""
    native_points, our_points, nudge, error = DRIVE_SELF_CHECKS[name]
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    native = Side(m1, True, opts=(torch.optim.AdamW(m1.parameters(), **HP),))
    ours = Side(m2, False, opts=(torch.optim.AdamW(m2.parameters(), **HP),))

    def pattern(side):
        for point in range(native_points if side.native else our_points):
            if nudge and point == 1 and not side.native:
                with torch.no_grad():
                    w = side.model[0].weight.view(-1)
                    w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
            yield point

    if error is None:
        assert drive(pattern, native, ours, name) == native_points
    else:
        with pytest.raises(AssertionError, match=error):
            drive(pattern, native, ours, name)


@pytest.mark.slow
@pytest.mark.slow
def test_zero_grad_keep_and_model_zero_grad():
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    n = cotangent.ReferenceUpdate(m1.parameters(), 0.05, fused=True, **HP)
    o = cotangent.AdamW(m2.parameters(), max_norm=0.05, fused=True, **HP)
    for step, how in enumerate(["opt-keep", "model-none", "model-keep", "opt-none"]):
        x = torch.randn(4, 8)
        if how == "opt-keep":
            n.optimizer.zero_grad(set_to_none=False)
            o.zero_grad(set_to_none=False)
        elif how == "model-none":
            m1.zero_grad()
            m2.zero_grad()
        elif how == "model-keep":
            m1.zero_grad(set_to_none=False)
            m2.zero_grad(set_to_none=False)
        else:
            n.optimizer.zero_grad()
            o.zero_grad()
        for m in (m1, m2):
            m(x).square().mean().backward()
        n.step()
        o.step()
        compare(m1, n.optimizer, m2, o, how)


def test_add_param_group_after_construction():
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    # the clip takes the param groups in order, as the loop that clips opt's parameters does
    n = cotangent.ReferenceUpdate(m1[0].parameters(), 0.05, fused=True,
                                  clip_order="param_groups", **HP)
    o = cotangent.AdamW(m2[0].parameters(), max_norm=0.05, fused=True,
                        clip_order="param_groups", **HP)

    def add_head(step, side):
        model, opt = side
        if step == 2:
            opt.add_param_group({"params": list(model[3].parameters()), "lr": 1e-2})

    lockstep(m1, n, m2, o, 4, "add_param_group", edit=add_head, edit_before_backward=True)
    assert int(o.state[m2[3].weight]["step"]) == 2


def test_grad_scaler_with_fused_adamw():
    scaler1, scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), torch.amp.GradScaler(
        "cpu", init_scale=2.0 ** 8)
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), fused=True, **HP)
    o2 = cotangent.AdamW(m2.parameters(), fused=True, max_norm=None, **HP)
    for step in range(4):
        x = torch.randn(4, 8)
        if step == 2:
            x[0, 0] = float("inf")  # overflow step: nothing may change
        for m, o, s in ((m1, o1, scaler1), (m2, o2, scaler2)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
            s.step(o)
            s.update()
        compare(m1, o1, m2, o2, f"scaler step {step}")
    assert int(o2.state[m2[0].weight]["step"]) == 3  # the overflow step did not count
    assert scaler1.get_scale() == scaler2.get_scale()


@pytest.mark.parametrize("direction", ["native->cotangent", "cotangent->native"])
def test_state_dict_round_trip_then_identical_training(direction):
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    a = torch.optim.AdamW(m1.parameters(), fused=True, **HP)
    b = cotangent.AdamW(m2.parameters(), fused=True, **HP)
    lockstep(m1, a, m2, b, 3, "before saving")
    src = a if direction == "native->cotangent" else b
    buf = io.BytesIO()
    torch.save({"model": (m1 if src is a else m2).state_dict(), "opt": src.state_dict()}, buf)
    data = buf.getvalue()
    ckpt = torch.load(io.BytesIO(data), map_location="cpu")
    ckpt_copy = torch.load(io.BytesIO(data), map_location="cpu")  # loading shares tensors
    m3, m4 = mlp(), mlp()
    m3.load_state_dict(ckpt["model"])
    m4.load_state_dict(ckpt["model"])
    reference = torch.optim.AdamW(m3.parameters(), fused=True, **HP)
    resumed = (cotangent.AdamW(m4.parameters(), fused=True, **HP)
               if direction == "native->cotangent" else torch.optim.AdamW(m4.parameters(),
                                                                           fused=True, **HP))
    reference.load_state_dict(ckpt["opt"])
    resumed.load_state_dict(ckpt_copy["opt"])
    lockstep(m3, reference, m4, resumed, 3, "after resume")


def test_bad_input_raises_and_changes_nothing():
    lin = nn.Linear(3, 3)
    before = [p.detach().clone() for p in lin.parameters()]
    ptrs = [p.data_ptr() for p in lin.parameters()]
    bad = [
        (dict(lr=-1.0), ValueError),
        (dict(betas=(1.0, 0.9)), ValueError),
        (dict(eps=-1.0), ValueError),
        (dict(weight_decay=-0.1), ValueError),
    ]
    for kw, exc in bad:
        with pytest.raises(exc):
            cotangent.AdamW(lin.parameters(), **kw)
    with pytest.raises(ValueError, match="empty"):
        cotangent.AdamW([])
    with pytest.raises(ValueError, match="max_norm"):
        cotangent.AdamW(lin.parameters(), max_norm="big")
    for p, b, ptr in zip(lin.parameters(), before, ptrs):
        assert same_bits(p, b) and p.data_ptr() == ptr and p.grad is None


def test_sparse_gradient_is_a_clear_error_naming_the_parameter():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = cotangent.AdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="parameter 0 .* received a sparse gradient"):
        opt.step()


def _two_params(cls, **kw):
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    return a, b, cls([a, b], lr=0.1, weight_decay=0.5, **kw)


def _state_and_values(a, b, opt):
    return [a.detach().clone(), b.detach().clone(), a.grad, b.grad,
            {k: v.clone() for k, v in opt.state.get(b, {}).items()}]


def _assert_same_outcome(native, ours, what):
    for x, y in zip(native[:4], ours[:4]):
        assert_same_bits(x, y, what)
    assert native[4].keys() == ours[4].keys(), what
    for k in native[4]:
        assert_same_bits(native[4][k], ours[4][k], f"{what}: {k}")


@pytest.mark.parametrize("cls", [cotangent.AdamW])
def test_zero_grad_keep_does_not_invent_gradients(cls):
    outcomes = []
    for c in (torch.optim.AdamW, cls):
        a, b, opt = _two_params(c)
        opt.zero_grad(set_to_none=False)
        a.sum().backward()  # b gets no gradient
        opt.step()
        outcomes.append(_state_and_values(a, b, opt))
    _assert_same_outcome(*outcomes, "zero_grad(set_to_none=False) before any gradient")


def test_gradients_written_by_hand_are_seen():
    outcomes = []
    for c in (torch.optim.AdamW, cotangent.AdamW):
        a, b, opt = _two_params(c)
        opt.zero_grad()
        a.sum().backward()
        g = torch.full((3,), 0.5)
        if b.grad is None:  # a common pattern for hand-computed gradients
            b.grad = g
        else:
            b.grad.add_(g)
        opt.step()
        outcomes.append(_state_and_values(a, b, opt))
    _assert_same_outcome(*outcomes, "hand-written gradient")
    outcomes = []
    for c in (torch.optim.AdamW, cotangent.AdamW):  # no backward at all, in-place writes
        a, b, opt = _two_params(c, foreach=False)
        opt.zero_grad(set_to_none=False) if c is torch.optim.AdamW else opt.zero_grad()
        for p in (a, b):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.add_(0.25)
        opt.step()
        outcomes.append(_state_and_values(a, b, opt))
    _assert_same_outcome(*outcomes, "in-place gradient without backward")


def test_step_without_any_gradient_is_a_no_op():
    for kw in ({}, {"max_norm": 1.0}):
        p = torch.nn.Parameter(torch.ones(3))
        opt = cotangent.AdamW([p], **kw)
        opt.zero_grad()
        opt.step()
        assert not opt.state and torch.equal(p.detach(), torch.ones(3)) and p.grad is None


@pytest.mark.parametrize("how", ["load_state_dict", "add_param_group"])
def test_repacking_keeps_absent_gradients_absent(how):
    outcomes = []
    for cls in (torch.optim.AdamW, cotangent.AdamW):
        a, b, opt = _two_params(cls)
        (a.sum() + b.sum()).backward()
        opt.step()
        opt.zero_grad()
        if how == "load_state_dict":
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        else:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
        a.sum().backward()  # b unused in this step
        opt.step()
        outcomes.append(_state_and_values(a, b, opt))
    _assert_same_outcome(*outcomes, how)


def test_unused_parameters_read_none_after_backward_like_native():
    """Users who clip themselves (max_norm=None) must see the same grads as native."""
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), fused=True, **HP)
    o2 = cotangent.AdamW(m2.parameters(), fused=True, **HP)
    for step in range(3):
        x = torch.randn(4, 8)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m[3](m[2](m[0](x))).square().mean().backward()  # the LayerNorm m[1] is unused
            assert m[1].weight.grad is None
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
        compare(m1, o1, m2, o2, f"external clip, step {step}")


def test_thread_count_change_recalibrates():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        m1 = mlp()
        m2 = copy.deepcopy(m1)
        n = cotangent.ReferenceUpdate(m1.parameters(), 0.05, norm_type=1.0, fused=True, **HP)
        o = cotangent.AdamW(m2.parameters(), max_norm=0.05, norm_type=1.0, fused=True, **HP)
        torch.set_num_threads(max(2, threads))
        x = torch.randn(4, 8)
        for m, opt in ((m1, n.optimizer), (m2, o)):
            opt.zero_grad()
            m(x).square().mean().backward()
        total = n.step()
        o.step()
        assert_same_bits(total, o.last_total_norm, "total after thread change")
    finally:
        torch.set_num_threads(threads)


def test_plan_cache_is_bounded():
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(12))
    opt = PackedAdamW(layers.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        opt.zero_grad()
        mask = torch.rand(12, generator=gen) < 0.5
        x = torch.ones(1, 2)
        sum(layer(x).sum() for layer, use in zip(layers, mask) if use or not mask.any()).backward()
        opt.step()
    assert len(opt._planner.plans) <= 64


def test_batched_norms_only_cell_matches_native():
    from cotangent.harness.factorial import BatchedNormsOnly

    def make():
        torch.manual_seed(5)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    m1 = make()
    m2 = copy.deepcopy(m1)
    native = cotangent.ReferenceUpdate(m1.parameters(), 0.05, fused=True, **HP)
    cell = BatchedNormsOnly(m2.parameters(), max_norm=0.05, fused=True, **HP)
    for step in range(4):
        x = torch.randn(4, 8)
        for m, o in ((m1, native.optimizer), (m2, cell.optimizer)):
            o.zero_grad()
            m(x).square().mean().backward()
        assert_same_bits(native.step(), cell.step(), f"step {step} total")
        compare(m1, native.optimizer, m2, cell.optimizer, f"step {step}")


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _pair(**kw):
    m1 = _small()
    m2 = copy.deepcopy(m1)
    return m1, m2, torch.optim.AdamW(m1.parameters(), fused=True, **HP), cotangent.AdamW(
        m2.parameters(), fused=True, **HP, **kw)


def test_autograd_grad_does_not_count_as_a_gradient():
    m1, m2, o1, o2 = _pair(max_norm=0.05)
    x = torch.randn(5, 8)
    for m, o in ((m1, o1), (m2, o2)):
        o.zero_grad()
        torch.autograd.grad(m(x).sum(), list(m[2].parameters()))  # a diagnostic, discarded
        m[0](x).tanh().sum().backward()
    total = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
    o1.step()
    o2.step()
    assert_same_bits(total, o2.last_total_norm, "total")
    compare(m1, o1, m2, o2, "after autograd.grad")
    assert m2[2].weight.grad is None and m2[2].weight not in o2.state


def test_step_pre_hooks_see_clipped_gradients_like_native_code():
    m1, m2, o1, o2 = _pair(max_norm=0.1)
    seen = {}

    def double(name):
        def hook(opt, args, kwargs):
            seen[name] = torch.cat([p.grad.reshape(-1) for p in opt.param_groups[0]["params"]])
            for p in opt.param_groups[0]["params"]:
                p.grad.mul_(2)
        return hook

    o1.register_step_pre_hook(double("native"))
    o2.register_step_pre_hook(double("cotangent"))
    x = torch.randn(5, 8)
    for m, o in ((m1, o1), (m2, o2)):
        o.zero_grad()
        (m(x).square().sum() * 50).backward()
    torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.1)
    o1.step()
    o2.step()
    assert_same_bits(seen["native"], seen["cotangent"], "gradients seen by the pre-hook")
    compare(m1, o1, m2, o2, "after a gradient-changing pre-hook")


def test_replacing_grad_data_is_handled():
    m1, m2, o1, o2 = _pair(max_norm=0.05)
    for step in range(3):
        x = torch.randn(5, 8)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).square().sum().backward()
            m[2].bias.grad.data = m[2].bias.grad.data.clone()
        torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
        o1.step()
        o2.step()
        assert_same_bits(m1[2].bias.grad, m2[2].bias.grad, f"step {step} bias grad")
        compare(m1, o1, m2, o2, f"step {step}")


def test_packed_parameters_sharing_storage_are_refused():
    """PackedAdamW would untie them (cotangent.AdamW updates that memory as native does:
    test_inputs.test_parameters_tied_through_data_update_that_memory_like_native)."""
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.weight.data = a.weight.data  # two Parameter objects, one storage
    with pytest.raises(ValueError, match="share storage"):
        PackedAdamW(list(a.parameters()) + list(b.parameters()))
    assert b.weight.data_ptr() == a.weight.data_ptr()


def test_deepcopy_and_pickle_of_the_optimizer_work():
    import pickle

    m1, m2, o1, o2 = _pair(max_norm=0.05)
    x = torch.randn(5, 8)
    for m, o in ((m1, o1), (m2, o2)):
        o.zero_grad()
        m(x).square().sum().backward()
    torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
    o1.step()
    o2.step()
    for clone in (copy.deepcopy(o2), pickle.loads(pickle.dumps(o2))):
        params = clone.param_groups[0]["params"]
        clone.zero_grad()
        sum((p * 2).sum() for p in params).backward()
        clone.step()  # usable, and the original is untouched
    compare(m1, o1, m2, o2, "original after copies stepped")


def test_rebuilding_the_optimizer_leaves_no_hooks_behind():
    import gc

    lin = nn.Linear(64, 64)
    for _ in range(4):
        opt = cotangent.AdamW(lin.parameters())
    del opt
    gc.collect()
    assert not lin.weight._post_accumulate_grad_hooks
    assert not lin.weight._backward_hooks


def test_module_zero_grad_keep_before_the_first_backward_keeps_negative_zero():
    p1, p2 = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    o1, o2 = torch.optim.AdamW([p1]), cotangent.AdamW([p2])
    coef = torch.tensor([-0.0, 1.0])
    for p in (p1, p2):
        mod = nn.Module()
        mod.p = p
        mod.zero_grad(set_to_none=False)
        (p * coef).sum().backward()
    assert torch.signbit(p2.grad[0]), "the -0.0 gradient lost its sign"
    assert_same_bits(p1.grad, p2.grad, "first gradient")
    o1.step()
    o2.step()  # and the update that reads it
    assert_same_update([p1], o1.state, [p2], o2.state, "after the first step")


def test_meta_parameters_are_refused_clearly_by_packing():
    """PackedAdamW has nothing to pack; cotangent.AdamW takes them as native does (the model
    is materialised with `to_empty` before the first step)."""
    with pytest.raises(ValueError, match="meta device"):
        PackedAdamW([nn.Parameter(torch.empty(3, device="meta"))])
    cotangent.AdamW([nn.Parameter(torch.empty(3, device="meta"))])


def test_negative_zero_gradients_keep_their_sign():
    """A fresh gradient of -0.0 must come out as -0.0, as with native `set_to_none=True`."""
    p_native = torch.nn.Parameter(torch.ones(6))
    p_ours = torch.nn.Parameter(torch.ones(6))
    opt = cotangent.AdamW([p_ours], fused=True, max_norm=1.0)
    native = cotangent.ReferenceUpdate([p_native], max_norm=1.0, fused=True)
    coef = torch.tensor([-0.0, 0.0, -1.0, 2.0, -0.0, 3.0])
    for _ in range(3):
        native.zero_grad()
        opt.zero_grad()
        (p_native * coef).sum().backward()
        (p_ours * coef).sum().backward()
        assert_same_bits(p_native.grad, p_ours.grad, "grad with -0.0")
        assert torch.signbit(p_ours.grad[0]), "the -0.0 gradient lost its sign"
        native.step()
        opt.step()
        assert_same_bits(p_native, p_ours, "param")


def test_packing_keeps_values_shapes_and_strides():
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    before = {n: (p.detach().clone(), p.stride()) for n, p in conv.named_parameters()}
    cotangent.AdamW(conv.parameters(), fused=True)
    for n, p in conv.named_parameters():
        assert_same_bits(before[n][0], p, f"value of {n}")
        assert p.stride() == before[n][1], n


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_duplicate_parameter_is_refused_before_anything_changes_by_packing():
    lin = torch.nn.Linear(3, 3)
    ptr = lin.weight.data_ptr()
    with pytest.raises(ValueError, match="same tensor"):
        PackedAdamW([lin.weight, lin.bias, lin.weight], fused=True)
    assert lin.weight.data_ptr() == ptr and lin.weight.grad is None


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_duplicate_parameter_is_updated_twice_like_native(impl):
    """Native warns and updates a parameter listed twice twice per step (and clips its
    gradient twice); cotangent.AdamW does the same (the single pass refuses shared memory)."""
    kw = {"fused": dict(fused=True), "foreach": dict(foreach=True),
          "for-loop": dict(foreach=False)}[impl]
    torch.manual_seed(0)
    m1 = torch.nn.Linear(3, 3)
    m2 = copy.deepcopy(m1)
    ref = cotangent.ReferenceUpdate([m1.weight, m1.bias, m1.weight], 0.05, **kw, **HP)
    opt = cotangent.AdamW([m2.weight, m2.bias, m2.weight], max_norm=0.05, **kw, **HP)
    for step in range(3):
        x = torch.randn(2, 3)
        for m, o in ((m1, ref), (m2, opt)):
            o.zero_grad()
            m(x).square().sum().backward()
        total = ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"step {step} total")
        compare(m1, ref.optimizer, m2, opt, f"duplicate, step {step}")


def test_nonfinite_norm_raises_before_modifying_anything():
    lin = torch.nn.Linear(3, 3)
    opt = cotangent.AdamW(lin.parameters(), fused=True, max_norm=1.0, error_if_nonfinite=True)
    opt.zero_grad()
    (lin(torch.ones(1, 3)) * float("inf")).sum().backward()
    assert_step_refused(opt, lin.parameters(), "non-finite")
    assert not opt.state


def test_saved_state_has_only_plain_containers():
    """`optimizer.state` counts its edits (a defaultdict subclass) but never leaks that type:
    a saved state_dict loads with `weights_only=True`, and the state pickles as a defaultdict."""
    import pickle
    from collections import defaultdict

    m1, m2, o1, o2 = _pair(max_norm=0.05)
    m2(torch.randn(5, 8)).sum().backward()
    o2.step()
    buf = io.BytesIO()
    torch.save(o2.state_dict(), buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert all(type(v) is dict for v in loaded["state"].values())
    assert type(pickle.loads(pickle.dumps(o2.state))) is defaultdict
    assert type(copy.deepcopy(o2.state)) is defaultdict


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_backward_through_parameters_updated_since_the_forward_behaves_like_native(impl):
    """For-loop and foreach AdamW bump every parameter's version counter, so a backward through
    a graph that saved the old values raises; parameters updated inside a merged range must
    too. Native fused AdamW (torch 2.13) bumps none and the backward runs: so must ours."""
    outcomes = []
    for cls in (torch.optim.AdamW, cotangent.AdamW, PackedAdamW):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])  # equal lengths: merged
        opt = cls(model.parameters(), **{"fused": dict(fused=True), "foreach": dict(foreach=True),
                                         "for-loop": dict(foreach=False)}[impl])
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        if cls is PackedAdamW:
            calls = opt.call_summary()
            assert calls["calls"] < calls["parameters"], "the case must use merged ranges"
        loss = model(torch.ones(2, 4)).sum()  # saves the current weights for backward
        opt.step()  # updates them before that backward
        try:
            loss.backward()
            outcomes.append("ran")
        except RuntimeError as error:
            assert "modified by an inplace operation" in str(error)
            outcomes.append("refused")
    assert outcomes == ["ran" if impl == "fused" else "refused"] * 3


def test_implementation_follows_native_defaults(monkeypatch):
    """`torch.optim.adam.adam`'s choice: only with fused and foreach both None does the device
    decide, and then a tensor lr (capturable off) falls back from foreach to the for-loop; an
    explicit fused=False is the for-loop. On CPU the default is the for-loop anyway, so the
    device default is forced to foreach here (as on CUDA)."""
    from cotangent import _compat, merge

    monkeypatch.setattr(_compat, "default_foreach", lambda params, differentiable: True)
    p = [torch.zeros(2)]

    def group(**kw):
        return dict(dict(fused=None, foreach=None, lr=1e-3, capturable=False,
                         differentiable=False), **kw)

    assert merge.implementation(group(), p) == "foreach"
    assert merge.implementation(group(lr=torch.tensor(1e-3)), p) == "for-loop"
    assert merge.implementation(group(lr=torch.tensor(1e-3), capturable=True), p) == "foreach"
    assert merge.implementation(group(fused=False), p) == "for-loop"
    assert merge.implementation(group(foreach=True), p) == "foreach"
    assert merge.implementation(group(fused=True), p) == "fused"


def test_saving_part_of_a_packed_model_writes_only_that_part():
    """Each packed parameter has a storage of its own over its segment: `torch.save` of one
    layer, pickle and `copy.copy` behave as for separately allocated parameters."""
    import pickle

    torch.manual_seed(0)
    native = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    packed = copy.deepcopy(native)
    cotangent.AdamW(packed.parameters())
    sizes = []
    for m in (native, packed):
        buf = io.BytesIO()
        torch.save(m[3].state_dict(), buf)
        sizes.append(len(buf.getvalue()))
    assert sizes[1] <= sizes[0] * 1.02, sizes  # not the whole 8-layer buffer
    loaded = torch.load(io.BytesIO(buf.getvalue()))
    assert_same_bits(loaded["weight"], packed[3].weight.detach(), "saved weight")
    assert len(pickle.dumps(packed[3])) <= 1.02 * len(pickle.dumps(native[3]))
    alias = copy.copy(packed[3].weight)
    alias.data.add_(1.0)  # a shallow copy aliases, as natively
    assert_same_bits(alias, packed[3].weight, "copy.copy alias")


def _matrices(m):
    return [p for p in m.parameters() if p.ndim == 2]


PACKERS = {
    "AdamW": lambda m: cotangent.AdamW(m.parameters()),
    "Muon": lambda m: cotangent.Muon(_matrices(m)),
    "MuonAdamW": lambda m: cotangent.MuonAdamW(
        [{"params": [p for p in m.parameters() if p.ndim != 2]}], _matrices(m)),
}


@pytest.mark.parametrize("packer", list(PACKERS))
def test_safetensors_saves_a_packed_model(tmp_path, packer):
    """`safetensors.torch.save_model` refuses parameters that share one storage ("None is
    covering the entire storage"); packed parameters each have their own, so it saves, and the
    file holds exactly the bytes a native model's holds (for every packing optimizer)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    native = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    packed = copy.deepcopy(native)
    opt = PACKERS[packer](packed)
    assert opt is not None
    for name, m in (("native", native), ("packed", packed)):
        safetensors_torch.save_model(m, str(tmp_path / f"{name}.safetensors"))
    assert ((tmp_path / "packed.safetensors").read_bytes()
            == (tmp_path / "native.safetensors").read_bytes())
    restored = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    safetensors_torch.load_model(restored, str(tmp_path / "packed.safetensors"))
    for a, b in zip(restored.parameters(), packed.parameters()):
        assert_same_bits(a, b, "restored parameter")


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("case,impl", [(c, i) for c in CASES for i in c.impls],
                         ids=lambda v: str(v).replace(" ", "_"))
def test_case_is_bitwise_equal_to_native(case, impl):
    assert case.expect <= OBSERVATIONS, case.expect - OBSERVATIONS
    seen = run_case(case, impl)
    # The case must exercise what it claims (clipping on every step or none, a skipped
    # parameter, the single pass and the clip multiply inside it; for PackedAdamW a merged AdamW
    # range, batched norms).
    expect = case.expect - SINGLE_PASS_OBSERVATIONS if impl == "fused" else case.expect
    assert expect <= seen, f"{case} ({impl}) did not show {sorted(expect - seen)}"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


shapes = st.lists(st.one_of(st.tuples(st.integers(0, 70)),
                            st.tuples(st.integers(1, 9), st.integers(1, 9))),
                  min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, dtype_ids=st.lists(st.integers(0, 2), min_size=12, max_size=12),
       max_norm=st.floats(-2.0, 5.0), norm_type=st.sampled_from([1.0, 2.0, 3.0, float("inf")]),
       seed=st.integers(0, 2**16))
def test_clip_grad_norm_matches_native(shapes, dtype_ids, max_norm, norm_type, seed):
    gen = torch.Generator().manual_seed(seed)
    if norm_type == float("inf"):
        shapes = [s for s in shapes if all(s)] or [(3,)]  # native raises on empty + inf
    ps, qs = [], []
    for shape, d in zip(shapes, dtype_ids):
        dtype = DTYPES[d]
        g = torch.randn(shape, generator=gen).to(dtype)
        p, q = torch.nn.Parameter(torch.zeros(shape, dtype=dtype)), torch.nn.Parameter(
            torch.zeros(shape, dtype=dtype))
        p.grad, q.grad = g.clone(), g.clone()
        ps.append(p)
        qs.append(q)
    t1 = torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type)
    t2 = cotangent.clip_grad_norm_(qs, max_norm, norm_type)
    assert_same_bits(t1, t2, "total")
    for p, q in zip(ps, qs):
        assert_same_bits(p.grad, q.grad, "grad")


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=10),
       impl=st.sampled_from(["fused", "foreach", "for-loop"]),
       amsgrad=st.booleans(), maximize=st.booleans(),
       weight_decay=st.sampled_from([0.0, 0.01, 0.3]), max_norm=st.sampled_from([None, 0.1, 10.0]),
       absent=st.lists(st.booleans(), min_size=10, max_size=10), seed=st.integers(0, 2**16))
def test_adamw_matches_native(lengths, impl, amsgrad, maximize, weight_decay, max_norm, absent,
                              seed):
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True),
             "for-loop": dict(foreach=False)}[impl]
    kw = dict(lr=1e-2, amsgrad=amsgrad, maximize=maximize, weight_decay=weight_decay, **flags)
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in lengths]
    ps = [torch.nn.Parameter(t.clone()) for t in init]
    qs = [torch.nn.Parameter(t.clone()) for t in init]
    native = cotangent.ReferenceUpdate(ps, max_norm=max_norm, **kw)
    ours = cotangent.AdamW(qs, max_norm=max_norm, **kw)
    for step in range(4):
        native.zero_grad()
        ours.zero_grad()
        grads = [torch.randn(n, generator=gen) for n in lengths]
        used = [not a or step == 0 or i == 0 for i, a in enumerate(absent[:len(lengths)])]
        for params in (ps, qs):
            loss = sum((p * g).sum() for p, g, u in zip(params, grads, used) if u)
            loss.backward()
        total = native.step()
        ours.step()
        if max_norm is not None:
            assert_same_bits(total, ours.last_total_norm, f"step {step} total")
        assert_same_update(ps, native.optimizer.state, qs, ours.state, f"step {step}")


BEHAVIOUR_IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True),
                   "fused": dict(fused=True)}


@pytest.mark.parametrize("impl", list(BEHAVIOUR_IMPLS))
def test_a_second_step_on_unchanged_gradients_clips_again_as_native(impl):
    """A loop that steps twice on one gradient (assigned once, kept: no backward between)
    clips at every step natively (``clip_grad_norm_`` then ``step()``; the second clip's
    coefficient is about 1 - 1e-6, which changes bits). Cotangent used to see the tensors
    its own step had clipped and skip the clip (a review's finding): every step clips."""
    p, q = (torch.nn.Parameter(torch.linspace(-1, 1, 10)) for _ in range(2))
    ours = cotangent.AdamW([p], lr=1e-2, max_norm=1.0, **BEHAVIOUR_IMPLS[impl])
    native = torch.optim.AdamW([q], lr=1e-2, **BEHAVIOUR_IMPLS[impl])
    p.grad = torch.full((10,), 3.0)
    q.grad = p.grad.clone()
    for step in range(3):
        ours.step()
        total = torch.nn.utils.clip_grad_norm_([q], 1.0)
        native.step()
        assert_same_bits(p.grad, q.grad, f"step {step}: clipped gradient")
        assert_same_bits(p.detach(), q.detach(), f"step {step}: parameter")
        assert_same_bits(ours.last_total_norm, total, f"step {step}: total norm")


@pytest.mark.parametrize("impl", list(BEHAVIOUR_IMPLS))
def test_an_explicit_clip_then_an_edit_is_not_clipped_again_by_the_step(impl):
    """``opt.clip_grad_norm_()``, then an in-place edit of the gradients (noise, a rescale),
    then ``step()``: native's ``clip_grad_norm_``, edit, ``step()`` clips once, so the step
    must not clip the edited gradients again (it did: a review's finding); the step after it
    clips again."""
    p, q = (torch.nn.Parameter(torch.linspace(-1, 1, 10)) for _ in range(2))
    ours = cotangent.AdamW([p], lr=1e-2, max_norm=1.0, **BEHAVIOUR_IMPLS[impl])
    native = torch.optim.AdamW([q], lr=1e-2, **BEHAVIOUR_IMPLS[impl])
    p.grad = torch.full((10,), 3.0)
    q.grad = p.grad.clone()
    assert_same_bits(ours.clip_grad_norm_(), torch.nn.utils.clip_grad_norm_([q], 1.0), "norm")
    p.grad.mul_(3.0)
    q.grad.mul_(3.0)
    ours.step()
    native.step()
    assert_same_bits(p.grad, q.grad, "edited gradient, not clipped again")
    assert_same_bits(p.detach(), q.detach(), "parameter")
    ours.step()
    torch.nn.utils.clip_grad_norm_([q], 1.0)
    native.step()
    assert_same_bits(p.grad, q.grad, "the next step clips")
    assert_same_bits(p.detach(), q.detach(), "parameter after the next step")
