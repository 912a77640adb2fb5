"""Step planning: which native AdamW calls a step makes, over which merged ranges.

For one pattern of present gradients a `StepPlan` lists the present parameters per param group;
`Planner.build_calls` turns it into native functional AdamW calls (`cotangent.merge`), one per
(param group, flat buffer), whose list elements are per-parameter views or merged ranges of
adjacent parameters wherever `cotangent.merge.merge_is_exact` proved the range equal to separate
calls and the parameters' step counts are equal. Calls are cached with the plan and rebuilt when
anything they were built on changes: `Planner.invalidate` (the one place that discards them),
the param groups' flags, the identity of the state entries, or the equality of merged step
counts (`AdamWCalls.still_valid`, checked at every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

import torch
from torch import Tensor

from cotangent import merge, singlepass
from cotangent.harness.packed.layout import Segment
from cotangent.spans import align_elements
from cotangent.harness.packed.store import FlatStore


def group_signature(group: dict) -> tuple:
    """The param-group settings that decide which native calls run and which merges are exact
    (values such as lr or betas are read at every call and need no signature)."""
    return (group["fused"], group["foreach"], bool(group["amsgrad"]), bool(group["maximize"]),
            merge.decay_kind(group), torch.is_tensor(group["lr"]), bool(group["capturable"]),
            bool(group["differentiable"]), merge.has_nan_scalar(group))


@dataclass(slots=True)
class SinglePassSpan:
    """The parameters of one for-loop / foreach call as segments of their layout's flat buffers,
    for one `cotangent.singlepass.single_pass_adamw_` call instead of the native op sequence.

    The buffers are elements ``[base, base + length)`` of the layout's parameter and gradient
    buffers (its state window: `FlatStore.windows`) and the whole state buffers; `segments`
    are the parameters' (offset from `base`, numel), in buffer order; `steps` their step
    counts: a 1-D slice of the step buffer where their positions are consecutive, else their
    0-d step tensors (views of it)."""

    layout: int
    base: int
    length: int
    segments: tuple[tuple[int, int], ...]
    steps: Tensor | list[Tensor]
    params: list[Tensor]  # the parameters, whose version counters the update bumps


@dataclass(slots=True)
class AdamWCall:
    """One native functional AdamW call: per-parameter tensors and merged ranges of one group.
    With `single`, the same update may instead run as one single pass (`SinglePassSpan`) where
    `cotangent.singlepass.decide` allows it at that step; `single_note` says why a for-loop or
    foreach call has no span."""

    group_index: int
    kind: str  # "fused" | "foreach" | "for-loop"
    direct: bool  # fused, one device and dtype, proven equal: skip the functional wrapper
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    max_exp_avg_sqs: list[Tensor] = field(default_factory=list)
    state_steps: list[Tensor] = field(default_factory=list)  # a range uses its first's step
    parameters: int = 0  # parameters updated by this call (ranges count each member)
    single: SinglePassSpan | None = None
    single_note: str | None = None


@dataclass(slots=True)
class StepMerge:
    """The step counts of merged ranges inside one step buffer (a 1-D CPU tensor): every member
    must equal its range's first before the update, and is set to it after."""

    buffer: Tensor
    members: Tensor  # int64 positions of the ranges' other parameters
    firsts: Tensor  # int64 position of each member's range head


_COMMON = itemgetter("step", "exp_avg", "exp_avg_sq")


@dataclass(slots=True)
class StateSeen:
    """The state entries a set of calls reads, as seen when the calls were built: the state
    container and its edit count (`store.WatchedState`), the present parameters' `state[p]`
    dicts, and the data pointers of their `step`, `exp_avg`, `exp_avg_sq` (and, at `amsgrad`
    positions, `max_exp_avg_sq`) entries."""

    container: object
    edits: int
    dicts: list[dict]
    amsgrad: list[int]  # positions whose max_exp_avg_sq is read
    ptrs: list[int]

    @classmethod
    def of(cls, state, params: list[Tensor], amsgrad: list[int]) -> StateSeen:
        """Record what `state` holds now for `params` (after adoption or initialisation)."""
        dicts = [state[p] for p in params]
        seen = cls(state, getattr(state, "edits", -1), dicts, amsgrad, [])
        seen.ptrs = seen._pointers(dicts)
        return seen

    def _pointers(self, dicts: list[dict]) -> list[int]:
        ptrs = list(map(Tensor.data_ptr, chain.from_iterable(map(_COMMON, dicts))))
        return ptrs + [dicts[i]["max_exp_avg_sq"].data_ptr() for i in self.amsgrad]

    def unchanged(self, state, params: list[Tensor]) -> bool:
        """Whether `state` still holds, for `params`, exactly the entries recorded (same data
        pointers: nothing assigned, replaced, popped or re-pointed with `.data`)."""
        if state is self.container and getattr(state, "edits", -2) == self.edits:
            dicts = self.dicts  # no entry of the container was assigned or removed
        else:
            dicts = list(map(state.get, params))  # .get: a defaultdict must not grow here
        try:
            return self._pointers(dicts) == self.ptrs
        except (KeyError, TypeError, AttributeError):
            return False


@dataclass(slots=True)
class AdamWCalls:
    """The calls of one plan, with what they were built on."""

    epoch: int
    signatures: list[tuple]
    calls: list[AdamWCall]
    merges: list[StepMerge]
    state_seen: StateSeen
    # for-loop / foreach parameters updated through a merged range (a view of the flat buffer),
    # whose own version counters the update does not bump (torch 2.13's fused kernel bumps none)
    merged_params: list[Tensor] = field(default_factory=list)

    def state_unchanged(self, state, params: list[Tensor]) -> bool:
        """Whether every state entry these calls read is still the tensor they were built with
        (nothing assigned, replaced, popped or re-pointed with `.data` since)."""
        return self.state_seen.unchanged(state, params)

    def merged_steps_equal(self) -> bool:
        """Whether every merged range's step counts are still equal (they may have been edited
        in place from outside, e.g. `for v in opt.state[p].values(): v.zero_()`)."""
        return all(torch.equal(m.buffer.index_select(0, m.members),
                               m.buffer.index_select(0, m.firsts)) for m in self.merges)

    def finish(self) -> None:
        """After the update: each merged range's members take its head's new step count, and
        every parameter updated through a range has its version counter bumped, as a native
        in-place update bumps it (so that autograd still refuses a backward through a graph that
        saved the old values)."""
        for m in self.merges:
            m.buffer.index_copy_(0, m.members, m.buffer.index_select(0, m.firsts))
        if self.merged_params:
            torch.autograd.graph.increment_version(self.merged_params)


@dataclass(slots=True)
class StepPlan:
    """Everything `step()` needs for one pattern of present gradients."""

    present: tuple[int, ...]
    params: list[Tensor]  # the present parameters, in slot order
    group_slots: list[tuple[int, list[int]]]  # (group index, its present slots)
    clip: list | None = None  # built by the clipper on first use
    calls: AdamWCalls | None = None


class Planner:
    """Plans and their AdamW calls for one `FlatStore`, cached per presence pattern."""

    MAX_PLANS = 64  # e.g. layer drop: bound the cache of presence patterns

    def __init__(self, store: FlatStore, group_sizes: list[int]) -> None:
        self.store = store
        self.group_of: list[int] = [gi for gi, n in enumerate(group_sizes) for _ in range(n)]
        self.plans: dict[tuple[int, ...], StepPlan] = {}
        self.epoch = 0
        self.last: StepPlan | None = None

    def invalidate(self, *, plans: bool = False) -> None:
        """Discard every cached AdamW call (state, views or verdicts changed); with `plans`,
        the presence plans too (their clip programs depend on calibration)."""
        self.epoch += 1
        if plans:
            self.plans.clear()
            self.last = None

    def plan(self, present: tuple[int, ...]) -> StepPlan:
        """The (cached) plan for this tuple of present slots, in slot order."""
        plan = self.plans.get(present)
        if plan is None:
            if len(self.plans) >= self.MAX_PLANS:
                self.plans.clear()
            group_slots: dict[int, list[int]] = {}
            for slot in present:
                group_slots.setdefault(self.group_of[slot], []).append(slot)
            plan = StepPlan(present, [self.store.params[s] for s in present],
                            sorted(group_slots.items()))
            self.plans[present] = plan
        self.last = plan
        return plan

    def call_summary(self) -> dict:
        """The last plan's calls: native list elements, parameters they update, implementations."""
        plan = self.last
        calls = plan.calls.calls if plan is not None and plan.calls is not None else []
        return dict(calls=sum(len(c.params) for c in calls),
                    parameters=sum(c.parameters for c in calls),
                    implementations=sorted({c.kind for c in calls}))

    def calls_valid(self, plan: StepPlan, state, groups: list[dict]) -> bool:
        """Whether `plan`'s cached calls may run this step (see the module docstring)."""
        c = plan.calls
        return (c is not None and c.epoch == self.epoch
                and c.signatures == [group_signature(groups[gi]) for gi, _ in plan.group_slots]
                and c.state_unchanged(state, plan.params) and c.merged_steps_equal())

    def build_calls(self, plan: StepPlan, state, groups: list[dict],
                    grad_override: dict[int, Tensor] | None = None) -> AdamWCalls:
        """Group the present parameters into native AdamW calls. Their state must be this
        store's (adopted or initialised). With `grad_override` (slot -> gradient used where it
        is), those slots stay single and the calls are not cached."""
        store = self.store
        override = grad_override or {}
        calls, merges, merged_params = [], {}, []
        for gi, slots in plan.group_slots:
            group = groups[gi]
            kind = merge.implementation(group, [store.params[s] for s in slots])
            limit = merge.max_range_elements(kind)
            in_group = set(slots)
            for li, layout in enumerate(store.layouts):  # one call per (group, device, dtype)
                segs = [seg for seg in layout.segments if seg.slot in in_group]
                if not segs:
                    continue
                note = singlepass.static_refusal(kind, layout.device, layout.dtype, group)
                # for-loop / foreach: the parameters the single pass can take form one call
                # (with a span), the others (a gradient or parameter outside the buffers, a
                # non-contiguous layout) another; native updates each parameter on its own,
                # so splitting a call changes no bits
                parts = [(segs, None)]
                if note is None:
                    fits = {seg.slot for seg in segs
                            if self._single_pass_fits(seg, state, override)}
                    fit = [seg for seg in segs if seg.slot in fits]
                    rest = [seg for seg in segs if seg.slot not in fits]
                    parts = [(fit, True), (rest, False)]
                for part, single in parts:
                    if not part:
                        continue
                    direct = kind == "fused" and merge.direct_fused_is_exact(
                        layout.device, layout.dtype, group)
                    call = AdamWCall(gi, kind, direct)
                    for run in self._ranges(li, part, kind, limit, group, state, override):
                        self._add(call, li, run, group, state, override, merges)
                        if len(run) > 1 and kind != "fused":  # native fused bumps no version
                            merged_params += [store.params[seg.slot] for seg in run]
                    # the direct call was proven with float32 steps, as native fused creates
                    # them; others (assigned by the user) go through the functional path,
                    # which checks them
                    call.direct = call.direct and all(st.dtype == torch.float32
                                                      for st in call.state_steps)
                    if single:
                        call.single = self._span(li, part, state)
                    elif single is False:
                        call.single_note = ("parameters or gradients outside the flat buffers, "
                                            "or not contiguous, run natively")
                    else:
                        call.single_note = note
                    calls.append(call)
        amsgrad = [i for i, s in enumerate(plan.present) if groups[self.group_of[s]]["amsgrad"]]
        built = AdamWCalls(
            self.epoch, [group_signature(groups[gi]) for gi, _ in plan.group_slots], calls,
            [StepMerge(buffer, torch.tensor(members), torch.tensor(firsts))
             for buffer, members, firsts in merges.values()],
            StateSeen.of(state, plan.params, amsgrad), merged_params)
        if not override:
            plan.calls = built
        return built

    def _single_pass_fits(self, seg: Segment, state, override: dict) -> bool:
        """Whether the single pass can update this parameter in place: contiguous, in the
        flat buffer with its gradient, its state the store's (0-d CPU step)."""
        store = self.store
        if not seg.contiguous or seg.slot in override or seg.slot in store.detached:
            return False
        step = state[store.params[seg.slot]]["step"]
        return step.device.type == "cpu" and step.dim() == 0 and store.is_ours(
            seg.slot, "step", step)

    def _span(self, li: int, segs: list[Segment], state) -> SinglePassSpan:
        store = self.store
        base, end = store.windows[li]
        steps = [state[store.params[seg.slot]]["step"] for seg in segs]
        positions = [store.position[seg.slot] for seg in segs]
        buffer = store.step_buffers.get((li, steps[0].device, steps[0].dtype))
        if (buffer is not None and all(s.dtype == steps[0].dtype for s in steps)
                and positions == list(range(positions[0], positions[0] + len(positions)))):
            steps = buffer.narrow(0, positions[0], len(positions))
        return SinglePassSpan(li, base, end - base,
                              tuple((seg.offset - base, seg.numel) for seg in segs), steps,
                              [store.params[seg.slot] for seg in segs])

    def _ranges(self, li, segs, kind, limit, group, state, override) -> list[list[Segment]]:
        """Split `segs` (buffer order) into runs that may share one list element."""
        store = self.store
        align = align_elements(store.layouts[li].dtype)
        runs: list[list[Segment]] = []
        run_end = -1
        run_start = 0
        for seg in segs:
            end = seg.offset + -(-seg.numel // align) * align
            step = state[store.params[seg.slot]]["step"]
            ok = (seg.contiguous and seg.slot not in override and seg.slot not in store.detached
                  and step.device.type == "cpu"
                  and merge.merge_is_exact(kind, store.layouts[li].device,
                                           store.layouts[li].dtype, seg.numel, group))
            if (ok and runs and run_end == seg.offset
                    and (limit is None or end - run_start <= limit)
                    and self._same_step(runs[-1][0], seg, state)):
                runs[-1].append(seg)
                run_end = end
            else:
                runs.append([seg])
                run_start, run_end = seg.offset, (end if ok else -1)
        return runs

    def _same_step(self, a: Segment, b: Segment, state) -> bool:
        sa = state[self.store.params[a.slot]]["step"]
        sb = state[self.store.params[b.slot]]["step"]
        # same step buffer (dtype and device) and the same count: one host read per pair, at
        # build time only (steps of merged ranges live on the CPU)
        return sa.dtype == sb.dtype and sa.device == sb.device and bool(sa == sb)

    def _add(self, call: AdamWCall, li: int, run: list[Segment], group: dict, state,
             override: dict[int, Tensor], merges: dict) -> None:
        store = self.store
        first = state[store.params[run[0].slot]]
        if len(run) == 1:
            slot = run[0].slot
            call.params.append(store.params[slot])
            call.grads.append(override.get(slot, store.grad_views[slot]))
            tensors = first
        else:
            align = align_elements(store.layouts[li].dtype)
            start = run[0].offset
            length = run[-1].offset + -(-run[-1].numel // align) * align - start
            call.params.append(store.flat_params[li].narrow(0, start, length))
            call.grads.append(store.flat_grads[li].narrow(0, start, length))
            tensors = {k: store.state_range(li, k, start, length) for k in store.flat_state[li]}
            step = first["step"]
            buffer = store.step_buffers[(li, step.device, step.dtype)]
            _, members, firsts = merges.setdefault(id(buffer), (buffer, [], []))
            head = store.position[run[0].slot]
            for seg in run[1:]:
                members.append(store.position[seg.slot])
                firsts.append(head)
        call.exp_avgs.append(tensors["exp_avg"])
        call.exp_avg_sqs.append(tensors["exp_avg_sq"])
        if group["amsgrad"]:
            call.max_exp_avg_sqs.append(tensors["max_exp_avg_sq"])
        call.state_steps.append(first["step"])
        call.parameters += len(run)
