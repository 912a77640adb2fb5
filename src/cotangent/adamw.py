"""`cotangent.AdamW`: `clip_grad_norm_` + `torch.optim.AdamW` as one update, reading every
tensor where the user and autograd left it.

This module is the optimizer's surface: construction, `step()` (torch's hooks around
`run_step`: the last step's plan replayed, `cotangent.replay`, or `cotangent.update.update`,
the whole step read top to bottom: gather, clip, plan, multiply, update), `zero_grad()`,
`clip_grad_norm_()`, state dicts, pickling, ZeRO-1's consolidation.
What a step works on is gathered and checked in `cotangent.gather`; the clip is
`cotangent.clip.clip_norm`; the kernel is `cotangent.singlepass`. Nothing is packed, copied
or tracked (ZeRO-1's broadcast buckets aside: `cotangent.sharding`): after `zero_grad()` every
``.grad`` is None, after a backward ``p.grad`` is autograd's tensor, and the clipped gradients
are left in it, as native leaves them.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from cotangent import _compat, dtensor, gather, replay, sharding, tensorlists, update
from cotangent.clip import ClipRecord
from cotangent.clip_order import (
    check_clip_order_known,
    check_not_sharded_by_zero,
    normalize_clip_order,
)
from cotangent.state import check_state_dict


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


def run_step(opt: AdamW, closure, clip: bool):
    """The body of `AdamW.step` between torch's step pre- and post-hooks, under
    ``torch.no_grad()`` as native AdamW's step: the last step's plan replayed in one C++ call
    where everything it assumed still holds (`cotangent.replay.replay`), else the full step
    (`cotangent.update.update`: gather, clip, plan, multiply, the AdamW calls), which leaves a
    plan for the next. `clip`: whether this step clips. Returns the closure's loss, or None."""
    with _compat.grad_disabled():
        _compat.graph_capture_health_check(opt)
        replayed = replay.replay(opt, closure, clip) if opt._replay is not None else None
        if replayed is None:
            return update.update(opt, closure, clip)
        n, clip_in_pass = replayed
        opt._path = update.Path(n, 0, (), n if clip_in_pass else 0, replayed=True)
        return None


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


class _ZeroOneMethods:
    """`cotangent.AdamW`'s ZeRO-1 methods (``shard="zero1"``: `cotangent.sharding`)."""

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


class AdamW(_ZeroOneMethods, torch.optim.AdamW):
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

    Where it is faster: float32 CPU calls (and bfloat16 for-loop / foreach ones) run as one
    pass over each (param group, dtype) list with the clip multiply folded in, and the
    per-tensor 2-norms come from one C call, each where its probe proved native's bytes
    (`cotangent.singlepass`, docs/single-pass.md). ``COTANGENT_SINGLE_PASS=0`` keeps native's
    op sequence; `update_path()` says what ran.

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
        clip_order: what you would pass to `clip_grad_norm_` (its order decides the total
            norm's bits): a module (its ``parameters()`` read afresh at every clip), a
            zero-argument callable returning parameters, a fixed iterable of them, or
            ``"param_groups"`` (param groups concatenated, as Lightning clips). Default: the
            optimizer's order with one param group holding parameters; with two or more and
            ``max_norm`` it is required (the optimizer cannot see the model). As natively,
            parameters missing from it are updated unclipped, others in it clipped too.
        batched_norms: allow one calibrated 2-D norm over CPU gradients that happen to be
            equal, evenly spaced rows of one storage (`cotangent.clip`); ``False``: native
            per-tensor norms only.
        shard: ``None`` (default), or ``"zero1"``: parameter-aligned ZeRO-1 under
            `torch.distributed` (typically beside DistributedDataParallel; `cotangent.sharding`,
            docs/distributed.md). Each rank holds and updates the state of one share of whole
            parameters (`share_of(p)` says whose), clips every gradient, then every parameter
            is broadcast from its owner: native's bytes everywhere. ``state`` holds this rank's
            share; `consolidate_state_dict()` then `state_dict()` give the whole native state.
            Every rank must make the same calls in the same order: they are collectives.
        shard_norms: with ZeRO-1, ``"all"`` (default: each rank computes every per-tensor norm)
            or ``"share"`` (its share's, all-gathered as bytes into native order).
        process_group: with ZeRO-1, the group to shard over (default: the default group).

    Attributes:
        last_total_norm: the total gradient norm of the last clip (0-dim tensor, as
            `clip_grad_norm_` returns it), until a backward delivers gradients the clip did not
            see; then ``None`` (also before any clip, without ``max_norm`` and after
            ``zero_grad(set_to_none=False)``), so after a step that `GradScaler` skipped, which
            it does by not calling `step()` for for-loop and foreach AdamW, it reads ``None``,
            never the previous step's norm.

    Raises:
        ValueError / RuntimeError at construction: what `torch.optim.AdamW` raises; a DTensor
            parameter placed other than ``Shard(0)`` / ``Replicate`` (any, with ZeRO-1); a
            wrapper-subclass parameter; a non-numeric `max_norm`; a bad `clip_order`; no
            `clip_order` with ``max_norm`` and two or more param groups holding parameters, or
            inside `torch.distributed.optim.ZeroRedundancyOptimizer` (its clip would norm one
            shard); an unknown `shard` or `shard_norms`; ZeRO-1 without a process group, or
            over parameters on two devices or sharing memory. (`add_param_group`, `step()` and
            `zero_grad()` raise the same after an edit that makes it so.)
        NotImplementedError: ``capturable=True`` or ``differentiable=True`` (also set later).
        RuntimeError from `step()` and `clip_grad_norm_()`, before anything is modified: a
            sparse gradient; a gradient whose shape, dtype or device differs from its
            parameter's; a ``state[p]`` lacking an entry native AdamW reads or holding a tensor
            of another shape, dtype or device; a non-finite total norm with
            ``error_if_nonfinite``; a tensor ``lr`` with ``foreach=True``; a call inside
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
            gather.clip_order(self)  # a callable's result is checked now too (and at every clip)
        if self._shares is not None:
            self._shares.refresh(self.param_groups, self.state)
        self._reset_records()

    def _reset_records(self) -> None:
        self._last_clip: ClipRecord | None = None  # `clip.record_clip`
        self._path = update.Path()  # the last step's (`update_path`)
        self._direct_fused: dict = {}
        self._checked: dict = {}  # id(p) -> `gather.Accepted`: what `check_param` accepted
        self._replay = None  # the last step's `cotangent.replay.Plan`, for the next step

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
        if len(self.param_groups) > 1:  # (only two or more groups can make the order unknown)
            check_clip_order_known(self.param_groups, self.max_norm, self._clip_order_params)
        clip = self.max_norm is not None
        if clip and closure is None and _compat.has_step_pre_hooks(self):
            # a native loop clips before opt.step(), whose pre-hooks then see clipped gradients
            update.clip_apart(self)
            clip = False
        args = (self,) if closure is None else (self, closure)
        return _compat.run_with_step_hooks(
            self, lambda closure=None: run_step(self, closure, clip), args, {})

    _compat.mark_step_hooked(step)  # torch must not wrap it again: it runs the hooks itself

    @torch.no_grad()
    def clip_grad_norm_(self) -> Tensor:
        """Clip the gradients now, exactly as ``torch.nn.utils.clip_grad_norm_(params, max_norm,
        norm_type, error_if_nonfinite)`` would at this point, and return the total norm;
        the next `step()` then does not clip these gradient tensors again (even if they were
        written in between, as native's clip, edit, step), the step after it does.

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
        return update.clip_apart(self)

    @property
    def last_total_norm(self) -> Tensor | None:
        """The total norm of the last clip (0-dim, the gradients' promoted dtype), or None
        before any clip, after ``zero_grad(set_to_none=False)`` and once a gradient is not one
        the clip saw (a backward delivered new gradients)."""
        live = _live(self)
        last = live._last_clip
        if live.max_norm is None or last is None:
            return None
        return last.total if last.grads.cover(gather.clip_order(live)) else None

    # ------------------------------------------------------------------ torch.optim surface

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As `torch.optim.Optimizer.zero_grad`: with ``set_to_none`` every ``.grad`` becomes
        None and no memory stays held (for plain leaf parameters the loop of ``p.grad = None``
        runs in C++, `cotangent.tensorlists.grad_clearer`, inside native's profiler range;
        otherwise native's own code runs).

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
        clear = tensorlists.grad_clearer() if set_to_none else None
        if clear is not None and not _compat.torch_modes_active():
            if not hasattr(self, "_zero_grad_profile_name"):
                self._patch_step_function()  # (as native's first zero_grad)
            with torch.autograd.profiler.record_function(self._zero_grad_profile_name):
                if clear(self.param_groups):
                    return
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
                    raise ValueError(f"{gather.describe(self, p)} {refusal}")
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
        clip = self._last_clip
        super().load_state_dict(state_dict)  # (`__setstate__` resets the records)
        # a clip apart stays recorded: native's clip_grad_norm_, load_state_dict, step clips
        # once; the record is about the gradients, which loading does not touch
        self._last_clip = clip
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
        multiply ran inside their single pass; ``replayed`` is True where the step repeated the
        decisions of the one before in one C++ call (`cotangent.replay`)."""
        last = self._path
        single, native = last.single_pass, last.native
        path = None
        if single or native:
            path = "mixed" if single and native else ("single-pass" if single else "native")
        return dict(path=path, single_pass=single, native=native,
                    single_pass_notes=list(last.notes), clip_in_pass=last.clip_in_pass,
                    replayed=last.replayed)


