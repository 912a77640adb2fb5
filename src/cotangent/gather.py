"""What one `cotangent.AdamW` step works on: its AdamW calls, gathered and checked.

`gather` reads, per param group, the parameters that have a gradient and groups them by
(device, dtype) as native's ``_group_tensors_by_device_and_dtype`` does: one `Call` each, with
native's lists (parameters, gradients, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
``step``), read where the user and autograd left them (``p.grad`` and ``state[p]`` as they are
now). Everything native AdamW would refuse is refused here, naming the parameter, before
anything is modified (`check_param`); state native would create lazily is created by
`create_state` once the step's checks have passed. FSDP2 calls are turned into calls over the
local shards (`on_local_shards`); ZeRO-1 keeps this rank's share (`own_share`).

Internal to `cotangent.AdamW` (`cotangent.update` runs the step); functions take the optimizer
as their first argument.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cotangent import _compat, dtensor, merge, sharding, singlepass
from cotangent.clip_order import PARAM_GROUPS, ClipOrder
from cotangent.state import describe as describe_slot
from cotangent.state import state_problem

if TYPE_CHECKING:
    from cotangent.adamw import AdamW


@dataclass(slots=True)
class Call:
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
    checked: bool = True  # `check_param` ran on every parameter
    kernel: singlepass.Prepared | None = None  # the single pass takes this call
    clip_in_pass: bool = False  # and multiplies its gradients by the clip coefficient
    why_native: str | None = None
    # read whole by `singlepass.read_group`: every parameter of the group with a gradient, in
    # group order, each a plain dense contiguous CPU tensor (gradients distinct, none an
    # inference tensor), its lists checked and read into `kernel`
    whole: bool = False

    LISTS = ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "steps", "pos")


@dataclass(frozen=True, slots=True)
class Accepted:
    """What `check_param` accepted for a parameter (`AdamW._checked`, by its id): the tensors
    native reads, by weak reference, and the parameter's shape, dtype and device then."""

    param: weakref.ref
    exp_avg: weakref.ref
    exp_avg_sq: weakref.ref
    step: weakref.ref
    max_exp_avg_sq: weakref.ref | None  # None: checked without amsgrad
    shape: torch.Size
    dtype: torch.dtype
    device: int  # `Tensor.get_device()`: -1 on the CPU


def gather(opt: AdamW) -> tuple[list[Call], list[tuple[Call, int]], tuple | None]:
    """This step's calls, one per (param group, device, dtype) of the parameters with a
    gradient (ZeRO-1: of this rank's share), the (call, index) of parameters whose state
    native would create now, and (ZeRO-1) the pending agreement of every rank's checks, for
    `sharding.finish_agree` before anything is modified (which raises on every rank when one
    rank's checks failed); None without ZeRO-1.

    Raises (before anything is modified): see `cotangent.AdamW`.
    """
    shares = opt._shares
    if shares is None:
        return (*gather_calls(opt, None), None)
    shares.refresh(opt.param_groups, opt.state)  # (raises alike on every rank)
    calls: list[Call] = []
    fresh: list[tuple[Call, int]] = []
    error = None
    try:
        calls, fresh = gather_calls(opt, shares)
        for call in calls:  # checked now: no rank may fail later, alone
            if not call.checked:
                for p in call.params:
                    check_param(opt, p, bool(call.group["amsgrad"]))
                call.checked = True
    except Exception as exc:
        error = exc
    pending = sharding.start_agree(error, shares.zero, shares.device)
    return calls, fresh, pending


def gather_calls(opt: AdamW, shares: sharding.Shares | None
                 ) -> tuple[list[Call], list[tuple[Call, int]]]:
    """`gather`'s calls and fresh state slots, without ZeRO-1's agreement (`shares`: this
    rank's share, or None)."""
    calls: list[Call] = []
    fresh: list[tuple[Call, int]] = []
    state = opt.state
    if len(opt._checked) > 4 * len(state) + 64:
        opt._checked.clear()  # (entries of parameters long gone)
    for group in opt.param_groups:
        refuse_unread_group_entries(group)
        if group["capturable"] or group["differentiable"]:
            raise NotImplementedError(
                "cotangent.AdamW supports capturable=False and differentiable=False only")
        # the common case, read in C++ (ZeRO-1 keeps a share, read in Python)
        read = None if shares is not None else singlepass.read_group(
            group["params"], state, bool(group["amsgrad"]))
        if read is not None:
            if read[0]:
                calls.append(whole_call(group, read))
            continue
        params = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
        if not params:
            continue
        refuse_tensor_lr_with_foreach(group)
        kind = merge.implementation(group, [p for _, p in params])
        amsgrad = bool(group["amsgrad"])
        if shares is not None:  # (the implementation is the whole group's choice)
            params = own_share(opt, params, shares, amsgrad)
            if not params:
                continue
        call = gather_alike(opt, group, kind, params, amsgrad, fresh)
        if call is not None:
            calls.append(on_local_shards(opt, call))
            continue
        by = {}
        for index, p in params:
            g = p.grad
            refuse_sparse(opt, p)
            key = (p.device, p.dtype)
            call = by.get(key)
            if call is None:
                call = by[key] = Call(group, kind, [], [])
                # a call the single pass may take is checked by it (`update.plan_kernel`), and
                # natively where it does not take it, before anything is modified
                call.checked = singlepass.static_refusal(kind, p.device, p.dtype,
                                                         group) is not None
                calls.append(call)
            if call.checked:
                check_param(opt, p, amsgrad)
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
    return [c if c.whole else on_local_shards(opt, c) for c in calls], fresh


# the group settings native AdamW's step reads, in its order (`torch.optim.Adam.step`: betas,
# then the arguments of its `adam` call)
SETTINGS_READ = ("betas", "amsgrad", "lr", "weight_decay", "eps", "maximize", "foreach",
                 "capturable", "differentiable", "fused", "decoupled_weight_decay")


def refuse_unread_group_entries(group: dict) -> None:
    """Native's KeyError for a setting deleted from a param group (the first it would read),
    and a ``"params"`` entry of another type than list or tuple (a list subclass may iterate
    or index otherwise than its storage, which the C++ readers read), raised here before
    anything is modified.

    Raises:
        KeyError: the setting's name.
        TypeError: ``"params"`` is not a list or tuple.
    """
    for key in SETTINGS_READ:
        if key not in group:
            raise KeyError(key)
    params = group["params"]
    if type(params) not in (list, tuple):
        raise TypeError(
            f"a param group's 'params' is a {type(params).__name__}, not a list: cotangent.AdamW "
            "reads a group's parameters as a list or tuple (torch.optim's add_param_group makes "
            "it a list; a subclass's own iteration or indexing is not followed); assign "
            "list(...)")


def refuse_tensor_lr_with_foreach(group: dict) -> None:
    """Native foreach AdamW's refusal of a tensor lr without capturable.

    Raises:
        RuntimeError: native's message.
    """
    if group["foreach"] and torch.is_tensor(group["lr"]):
        raise RuntimeError(
            "lr as a Tensor is not supported for capturable=False and foreach=True")


def whole_call(group: dict, read: tuple) -> Call:
    """The call of a group read whole by `singlepass.read_group` (`read`: its result, with at
    least one parameter): checked, its lists in `Call.kernel`."""
    pos, ps, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, prepared = read
    refuse_tensor_lr_with_foreach(group)
    # (plain CPU tensors alike: native's device rule answers for all as for the first)
    return Call(group, merge.implementation(group, ps[:1]), ps, grads, exp_avgs, exp_avg_sqs,
                max_exp_avg_sqs, steps, pos, kernel=prepared, whole=True)


def gather_alike(opt: AdamW, group: dict, kind: str, params: list[tuple[int, Tensor]],
                  amsgrad: bool, fresh: list[tuple[Call, int]]) -> Call | None:
    """`gather`'s call for a group whose parameters with a gradient share one device and
    dtype and all have state, gathered a list at a time (C-level loops); None otherwise
    (the general loop then runs, with its checks and errors)."""
    ps = [p for _, p in params]
    if len(set(map(_DTYPE, ps))) != 1 or len(set(map(_DEVICE, ps))) != 1:
        return None
    grads = [p.grad for p in ps]
    entries = list(map(opt.state.get, ps))
    if (not all(entries) or not all(map(isinstance, entries, repeat(dict)))
            or any(map(_IS_SPARSE, grads))):
        return None
    call = Call(group, kind, ps, grads)
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
            check_param(opt, p, amsgrad)
    return call


def on_local_shards(opt: AdamW, call: Call) -> Call:
    """`call` over its DTensor parameters' local shards (FSDP2: native's AdamW runs the
    same ATen ops on them, `cotangent.dtensor`): every parameter checked as native reads
    it, with its gradient placed as the parameter; then the parameters, gradients and
    moments replaced by their local tensors (the step tensors are plain). A call without
    DTensors is returned as it is; plain parameters beside DTensors stay as they are in a
    for-loop call (native updates each alone).

    Raises (before anything is modified):
        RuntimeError: a gradient that is not a DTensor placed as its parameter; a plain
            parameter beside DTensors in a foreach or fused call (native's list ops raise
            there, after incrementing the steps); the checks of `check_param`.
    """
    if not dtensor.any_dtensor(call.params):
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
            raise RuntimeError(f"{describe(opt, p)} {problem}")
        if not call.checked:
            check_param(opt, p, amsgrad)
    for i, p in enumerate(call.params):  # the state: what native's DTensor ops would read
        if not dtensor.is_dtensor(p):
            continue
        moments = [call.exp_avgs[i], call.exp_avg_sqs[i]] + (
            [call.max_exp_avg_sqs[i]] if amsgrad else [])
        if call.steps[i] is not None and type(call.steps[i]) is not Tensor:
            raise RuntimeError(f"{describe(opt, p)} has a step of type "
                               f"{type(call.steps[i]).__name__}: cotangent.AdamW follows "
                               "FSDP2's plain 0-d step tensors only")
        for m in moments:
            if m is not None and not dtensor.placed_as(m, p):
                raise RuntimeError(
                    f"{describe(opt, p)} is a DTensor placed {tuple(p.placements)} whose "
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


def own_share(opt: AdamW, params: list[tuple[int, Tensor]], shares: sharding.Shares,
               amsgrad: bool) -> list[tuple[int, Tensor]]:
    """ZeRO-1: the (index, parameter) pairs of this rank's share; every other gradient is
    checked as native reads it (equal on every rank, so every rank raises alike)."""
    own = []
    for index, p in params:
        if shares.owns(p):
            own.append((index, p))
        else:
            refuse_sparse(opt, p)
            check_param(opt, p, amsgrad)  # (no state here: the gradient alone)
    return own


def refuse_sparse(opt: AdamW, p: Tensor) -> None:
    """Native AdamW's refusal of a sparse gradient, naming the parameter.

    Raises:
        RuntimeError: ``p.grad`` is sparse.
    """
    if p.grad.is_sparse:
        raise RuntimeError(f"{describe(opt, p)} received a sparse gradient: Adam does not "
                           "support sparse gradients, please consider SparseAdam instead")


def check_param(opt: AdamW, p: Tensor, amsgrad: bool) -> None:
    """Native AdamW's inputs for `p` as native reads them, or a clear error: a gradient of
    `p`'s shape, dtype and device; a state entry with what native reads (`state_problem`).

    Raises:
        RuntimeError: naming the parameter.
    """
    g, shape = p.grad, p.shape
    if g.shape != shape or g.dtype is not p.dtype or (
            g.device != p.device if not (g.is_cpu and p.is_cpu) else False):
        raise RuntimeError(
            f"the gradient of {describe(opt, p)} is {tuple(g.shape)} {g.dtype} on "
            f"{g.device}; native AdamW needs it to match the parameter")
    entry = opt.state.get(p)
    if not entry:
        return
    m, v, s = entry.get("exp_avg"), entry.get("exp_avg_sq"), entry.get("step")
    vmax = entry.get("max_exp_avg_sq") if amsgrad else None
    # the same tensors as at the last check (every entry native reads present: a deleted one
    # is None here, as is the weak reference to the freed tensor), the parameter as it was
    # then, and the moments still of its shape and dtype (`.data =` / `set_` change them in
    # place): nothing native reads has changed
    seen = opt._checked.get(id(p))
    if (seen is not None and m is not None and v is not None and s is not None
            and seen.param() is p and seen.exp_avg() is m and seen.exp_avg_sq() is v
            and seen.step() is s
            and (not amsgrad or vmax is not None and seen.max_exp_avg_sq is not None
                 and seen.max_exp_avg_sq() is vmax
                 and vmax.shape == shape and vmax.dtype is p.dtype)
            and seen.shape == shape and seen.dtype is p.dtype
            and seen.device == p.get_device() and m.shape == shape and v.shape == shape
            and m.dtype is p.dtype and v.dtype is p.dtype):
        return
    if not (moment_ok(m, p) and moment_ok(v, p) and type(s) is Tensor
            and s.numel() == 1 and (not amsgrad or moment_ok(vmax, p))):
        problem = state_problem(slot(opt, p), p, entry, amsgrad)
        if problem:
            raise RuntimeError(problem)
        return  # (accepted by the full check: e.g. a tensor subclass; not remembered)
    if p.device.type == "cpu" or p.device == m.device:
        opt._checked[id(p)] = Accepted(weakref.ref(p), weakref.ref(m), weakref.ref(v),
                                       weakref.ref(s), weakref.ref(vmax) if vmax is not None
                                       else None, shape, p.dtype, p.get_device())


def create_state(opt: AdamW, fresh: list[tuple[Call, int]]) -> None:
    """Native's lazy state initialisation (`torch.optim.Adam._init_group`) for parameters
    updated for the first time, filled into their calls' lists."""
    for call, i in fresh:
        group = call.group
        p = group["params"][call.pos[i]]  # (the DTensor, where the call holds its shard)
        entry = opt.state[p]
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


def clip_order(opt: AdamW) -> list[Tensor]:
    """`clip_grad_norm_`'s parameter list now: the clip order (a module's parameters and a
    callable's result read afresh), or the optimizer's parameters in param-group order."""
    source = opt._clip_order_params
    if source is None or source == PARAM_GROUPS:
        return [p for g in opt.param_groups for p in g["params"]]
    return ClipOrder.read(source)


def clip_grads(opt: AdamW, calls: list[Call] | None = None) -> list[Tensor]:
    """The gradients `clip_grad_norm_` would clip now, in its order. `calls`: this step's
    calls where `calls_are_clip_order` holds: their gradients are the clip's, in call order
    (one call: its list)."""
    if calls:
        return calls[0].grads if len(calls) == 1 else [g for c in calls for g in c.grads]
    return [p.grad for p in clip_order(opt) if p.grad is not None]


def calls_are_clip_order(opt: AdamW, calls: list[Call]) -> bool:
    """Whether this step's calls hold the clip's gradients in its order, each checked in C++:
    every call read whole (`Call.whole`: plain contiguous CPU gradients, none an inference
    tensor) and the default clip order (the param groups', where the calls come from)."""
    source = opt._clip_order_params
    return (bool(calls) and all(c.whole for c in calls)
            and (source is None or source == PARAM_GROUPS))


def in_native_order(opt: AdamW, calls: list[Call]) -> list[Call]:
    """Tensors of this step share memory: every group runs as native runs it, one native
    call over its parameters in group order (clip multiplies all natively first)."""
    merged: dict[int, Call] = {}
    for c in calls:
        m = merged.get(id(c.group))
        if m is None:
            m = merged[id(c.group)] = Call(c.group, c.kind, [], [])
            m.why_native = "tensors share memory: native path, in native's order"
        for i, p in enumerate(c.params):
            if not c.checked:
                check_param(opt, p, bool(c.group["amsgrad"]))
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
        for name in Call.LISTS:
            values = getattr(m, name)
            if values:
                setattr(m, name, [values[i] for i in order])
        out.append(m)
    return out


def slot(opt: AdamW, p: Tensor) -> int:
    """`p`'s index among the optimizer's parameters (param groups concatenated), or -1."""
    for index, q in enumerate(q for g in opt.param_groups for q in g["params"]):
        if q is p:
            return index
    return -1


def describe(opt: AdamW, p: Tensor) -> str:
    """`p` named for an error message: its slot, shape and dtype (`cotangent.state.describe`)."""
    return describe_slot(slot(opt, p), p)


def moment_ok(t, p: Tensor) -> bool:
    """The quick form of `cotangent.state.entry_problem` for a moment (the full check, with its
    message, runs where this fails): a dense tensor of `p`'s shape, dtype and device."""
    if not (dtensor.placed_as(t, p) if dtensor.is_dtensor(p)  # (FSDP2: placed as p)
            else type(t) is Tensor):
        return False
    return (t.shape == p.shape and t.dtype is p.dtype and t.layout is torch.strided
            and t.device == p.device)


def split(call: Call, indices: list[int]) -> Call:
    """Move the parameters at `indices` out of `call` into a new call of the same group."""
    keep = [i for i in range(len(call.params)) if i not in set(indices)]
    rest = Call(call.group, call.kind, [], [])
    rest.checked = call.checked
    for name in Call.LISTS:
        values = getattr(call, name)
        if values:
            setattr(rest, name, [values[i] for i in indices])
            setattr(call, name, [values[i] for i in keep])
    return rest


_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")
_IS_SPARSE = attrgetter("is_sparse")
