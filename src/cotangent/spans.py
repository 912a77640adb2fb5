"""Memory spans of tensors: how far a tensor reaches in its storage, whether spans overlap,
whether a tensor is dense, and the allocator's alignment.

`cotangent.AdamW` and its ZeRO-1 sharding ask these before a step: a parameter that shares memory
with another (or with itself, an expanded tensor) cannot be updated by a pass that writes each
element once, and the single-pass kernel needs dense, non-overlapping tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

ALIGN_BYTES = 64


def align_elements(dtype: torch.dtype) -> int:
    """Number of `dtype` elements in `ALIGN_BYTES` bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return max(1, ALIGN_BYTES // itemsize)


def extent(t: Tensor) -> int:
    """Bytes from `t`'s first element to one past its last: all the memory it may touch (a
    non-dense tensor spans its gaps too; non-negative strides, as torch tensors have); 0 when
    empty."""
    if t.numel() == 0:
        return 0
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def overlapping_pair(starts: list[int], nbytes: list[int]) -> tuple[int, int] | None:
    """Two indices whose byte spans ``[starts[i], starts[i] + nbytes[i])`` overlap (the lower
    first), or None when no two do (empty spans never overlap): one sort, in Python."""
    spans = sorted((s, s + n, i) for i, (s, n) in enumerate(zip(starts, nbytes)) if n > 0)
    for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
        if start < end:
            return min(i, j), max(i, j)
    return None


def is_dense_non_overlapping(t: Tensor) -> bool:
    """True when `t`'s elements fill exactly `t.numel()` consecutive storage slots.

    Contiguous, channels_last and any permuted-dense tensor qualify; slices with gaps (`x[::2]`)
    and expanded tensors (stride 0) do not.
    """
    if t.numel() == 0 or t.is_contiguous():
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


