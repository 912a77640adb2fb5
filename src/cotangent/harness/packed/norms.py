"""Norm programs over the packed design's flat gradient buffers: one 2-D row norm per bucket of
equal-length gradients that `cotangent.norms.bucket_norm_is_exact` proved bitwise equal to the
native per-tensor norms, one native per-tensor call for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cotangent.harness.packed.layout import FlatLayout
from cotangent.norms import bucket_norm_is_exact, native_tensor_norms


def calibrate_layout(layout: FlatLayout, norm_type: float, foreach: bool | None) -> None:
    """Set `bucket.batched` for every bucket of `layout` from `bucket_norm_is_exact`."""
    for bucket in layout.buckets:
        bucket.batched = bucket_norm_is_exact(
            layout.device, layout.dtype, bucket.numel, bucket.rows, bucket.row_stride,
            norm_type, foreach,
        )


@dataclass(frozen=True, slots=True)
class NormProgram:
    """The calls that compute every per-tensor gradient norm of one flat buffer."""

    matrices: tuple[Tensor, ...]  # (rows, numel) views of calibrated buckets: one 2-D norm each
    singles: tuple[Tensor, ...]  # views normed by one native per-tensor call
    order: tuple[int, ...]  # position in `layout.segments` of each output norm, in output order


def norm_program(layout: FlatLayout, flat_grads: Tensor) -> NormProgram:
    """Plan the norm calls of a calibrated `layout` over its gradient buffer `flat_grads`."""
    matrices, singles, batched_order, single_order = [], [], [], []
    pos = 0
    for bucket in layout.buckets:
        positions = list(range(pos, pos + bucket.rows))
        pos += bucket.rows
        if bucket.batched:
            matrices.append(bucket.matrix(flat_grads))
            batched_order += positions
        else:
            singles += [layout.view(flat_grads, seg) for seg in bucket.segments]
            single_order += positions
    return NormProgram(tuple(matrices), tuple(singles), tuple(batched_order + single_order))


def run_norm_program(program: NormProgram, norm_type: float, foreach: bool | None) -> Tensor:
    """Per-tensor norms in `program.order`: one `vector_norm(dim=1)` per calibrated bucket and
    one native call for all other tensors. 1-D tensor, the gradients' dtype."""
    parts = [torch.linalg.vector_norm(m, norm_type, dim=1) for m in program.matrices]
    if program.singles:
        parts.append(torch.stack(native_tensor_norms(list(program.singles), norm_type, foreach)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def layout_norms(
    layout: FlatLayout, flat_grads: Tensor, norm_type: float, foreach: bool | None
) -> Tensor:
    """Norms of every segment's gradient, in buffer order (`layout.segments`).

    Args:
        layout: a calibrated layout (see `calibrate_layout`).
        flat_grads: 1-D gradient buffer of `layout.size` elements, `layout.dtype`.
    Returns:
        1-D tensor of `len(layout.segments)` norms, dtype `layout.dtype`.
    """
    program = norm_program(layout, flat_grads)
    out = run_norm_program(program, norm_type, foreach)
    inverse = [0] * len(program.order)
    for i, pos in enumerate(program.order):
        inverse[pos] = i
    return out.index_select(0, torch.tensor(inverse, device=out.device))
