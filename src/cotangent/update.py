"""The body of `cotangent.AdamW.step()`: ``clip_grad_norm_`` then AdamW, read top to bottom.

`update` is the whole step, in five parts; it remembers its decisions for the next step, which
replays them in one C++ call where they still hold (`cotangent.replay`, called first by
`cotangent.adamw.run_step`):

1. gather: this step's AdamW calls, one per (param group, device, dtype), with native's lists
   read where the user and autograd left them, and everything checked (`cotangent.gather`:
   nothing is modified before an error);
2. clip: the total norm and clip coefficient, exactly as ``clip_grad_norm_``
   (`cotangent.clip.clip_norm`), then native's lazy state creation;
3. plan: which calls the single-pass kernel takes (`plan_kernel`: its probe proved native's
   bytes for these settings) and whether each folds the clip multiply
   (`cotangent.clip.fold_rule`, the one rule for where the multiply runs);
4. the clip multiply of every gradient no pass folds, natively (`multiply_rest`);
5. the AdamW calls: the single pass (`cotangent.singlepass.launch`) or native's functional
   AdamW (`run_native`); under ZeRO-1 then every parameter broadcast from its owner
   (`run_sharded`).

Internal to `cotangent.AdamW`; functions take the optimizer as their first argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import is_
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cotangent import _compat, dtensor, gather, merge, replay, sharding, singlepass
from cotangent.clip import (StepClip, clip_norm, clipped_already, fold_rule, multiply_grads_,
                            record_clip, refuse_unmultipliable, step_done)
from cotangent.gather import Call
from cotangent.spans import extent, is_dense_non_overlapping

if TYPE_CHECKING:
    from cotangent.adamw import AdamW


@dataclass(frozen=True, slots=True)
class Path:
    """Which code updated the parameters at a step (`AdamW.update_path` reports it)."""

    single_pass: int = 0  # parameters updated by the single pass
    native: int = 0  # ... by native's functional AdamW
    notes: tuple[str, ...] = ()  # why the single pass did not take the others
    clip_in_pass: int = 0  # parameters whose clip multiply ran inside their pass
    replayed: bool = False  # the step was the last one's plan, replayed (`cotangent.replay`)


def update(opt: AdamW, closure, clip: bool):
    """The full step of `opt` (`cotangent.adamw.run_step` calls it between torch's step pre-
    and post-hooks, under ``torch.no_grad()`` as native AdamW's step, where the last step's
    plan does not replay): the closure (if any), the clip (if `clip`) and the AdamW update;
    then the plan the next step may replay (`cotangent.replay.remember`). Returns the
    closure's loss, or None.

    Raises: see `cotangent.AdamW`; nothing is modified before an error is raised.
    """
    opt._replay = None
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    grad_scale = getattr(opt, "grad_scale", None)
    found_inf = getattr(opt, "found_inf", None)
    step = singlepass.Step()
    # 1. gather: every call's lists, checked (ZeRO-1: every rank's checks, agreed below)
    calls, fresh, agreement = gather.gather(opt)
    # (the clip order's gradients are the calls', checked in C++: `calls_are_clip_order`)
    whole = gather.calls_are_clip_order(opt, calls)
    # 2. clip: the clip order's gradients, their total norm and coefficient
    order = gather.clip_grads(opt, calls if whole else None) if clip else None
    spread = None if order is None or whole else dtensor.clip_mesh_gradient(order)
    if spread is not None:
        if grad_scale is not None or found_inf is not None:
            raise RuntimeError("GradScaler state (grad_scale / found_inf) with DTensor "
                               "gradients: not followed by cotangent.AdamW")
        order = list(map(dtensor.local, order))  # (the clip reduces their norms)
    if order is not None and clipped_already(opt, order):
        order = None  # clip_grad_norm_() clipped these gradients
    if order is not None and not whole:
        refuse_unmultipliable(opt, order)  # (native's multiply would raise mid-clip)
    if order is not None and grad_scale is not None:
        sharding.finish_agree(agreement)
        agreement = None
        # fused AdamW under GradScaler gets scaled gradients and the scale; native code clips
        # after `scaler.unscale_`: unscale first (GradScaler's arithmetic), update unscaled
        _compat.unscale_grads_(order, grad_scale)
        grad_scale = None
    scaled = grad_scale is not None or found_inf is not None
    cut = None
    if order is not None:
        early = prepare_early(opt, calls, order) if not fresh else None
        cut = clip_norm(opt, order, fold=not scaled, prepared=early, step=step,
                        spread=spread, distinct=whole and order is calls[0].grads)
    sharding.finish_agree(agreement)  # (ZeRO-1: every rank's checks passed)
    gather.create_state(opt, fresh)
    # 3. plan: the calls the single pass takes, with or without the clip multiply
    extra: list[Call] = []
    for call in calls:
        plan_kernel(opt, call, cut, step, allowed=not scaled, extra=extra)
    calls += extra
    kernels = any(c.kernel is not None for c in calls)
    disjoint = (kernels or opt._shares is not None) and memory_disjoint(calls, cut)
    if kernels and not disjoint:
        calls = gather.in_native_order(opt, calls)
    # 4. the clip multiply of the gradients no pass multiplies
    later = []
    if cut is not None and not (len(calls) == 1 and calls[0].clip_in_pass
                                and calls[0].grads is cut.grads):  # (else: all in the pass)
        later = multiply_rest(opt, calls, cut, disjoint)
    # 5. the AdamW calls
    if opt._shares is None:
        path = run_calls(opt, calls, cut, step, grad_scale, found_inf)
    else:
        path = run_sharded(opt, calls, cut, step, grad_scale, found_inf, later)
    if cut is not None:
        record_clip(opt, cut.total, cut.grads, apart=False)
    else:
        step_done(opt)  # (a clip apart from this step is used up)
    opt._path = path
    if replay.replayer_available():
        opt._replay = replay.remember(opt, calls, cut, clip, step, path.single_pass)
    return loss


def clip_apart(opt: AdamW) -> Tensor:
    """`clip_grad_norm_` now, natively multiplied (unless these gradients are clipped
    already); returns the total norm. For a clip that user code runs apart from the step
    (`AdamW.clip_grad_norm_`, or before step pre-hooks)."""
    grads = gather.clip_grads(opt)
    spread = dtensor.clip_mesh_gradient(grads)
    grads = list(map(dtensor.local, grads))
    if clipped_already(opt, grads):
        return opt._last_clip.total
    sharding.finish_agree(gather.gather(opt)[2])  # a step's checks: nothing modified on bad input
    refuse_unmultipliable(opt, grads)
    cut = clip_norm(opt, grads, fold=False, spread=spread)
    if cut.identity:
        torch.autograd.graph.increment_version(grads)
    else:
        multiply_grads_(grads, cut.coef)
    record_clip(opt, cut.total, grads, apart=True)
    return cut.total


def prepare_early(opt: AdamW, calls: list[Call], order: list[Tensor]):
    """Where the clip order's gradients are exactly one kernel-eligible call's gradients,
    in its order (one param group, one device and dtype: the common case), that call's
    lists checked for the kernel now (`singlepass.prepare_lists`, which modifies nothing),
    so that the clip's norms read the gradients' addresses from it; else None."""
    if len(calls) != 1 or opt.norm_type != 2.0:
        return None
    call = calls[0]
    if call.whole and call.grads is order:  # (read with its lists: `gather.whole_call`)
        return call.kernel if call.kernel.dtype is torch.float32 else None
    if (call.checked or len(call.grads) != len(order)
            or not all(map(is_, call.grads, order))
            or not all(type(g) is Tensor for g in order)):
        return None
    left: list[int] = []
    try:
        prepared = singlepass.prepare_lists(
            call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
            call.max_exp_avg_sqs if call.group["amsgrad"] else None, call.steps, left)
    except (TypeError, ValueError, RuntimeError):
        return None  # (`plan_kernel` meets the same refusal and says why)
    if left or prepared.dtype != torch.float32 or not prepared.contiguous:
        return None
    call.kernel = prepared
    return prepared


def plan_kernel(opt: AdamW, call: Call, cut: StepClip | None, step: singlepass.Step, *,
                allowed: bool, extra: list[Call]) -> None:
    """Whether the single pass takes `call` (`call.kernel`), and with the clip multiply
    (`call.clip_in_pass`, `fold_rule`); else why not (`call.why_native`). `allowed`: False
    under GradScaler state. Parameters the pass cannot take on their own (a gradient in
    other strides) leave `call` for a native call appended to `extra`."""
    device, dtype = call.params[0].device, call.params[0].dtype
    why = singlepass.static_refusal(call.kind, device, dtype, call.group)
    if why is None and not allowed:
        why = "GradScaler state (grad_scale / found_inf): native path"
    fold = why is None and fold_rule(cut, dtype, call.grads)
    if why is None:
        why = step.decide(call.kind, call.group, cut.value if fold else None, dtype)
        if why is not None and fold:  # the pass may still take the update, clip apart
            fold = False
            why = step.decide(call.kind, call.group, None, dtype)
    if why is not None:
        call.kernel = None  # (lists checked before the clip, `prepare_early`: unused)
    elif call.kernel is None:
        left: list[int] = []
        try:
            call.kernel = singlepass.prepare_lists(
                call.params, call.grads, call.exp_avgs, call.exp_avg_sqs,
                call.max_exp_avg_sqs if call.group["amsgrad"] else None, call.steps, left)
        except (TypeError, ValueError, RuntimeError) as e:
            why = f"refused ({e})"
        if left and call.kernel is not None:
            rest = gather.split(call, left)
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
                gather.check_param(opt, p, bool(c.group["amsgrad"]))
            c.checked = True


def memory_disjoint(calls: list[Call], cut: StepClip | None) -> bool:
    """Whether no two tensors this step touches share memory: every call's parameters,
    gradients and state, and, with a clip, every clipped gradient (a non-dense tensor counts
    as all the memory it spans). Then the passes, each run as a whole with its clip
    multiply, and the native calls, in any order, give every element the operations native
    gives it, in native's order."""
    if (len(calls) == 1 and calls[0].kernel is not None
            and calls[0].kernel.disjoint is not None and (
                cut is None or cut.grads is calls[0].grads
                or (len(cut.grads) == len(calls[0].grads)
                    and all(map(is_, cut.grads, calls[0].grads))))):
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


def multiply_rest(opt: AdamW, calls: list[Call], cut: StepClip, disjoint: bool) -> list[Tensor]:
    """The clip multiply of every clipped gradient whose call's pass does not fold it, natively
    (a coefficient of exactly 1.0 only bumps their versions, as native's multiply does).
    Returns the gradients held back: under ZeRO-1, other shares' gradients that no update
    reads and whose memory nothing else shares, multiplied while the parameters travel."""
    folded = {id(g) for c in calls if c.clip_in_pass for g in c.grads}
    rest = [g for g in cut.grads if id(g) not in folded]
    later: list[Tensor] = []
    if opt._shares is not None and not cut.identity and disjoint:
        read = {id(g) for c in calls for g in c.grads}
        # (a multiply that could raise, as native's does on an expanded or inference
        # gradient, runs before the update, where native's raises)
        later = [g for g in rest if id(g) not in read and type(g) is Tensor
                 and is_dense_non_overlapping(g) and not g.is_inference()]
        if later and singlepass.spans_disjoint(
                [t.data_ptr() for t in chain(opt._shares.params, later)],
                [extent(t) for t in chain(opt._shares.params, later)]):
            held = set(map(id, later))
            rest = [g for g in rest if id(g) not in held]
        else:
            later = []  # (a gradient on a parameter's memory: native's order)
    if cut.identity:
        torch.autograd.graph.increment_version(rest)  # native's multiply bumps them
    else:
        multiply_grads_(rest, cut.coef)
    return later


def run_calls(opt: AdamW, calls: list[Call], cut: StepClip | None, step: singlepass.Step,
              grad_scale, found_inf) -> Path:
    """Run the step's calls: the single pass where it was planned, else native's."""
    single = native = in_pass = 0
    notes = set()
    for call in calls:
        if not call.params:
            continue
        if call.kernel is not None and run_kernel(call, cut, step):
            single += len(call.params)
            in_pass += len(call.params) if call.clip_in_pass else 0
            continue
        if call.why_native:
            notes.add(call.why_native)
        native += len(call.params)
        run_native(opt, call, grad_scale, found_inf)
    return Path(single, native, tuple(sorted(notes)), in_pass)


def run_sharded(opt: AdamW, calls: list[Call], cut: StepClip | None, step: singlepass.Step,
                grad_scale, found_inf, later: list[Tensor]) -> Path:
    """ZeRO-1's `run_calls`: this rank's share updated, then every parameter broadcast from its
    owner while the held-back clip multiplies run (`multiply_rest`). An error native raises
    inside the update reaches every rank, and every parameter still travels (no rank is left
    waiting in a broadcast)."""
    shares = opt._shares
    error = None
    path = Path()
    try:
        path = run_calls(opt, calls, cut, step, grad_scale, found_inf)
    except Exception as exc:
        error = exc
    agreed = sharding.start_agree(error, shares.zero, shares.device, sharding.DURING)
    pending = sharding.start_broadcast(shares.params, shares.shares, shares.zero)
    try:
        if later:
            multiply_grads_(later, cut.coef)
    finally:
        sharding.finish_broadcast(pending)
    sharding.finish_agree(agreed)
    shares.updates += 1
    return path


def run_kernel(call: Call, cut: StepClip | None, step: singlepass.Step) -> bool:
    """Run `call` as one single pass; False (nothing modified, and its gradients
    multiplied natively where the pass was to do it) when the kernel refuses."""
    group = call.group
    beta1, beta2 = group["betas"]
    try:
        singlepass.launch(
            call.kernel, implementation=call.kind, lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"],
            maximize=bool(group["maximize"]), amsgrad=bool(group["amsgrad"]),
            threads=step.team()[0], clip_coef=cut.value if call.clip_in_pass else None)
    except (ValueError, TypeError, ArithmeticError, singlepass.SinglePassUnavailable) as e:
        # raised before anything is modified (a NaN scalar, a step count giving a zero bias
        # correction): native runs, and fails or not, as native does
        call.why_native = f"refused ({e})"
        if call.clip_in_pass:
            multiply_grads_(call.grads, cut.coef)
        return False
    bump_versions(call)
    return True


def bump_versions(call: Call) -> None:
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
    group = call.group
    written = call.params + call.exp_avgs + call.exp_avg_sqs
    if group["amsgrad"]:
        written += call.max_exp_avg_sqs
    bump(written)
    bump(call.exp_avg_sqs if group["weight_decay"] == 0 else call.params + call.exp_avg_sqs)


def run_native(opt: AdamW, call: Call, grad_scale, found_inf) -> None:
    """Native's functional AdamW over `call`'s lists (the fused kernel called directly where
    `merge.direct_fused_is_exact` proved that equal; the verdict remembered by `opt` per
    (device, dtype, the group's branches, thread count): building its key costs more than
    the lookup)."""
    args = (call.params, call.grads, call.exp_avgs, call.exp_avg_sqs, call.max_exp_avg_sqs,
            call.steps)
    p, group = call.params[0], call.group
    direct = False
    if (call.kind == "fused" and grad_scale is None and found_inf is None
            and merge.fused_flags_accepted(group)
            and all(s.dtype is torch.float32 and s.device == p.device for s in call.steps)):
        # (other step tensors or flags: native's functional path, and its checks and errors)
        key = (p.device, p.dtype, bool(group["amsgrad"]), bool(group["maximize"]),
               merge.decay_kind(group), torch.is_tensor(group["lr"]), torch.get_num_threads())
        if key not in opt._direct_fused:
            opt._direct_fused[key] = merge.direct_fused_is_exact(p.device, p.dtype, group)
        direct = opt._direct_fused[key]
    if direct:
        merge.run_direct_fused(*args, group=group)
    else:
        merge.run_native_adamw(call.kind, *args, group=group, grad_scale=grad_scale,
                               found_inf=found_inf)
