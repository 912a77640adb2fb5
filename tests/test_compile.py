"""A `torch.compile`d model trained with cotangent.AdamW equals the compiled model with native
clip + AdamW (CPU, FP32, inductor), byte for byte.

Deterministic algorithms are on: without them inductor's CPU embedding backward accumulates in a
thread-dependent order, and two compiled copies of the same *native* model already differ."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cotangent
from bitwise import assert_same_bits
from cotangent.harness.model import build_model


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "for-loop"])
@pytest.mark.slow
def test_compiled_model_matches_native(impl):
    torch._dynamo.reset()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _compiled_run(impl)
    finally:
        torch.use_deterministic_algorithms(previous)


def _compiled_run(impl):
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
              **({"fused": True} if impl == "fused" else {"foreach": False}))
    m1, m2 = build_model("tiny-transformer", 9), build_model("tiny-transformer", 9)
    native = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, **kw)
    ours = cotangent.AdamW(m2.parameters(), max_norm=0.05, **kw)  # pack before compiling
    c1, c2 = torch.compile(m1), torch.compile(m2)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        batch = torch.randint(0, 256, (8, 33), generator=gen)
        losses = []
        for model, opt in ((c1, native), (c2, ours)):
            opt.zero_grad()
            logits = model(batch[:, :-1])  # (B, T, 256)
            loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss)
        assert_same_bits(losses[0], losses[1], f"step {step} loss")
        assert_same_bits(native.step(), (ours.step(), ours.last_total_norm)[1], "total norm")
        for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
            assert_same_bits(p1, p2, f"step {step} {name}")
            for key in native.optimizer.state[p1]:
                assert_same_bits(native.optimizer.state[p1][key], ours.state[p2][key], key)


@pytest.mark.slow
@pytest.mark.slow
def test_backward_under_compiled_autograd_matches_native():
    """A backward traced by compiled autograd (``compiled_autograd._enable(torch.compile(...))``,
    not fullgraph): the optimizer's gradient hooks run eagerly (`torch.compiler.disable`d twins),
    as native trains; it failed inside the hook (an end-of-backward callback queued while
    dynamo traced it). fullgraph=True is not supported (the hooks graph-break). For-loop with
    the clip, foreach without, fused with: gradients after each backward (two micro-batches at
    step 1), parameters and state after each step, byte for byte (CPU, float32). One test,
    so that dynamo compiles the backward graphs once."""
    from torch._dynamo import compiled_autograd

    from bitwise import assert_same_update

    torch._dynamo.reset()
    compiler = torch.compile(backend="eager")
    for impl, flags, max_norm in (("for-loop", dict(foreach=False), 0.05),
                                  ("foreach", dict(foreach=True), None),
                                  ("fused", dict(fused=True), 0.05)):
        torch.manual_seed(0)
        m1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                 torch.nn.GELU(), torch.nn.Linear(16, 4))
        m2 = copy.deepcopy(m1)
        native = cotangent.ReferenceUpdate(m1.parameters(), max_norm=max_norm, lr=1e-2, **flags)
        ours = cotangent.AdamW(m2.parameters(), max_norm=max_norm, lr=1e-2, **flags)
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for model, opt in ((m1, native), (m2, ours)):
                opt.zero_grad()
                for scale in ((1.0, 2.0) if step == 1 else (1.0,)):
                    loss = model(x * scale).square().mean()
                    with compiled_autograd._enable(compiler):
                        loss.backward()
            for a, b in zip(m1.parameters(), m2.parameters()):
                assert_same_bits(a.grad, b.grad, f"{impl} gradient, step {step}")
            native.step()
            ours.step()
            assert_same_update(m1.parameters(), native.optimizer.state, m2.parameters(),
                               ours.state, f"{impl} max_norm={max_norm} step {step}")
