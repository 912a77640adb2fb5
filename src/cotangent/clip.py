"""`cotangent.clip_grad_norm_`: drop-in for `torch.nn.utils.clip_grad_norm_` with batched norms.

Same signature, return value, warnings and errors as the native function (torch 2.4-2.13,
torch/nn/utils/clip_grad.py). Gradients that already sit as equally spaced, equal-length,
contiguous rows of one storage (for example the flat gradient buffer of a `cotangent.AdamW`) are
reduced with one 2-D norm per run wherever `cotangent.norms.bucket_norm_is_exact` has proven that
call bitwise equal to native per-tensor norms; every other gradient takes the native per-tensor
call. The clip multiply is native's (`_foreach_mul_` / `mul_`), skipped on CPU when the
coefficient is exactly 1.0 (x * 1.0 == x bit for bit, and reading a CPU scalar costs no sync).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable

import torch
from torch import Tensor

from cotangent import _compat, dtensor
from cotangent.norms import (
    bucket_norm_is_exact,
    check_finite,
    clip_coefficient,
    native_tensor_norms,
    total_norm,
)


def _row_runs(grads: list[Tensor]) -> list[tuple[int, int, int]]:
    """Maximal runs (start, count, row_stride) of consecutive `grads` that are rows of one strided
    matrix: same storage, contiguous, equal numel, offsets in arithmetic progression."""
    runs = []
    i = 0
    while i < len(grads):
        g = grads[i]
        j = i + 1
        stride = None
        if g.is_contiguous() and g.numel() > 0:
            base = g.untyped_storage().data_ptr()
            while j < len(grads):
                h = grads[j]
                if (not h.is_contiguous() or h.numel() != g.numel()
                        or h.untyped_storage().data_ptr() != base):
                    break
                step = h.storage_offset() - grads[j - 1].storage_offset()
                if step < g.numel() or (stride is not None and step != stride):
                    break
                stride = step
                j += 1
        runs.append((i, j - i, stride or g.numel()))
        i = j
    return runs


def group_norms(grads: list[Tensor], norm_type: float, foreach: bool | None) -> Tensor:
    """Per-tensor norms of one (device, dtype) group, in order, as a 1-D tensor."""
    if not any(g.storage_offset() for g in grads):
        # (a run's later rows sit at positive offsets: tensors of their own, e.g. autograd's
        # fresh gradients, take the native per-tensor call without the run search)
        return torch.stack(native_tensor_norms(grads, norm_type, foreach))
    parts: list[Tensor] = []
    pending: list[Tensor] = []
    for start, count, stride in _row_runs(grads):
        first = grads[start]
        if count > 1 and bucket_norm_is_exact(first.device, first.dtype, first.numel(), count, stride,
                                          norm_type, foreach):
            if pending:
                parts.append(torch.stack(native_tensor_norms(pending, norm_type, foreach)))
                pending = []
            matrix = first.as_strided((count, first.numel()), (stride, 1),
                                      first.storage_offset())
            parts.append(torch.linalg.vector_norm(matrix, norm_type, dim=1))
        else:
            pending.extend(grads[start:start + count])
    if pending:
        parts.append(torch.stack(native_tensor_norms(pending, norm_type, foreach)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@torch.no_grad()
def get_total_norm(tensors: Iterable[Tensor] | Tensor, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """Drop-in for `torch.nn.utils.get_total_norm`: the norm of the per-tensor norms.

    Returns a 0-dim tensor on the first tensor's device, dtype promoted over the inputs' dtypes
    (native `torch.stack` promotion); `torch.tensor(0.0)` for no tensors.
    Raises:
        RuntimeError: non-finite total with `error_if_nonfinite=True`; `foreach=True` on a
            device without foreach kernels (native messages).
    """
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    if any(map(dtensor.is_dtensor, tensors)):  # (FSDP2: native's own code, reductions and all)
        return torch.nn.utils.get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    first_device = tensors[0].device
    parts = [group_norms([tensors[i] for i in indices], norm_type, foreach).to(first_device)
             for _, _, indices in _compat.group_by_device_and_dtype(tensors)]
    total = total_norm(parts, norm_type)
    if error_if_nonfinite:
        check_finite(total, norm_type)
    return total


@torch.no_grad()
def clip_grads_with_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float,
                          total: Tensor, foreach: bool | None = None) -> None:
    """Drop-in for `torch.nn.utils.clip_grads_with_norm_`: scale every gradient in place by
    `clamp(max_norm / (total + 1e-6), max=1.0)` with native's op sequence."""
    parameters = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    scale_grads_([p.grad for p in parameters if p.grad is not None], max_norm, total, foreach)


@torch.no_grad()
def scale_grads_(grads: list[Tensor], max_norm: float, total: Tensor,
                 foreach: bool | None = None) -> None:
    """The multiply of `clip_grads_with_norm_`, on the gradient tensors themselves: each is
    scaled in place by `clamp(max_norm / (total + 1e-6), max=1.0)` (per (device, dtype) group,
    `_foreach_mul_` or a loop of `mul_` as native chooses). The multiply runs even by 1.0, as
    native's does: `total` need not be these gradients' norm, so nothing proves ``g * 1.0 == g``
    (a signalling NaN is quieted, a subnormal flushed under `torch.set_flush_denormal`)."""
    if not grads:
        return
    multiply_grads_(grads, clip_coefficient(total, float(max_norm)), foreach)


@torch.no_grad()
def multiply_grads_(grads: list[Tensor], coef: Tensor, foreach: bool | None = None) -> None:
    """`clip_grads_with_norm_`'s multiply by an already computed clip coefficient `coef` (a
    0-dim tensor): per (device, dtype) group, `_foreach_mul_` or a loop of `mul_`, as native
    chooses."""
    if not grads:
        return
    for device, _, indices in _compat.group_by_device_and_dtype(grads):
        group = [grads[i] for i in indices]
        coef_dev = coef.to(device)
        if _compat.foreach_norm_is_used(group, device, foreach):  # same branch as native's mul
            _compat.foreach_mul_(group, coef_dev)
        else:
            for g in group:
                g.mul_(coef_dev)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> Tensor:
    """Drop-in for `torch.nn.utils.clip_grad_norm_`, bitwise equal on the same inputs.

    Args:
        parameters: tensors (or one tensor) whose `.grad` are clipped in place.
        max_norm: maximum total norm (float; a negative value flips the gradients, as native).
        norm_type: p of the p-norm, `float('inf')` for the max norm.
        error_if_nonfinite: raise before modifying anything if the total norm is inf or NaN.
        foreach: as native: None uses foreach kernels where supported.
    Returns:
        The total norm of the gradients before clipping (0-dim tensor).
    Warns:
        UserWarning: `parameters` is an empty generator (native message).
    """
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=3)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(parameters, max_norm, total, foreach)
    return total
