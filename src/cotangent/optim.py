"""`cotangent.AdamW`: gradient clipping plus AdamW over packed parameters, bitwise equal to native.

The optimizer is a thin stateful shell (parameter groups, state, hooks, `state_dict`) around the
pure functions of `cotangent.norms` and torch's own functional AdamW (`torch.optim.adam.adam`
with `decoupled_weight_decay=True`, the function `torch.optim.AdamW.step` calls).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from cotangent import _compat, coalesce
from cotangent.norms import (
    calibrate_layout,
    calibrate_scale,
    clip_coefficient,
    multiply_is_identity,
    norm_program,
    run_norm_program,
    total_norm,
)
from cotangent.packing import FlatLayout, Segment, align_elements, plan_layouts

_STATE_BUFFERS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_GRAD = operator.attrgetter("grad")


@dataclass(slots=True)
class _AdamCall:
    """One native functional AdamW call: per-parameter tensors and merged ranges of one group."""

    group_index: int
    kind: str  # "fused" | "foreach" | "for-loop"
    direct: bool  # fused, one device and dtype, proven equal: skip the functional wrapper
    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    max_exp_avg_sqs: list[Tensor]
    state_steps: list[Tensor]  # one per list element: a range uses its first parameter's step
    # per merged range: (steps of its other parameters, a slice of a step buffer; its first
    # parameter's step), copied after the call so every parameter keeps its own step count
    step_fills: list[tuple[Tensor, Tensor]]


@dataclass(slots=True)
class _StepPlan:
    """Everything `step()` needs for one pattern of present gradients, built once and cached."""

    group_slots: list[tuple[int, list[int]]]  # (group index, present slots of the group)
    # native (device, dtype) group order: (layout index, positions in that layout's norm vector
    # or None when the order is the layout order, slots of the grads in native order)
    clip_groups: list[tuple[int, Tensor | None, list[int]]]
    absent: list[int]  # slots without a gradient this step
    first_device: torch.device | None  # device of the first present gradient (native stacks there)
    calls: list[_AdamCall] | None = None  # built after the first clip of this plan


class AdamW(torch.optim.AdamW):
    r"""AdamW with built-in gradient clipping over packed flat buffers.

    Drop-in for ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` followed by
    ``torch.optim.AdamW(params, ...).step()``: same constructor arguments and defaults as
    `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019, as
    implemented by PyTorch), plus the clipping arguments. Every `step()` first clips exactly as
    ``clip_grad_norm_([p for group in param_groups for p in group["params"] if p.grad is not None],
    max_norm, norm_type, error_if_nonfinite, foreach=None)`` would, then runs the AdamW
    implementation torch itself picks for these arguments (for-loop, foreach or fused) on
    per-parameter views, or once over a merged range of adjacent parameters where a calibration
    probe proved that equal (`cotangent.coalesce`); parameters, gradients and the moments
    `exp_avg` / `exp_avg_sq` come out bit for bit as with native code on the same device, dtype
    and torch version.

    Packing: at construction every parameter's storage moves into one flat buffer per
    (device, dtype), ordered by length, keeping its shape and strides (`p.data` is re-pointed; the
    `Parameter` objects and modules are unchanged). Gradients live in a matching flat buffer and
    autograd accumulates straight into it. Moments are views of flat buffers too.

    Gradients and `zero_grad`: `zero_grad(set_to_none=True)` fills the gradient buffer with -0.0,
    the identity of floating-point addition, so the next backward's in-place accumulation
    reproduces native's freshly assigned gradient byte for byte (including -0.0). Until that
    backward, ``p.grad`` is that -0.0 view rather than ``None``. A tensor hook per parameter
    records which gradients arrive; at the end of the backward, parameters that received none
    read ``None`` again, and `step()` skips them exactly as native skips ``p.grad is None``.
    Gradients written into the view in place without a backward are detected (the view is no
    longer all -0.0). Gradients that land outside the buffer (``model.zero_grad()`` then
    backward, or assigning ``p.grad``) are copied in at `step()`: correct, one copy slower.

    Args:
        params: iterable of parameters or of param-group dicts, as for `torch.optim.AdamW`.
            Parameters must be dense (contiguous, channels_last or another dense permutation),
            real floating point, and appear once.
        lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused: as `torch.optim.AdamW`.
        capturable, differentiable: accepted for signature compatibility; only ``False`` is
            supported.
        max_norm: clip the global gradient norm to this value before each update (``None``: no
            clipping, plain AdamW).
        norm_type: p of the global p-norm (``float('inf')`` for the max norm), as `clip_grad_norm_`.
        error_if_nonfinite: raise before any tensor is modified when the total norm is inf or NaN,
            as `clip_grad_norm_`.
        clip_order: the parameters exactly as you would pass them to `clip_grad_norm_` (e.g.
            ``model.parameters()``); their order decides the bits of the total norm. Default: the
            optimizer's order (param groups concatenated). It must contain every optimizer
            parameter; others in it must have no gradient at `step()`.
        batched_norms: use calibrated batched norms (default). ``False`` computes every
            per-tensor norm with the native call, keeping everything else packed: the
            "packing-only" cell of a factorial experiment.

    Attributes:
        last_total_norm: the total gradient norm of the last clipping `step()` (0-dim tensor on
            the first gradient's device, dtype of the promoted gradient dtypes), as returned by
            `clip_grad_norm_`; ``None`` before the first step or without ``max_norm``.

    Raises:
        ValueError / RuntimeError: everything `torch.optim.AdamW` raises for bad arguments; a
            parameter that appears twice, is sparse, complex, integer, or not dense; non-float
            `max_norm`; a `clip_order` that misses an optimizer parameter.
        NotImplementedError: ``capturable=True`` or ``differentiable=True``.
    """

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        clip_order=None,
        batched_norms: bool = True,
    ) -> None:
        self._layouts: list[FlatLayout] | None = None  # None until the first pack
        clip_order = None if clip_order is None else list(clip_order)
        try:
            max_norm = None if max_norm is None else float(max_norm)
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            raise ValueError(f"max_norm must be a number or None and norm_type a number, got "
                             f"max_norm={max_norm!r}, norm_type={norm_type!r}") from None
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused,
        )
        if capturable or differentiable:
            raise NotImplementedError(
                "cotangent.AdamW supports capturable=False and differentiable=False only"
            )
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.error_if_nonfinite = bool(error_if_nonfinite)
        self.last_total_norm: Tensor | None = None
        self._clip_order_params = clip_order
        self.batched_norms = bool(batched_norms)
        self._pack()

    # ------------------------------------------------------------------ packing

    def add_param_group(self, param_group: dict) -> None:
        """As `torch.optim.Optimizer.add_param_group`; afterwards all buffers are re-packed."""
        super().add_param_group(param_group)
        if self._layouts is not None:
            try:
                self._pack()
            except Exception:
                self.param_groups.pop()  # _pack validates before it modifies anything
                raise

    def load_state_dict(self, state_dict: dict) -> None:
        """As `torch.optim.Optimizer.load_state_dict` (native AdamW format); moments are then
        moved into the flat state buffers."""
        super().load_state_dict(state_dict)
        self._pack()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(max_norm=self.max_norm, norm_type=self.norm_type,
                     error_if_nonfinite=self.error_if_nonfinite, batched_norms=self.batched_norms,
                     _clip_order_params=self._clip_order_params,
                     last_total_norm=self.last_total_norm)
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickling or deep-copying repacks the (copied) parameters into new flat buffers."""
        super().__setstate__(state)
        self._layouts = None
        self._pack()

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _validate(self, params: list[Tensor]) -> list[FlatLayout]:
        seen: dict[int, int] = {}
        for slot, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(
                    f"parameter {slot} is the same tensor as parameter {seen[id(p)]}; native AdamW "
                    "would update it twice per step, cotangent.AdamW refuses duplicates"
                )
            seen[id(p)] = slot
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
        order = getattr(self, "_clip_order_params", None)
        if order is not None:
            listed = {id(q) for q in order}
            missing = [slot for slot, p in enumerate(params) if id(p) not in listed]
            if missing:
                raise ValueError(f"clip_order lacks optimizer parameter(s) {missing}; it must "
                                 "list every parameter the optimizer updates")
        return plan_layouts(params)

    @torch.no_grad()
    def _pack(self) -> None:
        """(Re)build the flat buffers from the current parameters, gradients and state."""
        params = self._all_params()
        layouts = self._validate(params)  # every check before anything is modified
        # Gradients that logically exist now (a -0.0 view that saw no backward is not one).
        old_grads = {id(p): p.grad for p in params if self._has_logical_grad(p)}
        if getattr(self, "_hook_finalizer", None) is not None:
            self._hook_finalizer()  # removes the previous hooks
        self._params = params
        self._layouts = layouts
        self._flat_params: list[Tensor] = []
        self._flat_grads: list[Tensor] = []
        self._state_flat: list[dict[str, Tensor]] = [{} for _ in layouts]
        self._grad_views: list[Tensor] = [None] * len(params)  # type: ignore[list-item]
        self._param_ptrs: list[int] = [0] * len(params)
        self._grad_ptrs: list[int] = [0] * len(params)
        self._where: list[tuple[int, Segment]] = [None] * len(params)  # type: ignore[list-item]
        self._has_grad: list[bool] = [False] * len(params)
        self._step_flat: dict[tuple, Tensor] = {}
        self._seg_pos = [0] * len(params)
        for layout in layouts:
            for pos, seg in enumerate(layout.segments):
                self._seg_pos[seg.slot] = pos
        # A parameter frozen at construction gets no hook and no gradient view; if it is unfrozen
        # later, its gradients arrive outside the buffer and are copied in at step().
        self._tracked = [p.requires_grad for p in params]
        for li, layout in enumerate(layouts):
            flat_p = layout.new_buffer(0.0)
            flat_g = layout.new_buffer(-0.0)
            for seg in layout.segments:
                p = params[seg.slot]
                view = layout.view(flat_p, seg)
                view.copy_(p)
                p.data = view
                gview = layout.view(flat_g, seg)
                grad = old_grads.get(id(p))
                if grad is not None:
                    gview.copy_(grad)
                    self._has_grad[seg.slot] = True
                    p.grad = gview
                else:
                    # As native until the first zero_grad(): no gradient. The first backward
                    # then allocates one outside the buffer (copied in at step, once).
                    p.grad = None
                self._grad_views[seg.slot] = gview
                self._grad_ptrs[seg.slot] = gview.data_ptr()
                self._param_ptrs[seg.slot] = p.data_ptr()
                self._where[seg.slot] = (li, seg)
                state = self.state.get(p)
                if state:
                    if torch.is_tensor(state.get("step")):
                        state["step"] = self._step_view(li, seg.slot, state["step"])
                    for key in _STATE_BUFFERS:
                        if key in state:
                            target = self._state_view(li, seg, key)
                            target.copy_(state[key])
                            state[key] = target
            self._flat_params.append(flat_p)
            self._flat_grads.append(flat_g)
        self._calibrate()
        self._install_hooks()
        slot_of = {id(p): slot for slot, p in enumerate(params)}
        order = self._clip_order_params
        self._clip_order = (list(range(len(params))) if order is None
                            else [slot_of[id(p)] for p in order if id(p) in slot_of])
        self._clip_outsiders = [] if order is None else [p for p in order if id(p) not in slot_of]
        self._slot_of = slot_of
        self._all_slots = tuple(range(len(params)))
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._state_seen = (id(self.state), len(self.state))
        self._clipped: tuple[int, ...] | None = None  # present slots, when step() clipped
        self._plans: dict[tuple[int, ...], _StepPlan] = {}
        self._last_present: tuple[int, ...] | None = None
        self._group_slots: list[list[int]] = []
        slot = 0
        for group in self.param_groups:
            self._group_slots.append(list(range(slot, slot + len(group["params"]))))
            slot += len(group["params"])

    def _calibrate(self) -> None:
        """Run (or look up) the batched-norm probes for every bucket, for this thread count,
        and plan the norm calls of each flat gradient buffer."""
        self._calibrated_threads = torch.get_num_threads()
        self._scale_ok: dict[tuple, bool] = {}
        if self.max_norm is not None:
            for layout in self._layouts or []:
                if self.batched_norms:
                    calibrate_layout(layout, self.norm_type, None)
                else:  # the "packing-only" cell of the factorial: every norm per tensor
                    for bucket in layout.buckets:
                        bucket.batched = False
        self._norm_programs = [norm_program(layout, flat)
                               for layout, flat in zip(self._layouts or [], self._flat_grads)]

    def _install_hooks(self) -> None:
        """Per trainable parameter: a post-accumulate-grad hook (a gradient arrived in `.grad`;
        `torch.autograd.grad` does not trigger it) and a tensor hook (the incoming gradient is
        sparse), plus an end-of-backward callback. The hooks hold the optimizer weakly and are
        removed when it is garbage collected."""
        ref = weakref.ref(self)

        def end_of_backward() -> None:
            # As native: a parameter that got no gradient in this backward (and had none
            # before) reads as None, not as its -0.0 buffer view.
            opt = ref()
            if opt is None:
                return
            opt._callback_queued = False
            for slot, p in enumerate(opt._params):
                if opt._tracked[slot] and not opt._has_grad[slot] and p.grad is opt._grad_views[slot]:
                    p.grad = None

        def make_hooks(slot: int):
            def accumulated(_: Tensor) -> None:
                opt = ref()
                if opt is None:
                    return
                opt._has_grad[slot] = True  # a gradient arrived since the last zero_grad
                if not opt._callback_queued:
                    opt._callback_queued = True
                    _compat.queue_backward_callback(end_of_backward)

            def incoming(grad: Tensor) -> None:
                opt = ref()
                if opt is not None and grad.layout is not torch.strided:
                    opt._sparse_grad[slot] = True

            return accumulated, incoming

        self._sparse_grad = [False] * len(self._params)
        self._callback_queued = False
        handles = []
        for slot, p in enumerate(self._params):
            if p.requires_grad:
                accumulated, incoming = make_hooks(slot)
                handles.append(p.register_post_accumulate_grad_hook(accumulated))
                handles.append(p.register_hook(incoming))
        self._hook_handles = handles
        self._hook_finalizer = weakref.finalize(self, _remove_handles, handles)

    def _has_logical_grad(self, p: Tensor) -> bool:
        """Whether native code would see a gradient on `p`: not None, and not an untouched
        -0.0 buffer view left by `zero_grad()`."""
        if p.grad is None:
            return False
        slot = getattr(self, "_slot_of", {}).get(id(p))
        if slot is None or p.grad is not self._grad_views[slot] or self._has_grad[slot]:
            return True
        return not _untouched(p.grad)

    def _state_view(self, li: int, seg: Segment, key: str) -> Tensor:
        bufs = self._state_flat[li]
        if key not in bufs:
            bufs[key] = self._layouts[li].new_buffer(0.0)  # type: ignore[index]
        return self._layouts[li].view(bufs[key], seg)  # type: ignore[index]

    # ------------------------------------------------------------------ gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients, as `torch.optim.Optimizer.zero_grad`, keeping them in the flat buffer.

        ``set_to_none=True`` (default): every parameter counts as having no gradient until the next
        backward; the buffer holds -0.0 so that backward's accumulation reproduces a fresh
        gradient bit for bit. ``set_to_none=False``: gradients that exist become +0.0 in place, as
        native; those that are ``None`` stay absent.
        """
        keep = [] if set_to_none else [
            i for i, p in enumerate(self._params) if self._tracked[i] and self._has_logical_grad(p)]
        for flat_g in self._flat_grads:
            flat_g.fill_(-0.0)
        for slot, p in enumerate(self._params):
            if not self._tracked[slot]:
                if p.grad is not None:  # a frozen parameter's stray gradient, reset as native
                    p.grad = None if set_to_none else p.grad.zero_()
                continue
            if p.grad is not self._grad_views[slot]:
                p.grad = self._grad_views[slot]
            self._has_grad[slot] = False
            self._sparse_grad[slot] = False
        self._callback_queued = False  # in case a failed backward never ran its callback
        for slot in keep:
            self._grad_views[slot].zero_()
            self._has_grad[slot] = True

    def _present_slots(self) -> tuple[int, ...]:
        """Slots with a gradient this step; gradients outside the flat buffer are copied in."""
        params = self._params
        # Fast path, the usual training step: every parameter still lives in its buffer segment
        # and every gradient is its buffer view, filled by a backward (no sparse gradient).
        grads = list(map(_GRAD, params))
        if (not self._clip_outsiders and all(self._has_grad) and not any(self._sparse_grad)
                and list(map(Tensor.data_ptr, params)) == self._param_ptrs
                and all(map(operator.is_, grads, self._grad_views))
                and list(map(Tensor.data_ptr, grads)) == self._grad_ptrs):
            return self._all_slots
        outside = []
        present = []
        for slot, p in enumerate(self._params):
            if p.data_ptr() != self._param_ptrs[slot]:
                raise RuntimeError(
                    f"parameter {slot} (shape {tuple(p.shape)}) no longer lives in cotangent.AdamW's "
                    "flat buffer: its storage was replaced after the optimizer was built (e.g. "
                    "`p.data = ...` or `module.to(...)`); build the optimizer after moving the model"
                )
            g = p.grad
            if g is None:
                continue
            if g is self._grad_views[slot] and g.data_ptr() != self._grad_ptrs[slot]:
                # `p.grad.data = ...` moved our view's storage: a fresh view takes its values
                li, seg = self._where[slot]
                self._grad_views[slot] = self._layouts[li].view(self._flat_grads[li], seg)
                self._has_grad[slot] = True
                self._plans.clear()  # cached calls hold the old view object
                self._last_present = None
            if g is self._grad_views[slot]:
                if not self._has_grad[slot] and not _untouched(g):
                    self._has_grad[slot] = True  # written in place without a backward
                if self._has_grad[slot]:
                    if self._sparse_grad[slot]:
                        raise RuntimeError(
                            f"parameter {slot} (shape {tuple(p.shape)}) received a sparse "
                            "gradient; Adam does not support sparse gradients, please consider "
                            "SparseAdam instead"
                        )
                    present.append(slot)
                continue
            if g.is_sparse:
                raise RuntimeError(
                        f"parameter {slot} (shape {tuple(p.shape)}) received a sparse gradient; Adam "
                    "does not support sparse gradients, please consider SparseAdam instead"
                )
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise RuntimeError(
                    f"parameter {slot}: gradient {tuple(g.shape)} {g.dtype} {g.device} does not "
                    f"match the parameter {tuple(p.shape)} {p.dtype} {p.device}"
                )
            outside.append(slot)
            present.append(slot)
        for p in self._clip_outsiders:
            if self.max_norm is not None and p.grad is not None:
                raise RuntimeError(
                    f"a parameter in clip_order (shape {tuple(p.shape)}) has a gradient but is not "
                    "updated by this optimizer; native clip_grad_norm_ would include it")
        for slot in outside:  # validated above; now copy in
            p = self._params[slot]
            self._grad_views[slot].copy_(p.grad)
            p.grad = self._grad_views[slot]
            self._has_grad[slot] = True
        return tuple(present)

    # ------------------------------------------------------------------ step

    def _plan(self, present: tuple[int, ...]) -> _StepPlan:
        plan = self._plans.get(present)
        if plan is not None:
            return plan
        present_set = set(present)
        group_slots = []
        for gi, slots in enumerate(self._group_slots):
            mine = [s for s in slots if s in present_set]
            if mine:
                group_slots.append((gi, mine))
        clip_groups = []
        ordered = [s for s in self._clip_order if s in present_set]  # clip_grad_norm_'s order
        grads = [self._grad_views[s] for s in ordered]
        for _, _, indices in (_compat.group_by_device_and_dtype(grads) if grads else []):
            slots = [ordered[i] for i in indices]
            li = self._where[slots[0]][0]
            program = self._norm_programs[li]
            out_pos = {self._layouts[li].segments[pos].slot: i
                       for i, pos in enumerate(program.order)}
            order = [out_pos[s] for s in slots]
            index = None if order == list(range(len(out_pos))) else torch.tensor(
                order, device=self._layouts[li].device)
            clip_groups.append((li, index, slots))
        absent = [s for s in range(len(self._params)) if s not in present_set]
        first_device = self._grad_views[ordered[0]].device if ordered else None
        plan = _StepPlan(group_slots, clip_groups, absent, first_device)
        if len(self._plans) >= 64:  # e.g. layer drop: bound the cache of presence patterns
            self._plans.clear()
        self._plans[present] = plan
        return plan

    def _build_calls(self, plan: _StepPlan) -> list[_AdamCall]:
        """Initialise missing state (lazily, as native does at a parameter's first update) and
        group the present parameters into native AdamW calls, merging adjacent segments into
        ranges wherever `cotangent.coalesce.calibrate_merge` allows and their steps are equal."""
        calls = []
        for gi, slots in plan.group_slots:
            group = self.param_groups[gi]
            for slot in slots:
                state = self.state[self._params[slot]]
                if len(state) == 0:
                    self._init_state(group, self._params[slot], slot, state)
            kind = coalesce.implementation(group, [self._params[s] for s in slots])
            limit = coalesce.max_range_elements(kind)
            in_group = set(slots)
            for li, layout in enumerate(self._layouts):  # one call per (group, device, dtype)
                segs = [seg for seg in layout.segments if seg.slot in in_group]
                if not segs:
                    continue
                direct = kind == "fused" and coalesce.calibrate_direct(
                    layout.device, layout.dtype, group)
                call = _AdamCall(gi, kind, direct, [], [], [], [], [], [], [])
                for run in self._ranges(li, layout, segs, kind, limit, group):
                    self._add_to_call(call, li, run, group)
                calls.append(call)
        self._state_seen = (id(self.state), len(self.state))
        return calls

    def _ranges(self, li, layout, segs, kind, limit, group) -> list[list[Segment]]:
        """Split `segs` (buffer order) into runs that may share one call."""
        align = align_elements(layout.dtype)
        runs: list[list[Segment]] = []
        run_end = -1
        run_start = 0
        for seg in segs:
            end = seg.offset + -(-seg.numel // align) * align
            ok = seg.contiguous and coalesce.calibrate_merge(
                kind, layout.device, layout.dtype, seg.numel, group)
            if (ok and runs and run_end == seg.offset
                    and (limit is None or end - run_start <= limit)
                    and self._same_step(runs[-1][0], seg)):
                runs[-1].append(seg)
                run_end = end
            else:
                runs.append([seg])
                run_start, run_end = seg.offset, (end if ok else -1)
        return runs

    def _same_step(self, a: Segment, b: Segment) -> bool:
        sa = self.state[self._params[a.slot]]["step"]
        sb = self.state[self._params[b.slot]]["step"]
        return bool(sa == sb)  # once per plan build (a host read on accelerators)

    def _add_to_call(self, call: _AdamCall, li: int, run: list[Segment], group: dict) -> None:
        first = self.state[self._params[run[0].slot]]
        steps = [self.state[self._params[seg.slot]]["step"] for seg in run]
        item = steps[0].element_size()
        consecutive = all(st.data_ptr() == steps[0].data_ptr() + i * item
                          for i, st in enumerate(steps))
        if len(run) > 1 and not consecutive:  # steps not side by side: no merged call
            for seg in run:
                self._add_to_call(call, li, [seg], group)
            return
        if len(run) == 1:
            p = self._params[run[0].slot]
            call.params.append(p)
            call.grads.append(self._grad_views[run[0].slot])
            tensors = first
        else:
            align = align_elements(self._layouts[li].dtype)
            start = run[0].offset
            length = run[-1].offset + -(-run[-1].numel // align) * align - start
            call.params.append(self._flat_params[li].narrow(0, start, length))
            call.grads.append(self._flat_grads[li].narrow(0, start, length))
            tensors = {k: v.narrow(0, start, length) for k, v in self._state_flat[li].items()}
            rest = steps[0].as_strided((len(run) - 1,), (1,), steps[0].storage_offset() + 1)
            call.step_fills.append((rest, steps[0]))
        call.exp_avgs.append(tensors["exp_avg"])
        call.exp_avg_sqs.append(tensors["exp_avg_sq"])
        if group["amsgrad"]:
            call.max_exp_avg_sqs.append(tensors["max_exp_avg_sq"])
        call.state_steps.append(first["step"])

    def _init_state(self, group: dict, p: Tensor, slot: int, state: dict) -> None:
        """Lazy state initialisation as `torch.optim.Adam._init_group`, moments in flat buffers
        and the step count a 0-dim view into a per-layout step buffer."""
        if group["fused"]:
            _compat.check_fused_support(p)
        if group["foreach"] and torch.is_tensor(group["lr"]) and not group["capturable"]:
            raise RuntimeError(
                "lr as a Tensor is not supported for capturable=False and foreach=True"
            )
        li, seg = self._where[slot]
        template = _compat.new_step_tensor(p, fused=bool(group["fused"]),
                                           capturable=bool(group["capturable"]))
        state["step"] = self._step_view(li, slot, template)
        keys = _STATE_BUFFERS if group["amsgrad"] else _STATE_BUFFERS[:2]
        for key in keys:
            state[key] = self._state_view(li, seg, key)
            state[key].zero_()

    def _step_view(self, li: int, slot: int, value: Tensor) -> Tensor:
        """A 0-dim view holding `value` (a step count) in the step buffer of layout `li` for
        `value`'s device and dtype; segments side by side in the layout are side by side here."""
        key = (li, value.device, value.dtype)
        if key not in self._step_flat:
            n = len(self._layouts[li].segments)  # type: ignore[index]
            self._step_flat[key] = torch.zeros(n, dtype=value.dtype, device=value.device)
        view = self._step_flat[key][self._seg_pos[slot]]
        view.copy_(value)
        return view

    def _clip(self, plan: _StepPlan) -> Tensor:
        """Clip the present gradients in place as `clip_grad_norm_`; returns the total norm."""
        if not plan.clip_groups:
            return torch.tensor(0.0)
        norms = {}
        parts = []
        for li, index, _ in plan.clip_groups:
            if li not in norms:
                norms[li] = run_norm_program(self._norm_programs[li], self.norm_type, None)
            parts.append(norms[li] if index is None else norms[li].index_select(0, index))
        if len(parts) == 1:  # one (device, dtype): the stacked norms are this vector
            total = total_norm(parts[0], self.norm_type)
        else:
            total = total_norm([part.to(plan.first_device) for part in parts], self.norm_type)
        if self.error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {self.norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        coef = clip_coefficient(total, self.max_norm)  # type: ignore[arg-type]
        for li, _, slots in plan.clip_groups:
            layout = self._layouts[li]
            coef_dev = coef.to(layout.device)
            if multiply_is_identity(coef_dev):
                continue
            key = (li, coef_dev.dtype)
            if key not in self._scale_ok:  # probe once per buffer and coefficient dtype
                self._scale_ok[key] = calibrate_scale(layout.device, layout.dtype, coef_dev.dtype)
            if self._scale_ok[key]:
                self._flat_grads[li].mul_(coef_dev)
            else:
                _compat.foreach_mul_([self._grad_views[s] for s in slots], coef_dev)
        return total

    def step(self, closure=None):
        """Clip (if ``max_norm`` is set) and apply one AdamW update; returns the closure's loss.

        Without a closure the clip runs first, before the optimizer's step pre-hooks, exactly
        where user code calls `clip_grad_norm_` before `optimizer.step()`; with a closure it
        runs after the closure has computed the gradients.
        """
        self._clipped = None
        if closure is None and self.max_norm is not None:
            with torch.no_grad():
                self._refresh()
                present = self._present_slots()
                self.last_total_norm = self._clip(self._plan(present))  # may raise: nothing
                self._clipped = present                                  # modified before it
        return self._hooked_step(closure)

    step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it: _hooked_step is

    @torch.no_grad()
    def _step_body(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._clipped is not None and not _compat.has_step_pre_hooks(self):
            present = self._clipped  # nothing ran since the clip that could change gradients
        else:
            self._refresh()
            present = self._present_slots()  # pre-hooks may have changed the gradients
        plan = self._plan(present)
        if present != self._last_present:
            # Steps may have diverged while another set of parameters had gradients: re-check
            # the step equality that merged ranges rely on.
            plan.calls = None
            self._last_present = present
        if self.max_norm is not None and self._clipped is None:
            self.last_total_norm = self._clip(plan)  # may raise: nothing is modified before it
        self._clipped = None
        if plan.calls is None:
            plan.calls = self._build_calls(plan)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for call in plan.calls:
            group = self.param_groups[call.group_index]
            if call.direct and grad_scale is None and found_inf is None:
                coalesce.run_direct_fused(
                    call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                    call.max_exp_avg_sqs, call.state_steps, group=group)
            else:
                coalesce.run_native_adamw(
                    call.kind, call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                    call.max_exp_avg_sqs, call.state_steps, group=group,
                    grad_scale=grad_scale, found_inf=found_inf)
            for rest, first in call.step_fills:
                rest.copy_(first)
        for slot in plan.absent:  # native leaves these None; so do we after the step
            p = self._params[slot]
            if p.grad is self._grad_views[slot]:
                p.grad = None
        return loss

    # torch's own wrapper: profiler range, step pre-hooks, body, post-hooks (as native AdamW)
    _hooked_step = torch.optim.Optimizer.profile_hook_step(_step_body)

    def _refresh(self) -> None:
        """Notice what changed since the last step and adapt before anything is modified:
        parameters appended to a group (repack), the thread count (recalibrate), a cleared or
        replaced `state` (rebuild the AdamW calls, which re-initialise state as native does)."""
        if [len(g["params"]) for g in self.param_groups] != self._group_sizes:
            self._pack()
        if torch.get_num_threads() != self._calibrated_threads:
            self._calibrate()  # verdicts depend on the thread count: probe again
            self._plans.clear()
            self._last_present = None
        if (id(self.state), len(self.state)) != self._state_seen:
            for plan in self._plans.values():
                plan.calls = None
            self._last_present = None
            self._state_seen = (id(self.state), len(self.state))

    # ------------------------------------------------------------------ introspection

    def layout_summary(self) -> list[dict]:
        """Per flat buffer: device, dtype, elements (with padding), tensors, buckets and how many
        buckets use the batched norm."""
        return [
            dict(device=str(l.device), dtype=str(l.dtype).removeprefix("torch."), elements=l.size,
                 tensors=len(l.segments), buckets=len(l.buckets),
                 batched_buckets=sum(b.batched for b in l.buckets))
            for l in self._layouts or []
        ]

    def call_summary(self) -> dict:
        """How the last step ran AdamW: native list elements (per-parameter tensors plus merged
        ranges) against parameters, over the calls of the current plan."""
        plan = self._plans.get(self._last_present) if self._last_present is not None else None
        calls = plan.calls if plan is not None and plan.calls is not None else []
        return dict(calls=sum(len(c.params) for c in calls),
                    parameters=sum(len(c.params) + sum(len(r) for r, _ in c.step_fills)
                                   for c in calls),
                    implementations=sorted({c.kind for c in calls}))


def _remove_handles(handles) -> None:
    for handle in handles:
        handle.remove()


def _untouched(grad: Tensor) -> bool:
    """True when every element of `grad` is -0.0, the fill `zero_grad()` leaves."""
    return bool(torch.signbit(grad).all()) and not bool(grad.any())
