"""Flat-buffer layout of the packed design (`PackedAdamW`): parameters, gradients and AdamW
moments as views into one buffer.

For each (device, dtype) the parameters are laid out in one flat 1-D buffer, ordered by length so
that equal-length tensors sit side by side (a *bucket*). Each parameter keeps its own shape and
strides (a channels_last weight stays channels_last); only its storage moves, to a storage of its
own over its segment (`own_storage`), so that saving part of a model saves only that part. Every
segment starts on a 64-byte boundary, the alignment of PyTorch's CPU allocator, so that kernels whose
code path depends on pointer alignment (CUDA `_foreach_norm`, vectorised CPU loops) see the same
alignment class as for a separately allocated tensor. Inside a bucket the rows are therefore
`row_stride >= numel` elements apart, and a bucket of `k` tensors of `n` elements is the strided
2-D view `buffer.as_strided((k, n), (row_stride, 1), offset)`.

The gradient buffer and the optimizer-state buffers (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`)
use the same layout, so the same offsets address all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from cotangent.spans import align_elements, is_dense_non_overlapping


@dataclass(frozen=True, slots=True)
class Segment:
    """One tensor's place in a flat buffer."""

    slot: int  # position of the parameter in the optimizer's flat parameter list
    offset: int  # element offset of the segment in the flat buffer
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    contiguous: bool  # row-major contiguous (only those are batched with their bucket)


@dataclass(slots=True)
class Bucket:
    """Equal-length, contiguous segments stored `row_stride` elements apart, or one lone segment."""

    numel: int  # n, elements per tensor
    row_stride: int  # elements between consecutive rows
    offset: int  # element offset of the first row
    segments: list[Segment]
    batched: bool = False  # set by calibration: one 2-D reduction is bitwise equal to native

    @property
    def rows(self) -> int:
        return len(self.segments)

    def matrix(self, flat: Tensor) -> Tensor:
        """The (rows, numel) strided view of this bucket in `flat`."""
        return flat.as_strided((self.rows, self.numel), (self.row_stride, 1), self.offset)


@dataclass(slots=True)
class FlatLayout:
    """Layout of all parameters of one (device, dtype) in one flat buffer of `size` elements."""

    device: torch.device
    dtype: torch.dtype
    size: int
    buckets: list[Bucket]
    segments: list[Segment] = field(default_factory=list)  # in buffer (bucket) order

    def view(self, flat: Tensor, seg: Segment) -> Tensor:
        """The tensor of segment `seg` inside `flat` (same shape and strides as the parameter)."""
        return flat.as_strided(seg.shape, seg.stride, seg.offset)

    def alias(self, flat: Tensor, seg: Segment) -> Tensor:
        """Like `view`, but a tensor of its own that shares `flat`'s storage rather than an
        autograd view of `flat`: in-place metadata operations user code applies to gradients and
        optimizer state (``p.grad.detach_()``) work on it as on a separately allocated tensor."""
        return alias(flat, seg.offset, seg.shape, seg.stride)

    def new_buffer(self, fill: float) -> Tensor:
        return torch.full((self.size,), fill, dtype=self.dtype, device=self.device)


def alias(flat: Tensor, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> Tensor:
    """A tensor over `flat`'s storage at element `offset` (not an autograd view of `flat`)."""
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
        flat.untyped_storage(), flat.storage_offset() + offset, shape, stride)


def own_storage(view: Tensor) -> Tensor:
    """`view`'s elements as a tensor with a storage of its own that spans exactly them, over
    the same memory (a DLPack round trip; the new storage keeps the buffer alive). A packed
    parameter set to it pickles, `torch.save`s and `safetensors`-saves only its own bytes, as a
    separately allocated parameter does, while its memory stays in the flat buffer."""
    return torch.from_dlpack(view)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_layouts(params: list[Tensor]) -> list[FlatLayout]:
    """Plan one `FlatLayout` per (device, dtype), in order of first appearance.

    Within a layout, contiguous tensors are sorted by length (stable, so equal lengths keep the
    parameter order) and grouped in buckets; a non-contiguous dense tensor (e.g. channels_last)
    gets a bucket of its own. `slot` in each segment indexes `params`.

    Raises:
        ValueError: a parameter that is not dense and non-overlapping (it cannot be re-homed into
            a flat buffer without changing its strides).
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for slot, p in enumerate(params):
        if not is_dense_non_overlapping(p):
            raise ValueError(
                f"parameter {slot} (shape {tuple(p.shape)}, stride {p.stride()}) is not dense and "
                "non-overlapping, so it cannot live in a flat buffer with its own strides"
            )
        by_key.setdefault((p.device, p.dtype), []).append(slot)

    layouts = []
    for (device, dtype), slots in by_key.items():
        align = align_elements(dtype)
        ordered = sorted(slots, key=lambda s: params[s].numel())
        sizes = [_round_up(params[s].numel(), align) for s in ordered]
        buckets: list[Bucket] = []
        offset = 0
        for slot, row_stride in zip(ordered, sizes):
            p = params[slot]
            n = p.numel()
            contiguous = p.is_contiguous()
            seg = Segment(slot, offset, tuple(p.shape), tuple(p.stride()), n, contiguous)
            last = buckets[-1] if buckets else None
            if (last is not None and contiguous and last.segments[0].contiguous
                    and last.numel == n):
                last.segments.append(seg)  # the next row of the bucket ends at `offset`
            else:
                buckets.append(Bucket(n, row_stride, offset, [seg]))
            offset += row_stride
        segments = [s for b in buckets for s in b.segments]
        layouts.append(FlatLayout(device, dtype, offset, buckets, segments))
    return layouts

