"""`cotangent.AdamW`: `clip_grad_norm_` + `torch.optim.AdamW` as one update, reading every
tensor where the user and autograd left it.

Read `AdamW._update` top to bottom: it is the whole step. It gathers this step's parameters,
gradients and state per (param group, device, dtype), as native's `_init_group` does (checking
them first: nothing is modified before an error); computes the total gradient norm and clip
coefficient exactly as `clip_grad_norm_` (the per-tensor 2-norms of contiguous float32 CPU
gradients from one C call where its probe proved ATen's bits); lets the single-pass kernel
(`cotangent.singlepass`) take the for-loop, foreach and fused calls its probe proved equal to
native, with the clip multiply in the same pass (`_fold_rule` decides where); multiplies every
other gradient and runs every other call with native's own functions. Nothing is packed,
copied or tracked (ZeRO-1's broadcast buckets aside: `cotangent.sharding`): after `zero_grad()`
every ``.grad`` is None, after a backward ``p.grad`` is autograd's tensor, and the clipped
gradients are left in it, as native leaves them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import attrgetter, is_

import torch
from torch import Tensor

from cotangent import _compat, dtensor, merge, sharding, singlepass
from cotangent.clip import get_total_norm, multiply_grads_
from cotangent.clip_order import (
    PARAM_GROUPS,
    ClipOrder,
    check_clip_order_known,
    check_not_sharded_by_zero,
    normalize_clip_order,
)
from cotangent.norms import (check_finite, clip_coefficient, multiply_is_identity,
                             native_tensor_norms, total_norm)
from cotangent.spans import extent, is_dense_non_overlapping
from cotangent.state import check_state_dict, describe, state_problem


class NotShardedError(AttributeError, RuntimeError):
    """`AdamW.consolidate_state_dict` read on an optimizer built with ``shard=None``: an
    AttributeError for ``hasattr`` checks, a RuntimeError for callers."""


def _live(opt: AdamW) -> AdamW:
    """The optimizer `opt` stands for. A wrapper that subclasses the wrapped optimizer's class on
    the fly and copies its attributes (pytorch-lightning's `LightningOptimizer`, which
    `self.optimizers()` returns) runs our methods with itself as `self`: what they record
    (the last total norm, the clip witness) would land on the wrapper, unseen by the optimizer.
    Such calls go to the optimizer itself.

    Raises:
        RuntimeError: `opt` was never initialised and forwards to no optimizer.
    """
    ref = getattr(opt, "_live_ref", None)  # (the wrapper forwards attribute reads)
    live = ref() if ref is not None else None
    if live is None:
        raise RuntimeError(f"{type(opt).__name__} was not initialised (AdamW.__init__ did not "
                           "run) and forwards to no cotangent.AdamW")
    return live


@dataclass(slots=True)
class _Call:
    """One AdamW call of a step: the parameters with a gradient of one param group on one
    (device, dtype), with native's lists for them (in group order)."""

    group: dict
    kind: str  # "for-loop", "foreach" or "fused": what native runs for the group
    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor | None] = field(default_factory=list)  # None: state created later
    exp_avg_sqs: list[Tensor | None] = field(default_factory=list)
    max_exp_avg_sqs: list[Tensor | None] = field(default_factory=list)
    steps: list[Tensor | None] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)  # each parameter's index in group["params"]
    checked: bool = True  # `AdamW._check_param` ran on every parameter
    kernel: singlepass.Prepared | None = None  # the single pass takes this call
    clip_in_pass: bool = False  # and multiplies its gradients by the clip coefficient
    why_native: str | None = None


@dataclass(slots=True)
class _Clip:
    """This step's clip: the total norm, the coefficient (0-dim tensors, native's) and its value
    where the single pass may fold the multiply (None: every multiply runs natively)."""

    grads: list[Tensor]  # clip order
    ids: set[int]  # id() of each of them
    total: Tensor
    coef: Tensor
    value: float | None
    identity: bool  # the multiply by this coefficient changes no gradient (skipped)


def _refusal(p: Tensor) -> str | None:
    """Why `cotangent.AdamW` cannot take `p`, or None. DTensor parameters are taken where
    placed as FSDP2 places them (`dtensor.placement_refusal`); other wrapper subclasses are
    refused."""
    if dtensor.is_dtensor(p):
        return dtensor.placement_refusal(p)
    refusal = _compat.tensor_kind_refusal(p)
    if refusal is not None and isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
        return None  # a lazy module's parameter: materialised in place, read at each step
    return refusal


class AdamW(torch.optim.AdamW):
    r"""``clip_grad_norm_`` followed by `torch.optim.AdamW`, bitwise equal, in one update.

    Drop-in for ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type,
    error_if_nonfinite)`` then ``torch.optim.AdamW(params, ...).step()``: same constructor
    arguments and defaults as `torch.optim.AdamW` (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", 2019, as implemented by PyTorch), plus the clipping arguments. The
    parameters, gradients, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` and ``step`` come out
    bit for bit as with native code on the same device, dtype and torch version, in whichever
    implementation (for-loop, foreach, fused) torch itself picks for these arguments.

    Everything is read where it is, at every step, as native reads it: ``p.grad`` is autograd's
    tensor (or what you assigned), ``state[p]`` holds native AdamW's tensors (created as native
    creates them), `zero_grad()` is native's. Edits between steps (param groups, state,
    hyperparameters, ``p.data``) are simply what the next step reads.

    Where it is faster: for-loop, foreach and fused AdamW on float32 CPU parameters (and
    for-loop / foreach on bfloat16) run as one pass over each (param group, dtype) list
    (`cotangent.singlepass`: a C++ kernel compiled on first use, used where its probe proved
    native's bytes for these settings), with the clip multiply in the same pass for float32
    (`_fold_rule`), and with ``norm_type=2`` the per-tensor norms of contiguous float32 CPU
    gradients come from one C call where its probe proved ATen's norms; a clip coefficient of
    exactly 1.0 multiplies nothing (``g * 1.0 == g`` there, proven per step by
    `cotangent.norms.multiply_is_identity`).
    ``COTANGENT_SINGLE_PASS=0`` keeps native's op sequence; `update_path()` says what ran.

    Args:
        params: iterable of parameters or of param-group dicts, as for `torch.optim.AdamW`.
            FSDP2 (`fully_shard`) DTensor parameters placed ``Shard(0)`` / ``Replicate`` are
            updated on their local shards (`cotangent.dtensor`); other placements and other
            wrapper subclasses are refused.
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
            every clip), a zero-argument callable returning parameters, a fixed iterable of them,
            or ``"param_groups"`` (the optimizer's parameters, param groups concatenated, as
            Lightning's ``gradient_clip_val`` clips). Default (None): the optimizer's order when
            one param group holds parameters; with two or more and ``max_norm`` set it is
            required (a ValueError names it), since native loops clip ``model.parameters()`` or
            the param groups and the optimizer cannot see the model. As with native code,
            optimizer parameters missing from the order are updated unclipped, and others in it
            are clipped too.
        batched_norms: allow one calibrated 2-D norm over CPU gradients that happen to be
            equal, evenly spaced rows of one storage (`cotangent.clip`); ``False``: native
            per-tensor norms only.
        shard: ``None`` (default), or ``"zero1"``: parameter-aligned ZeRO-1 under
            `torch.distributed` (typically with DistributedDataParallel, whose all-reduce makes
            every rank's gradients equal; `cotangent.sharding`). Each rank holds and updates
            the AdamW state of one share of whole parameters (contiguous runs of the parameter
            list balanced by size; `share_of(p)` says whose); every rank checks and clips every
            gradient, updates its share where it is, then every parameter is broadcast from its
            owner. Parameters, gradients, norms and each share's state come out as the
            unsharded native loop's. ``state`` holds this rank's share only;
            `consolidate_state_dict()` then `state_dict()` give the whole state in native
            format. Every rank must make the same calls (step, zero_grad, param-group edits)
            in the same order: they are collectives.
        shard_norms: with ``shard="zero1"``, ``"all"`` (default): each rank computes every
            per-tensor norm; ``"share"``: the norms of its share only, all-gathered (as bytes)
            into native order. Both give `clip_grad_norm_`'s bits.
        process_group: with ``shard="zero1"``, the group to shard over (default: the default
            group).

    Attributes:
        last_total_norm: the total gradient norm of the last clip (0-dim tensor, as
            `clip_grad_norm_` returns it), until a backward delivers gradients the clip did not
            see; then ``None`` (also before any clip, without ``max_norm`` and after
            ``zero_grad(set_to_none=False)``), so after a step that `GradScaler` skipped, which
            it does by not calling `step()` for for-loop and foreach AdamW, it reads ``None``,
            never the previous step's norm.

    Raises:
        ValueError / RuntimeError at construction: everything `torch.optim.AdamW` raises; a
            DTensor parameter placed other than ``Shard(0)`` / ``Replicate`` (or any with
            ``shard="zero1"``); a wrapper-subclass parameter; non-numeric `max_norm`;
            ``max_norm`` with two or more param groups holding parameters and no `clip_order`
            (also from `add_param_group`, `step()` and `zero_grad()` after an edit that makes
            it so);
            ``max_norm`` without `clip_order` (or with ``"param_groups"``) inside
            `torch.distributed.optim.ZeroRedundancyOptimizer` (each rank's optimizer holds one
            shard: its clip would norm that shard alone); a bad `clip_order`; an unknown
            `shard` or `shard_norms`; ``shard="zero1"`` without an initialised process group,
            or with parameters on two devices or sharing memory (also from `add_param_group`
            and `step()` after an edit that makes it so).
        NotImplementedError: ``capturable=True`` or ``differentiable=True`` (also when set on a
            group later).
        RuntimeError from `step()` and `clip_grad_norm_()`, before anything is modified: a
            sparse gradient; a gradient whose shape, dtype or device differs from its
            parameter's; a ``state[p]`` that lacks an entry native AdamW reads or holds a tensor
            of another shape, dtype or device; a non-finite total norm with
            ``error_if_nonfinite``; a tensor ``lr`` with ``foreach=True``; the call happening
            inside ``torch.compile``; and what native AdamW raises itself.

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
                 batched_norms: bool = True, shard: str | None = None,
                 shard_norms: str = "all", process_group=None) -> None:
        zero = sharding.setup(shard, shard_norms, process_group)
        self._shares = None if zero is None else sharding.Shares(zero)
        try:
            max_norm = None if max_norm is None else float(max_norm)
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            raise ValueError(f"max_norm must be a number or None and norm_type a number, got "
                             f"max_norm={max_norm!r}, norm_type={norm_type!r}") from None
        self._live_ref = weakref.ref(self)
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
            capturable=capturable, differentiable=differentiable, fused=fused)
        if capturable or differentiable:
            raise NotImplementedError(
                "cotangent.AdamW supports capturable=False and differentiable=False only")
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.error_if_nonfinite = bool(error_if_nonfinite)
        self.batched_norms = bool(batched_norms)
        self._clip_order_params = normalize_clip_order(clip_order)
        check_not_sharded_by_zero(max_norm, self._clip_order_params)
        check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        if max_norm is not None:
            self._clip_order()  # a callable's result is checked now too (and at every clip)
        if self._shares is not None:
            self._shares.refresh(self.param_groups, self.state)
        self._reset_records()

    def _reset_records(self) -> None:
        self._last_clip: tuple | None = None  # (total norm, weakrefs to the clipped grads,
        # their versions): `_record_clip`
        self._paths = (0, 0, (), 0)
        self._direct_fused: dict = {}
        self._checked: dict = {}  # id(p) -> what `_check_param` last accepted (weakly)

    # ------------------------------------------------------------------ the update

    def step(self, closure=None):
        """Clip (if ``max_norm`` is set) and apply one AdamW update.

        The clip runs where user code calls `clip_grad_norm_`: before the step pre-hooks (when
        there are some), or, with a closure, right after the closure has computed the
        gradients. It is skipped when `clip_grad_norm_()` already clipped these gradients.

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
        check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        clip = self.max_norm is not None
        if clip and closure is None and _compat.has_step_pre_hooks(self):
            # a native loop clips before opt.step(), whose pre-hooks then see clipped gradients
            self._clip_apart()
            clip = False
        args = (self,) if closure is None else (self, closure)
        return _compat.run_with_step_hooks(
            self, lambda closure=None: self._update(closure, clip), args, {})

    _compat.mark_step_hooked(step)  # torch must not wrap it again: it runs the hooks itself

    @torch.no_grad()
    def _update(self, closure, clip: bool):
        """The step body, between torch's step pre- and post-hooks."""
        _compat.graph_capture_health_check(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        calls, fresh, agreement = self._gather()  # checks everything; modifies nothing
        order = self._clip_grads() if clip else None
        spread = None if order is None else dtensor.clip_mesh_gradient(order)
        if spread is not None:
            if grad_scale is not None or found_inf is not None:
                raise RuntimeError("GradScaler state (grad_scale / found_inf) with DTensor "
                                   "gradients: not followed by cotangent.AdamW")
            order = list(map(dtensor.local, order))  # (the clip reduces their norms, below)
        if order is not None and self._clipped_already(order):
            order = None  # clip_grad_norm_() clipped these gradients
        if order is not None and grad_scale is not None:
            sharding.finish_agree(agreement)
            agreement = None
            # fused AdamW under GradScaler gets scaled gradients and the scale; native code clips
            # after `scaler.unscale_`: unscale first (GradScaler's arithmetic), update unscaled
            _compat.unscale_grads_(order, grad_scale)
            grad_scale = None
        early = self._prepare_early(calls, order) if not fresh else None
        decisions: dict = {}
        cut = self._clip_norm(order, fold=grad_scale is None and found_inf is None,
                              prepared=early, team_now=lambda: self._team(decisions),
                              spread=spread) if order is not None else None
        sharding.finish_agree(agreement)  # (ZeRO-1: every rank's checks passed)
        self._create_state(fresh)
        extra: list[_Call] = []
        for call in calls:
            self._plan_kernel(call, cut, decisions, allowed=grad_scale is None
                              and found_inf is None, extra=extra)
        calls += extra
        kernels = any(c.kernel is not None for c in calls)
        disjoint = (kernels or self._shares is not None) and self._memory_disjoint(calls, cut)
        if kernels and not disjoint:
            calls = self._in_native_order(calls)
        later: list[Tensor] = []  # ZeRO-1: gradients of other shares, multiplied meanwhile
        if cut is not None:
            folded = {id(g) for c in calls if c.clip_in_pass for g in c.grads}
            rest = [g for g in cut.grads if id(g) not in folded]
            if self._shares is not None and not cut.identity and disjoint:
                # no update reads them and nothing shares their memory: their multiply runs
                # while the parameters travel
                read = {id(g) for c in calls for g in c.grads}
                # (a multiply that could raise, as native's does on an expanded or inference
                # gradient, runs before the update, where native's raises)
                later = [g for g in rest if id(g) not in read and type(g) is Tensor
                         and is_dense_non_overlapping(g) and not g.is_inference()]
                if later and singlepass.spans_disjoint(
                        [t.data_ptr() for t in chain(self._shares.params, later)],
                        [extent(t) for t in chain(self._shares.params, later)]):
                    held = set(map(id, later))
                    rest = [g for g in rest if id(g) not in held]
                else:
                    later = []  # (a gradient on a parameter's memory: native's order)
            if cut.identity:
                torch.autograd.graph.increment_version(rest)  # native's multiply bumps them
            else:
                multiply_grads_(rest, cut.coef)
        if (shares := self._shares) is None:
            paths = self._run_calls(calls, cut, decisions, grad_scale, found_inf)
        else:
            # ZeRO-1: an error native raises inside the update reaches every rank, and every
            # parameter still travels from its owner (no rank is left in a broadcast)
            error = None
            try:
                paths = self._run_calls(calls, cut, decisions, grad_scale, found_inf)
            except Exception as exc:
                error = exc
            agreed = sharding.start_agree(error, shares.zero, shares.device, sharding.DURING)
            pending = sharding.start_broadcast(shares.params, shares.shares, shares.zero)
            try:
                if later:  # other shares' clip multiply, while the parameters travel
                    multiply_grads_(later, cut.coef)
            finally:
                sharding.finish_broadcast(pending)
            sharding.finish_agree(agreed)
            shares.updates += 1
        if cut is not None:
            self._record_clip(cut.total, cut.grads)
        self._paths = paths
        return loss

    def _run_calls(self, calls: list[_Call], cut: _Clip | None, decisions: dict, grad_scale,
                   found_inf) -> tuple:
        """Run the step's calls (single pass where it was planned, else native's); returns
        `update_path`'s counts."""
        single = native = in_pass = 0
        notes = set()
        for call in calls:
            if not call.params:
                continue
            if call.kernel is not None and self._run_kernel(call, cut, decisions):
                single += len(call.params)
                in_pass += len(call.params) if call.clip_in_pass else 0
                continue
            if call.why_native:
                notes.add(call.why_native)
            native += len(call.params)
            self._run_native(call, grad_scale, found_inf)
        return single, native, tuple(sorted(notes)), in_pass

    # ------------------------------------------------------------------ step pieces

    def _gather(self) -> tuple[list[_Call], list[tuple[_Call, int]], tuple | None]:
        """This step's calls, one per (param group, device, dtype) of the parameters with a
        gradient (ZeRO-1: of this rank's share), the (call, index) of parameters whose state
        native would create now, and (ZeRO-1) the pending agreement of every rank's checks, for
        `sharding.finish_agree` before anything is modified (which raises on every rank when one
        rank's checks failed); None without ZeRO-1.

        Raises (before anything is modified): see the class docstring.
        """
        shares = self._shares
        if shares is None:
            return (*self._gather_calls(None), None)
        shares.refresh(self.param_groups, self.state)  # (raises alike on every rank)
        calls: list[_Call] = []
        fresh: list[tuple[_Call, int]] = []
        error = None
        try:
            calls, fresh = self._gather_calls(shares)
            for call in calls:  # checked now: no rank may fail later, alone
                if not call.checked:
                    for p in call.params:
                        self._check_param(p, bool(call.group["amsgrad"]))
                    call.checked = True
        except Exception as exc:
            error = exc
        pending = sharding.start_agree(error, shares.zero, shares.device)
        return calls, fresh, pending

    def _gather_calls(self, shares: sharding.Shares | None):
        calls: list[_Call] = []
        fresh: list[tuple[_Call, int]] = []
        state = self.state
        if len(self._checked) > 4 * len(state) + 64:
            self._checked.clear()  # (entries of parameters long gone)
        for group in self.param_groups:
            if group["capturable"] or group["differentiable"]:
                raise NotImplementedError(
                    "cotangent.AdamW supports capturable=False and differentiable=False only")
            params = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            if not params:
                continue
            if group["foreach"] and torch.is_tensor(group["lr"]):
                raise RuntimeError(
                    "lr as a Tensor is not supported for capturable=False and foreach=True")
            kind = merge.implementation(group, [p for _, p in params])
            amsgrad = bool(group["amsgrad"])
            if shares is not None:  # (the implementation is the whole group's choice)
                params = self._own_share(params, shares, amsgrad)
                if not params:
                    continue
            call = self._gather_alike(group, kind, params, amsgrad, fresh)
            if call is not None:
                calls.append(self._on_local_shards(call))
                continue
            by = {}
            for index, p in params:
                g = p.grad
                self._refuse_sparse(p)
                key = (p.device, p.dtype)
                call = by.get(key)
                if call is None:
                    call = by[key] = _Call(group, kind, [], [])
                    # a call the single pass may take is checked by it (`_plan_kernel`), and
                    # natively where it does not take it, before anything is modified
                    call.checked = singlepass.static_refusal(kind, p.device, p.dtype,
                                                             group) is not None
                    calls.append(call)
                if call.checked:
                    self._check_param(p, amsgrad)
                entry = state.get(p)
                if entry:
                    m, v, s = (entry.get("exp_avg"), entry.get("exp_avg_sq"),
                               entry.get("step"))
                    vmax = entry.get("max_exp_avg_sq") if amsgrad else None
                else:
                    if group["fused"]:
                        _compat.check_fused_support(p)
                    fresh.append((call, len(call.params)))
                    m = v = s = vmax = None
                call.params.append(p)
                call.pos.append(index)
                call.grads.append(g)
                call.exp_avgs.append(m)
                call.exp_avg_sqs.append(v)
                call.steps.append(s)
                if amsgrad:
                    call.max_exp_avg_sqs.append(vmax)
        return [self._on_local_shards(c) for c in calls], fresh

    def _gather_alike(self, group: dict, kind: str, params: list[tuple[int, Tensor]],
                      amsgrad: bool, fresh: list[tuple[_Call, int]]) -> _Call | None:
        """`_gather`'s call for a group whose parameters with a gradient share one device and
        dtype and all have state, gathered a list at a time (C-level loops); None otherwise
        (the general loop then runs, with its checks and errors)."""
        ps = [p for _, p in params]
        if len(set(map(_DTYPE, ps))) != 1 or len(set(map(_DEVICE, ps))) != 1:
            return None
        grads = [p.grad for p in ps]
        entries = list(map(self.state.get, ps))
        if (not all(entries) or not all(map(isinstance, entries, repeat(dict)))
                or any(map(_IS_SPARSE, grads))):
            return None
        call = _Call(group, kind, ps, grads)
        call.pos = [i for i, _ in params]
        call.exp_avgs = list(map(dict.get, entries, repeat("exp_avg")))
        call.exp_avg_sqs = list(map(dict.get, entries, repeat("exp_avg_sq")))
        call.steps = list(map(dict.get, entries, repeat("step")))
        if amsgrad:
            call.max_exp_avg_sqs = list(map(dict.get, entries, repeat("max_exp_avg_sq")))
        first = ps[0]
        call.checked = singlepass.static_refusal(kind, first.device, first.dtype,
                                                 group) is not None
        if call.checked:
            for p in ps:
                self._check_param(p, amsgrad)
        return call

    def _on_local_shards(self, call: _Call) -> _Call:
        """`call` over its DTensor parameters' local shards (FSDP2: native's AdamW runs the
        same ATen ops on them, `cotangent.dtensor`): every parameter checked as native reads
        it, with its gradient placed as the parameter; then the parameters, gradients and
        moments replaced by their local tensors (the step tensors are plain). A call without
        DTensors is returned as it is; plain parameters beside DTensors stay as they are in a
        for-loop call (native updates each alone).

        Raises (before anything is modified):
            RuntimeError: a gradient that is not a DTensor placed as its parameter; a plain
                parameter beside DTensors in a foreach or fused call (native's list ops raise
                there, after incrementing the steps); the checks of `_check_param`.
        """
        if not any(map(dtensor.is_dtensor, call.params)):
            return call
        amsgrad = bool(call.group["amsgrad"])
        for p in call.params:
            if dtensor.is_dtensor(p):
                problem = dtensor.gradient_refusal(p)
            else:  # (native's for-loop updates each parameter alone; its lists ops raise)
                problem = None if call.kind == "for-loop" else (
                    "is a plain parameter beside DTensor parameters in one "
                    f"{call.kind} AdamW call: native's {call.kind} AdamW raises mixing "
                    "torch.Tensor and DTensor")
            if problem:
                raise RuntimeError(f"{self._describe(p)} {problem}")
            if not call.checked:
                self._check_param(p, amsgrad)
        for i, p in enumerate(call.params):  # the state: what native's DTensor ops would read
            if not dtensor.is_dtensor(p):
                continue
            moments = [call.exp_avgs[i], call.exp_avg_sqs[i]] + (
                [call.max_exp_avg_sqs[i]] if amsgrad else [])
            if call.steps[i] is not None and type(call.steps[i]) is not Tensor:
                raise RuntimeError(f"{self._describe(p)} has a step of type "
                                   f"{type(call.steps[i]).__name__}: cotangent.AdamW follows "
                                   "FSDP2's plain 0-d step tensors only")
            for m in moments:
                if m is not None and not dtensor.placed_as(m, p):
                    raise RuntimeError(
                        f"{self._describe(p)} is a DTensor placed {tuple(p.placements)} whose "
                        "state holds a moment that is "
                        + (f"a DTensor placed {tuple(m.placements)}" if dtensor.is_dtensor(m)
                           else "a plain tensor (a checkpoint of an unsharded model?)")
                        + ": cotangent.AdamW follows moments placed as their parameter only "
                        "(load a sharded checkpoint, e.g. torch.distributed.checkpoint's "
                        "set_optimizer_state_dict)")
        call.checked = True
        local = dtensor.local
        call.params = list(map(local, call.params))
        call.grads = list(map(local, call.grads))
        call.exp_avgs = [None if t is None else local(t) for t in call.exp_avgs]
        call.exp_avg_sqs = [None if t is None else local(t) for t in call.exp_avg_sqs]
        call.max_exp_avg_sqs = [None if t is None else local(t) for t in call.max_exp_avg_sqs]
        return call

    def _own_share(self, params: list[tuple[int, Tensor]], shares: sharding.Shares,
                   amsgrad: bool) -> list[tuple[int, Tensor]]:
        """ZeRO-1: the (index, parameter) pairs of this rank's share; every other gradient is
        checked as native reads it (equal on every rank, so every rank raises alike)."""
        own = []
        for index, p in params:
            if shares.owns(p):
                own.append((index, p))
            else:
                self._refuse_sparse(p)
                self._check_param(p, amsgrad)  # (no state here: the gradient alone)
        return own

    def _refuse_sparse(self, p: Tensor) -> None:
        """Native AdamW's refusal of a sparse gradient, naming the parameter.

        Raises:
            RuntimeError: ``p.grad`` is sparse.
        """
        if p.grad.is_sparse:
            raise RuntimeError(f"{self._describe(p)} received a sparse gradient: Adam does not "
                               "support sparse gradients, please consider SparseAdam instead")

    def _check_param(self, p: Tensor, amsgrad: bool) -> None:
        """Native AdamW's inputs for `p` as native reads them, or a clear error: a gradient of
        `p`'s shape, dtype and device; a state entry with what native reads (`state_problem`).

        Raises:
            RuntimeError: naming the parameter.
        """
        g, shape = p.grad, p.shape
        if g.shape != shape or g.dtype is not p.dtype or (
                g.device != p.device if not (g.is_cpu and p.is_cpu) else False):
            raise RuntimeError(
                f"the gradient of {self._describe(p)} is {tuple(g.shape)} {g.dtype} on "
                f"{g.device}; native AdamW needs it to match the parameter")
        entry = self.state.get(p)
        if not entry:
            return
        m, v, s = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("step")
        vmax = entry.get("max_exp_avg_sq") if amsgrad else None
        # the same tensors as at the last check, and the parameter as it was then: nothing
        # native reads has changed shape, dtype or device (a moment resized in place aside)
        seen = self._checked.get(id(p))
        if (seen is not None and seen[0]() is p and seen[1]() is m and seen[2]() is v
                and seen[3]() is s and (vmax is None or seen[4]() is vmax)
                and seen[5] == shape and seen[6] is p.dtype and seen[7] == p.get_device()):
            return
        if not (_moment_ok(m, p) and _moment_ok(v, p) and type(s) is Tensor
                and s.numel() == 1 and (not amsgrad or _moment_ok(vmax, p))):
            problem = state_problem(self._slot(p), p, entry, amsgrad)
            if problem:
                raise RuntimeError(problem)
            return  # (accepted by the full check: e.g. a tensor subclass; not remembered)
        if p.device.type == "cpu" or p.device == m.device:
            self._checked[id(p)] = (weakref.ref(p), weakref.ref(m), weakref.ref(v),
                                    weakref.ref(s), weakref.ref(vmax) if vmax is not None
                                    else None, shape, p.dtype, p.get_device())

    def _create_state(self, fresh: list[tuple[_Call, int]]) -> None:
        """Native's lazy state initialisation (`torch.optim.Adam._init_group`) for parameters
        updated for the first time, filled into their calls' lists."""
        for call, i in fresh:
            group = call.group
            p = group["params"][call.pos[i]]  # (the DTensor, where the call holds its shard)
            entry = self.state[p]
            if not entry:  # (a parameter listed twice: created once, as native does)
                entry["step"] = _compat.new_step_tensor(p, fused=bool(group["fused"]),
                                                        capturable=bool(group["capturable"]))
                entry["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                entry["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    entry["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
            call.steps[i], call.exp_avgs[i] = entry["step"], dtensor.local(entry["exp_avg"])
            call.exp_avg_sqs[i] = dtensor.local(entry["exp_avg_sq"])
            if group["amsgrad"]:
                call.max_exp_avg_sqs[i] = dtensor.local(entry["max_exp_avg_sq"])

    def _clip_order(self) -> list[Tensor]:
        """`clip_grad_norm_`'s parameter list now: the clip order (a module's parameters and a
        callable's result read afresh), or the optimizer's parameters in param-group order."""
        source = self._clip_order_params
        if source is None or source == PARAM_GROUPS:
            return [p for g in self.param_groups for p in g["params"]]
        return ClipOrder.read(source)

    def _clip_grads(self) -> list[Tensor]:
        """The gradients `clip_grad_norm_` would clip now, in its order."""
        return [p.grad for p in self._clip_order() if p.grad is not None]

    def _prepare_early(self, calls: list[_Call], order: list[Tensor] | None):
        """Where the clip order's gradients are exactly one kernel-eligible call's gradients,
        in its order (one param group, one device and dtype: the common case), that call's
        lists checked for the kernel now (`singlepass.prepare_lists`, which modifies nothing),
        so that the clip's norms read the gradients' addresses from it; else None."""
        if order is None or len(calls) != 1 or self.norm_type != 2.0:
            return None
        call = calls[0]
        if (call.checked or len(call.grads) != len(order)
                or not all(map(_IS, call.grads, order))
                or not all(type(g) is Tensor for g in order)):
            return None
        left: list[int] = []
        try:
            prepared = singlepass.prepare_lists(
                call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                call.max_exp_avg_sqs if call.group["amsgrad"] else None, call.steps, left)
        except (TypeError, ValueError, RuntimeError):
            return None  # (`_plan_kernel` meets the same refusal and says why)
        if left or prepared.dtype != torch.float32 or not prepared.contiguous:
            return None
        call.kernel = prepared
        return prepared

    def _clip_norm(self, grads: list[Tensor], fold: bool,
                   prepared: singlepass.Prepared | None = None, team_now=None,
                   spread: Tensor | None = None) -> _Clip:
        """`clip_grad_norm_`'s total norm and clip coefficient over `grads` (raises with
        ``error_if_nonfinite`` before anything is modified). `fold`: the single pass may do the
        multiply (no GradScaler state, a CPU coefficient that is not NaN). `prepared`: a call's
        checked lists whose gradients are `grads` (`_prepare_early`); `team_now`: this step's
        `singlepass.team`. `spread`: `grads` are the local shards of DTensor gradients placed
        as this one (`dtensor.clip_mesh_gradient`): the stack of their norms becomes the
        DTensor native's stack is (`dtensor.spread_stack`), so that the total norm (the DTensor
        native's clip returns) and the coefficient reduce across ranks in DTensor's own code (a
        collective); the multiply uses the coefficient's replicated local value."""
        shares = self._shares
        across = None if spread is None else (
            lambda stacked: dtensor.spread_stack(stacked, spread, self.norm_type))
        if shares is not None and shares.zero.norms == "share":
            share_of = {id(p.grad): s for p, s in zip(shares.params, shares.shares)
                        if p.grad is not None}
            total = sharding.share_total_norm(
                grads, [share_of.get(id(g), -1) for g in grads], shares.zero, self.norm_type,
                lambda part: self._tensor_norms(part, team_now))
        elif self.norm_type == 2.0 and (prepared is not None or _plain_cpu_float32(grads)) and (
                singlepass.norms_proven(team_now)):
            # every per-tensor norm in one C call, with ATen's bits (proven by its probe)
            norms = (singlepass.tensor_norms(grads) if prepared is None else
                     singlepass.gradient_norms(prepared))
            total = total_norm(norms, self.norm_type, across)
        elif self.batched_norms and spread is None and all(
                g.device.type == "cpu" for g in grads[:1]):
            # (on CUDA a (B, K) row norm and `_foreach_norm` reduce in other trees: issue 29;
            # no batched-norm probe runs there until a measurement shows it can win)
            total = get_total_norm(grads, self.norm_type)
        else:
            norms = []
            first = grads[0].device if grads else None
            for device, _, idx in _compat.group_by_device_and_dtype(grads):
                part = native_tensor_norms([grads[i] for i in idx], self.norm_type, None)
                norms.extend(n.to(first) for n in part)
            total = total_norm([torch.stack(norms)] if norms else [], self.norm_type, across)
        if self.error_if_nonfinite:
            check_finite(total, self.norm_type)
        coef = dtensor.replicated_local(clip_coefficient(total, self.max_norm))
        # (an expanded or an inference gradient: native's multiply, by 1.0 too, raises; so
        # must ours)
        identity = multiply_is_identity(coef, self.norm_type, singlepass.flushing_now()) and (
            prepared is not None or (all(map(is_dense_non_overlapping, grads))
                                     and not any(map(Tensor.is_inference, grads))))
        ids = set(map(id, grads))
        value = None
        if (fold and not identity and len(ids) == len(grads) and coef.device.type == "cpu"
                and singlepass.switched_on()):  # (a gradient listed twice: native multiplies
            value = coef.item()                  # it twice)
            if value != value:
                value = None  # a NaN coefficient: the multiply runs natively (see singlepass)
        return _Clip(grads, ids, total, coef, value, identity)

    def _tensor_norms(self, grads: list[Tensor], team_now=None) -> list[Tensor]:
        """Native's per-tensor norms of `grads` (one device and dtype), from one C call where
        its probe proved ATen's bits."""
        if (self.norm_type == 2.0 and _plain_cpu_float32(grads)
                and singlepass.norms_proven(team_now)):
            return list(singlepass.tensor_norms(grads))
        return native_tensor_norms(grads, self.norm_type, None)

    def _clip_apart(self) -> Tensor:
        """`clip_grad_norm_` now, natively multiplied (unless these gradients are clipped
        already); returns the total norm."""
        grads = self._clip_grads()
        spread = dtensor.clip_mesh_gradient(grads)
        grads = list(map(dtensor.local, grads))
        if self._clipped_already(grads):
            return self._last_clip[0]
        sharding.finish_agree(self._gather()[2])  # a step's checks: nothing modified on bad input
        cut = self._clip_norm(grads, fold=False, spread=spread)
        if cut.identity:
            torch.autograd.graph.increment_version(grads)
        else:
            multiply_grads_(grads, cut.coef)
        self._record_clip(cut.total, grads)
        return cut.total

    def _record_clip(self, total: Tensor, grads: list[Tensor]) -> None:
        """Remember the clip: its total norm, and which gradients it left, by weak reference (a
        gradient is freed by ``zero_grad()`` as with native code) and version counter."""
        self._last_clip = (total, list(map(weakref.ref, grads)), list(map(_VERSION, grads)))

    def _clipped_already(self, grads: list[Tensor]) -> bool:
        """Whether `grads` are exactly the gradients the last clip left (same tensors, not
        written since)."""
        last = self._last_clip
        if last is None or len(last[1]) != len(grads):
            return False
        return all(a is b() and a._version == v for a, b, v in zip(grads, last[1], last[2]))

    def _plan_kernel(self, call: _Call, cut: _Clip | None, decisions: dict,
                     allowed: bool, extra: list[_Call]) -> None:
        """Whether the single pass takes `call` (`call.kernel`), and with the clip multiply
        (`call.clip_in_pass`, `_fold_rule`); else why not (`call.why_native`). Parameters the
        pass cannot take on their own (a gradient in other strides) leave `call` for a native
        call appended to `extra`."""
        device, dtype = call.params[0].device, call.params[0].dtype
        why = singlepass.static_refusal(call.kind, device, dtype, call.group)
        if why is None and not allowed:
            why = "GradScaler state (grad_scale / found_inf): native path"
        fold = why is None and _fold_rule(cut, dtype, call.grads)
        if why is None:
            why = self._decide(call, cut.value if fold else None, dtype, decisions)
            if why is not None and fold:  # the pass may still take the update, clip apart
                fold = False
                why = self._decide(call, None, dtype, decisions)
        if why is not None:
            call.kernel = None  # (lists checked before the clip, `_prepare_early`: unused)
        elif call.kernel is None:
            left: list[int] = []
            try:
                call.kernel = singlepass.prepare_lists(
                    call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                    call.max_exp_avg_sqs if call.group["amsgrad"] else None, call.steps, left)
            except (TypeError, ValueError, RuntimeError) as e:
                why = f"refused ({e})"
            if left and call.kernel is not None:
                rest = _split(call, left)
                rest.why_native = ("a gradient or state in other strides than its parameter's "
                                   "(or a parameter that is not dense): native path")
                extra.append(rest)
                if not call.params:
                    call.kernel = None
                    why = rest.why_native
        call.clip_in_pass = call.kernel is not None and fold
        call.why_native = why
        for c in ([call] if call.kernel is None else []) + extra:
            if not c.checked:  # what runs natively is checked as native reads it
                for p in c.params:
                    self._check_param(p, bool(c.group["amsgrad"]))
                c.checked = True

    def _decide(self, call: _Call, clip_coef: float | None, dtype: torch.dtype,
                decisions: dict) -> str | None:
        """`singlepass.decide` for `call`'s settings, asked once per step and argument."""
        key = (call.kind, id(call.group), clip_coef, dtype)
        if key not in decisions:
            decisions[key] = singlepass.decide(call.kind, call.group, clip_coef, dtype,
                                               lambda: self._team(decisions))
        return decisions[key]

    @staticmethod
    def _team(decisions: dict) -> tuple[int, tuple[int, ...]]:
        """`singlepass.team()`, asked once per step (no user code runs between this step's
        decisions and its passes)."""
        if "team" not in decisions:
            decisions["team"] = singlepass.team()
        return decisions["team"]

    @staticmethod
    def _memory_disjoint(calls: list[_Call], cut: _Clip | None) -> bool:
        """Whether no two tensors this step touches share memory: every call's parameters,
        gradients and state, and, with a clip, every clipped gradient (a non-dense tensor counts
        as all the memory it spans). Then the passes, each run as a whole with its clip
        multiply, and the native calls, in any order, give every element the operations native
        gives it, in native's order."""
        if (len(calls) == 1 and calls[0].kernel is not None
                and calls[0].kernel.disjoint is not None and (
                    cut is None or (len(cut.grads) == len(calls[0].grads)
                                    and all(map(_IS, cut.grads, calls[0].grads))))):
            return calls[0].kernel.disjoint  # (read with the lists: `tensorlists`)
        starts, nbytes = [], []
        seen = set()
        for c in calls:
            if c.kernel is not None:
                s, n = c.kernel.spans()
                starts += s
                nbytes += n
                seen.update(id(g) for g in c.grads)
                continue
            for t in chain(c.params, c.grads, c.exp_avgs, c.exp_avg_sqs, c.max_exp_avg_sqs,
                           c.steps):
                seen.add(id(t))
                starts.append(t.data_ptr())
                nbytes.append(extent(t))
        if cut is not None:
            for g in cut.grads:
                if id(g) not in seen:
                    starts.append(g.data_ptr())
                    nbytes.append(extent(g))
        return singlepass.spans_disjoint(starts, nbytes)

    def _in_native_order(self, calls: list[_Call]) -> list[_Call]:
        """Tensors of this step share memory: every group runs as native runs it, one native
        call over its parameters in group order (clip multiplies all natively first)."""
        merged: dict[int, _Call] = {}
        for c in calls:
            m = merged.get(id(c.group))
            if m is None:
                m = merged[id(c.group)] = _Call(c.group, c.kind, [], [])
                m.why_native = "tensors share memory: native path, in native's order"
            for i, p in enumerate(c.params):
                if not c.checked:
                    self._check_param(p, bool(c.group["amsgrad"]))
                m.pos.append(c.pos[i])
                m.params.append(p)
                m.grads.append(c.grads[i])
                m.exp_avgs.append(c.exp_avgs[i])
                m.exp_avg_sqs.append(c.exp_avg_sqs[i])
                m.steps.append(c.steps[i])
                if c.max_exp_avg_sqs:
                    m.max_exp_avg_sqs.append(c.max_exp_avg_sqs[i])
        out = []
        for m in merged.values():
            order = sorted(range(len(m.pos)), key=m.pos.__getitem__)
            for name in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                         "steps", "pos"):
                values = getattr(m, name)
                if values:
                    setattr(m, name, [values[i] for i in order])
            out.append(m)
        return out

    def _run_kernel(self, call: _Call, cut: _Clip | None, decisions: dict) -> bool:
        """Run `call` as one single pass; False (nothing modified, and its gradients
        multiplied natively where the pass was to do it) when the kernel refuses."""
        group = call.group
        beta1, beta2 = group["betas"]
        try:
            singlepass.launch(
                call.kernel, implementation=call.kind, lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"],
                maximize=bool(group["maximize"]), amsgrad=bool(group["amsgrad"]),
                threads=self._team(decisions)[0],
                clip_coef=cut.value if call.clip_in_pass else None)
        except (ValueError, TypeError, ArithmeticError, singlepass.SinglePassUnavailable) as e:
            # raised before anything is modified (a NaN scalar, a step count giving a zero bias
            # correction): native runs, and fails or not, as native does
            call.why_native = f"refused ({e})"
            if call.clip_in_pass:
                multiply_grads_(call.grads, cut.coef)
            return False
        _bump_versions(call, group)
        return True

    def _direct_fused_exact(self, device: torch.device, dtype: torch.dtype, group: dict) -> bool:
        """`merge.direct_fused_is_exact`, remembered by this optimizer per (device, dtype, the
        group's branches, thread count): building the verdict's key costs more than the
        lookup."""
        key = (device, dtype, bool(group["amsgrad"]), bool(group["maximize"]),
               merge.decay_kind(group), torch.is_tensor(group["lr"]), torch.get_num_threads())
        memo = self._direct_fused
        if key not in memo:
            memo[key] = merge.direct_fused_is_exact(device, dtype, group)
        return memo[key]

    def _run_native(self, call: _Call, grad_scale, found_inf) -> None:
        """Native's functional AdamW over `call`'s lists (the fused kernel called directly where
        `merge.direct_fused_is_exact` proved that equal)."""
        args = (call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.max_exp_avg_sqs,
                call.steps)
        p = call.params[0]
        if (call.kind == "fused" and grad_scale is None and found_inf is None
                and all(s.dtype is torch.float32 and s.device == p.device for s in call.steps)
                and self._direct_fused_exact(p.device, p.dtype, call.group)):
            # (other step tensors: native's functional path, and its checks and errors)
            merge.run_direct_fused(*args, group=call.group)
        else:
            merge.run_native_adamw(call.kind, *args, group=call.group, grad_scale=grad_scale,
                                   found_inf=found_inf)

    def _slot(self, p: Tensor) -> int:
        for slot, q in enumerate(q for g in self.param_groups for q in g["params"]):
            if q is p:
                return slot
        return -1

    def _describe(self, p: Tensor) -> str:
        return describe(self._slot(p), p)

    # ------------------------------------------------------------------ clipping on its own

    @torch.no_grad()
    def clip_grad_norm_(self) -> Tensor:
        """Clip the gradients now, exactly as ``torch.nn.utils.clip_grad_norm_(params, max_norm,
        norm_type, error_if_nonfinite)`` would at this point, and return the total norm;
        the next `step()` then does not clip them again.

        Use it where native code's clip sits apart from `optimizer.step()`: with
        `torch.amp.GradScaler`, ``scaler.unscale_(opt); norm = opt.clip_grad_norm_();
        scaler.step(opt)`` gives native's gradients and norm even on steps the scaler skips.

        Raises:
            ValueError: the optimizer was built with ``max_norm=None``.
            RuntimeError: as `step()`.
        """
        if (live := _live(self)) is not self:
            return live.clip_grad_norm_()
        _compat.refuse_under_compile("cotangent.AdamW.clip_grad_norm_()")
        if self.max_norm is None:
            raise ValueError("clip_grad_norm_() needs the optimizer built with max_norm=...")
        check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        self._last_clip = None  # an explicit call clips again, as native's would
        return self._clip_apart()

    @property
    def last_total_norm(self) -> Tensor | None:
        """The total norm of the last clip (0-dim, the gradients' promoted dtype), or None
        before any clip, after ``zero_grad(set_to_none=False)`` and once a gradient is not one
        the clip saw (a backward delivered new gradients)."""
        live = _live(self)
        last = live._last_clip
        if live.max_norm is None or last is None:
            return None
        ids = {id(g) for ref in last[1] if (g := ref()) is not None}  # (live: ids unique)
        fresh = any(p.grad is not None and id(dtensor.local(p.grad)) not in ids
                    for p in live._clip_order())
        return None if fresh else last[0]

    # ------------------------------------------------------------------ torch.optim surface

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As `torch.optim.Optimizer.zero_grad` (native's own code: with ``set_to_none`` every
        ``.grad`` becomes None and no memory stays held).

        Raises:
            RuntimeError: inside ``torch.compile``.
            ValueError: ``max_norm`` set with two or more param groups and no `clip_order`
                (after an edit that made it so; see the class docstring).
        """
        if (live := _live(self)) is not self:
            return live.zero_grad(set_to_none)
        _compat.refuse_under_compile("cotangent.AdamW.zero_grad()")
        check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        if not set_to_none:
            self._last_clip = None  # the gradients are zeros now, not the clipped ones
        if self._shares is not None:
            self._shares.refresh(self.param_groups, self.state)
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """As `torch.optim.Optimizer.add_param_group`, refusing DTensor parameters it cannot
        follow (`dtensor.placement_refusal`; any under ZeRO-1), wrapper-subclass parameters
        and (with ``max_norm``) a second group without `clip_order`; a refused group is not
        added."""
        if "_live_ref" in vars(self) and (live := _live(self)) is not self:
            return live.add_param_group(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                refusal = _refusal(p)
                if refusal is None and dtensor.is_dtensor(p) and getattr(
                        self, "_shares", None) is not None:
                    refusal = ("is a DTensor (FSDP2 shards it already): shard='zero1' is for "
                               "DistributedDataParallel; use cotangent.AdamW without shard")
                if refusal is not None:
                    raise ValueError(f"{self._describe(p)} {refusal}")
            if hasattr(self, "max_norm"):
                check_clip_order_known(self.param_groups, self.max_norm,
                                       self._clip_order_params)
            if getattr(self, "_shares", None) is not None and hasattr(self, "max_norm"):
                self._shares.refresh(self.param_groups, self.state)  # state moves to owners
        except Exception:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict) -> None:
        """As `torch.optim.Optimizer.load_state_dict` (native AdamW format). Every moment is
        checked against its parameter first: a tensor of another shape (native would broadcast
        or fail mid-update) is a ValueError naming the parameter, and nothing is loaded.
        ZeRO-1: load the whole (native-format) state dict on every rank; each keeps its
        share."""
        if (live := _live(self)) is not self:
            return live.load_state_dict(state_dict)
        check_state_dict(state_dict, self.param_groups)
        super().load_state_dict(state_dict)
        self._last_clip = None
        if self._shares is not None:  # every rank loaded every entry: each keeps its own
            self._shares.consolidated = None
            self._shares.drop_foreign(self.state)

    def state_dict(self) -> dict:
        """As `torch.optim.Optimizer.state_dict` (native AdamW format).

        ZeRO-1: the whole, unsharded state, as gathered by the last `consolidate_state_dict()`
        onto this rank; it loads into `torch.optim.AdamW` and into this optimizer (sharded or
        not) alike.

        Raises:
            RuntimeError: ZeRO-1 without a `consolidate_state_dict()` onto this rank since the
                last update.
        """
        if (live := _live(self)) is not self:
            return live.state_dict()
        if self._shares is None:
            return super().state_dict()
        whole, mine = self._shares.whole_state(), self.state
        try:
            self.state = whole
            return super().state_dict()
        finally:
            self.state = mine

    def __getstate__(self) -> dict:
        """For pickle and deepcopy: native's state plus the clipping settings.

        Raises:
            TypeError: ZeRO-1 (one rank's share and a process group cannot travel).
        """
        if self._shares is not None:
            raise TypeError("a cotangent.AdamW with shard='zero1' cannot be pickled or copied "
                            "(it holds one rank's share and a process group); save "
                            "consolidate_state_dict() + state_dict() instead")
        state = super().__getstate__()
        state.update(max_norm=self.max_norm, norm_type=self.norm_type,
                     error_if_nonfinite=self.error_if_nonfinite, batched_norms=self.batched_norms,
                     _clip_order_params=self._clip_order_params)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._live_ref = weakref.ref(self)
        # (`load_state_dict` calls this on a live optimizer: a ZeRO-1 plan stays; unpickling
        # and deepcopy never see one, `__getstate__` refuses them)
        self.__dict__.setdefault("_shares", None)
        self._reset_records()

    @property
    def consolidate_state_dict(self):
        """``consolidate_state_dict(to=0)``, ZeRO-1 only: gather every rank's share of the state
        onto rank `to` of the process group (None: onto every rank), so that `state_dict()` there
        returns the whole state in `torch.optim.AdamW`'s unsharded format. A collective: call it
        on every rank (as `torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict`).

        An optimizer built with ``shard=None`` has no such method (its `state_dict()` is whole
        already): reading the attribute raises `NotShardedError`, so that checkpointing code that
        asks ``hasattr(opt, "consolidate_state_dict")`` (pytorch-lightning, lightning-fabric)
        saves `state_dict()` as for any unsharded optimizer.

        Raises:
            NotShardedError (an AttributeError and a RuntimeError): ``shard=None``.
            ValueError (from the call): `to` is neither a rank of the group nor None.
        """
        live = _live(self)
        if live._shares is None:
            raise NotShardedError("consolidate_state_dict() is for shard='zero1'; this "
                                  "optimizer is not sharded")
        return live._consolidate_state_dict

    def _consolidate_state_dict(self, to: int | None = 0) -> None:
        self._shares.refresh(self.param_groups, self.state)
        self._shares.consolidate(self.state, to)

    def share_of(self, p: Tensor) -> int:
        """ZeRO-1: the rank (in the process group) that holds `p`'s state and updates it.

        Raises:
            NotShardedError: ``shard=None``.
            KeyError: `p` is not one of the optimizer's parameters.
        """
        live = _live(self)
        if live._shares is None:
            raise NotShardedError("share_of() is for shard='zero1'; this optimizer is not "
                                  "sharded")
        live._shares.refresh(live.param_groups, live.state)
        return live._shares.share_of[id(p)]

    # ------------------------------------------------------------------ introspection

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this optimizer holds (``exp_avg``, ``exp_avg_sq``,
        ``max_exp_avg_sq``, ``step``)."""
        return sum(t.numel() * t.element_size() for entry in self.state.values()
                   for t in entry.values() if isinstance(t, Tensor))

    def update_path(self) -> dict:
        """Which code updated the parameters at the last step.

        Returns a dict: ``path`` is "single-pass" (every parameter by the single-pass kernel,
        `cotangent.singlepass`), "native" (every parameter by native's functional AdamW: its
        for-loop / foreach op sequence or the fused kernel), "mixed", or None before the first
        step; ``single_pass`` and ``native`` count parameters; ``single_pass_notes`` lists why
        the single pass did not take the others (e.g. ``off (COTANGENT_SINGLE_PASS=0)``,
        GradScaler state, a failed probe); ``clip_in_pass`` counts the parameters whose clip
        multiply ran inside their single pass."""
        single, native, notes, clip_in_pass = self._paths
        path = None
        if single or native:
            path = "mixed" if single and native else ("single-pass" if single else "native")
        return dict(path=path, single_pass=single, native=native, single_pass_notes=list(notes),
                    clip_in_pass=clip_in_pass)


def _moment_ok(t, p: Tensor) -> bool:
    """The quick form of `cotangent.state.entry_problem` for a moment (the full check, with its
    message, runs where this fails): a dense tensor of `p`'s shape, dtype and device."""
    if not (dtensor.placed_as(t, p) if dtensor.is_dtensor(p)  # (FSDP2: placed as p)
            else type(t) is Tensor):
        return False
    return (t.shape == p.shape and t.dtype is p.dtype and t.layout is torch.strided
            and t.device == p.device)


def _plain_cpu_float32(grads: list[Tensor]) -> bool:
    """Whether `grads` are all contiguous float32 CPU tensors (no subclasses; no negative-bit
    view, whose memory holds the negated values; no ZeroTensor, which has none), at least
    one."""
    return bool(grads) and all(type(g) is Tensor and g.dtype is torch.float32 and g.is_cpu
                               and g.is_contiguous() and not g.is_neg()
                               and not _compat.is_zerotensor(g) for g in grads)


_IS = is_
_VERSION = attrgetter("_version")
_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")
_IS_SPARSE = attrgetter("is_sparse")


def _bump_versions(call: _Call, group: dict) -> None:
    """Bump the version counters of what a single pass over `call` wrote as native's ops bump
    them (autograd then refuses, or allows, a backward through a graph that saved the old
    values as it does natively): the step tensors are bumped by their increment already; the
    clip multiply bumps each gradient once; for-loop and foreach AdamW bump each parameter once
    per in-place op (``mul_`` for the decay, ``addcdiv_``), exp_avg once (``lerp_``), exp_avg_sq
    twice (``mul_``, ``addcmul_``), max_exp_avg_sq once; `torch._fused_adamw_` bumps none of
    them (measured, torch 2.13.0 CPU)."""
    bump = torch.autograd.graph.increment_version
    if call.clip_in_pass:
        bump(call.grads)
    if call.kind == "fused":
        return
    written = call.params + call.exp_avgs + call.exp_avg_sqs
    if group["amsgrad"]:
        written += call.max_exp_avg_sqs
    bump(written)
    bump(call.exp_avg_sqs if group["weight_decay"] == 0 else call.params + call.exp_avg_sqs)


def _split(call: _Call, indices: list[int]) -> _Call:
    """Move the parameters at `indices` out of `call` into a new call of the same group."""
    keep = [i for i in range(len(call.params)) if i not in set(indices)]
    rest = _Call(call.group, call.kind, [], [])
    rest.checked = call.checked
    for name in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps",
                 "pos"):
        values = getattr(call, name)
        if values:
            setattr(rest, name, [values[i] for i in indices])
            setattr(call, name, [values[i] for i in keep])
    return rest


def _fold_rule(cut: _Clip | None, dtype: torch.dtype, grads: list[Tensor]) -> bool:
    """The one rule for where the clip multiply runs: inside a call's single pass when this step
    clips with a coefficient the pass may use (`_Clip.value`: a CPU float32 coefficient, not
    NaN, not an identity multiply, each gradient listed once, no GradScaler state, no step
    pre-hook between the clip and the update), the call is float32 (bfloat16's multiply is not
    reproduced) and every gradient of the call is clipped (a parameter outside the clip order
    is updated unclipped); everywhere else natively, before the update, as `clip_grad_norm_`
    does. (`AdamW._memory_disjoint` must also hold for the whole step.)"""
    return (cut is not None and cut.value is not None and dtype == torch.float32
            and all(id(g) in cut.ids for g in grads))

