"""Occurrence aggregation for shared (recurrent) blocks: four ways to update replicated leaves.

A block applied at k places in a network (a recurrent core) can be trained as one shared module
(autograd sums the k gradients into one leaf) or as k *replica leaves*, one per occurrence,
that start identical and must stay identical. With replicas, the optimizer's nonlinearity
(Muon's orthogonalization, Adam's normalization) can be applied before or after the k
contributions are combined. The modes, as this project defines them:

    pooled   ("P")  every replica's gradient is replaced by the sum of the k gradients (what a
                    shared module feeds its optimizer); every replica takes the same step.
    averaged ("A")  every replica steps on its own gradient with its own optimizer state; the
                    common displacement is the mean of the k displacements.
    ap       ("AP") averaged direction, pooled norm: the mean displacement rescaled to the norm
                    of the pooled displacement.
    pa       ("PA") pooled direction, averaged norm: the pooled displacement rescaled to the
                    norm of the mean displacement.

AP and PA need both displacements every step, so they keep one extra *pooled leaf* per shared
tensor (`pooled_leaves()`: the caller adds them to the optimizer); it receives the summed
gradient and, after the step, is reset to the replicas' new value with them.

Per step, `after_step()` returns the diagnostics (float): ``pooled_norm`` and ``averaged_norm``
(L2 norms of the pooled / mean displacements over all shared tensors; None where the mode does
not compute one), ``target_norm`` (the norm the applied displacement should have),
``realized_norm`` (the norm of new - old parameters actually written), ``relative_norm_mismatch``
(max over tensors of |realized - target| / target), ``cosine`` (between the pooled and mean
displacements; None unless both exist), ``sync_error`` (max |replica - replica 0| over all
replicas after the step: 0.0 when they are in sync) and ``autograd_order`` (pooling modes:
whether the pooled gradient was built from the hook-tracked per-backward sums, every replica's
``.grad`` matching its tracked accumulation; None for "averaged"; see above for when that
equals native sharing).

The pooled gradient follows autograd's own accumulation by default (``sum_order="autograd"``):
a gradient hook on every replica sees each backward's gradient of that replica as it arrives,
so that within one backward the replicas' gradients are summed in arrival order - the last
occurrence first, ``(g_k + g_(k-1)) + ... + g_1`` for a block applied k times in sequence, as
the engine sums the inputs of a shared leaf - and the sums of successive backwards (gradient
accumulation) are added to the running total, as a shared leaf's ``.grad`` accumulates them.
Measured (CPU, float32, torch 2.13, tests/test_muon.py): the pooled mode then gives a
natively shared module's bits, parameters and state, step after step, on both MuonAdamW paths,
with one or several backwards per step; an adversarial review found the same for parallel
branches, residual reuse, activation checkpointing, retain_graph double backward and
``backward(inputs=...)``. That equality needs each replica to receive one gradient per
backward: where one occurrence uses its weight more than once (the same matrix twice inside a
block, a gradient penalty backpropagated through the weights), the engine sums the
contributions in an interleaved order the replicas' hooks cannot see; under autocast a shared
weight is cast once and its gradients are summed in the low precision; and a compiled backward
sums inside the graph. In those cases ``autograd_order`` still reads True (the tracking it
certifies held) while the pooled gradient differs from native sharing's in the last bits.
If the replicas' gradients were changed other than by backwards
since the last step (zeroed, assigned, scaled), or a backward ran through
``torch.autograd.grad``, the tracked sums no longer match them; the pooled gradient is then the
sum of the replicas' current gradients in backward order and `after_step` reports
``autograd_order: False``. ``sum_order="backward"`` always sums the current gradients last
replica first, ``"forward"`` first replica first (float addition is not associative: these
differ in the last bits). Norms, dot products and
rescale factors are computed in float32 (float64 for the sums of squares).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from torch.optim.optimizer import register_optimizer_step_post_hook

from cotangent import _compat

MODES = ("pooled", "averaged", "ap", "pa")
SUM_ORDERS = ("autograd", "backward", "forward")


def _sq(t: Tensor) -> float:
    return float(t.double().square().sum())


class OccurrenceAggregator:
    """Keeps replica leaves of shared tensors identical under one of `MODES` (module docstring).

    Args:
        occurrences: one sequence per shared tensor: its k >= 2 replica leaves (distinct
            tensors of one shape, dtype and device, with identical bytes).
        mode: one of `MODES`.
        sum_order: "autograd" (default: as autograd accumulates a shared leaf, tracked by
            gradient hooks), "backward" (current gradients, last replica first) or "forward"
            (first replica first): how the pooled gradient is summed.

    Raises:
        ValueError: an unknown mode or sum order, fewer than 2 replicas, replicas that differ
            in shape, dtype, device or bytes, or a tensor listed twice.
    """

    def __init__(self, occurrences: Sequence[Sequence[Tensor]], mode: str,
                 sum_order: str = "autograd") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown occurrence mode {mode!r}; known: {', '.join(MODES)}")
        if sum_order not in SUM_ORDERS:
            raise ValueError(f"sum_order must be one of {', '.join(SUM_ORDERS)}, got "
                             f"{sum_order!r}")
        self.sum_order = sum_order
        seen: set[int] = set()
        groups = []
        if isinstance(occurrences, Tensor):
            raise ValueError("occurrences must be a list with one list of replica leaves per "
                             "shared tensor, not a tensor")
        for j, occ in enumerate(occurrences):
            if isinstance(occ, Tensor):
                raise ValueError(f"occurrences[{j}] is a tensor; occurrences must be a list "
                                 "with one list of replica leaves per shared tensor "
                                 "([[w_1, w_2, w_3], ...])")
            occ = list(occ)
            if len(occ) < 2:
                raise ValueError(f"shared tensor {j} has {len(occ)} replica(s); need at least 2")
            first = occ[0]
            for k, t in enumerate(occ):
                if id(t) in seen:
                    raise ValueError(f"shared tensor {j}, replica {k} is listed twice")
                seen.add(id(t))
                if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
                    raise ValueError(f"shared tensor {j}: replica {k} is {tuple(t.shape)} "
                                     f"{t.dtype} {t.device}, replica 0 {tuple(first.shape)} "
                                     f"{first.dtype} {first.device}")
                if k and not _same_bytes(t, first):
                    raise ValueError(f"shared tensor {j}: replica {k} does not hold replica "
                                     "0's values; replicas must start identical")
            groups.append(occ)
        self.mode = mode
        self.occurrences = groups
        self._pooled: list[Tensor] = []
        if mode in ("ap", "pa"):
            self._pooled = [occ[0].detach().clone().requires_grad_(occ[0].requires_grad)
                            for occ in groups]
        self._before: list[Tensor] | None = None
        self._autograd_order: bool | None = None
        if mode != "averaged" and sum_order == "autograd":
            self._tracker = _AccumulationTracker(groups)

    def pooled_leaves(self) -> list[Tensor]:
        """The extra leaves the optimizer must hold (modes "ap" and "pa"; else empty), one per
        shared tensor, in `occurrences` order: put them with the replicas' kind of parameters
        (the same param group settings)."""
        return list(self._pooled)

    @torch.no_grad()
    def before_step(self) -> None:
        """After the backward, before ``optimizer.step()``: remember the replicas' values and
        set the gradients the mode steps on.

        Raises:
            RuntimeError: a replica without a gradient, or a second call before `after_step`
                (it would pool the pooled gradients again); nothing modified.
        """
        if self._before is not None:
            raise RuntimeError("before_step() called twice without after_step(): the "
                               "gradients are already aggregated for this step")
        for j, occ in enumerate(self.occurrences):
            for k, t in enumerate(occ):
                if t.grad is None:
                    raise RuntimeError(f"shared tensor {j}, replica {k} has no gradient")
        self._before = [occ[0].detach().clone() for occ in self.occurrences]
        if self._pooled:  # which parameters the optimizer steps until after_step hold
            self._stepped: set[int] = set()
            stepped = self._stepped

            def record(optimizer, args, kwargs) -> None:
                stepped.update(id(p) for g in optimizer.param_groups for p in g["params"])

            self._step_hook = register_optimizer_step_post_hook(record)
        if self.mode == "averaged":
            return
        tracked = None
        if self.sum_order == "autograd":
            tracked = self._tracker.take()
        self._autograd_order = tracked is not None
        for j, occ in enumerate(self.occurrences):
            if tracked is not None:
                pooled = tracked[j]
            else:
                order = occ if self.sum_order == "forward" else occ[::-1]
                pooled = order[0].grad.clone()
                for t in order[1:]:
                    pooled.add_(t.grad)
            if self.mode == "pooled":
                for t in occ:
                    t.grad.copy_(pooled)
            else:
                self._pooled[j].grad = pooled

    @torch.no_grad()
    def after_step(self) -> dict:
        """After ``optimizer.step()``: write the mode's common displacement into every replica
        (and pooled leaf); return the diagnostics (module docstring).

        Raises:
            RuntimeError: `before_step` was not called since the last `after_step`.
        """
        if self._before is None:
            raise RuntimeError("after_step() without before_step() since the last step")
        if self._pooled:
            self._step_hook.remove()
            missing = [j for j, t in enumerate(self._pooled) if id(t) not in self._stepped]
            if missing:
                self._before = None
                raise RuntimeError(
                    f"no optimizer step since before_step() held the pooled leaves of shared "
                    f"tensor(s) {missing}: put agg.pooled_leaves() in the optimizer too (mode "
                    f"{self.mode!r} needs the pooled displacement); the replicas were not "
                    "written and may now differ")
        sums = {"pooled": 0.0, "averaged": 0.0, "target": 0.0, "realized": 0.0, "dot": 0.0}
        mismatch = 0.0
        for j, (occ, base) in enumerate(zip(self.occurrences, self._before)):
            pooled = averaged = None
            if self.mode == "pooled":
                pooled = occ[0] - base
            else:
                averaged = torch.stack([t - base for t in occ]).mean(dim=0)
            if self.mode in ("ap", "pa"):
                pooled = self._pooled[j] - base
            if self.mode == "ap":
                move, target = _rescale(averaged, pooled)
            elif self.mode == "pa":
                move, target = _rescale(pooled, averaged)
            else:
                move = pooled if pooled is not None else averaged
                target = move.float().norm()
            if self.mode != "pooled":  # the replicas already hold base + pooled in P
                new = base + move
                for t in occ:
                    t.copy_(new)
                if self._pooled:
                    self._pooled[j].copy_(new)
            realized = (occ[0] - base).float().norm()
            if float(target) > 0:
                mismatch = max(mismatch, abs(float(realized) - float(target)) / float(target))
            if pooled is not None:
                sums["pooled"] += _sq(pooled)
            if averaged is not None:
                sums["averaged"] += _sq(averaged)
            if pooled is not None and averaged is not None:
                sums["dot"] += float((pooled.double() * averaged.double()).sum())
            sums["target"] += float(target) ** 2
            sums["realized"] += float(realized) ** 2
        self._before = None
        both = self.mode in ("ap", "pa")
        denom = (sums["pooled"] * sums["averaged"]) ** 0.5
        return {
            "pooled_norm": sums["pooled"] ** 0.5 if self.mode != "averaged" else None,
            "averaged_norm": sums["averaged"] ** 0.5 if self.mode != "pooled" else None,
            "target_norm": sums["target"] ** 0.5,
            "realized_norm": sums["realized"] ** 0.5,
            "relative_norm_mismatch": mismatch,
            "cosine": (sums["dot"] / denom if denom > 0 else None) if both else None,
            "sync_error": self.sync_error(),
            "autograd_order": None if self.mode == "averaged" else self._autograd_order,
        }

    @torch.no_grad()
    def sync_error(self) -> float:
        """max |replica - replica 0| over every replica (and pooled leaf) of every shared
        tensor; 0.0 exactly when they hold equal values (NaN counts as out of sync)."""
        worst = 0.0
        for j, occ in enumerate(self.occurrences):
            others = occ[1:] + ([self._pooled[j]] if self._pooled else [])
            for t in others:
                diff = (t.float() - occ[0].float()).abs()
                worst = max(worst, float("inf") if diff.isnan().any() else float(diff.max()))
        return worst


def _rescale(direction: Tensor, norm_of: Tensor) -> tuple[Tensor, Tensor]:
    """`direction` scaled to the L2 norm of `norm_of` (float32 factor), and that norm; a zero
    direction stays zero."""
    target = norm_of.float().norm()
    length = direction.float().norm()
    if float(length) == 0.0:
        return torch.zeros_like(direction), target
    return direction * (target / length).to(direction.dtype), target


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    return bool(torch.equal(a.detach().reshape(-1).view(torch.uint8),
                            b.detach().reshape(-1).view(torch.uint8)))


class _AccumulationTracker:
    """Gradient hooks on replica leaves that reproduce autograd's accumulation of a shared leaf:
    per backward, the contributions summed in arrival order; across backwards, those sums added
    to a running total; and per replica the same accumulation of its own contributions, to
    confirm at `take()` that the replicas' gradients came from exactly these backwards."""

    def __init__(self, groups: list[list[Tensor]]) -> None:
        self.groups = groups
        self.reset()
        ref = weakref.ref(self)
        handles = []
        for j, occ in enumerate(groups):
            for k, t in enumerate(occ):
                if t.requires_grad:
                    handles.append(t.register_hook(_make_hook(ref, j, k)))
        self._finalizer = weakref.finalize(self, _remove_handles, handles)

    def reset(self) -> None:
        n = len(self.groups)
        self.backward_sum: list[Tensor | None] = [None] * n  # this backward, arrival order
        self.total: list[Tensor | None] = [None] * n  # across backwards
        self.own: list[list[Tensor | None]] = [[None] * len(occ) for occ in self.groups]
        self.queued = False

    def incoming(self, j: int, k: int, grad: Tensor) -> None:
        if not self.queued:
            self.queued = True
            ref = weakref.ref(self)
            _compat.queue_backward_callback(lambda: (t := ref()) is not None and t.end())
        grad = grad.detach()
        s = self.backward_sum[j]
        self.backward_sum[j] = grad.clone() if s is None else s + grad
        mine = self.own[j][k]
        self.own[j][k] = grad.clone() if mine is None else mine + grad

    def end(self) -> None:
        """End of a backward: add its sums to the totals."""
        self.queued = False
        for j, s in enumerate(self.backward_sum):
            if s is not None:
                self.total[j] = s if self.total[j] is None else self.total[j] + s
        self.backward_sum = [None] * len(self.groups)

    def take(self) -> list[Tensor] | None:
        """The tracked pooled gradients, if every replica's `.grad` is exactly its tracked
        accumulation (else None); the tracker starts over either way."""
        ok = all(t is not None for t in self.total) and all(
            own is not None and t.grad is not None and own.dtype == t.grad.dtype
            and _same_bytes(own, t.grad)
            for occ, owns in zip(self.groups, self.own) for t, own in zip(occ, owns))
        totals = self.total
        self.reset()
        return totals if ok else None


def _make_hook(ref, j: int, k: int):
    def hook(grad: Tensor) -> None:
        tracker = ref()
        if tracker is not None:
            tracker.incoming(j, k, grad)
    return hook


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()
