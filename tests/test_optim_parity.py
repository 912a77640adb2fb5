"""`cotangent.AdamW` vs `clip_grad_norm_` + `torch.optim.AdamW`, compared byte for byte.

Holds for: CPU, float32 weights (FP32 or BF16 autocast), the installed torch, each native AdamW
implementation (fused, foreach, for-loop) with `clip_grad_norm_(foreach=None)`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cotangent
from bitwise import assert_same_bits
from cotangent.harness.model import build_model

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}

FAMILIES = ["tiny-transformer-tied", "tiny-gated-gqa", "tiny-causal-conv"]
# (max_norm, clipping expected active on every step)
CLIPS = [(0.05, True), (1e6, False)]


def make_model(family: str, seed: int):
    """A tiny model; "-tied" shares the head weight with the token embedding."""
    model = build_model(family.removesuffix("-tied"), seed)
    if family.endswith("-tied"):
        model.head.weight = model.tok_emb.weight
    return model


def _loss(model, batch, precision):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(batch[:, :-1])  # (B, T, 256)
    return F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))


def compare_models(native_model, native_opt, ours_model, ours_opt, what):
    for (name, p1), p2 in zip(native_model.named_parameters(), ours_model.parameters()):
        assert_same_bits(p1, p2, f"{what}: param {name}")
        assert_same_bits(p1.grad, p2.grad, f"{what}: grad {name}")
        s1, s2 = native_opt.state[p1], ours_opt.state[p2]
        assert s1.keys() == s2.keys(), f"{what}: state keys of {name}"
        for key in s1:
            assert_same_bits(s1[key], s2[key], f"{what}: state {key} of {name}")


@pytest.mark.parametrize("clip", CLIPS, ids=["clip-active", "clip-inactive"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("family", FAMILIES)
def test_updates_bitwise_equal_to_native(family, impl, precision, clip):
    max_norm, active = clip
    steps = 8
    native_model, ours_model = make_model(family, 3), make_model(family, 3)
    ref = cotangent.ReferenceUpdate(native_model.parameters(), max_norm=max_norm,
                                    **HP, **IMPLS[impl])
    opt = cotangent.AdamW(ours_model.parameters(), max_norm=max_norm, **HP, **IMPLS[impl])
    gen = torch.Generator().manual_seed(11)
    clipped_steps = 0
    for step in range(steps):
        batch = torch.randint(0, 256, (4, 33), generator=gen)
        ref.zero_grad()
        opt.zero_grad()
        loss1 = _loss(native_model, batch, precision)
        loss2 = _loss(ours_model, batch, precision)
        assert_same_bits(loss1, loss2, f"step {step}: loss")
        loss1.backward()
        loss2.backward()
        compare_models(native_model, ref.optimizer, ours_model, opt, f"step {step} after backward")
        total1 = ref.step()
        opt.step()
        assert_same_bits(total1, opt.last_total_norm, f"step {step}: total norm")
        compare_models(native_model, ref.optimizer, ours_model, opt, f"step {step} after update")
        clipped_steps += bool(total1 > max_norm)
    # The case must exercise what it claims: clipping on every step, or on none.
    assert clipped_steps == (steps if active else 0)
    assert all(int(s["step"]) == steps for s in opt.state.values())


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


def test_params_without_grad_are_skipped_like_native():
    """A parameter unused in a step: no update, no decay, no step count, grad None afterwards."""
    def make():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})

    m1, m2 = make(), make()
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.1, **HP, fused=True)
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.1, **HP, fused=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for step in range(6):
        use_b = step % 3 == 0
        for m, o in ((m1, ref), (m2, opt)):
            o.zero_grad()
            y = m["a"](x)
            if use_b:
                y = m["b"](y)
            y.square().sum().backward()
            o.step()
        compare_models(m1, ref.optimizer, m2, opt, f"step {step}")
        assert m2["b"].weight.grad is None if not use_b else m2["b"].weight.grad is not None
    assert int(opt.state[m2["b"].weight]["step"]) == 2
    assert int(opt.state[m2["a"].weight]["step"]) == 6


def test_gradients_outside_the_buffer_are_still_exact():
    """`model.zero_grad()` (set_to_none) makes autograd allocate fresh grads outside the buffer."""
    m1, m2 = build_model("tiny", 5), build_model("tiny", 5)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, **HP, fused=True)
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, **HP, fused=True)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        batch = torch.randint(0, 256, (2, 33), generator=gen)
        m1.zero_grad()
        m2.zero_grad()
        for m in (m1, m2):
            _loss(m, batch, "fp32").backward()
        ref.step()
        opt.step()
        compare_models(m1, ref.optimizer, m2, opt, f"step {step}")


def test_gradient_accumulation_over_micro_batches():
    m1, m2 = build_model("tiny", 6), build_model("tiny", 6)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, **HP, fused=True)
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, **HP, fused=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        ref.zero_grad()
        opt.zero_grad()
        for _ in range(3):
            batch = torch.randint(0, 256, (2, 33), generator=gen)
            for m in (m1, m2):
                (_loss(m, batch, "fp32") / 3).backward()
        compare_models(m1, ref.optimizer, m2, opt, f"step {step} accumulated")
        ref.step()
        opt.step()
        compare_models(m1, ref.optimizer, m2, opt, f"step {step}")


def test_packing_keeps_values_shapes_and_strides():
    conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    before = {n: (p.detach().clone(), p.stride()) for n, p in conv.named_parameters()}
    cotangent.AdamW(conv.parameters(), fused=True)
    for n, p in conv.named_parameters():
        assert_same_bits(before[n][0], p, f"value of {n}")
        assert p.stride() == before[n][1], n


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_duplicate_parameter_is_refused_before_anything_changes():
    lin = torch.nn.Linear(3, 3)
    ptr = lin.weight.data_ptr()
    with pytest.raises(ValueError, match="same tensor"):
        cotangent.AdamW([lin.weight, lin.bias, lin.weight], fused=True)
    assert lin.weight.data_ptr() == ptr and lin.weight.grad is None


def test_replaced_parameter_storage_is_detected():
    lin = torch.nn.Linear(3, 3)
    opt = cotangent.AdamW(lin.parameters(), fused=True)
    lin(torch.ones(2, 3)).sum().backward()
    lin.weight.data = lin.weight.data.clone()
    with pytest.raises(RuntimeError, match="no longer lives"):
        opt.step()


def test_nonfinite_norm_raises_before_modifying_anything():
    lin = torch.nn.Linear(3, 3)
    opt = cotangent.AdamW(lin.parameters(), fused=True, max_norm=1.0, error_if_nonfinite=True)
    opt.zero_grad()
    (lin(torch.ones(1, 3)) * float("inf")).sum().backward()
    before = [p.detach().clone() for p in lin.parameters()]
    grads = [p.grad.clone() for p in lin.parameters()]
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.step()
    for p, b, g in zip(lin.parameters(), before, grads):
        assert_same_bits(p, b, "param after refused step")
        assert_same_bits(p.grad, g, "grad after refused step")
    assert not opt.state
