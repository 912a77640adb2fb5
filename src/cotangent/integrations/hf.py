"""Hugging Face `transformers.Trainer` with `cotangent.AdamW` doing the Trainer's one clip.

The plain Trainer clips natively (``TrainingArguments.max_grad_norm``, default 1.0) and, in
transformers 5.x, runs a second native norm pass (``clip_grad_norm_(params, inf)``) for the
logged ``grad_norm`` when ``max_grad_norm=0``. With `cotangent.AdamW(max_norm=...)` that means
either two clips (the Trainer's, then the optimizer's: other bits than the native run) or two
norm passes. `CotangentTrainer` hands the clip and the logged norm to the optimizer's batched
`clip_grad_norm_()`, so a step clips once and norms once:

    >>> from cotangent.integrations.hf import CotangentTrainer
    >>> opt = cotangent.AdamW(model.parameters(), lr=1e-3, max_norm=1.0)
    >>> trainer = CotangentTrainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0),
    ...                            train_dataset=data, optimizers=(opt, scheduler))
    >>> trainer.train()   # the bits of Trainer(..., optimizers=(torch.optim.AdamW(...), scheduler))

Needs ``pip install 'cotangent[hf]'`` (transformers, accelerate); importing this module imports
transformers, ``import cotangent`` does not.
"""

from __future__ import annotations

try:
    import transformers
    from transformers import Trainer
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError("cotangent.integrations.hf needs transformers and accelerate: "
                      "pip install 'cotangent[hf]'") from error

import torch

from cotangent.integrations import clip_follows
from cotangent.adamw import AdamW

__all__ = ["CotangentTrainer", "CotangentTrainerMixin"]

# Accelerate's distributed types whose `clip_grad_norm_` is the plain torch call (after
# unscaling), i.e. where the optimizer's clip is the same computation.
_PLAIN_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU",
                "MULTI_SDAA", "MULTI_MUSA", "MULTI_HPU", "MULTI_NEURON"}


def unwrap_optimizer(optimizer):
    """The optimizer inside accelerate's `AcceleratedOptimizer` wrapper(s) (or `optimizer`)."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:  # pragma: no cover - transformers' Trainer requires accelerate
        return optimizer
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class CotangentTrainerMixin:
    """Mix into a `transformers.Trainer` subclass (``class T(CotangentTrainerMixin, SFTTrainer)``)
    to make `cotangent.AdamW` (built with ``max_norm``) do the Trainer's gradient clip.

    What the Trainer's step does then, for an optimizer ``opt = cotangent.AdamW(...,
    max_norm=M)`` (norm_type 2):
      - ``max_grad_norm == M`` or ``max_grad_norm == 0``: the clip and the logged ``grad_norm``
        are ``opt.clip_grad_norm_()`` (one batched norm pass; `step()` does not clip again).
        Parameters, AdamW state, losses and logged norms have the bits of the same Trainer run
        with ``torch.optim.AdamW`` and ``max_grad_norm=M``.
      - another ``max_grad_norm > 0``, or ``norm_type != 2`` with ``max_grad_norm > 0``: two
        different clips were asked for; `ValueError` at the first step.
      - ``norm_type != 2`` with ``max_grad_norm == 0``: the Trainer's native norm pass logs the
        2-norm and the optimizer clips with its p-norm in `step()` (the native program).
    Any other optimizer, or `cotangent.AdamW` with ``max_norm=None``: the Trainer's own native
    clip and norm, unchanged.

    The optimizer's clip covers its clip order; the Trainer's covers ``model.parameters()``.
    They must list the parameters that have gradients in the same order, else `ValueError` at
    the first step: build the optimizer from ``model.parameters()`` or pass
    ``clip_order=model``. With two or more param groups (the Trainer's decay / no-decay
    split through ``optimizer_cls_and_kwargs``) `cotangent.AdamW` itself refuses a missing
    ``clip_order`` when the Trainer builds it.

    Raises:
        TypeError at construction: the Trainer class lacks the ``_clip_grad_norm`` /
            ``_get_grad_norm`` methods this overrides (transformers before 5.0): there, use the
            plain Trainer with ``max_grad_norm=0`` and ``cotangent.AdamW(max_norm=...)``.
        ValueError / NotImplementedError at the first optimizer step: see above; DeepSpeed,
            FSDP, XLA or SageMaker model parallelism with ``cotangent.AdamW(max_norm=...)``.
    """

    def __init__(self, *args, **kwargs):
        for name in ("_clip_grad_norm", "_get_grad_norm"):
            if not callable(getattr(super(), name, None)):
                raise TypeError(
                    f"CotangentTrainer needs Trainer.{name} (transformers >= 5.0; installed: "
                    f"{transformers.__version__}). With this version use the plain Trainer with "
                    "TrainingArguments(max_grad_norm=0) and cotangent.AdamW(max_norm=...)")
        super().__init__(*args, **kwargs)

    # -- the Trainer's two hooks (transformers 5.x, Trainer._inner_training_loop)

    def _clip_grad_norm(self, model):
        opt = self._cotangent_clipper(model)
        if opt is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()  # as Accelerator.clip_grad_norm_ does first
        return opt.clip_grad_norm_()

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            opt = self._cotangent_clipper(model)
            if opt is not None:
                self.accelerator.unscale_gradients()
                grad_norm = opt.clip_grad_norm_()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _cotangent_clipper(self, model):
        """The `cotangent.AdamW` that does this step's clip, or None for the native path."""
        opt = unwrap_optimizer(self.optimizer)
        if not isinstance(opt, AdamW) or opt.max_norm is None:
            return None
        trainer_max = self.args.max_grad_norm or 0.0
        if trainer_max > 0 and (float(trainer_max) != opt.max_norm or opt.norm_type != 2.0):
            raise ValueError(
                f"TrainingArguments(max_grad_norm={trainer_max}) and cotangent.AdamW(max_norm="
                f"{opt.max_norm}, norm_type={opt.norm_type}) ask for two different clips; the "
                "Trainer clips with the 2-norm: set max_grad_norm to the optimizer's max_norm "
                "(or 0), or build the optimizer with max_norm=None")
        if trainer_max <= 0 and opt.norm_type != 2.0:
            return None  # the Trainer logs its 2-norm natively; step() clips with the p-norm
        kind = str(getattr(self.accelerator.distributed_type, "value",
                           self.accelerator.distributed_type))
        if kind.upper() not in _PLAIN_TYPES:
            raise NotImplementedError(
                f"CotangentTrainer: the optimizer's clip replaces Accelerator.clip_grad_norm_ "
                f"only without DeepSpeed, FSDP or XLA (distributed type {kind})")
        if getattr(self, "_has_mixed_mesh_grads", None) and self._has_mixed_mesh_grads(model):
            raise NotImplementedError("CotangentTrainer: gradients on several device meshes")
        _check_clip_order(opt, model)
        return opt


def _check_clip_order(opt: AdamW, model: torch.nn.Module) -> None:
    """ValueError unless the optimizer's clip and ``clip_grad_norm_(model.parameters())`` take
    the parameters that have gradients in the same order (so their norms have the same bits)."""
    if not clip_follows(opt, model.parameters()):
        raise ValueError(
            "CotangentTrainer: the Trainer clips clip_grad_norm_(model.parameters()), but the "
            "optimizer's clip order lists the parameters with gradients differently (param "
            "groups in another order, or parameters outside the optimizer): build "
            "cotangent.AdamW(..., clip_order=model)")


class CotangentTrainer(CotangentTrainerMixin, Trainer):
    """`transformers.Trainer` whose clip and logged ``grad_norm`` come from
    `cotangent.AdamW.clip_grad_norm_()` (see `CotangentTrainerMixin`)."""

