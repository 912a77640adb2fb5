"""Gradient tracking: which parameters received a gradient since `zero_grad`, and where it is.

Native AdamW updates exactly the parameters whose ``.grad`` is not None. With packed gradients
``.grad`` is a view of the flat gradient buffer once a backward has delivered a gradient. Outside
torch.distributed `zero_grad` sets ``.grad`` to None, as native, and the hooks copy each fresh
gradient autograd stores into its view (`GradientTracker.can_copy_in`); later backwards
accumulate into the view, as native accumulates into its ``.grad``. In a process group
`zero_grad` instead fills the buffer with -0.0, the identity of floating-point addition, and
leaves the views as ``.grad``, so that a backward's in-place accumulation reproduces a freshly
allocated gradient byte for byte. The hooks:

- a post-accumulate-grad hook per trainable parameter (a gradient arrived in ``.grad``;
  `torch.autograd.grad` does not trigger it): copies a large fresh gradient in at once;
- a tensor hook seeing each incoming gradient (to notice sparse ones, and whether ``.grad`` is
  None just before: then autograd stores a fresh tensor);
- an end-of-backward callback that copies the small fresh gradients in, in one call, and sets
  ``.grad`` back to None for views that received nothing, as native code would show them.

`GradientTracker.scan` then lists the present gradients for `step()`: the usual case is a
comparison of a few lists; anything unusual (a gradient assigned from outside, written in place
without a backward, a replaced view storage, a sparse gradient) takes the careful path.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cotangent import _compat, calibration
from cotangent.calibration import sprinkle_special_values
from cotangent.harness.packed.store import FlatStore, same_strides
from cotangent.state import describe

_GRAD = operator.attrgetter("grad")
# Fresh gradients of at least this many elements are copied into the flat buffer in their own
# post-accumulate-grad hook (freed at once); smaller ones together at the end of the backward
# (one call instead of one per tensor). Measured on a 2-core AVX2 EPYC VM, 146 tensors of 4096
# elements, backward time over native's: 16-20 us per tensor with a copy in each hook, 12-16 us
# batched, 6-11 us with the former -0.0 prefill and accumulation.
COPY_NOW_MIN = 1 << 16


@dataclass(slots=True)
class Gradients:
    """The gradients a step sees."""

    present: tuple[int, ...]  # slots with a gradient, in slot order
    # gradients that are not the slot's buffer view and cannot be copied into it without
    # changing bits (their strides differ from the parameter's): used where they are
    foreign: dict[int, Tensor] = field(default_factory=dict)
    views_replaced: bool = False  # a view object was renewed (`p.grad.data = ...`)
    # gradient tensors from outside the buffer whose values were copied into it this step
    # (native would clip them in place: their version counters are bumped by the clip)
    adopted: list[Tensor] = field(default_factory=list)

    def tensor(self, store: FlatStore, slot: int) -> Tensor:
        """The gradient of `slot` as native code would see it."""
        return self.foreign.get(slot, store.grad_views[slot])


def _untouched(grad: Tensor) -> bool:
    """True when every element of `grad` is -0.0, the fill `zero_grad()` leaves."""
    return bool(torch.signbit(grad).all()) and not bool(grad.any())


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()


class GradientTracker:
    """Hooks and flags for the gradients of one `FlatStore`.

    Attributes:
        backwards: number of backward passes that delivered a gradient to a tracked parameter.
        resets: number of `zero_grad` calls. Together they tell the optimizer whether a clip or a
            norm it computed still refers to the current gradients.
    """

    def __init__(self, store: FlatStore, backwards: int = 0, resets: int = 0) -> None:
        self.store = store
        n = len(store.params)
        self.tracked = [p.requires_grad for p in store.params]  # hooked at construction
        self.has_grad = [False] * n  # a gradient arrived in the view since the last zero_grad
        self.sparse = [False] * n
        self.fresh = [False] * n  # autograd is storing a fresh `.grad` (see `can_copy_in`)
        self.pending: list[tuple[int, Tensor]] = []  # small fresh gradients to copy in
        self.big = [p.numel() >= COPY_NOW_MIN for p in store.params]  # copied in at once
        self.copy_in = True  # this backward copies fresh gradients in (not distributed)
        self.task: int | None = None  # the autograd graph task of the last backward seen
        self.callback_queued = False
        self.backwards = backwards
        self.resets = resets
        self.all_slots = tuple(range(n))
        # the memory a fresh gradient must not share to be copied in (`can_copy_in`); packed
        # parameters have storages of their own over the flat buffers' memory, so compare memory
        self.buffer_spans = [_span(t) for t in store.flat_grads + store.flat_params + [
            store.params[s] for s in store.detached] if t.numel()]
        # slots whose dtype keeps a gradient's bits when accumulated into -0.0: zero_grad
        # points their .grad at the buffer; the others get None, as native, and a fresh tensor
        self.prefilled = [accumulate_into_negative_zero_is_exact(
            store.layouts[store.where[s][0]].device, store.layouts[store.where[s][0]].dtype)
            for s in self.all_slots]
        # Under torch.distributed: None until a step has shown whether gradients arrive as
        # DistributedDataParallel's bucket views (then prefilling is never safe) or not.
        self.prefill_in_process_group: bool | None = None
        self._install_hooks()

    def _install_hooks(self) -> None:
        ref = weakref.ref(self)

        def end_of_backward() -> None:
            tracker = ref()
            if tracker is None:
                return
            tracker.callback_queued = False
            if tracker.pending:
                tracker.copy_in_pending()
            views = tracker.store.grad_views
            for slot, p in enumerate(tracker.store.params):
                if tracker.tracked[slot] and not tracker.has_grad[slot] and p.grad is views[slot]:
                    p.grad = None

        def make_hooks(slot: int):
            def accumulated(p: Tensor) -> None:
                if torch.compiler.is_compiling():  # traced by compiled autograd: run eagerly
                    return accumulated_eagerly(p)
                tracker = ref()
                if tracker is None:
                    return
                tracker.has_grad[slot] = True
                # the first gradient of this backward: by graph task where torch tells it (a
                # backward that raised never ran its callback; the next one queues its own)
                task = _compat.graph_task_id()
                if not tracker.callback_queued if task is None else task != tracker.task:
                    tracker.callback_queued, tracker.task = True, task
                    tracker.backwards += 1
                    tracker.copy_in = not _distributed()
                    _compat.queue_backward_callback(end_of_backward)
                # autograd has just made `.grad`; another post-accumulate-grad hook may hold
                # that tensor (native's live gradient): then it stays `.grad`
                if (tracker.fresh[slot] and tracker.copy_in
                        and _compat.post_accumulate_grad_hook_count(p) == 1):
                    tracker.fresh[slot] = False
                    g = p.grad
                    if not tracker.big[slot]:  # copied with the others at the end
                        tracker.pending.append((slot, g))
                    elif tracker.can_copy_in(g, p):
                        view = tracker.store.grad_views[slot]
                        view.copy_(g)  # the same bytes; autograd's fresh tensor is freed
                        p.grad = view

            def incoming(grad: Tensor) -> None:
                if torch.compiler.is_compiling():
                    return incoming_eagerly(grad)
                tracker = ref()
                if tracker is None:
                    return
                if grad.layout is not torch.strided:
                    tracker.sparse[slot] = True
                # None now: autograd is about to store a fresh tensor (its own or a clone of
                # `grad`) as `.grad`; anything else it accumulates into where it is
                tracker.fresh[slot] = tracker.store.params[slot].grad is None

            # Compiled autograd (not fullgraph) traces these hooks with dynamo, which cannot
            # queue the end-of-backward callback, ask torch for the graph task or keep the
            # tracker's bookkeeping as written; the disabled twins graph-break and run the same
            # code eagerly (`is_compiling()` is False there). Eager backwards pay one
            # `is_compiling()` call per hook instead of the disable wrapper's cost.
            accumulated_eagerly = torch.compiler.disable(accumulated)
            incoming_eagerly = torch.compiler.disable(incoming)
            return accumulated, incoming

        handles = []
        for slot, p in enumerate(self.store.params):
            if p.requires_grad:
                accumulated, incoming = make_hooks(slot)
                handles.append(p.register_post_accumulate_grad_hook(accumulated))
                handles.append(p.register_hook(incoming))
        self._finalizer = weakref.finalize(self, _remove_handles, handles)

    def can_copy_in(self, g: Tensor | None, p: Tensor) -> bool:
        """Whether the fresh gradient `g` that a backward has just stored as ``p.grad`` can be
        copied into its buffer view, the view then becoming ``.grad``: during the backward for
        gradients of `COPY_NOW_MIN` elements or more (the fresh tensor is freed at once), at its
        end for the smaller ones, all in one `torch._foreach_copy_` (`copy_in_pending`).

        Bits are unchanged (a copy between tensors of the same dtype, shape and strides), and
        no one else holds the fresh tensor: autograd stores either the incoming gradient
        itself, when nothing else refers to it, or a clone. This replaces accumulating into a
        -0.0 prefill (`zero_grad` then writes nothing, and the backward reads one buffer less)
        and takes in dtypes where that accumulation is not exact. Not for: a gradient that
        requires grad (``create_graph=True``: native keeps its graph), sparse or laid out unlike
        its parameter, or sharing memory with the flat buffers; nor for a parameter with
        post-accumulate-grad hooks besides this tracker's (checked by the hook: they see the
        fresh tensor and may keep it as the live gradient; `zero_grad` gives such parameters
        the -0.0 view instead); nor under torch.distributed (checked once per backward:
        DistributedDataParallel's bucket views and copies keep today's prefill there)."""
        return (g is not None and g.layout is torch.strided and not g.requires_grad
                and g.dtype == p.dtype and g.shape == p.shape and g.device == p.device
                and (g.stride() == p.stride() or same_strides(g, p))
                and not self._shares_buffer_memory(g))

    def _shares_buffer_memory(self, g: Tensor) -> bool:
        """Whether `g`'s storage overlaps the flat buffers or a parameter outside them."""
        storage = g.untyped_storage()
        start = storage.data_ptr()
        end = start + storage.nbytes()
        return any(start < b_end and b_start < end for b_start, b_end in self.buffer_spans)

    @torch.no_grad()
    def copy_in_pending(self) -> None:
        """Copy the small fresh gradients the backward left (`can_copy_in`) into their views
        in one call, and make the views ``.grad``; a gradient replaced since is left alone."""
        pending, self.pending = self.pending, []
        params, views = self.store.params, self.store.grad_views
        slots = [slot for slot, g in pending
                 if params[slot].grad is g and self.can_copy_in(g, params[slot])]
        if not slots:
            return
        _compat.foreach_copy_([views[s] for s in slots], [params[s].grad for s in slots])
        for slot in slots:
            params[slot].grad = views[slot]

    def remove_hooks(self) -> None:
        """Remove this tracker's hooks from the parameters (before a repack replaces it)."""
        self._finalizer()

    def has_logical_grad(self, slot: int) -> bool:
        """Whether native code would see a gradient on slot `slot`: not None, and not an
        untouched -0.0 view left by `zero_grad()`."""
        g = self.store.params[slot].grad
        if g is None:
            return False
        if g is not self.store.grad_views[slot] or self.has_grad[slot]:
            return True
        return not _untouched(g)

    def logical_grads(self) -> dict[int, Tensor]:
        """Slot -> gradient, for every slot native code would see a gradient on."""
        return {s: self.store.params[s].grad for s in self.all_slots if self.has_logical_grad(s)}

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool, prefill: bool = True) -> None:
        """`Optimizer.zero_grad` over packed gradients (see `cotangent.AdamW.zero_grad`).

        `prefill` False: every gradient not kept reads None, as native, instead of the -0.0
        view (the optimizers pass it while their ``state`` is empty: code such as
        `torch.distributed.checkpoint`'s optimizer-state initialisation reads "no state and
        every ``.grad`` None" as a fresh optimizer); the next step copies the backward's fresh
        gradients into the buffer.

        Outside torch.distributed every gradient not kept reads None, as native, and the
        backward's fresh gradients are copied into their views as they arrive (`can_copy_in`);
        only a parameter with post-accumulate-grad hooks of its own gets its view filled with
        -0.0 as ``.grad``. In a process group the whole buffer is refilled with -0.0 and the
        views stay ``.grad`` (where `prefill` and the dtype allow), for the backward to
        accumulate into."""
        store = self.store
        keep = set() if set_to_none else {
            s for s in self.all_slots if self.tracked[s] and self.has_logical_grad(s)}
        views = store.grad_views
        n = len(views)
        kept_outside = set()
        # In a process group gradients read None, as native, until a step has shown that they
        # do not arrive as DistributedDataParallel bucket views: with gradient_as_bucket_view
        # DDP hands a globally unused parameter whose gradient is defined a zero bucket view
        # instead of leaving it None (without it, DDP writes into the defined gradients).
        allowed, prefill = prefill, self.prefilled
        distributed = _distributed()
        if not allowed or (not self.prefill_in_process_group and distributed):
            prefill = [False] * n
        elif not distributed:
            # outside a process group only parameters with post-accumulate-grad hooks of their
            # own (which may keep the `.grad` they see) keep the -0.0 view: the others are copied
            # in as their gradients arrive (`can_copy_in`)
            prefill = [pre and _compat.post_accumulate_grad_hook_count(p) > 1
                       for pre, p in zip(prefill, store.params)]
            for slot in (s for s in self.all_slots if prefill[s]):
                views[slot].fill_(-0.0)
        else:
            for flat_g in store.flat_grads:
                flat_g.fill_(-0.0)
        # Only gradients that are not their buffer view need a look (none in the usual step).
        for slot, (p, g, view) in enumerate(zip(store.params, map(_GRAD, store.params), views)):
            if g is view and self.tracked[slot] and (prefill[slot] or slot in keep):
                continue
            if not self.tracked[slot] or (g is not None and slot in keep
                                          and not same_strides(g, p)):
                # a frozen parameter's stray gradient, or one laid out unlike its parameter
                # that native keeps (zeroed in place) and accumulates into: reset as native
                if g is not None:
                    p.grad = None if set_to_none else g.zero_()
                kept_outside.add(slot)
                continue
            if not prefill[slot] and slot not in keep:
                p.grad = None  # native's None: the backward allocates a fresh gradient
                continue
            p.grad = view
        self.has_grad = [False] * n
        self.sparse = [False] * n
        self.fresh = [False] * n
        self.pending = []
        self.callback_queued = False  # in case a failed backward never ran its callback
        for slot in keep - kept_outside:
            views[slot].zero_()
            self.has_grad[slot] = True
        self.resets += 1

    def scan(self) -> Gradients:
        """The gradients of this step; same-layout gradients found outside the buffer are copied
        into it (one copy; native bits are unchanged because views behave as separate tensors).

        Raises:
            RuntimeError: a sparse gradient; a gradient whose shape, dtype or device differs
                from its parameter's; a gradient sharing memory with a parameter.
        """
        store = self.store
        params = store.params
        grads = list(map(_GRAD, params))
        # The usual training step: every gradient is its buffer view, filled by a backward.
        if (all(self.has_grad) and not any(self.sparse)
                and all(map(operator.is_, grads, store.grad_views))
                and list(map(Tensor.data_ptr, grads)) == store.grad_ptrs):
            return Gradients(self.all_slots)
        present, outside, foreign = [], [], {}
        views_replaced = False
        for slot, p in enumerate(params):
            g = grads[slot]
            if g is None:
                continue
            if g is store.grad_views[slot] and g.data_ptr() != store.grad_ptrs[slot]:
                # `p.grad.data = ...` moved our view's storage: a fresh view takes its values,
                # copied in below like any gradient from outside
                store.refresh_grad_view(slot)
                views_replaced = True
            if g is store.grad_views[slot]:
                if not self.has_grad[slot] and not _untouched(g):
                    self.has_grad[slot] = True  # written in place without a backward
                if self.has_grad[slot]:
                    if self.sparse[slot]:
                        raise RuntimeError(
                            f"{describe(slot, p)} received a sparse gradient; Adam does not "
                            "support sparse gradients, please consider SparseAdam instead")
                    present.append(slot)
                continue
            if g.is_sparse or g.layout is not torch.strided:
                raise RuntimeError(
                    f"{describe(slot, p)} received a sparse gradient; Adam does not support "
                    "sparse gradients, please consider SparseAdam instead")
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise RuntimeError(
                    f"{describe(slot, p)}: gradient {tuple(g.shape)} {g.dtype} {g.device} does "
                    f"not match the parameter")
            present.append(slot)
            if same_strides(g, p):
                outside.append(slot)
            else:
                foreign[slot] = g
        if outside and self.prefill_in_process_group is None and _distributed():
            self.prefill_in_process_group = all(grads[s]._base is None for s in outside)
        # A gradient overlapping a parameter's memory: native's step reads it while updating
        # that parameter in place, tensor after tensor, and what it reads depends on that order
        # (refused before anything is modified).
        for slot in _overlapping_parameters(outside + list(foreign), grads, store):
            raise RuntimeError(
                f"{describe(slot, params[slot])}: its gradient shares memory with a parameter "
                f"(native's in-place updates would change it in the middle of the step, in an "
                f"order Cotangent does not reproduce); give it a gradient of its own, e.g. "
                f"p.grad = p.grad.clone()")
        # A gradient sharing memory with another gradient (`e.grad = w.grad`) is clipped and
        # read where it is, as native does: a copy would untie it.
        for slot in _aliased(outside + list(foreign), grads, store):
            if slot in outside:
                outside.remove(slot)
                foreign[slot] = grads[slot]
        adopted = []
        with torch.no_grad():
            for slot in outside:  # validated above; now copy in
                p = params[slot]
                view = store.grad_views[slot]
                if p.grad is not view:
                    view.copy_(p.grad)
                    adopted.append(p.grad)
                    p.grad = view
                self.has_grad[slot] = True
        return Gradients(tuple(present), foreign, views_replaced, adopted)

    @torch.no_grad()
    def take_in(self, slot: int, grad: Tensor) -> None:
        """Copy a (clipped) foreign gradient into the slot's view and make it `.grad`."""
        view = self.store.grad_views[slot]
        view.copy_(grad)
        self.store.params[slot].grad = view
        self.has_grad[slot] = True

    def release_absent(self, present: tuple[int, ...]) -> None:
        """After a step: parameters without a gradient read None, as native leaves them."""
        if len(present) == len(self.all_slots):
            return
        present_set = set(present)
        views = self.store.grad_views
        for slot, p in enumerate(self.store.params):
            if slot not in present_set and p.grad is views[slot]:
                p.grad = None


def gradients_to_carry(old: GradientTracker | None, params: list[Tensor]) -> dict[int, Tensor]:
    """The gradients that exist for `params` (new slot -> tensor) when they are (re)packed: the
    logical gradients of parameters the old tracker knew, `.grad` of the others.

    Raises:
        RuntimeError: a gradient whose shape, dtype or layout differs from its parameter's.
    """
    packed = {id(q): s for s, q in enumerate(old.store.params)} if old is not None else {}
    logical = old.logical_grads() if old is not None else {}
    grads = {}
    for slot, p in enumerate(params):
        g = logical.get(packed[id(p)]) if id(p) in packed else p.grad
        if g is None:
            continue
        if g.shape != p.shape or g.dtype != p.dtype or g.layout is not torch.strided:
            raise RuntimeError(f"{describe(slot, p)}: its gradient {tuple(g.shape)} {g.dtype} "
                               f"{g.layout} does not match it")
        grads[slot] = g
    return grads


def _distributed() -> bool:
    """Whether a torch.distributed process group is active in this process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes `t` can touch: [data_ptr, data_ptr + extent)."""
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlapping_parameters(slots: list[int], grads: list[Tensor],
                            store: FlatStore) -> list[int]:
    """Those of `slots` whose gradient overlaps the memory of a parameter: the flat parameter
    buffers, or a parameter that lives outside them."""
    params = [_span(b) for b in store.flat_params if b.numel()]
    params += [_span(store.params[s]) for s in store.detached if store.params[s].numel()]
    out = []
    for slot in slots:
        if grads[slot].numel():
            start, end = _span(grads[slot])
            if any(start < p_end and p_start < end for p_start, p_end in params):
                out.append(slot)
    return out


def _aliased(slots: list[int], grads: list[Tensor], store: FlatStore) -> set[int]:
    """Those of `slots` whose gradient overlaps another gradient's memory, the flat buffers
    (parameters or other gradients' views) or a parameter that lives outside them."""
    spans = [(*_span(grads[s]), s) for s in slots if grads[s].numel()]
    spans += [(*_span(b), None) for b in store.flat_grads + store.flat_params if b.numel()]
    spans += [(*_span(store.params[s]), None) for s in store.detached if store.params[s].numel()]
    spans.sort()
    aliased: set[int] = set()
    active: list[tuple[int, int, int | None]] = []
    for start, end, slot in spans:
        active = [a for a in active if a[1] > start]
        for _, _, other in active:
            aliased.update(x for x in (slot, other) if x is not None)
        active.append((start, end, slot))
    return aliased


def accumulate_into_negative_zero_is_exact(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether autograd's accumulation into a gradient buffer filled with -0.0 reproduces the
    incoming gradient bit for bit in `dtype` (``-0.0 + g == g`` for every value, NaN payloads
    included). Not for bfloat16 on CPU: the add rounds through float32 and stores NaN as 0xFFFF
    where the backward produced 0x7FC0. Probe: `add_` of ordinary values and of the special
    values (`calibration.sprinkle_special_values`) into -0.0, bytes compared; cached."""
    key = calibration.full_key("accumulate_into_negative_zero", device.type, (dtype,),
                               probe=accumulate_into_negative_zero_is_exact)

    def probe() -> bool:
        gen = torch.Generator().manual_seed(5)
        values = torch.randn(64, 67, generator=gen).to(dtype)
        sprinkle_special_values(list(values.unbind(0)))
        values = values.to(device)
        buf = torch.full_like(values, -0.0)
        buf.add_(values)  # AccumulateGrad's in-place `grad += new_grad`
        return calibration.same_bytes(buf, values)

    return calibration.verdict(key, probe)
