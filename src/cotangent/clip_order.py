"""The clip order: which gradients a clip covers, and in which order, as `clip_grad_norm_` sees
them.

`torch.nn.utils.clip_grad_norm_(params, ...)` norms the gradients of the tensors it is given, in
that order (grouped by device and dtype); an optimizer that clips for the user must norm the same
tensors in the same order. `clip_order` names them: the optimizer's own param groups
(``"param_groups"``), a module (its ``parameters()`` at each step), a zero-argument callable, or a
list. `ClipOrder` resolves it at each step and notices when it changed.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from cotangent import _compat


PARAM_GROUPS = "param_groups"  # clip_order naming the optimizer's own order


def normalize_clip_order(clip_order):
    """`clip_order` as the optimizers and `ReferenceUpdate` keep it: None (not given),
    `PARAM_GROUPS`, a module, a zero-argument callable, or a list snapshot of an iterable of
    tensors (as `clip_grad_norm_` takes one).

    Raises:
        ValueError: a string other than ``"param_groups"``, or an iterable holding something
            that is not a tensor.
    """
    if clip_order is None or isinstance(clip_order, torch.nn.Module) or (
            callable(clip_order) and not isinstance(clip_order, Tensor)):
        return clip_order
    if isinstance(clip_order, str):
        if clip_order != PARAM_GROUPS:
            raise ValueError(f"clip_order must be a module, a zero-argument callable, an "
                             f"iterable of parameters or {PARAM_GROUPS!r}, got {clip_order!r}")
        return clip_order
    if isinstance(clip_order, Tensor):
        return [clip_order]
    try:
        order = list(clip_order)
    except TypeError:
        raise ValueError(f"clip_order must be a module, a zero-argument callable, an iterable "
                         f"of parameters or {PARAM_GROUPS!r}, got "
                         f"{type(clip_order).__name__!r}") from None
    return checked_tensors(order, "clip_order")


def checked_tensors(order: list, what: str) -> list[Tensor]:
    """`order` itself when it holds tensors only.

    Raises:
        ValueError: an element that is not a tensor (e.g. a (name, parameter) pair from
            ``named_parameters``), named with `what`.
    """
    for t in order:
        if not isinstance(t, Tensor):
            raise ValueError(f"{what} holds {type(t).__name__!r}, not a tensor "
                             "(named_parameters? pass parameters)")
    return order


def check_clip_order_known(param_groups: list[dict], max_norm, clip_order) -> None:
    """The clip-order rule of every Cotangent optimizer that clips: its order must be known.

    The bits of the total norm depend on the order in which `clip_grad_norm_` meets the
    gradients. With one param group (holding parameters) the optimizer's order is the list the
    user built it from, taken to be the list the native loop clips (where it is not, e.g. a
    subset while the loop clips the whole model, nothing here can tell: `cotangent.verify`
    reports it). With two or more, native loops differ: most clip ``clip_grad_norm_(model.parameters(), ...)`` (model order: PyTorch
    examples, Hugging Face's Trainer, Accelerate), some clip the optimizer's parameters
    (Lightning's ``gradient_clip_val``), and the optimizer cannot see the model to tell whether
    the two agree. So there ``clip_order`` must say which: ``clip_order=model`` (or what you
    pass to `clip_grad_norm_`) or ``clip_order="param_groups"``.

    Args:
        param_groups: the optimizer's param groups (dicts with a ``"params"`` list).
        max_norm: the optimizer's clipping threshold (None: no clip, nothing to check).
        clip_order: the normalized `clip_order` (`normalize_clip_order`).
    Raises:
        ValueError: `max_norm` is set, `clip_order` is None and two or more param groups hold
            parameters.
    """
    if max_norm is None or clip_order is not None:
        return
    holding = sum(1 for g in param_groups if g["params"])
    if holding >= 2:
        raise ValueError(
            f"max_norm is set and the {holding} param groups make the clip order ambiguous: "
            "the total norm's bits depend on the order clip_grad_norm_ meets the gradients. "
            "Pass clip_order=model if your native loop calls "
            "clip_grad_norm_(model.parameters(), ...) (or clip_order=<what you pass to "
            "clip_grad_norm_>), or clip_order='param_groups' if it clips the optimizer's "
            "parameters in param-group order (as Lightning's gradient_clip_val does)")


def check_not_sharded_by_zero(max_norm, clip_order) -> None:
    """The clip-order rule inside `torch.distributed.optim.ZeroRedundancyOptimizer`, called
    from an optimizer's constructor: each rank's optimizer there holds one shard of the
    parameters, so a clip over its own param groups would norm that shard alone.

    Raises:
        ValueError: `max_norm` set with `clip_order` None or ``"param_groups"`` while a
            ZeroRedundancyOptimizer builds the optimizer.
    """
    if (max_norm is not None and clip_order in (None, PARAM_GROUPS)
            and _compat.built_by_zero_redundancy_optimizer()):
        raise ValueError(
            "cotangent.AdamW(max_norm=...) inside ZeroRedundancyOptimizer: each rank's "
            "optimizer holds one shard of the parameters (its param groups are the shard's), "
            "so a clip over them would norm that shard alone, where native code clips "
            "clip_grad_norm_(model.parameters(), ...) on every rank; pass clip_order=model "
            "(every rank then clips every gradient), or max_norm=None and clip natively "
            "before ZeroRedundancyOptimizer.step()")


class ClipOrder:
    """What the clip covers, in which order: `clip_grad_norm_`'s parameter list.

    `source` is a module (its ``parameters()`` read at every clip, as a loop calling
    ``clip_grad_norm_(model.parameters(), ...)`` reads them), a zero-argument callable, a fixed
    list, or None / ``"param_groups"`` (the optimizer's parameters in param-group order). As
    with native code, optimizer parameters missing from it are updated unclipped, and
    parameters in it that the optimizer does not hold are clipped too (where their gradients
    are).
    """

    def __init__(self, source, params: list[Tensor]) -> None:
        self.source = None if isinstance(source, str) else source
        self.resolve(params)

    @property
    def live(self) -> bool:
        """Whether the source is read afresh at every clip (a module or a callable)."""
        return isinstance(self.source, torch.nn.Module) or callable(self.source)

    def current(self) -> list[Tensor] | None:
        """The source's parameters now (None: the optimizer's order).

        Raises:
            ValueError: a callable source returned something other than tensors.
        """
        return None if self.source is None else self.read(self.source)

    @staticmethod
    def read(source) -> list[Tensor]:
        """The parameters of a normalized `clip_order` source now: a module's
        ``parameters()``, a callable's result, or the list itself.

        Raises:
            ValueError: a callable source returned something other than tensors.
        """
        if isinstance(source, torch.nn.Module):
            return list(source.parameters())
        if callable(source):
            try:
                order = list(source())
            except TypeError:
                raise ValueError("clip_order() must return an iterable of parameters") from None
            return checked_tensors(order, "clip_order()")
        return source

    def resolve(self, params: list[Tensor], order: list[Tensor] | None = None) -> None:
        """Map the order onto `params` (the optimizer's slots): `slots` in clip order, and
        `sequence` = (slot or None for an outside parameter, parameter) in clip order."""
        order = self.current() if order is None else order
        slot_of = {id(p): slot for slot, p in enumerate(params)}
        self.seen = order
        self.sequence = (list(enumerate(params)) if order is None
                         else [(slot_of.get(id(p)), p) for p in order])
        self.slots = [s for s, _ in self.sequence if s is not None]
        self.outsiders = [p for s, p in self.sequence if s is None]

    def refresh(self, params: list[Tensor]) -> bool:
        """Re-read a live source; returns whether the order changed (plans must be rebuilt)."""
        if not self.live:
            return False
        order = self.current()
        if len(order) == len(self.seen) and all(map(operator.is_, order, self.seen)):
            return False
        self.resolve(params, order)
        return True
