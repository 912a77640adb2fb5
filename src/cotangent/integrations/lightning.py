"""PyTorch Lightning with `cotangent.AdamW` doing the Trainer's one clip.

Lightning clips natively (``Trainer(gradient_clip_val=...)``: `torch.nn.utils.clip_grad_norm_`
over the optimizer's parameters, after the closure's backward); `cotangent.AdamW(max_norm=...)`
clips inside `step()`. Both set clips twice (the second coefficient ``max_norm / (norm' + 1e-6)``
with ``norm'`` just under ``max_norm`` is about ``1 - 1e-6``: other bits than one clip). Mixing
`CotangentClipping` into a `LightningModule` makes ``gradient_clip_val`` the optimizer's own
batched clip, once:

    >>> from cotangent.integrations.lightning import CotangentClipping
    >>> class Model(CotangentClipping, pl.LightningModule):
    ...     def configure_optimizers(self):
    ...         return cotangent.AdamW(self.parameters(), lr=1e-3, max_norm=1.0)
    >>> pl.Trainer(gradient_clip_val=1.0).fit(Model(), data)   # one clip: native's bits

Needs ``pip install 'cotangent[lightning]'``; this module imports no framework itself (the mixin
works with `pytorch_lightning` and `lightning.pytorch` alike); ``import cotangent`` never
imports it.
"""

from __future__ import annotations

from cotangent.integrations import clip_follows
from cotangent.adamw import AdamW

__all__ = ["CotangentClipping"]


def _unwrapped(optimizer):
    """The optimizer inside Lightning's `LightningOptimizer` (or `optimizer`)."""
    return getattr(optimizer, "_optimizer", optimizer)


class CotangentClipping:
    """`LightningModule` mixin (list it before `LightningModule`): for a `cotangent.AdamW` with
    `max_norm`, the Trainer's clip is the optimizer's `clip_grad_norm_()`.

    - ``gradient_clip_val`` unset or 0: nothing here; `step()` clips with `max_norm`.
    - ``gradient_clip_val == max_norm`` with the "norm" algorithm (and `norm_type` 2): the
      optimizer clips now, exactly as Lightning's `clip_grad_norm_` over its parameters would
      (the optimizer's parameter order, Lightning's too), and `step()` does not clip again.
    - any other value, or "value" clipping, or a `clip_order` that lists the parameters with
      gradients otherwise than the param groups: `ValueError` (two different clips asked for),
      raised before the optimizer changes anything.
    With two or more param groups, build the optimizer with ``clip_order="param_groups"``
    (Lightning's clip order; `cotangent.AdamW` refuses an unstated order there).
    Any other optimizer (or `max_norm=None`): Lightning's own clipping, unchanged.
    """

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None) -> None:
        inner = _unwrapped(optimizer)
        if not isinstance(inner, AdamW) or inner.max_norm is None:
            return super().configure_gradient_clipping(
                optimizer, gradient_clip_val=gradient_clip_val,
                gradient_clip_algorithm=gradient_clip_algorithm)
        if gradient_clip_val is None or gradient_clip_val == 0:
            return None
        algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
        if (algorithm not in (None, "norm") or inner.norm_type != 2.0
                or float(gradient_clip_val) != float(inner.max_norm)):
            raise ValueError(
                f"gradient_clip_val={gradient_clip_val} ({algorithm or 'norm'}) and "
                f"cotangent.AdamW(max_norm={inner.max_norm}, norm_type={inner.norm_type}) ask "
                "for two different clips: set gradient_clip_val to max_norm (norm clipping), "
                "or leave it unset, or build the optimizer with max_norm=None")
        _check_clip_order(inner)
        inner.clip_grad_norm_()
        return None


def _check_clip_order(opt: AdamW) -> None:
    """ValueError unless the optimizer's clip takes the parameters that have gradients in the
    order Lightning's clip does (the param groups concatenated), so their norms have the same
    bits."""
    if not clip_follows(opt, [p for group in opt.param_groups for p in group["params"]]):
        raise ValueError(
            "CotangentClipping: Lightning clips clip_grad_norm_ over the optimizer's param "
            "groups, but the optimizer's clip_order lists the parameters with gradients "
            "differently: build cotangent.AdamW with clip_order='param_groups' (or clip in "
            "step() with gradient_clip_val unset)")
