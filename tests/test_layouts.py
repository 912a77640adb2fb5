"""Everything real models have, each compared byte for byte with native clip + AdamW (CPU).

Each case builds two identical models, one driven by `clip_grad_norm_` + `torch.optim.AdamW`,
one by `cotangent.AdamW`, runs several steps and compares loss, every gradient, the total norm,
every parameter and every optimizer-state tensor after each step.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import cotangent
from bitwise import assert_same_bits, same_bits

HP = dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}


class Native:
    """The reference: clip_grad_norm_ over every parameter with a grad, then torch.optim.AdamW."""

    def __init__(self, params_or_groups, max_norm, norm_type=2.0, error_if_nonfinite=False,
                 **kw):
        self.opt = torch.optim.AdamW(params_or_groups, **kw)
        self.max_norm, self.norm_type, self.error = max_norm, norm_type, error_if_nonfinite

    def step(self):
        params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
        total = None
        if self.max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(params, self.max_norm, self.norm_type,
                                                   self.error)
        self.opt.step()
        return total


def compare(m1, o1, m2, o2, what):
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert_same_bits(p1, p2, f"{what}: param {name}")
        assert_same_bits(p1.grad, p2.grad, f"{what}: grad {name}")
        s1, s2 = o1.state.get(p1, {}), o2.state.get(p2, {})
        assert s1.keys() == s2.keys(), f"{what}: state keys of {name}"
        for key in s1:
            assert_same_bits(s1[key], s2[key], f"{what}: {key} of {name}")


def lockstep(m1, o1, m2, o2, steps, what, before_step=None):
    """Train two models with their optimizers on the same inputs, comparing after each step."""
    for step in range(steps):
        if before_step:
            before_step(step)
        x = torch.randn(4, 8)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        compare(m1, o1, m2, o2, f"{what}, step {step}")


def drive(make_model, *, steps=5, max_norm=0.05, groups=None, loss_fn=None, impl="fused",
          opt_kw=None, between=None, ours_kw=None):
    """Run native and cotangent side by side; returns (models, optimizers) after `steps`."""
    m1 = make_model()
    m2 = copy.deepcopy(m1)
    kw = dict(HP, **IMPLS[impl], **(opt_kw or {}))
    g1 = groups(m1) if groups else m1.parameters()
    g2 = groups(m2) if groups else m2.parameters()
    native = Native(g1, max_norm, **kw)
    ours = cotangent.AdamW(g2, max_norm=max_norm, **kw, **(ours_kw or {}))
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(4, 8, generator=gen)
        native.opt.zero_grad()
        ours.zero_grad()
        for m in (m1, m2):
            loss = loss_fn(m, x, step) if loss_fn else m(x).square().mean()
            loss.backward()
        compare(m1, native.opt, m2, ours, f"step {step} grads")
        total = native.step()
        ours.step()
        assert_same_bits(total, ours.last_total_norm if max_norm is not None else None,
                         f"step {step} total norm")
        compare(m1, native.opt, m2, ours, f"step {step}")
        if between:
            between(step, native.opt, ours)
    return (m1, m2), (native.opt, ours)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))


@pytest.mark.parametrize("impl", list(IMPLS))
def test_several_param_groups_no_decay_on_biases_and_norms(impl):
    def groups(m):
        decay = [p for p in m.parameters() if p.dim() >= 2]
        no_decay = [p for p in m.parameters() if p.dim() < 2]
        return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}]

    drive(mlp, groups=groups, impl=impl)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("extra", [dict(amsgrad=True), dict(maximize=True),
                                   dict(amsgrad=True, maximize=True, weight_decay=0.0)])
def test_amsgrad_and_maximize(impl, extra):
    drive(mlp, impl=impl, opt_kw=extra)


@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_tensor_lr_with_a_scheduler(impl):
    def between(step, o1, o2):
        for o in (o1, o2):
            for g in o.param_groups:
                g["lr"].mul_(0.5) if torch.is_tensor(g["lr"]) else None

    drive(mlp, impl=impl, opt_kw=dict(lr=torch.tensor(5e-3)), between=between)


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_lr_scheduler_object():
    scheds = []

    def between(step, o1, o2):
        if not scheds:
            scheds.extend(torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7) for o in (o1, o2))
        for s in scheds:
            s.step()

    drive(mlp, between=between, steps=6)


def test_clipping_inactive_and_no_clipping():
    drive(mlp, max_norm=1e6)
    drive(mlp, max_norm=None)


def test_negative_max_norm_flips_gradients_like_native():
    drive(mlp, max_norm=-0.5)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, float("inf")])
def test_other_norm_types(norm_type):
    drive(mlp, opt_kw=dict(norm_type=norm_type), steps=3)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Linear(4, 8)

    def forward(self, x):  # x: (B, 8) -> image (B, 2, 2, 2)
        img = x.view(-1, 2, 2, 2)  # (B, C=2, H=2, W=2)
        y = self.conv2(torch.relu(self.bn(self.conv1(img))))  # (B, 4, 2, 2)
        return self.head(y.mean(dim=(2, 3)))  # (B, 8)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_channels_last_conv_net(impl):
    def make():
        torch.manual_seed(1)
        return ConvNet().to(memory_format=torch.channels_last)

    (_, m2), _ = drive(make, impl=impl)
    assert m2.conv1.weight.is_contiguous(memory_format=torch.channels_last)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 8)
        self.mid = nn.Linear(8, 8, bias=False)
        self.zero = nn.Parameter(torch.zeros(0))  # zero-size parameter
        self.frozen = nn.Parameter(torch.ones(8), requires_grad=False)

    def forward(self, x):
        h = self.emb(x.abs().argmax(dim=1))  # (B, 8)
        h = torch.tanh(self.mid(h)) * self.frozen + self.zero.sum()
        return h @ self.emb.weight.t()  # tied output projection (B, 8)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_tied_frozen_and_zero_size_parameters(impl):
    def make():
        torch.manual_seed(2)
        return Tied()

    drive(make, impl=impl)


def test_mixed_dtypes():
    def make():
        torch.manual_seed(3)
        m = mlp()
        m[1].to(torch.bfloat16)
        return m

    def loss_fn(m, x, step):
        h = m[0](x)
        h = m[1](h.bfloat16()).float()
        return m[3](m[2](h)).square().mean()

    drive(make, loss_fn=loss_fn, impl="for-loop")
    drive(make, loss_fn=loss_fn, impl="fused")


def test_parameters_without_grad_in_some_steps():
    def loss_fn(m, x, step):
        h = m[0](x)
        if step % 2 == 0:  # the LayerNorm is skipped every other step
            h = m[1](h)
        return m[3](m[2](h)).square().mean()

    (_, m2), (_, o2) = drive(mlp, loss_fn=loss_fn, steps=6)
    assert int(o2.state[m2[1].weight]["step"]) == 3
    assert int(o2.state[m2[0].weight]["step"]) == 6


def test_zero_grad_keep_and_model_zero_grad():
    m1 = mlp()
    m2 = copy.deepcopy(m1)
    n = Native(m1.parameters(), 0.05, fused=True, **HP)
    o = cotangent.AdamW(m2.parameters(), max_norm=0.05, fused=True, **HP)
    for step, how in enumerate(["opt-keep", "model-none", "model-keep", "opt-none"]):
        x = torch.randn(4, 8)
        if how == "opt-keep":
            n.opt.zero_grad(set_to_none=False)
            o.zero_grad(set_to_none=False)
        elif how == "model-none":
            m1.zero_grad()
            m2.zero_grad()
        elif how == "model-keep":
            m1.zero_grad(set_to_none=False)
            m2.zero_grad(set_to_none=False)
        else:
            n.opt.zero_grad()
            o.zero_grad()
        for m in (m1, m2):
            m(x).square().mean().backward()
        n.step()
        o.step()
        compare(m1, n.opt, m2, o, how)


def test_add_param_group_after_construction():
    m1, m2 = mlp(), None
    m2 = copy.deepcopy(m1)
    n = Native(m1[0].parameters(), 0.05, fused=True, **HP)
    o = cotangent.AdamW(m2[0].parameters(), max_norm=0.05, fused=True, **HP)
    for step in range(4):
        if step == 2:
            n.opt.add_param_group({"params": list(m1[3].parameters()), "lr": 1e-2})
            o.add_param_group({"params": list(m2[3].parameters()), "lr": 1e-2})
        x = torch.randn(4, 8)
        n.opt.zero_grad()
        o.zero_grad()
        for m in (m1, m2):
            m(x).square().mean().backward()
        n.step()
        o.step()
        for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
            assert_same_bits(p1, p2, f"step {step} {name}")


def test_gradients_with_inf_and_nan_give_native_bits():
    def loss_fn(m, x, step):
        y = m(x)
        if step == 1:
            y = y * float("inf")
        if step == 3:
            y = y * float("nan")
        return y.square().mean()

    drive(mlp, loss_fn=loss_fn, steps=4)


def test_fp16_norm_overflow_zeroes_gradients_like_native():
    def make():
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(8, 8).half())

    def loss_fn(m, x, step):
        return (m(x.half()).float() * 3e4).sum()

    drive(make, loss_fn=loss_fn, steps=2, impl="for-loop")


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
    with pytest.raises(ValueError, match="floating point"):
        cotangent.AdamW([nn.Parameter(torch.ones(2)), torch.ones(2, dtype=torch.long)],
                        fused=True)
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


def test_clip_order_reproduces_clipping_over_model_parameters():
    def groups(m):  # groups in a different order from model.parameters()
        return [{"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
                {"params": [p for p in m.parameters() if p.dim() >= 2]}]

    m1 = mlp()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(groups(m1), fused=True, **HP)
    o2 = cotangent.AdamW(groups(m2), fused=True, max_norm=0.05, clip_order=m2.parameters(), **HP)
    for step in range(4):
        x = torch.randn(4, 8)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).square().mean().backward()
        total = torch.nn.utils.clip_grad_norm_(m1.parameters(), 0.05)
        o1.step()
        o2.step()
        assert_same_bits(total, o2.last_total_norm, "total norm in model order")
        compare(m1, o1, m2, o2, f"clip_order step {step}")
    with pytest.raises(ValueError, match="clip_order lacks"):
        cotangent.AdamW(mlp().parameters(), max_norm=1.0, clip_order=[])


def test_thread_count_change_recalibrates():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        m1 = mlp()
        m2 = copy.deepcopy(m1)
        n = Native(m1.parameters(), 0.05, norm_type=1.0, fused=True, **HP)
        o = cotangent.AdamW(m2.parameters(), max_norm=0.05, norm_type=1.0, fused=True, **HP)
        torch.set_num_threads(max(2, threads))
        x = torch.randn(4, 8)
        for m, opt in ((m1, n.opt), (m2, o)):
            opt.zero_grad()
            m(x).square().mean().backward()
        total = n.step()
        o.step()
        assert_same_bits(total, o.last_total_norm, "total after thread change")
        assert o._clipper.threads == max(2, threads)
    finally:
        torch.set_num_threads(threads)


def test_plan_cache_is_bounded():
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(12))
    opt = cotangent.AdamW(layers.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        opt.zero_grad()
        mask = torch.rand(12, generator=gen) < 0.5
        x = torch.ones(1, 2)
        sum(layer(x).sum() for layer, use in zip(layers, mask) if use or not mask.any()).backward()
        opt.step()
    assert len(opt._planner.plans) <= 64


def test_gradient_with_other_strides_is_read_in_the_parameters_layout():
    """Policy: a gradient whose strides differ from its parameter's is copied into the
    parameter's layout. Native CPU fused AdamW would read it in storage order (a known bug,
    pytorch#106951); the reference here is native with the same values laid out like the param."""
    torch.manual_seed(0)
    w_native = nn.Parameter(torch.randn(4, 6))
    w_ours = nn.Parameter(w_native.detach().clone())
    opt_native = torch.optim.AdamW([w_native], fused=True, **HP)
    opt_ours = cotangent.AdamW([w_ours], fused=True, **HP)
    g = torch.randn(6, 4).t()  # (4, 6) with transposed strides
    assert g.stride() != w_ours.stride()
    w_native.grad = g.contiguous()
    w_ours.grad = g
    opt_native.step()
    opt_ours.step()
    assert_same_bits(w_native, w_ours, "param after a transposed gradient")
    assert w_ours.grad.stride() == w_ours.stride()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_packing_only_cell_matches_native(impl):
    drive(mlp, impl=impl, ours_kw=dict(batched_norms=False))


def test_batched_norms_only_cell_matches_native():
    from cotangent.factorial import BatchedNormsOnly

    def make():
        torch.manual_seed(5)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])

    m1 = make()
    m2 = copy.deepcopy(m1)
    native = Native(m1.parameters(), 0.05, fused=True, **HP)
    cell = BatchedNormsOnly(m2.parameters(), max_norm=0.05, fused=True, **HP)
    for step in range(4):
        x = torch.randn(4, 8)
        for m, o in ((m1, native.opt), (m2, cell.optimizer)):
            o.zero_grad()
            m(x).square().mean().backward()
        assert_same_bits(native.step(), cell.step(), f"step {step} total")
        compare(m1, native.opt, m2, cell.optimizer, f"step {step}")


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


def test_cleared_state_starts_fresh_like_native():
    m1, m2, o1, o2 = _pair()

    def clear_at_two(step):
        if step == 2:
            o1.state.clear()
            o2.state.clear()

    lockstep(m1, o1, m2, o2, 4, "state cleared at step 2", before_step=clear_at_two)


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


def test_parameters_sharing_storage_are_refused():
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    b.weight.data = a.weight.data  # two Parameter objects, one storage
    with pytest.raises(ValueError, match="share storage"):
        cotangent.AdamW(list(a.parameters()) + list(b.parameters()))
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


def test_parameters_appended_to_a_group_are_picked_up():
    m1, m2, o1, o2 = _pair()
    extra1, extra2 = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    o1.param_groups[0]["params"].append(extra1)
    o2.param_groups[0]["params"].append(extra2)
    for o, m, e in ((o1, m1, extra1), (o2, m2, extra2)):
        o.zero_grad()
        (m(torch.ones(2, 8)).sum() + e.sum()).backward()
        o.step()
    assert_same_bits(extra1, extra2, "appended parameter")
    compare(m1, o1, m2, o2, "after appending")


def test_module_zero_grad_keep_before_the_first_backward_keeps_negative_zero():
    p1, p2 = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    o1, o2 = torch.optim.AdamW([p1]), cotangent.AdamW([p2])
    coef = torch.tensor([-0.0, 1.0])
    for p in (p1, p2):
        mod = nn.Module()
        mod.p = p
        mod.zero_grad(set_to_none=False)
        (p * coef).sum().backward()
    assert_same_bits(p1.grad, p2.grad, "first gradient")


def test_meta_parameters_are_refused_clearly():
    with pytest.raises(ValueError, match="meta device"):
        cotangent.AdamW([nn.Parameter(torch.empty(3, device="meta"))])
