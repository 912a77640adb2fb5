"""AdamW state as native `torch.optim.AdamW` keeps it: which entries it reads, how error
messages name a parameter, and the checks that run before a step or a `load_state_dict` changes
anything (native would fail mid-update, or not at all, on the inputs these refuse).
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

import torch
from torch import Tensor

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def state_keys(amsgrad: bool) -> tuple[str, ...]:
    """The state entries native AdamW reads at every step for a group with this `amsgrad`."""
    return ("step",) + (MOMENTS if amsgrad else MOMENTS[:2])


def describe(slot: int, p: Tensor) -> str:
    """How error messages name a parameter: its slot, shape and dtype."""
    return f"parameter {slot} (shape {tuple(p.shape)}, {str(p.dtype).removeprefix('torch.')})"


def entry_problem(p: Tensor, key: str, value) -> str | None:
    """Why `value` cannot be native AdamW's `state[p][key]` in a packed optimizer, or None.

    A moment must match the parameter's shape, dtype and device and be dense; the step must be
    a 0-dim real tensor (native AdamW's functional API refuses non-tensor steps)."""
    if not isinstance(value, Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if key == "step":
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            return f"must be a 0-dim real tensor, not {tuple(value.shape)} {value.dtype}"
        return None
    if value.shape != p.shape or value.dtype != p.dtype or value.device != p.device:
        return (f"is {tuple(value.shape)} {value.dtype} on {value.device}; it must match the "
                f"parameter ({tuple(p.shape)} {p.dtype} on {p.device})")
    if value.layout is not torch.strided:
        return f"is not a dense tensor ({value.layout})"
    return None


def state_problem(slot: int, p: Tensor, state: dict, amsgrad: bool) -> str | None:
    """Why `state` (a non-empty `optimizer.state[p]`) cannot drive native AdamW's next update of
    `p`, or None when it can.

    Native AdamW reads ``step``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with
    amsgrad) afresh at every step: a missing entry is a KeyError there, a moment of another shape
    fails in the middle of the update (after weight decay has already changed the parameter), a
    non-tensor step fails the functional API's check (`entry_problem`).
    """
    for key in state_keys(amsgrad):
        if key not in state:
            return (f"optimizer.state of {describe(slot, p)} has no {key!r} entry (it has "
                    f"{sorted(map(str, state))}); native AdamW would raise KeyError here. Delete "
                    "the whole entry (`del opt.state[p]`) to start the parameter afresh")
        problem = entry_problem(p, key, state[key])
        if problem:
            return f"optimizer.state[p][{key!r}] of {describe(slot, p)} {problem}"
    return None


def check_state_dict(state_dict: dict, groups: list[dict]) -> None:
    """Check a native AdamW `state_dict` against the parameters it will be loaded into, before
    `load_state_dict` changes anything (native does not check moment shapes: a (1, 8) moment
    broadcasts into a (4, 8) parameter, others fail mid-update naming no parameter).

    Raises:
        ValueError: a moment whose shape differs from its parameter's, or that is not a dense
            floating-point tensor; a step with more than one element. (Group count and size
            mismatches are left to native `load_state_dict`, which raises its own ValueError.)
    """
    saved_groups = state_dict.get("param_groups", [])
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        return
    params = [p for g in groups for p in g["params"]]
    slot_of = {pid: slot for slot, pid in enumerate(chain.from_iterable(
        g["params"] for g in saved_groups))}
    for key, entry in state_dict.get("state", {}).items():
        slot = slot_of.get(key)
        if slot is None or not isinstance(entry, dict):
            continue
        p = params[slot]
        where = f"state_dict['state'][{key!r}]"
        for name, value in entry.items():
            if not isinstance(value, Tensor):
                continue
            if name in MOMENTS and value.shape != p.shape:
                raise ValueError(
                    f"{where}[{name!r}] has shape {tuple(value.shape)}, but it belongs to "
                    f"{describe(slot, p)}: the checkpoint is of another model (nothing was "
                    "loaded)")
            if name in MOMENTS and not (value.is_floating_point()
                                        and value.layout is torch.strided):
                raise ValueError(f"{where}[{name!r}] is {value.dtype} {value.layout}; "
                                 f"{describe(slot, p)} needs a dense floating-point moment")
            if name == "step" and value.numel() != 1:
                raise ValueError(f"{where}['step'] has {value.numel()} elements; a step count "
                                 "is a single number")


def compact_state(state) -> defaultdict:
    """A copy of an optimizer's `state` with every tensor cloned into its own compact storage
    (for pickling: a view would carry its whole flat buffer along)."""
    return defaultdict(dict, {
        p: {k: v.clone(memory_format=torch.preserve_format) if isinstance(v, Tensor) else v
            for k, v in entry.items()} for p, entry in state.items()})
