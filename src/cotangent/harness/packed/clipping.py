"""Gradient clipping over the packed design's gradient buffers, bitwise equal to `torch.nn.utils.clip_grad_norm_`.

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

import torch
from torch import Tensor

from cotangent import _compat
from cotangent.clip import get_total_norm, scale_grads_
from cotangent.clip_order import ClipOrder
from cotangent.harness.packed.norms import calibrate_layout, norm_program, run_norm_program
from cotangent.harness.packed.store import FlatStore
from cotangent.harness.packed.tracking import Gradients
from cotangent.norms import (check_finite, clip_coefficient, flat_multiply_is_exact,
                             multiply_is_identity, total_norm)


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


def tensors_if_outside(order: ClipOrder, grads: Gradients, store: FlatStore) -> list[Tensor] | None:
    """The gradients to clip, in clip order, when some are not in the flat buffer (foreign
    strides, or parameters outside the optimizer); None when all are."""
    if not grads.foreign and not any(p.grad is not None for p in order.outsiders):
        return None
    present = set(grads.present)
    return [q.grad if s is None else grads.tensor(store, s) for s, q in order.sequence
            if (q.grad is not None if s is None else s in present)]
