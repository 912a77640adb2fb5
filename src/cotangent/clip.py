"""Clipping: `cotangent.clip_grad_norm_`, a drop-in for `torch.nn.utils.clip_grad_norm_` with
batched norms, and the clip of a `cotangent.AdamW` step (`clip_norm`, `fold_rule`).

Same signature, return value, warnings and errors as the native function (torch 2.4-2.13,
torch/nn/utils/clip_grad.py). Gradients that already sit as equally spaced, equal-length,
contiguous rows of one storage (for example the flat gradient buffer of a `cotangent.AdamW`) are
reduced with one 2-D norm per run wherever `cotangent.norms.bucket_norm_is_exact` has proven that
call bitwise equal to native per-tensor norms; every other gradient takes the native per-tensor
call. The clip multiply is native's (`_foreach_mul_` / `mul_`), skipped on CPU when the
coefficient is exactly 1.0 (x * 1.0 == x bit for bit, and reading a CPU scalar costs no sync).

A `cotangent.AdamW` step clips with `clip_norm` (the same total norm and coefficient, from one
C call of per-tensor norms where its probe proved ATen's bits, reduced across ranks for FSDP2's
DTensor gradients as native's DTensor ops reduce them); `fold_rule` is the one rule for where
its multiply runs: inside a single pass, or natively before the update.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cotangent import _compat, dtensor, sharding, singlepass, tensorlists
from cotangent.norms import (
    bucket_norm_is_exact,
    check_finite,
    clip_coefficient,
    multiply_is_identity,
    native_tensor_norms,
    total_norm,
)

if TYPE_CHECKING:
    from cotangent.adamw import AdamW


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


# ------------------------------------------------------------ the clip of a cotangent.AdamW step

@dataclass(slots=True)
class StepClip:
    """A step's clip: the total norm, the coefficient (0-dim tensors, native's) and its value
    where the single pass may fold the multiply (None: every multiply runs natively)."""

    grads: list[Tensor]  # clip order
    total: Tensor
    coef: Tensor
    value: float | None
    identity: bool  # the multiply by this coefficient changes no gradient (skipped)
    ids: set[int] | None = None  # id() of each gradient, once `covers` needs them

    def covers(self, grads: list[Tensor]) -> bool:
        """Whether every tensor of `grads` is one of this clip's gradients."""
        if grads is self.grads:
            return True
        if self.ids is None:
            self.ids = set(map(id, self.grads))
        return all(map(self.ids.__contains__, map(id, grads)))


def clip_norm(opt: AdamW, grads: list[Tensor], *, fold: bool,
              prepared: singlepass.Prepared | None = None,
              step: singlepass.Step | None = None,
              spread: Tensor | None = None, distinct: bool = False) -> StepClip:
    """`clip_grad_norm_`'s total norm and clip coefficient over `grads`, with `opt`'s
    ``norm_type``, ``max_norm`` and ``error_if_nonfinite`` (raising before anything is
    modified); modifies nothing.

    Its callers have refused, before it, every gradient native's multiply would raise on
    (`refuse_unmultipliable`), so a multiply by exactly 1.0 may be skipped for any of them.

    Args:
        grads: the clip order's gradients (plain tensors; FSDP2: their local shards).
        fold: the single pass may do the multiply (no GradScaler state): the coefficient's
            value is read where it is a CPU float that is not NaN.
        prepared: a call's checked lists whose gradients are `grads`
            (`cotangent.update.prepare_early`): the norms read the addresses from it.
        step: this step's `singlepass.Step` (its team asked once per step); default a new one.
        spread: `grads` are the local shards of DTensor gradients placed as this one
            (`dtensor.clip_mesh_gradient`): the stack of their norms becomes the DTensor
            native's stack is (`dtensor.spread_stack`), so that the total norm (the DTensor
            native's clip returns) and the coefficient reduce across ranks in DTensor's own
            code (a collective); the multiply uses the coefficient's replicated local value.
        distinct: the caller knows `grads` holds no tensor twice (else it is counted here: a
            gradient listed twice is multiplied twice, natively).
    """
    norm_type = opt.norm_type
    shares = opt._shares
    step = step or singlepass.Step()
    across = None if spread is None else (
        lambda stacked: dtensor.spread_stack(stacked, spread, norm_type))
    total = coef = value = None
    if shares is not None and shares.zero.norms == "share":
        share_of = {id(p.grad): s for p, s in zip(shares.params, shares.shares)
                    if p.grad is not None}
        total = sharding.share_total_norm(
            grads, [share_of.get(id(g), -1) for g in grads], shares.zero, norm_type,
            lambda part: tensor_norms(part, norm_type, step))
    elif norm_type == 2.0 and (norms := kernel_norms(grads, prepared, step)) is not None:
        # every per-tensor norm in one C call, with ATen's bits (proven by its probe, which
        # also proves the total norm and coefficient of `singlepass.clip_scalars`)
        if across is None:
            total, coef, value = singlepass.clip_scalars(norms, opt.max_norm)
        else:
            total = total_norm(norms, norm_type, across)
    elif opt.batched_norms and spread is None and all(
            g.device.type == "cpu" for g in grads[:1]) and not _compat.torch_modes_active():
        # (on CUDA a (B, K) row norm and `_foreach_norm` reduce in other trees: issue 29;
        # no batched-norm probe runs there until a measurement shows it can win; under a
        # torch mode the mode sees native's per-tensor norms, below)
        total = get_total_norm(grads, norm_type)
    else:
        norms = []
        first = grads[0].device if grads else None
        for _, _, idx in _compat.group_by_device_and_dtype(grads):
            part = native_tensor_norms([grads[i] for i in idx], norm_type, None)
            norms.extend(n.to(first) for n in part)
        total = total_norm(torch.stack(norms) if norms else [], norm_type, across)
    if opt.error_if_nonfinite:
        check_finite(total, norm_type)
    if coef is None:
        # a total replicated on every rank (a DTensor's reduced p-norm): its coefficient's ops
        # are local ops on every rank, run here on the local value (bits as DTensor's, without
        # its dispatch per op); a partial one (inf's maxima) reduces in DTensor's own code
        coef = dtensor.replicated_local(clip_coefficient(
            dtensor.local(total) if dtensor.replicated(total) else total, opt.max_norm))
        # (switched off or under a torch mode: native's ops only, no read of the value; the
        # multiply then runs, by 1.0 too, as native's does)
        value = coef.item() if coef.device.type == "cpu" and step.off() is None else None
    # (a gradient native's multiply raises on, by 1.0 too, was refused before this clip:
    # `refuse_unmultipliable`)
    identity = value is not None and multiply_is_identity(coef, norm_type, step.flushing(), value)
    if not (fold and not identity and value is not None and value == value
            and step.off() is None
            and (distinct or len(set(map(id, grads))) == len(grads))):
        value = None  # (a gradient listed twice: native multiplies it twice; a NaN
    return StepClip(grads, total, coef, value, identity)  # coefficient: natively, see singlepass


def kernel_norms(grads: list[Tensor], prepared: singlepass.Prepared | None,
                 step: singlepass.Step) -> Tensor | None:
    """The 2-norm of each of `grads` from one C call (`singlepass.gradient_norms` of
    `prepared`, whose gradients they are, or `singlepass.tensor_norms`), where the norm probe
    proves them ATen's bits for this step's team (`singlepass.norms_proven`); else None (the
    caller computes them natively). A float32 tensor of shape (len(grads),)."""
    if step.off() is not None or (prepared is None and not plain_cpu_float32(grads)):
        return None
    norms = (singlepass.tensor_norms(grads) if prepared is None
             else step.gradient_norms(prepared))  # (no side effects: unused unless proven)
    return norms if singlepass.norms_proven(step.team, step) else None


def tensor_norms(grads: list[Tensor], norm_type: float,
                 step: singlepass.Step | None = None) -> list[Tensor]:
    """Native's per-tensor norms of `grads` (one device and dtype), from one C call where
    its probe proved ATen's bits."""
    norms = kernel_norms(grads, None, step or singlepass.Step()) if norm_type == 2.0 else None
    return list(norms) if norms is not None else native_tensor_norms(grads, norm_type, None)


def fold_rule(cut: StepClip | None, dtype: torch.dtype, grads: list[Tensor]) -> bool:
    """The one rule for where the clip multiply runs: inside a call's single pass when this step
    clips with a coefficient the pass may use (`StepClip.value`: a CPU float32 coefficient, not
    NaN, not an identity multiply, each gradient listed once, no GradScaler state, no step
    pre-hook between the clip and the update), the call is float32 (bfloat16's multiply is not
    reproduced) and every gradient of the call is clipped (a parameter outside the clip order
    is updated unclipped); everywhere else natively, before the update, as `clip_grad_norm_`
    does. (`cotangent.update.memory_disjoint` must also hold for the whole step.)"""
    return (cut is not None and cut.value is not None and dtype == torch.float32
            and cut.covers(grads))


@dataclass(slots=True)
class SeenGradients:
    """The gradients a clip saw, in order, none kept alive (a gradient is freed by
    ``zero_grad()`` as with native code): `cotangent.tensorlists.gradient_set`'s record where
    it is compiled (`_set`, which the replayed step makes in C++), else weak references
    (`_refs`; the same answers). Made by `seen_gradients`."""

    _set: object | None
    _refs: list | None = None

    def same(self, grads: list[Tensor]) -> bool:
        """Whether `grads` are these gradients: the same tensors, in order."""
        if self._set is not None:
            return self._set.same(grads)
        return len(self._refs) == len(grads) and all(
            a is b() for a, b in zip(grads, self._refs))

    def cover(self, params: list[Tensor]) -> bool:
        """Whether the ``.grad`` of every one of `params` that has one (a DTensor's: its local
        shard) is one of these gradients."""
        if self._set is not None:
            answer = -1 if _compat.torch_modes_active() else self._set.covers(params)
            if answer >= 0:
                return bool(answer)
            holds = self._set.holds
        else:
            ids = {id(g) for ref in self._refs if (g := ref()) is not None}  # (live: unique)
            holds = lambda t: id(t) in ids  # noqa: E731
        return all(holds(dtensor.local(g)) for p in params if (g := p.grad) is not None)


@dataclass(slots=True)
class ClipRecord:
    """The last clip of an optimizer (`record_clip`)."""

    total: Tensor  # its total norm
    grads: SeenGradients  # the gradients it clipped
    apart: bool  # run apart from a step, not yet used up by one (`clipped_already`)


def record_clip(opt: AdamW, total: Tensor, grads: list[Tensor], *, apart: bool) -> None:
    """Remember the clip on `opt`: its total norm and which gradients it clipped
    (`SeenGradients`). `apart`: a clip run apart from the update (`AdamW.clip_grad_norm_()`,
    or before step pre-hooks), which the next `step()` must not repeat (`clipped_already`); a
    step's own clip is never skipped by the next step (native's loop clips at every step, even
    on unchanged gradients)."""
    opt._last_clip = ClipRecord(total, seen_gradients(grads), apart)


def seen_gradients(grads: list[Tensor]) -> SeenGradients:
    """`grads` as a `SeenGradients` record (compiled where `tensorlists.gradient_set` is)."""
    make = tensorlists.gradient_set()
    if make is not None:
        return SeenGradients(make(grads))
    return SeenGradients(None, list(map(weakref.ref, grads)))


def step_done(opt: AdamW) -> None:
    """A step has run: a clip apart from it was used up (the next step clips again)."""
    if opt._last_clip is not None:
        opt._last_clip.apart = False


def clipped_already(opt: AdamW, grads: list[Tensor]) -> bool:
    """Whether a clip apart from the update (`record_clip`) clipped exactly `grads` (the same
    tensors, in order) since the last step: then native's loop (``clip_grad_norm_(...)``, then
    ``step()``) does not clip again, whatever was written into them in between (an in-place
    edit or an accumulating backward: native's step does not clip those either)."""
    last = opt._last_clip
    return last is not None and last.apart and last.grads.same(grads)


def refuse_unmultipliable(opt: AdamW, grads: list[Tensor]) -> None:
    """Raise before anything is modified where native's clip multiply (``g.mul_(coef)``, by
    1.0 too) raises on a gradient: one that overlaps itself (an expanded tensor) or an
    inference tensor (written in place outside inference mode).

    Raises:
        RuntimeError: naming the parameter, with native's reason.
    """
    if all(map(Tensor.is_contiguous, grads)) and not any(map(Tensor.is_inference, grads)):
        return  # (a contiguous tensor does not overlap itself)
    from cotangent import gather

    for g in grads:
        if g.is_inference():
            reason = ("is an inference tensor: native's clip multiply raises (an in-place "
                      "update to an inference tensor outside InferenceMode is not allowed)")
        elif not g.is_contiguous() and _compat.has_internal_overlap(g):
            reason = ("overlaps itself (an expanded tensor?): native's clip multiply raises "
                      "(more than one element of the written-to tensor refers to a single "
                      "memory location); give it memory of its own, e.g. .contiguous()")
        else:
            continue
        owner = next((p for p in gather.clip_order(opt) if p.grad is g
                      or dtensor.local(p.grad) is g), None)
        name = "a gradient" if owner is None else f"the gradient of {gather.describe(opt, owner)}"
        raise RuntimeError(f"{name} {reason}; cotangent.AdamW refuses it before anything "
                           "is modified")


def plain_cpu_float32(grads: list[Tensor]) -> bool:
    """Whether `grads` are all contiguous float32 CPU tensors (no subclasses; no negative-bit
    view, whose memory holds the negated values; no ZeroTensor, which has none), at least
    one."""
    return bool(grads) and all(type(g) is Tensor and g.dtype is torch.float32 and g.is_cpu
                               and g.is_contiguous() and not g.is_neg()
                               and not _compat.is_zerotensor(g) for g in grads)


