"""The native update phase, written exactly as a user writes it.

`ReferenceUpdate` *calls* `torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW`; it never
re-implements them. Every fast path in Cotangent is tested against it (`cotangent.verify` and the
test suite use it as their one oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cotangent.clip_order import normalize_clip_order


class ReferenceUpdate:
    """``clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)`` then
    ``torch.optim.AdamW(...).step()``.

    Args:
        params: parameters or param-group dicts, as for `torch.optim.AdamW`.
        max_norm: clipping threshold, or None for no clipping.
        norm_type: p of the global norm.
        error_if_nonfinite: as `clip_grad_norm_`.
        clip_order: what is passed to `clip_grad_norm_`: a module (its ``parameters()`` at each
            clip, as a loop calling ``clip_grad_norm_(model.parameters(), ...)`` does), a
            zero-argument callable, a fixed list, or ``"param_groups"`` / None: the optimizer's
            parameters, param groups concatenated. (The oracle takes every order as given;
            `cotangent.AdamW` refuses None where it is ambiguous.)
        **adamw_kwargs: passed unchanged to `torch.optim.AdamW` (lr, betas, eps, weight_decay,
            amsgrad, maximize, foreach, fused, ...).

    Raises:
        ValueError: a `clip_order` that is a string other than ``"param_groups"`` or holds
            something other than tensors; what `torch.optim.AdamW` raises.

    Attributes:
        optimizer: the `torch.optim.AdamW`.
    """

    def __init__(self, params, max_norm: float | None = None, norm_type: float = 2.0,
                 error_if_nonfinite: bool = False, clip_order=None, **adamw_kwargs) -> None:
        self.optimizer = torch.optim.AdamW(params, **adamw_kwargs)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.error_if_nonfinite = error_if_nonfinite
        self.clip_order = normalize_clip_order(clip_order)
        self._clipped = False

    @property
    def params(self) -> list[Tensor]:
        """The optimizer's parameters, param groups concatenated."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def clip_grad_norm_(self) -> Tensor:
        """The user's clip: `clip_grad_norm_` over the clip-order parameters; returns the total."""
        self._clipped = True
        order = self.clip_order
        if isinstance(order, torch.nn.Module):
            params = order.parameters()
        elif callable(order):
            params = order()
        else:
            params = self.params if order is None or isinstance(order, str) else order
        return torch.nn.utils.clip_grad_norm_(params, self.max_norm, self.norm_type,
                                              self.error_if_nonfinite)

    def step(self) -> Tensor | None:
        """Clip (if configured and not already done for these gradients) and update; returns the
        total norm from `clip_grad_norm_` (None when this step did not clip)."""
        total = None
        if self.max_norm is not None and not self._clipped:
            total = self.clip_grad_norm_()
        self._clipped = False
        self.optimizer.step()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`torch.optim.AdamW.zero_grad` (and the next `step()` clips again)."""
        self._clipped = False
        self.optimizer.zero_grad(set_to_none=set_to_none)
