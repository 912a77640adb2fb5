"""`PackedAdamW`: gradient clipping plus AdamW over packed parameters, bitwise equal to
native: the seed study's design, kept as the factorial's ``packing-only`` and ``packed`` arms
(`cotangent.AdamW` itself reads every tensor where it is, ZeRO-1 included: `cotangent.adamw`).

Read `step()` first: it clips where user code calls `clip_grad_norm_`, then `_update` runs the
native functional AdamW calls. The pieces it composes:

- `store.FlatStore`: parameters, gradients and AdamW state as views of flat buffers;
- `tracking.GradientTracker`: which gradients arrived since `zero_grad`;
- `plan.Planner`: which native AdamW calls, over which merged ranges;
- `clipping.PackedClipper`: `clip_grad_norm_` over the packed gradients;
- `cotangent.singlepass`: for-loop / foreach AdamW as one pass over the flat buffers, gated;
- `cotangent.reference.ReferenceUpdate`: the native code all of this is tested against.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from itertools import chain

import torch
from torch import Tensor

from cotangent import _compat, merge, singlepass
from cotangent.adamw import AdamW
from cotangent.clip_order import (ClipOrder, check_clip_order_known, check_not_sharded_by_zero,
                                  normalize_clip_order)
from cotangent.harness.packed.clipping import PackedClipper, clip_actual_tensors, tensors_if_outside
from cotangent.harness.packed.plan import Planner, StepPlan
from cotangent.harness.packed.store import (FlatStore, WatchedState, check_state, same_strides,
                                            validate_params)
from cotangent.harness.packed.tracking import Gradients, GradientTracker, gradients_to_carry
from cotangent.state import check_state_dict, compact_state


def _live(opt: PackedAdamW) -> PackedAdamW:
    """The optimizer `opt` stands for. A wrapper that subclasses the wrapped optimizer's class on
    the fly and forwards attribute reads to it (pytorch-lightning's `LightningOptimizer`, which
    `self.optimizers()` returns) runs our methods with itself as `self`: their writes would land
    on the wrapper, unseen by the optimizer (a clip recorded there would be done again by
    `step()`). Such calls go to the optimizer whose buffers these are.

    Raises:
        RuntimeError: `opt` was never initialised and forwards to no optimizer.
    """
    if "_store" in vars(opt):
        return opt
    ref = getattr(opt, "_live_ref", None)  # forwarded by the wrapper
    live = ref() if ref is not None else None
    if live is None:
        raise RuntimeError(f"{type(opt).__name__} was not initialised (AdamW.__init__ did not "
                           "run) and forwards to no cotangent.AdamW")
    return live


@dataclass(slots=True)
class _StepInputs:
    """What one step works on, found by `AdamW._prepare`."""

    grads: Gradients
    plan: StepPlan  # every present gradient: what is clipped
    update: StepPlan  # what is updated (= `plan`)
    calls_valid: bool  # the update plan's cached AdamW calls may run as they are


class PackedAdamW(AdamW):
    r"""AdamW with built-in gradient clipping over packed flat buffers: `cotangent.AdamW`'s
    seed-study design (parameters moved into flat buffers, gradients copied into one as autograd
    delivers them). The harness's ``packed`` arm uses it, and its ``packing-only`` arm with
    ``batched_norms=False``; it does not shard (ZeRO-1 is ``cotangent.AdamW(shard="zero1")``). Same bits as `cotangent.AdamW`,
    except where the packing takes over tensors the user still holds (issue 26; the reason
    `cotangent.AdamW` reads everything in place): a gradient tensor assigned once and refilled
    in place across steps is read from its copy in the buffer from the second step on, and a
    parameter whose memory another tensor outside the optimizer also references is moved into
    the buffer, so that tensor no longer sees the updates (`tests/test_inputs.py`,
    ``test_a_gradient_assigned_once_*`` and ``test_parameter_memory_shared_*``, pass for
    `cotangent.AdamW` and fail for this class).

    Drop-in for ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` followed by
    ``torch.optim.AdamW(params, ...).step()``: same constructor arguments and defaults as
    `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019, as
    implemented by PyTorch), plus the clipping arguments. Every `step()` first clips exactly as
    ``clip_grad_norm_([p for group in param_groups for p in group["params"] if p.grad is not None],
    max_norm, norm_type, error_if_nonfinite, foreach=None)`` would, then runs the AdamW
    implementation torch itself picks for these arguments (for-loop, foreach or fused) on
    per-parameter views, or once over a merged range of adjacent parameters where a calibration
    probe proved that equal (`cotangent.merge`); for-loop and foreach calls over float32 CPU
    buffers run as one pass over memory instead (`cotangent.singlepass`: a C++ kernel compiled
    on first use, where its probe proved it equal; ``COTANGENT_SINGLE_PASS=0`` keeps native's
    op sequence; `update_path()` says which ran); parameters, gradients, `exp_avg`, `exp_avg_sq`,
    `max_exp_avg_sq` and `step` come out bit for bit as with native code on the same device,
    dtype and torch version.

    Packing: at construction every parameter's storage moves into one flat buffer per
    (device, dtype), ordered by length, keeping its shape and strides (`p.data` is re-pointed; the
    `Parameter` objects and modules are unchanged; parameters in shared memory stay where they
    are). Gradients live in a matching flat buffer that autograd accumulates into; `state[p]`
    holds tensors over flat moment and step buffers.

    Edits from outside are followed as native follows them (it reads everything afresh at every
    step): parameters added to, removed from or replaced inside ``param_groups`` (repacked),
    ``state[p]`` entries assigned, replaced, cleared or edited in place (assigned tensors are
    validated and copied in, as `load_state_dict` does), ``p.data = t`` (that parameter is then
    updated where it is), hyperparameter edits, gradients assigned or written without a backward,
    a changed thread count. What cannot be followed is a clear error (see Raises), never a silent
    difference. One difference is deliberate: with ``fused=True``, a gradient whose strides
    differ from its parameter's (e.g. assigned transposed) is read in the parameter's layout,
    as the for-loop and foreach implementations read it; native CPU fused AdamW reads it in
    storage order instead (pytorch#106951) and CUDA fused AdamW raises.

    Args:
        params: iterable of parameters or of param-group dicts, as for `torch.optim.AdamW`.
            Parameters must be dense (contiguous, channels_last or another dense permutation),
            real floating point, plain tensors (not DTensor / FSDP2 shards), and appear once.
        lr, betas, eps, weight_decay, amsgrad, maximize, foreach, fused: as `torch.optim.AdamW`.
        capturable, differentiable: accepted for signature compatibility; only ``False`` is
            supported.
        max_norm: clip the global gradient norm to this value before each update (``None``: no
            clipping, plain AdamW).
        norm_type: p of the global p-norm (``float('inf')`` for the max norm), as `clip_grad_norm_`.
        error_if_nonfinite: raise before any tensor is modified when the total norm is inf or NaN,
            as `clip_grad_norm_`.
        clip_order: what you would pass to `clip_grad_norm_`; its order decides the bits of the
            total norm. A module (``clip_order=model``: its ``parameters()`` are read afresh at
            every clip, so wrapping or pruning mid-run is followed), a zero-argument callable
            returning parameters, a fixed iterable of them (e.g. ``model.parameters()`` as
            it is now), or ``"param_groups"`` (the optimizer's parameters, param groups
            concatenated, as Lightning's ``gradient_clip_val`` clips). Default (None): the
            optimizer's order when one param group holds parameters (native's bits when that
            group is the list your loop clips, e.g. ``model.parameters()``; a group in another
            order, or a subset while the loop clips the whole model, needs
            ``clip_order=model``, and `cotangent.verify` reports the difference); with two or
            more and ``max_norm`` set, the order is ambiguous (native loops clip
            ``model.parameters()`` or the param groups, and the optimizer cannot see the model),
            so clip_order is required there: a ValueError at construction, or at the
            `add_param_group` / edit that makes the second group, names ``clip_order=model``.
            As with native code, optimizer parameters missing from the order are updated
            unclipped, and others in it are clipped too.
        batched_norms: use calibrated batched norms (default). ``False`` computes every
            per-tensor norm with the native call, keeping everything else packed: the
            "packing-only" cell of a factorial experiment.
    Attributes:
        last_total_norm: the total gradient norm the last clip computed (0-dim tensor on the
            first gradient's device, dtype of the promoted gradient dtypes), as `clip_grad_norm_`
            returns it; ``None`` before the first clip, without ``max_norm``, and once a backward
            has delivered new gradients that are not clipped yet (so after a step that
            `GradScaler` skipped, which it does by not calling `step()` for for-loop and foreach
            AdamW, it reads ``None``, never the previous step's norm).

    Raises:
        ValueError / RuntimeError at construction: everything `torch.optim.AdamW` raises for bad
            arguments; a parameter that appears twice, shares storage with another, is sparse,
            complex, integer, on the meta device, a DTensor or other wrapper subclass, an
            uninitialised lazy parameter, or not dense; non-numeric `max_norm`; ``max_norm`` with two or more param
            groups holding parameters and no `clip_order` (also from `add_param_group`,
            `step()` and `zero_grad()` after an edit that makes it so); ``max_norm`` without
            `clip_order` (or with ``"param_groups"``) inside
            `torch.distributed.optim.ZeroRedundancyOptimizer` (each rank's optimizer holds one
            shard: its clip would norm that shard alone); a `clip_order`
            that is a string other than ``"param_groups"``, not iterable, or holds (or, a
            callable, returns) something other than tensors.
        NotImplementedError: ``capturable=True`` or ``differentiable=True`` (also when set on a
            group later).
        RuntimeError from `step()`, `clip_grad_norm_()` and `zero_grad()`, before anything is
            modified: a parameter cast, moved, reshaped or tied to another through ``.data``
            after building (``model.half()``, ``model.to(...)``); a sparse gradient; a gradient
            whose shape, dtype or device differs from its parameter's; a non-finite total norm
            with ``error_if_nonfinite``; a ``state[p]`` that lacks an entry native AdamW reads,
            or holds a tensor of another shape, dtype or device, or a non-tensor or non-0-dim
            step; a tensor ``lr`` with ``foreach=True``; the call happening inside
            ``torch.compile``; and what native AdamW raises itself.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = cotangent.AdamW(model.parameters(), lr=1e-3, fused=True, max_norm=1.0)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()   # = clip_grad_norm_(model.parameters(), 1.0); AdamW(...).step()
        >>> opt.zero_grad()
    """

    def __init__(self, params, lr: float | Tensor = 1e-3,
                 betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 error_if_nonfinite: bool = False, clip_order=None,
                 batched_norms: bool = True) -> None:
        self._live_ref = weakref.ref(self)  # read through wrappers that forward reads: _live
        self._store: FlatStore | None = None  # None until the first pack
        self._tracker: GradientTracker | None = None
        self._shares = None  # (never sharded: ZeRO-1 is `cotangent.AdamW(shard="zero1")`)
        try:
            max_norm = None if max_norm is None else float(max_norm)
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            raise ValueError(f"max_norm must be a number or None and norm_type a number, got "
                             f"max_norm={max_norm!r}, norm_type={norm_type!r}") from None
        torch.optim.AdamW.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused)
        if capturable or differentiable:
            raise NotImplementedError(
                "cotangent.AdamW supports capturable=False and differentiable=False only")
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.error_if_nonfinite = bool(error_if_nonfinite)
        self.batched_norms = bool(batched_norms)
        # a snapshot of an iterable, as clip_grad_norm_ takes one (`_repack` checks the rule)
        self._clip_order_params = normalize_clip_order(clip_order)
        check_not_sharded_by_zero(max_norm, self._clip_order_params)
        self._last_total_norm: Tensor | None = None
        self._norm_backwards = -1  # tracker.backwards when the norm was computed
        self._clipped: tuple[int, int] | None = None  # (backwards, resets) of clipped gradients
        self._prepared: _StepInputs | None = None  # found by this step()'s clip, for its body
        self._scale_applied = False  # this step's clip already divided by GradScaler's scale
        # (coefficient, its float value, {layout: (clip group entry, parameters)}): clip
        # multiplies left by step()'s clip to this step's single passes (`_defer_clip`)
        self._pending_clip: tuple | None = None
        self.state = WatchedState(dict, self.state)  # (no user code holds the old one yet)
        self._repack()

    # ------------------------------------------------------------------ the update

    def step(self, closure=None):
        """Clip (if ``max_norm`` is set) and apply one AdamW update.

        The clip runs where user code calls `clip_grad_norm_`: before the step pre-hooks, or,
        with a closure, right after the closure has computed the gradients. It is skipped when
        `clip_grad_norm_()` already clipped these gradients.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss (run
                under `torch.enable_grad`), as for `torch.optim.AdamW.step`.
        Returns:
            The closure's loss, or None.
        Raises:
            See the class docstring; nothing is modified before an error is raised.
        """
        if (live := _live(self)) is not self:
            return live.step(closure)
        _compat.refuse_under_compile("cotangent.AdamW.step()")
        # before hooks or the closure run (the clip order is checked again after them)
        check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        self._scale_applied = False
        # the clip multiply may join the single pass only where nothing can read the
        # gradients between the clip and the update: no step pre-hook
        defer = not _compat.has_step_pre_hooks(self)
        if closure is None:
            self._clip_if_due(defer)
            return self._hooked_step()

        def closure_then_clip():
            loss = closure()
            self._clip_if_due(defer)
            return loss

        return self._hooked_step(closure_then_clip)

    _compat.mark_step_hooked(step)  # torch must not wrap it again: _hooked_step runs the hooks

    @torch.no_grad()
    def _update(self, closure=None):
        """The step body, run between torch's step pre- and post-hooks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inputs, self._prepared = self._prepared, None
        if inputs is None or _compat.has_step_pre_hooks(self):
            inputs = self._prepare()  # pre-hooks may have changed gradients or state
        self._decisions: dict = {}
        try:
            calls = self._adamw_calls(inputs)
        except BaseException:
            self._settle_clip(None)  # a deferred clip multiply still happens
            raise
        grad_scale = None if self._scale_applied else getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        clip_coef, clip_value, clip_layouts = self._settle_clip(calls)
        single, native, notes, clip_in_pass = 0, 0, set(), 0
        for call in calls.calls:
            group = self.param_groups[call.group_index]
            if call.single is not None and grad_scale is None and found_inf is None:
                joined = call.single.layout in clip_layouts
                why = self._single_pass(call, group, clip_value if joined else None)
                if why is None:
                    single += call.parameters
                    clip_in_pass += call.parameters if joined else 0
                    continue
                notes.add(why)
                if joined:  # refused before touching anything: multiply as native, then step
                    _compat.foreach_mul_(call.grads, clip_coef)
            elif call.single_note is not None:
                notes.add(call.single_note)
            native += call.parameters
            args = (call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                    call.max_exp_avg_sqs, call.state_steps)
            if call.direct and grad_scale is None and found_inf is None:
                merge.run_direct_fused(*args, group=group)
            else:
                merge.run_native_adamw(call.kind, *args, group=group, grad_scale=grad_scale,
                                       found_inf=found_inf)
        calls.finish()
        self._paths = (single, native, tuple(sorted(notes)), clip_in_pass)
        self._tracker.release_absent(inputs.grads.present)
        self._clipped, self._scale_applied = None, False
        return loss

    _hooked_step = _compat.with_step_hooks(_update)

    def _defer_clip(self, groups: list, coef: Tensor) -> set[int]:
        """The layouts whose clip multiply step()'s clip leaves to this step's single passes
        (`Clipper.clip`'s `defer`): CPU float32 layouts whose present gradients the clip
        multiplies once each, when the coefficient is neither 1.0 (no multiply at all) nor NaN
        (with two NaNs ATen's multiply keeps one by loop position; see
        `cotangent.singlepass.single_pass_adamw_`), without GradScaler state or
        the single pass switched off. `_settle_clip` multiplies whatever no pass will."""
        self._pending_clip = None
        if (getattr(self, "grad_scale", None) is not None
                or getattr(self, "found_inf", None) is not None or coef.device.type != "cpu"
                or not singlepass.switched_on()):
            return set()
        value = coef.item()
        if value != value or value == 1.0:
            return set()
        store = self._store
        pending = {entry[0]: (entry, {id(store.params[s]) for s in entry[2]})
                   for entry in groups if entry[3]
                   and store.layouts[entry[0]].device.type == "cpu"
                   and store.layouts[entry[0]].dtype == torch.float32}
        if pending:
            self._pending_clip = (coef, value, pending)
        return set(pending)

    def _settle_clip(self, calls) -> tuple[Tensor | None, float | None, set[int]]:
        """Consume the clip multiply `_defer_clip` left pending: returns (coefficient, its
        value, layouts) where every clipped gradient of the layout, and nothing else, belongs to
        calls that take the single pass now (`singlepass.decide` with the coefficient), which then
        multiply them in the pass; the other pending layouts are multiplied here, as the clip
        would have (`calls` None: all of them)."""
        pending, self._pending_clip = self._pending_clip, None
        if pending is None:
            return None, None, set()
        coef, value, layouts = pending
        taken: dict[int, set[int]] = {}
        if calls is not None and getattr(self, "grad_scale", None) is None and getattr(
                self, "found_inf", None) is None:
            for call in calls.calls:
                if call.single is None:
                    continue
                group = self.param_groups[call.group_index]
                ids = taken.setdefault(call.single.layout, set())
                if self._decide(call, group, value) is None:
                    ids.update(id(p) for p in call.single.params)
                else:
                    ids.add(-1)  # a call over this layout runs natively: no multiply in passes
        joined = {li for li, (_, ids) in layouts.items() if taken.get(li) == ids}
        rest = [entry for li, (entry, _) in layouts.items() if li not in joined]
        if rest:
            self._clipper.scale(rest, coef)
        return coef, value, joined

    def _decide(self, call, group: dict, clip_coef: float | None) -> str | None:
        """`singlepass.decide` for `call`, asked once per step and argument (`_update` clears
        the memo: the group's hyperparameters may change between steps)."""
        if call.kind not in singlepass.IMPLEMENTATIONS:
            return "fused AdamW: native's kernel (the packed design as it was before issue 26)"
        dtype = self._store.layouts[call.single.layout].dtype
        key = (call.kind, call.group_index, clip_coef, dtype)
        memo = self._decisions
        if key not in memo:
            memo[key] = singlepass.decide(call.kind, group, clip_coef, dtype, self._team)
        return memo[key]

    def _team(self) -> tuple[int, tuple[int, ...]]:
        """`singlepass.team()`, asked once per step (nothing runs user code between this
        step's decisions and its passes)."""
        memo = self._decisions
        if "team" not in memo:
            memo["team"] = singlepass.team()
        return memo["team"]

    def _single_pass(self, call, group: dict, clip_coef: float | None = None) -> str | None:
        """Run `call` as one `cotangent.singlepass.single_pass_adamw_` pass over its layout's
        buffers where `singlepass.decide` allows it now, with the clip multiply by `clip_coef`
        when given; returns None when it ran, else why not (nothing was modified then: native's
        op sequence runs instead)."""
        why = self._decide(call, group, clip_coef)
        if why is not None:
            return why
        span, store = call.single, self._store
        li, base, length = span.layout, span.base, span.length
        moments = store.flat_state[li]
        beta1, beta2 = group["betas"]
        try:
            singlepass.single_pass_adamw_(
                store.flat_params[li].narrow(0, base, length),
                store.flat_grads[li].narrow(0, base, length), moments["exp_avg"],
                moments["exp_avg_sq"], moments["max_exp_avg_sq"] if group["amsgrad"] else None,
                span.steps, segments=span.segments, implementation=call.kind, lr=group["lr"],
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                maximize=bool(group["maximize"]), amsgrad=bool(group["amsgrad"]),
                threads=self._team()[0], clip_coef=clip_coef)
        except (ValueError, TypeError, ArithmeticError, singlepass.SinglePassUnavailable) as e:
            # raised before anything is modified (a NaN scalar, a step count giving a zero
            # bias correction): native runs, and fails or not, as native does
            return f"refused ({e})"
        # native's in-place ops bump the version counters of the parameters, their state and
        # (with the clip) gradients (autograd then refuses a backward through a graph that
        # saved the old values): so must the kernel's writes
        state = self.state
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step") if group["amsgrad"] else (
            "exp_avg", "exp_avg_sq", "step")
        torch.autograd.graph.increment_version(
            span.params + [state[p][k] for p in span.params for k in keys])
        return None

    @torch.no_grad()
    def clip_grad_norm_(self) -> Tensor:
        """As `cotangent.AdamW.clip_grad_norm_`, over the packed gradients."""
        if (live := _live(self)) is not self:
            return live.clip_grad_norm_()
        _compat.refuse_under_compile("cotangent.AdamW.clip_grad_norm_()")
        if self.max_norm is None:
            raise ValueError("clip_grad_norm_() needs the optimizer built with max_norm=...")
        self._clip(self._prepare())
        return self._last_total_norm

    @property
    def last_total_norm(self) -> Tensor | None:
        """The total norm of the last clip (0-dim, the gradients' promoted dtype), or None
        before any clip and once a backward delivered gradients that are not clipped yet."""
        if self._tracker is not None and self._norm_backwards == self._tracker.backwards:
            return self._last_total_norm
        return None

    @torch.no_grad()
    def _clip_if_due(self, defer: bool = False) -> None:
        """step()'s clip, unless these gradients are clipped already; with `defer`, the clip
        multiply may be left to the step's single passes (`_defer_clip`)."""
        if self.max_norm is None or self._clipped == (self._tracker.backwards,
                                                      self._tracker.resets):
            return
        inputs = self._prepare()
        self._clip(inputs, defer)
        self._prepared = inputs

    @torch.no_grad()
    def _clip(self, inputs: _StepInputs, defer: bool = False) -> None:
        """`clip_grad_norm_` over the present gradients, in clip order (may raise: nothing is
        modified before the total norm is known, except GradScaler's unscaling below)."""
        grads, store = inputs.grads, self._store
        grad_scale = getattr(self, "grad_scale", None)
        if grad_scale is not None:
            # Fused AdamW under GradScaler gets scaled gradients and the scale; native code
            # clips after `scaler.unscale_`, so unscale first (GradScaler's own arithmetic) and
            # run the update without the scale.
            _compat.unscale_grads_([grads.tensor(store, s) for s in grads.present], grad_scale)
            self._scale_applied = True
        outside = tensors_if_outside(self._clip_seq, grads, store)
        if outside is not None:  # not all in the buffer: clip them where they are
            total = clip_actual_tensors(outside, self.max_norm, self.norm_type,
                                        self.error_if_nonfinite)
        else:
            plan = inputs.plan
            if plan.clip is None:
                plan.clip = self._clipper.groups(plan.present, self._clip_seq.slots)
            total = self._clipper.clip(plan.clip, self.max_norm, self.error_if_nonfinite,
                                       defer=self._defer_clip if defer else None)
        # native's clip multiplies every gradient in place (by 1.0 too), bumping its version
        # counter; Cotangent's flat multiply, its skip of 1.0 and the multiply in the single
        # pass do not touch the gradient tensors' own counters: bump them as native would
        torch.autograd.graph.increment_version(
            [grads.tensor(store, s) for s in grads.present] + grads.adopted)
        self._last_total_norm = total
        self._norm_backwards = self._tracker.backwards
        self._clipped = (self._tracker.backwards, self._tracker.resets)

    # ------------------------------------------------------------------ noticing edits

    def _prepare(self) -> _StepInputs:
        """Notice every edit made since the last step, then list this step's gradients and check
        the state they will read. Raises (see the class docstring) before anything is modified."""
        self._refresh_structure()
        if self.max_norm is not None and self._clip_seq.refresh(self._store.params):
            self._planner.invalidate(plans=True)
        if self._store.sync_params():
            self._planner.invalidate()
        grads = self._tracker.scan()
        if grads.views_replaced:
            self._planner.invalidate()
        plan = self._planner.plan(grads.present)
        valid = self._planner.calls_valid(plan, self.state, self.param_groups)
        if not valid:
            check_state(self._store, self.state, self.param_groups, plan.group_slots)
        return _StepInputs(grads, plan, plan, valid)

    def _refresh_structure(self) -> None:
        """Repack when parameters were added to, removed from or replaced in the param groups;
        recalibrate when the thread count (probe verdicts depend on it) or the clipping settings
        changed."""
        groups = self.param_groups
        params = self._store.params
        check_clip_order_known(groups, self.max_norm, self._clip_order_params)  # max_norm edits
        if ([len(g["params"]) for g in groups] != self._group_sizes or not all(
                map(operator.is_, chain.from_iterable(g["params"] for g in groups), params))):
            self._repack()
        elif self._calibrated_for != self._calibration_settings():
            self._calibrate()

    def _calibration_settings(self) -> tuple:
        return (torch.get_num_threads(), self.max_norm is not None, self.norm_type,
                self.batched_norms)

    def _calibrate(self) -> None:
        """Probe (or look up) the norm and multiply verdicts; drop every cached plan."""
        self._calibrated_for = self._calibration_settings()
        self._clipper = (PackedClipper(self._store, self.norm_type, self.batched_norms)
                         if self.max_norm is not None else None)
        self._planner.invalidate(plans=True)

    def _adamw_calls(self, inputs: _StepInputs):
        """The native AdamW calls of this step: the plan's cached ones, or new ones after the
        state read by them was adopted into the flat buffers or initialised."""
        grads, plan = inputs.grads, inputs.update
        override = {}
        for slot, g in grads.foreign.items():
            group = self.param_groups[self._planner.group_of[slot]]
            if (merge.implementation(group, [g]) == "fused"
                    and not same_strides(g, self._store.params[slot])):
                # policy: CPU fused AdamW would read such a gradient in storage order (pytorch
                # #106951); it is read in the parameter's layout instead, after the clip
                self._tracker.take_in(slot, g)
            else:
                override[slot] = g  # for-loop and foreach take it as it is, like native
        if inputs.calls_valid and not override:
            return plan.calls
        if self._store.take_state(self.state, self.param_groups, plan.group_slots):
            self._planner.invalidate()
        return self._planner.build_calls(plan, self.state, self.param_groups, override)

    # ------------------------------------------------------------------ packing

    @torch.no_grad()
    def _repack(self) -> None:
        """(Re)build the flat buffers from the current param groups, gradients and state.
        Everything is validated before anything is modified."""
        check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        params = [p for g in self.param_groups for p in g["params"]]
        layouts = validate_params(params)
        self._clip_seq = ClipOrder(self._clip_order_params, params)
        old = self._tracker
        grads = gradients_to_carry(old, params)
        states = {slot: self.state[p] for slot, p in enumerate(params) if self.state.get(p)}
        detached = {id(old.store.params[s]) for s in old.store.detached} if old else set()
        if old is not None:
            old.remove_hooks()
        store = FlatStore.pack(params, layouts, grads, states, detached)
        tracker = GradientTracker(store, *((old.backwards, old.resets) if old else (0, 0)))
        for slot in grads:
            tracker.has_grad[slot] = True
        self._store, self._tracker = store, tracker
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._planner = Planner(store, self._group_sizes)
        self._calibrate()
        self._clipped, self._prepared = None, None

    def add_param_group(self, param_group: dict) -> None:
        """As `torch.optim.Optimizer.add_param_group`; afterwards all buffers are re-packed."""
        if (live := _live(self)) is not self:
            return live.add_param_group(param_group)
        torch.optim.AdamW.add_param_group(self, param_group)
        if self._store is not None:
            try:
                self._repack()
            except Exception:
                self.param_groups.pop()  # _repack validates before it modifies anything
                raise

    def load_state_dict(self, state_dict: dict) -> None:
        """As `torch.optim.Optimizer.load_state_dict` (native AdamW format), then the state moves
        into the flat buffers. Every moment is checked against its parameter first: a tensor of
        another shape (native would broadcast or fail mid-update) is a ValueError naming the
        parameter, and the optimizer is left exactly as it was."""
        if (live := _live(self)) is not self:
            return live.load_state_dict(state_dict)
        check_state_dict(state_dict, self.param_groups)
        before = (self.state, self.param_groups)
        try:
            torch.optim.AdamW.load_state_dict(self, state_dict)
            self._repack()
        except Exception:
            self.state, self.param_groups = before
            raise

    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds (flat `exp_avg`, `exp_avg_sq`,
        `max_exp_avg_sq` and step buffers)."""
        buffers = [b for per in self._store.flat_state for b in per.values()]
        buffers += self._store.step_buffers.values()
        return sum(b.numel() * b.element_size() for b in buffers)

    def __getstate__(self) -> dict:
        """For pickle and deepcopy: the state as compact tensors (a view would carry its whole
        flat buffer into a pickle), plus the clipping settings."""
        state = torch.optim.AdamW.__getstate__(self)
        state["state"] = compact_state(self.state)
        state.update(max_norm=self.max_norm, norm_type=self.norm_type,
                     error_if_nonfinite=self.error_if_nonfinite, batched_norms=self.batched_norms,
                     _clip_order_params=self._clip_order_params)
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickling or deep-copying repacks the (copied) parameters into new flat buffers.
        (`load_state_dict` calls this on a live optimizer; it repacks afterwards itself.)"""
        live = "_store" in self.__dict__
        torch.optim.AdamW.__setstate__(self, state)
        # native load_state_dict and unpickling both install a new state container here
        self.state = WatchedState(dict, self.state)
        if live:
            return
        self._live_ref = weakref.ref(self)
        self._store, self._tracker, self._shares = None, None, None
        self._last_total_norm, self._norm_backwards = None, -1
        self._clipped, self._prepared, self._scale_applied = None, None, False
        self._pending_clip = None
        self._repack()

    # ------------------------------------------------------------------ gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients, as `torch.optim.Optimizer.zero_grad`, keeping them in the flat buffer.

        ``set_to_none=True`` (default): every ``.grad`` reads None, as native, and nothing is
        written; the next backward's fresh gradients are copied into the flat buffer as they
        arrive. Under torch.distributed the buffer is filled with -0.0 instead and ``.grad`` is
        that view, so that the backward's accumulation reproduces a fresh gradient bit for bit
        (except while ``state`` is empty, before the first update or after it was cleared:
        then ``.grad`` reads None, as native; `torch.distributed.checkpoint` initialises the
        state of an optimizer only when it has no state and no gradient).
        ``set_to_none=False``: gradients that exist become +0.0 in place, as native; those that
        are ``None`` stay absent.

        Raises:
            RuntimeError: a parameter's storage was replaced (e.g. ``model.half()`` after the
                optimizer was built); inside ``torch.compile``.
            ValueError: ``max_norm`` set with two or more param groups and no `clip_order`
                (after an edit that made it so; see the class docstring).
        """
        if (live := _live(self)) is not self:
            return live.zero_grad(set_to_none)
        _compat.refuse_under_compile("cotangent.AdamW.zero_grad()")
        self._refresh_structure()
        if self._store.sync_params():
            self._planner.invalidate()
        # no state yet (a fresh optimizer): .grad reads None as native, in a process group too
        # (torch.distributed.checkpoint tells a fresh optimizer by exactly that)
        self._tracker.zero_grad(set_to_none, prefill=bool(self.state))

    # ------------------------------------------------------------------ introspection

    def layout_summary(self) -> list[dict]:
        """Per flat buffer: device, dtype, elements (with padding), tensors, buckets and how many
        buckets use the batched norm."""
        return self._store.layout_summary()

    def call_summary(self) -> dict:
        """How the last step ran AdamW: native list elements (per-parameter tensors plus merged
        ranges) against parameters, and the implementations used; plus `update_path()`'s
        ``path``, ``single_pass`` and ``single_pass_notes``."""
        return dict(self._planner.call_summary(), **self.update_path())

    def update_path(self) -> dict:
        """Which code updated the parameters at the last step.

        Returns a dict: ``path`` is "single-pass" (every parameter by the single-pass kernel,
        `cotangent.singlepass`), "native" (every parameter by native's functional AdamW: its
        for-loop / foreach op sequence or the fused kernel), "mixed", or None before the first
        step; ``single_pass`` and ``native`` count parameters; ``single_pass_notes`` lists why
        the single pass did not take the others (e.g. ``off (COTANGENT_SINGLE_PASS=0)``, the
        kernel unavailable, fused AdamW, a failed probe); ``clip_in_pass`` counts the parameters
        whose clip multiply (step()'s clip) ran inside their single pass; ``replayed`` is
        always False (the packed design has no replayed step)."""
        single, native, notes, clip_in_pass = getattr(self, "_paths", (0, 0, (), 0))
        path = None
        if single or native:
            path = "mixed" if single and native else ("single-pass" if single else "native")
        return dict(path=path, single_pass=single, native=native, single_pass_notes=list(notes),
                    clip_in_pass=clip_in_pass, replayed=False)
