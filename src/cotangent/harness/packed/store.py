"""The flat-buffer store: parameters, gradients and AdamW state of one optimizer as views.

`FlatStore.pack` moves every parameter's storage into one flat buffer per (device, dtype)
(`layout` decides it), keeps a matching gradient buffer that autograd
accumulates into, and holds the AdamW state (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`) in flat
buffers of the same layout and the `step` counts in one small buffer per layout and step dtype.
The optimizer's `state[p]` dicts hold views of these buffers, so in-place edits of them are
seen; tensors assigned into `state[p]` from outside are validated (`state_problem`) and copied
in (`adopt`), as `load_state_dict` does.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from cotangent import _compat
from cotangent.harness.packed.layout import FlatLayout, Segment, alias, own_storage, plan_layouts
from cotangent.state import MOMENTS, describe, entry_problem, state_keys, state_problem



class WatchedState(defaultdict):
    """`optimizer.state` that counts edits of its entries (assigned, deleted, popped, cleared,
    updated, created on first access), so that a step can tell in O(1) that every `state[p]` is
    still the dict it saw. It pickles and copies as a plain `defaultdict(dict)`."""

    __slots__ = ("edits",)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.edits = 0

    def __setitem__(self, key, value) -> None:
        self.edits += 1
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.edits += 1
        super().__delitem__(key)

    def _edited(name):
        def method(self, *args, **kwargs):
            self.edits += 1
            return getattr(super(WatchedState, self), name)(*args, **kwargs)
        method.__name__ = name
        return method

    pop = _edited("pop")
    popitem = _edited("popitem")
    clear = _edited("clear")
    update = _edited("update")
    setdefault = _edited("setdefault")
    __ior__ = _edited("__ior__")
    del _edited

    def __reduce__(self):
        return (defaultdict, (self.default_factory,), None, None, iter(self.items()))


def validate_params(params: list[Tensor]) -> list[FlatLayout]:
    """Check that every parameter can be packed; returns the planned layouts
    (`layout.plan_layouts`).

    Raises:
        ValueError: a parameter that appears twice, shares storage with another, is sparse,
            complex, integer, on the meta device, a DTensor / wrapper subclass / uninitialised
            lazy parameter, or not dense.
    """
    seen: dict[int, int] = {}
    for slot, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"parameter {slot} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            raise ValueError(
                f"parameter {slot} is the same tensor as parameter {seen[id(p)]}; native AdamW "
                "would update it twice per step, cotangent.AdamW refuses duplicates")
        seen[id(p)] = slot
        if not p.is_leaf:
            raise ValueError(f"parameter {slot} is not a leaf tensor (it has a grad_fn); an "
                             "optimizer can only update leaf tensors (native add_param_group "
                             "refuses it too)")
        refusal = _compat.tensor_kind_refusal(p)
        if refusal is not None:
            raise ValueError(f"parameter {slot} {refusal}")
        if p.layout is not torch.strided:
            raise ValueError(f"parameter {slot} has layout {p.layout}; only dense (strided) "
                             "parameters can be packed")
        if p.is_complex():
            raise ValueError(f"parameter {slot} is complex ({p.dtype}); not supported")
        if not p.is_floating_point():
            raise ValueError(f"parameter {slot} has dtype {p.dtype}; AdamW needs floating "
                             "point parameters")
        if p.device.type == "meta":
            raise ValueError(f"parameter {slot} is on the meta device (no data to pack); "
                             "build cotangent.AdamW after materialising the model")
    spans = sorted(
        (p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size(),
         p.untyped_storage().data_ptr() + (p.storage_offset() + p.numel()) * p.element_size(),
         slot)
        for slot, p in enumerate(params) if p.numel() > 0)
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise ValueError(
                f"parameters {min(a, b)} and {max(a, b)} share storage; packing would untie "
                "them (tie modules by sharing one Parameter object instead)")
    return plan_layouts(params)


def same_strides(t: Tensor, p: Tensor) -> bool:
    """Whether `t` is laid out in memory exactly like `p` (strides of size-1 dims aside)."""
    return all(a == b for a, b, n in zip(t.stride(), p.stride(), p.shape) if n > 1)


def check_state(store: FlatStore, state, groups: list[dict],
                group_slots: list[tuple[int, list[int]]]) -> None:
    """Validate the param groups and the state that native AdamW will read for these slots.

    Raises:
        NotImplementedError: a group set to ``capturable`` or ``differentiable``.
        RuntimeError: a tensor lr with ``foreach=True`` (native's message); a state that
            `state_problem` rejects.
    """
    for gi, slots in group_slots:
        group = groups[gi]
        if group["capturable"] or group["differentiable"]:
            raise NotImplementedError(
                "cotangent.AdamW supports capturable=False and differentiable=False only")
        if group["foreach"] and torch.is_tensor(group["lr"]):
            raise RuntimeError(
                "lr as a Tensor is not supported for capturable=False and foreach=True")
        for slot in slots:
            p = store.params[slot]
            entry = state.get(p)  # .get: native creates entries only when it updates
            problem = entry and state_problem(slot, p, entry, bool(group["amsgrad"]))
            if problem:
                raise RuntimeError(problem)
    _check_no_shared_state(store, state, group_slots)


def _check_no_shared_state(store: FlatStore, state, group_slots) -> None:
    """Native updates a tensor shared by two state entries once per entry, in its own order;
    packing would copy it apart. Refuse that (zero-size tensors share no elements)."""
    owner: dict[int, tuple[int, str]] = {}
    for _, slots in group_slots:
        for slot in slots:
            entry = state.get(store.params[slot]) or {}
            for key in ("step",) + MOMENTS:
                value = entry.get(key)
                if not isinstance(value, Tensor) or value.numel() == 0:
                    continue
                other = owner.setdefault(value.data_ptr(), (slot, key))
                if other != (slot, key):
                    raise RuntimeError(
                        f"optimizer.state[p][{key!r}] of {describe(slot, store.params[slot])} is "
                        f"the same memory as state[{other[1]!r}] of parameter {other[0]}; native "
                        "AdamW would update it once per parameter, cotangent.AdamW cannot follow "
                        "that: give each parameter its own state tensors")


def adoptable_keys(p: Tensor, state: dict) -> list[str]:
    """The entries of `state` that can move into the flat buffers as they are."""
    return [k for k in ("step",) + MOMENTS if k in state and entry_problem(p, k, state[k]) is None]


class FlatStore:
    """Flat buffers and per-parameter views of one optimizer's parameters, gradients and state.

    Attributes (per slot = position in the optimizer's parameter list, param groups
    concatenated):
        params: the parameters (the user's `Parameter` objects, now views of `flat_params`).
        layouts: one `FlatLayout` per (device, dtype), in order of first appearance.
        where: (layout index, `Segment`) of each slot.
        grad_views: each slot's view of its layout's gradient buffer (same shape and strides as
            the parameter).
        flat_params, flat_grads: the 1-D buffers, one per layout.
        windows: per layout, the element range ``[start, end)`` its state buffers cover (the
            whole layout).
    """

    def __init__(self, params: list[Tensor], layouts: list[FlatLayout]) -> None:
        self.params = params
        self.layouts = layouts
        self.windows = [(0, layout.size) for layout in layouts]
        self.flat_params: list[Tensor] = [layout.new_buffer(0.0) for layout in layouts]
        self.flat_grads: list[Tensor] = [layout.new_buffer(-0.0) for layout in layouts]
        self.flat_state: list[dict[str, Tensor]] = [{} for _ in layouts]
        self.step_buffers: dict[tuple, Tensor] = {}  # (layout, device, dtype) -> 1-D steps
        self.where: list[tuple[int, Segment]] = [None] * len(params)  # type: ignore[list-item]
        self.position: list[int] = [0] * len(params)  # index of the slot in its layout's segments
        for li, layout in enumerate(layouts):
            for pos, seg in enumerate(layout.segments):
                self.where[seg.slot] = (li, seg)
                self.position[seg.slot] = pos
        self.grad_views: list[Tensor] = [self.alias(self.flat_grads, s)
                                         for s in range(len(params))]
        self.grad_ptrs = [g.data_ptr() for g in self.grad_views]
        self.param_ptrs: list[int] = []
        # slots whose parameter's data lives outside the flat buffer (assigned by `p.data = t`,
        # or in shared memory): updated by per-parameter calls on the parameter itself
        self.detached: set[int] = set()

    @classmethod
    @torch.no_grad()
    def pack(cls, params: list[Tensor], layouts: list[FlatLayout], grads: dict[int, Tensor],
             states: dict[int, dict], keep_in_place: set[int] = frozenset()) -> FlatStore:
        """Move `params` into new flat buffers (re-pointing `p.data`) and set their gradients from
        `grads` (slot -> tensor; a gradient laid out like its parameter is copied into the buffer,
        another stays where it is; slots without one read None); the valid entries of the state
        dicts `states` (slot -> dict) are copied in and replaced by views. The caller validates
        the parameters (`validate_params`) and the gradients' shapes and dtypes. Parameters in
        shared memory (`stays_in_place`) and those whose `id` is in `keep_in_place` (following a
        `p.data = t` of the previous store) stay where they are."""
        store = cls(params, layouts)
        for slot, p in enumerate(params):
            if stays_in_place(p) or id(p) in keep_in_place:
                store.detached.add(slot)
            else:
                view = store.view(store.flat_params, slot)
                view.copy_(p)
                p.data = own_storage(view)
            grad = grads.get(slot)
            if grad is None:
                p.grad = None
            elif same_strides(grad, p):
                store.grad_views[slot].copy_(grad)
                p.grad = store.grad_views[slot]
            else:
                p.grad = grad
            state = states.get(slot)
            if state:
                store.adopt(slot, state, adoptable_keys(p, state))
        store.param_ptrs = [p.data_ptr() for p in params]
        return store

    def view(self, buffers: list[Tensor], slot: int) -> Tensor:
        """Slot `slot`'s tensor in `buffers` (one flat buffer per layout)."""
        li, seg = self.where[slot]
        return self.layouts[li].view(buffers[li], seg)

    def alias(self, buffers: list[Tensor], slot: int) -> Tensor:
        """As `view`, but not an autograd view of the buffer (see `FlatLayout.alias`)."""
        li, seg = self.where[slot]
        return self.layouts[li].alias(buffers[li], seg)

    def refresh_grad_view(self, slot: int) -> None:
        """A new view object for a slot whose view's storage was replaced (`p.grad.data = x`)."""
        self.grad_views[slot] = self.alias(self.flat_grads, slot)
        self.grad_ptrs[slot] = self.grad_views[slot].data_ptr()

    def moment_view(self, slot: int, key: str) -> Tensor:
        """Slot `slot`'s view of the `key` moment buffer (allocated on first use, zero-filled)."""
        li, seg = self.where[slot]
        buffers = self.flat_state[li]
        start, end = self.windows[li]
        if key not in buffers:
            layout = self.layouts[li]
            buffers[key] = torch.zeros(end - start, dtype=layout.dtype, device=layout.device)
        return alias(buffers[key], seg.offset - start, seg.shape, seg.stride)

    def state_range(self, li: int, key: str, start: int, length: int) -> Tensor:
        """Elements ``[start, start + length)`` of layout `li` in its `key` state buffer."""
        return self.flat_state[li][key].narrow(0, start - self.windows[li][0], length)

    def step_view(self, slot: int, like: Tensor) -> Tensor:
        """A 0-dim view for slot `slot`'s step count in the step buffer of its layout for `like`'s
        device and dtype; slots side by side in the layout are side by side here."""
        li, _ = self.where[slot]
        key = (li, like.device, like.dtype)
        if key not in self.step_buffers:
            n = len(self.layouts[li].segments)
            self.step_buffers[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
        return alias(self.step_buffers[key], self.position[slot], (), ())

    def is_ours(self, slot: int, key: str, value: Tensor) -> bool:
        """Whether `value` is (a view identical to) this store's tensor for `state[key]`."""
        target = self.step_view(slot, value) if key == "step" else self.moment_view(slot, key)
        return (value.data_ptr() == target.data_ptr() and value.dtype == target.dtype
                and value.shape == target.shape and value.stride() == target.stride())

    @torch.no_grad()
    def adopt(self, slot: int, state: dict, keys) -> bool:
        """Copy `state[key]` for each of `keys` into this store and replace it by the view, unless
        it is already this store's (values validated by `state_problem`; moments are re-laid out
        like the parameter). Returns whether anything was copied."""
        copied = False
        for key in keys:
            value = state[key]
            if self.is_ours(slot, key, value):
                continue
            target = self.step_view(slot, value) if key == "step" else self.moment_view(slot, key)
            target.copy_(value)
            state[key] = target
            copied = True
        return copied

    @torch.no_grad()
    def init_state(self, slot: int, state: dict, *, fused: bool, amsgrad: bool) -> None:
        """Lazy state initialisation as `torch.optim.Adam._init_group`: a zero step placed as
        native places it (`_compat.new_step_tensor`) and zero moments, all views of this store."""
        p = self.params[slot]
        if fused:
            _compat.check_fused_support(p)
        step = self.step_view(slot, _compat.new_step_tensor(p, fused=fused, capturable=False))
        step.zero_()
        state["step"] = step
        for key in state_keys(amsgrad)[1:]:
            view = self.moment_view(slot, key)
            view.zero_()
            state[key] = view

    def take_state(self, state, groups: list[dict],
                   group_slots: list[tuple[int, list[int]]]) -> bool:
        """Before an update: give every listed slot its state in this store, initialising empty
        ones lazily as native does at a parameter's first update and copying in entries assigned
        from outside (validated by `check_state`). Returns whether anything changed.

        Entries are read before any is written: after ``state[a], state[b] = state[b],
        state[a]`` each holds the other's tensors in this store, which the first copy would
        otherwise overwrite."""
        fresh, copies = [], []
        for gi, slots in group_slots:
            group = groups[gi]
            for slot in slots:
                entry = state[self.params[slot]]
                if not entry:
                    fresh.append((slot, entry, group))
                    continue
                keys = [k for k in adoptable_keys(self.params[slot], entry)
                        if not self.is_ours(slot, k, entry[k])]
                if keys:
                    copies.append((slot, entry, {k: entry[k].clone() if self._holds(entry[k])
                                                 else entry[k] for k in keys}))
        for slot, entry, values in copies:
            snapshot = dict(entry, **values)
            self.adopt(slot, snapshot, list(values))
            entry.update((k, snapshot[k]) for k in values)
        for slot, entry, group in fresh:
            self.init_state(slot, entry, fused=bool(group["fused"]), amsgrad=bool(group["amsgrad"]))
        return bool(fresh or copies)

    def _holds(self, t: Tensor) -> bool:
        """Whether `t`'s memory lies in one of this store's state or step buffers."""
        ptr = t.data_ptr()
        buffers = [b for per in self.flat_state for b in per.values()]
        buffers += list(self.step_buffers.values())
        return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size()
                   for b in buffers)

    def layout_summary(self) -> list[dict]:
        """Per flat buffer: device, dtype, elements (with padding), tensors, buckets and how many
        buckets use the batched norm."""
        return [dict(device=str(l.device), dtype=str(l.dtype).removeprefix("torch."),
                     elements=l.size, tensors=len(l.segments), buckets=len(l.buckets),
                     batched_buckets=sum(b.batched for b in l.buckets)) for l in self.layouts]

    def sync_params(self) -> bool:
        """Follow parameters whose data moved since the last step, as native does.

        A parameter whose storage was replaced by one of the same shape, dtype, device and
        strides (``p.data = t``: SAM restoring weights, a momentum encoder's update, a
        parametrization, another optimizer packing it) stays where it now is, its update runs
        on the parameter itself; one whose flat buffer moved as a whole (``share_memory()``) is
        still in it. Returns whether a parameter left the buffer (cached calls must be rebuilt).

        Raises:
            RuntimeError: a parameter cast or moved to another dtype or device (``model.half()``,
                ``model.to(...)``), reshaped or re-strided, or now sharing memory with another
                parameter (native would update that memory twice, in its own order).
        """
        if list(map(Tensor.data_ptr, self.params)) == self.param_ptrs:
            return False
        left = False
        for slot, (p, ptr) in enumerate(zip(self.params, self.param_ptrs)):
            if p.data_ptr() == ptr:
                continue
            li, seg = self.where[slot]
            flat = self.flat_params[li]
            if slot not in self.detached and p.data_ptr() == (
                    flat.data_ptr() + seg.offset * flat.element_size()):
                self.param_ptrs[slot] = p.data_ptr()  # the whole buffer moved
                continue
            problem = self._move_problem(slot, p)
            if problem:
                raise RuntimeError(
                    f"{describe(slot, p)} no longer lives in this cotangent.AdamW's flat buffer "
                    f"and cannot be followed: {problem}; build the optimizer after moving or "
                    "casting the model")
            left |= slot not in self.detached
            self.detached.add(slot)
            self.param_ptrs[slot] = p.data_ptr()
        return left

    def _move_problem(self, slot: int, p: Tensor) -> str | None:
        layout = self.layouts[self.where[slot][0]]
        seg = self.where[slot][1]
        if p.dtype != layout.dtype or p.device != layout.device:
            return (f"it was cast or moved from {str(layout.dtype).removeprefix('torch.')} on "
                    f"{layout.device} (e.g. `model.half()`, `model.to(...)`)")
        if tuple(p.shape) != seg.shape or not same_strides(p, self.grad_views[slot]):
            return f"its shape or strides changed (now {tuple(p.shape)}, stride {p.stride()})"
        start = p.data_ptr()
        end = start + p.numel() * p.element_size()
        for other, q in enumerate(self.params):
            if other != slot and q.numel() and p.numel() and (
                    q.data_ptr() < end and start < q.data_ptr() + q.numel() * q.element_size()):
                return (f"its new storage overlaps parameter {other}'s (parameters tied through "
                        "`.data`: tie modules by sharing one Parameter object instead)")
        return None


def stays_in_place(p: Tensor) -> bool:
    """Whether packing must leave a parameter where it is: in shared memory (Hogwild workers
    update it there for each other), it is updated per parameter, as native."""
    return p.device.type == "cpu" and p.is_shared()
