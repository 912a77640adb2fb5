"""Gradient clipping over packed gradients, bitwise equal to `torch.nn.utils.clip_grad_norm_`.

`PackedClipper` computes the per-tensor norms of a flat gradient buffer with one norm program
per buffer (`cotangent.norms`: a 2-D row norm per calibrated bucket of equal-length gradients,
one native per-tensor call for the rest), puts them in native order (clip order, grouped by
(device, dtype) as native groups them), takes the total and the clip coefficient with native's
op sequence, and multiplies: once over the whole flat buffer where `flat_multiply_is_exact`
proved that equal to native's per-gradient multiplies, per gradient view otherwise.

Gradients that cannot sit in the buffer for this step (`tracking.Gradients.foreign`: strides
other than the parameter's) are clipped where they are, by `clip_actual_tensors`, which calls
this library's drop-ins for the native functions on the actual tensors.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import Tensor

from cotangent import _compat
from cotangent.clip import get_total_norm, scale_grads_
from cotangent.norms import (
    calibrate_layout,
    check_finite,
    clip_coefficient,
    flat_multiply_is_exact,
    multiply_is_identity,
    norm_program,
    run_norm_program,
    total_norm,
)
from cotangent.store import FlatStore
from cotangent.tracking import Gradients


class PackedClipper:
    """Calibrated norm programs and multiply verdicts for the gradient buffers of a store.

    Args:
        store: the flat store whose gradients are clipped.
        norm_type: p of the global p-norm.
        batched_norms: use calibrated batched norms; False computes every per-tensor norm with
            the native call (the "packing-only" cell of the factorial experiment).
    """

    def __init__(self, store: FlatStore, norm_type: float, batched_norms: bool) -> None:
        self.store = store
        self.norm_type = norm_type
        self.batched_norms = batched_norms
        self.calibrate()

    def calibrate(self) -> None:
        """Run (or look up) the probes for this thread count and plan the norm calls."""
        self.multiply_exact: dict[tuple, bool] = {}
        for layout in self.store.layouts:
            if self.batched_norms:
                calibrate_layout(layout, self.norm_type, None)
            else:
                for bucket in layout.buckets:
                    bucket.batched = False
        self.programs = [norm_program(layout, flat)
                         for layout, flat in zip(self.store.layouts, self.store.flat_grads)]

    def groups(self, present: tuple[int, ...], clip_order: list[int]) -> list:
        """Native (device, dtype) groups of the present gradients in clip order: per group, its
        layout, the positions of its norms in that layout's norm vector (None when they are the
        whole vector in order), its slots, and whether the layout's every present gradient is
        in the clip (so that one multiply over the whole buffer may stand for native's)."""
        present_set = set(present)
        ordered = [s for s in clip_order if s in present_set]
        grads = [self.store.grad_views[s] for s in ordered]
        groups = []
        for _, _, indices in (_compat.group_by_device_and_dtype(grads) if grads else []):
            slots = [ordered[i] for i in indices]
            li = self.store.where[slots[0]][0]
            segments = self.store.layouts[li].segments
            out_pos = {segments[pos].slot: i for i, pos in enumerate(self.programs[li].order)}
            order = [out_pos[s] for s in slots]
            index = None if order == list(range(len(out_pos))) else torch.tensor(
                order, device=self.store.layouts[li].device)
            # one multiply over the buffer stands for native's only if it multiplies each present
            # gradient exactly once: all of them are clipped, none twice (a parameter listed
            # twice in clip_order is multiplied twice by native)
            whole = ({s for s in present if self.store.where[s][0] == li} <= set(slots)
                     and len(set(slots)) == len(slots))
            groups.append((li, index, slots, whole))
        return groups

    def total_norm(self, groups: list) -> Tensor:
        """The total norm of the gradients of `groups`, as `clip_grad_norm_` returns it."""
        if not groups:
            return torch.tensor(0.0)
        norms: dict[int, Tensor] = {}
        parts = []
        for li, index, _, _ in groups:
            if li not in norms:
                norms[li] = run_norm_program(self.programs[li], self.norm_type, None)
            parts.append(norms[li] if index is None else norms[li].index_select(0, index))
        if len(parts) == 1:  # one (device, dtype): the stacked norms are this vector
            return total_norm(parts[0], self.norm_type)
        first_device = self.store.grad_views[groups[0][2][0]].device
        return total_norm([part.to(first_device) for part in parts], self.norm_type)

    def scale(self, groups: list, coef: Tensor, skip=()) -> None:
        """Multiply the gradients of `groups` by `coef` in place, as native clipping does,
        except those of the layouts in `skip` (their multiply is left to the caller)."""
        for li, _, slots, whole in groups:
            if li in skip:
                continue
            layout = self.store.layouts[li]
            coef_dev = coef.to(layout.device)
            if coef_dev.device.type == "cpu":
                value = coef_dev.item()  # a CPU scalar: reading it costs no device sync
                if multiply_is_identity(coef_dev, self.norm_type):
                    continue  # x * 1.0 == x bit for bit here (see multiply_is_identity)
                classes = ("finite",) if math.isfinite(value) else ("nonfinite",)
            else:  # no sync on accelerators: the verdict must hold for every coefficient
                classes = ("finite", "nonfinite")
            exact = whole and all(self._multiply_exact(li, coef_dev.dtype, c) for c in classes)
            if exact:
                # absent gradients' views are multiplied too: nothing reads them before a
                # backward's fresh gradient is copied over them, or zero_grad refills them
                self.store.flat_grads[li].mul_(coef_dev)
            else:
                _compat.foreach_mul_([self.store.grad_views[s] for s in slots], coef_dev)

    def _multiply_exact(self, li: int, coef_dtype: torch.dtype, coef_class: str) -> bool:
        key = (li, coef_dtype, coef_class)
        if key not in self.multiply_exact:  # probe once per buffer, coefficient dtype and class
            layout = self.store.layouts[li]
            self.multiply_exact[key] = flat_multiply_is_exact(
                layout.device, layout.dtype, coef_dtype, finite=coef_class == "finite")
        return self.multiply_exact[key]

    def clip(self, groups: list, max_norm: float, error_if_nonfinite: bool,
             defer=None) -> Tensor:
        """`clip_grad_norm_` over the packed gradients of `groups`; returns the total norm.
        `defer`: None, or a function (groups, clip coefficient) -> the layouts whose multiply
        the caller takes over (it runs later, still before anything reads those gradients).

        Raises:
            RuntimeError: the total is inf or NaN and `error_if_nonfinite` (nothing modified).
        """
        total = self.total_norm(groups)
        if error_if_nonfinite:
            check_finite(total, self.norm_type)
        coef = clip_coefficient(total, max_norm)
        self.scale(groups, coef, skip=defer(groups, coef) if defer is not None else ())
        return total


def clip_actual_tensors(grads: list[Tensor], max_norm: float, norm_type: float,
                        error_if_nonfinite: bool) -> Tensor:
    """`clip_grad_norm_` over `grads` (in clip order) exactly where they are: native per-tensor
    norms (batched only where `cotangent.clip` proves it), native multiplies. Returns the total.

    Raises:
        RuntimeError: as `torch.nn.utils.clip_grad_norm_` (non-finite total with
            `error_if_nonfinite`, or a gradient native norms reject, e.g. an expanded one).
    """
    total = get_total_norm(grads, norm_type, error_if_nonfinite)
    scale_grads_(grads, max_norm, total)
    return total


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

    def tensors_if_outside(self, grads: Gradients, store: FlatStore) -> list[Tensor] | None:
        """The gradients to clip, in clip order, when some are not in the flat buffer (foreign
        strides, or parameters outside the optimizer); None when all are."""
        if not grads.foreign and not any(p.grad is not None for p in self.outsiders):
            return None
        present = set(grads.present)
        return [q.grad if s is None else grads.tensor(store, s) for s, q in self.sequence
                if (q.grad is not None if s is None else s in present)]
