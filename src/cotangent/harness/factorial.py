"""The two off-diagonal cells of the 2x2 factorial {batched norms} x {packing}.

`native` (neither) is `cotangent.ReferenceUpdate`; `packed` (both) is `cotangent.harness.packed.PackedAdamW`;
`packing-only` is `PackedAdamW(..., batched_norms=False)`; `batched-norms-only` is
`BatchedNormsOnly` below: gradients stay separate native tensors, equal-length ones are stacked
(one copy each step: the price of batching without a flat buffer) and reduced by one 2-D norm
wherever calibration proved it bitwise equal; the clip multiply and AdamW are native. Every cell
gives native's bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cotangent import _compat
from cotangent.clip import clip_grads_with_norm_
from cotangent.norms import bucket_norm_is_exact, native_tensor_norms, total_norm
from cotangent.harness.packed import PackedAdamW
from cotangent.verify import _verify_with, optimizer_builder


def stacked_group_norms(grads: list[Tensor], norm_type: float) -> Tensor:
    """Per-tensor norms of one (device, dtype) group, in order; equal-length contiguous gradients
    are stacked and reduced together where `bucket_norm_is_exact` allows. 1-D, the grads' dtype."""
    by_length: dict[int, list[int]] = {}
    for i, g in enumerate(grads):
        if g.is_contiguous() and g.numel() > 0:
            by_length.setdefault(g.numel(), []).append(i)
    out: list[Tensor | None] = [None] * len(grads)
    for n, idx in by_length.items():
        g0 = grads[idx[0]]
        if len(idx) > 1 and bucket_norm_is_exact(g0.device, g0.dtype, n, len(idx), n, norm_type,
                                             None):
            rows = torch.linalg.vector_norm(torch.stack([grads[i].reshape(-1) for i in idx]),
                                             norm_type, dim=1)  # (k,) from a (k, n) copy
            for j, i in enumerate(idx):
                out[i] = rows[j]
    rest = [i for i in range(len(grads)) if out[i] is None]
    if rest:
        for i, norm in zip(rest, native_tensor_norms([grads[i] for i in rest], norm_type, None)):
            out[i] = norm
    return torch.stack(out)  # type: ignore[arg-type]


class BatchedNormsOnly:
    """Clip with stacked batched norms, then native `torch.optim.AdamW` (no packing).

    Args:
        params: parameters (one group).
        max_norm, norm_type: as `torch.nn.utils.clip_grad_norm_`.
        **adamw_kwargs: passed to `torch.optim.AdamW`.
    """

    def __init__(self, params, max_norm: float, norm_type: float = 2.0, **adamw_kwargs) -> None:
        self.params = list(params)
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.optimizer = torch.optim.AdamW(self.params, **adamw_kwargs)

    @torch.no_grad()
    def step(self) -> Tensor:
        """Clip as `clip_grad_norm_(params, max_norm, norm_type)` would, then update; returns the
        total norm."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            first = grads[0].device
            parts = [stacked_group_norms([grads[i] for i in idx], self.norm_type).to(first)
                     for _, _, idx in _compat.group_by_device_and_dtype(grads)]
            total = total_norm(parts, self.norm_type)
        else:
            total = torch.tensor(0.0)
        clip_grads_with_norm_(self.params, self.max_norm, total)
        self.optimizer.step()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def verify_batched_norms_only(model: torch.nn.Module, loss_fn, batches, *,
                              max_norm: float | None = 1.0, norm_type: float = 2.0,
                              autocast_dtype: torch.dtype | None = None, compile: bool = False,
                              stop_at_first: bool = True, **adamw_kwargs):
    """`cotangent.verify` for the batched-norms-only cell: native clip + AdamW against
    `BatchedNormsOnly`, byte for byte after every step; returns a `cotangent.verify.VerifyReport`
    whose arm is "batched-norms-only".

    Raises:
        ValueError: `max_norm` is None (the cell is a clip); no batches.
    """
    if max_norm is None:
        raise ValueError("batched-norms-only needs max_norm")

    def build(our_params, our_order, *, max_norm, norm_type, error_if_nonfinite, **kwargs):
        cell = BatchedNormsOnly(our_params, max_norm=max_norm, norm_type=norm_type, **kwargs)
        return cell.optimizer, cell.step
    build.arm = "batched-norms-only"
    return _verify_with(build, model, loss_fn, batches, max_norm=max_norm,
                        autocast_dtype=autocast_dtype, compile=compile,
                        stop_at_first=stop_at_first, params=None, clip_order=None,
                        norm_type=norm_type, error_if_nonfinite=False, **adamw_kwargs)


def verify_packing_only(model: torch.nn.Module, loss_fn, batches, *,
                        max_norm: float | None = 1.0, norm_type: float = 2.0,
                        autocast_dtype: torch.dtype | None = None, compile: bool = False,
                        stop_at_first: bool = True, params=None, clip_order=None,
                        error_if_nonfinite: bool = False, **adamw_kwargs):
    """`cotangent.verify` for the packing-only cell: native clip + AdamW against
    ``PackedAdamW(..., batched_norms=False)`` (packed buffers, native per-tensor norms), byte
    for byte after every step; the arguments and the `cotangent.verify.VerifyReport` as
    `cotangent.verify`'s, with arm "packing-only".

    Raises:
        ValueError: as `cotangent.verify`.
    """
    return _verify_with(optimizer_builder(PackedAdamW, arm="packing-only", batched_norms=False),
                        model, loss_fn, batches, max_norm=max_norm, autocast_dtype=autocast_dtype,
                        compile=compile, stop_at_first=stop_at_first, params=params,
                        clip_order=clip_order, norm_type=norm_type,
                        error_if_nonfinite=error_if_nonfinite, **adamw_kwargs)
