"""The native update phase, written exactly as a user writes it.

`ReferenceUpdate` *calls* `torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW`; it never
re-implements them. Every fast path in Cotangent is tested against it.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ReferenceUpdate:
    """``clip_grad_norm_(params, max_norm, norm_type)`` then ``torch.optim.AdamW(...).step()``.

    Args:
        params: parameters (a single group), as for `torch.optim.AdamW`.
        max_norm: clipping threshold, or None for no clipping.
        norm_type: p of the global norm.
        **adamw_kwargs: passed unchanged to `torch.optim.AdamW` (lr, betas, eps, weight_decay,
            amsgrad, maximize, foreach, fused, ...).
    """

    def __init__(self, params, max_norm: float | None = None, norm_type: float = 2.0,
                 **adamw_kwargs) -> None:
        self.params = list(params)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.optimizer = torch.optim.AdamW(self.params, **adamw_kwargs)

    def step(self) -> Tensor | None:
        """Clip (if configured) and update; returns the total norm from `clip_grad_norm_`."""
        total = None
        if self.max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, self.norm_type)
        self.optimizer.step()
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
