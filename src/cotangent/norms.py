"""Gradient norms and the clip coefficient, bitwise equal to `torch.nn.utils.clip_grad_norm_`.

Native clipping (torch/nn/utils/clip_grad.py, torch 2.4-2.13) computes one norm per gradient,
grouped by (device, dtype) with `_group_tensors_by_device_and_dtype`, stacks them in that group
order, takes the norm of the stack, then multiplies every gradient by
`clamp(max_norm / (total + 1e-6), max=1.0)`. This module reproduces each stage with the same
torch ops and replaces only the per-tensor norms of equal-length gradients by one 2-D
`torch.linalg.vector_norm(..., dim=1)` over a bucket of the flat gradient buffer, and only where a
calibration probe has shown that call to give the same bits as the native per-tensor call on this
device, dtype, length, bucket size, thread count and torch version. Everywhere else the native
per-tensor call runs on views of the flat buffer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cotangent import _compat, calibration
from cotangent.calibration import ALL_ONES_NAN, sprinkle_special_values, write_special
from cotangent.spans import align_elements

_PROBE_TRIALS = 4


def native_tensor_norms(
    tensors: list[Tensor], norm_type: float, foreach: bool | None
) -> list[Tensor]:
    """Per-tensor norms of one (device, dtype) group, exactly as native clipping computes them.

    Args:
        tensors: gradients sharing one device and dtype, any shapes.
        norm_type: p of the p-norm (`float('inf')` for the max norm).
        foreach: as in `clip_grad_norm_`: None picks `torch._foreach_norm` where supported.
    Returns:
        One 0-dim tensor per input, dtype of the inputs.
    Raises:
        RuntimeError: `foreach=True` on a device without foreach kernels (native message).
    """
    if not tensors:
        return []
    if _compat.foreach_norm_is_used(tensors, tensors[0].device, foreach):
        return _compat.foreach_norm(tensors, norm_type)
    return [torch.linalg.vector_norm(g, norm_type) for g in tensors]


def _probe_values(count: int, dtype: torch.dtype, trial: int) -> Tensor:
    """Deterministic probe data (float32 on CPU, cast to `dtype`): three magnitude profiles, and
    a fourth whose rows carry the special values (`calibration.sprinkle_special_values`, applied
    by the caller, which knows the rows)."""
    gen = torch.Generator().manual_seed(1234 + trial)
    x = torch.randn(count, generator=gen, dtype=torch.float32)
    if trial == 1:  # small values with exact zeros, like sparse-ish gradients
        x = x * 1e-4 * (torch.rand(count, generator=gen, dtype=torch.float32) > 0.1)
    elif trial == 2:  # wide exponent spread, within the dtype's range
        span = 6 if dtype == torch.float16 else 20
        x = x * torch.exp2(torch.randint(-span, span + 1, (count,), generator=gen).float())
    return x.to(dtype)


SPECIAL_TRIAL = _PROBE_TRIALS - 1  # the trial whose rows also hold inf, NaN and signed zeros


_bytes_equal = calibration.same_bytes  # (not `torch.equal` on values: -0.0 == 0.0, NaN != NaN)


def bucket_norm_is_exact(
    device: torch.device,
    dtype: torch.dtype,
    numel: int,
    rows: int,
    row_stride: int,
    norm_type: float,
    foreach: bool | None,
) -> bool:
    """Whether one 2-D row-norm call equals native per-tensor norms for this bucket shape.

    The probe lays out `rows` tensors of `numel` elements `row_stride` apart in a fresh buffer
    on `device` (64-byte aligned, like the flat buffers) and compares, byte for byte, the rows
    of `torch.linalg.vector_norm(matrix, norm_type, dim=1)` with native per-tensor norms of
    separately allocated copies, on four probe distributions (the last with inf, -inf, NaN,
    signed zeros and a subnormal sprinkled over the rows, so that NaN payloads are compared
    too). It also checks that native norms of the views equal those of the copies (the
    per-tensor fallback relies on it). The verdict is cached per (device type, dtype, numel,
    rows, row_stride, norm_type, native path) and the environment
    (`cotangent.calibration.full_key`).

    Raises:
        RuntimeError: native per-tensor norms of views differ from those of copies, i.e. the packed
            layout itself cannot be bitwise equal on this device.
    """
    native_path = _compat.foreach_norm_is_used(
        [torch.empty(0, dtype=dtype, device=device)], device, foreach
    )
    if rows < 2 or numel == 0:
        return False  # nothing to batch: the native per-tensor call is used as is
    key = calibration.full_key("bucket_norm", device.type, (
        dtype, numel, rows, row_stride, float(norm_type),
        "_foreach_norm" if native_path else "vector_norm"),
        probe=(bucket_norm_is_exact, _bucket_norm_probe, _probe_values,
               native_tensor_norms))
    return calibration.verdict(key, lambda: _bucket_norm_probe(
        device, dtype, numel, rows, row_stride, norm_type, foreach))


def _bucket_norm_probe(device, dtype, numel, rows, row_stride, norm_type, foreach) -> bool:
    verdict = True
    for trial in range(_PROBE_TRIALS):
        flat = _probe_values(rows * row_stride, dtype, trial).to(device)
        matrix = flat.as_strided((rows, numel), (row_stride, 1), 0)
        views = list(matrix.unbind(0))
        if trial == SPECIAL_TRIAL:
            sprinkle_special_values(views)
        copies = [v.clone() for v in views]
        native = torch.stack(native_tensor_norms(copies, norm_type, foreach))
        on_views = torch.stack(native_tensor_norms(views, norm_type, foreach))
        if not _bytes_equal(native, on_views):
            raise RuntimeError(
                f"native norms of views into a flat buffer differ from norms of separate tensors "
                f"on {device.type} {dtype} (numel {numel}); packing cannot be bitwise equal here"
            )
        if verdict:
            batched = torch.linalg.vector_norm(matrix, norm_type, dim=1)
            verdict = _bytes_equal(batched, native)
    return verdict


def flat_multiply_is_exact(device: torch.device, dtype: torch.dtype, coef_dtype: torch.dtype,
                           finite: bool = True) -> bool:
    """Whether one in-place multiply over a flat buffer equals per-tensor multiplies.

    Native clipping runs `g.mul_(coef)` per gradient (`_foreach_mul_` falls back to that on
    CPU). Multiplication is elementwise, so the only way position can matter is a vectorised body
    and a scalar tail computing it differently: NaN payloads differ that way in bfloat16, and when
    both the element and the coefficient are NaN, the body and the tail keep different ones. The
    probe multiplies segments of 1-40, 63-65, 127-129 and 1000 elements, laid out as in a flat
    buffer and holding inf, -inf, NaNs, signed zeros and a subnormal in body and tail positions,
    by coefficients of one class - `finite` (random, 1, 0.5, 1e-6, 0, -0.5, 3) or not (inf,
    -inf, NaNs of both signs) - and compares the bytes with per-segment multiplies of copies.
    Cached per (device type, dtype, coefficient dtype, class) and the environment
    (`cotangent.calibration.full_key`).
    """
    key = calibration.full_key("flat_clip_multiply", device.type,
                               (dtype, coef_dtype, "finite" if finite else "nonfinite"),
                               probe=(flat_multiply_is_exact, _flat_multiply_probe, _probe_values))
    return calibration.verdict(
        key, lambda: _flat_multiply_probe(device, dtype, coef_dtype, finite))


def _flat_multiply_probe(device, dtype, coef_dtype, finite) -> bool:
    align = align_elements(dtype)
    lengths = list(range(1, 41)) + [63, 64, 65, 127, 128, 129, 1000]
    offsets, total = [], 0
    for n in lengths:
        offsets.append(total)
        total += -(-n // align) * align
    gen = torch.Generator().manual_seed(99)
    if finite:
        coefs = (torch.rand(13, generator=gen, dtype=torch.float32).tolist()
                 + [1.0, 0.5, 1e-6, 0.0, -0.5, 3.0])
    else:
        coefs = [float("inf"), float("-inf"), float("nan"), -float("nan"), ALL_ONES_NAN]
    verdict = True
    for trial, c in enumerate(coefs):
        flat = _probe_values(total, dtype, trial % _PROBE_TRIALS).to(device)
        segments = [flat[o:o + n] for o, n in zip(offsets, lengths)]
        sprinkle_special_values(segments[trial % 2::2], shift=trial)  # alternate segments
        coef = torch.zeros(1, dtype=coef_dtype, device=device)
        write_special(coef, 0, c)
        coef = coef[0]
        copies = [t.clone() for t in segments]
        for t in copies:
            t.mul_(coef)
        flat.mul_(coef)
        if not all(_bytes_equal(flat[o:o + n], t) for o, n, t in zip(offsets, lengths, copies)):
            verdict = False
            break
    return verdict


def total_norm(norms_in_native_order: list[Tensor] | Tensor, norm_type: float,
               across=None) -> Tensor:
    """`vector_norm(stack(per-tensor norms), norm_type)`: the native total gradient norm.

    `torch.cat` of per-group 1-D norm tensors promotes dtypes exactly as native `torch.stack`
    of the 0-dim norms does. An empty input gives native's `torch.tensor(0.0)`. `across`: a
    function applied to the stack first (the cross-rank reduction of the local shards' norms
    of DTensor gradients: `cotangent.dtensor.reduce_stacked`).
    """
    if isinstance(norms_in_native_order, Tensor):
        stacked = norms_in_native_order
    elif not norms_in_native_order:
        return torch.tensor(0.0)
    else:
        stacked = torch.cat(norms_in_native_order)
    if across is not None:
        stacked = across(stacked)
    return torch.linalg.vector_norm(stacked, norm_type)


def check_finite(total: Tensor, norm_type: float) -> None:
    """`clip_grad_norm_(..., error_if_nonfinite=True)`'s check, with native's message.

    Raises:
        RuntimeError: `total` is inf or NaN.
    """
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """`clamp(max_norm / (total + 1e-6), max=1.0)` with native's op sequence.

    `float / Tensor` is `Tensor.__rtruediv__`, i.e. `reciprocal()` then a multiply, which differs
    from a true division in the last bit for about a quarter of inputs
    (25,724 of 100,000 random float32 norms on CPU); so this keeps the exact expression of
    `torch.nn.utils.clip_grad._clip_grads_with_norm_`.
    """
    clip_coef = float(max_norm) / (total + 1e-6)
    return torch.clamp(clip_coef, max=1.0)


def flushing_denormals() -> bool:
    """Whether float32 arithmetic on the calling thread flushes subnormals (after
    `torch.set_flush_denormal(True)`: x86 FTZ/DAZ), read off one multiply (no getter exists)."""
    return bool(torch.tensor([1e-40], dtype=torch.float32).mul_(1.0)[0] == 0.0)


def multiply_is_identity(coef: Tensor, norm_type: float, flushing: bool | None = None,
                         value: float | None = None) -> bool:
    """True when multiplying gradients by the clip coefficient `coef` may be skipped, where
    `coef` came from those gradients' own total norm of order `norm_type`: it is exactly 1.0
    and on the CPU (reading it costs no device sync; on accelerators the multiply always runs,
    as native's does), and ``g * 1.0 == g`` bit for bit for every gradient. That fails for a
    signalling NaN (the multiply quiets it) and for subnormals while denormals are flushed, so
    the norm must be one a NaN turns into NaN (every order but 0, which counts a NaN as 1:
    a coefficient of 1.0 then proves no NaN is there) and nothing may be flushing.
    `flushing`: whether the calling thread flushes denormals, where the caller knows (e.g. from
    its MXCSR register, `cotangent.singlepass.flushing_now`); None: `flushing_denormals()`.
    `value`: ``coef.item()`` where the caller has read it already."""
    return (coef.device.type == "cpu" and (coef.item() if value is None else value) == 1.0
            and norm_type != 0 and not (flushing_denormals() if flushing is None else flushing))
