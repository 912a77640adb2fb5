"""The last step, replayed: a step that makes the decisions the full step made last time, in
one C++ call, where every input of those decisions is as it was then.

A full step (`cotangent.update.update`) decides, for one param group, what native AdamW would
run and whether the single pass may take it: the implementation from the group's flags, the
clip order and clip settings, the OpenMP team, the probes' verdicts for the hyperparameters'
classes, the vector body / scalar tail pieces for these tensor sizes. Between steps of a
training loop none of that usually changes; only the gradients are new and the step counts
and (with a schedule) the learning rate move. So where the full step was the common case —
one param group whose parameters with a gradient were read whole in C++ (plain dense
contiguous float32 CPU tensors, float32 steps, no memory shared) and updated by one single
pass, with the clip's norms from the kernel — it leaves a `Plan` (`remember`), and the next step
runs `tensorlists.Replay.run`: the same reader, norms, clip scalars (`singlepass.clip_scalars`),
native's step scalars, kernel and version bumps, checking as it goes that each input is what
the plan assumed (the group's settings, the learning rate's and decay's float32 classes, the
tensor sizes, the team and its float modes, the thread count, the clip coefficient's class,
whose verdict it asks of `Step.decide` once). Anything else declines, before anything is
modified, and the full step runs and remembers anew. `replay` checks what only Python sees
first: the param groups, the optimizer's clip settings, a closure, a clip apart from the step,
the switch's text and torch modes (what `singlepass.verdicts.off_reason` reads), a fork, the
kernel build and the verdict cache. Once the plan holds the verdict for the clip coefficient's
float32 class, every function a replayed step calls lives in this module, `cotangent.adamw`
(`run_step`) or `cotangent._compat`, then in C++; the first replay of a plan, or a coefficient
of a class it has not met, asks `singlepass.Step.decide` once from C++.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cotangent import _compat, singlepass, tensorlists
from cotangent.clip import ClipRecord, SeenGradients
from cotangent.clip_order import PARAM_GROUPS
from cotangent.singlepass.verdicts import ENV_SWITCH

if TYPE_CHECKING:
    from cotangent.adamw import AdamW
    from cotangent.clip import StepClip
    from cotangent.gather import Call

# the group settings native AdamW reads, besides lr (which may move within its float32 class)
# and params (read at every step)
SETTINGS = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "fused",
            "capturable", "differentiable", "decoupled_weight_decay")
KINDS = {"for-loop": 0, "foreach": 1, "fused": 2}


@dataclass(slots=True)
class Plan:
    """What the next step may replay (`remember`), and what only Python checks (`replay`)."""

    compiled: object  # `tensorlists.Replay`
    groups: list  # opt.param_groups, holding `group` alone
    group: dict
    kind: str
    clip: bool
    max_norm: bytes | None  # the optimizer's clip settings then (`_max_norm`)
    error_if_nonfinite: bool
    clip_order: object  # opt._clip_order_params (compared by identity)
    build: object  # the kernel build then (`singlepass.kernel._BUILD`)
    generation: int  # `singlepass.verdicts.GENERATION` then
    switch: str | None  # ``COTANGENT_SINGLE_PASS`` then (`singlepass.verdicts.switched_on`)


def _max_norm(opt: AdamW) -> bytes | None:
    """``max_norm`` as a float's bytes (-0.0 is not 0.0; an int as its float), else None."""
    value = opt.max_norm
    try:
        return struct.pack("d", value) if type(value) in (float, int) else None
    except (OverflowError, struct.error):  # (an int past float's range: the full step raises)
        return None


def _same_settings(opt: AdamW, p: Plan) -> bool:
    """Whether the optimizer's settings a step reads besides its groups are the plan's."""
    norm_type = opt.norm_type
    return (_max_norm(opt) == p.max_norm and type(norm_type) in (float, int)
            and norm_type == 2.0 and opt.error_if_nonfinite is p.error_if_nonfinite
            and opt._clip_order_params is p.clip_order and opt._shares is None
            and getattr(opt, "grad_scale", None) is None
            and getattr(opt, "found_inf", None) is None)


def remember(opt: AdamW, calls: list[Call], cut: StepClip | None, clip: bool,
             step: singlepass.Step, single_pass: int) -> Plan | None:
    """The plan a full step leaves for the next (`Plan`), or None where it was not the common
    case the replay follows. `calls`, `cut`: the step's calls and clip; `clip`: whether it
    clipped; `single_pass`: the parameters its single pass updated."""
    if len(calls) != 1 or opt._shares is not None or opt.norm_type != 2.0:
        return None
    call = calls[0]
    prepared, group = call.kernel, call.group
    if (not call.whole or prepared is None or single_pass != len(call.params)
            or prepared.dtype is not torch.float32 or not prepared.float32_steps
            or not prepared.disjoint or len(opt.param_groups) != 1
            or opt.param_groups[0] is not group or step._team is None
            or type(opt.param_groups) is not list or type(group) is not dict
            or type(group["params"]) is not list
            or getattr(opt, "grad_scale", None) is not None
            or getattr(opt, "found_inf", None) is not None):
        return None
    source = opt._clip_order_params
    if clip and (cut is None or cut.grads is not call.grads
                 or not (source is None or source == PARAM_GROUPS)
                 or not singlepass.norms_proven(step.team, step)):
        return None
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    try:
        beta1, beta2 = group["betas"]
    except (TypeError, ValueError):
        return None
    if (type(lr) is not float or type(beta1) is not float or type(beta2) is not float
            or type(eps) is not float or type(wd) not in (float, int)
            or (clip and _max_norm(opt) is None) or type(opt.error_if_nonfinite) is not bool):
        return None
    snapshot = []
    for key in SETTINGS:
        if key in group:
            value = group[key]
            snapshot.append((key, tuple(value) if key == "betas" else value))
    kind = call.kind
    lib = singlepass.kernel._lib()
    fused = kind == "fused"
    size, modes = step.team()
    unit = singlepass.work.fused_vector_unit() if fused else singlepass.work.aten_vector_unit()
    pieces = (singlepass.work._fused_pieces(prepared.numels, size, unit) if fused
              else singlepass.work._pieces(prepared.numels, size, unit, True))
    sqrt = None if fused else singlepass.sqrt_address(singlepass.sqrt_kind())
    amsgrad = bool(group["amsgrad"])
    compiled = tensorlists.replayer()(group, tuple(snapshot), dict(
        kind=KINDS[kind], amsgrad=amsgrad, clip=clip, error_if_nonfinite=opt.error_if_nonfinite,
        max_norm=float(opt.max_norm) if clip else 0.0, lr=lr, beta1=beta1,
        beta2=beta2, weight_decay=float(wd), scalars=[1 - beta1, beta2, 1 - beta2, eps],
        flags=(1 if wd != 0 else 0) | (2 if group["maximize"] else 0) | (4 if amsgrad else 0)
        | (16 if fused else 0),
        sqrt_fn=sqrt or 0, sqrt_mode=singlepass.MKL_SQRT_MODE,
        threads=torch.get_num_threads(), team_size=size, team_modes=list(modes),
        numels=list(prepared.numels), pieces=pieces,
        norms_team_fn=_address(lib.cot_singlepass_norms_team),
        clip_scalars_fn=_address(lib.cot_singlepass_clip_scalars),
        team_fn=_address(lib.cot_singlepass_team), adamw_fn=_address(lib.cot_singlepass_adamw)))
    return Plan(compiled, opt.param_groups, group, kind, clip, _max_norm(opt),
                opt.error_if_nonfinite, opt._clip_order_params, singlepass.kernel._BUILD,
                singlepass.verdicts.GENERATION, os.environ.get(ENV_SWITCH))


def replay(opt: AdamW, closure, clip: bool) -> tuple[int, bool] | None:
    """Run this step as the last one's `Plan` says, and record its clip as the full step does:
    returns (parameters updated, whether the clip multiply ran in the pass); or modify nothing
    and return None, leaving the step to the full one: a closure, other param groups, clip
    settings or state container, the single pass switched (``COTANGENT_SINGLE_PASS`` as it was
    when planned) or a torch mode active (as `singlepass.verdicts.off_reason`), a forked
    process, another kernel build or verdicts, a clip apart from the step to honour, or a check
    of `tensorlists.Replay.run` failing. Everything it calls lives here or in `_compat`."""
    p = opt._replay
    if closure is not None or p.clip != clip or opt.param_groups is not p.groups:
        return None
    if (len(p.groups) != 1 or p.groups[0] is not p.group or not _same_settings(opt, p)
            or type(opt.state) not in (dict, defaultdict)
            or os.environ.get(ENV_SWITCH) != p.switch or _compat.torch_modes_active()
            or singlepass.kernel._FORKED or singlepass.kernel._BUILD is not p.build
            or singlepass.verdicts.GENERATION != p.generation):
        return None
    last = opt._last_clip
    if last is not None and last.apart:
        return None  # (else a clip apart was used up already: nothing to record of it)
    kind, group = p.kind, p.group
    out = p.compiled.run(opt.state, lambda coef: singlepass.Step().decide(
        kind, group, coef, torch.float32) is None)
    if out is None:
        return None
    total, seen, n, clip_in_pass = out
    if clip:  # (as `clip.record_clip`, with the gradient set made in C++)
        opt._last_clip = ClipRecord(total, SeenGradients(seen), apart=False)
    return n, clip_in_pass


def replayer_available() -> bool:
    """Whether plans can be made here (the compiled `tensorlists.Replay` is available)."""
    return tensorlists.replayer() is not None


def _address(function) -> int:
    """The address of a ctypes function of the kernel library."""
    return ctypes.cast(function, ctypes.c_void_p).value
