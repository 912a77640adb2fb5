"""Bitwise comparison helpers for tests: bytes, never tolerances or `torch.equal` on values."""

from __future__ import annotations

import torch


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when both are None, or dtype, shape and every byte agree."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two tensors first differ and by how many ULPs (for failure messages)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia = a.detach().cpu().contiguous().reshape(-1).view(ints).long()
    ib = b.detach().cpu().contiguous().reshape(-1).view(ints).long()
    idx = (ia != ib).nonzero()
    if len(idx) == 0:
        return "no difference"
    i = int(idx[0])
    return (f"{len(idx)} elements differ; first at flat index {i}: {a.reshape(-1)[i].item()!r} vs "
            f"{b.reshape(-1)[i].item()!r} ({abs(int(ia[i]) - int(ib[i]))} ULP)")


def assert_same_bits(a, b, what: str) -> None:
    assert same_bits(a, b), f"{what}: " + (
        "None vs tensor" if a is None or b is None else first_difference(a, b))
