"""`cotangent.clip_grad_norm_` vs `torch.nn.utils.clip_grad_norm_`, byte for byte (CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

import cotangent
from bitwise import assert_same_bits
from cotangent.clip import group_norms

LENGTHS = [1, 2, 3, 4, 5, 6, 8, 10, 31, 32, 33, 62, 64, 66, 126, 128, 130, 254, 256, 258, 510,
           512, 514, 1022, 1024, 1026, 4094, 4096, 4098, 16384, 65536, 262144]


def _rows_in_one_buffer(n: int, k: int, dtype, seed: int) -> list[torch.Tensor]:
    """k gradients of n elements as 64-byte aligned rows of one flat buffer (like cotangent.AdamW)."""
    align = 64 // torch.empty((), dtype=dtype).element_size()
    stride = -(-n // align) * align
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(k * stride, generator=gen).to(dtype)
    return [flat[i * stride:i * stride + n] for i in range(k)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_norm_sweep_per_tensor_and_total(dtype, k):
    """32 lengths x bucket sizes {1, 3, 8}: per-tensor norms, total and clipped grads."""
    for n in LENGTHS:
        rows = _rows_in_one_buffer(n, k, dtype, seed=n * 10 + k)
        ours = group_norms(rows, 2.0, None)
        native = torch._foreach_norm([r.clone() for r in rows], 2.0)
        for i in range(k):
            assert_same_bits(ours[i], native[i], f"norm of row {i}, n={n}, k={k}, {dtype}")
        params_ours = [torch.nn.Parameter(torch.zeros_like(r)) for r in rows]
        params_native = [torch.nn.Parameter(torch.zeros_like(r)) for r in rows]
        for po, pn, r in zip(params_ours, params_native, rows):
            po.grad = r  # the views into the flat buffer
            pn.grad = r.clone()
        t_ours = cotangent.clip_grad_norm_(params_ours, 0.5)
        t_native = torch.nn.utils.clip_grad_norm_(params_native, 0.5)
        assert_same_bits(t_ours, t_native, f"total norm n={n}, k={k}, {dtype}")
        for po, pn in zip(params_ours, params_native):
            assert_same_bits(po.grad, pn.grad, f"clipped grad n={n}, k={k}, {dtype}")


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_mixed_dtypes_order_and_norm_types(foreach, norm_type):
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    shapes = [(7,), (3, 4), (16,), (5, 5), (2, 3, 4)]
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    qs = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for p, q in zip(ps, qs):
        p.grad = (torch.randn(p.shape, generator=gen) * 3).to(p.dtype)
        q.grad = p.grad.clone()
    t1 = torch.nn.utils.clip_grad_norm_(ps, 0.1, norm_type, foreach=foreach)
    t2 = cotangent.clip_grad_norm_(qs, 0.1, norm_type, foreach=foreach)
    assert_same_bits(t1, t2, "total")
    for p, q in zip(ps, qs):
        assert_same_bits(p.grad, q.grad, "clipped grad")


def test_edge_cases_match_native():
    # empty list: a CPU float32 zero, nothing clipped
    assert_same_bits(cotangent.clip_grad_norm_([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0),
                     "empty")
    # empty generator warns, as native
    with pytest.warns(UserWarning, match="empty generator"):
        cotangent.clip_grad_norm_((p for p in []), 1.0)
    # a zero-size gradient with the inf norm raises, as native
    p = torch.nn.Parameter(torch.zeros(0))
    p.grad = torch.zeros(0)
    with pytest.raises(RuntimeError) as native_err:
        torch.nn.utils.clip_grad_norm_([p], 1.0, float("inf"))
    with pytest.raises(RuntimeError) as our_err:
        cotangent.clip_grad_norm_([p], 1.0, float("inf"))
    assert str(native_err.value) == str(our_err.value)
    # non-finite with error_if_nonfinite: raises before modifying anything
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.tensor([1.0, float("inf"), 2.0])
    before = q.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        cotangent.clip_grad_norm_([q], 1.0, error_if_nonfinite=True)
    assert_same_bits(q.grad, before, "grad after refused clip")
    # duplicates are counted twice and scaled twice, as native
    r1, r2 = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    r1.grad, r2.grad = torch.arange(4.0), torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_bits(torch.nn.utils.clip_grad_norm_([r1, r1], 1.0),
                         cotangent.clip_grad_norm_([r2, r2], 1.0), "duplicates total")
    assert_same_bits(r1.grad, r2.grad, "duplicates grad")
