"""Property tests (hypothesis): random parameter lists, dtypes, lengths and hyperparameters,
cotangent vs native compared byte for byte (CPU)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cotangent
from bitwise import assert_same_bits, assert_same_update

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
