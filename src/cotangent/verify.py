"""`cotangent.verify`: prove, on your own model, that Cotangent's update phase gives native bits.

Runs the native update (`torch.nn.utils.clip_grad_norm_` + `torch.optim.AdamW`) and a Cotangent
configuration side by side from one initial state (a deep copy of `model`), on the same batches,
and compares byte for byte after every step: the loss, every gradient before and after clipping,
the total norm, every parameter, and every optimizer-state tensor (`exp_avg`, `exp_avg_sq`,
`max_exp_avg_sq`, `step`). The first difference is reported with the tensor's name, the flat
index and the distance in units in the last place (ULP).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cotangent.factorial import BatchedNormsOnly
from cotangent.optim import AdamW
from cotangent.reference import ReferenceUpdate

ARMS = ("cotangent", "packing-only", "batched-norms-only")
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ulp_distance(a: Tensor, b: Tensor) -> Tensor:
    """Elementwise distance in representable values between two float tensors of one dtype
    (0 for identical bits; -0.0 and +0.0 are 1 apart; NaNs compare by their bit patterns)."""
    ia = a.detach().reshape(-1).contiguous().view(_INT[a.element_size()]).long()
    ib = b.detach().reshape(-1).contiguous().view(_INT[b.element_size()]).long()
    magnitude = (1 << (8 * a.element_size() - 1)) - 1
    # map sign-magnitude bit patterns onto a monotonic integer line (-0.0 -> -1, +0.0 -> 0)
    oa = torch.where(ia < 0, -(ia & magnitude) - 1, ia)
    ob = torch.where(ib < 0, -(ib & magnitude) - 1, ib)
    return (oa - ob).abs()


def first_difference(a: Tensor | None, b: Tensor | None) -> str | None:
    """None when bit-identical, else where and by how much they first differ."""
    if a is None or b is None:
        return None if a is None and b is None else f"{'None' if a is None else 'tensor'} vs " \
                                                     f"{'None' if b is None else 'tensor'}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not a.is_floating_point():
        diff = (a.reshape(-1) != b.reshape(-1)).nonzero()
        return None if len(diff) == 0 else f"index {int(diff[0])}: {a.reshape(-1)[diff[0]].item()}" \
                                          f" vs {b.reshape(-1)[diff[0]].item()}"
    ulps = ulp_distance(a, b)
    bad = ulps.nonzero()
    if len(bad) == 0:
        return None
    i = int(bad[0])
    return (f"{len(bad)} of {a.numel()} elements differ; first at flat index {i}: "
            f"{a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r} ({int(ulps[i])} ULP)")


@dataclass
class VerifyReport:
    """Outcome of `verify`: one entry per step, and the first difference if any."""

    arm: str
    steps: int = 0
    checks: int = 0  # comparisons made (one per tensor per step)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.steps > 0 and not self.failures

    def as_dict(self) -> dict:
        return dict(arm=self.arm, steps=self.steps, checks=self.checks, passed=self.passed,
                    first_failure=self.failures[0] if self.failures else None)


def verify(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], Tensor],
           batches: Iterable, *, max_norm: float | None = 1.0, arm: str = "cotangent",
           autocast_dtype: torch.dtype | None = None, compile: bool = False,
           stop_at_first: bool = True, **adamw_kwargs) -> VerifyReport:
    """Compare native and Cotangent updates step by step; returns a `VerifyReport`.

    Args:
        model: your model; it is deep-copied twice (it is not modified).
        loss_fn: ``loss_fn(model, batch) -> 0-dim loss``, called once per batch per side.
        batches: one batch per update step.
        max_norm: clipping threshold (None: no clipping).
        arm: "cotangent" (batched norms + packing), "packing-only" or "batched-norms-only".
        autocast_dtype: run forward passes under `torch.autocast` with this dtype.
        compile: `torch.compile` both copies (after the optimizers are built), under
            `torch.use_deterministic_algorithms(True)` for the duration of the call.
        stop_at_first: stop at the first step with a difference.
        **adamw_kwargs: `torch.optim.AdamW` arguments (lr, betas, weight_decay, fused, ...).
    Raises:
        ValueError: unknown `arm`.
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    if compile:
        # inductor's CPU embedding backward accumulates in a thread-dependent order: two
        # compiled copies of one native model differ unless deterministic mode is on.
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return _verify(model, loss_fn, batches, max_norm=max_norm, arm=arm,
                           autocast_dtype=autocast_dtype, compile=True,
                           stop_at_first=stop_at_first, **adamw_kwargs)
        finally:
            torch.use_deterministic_algorithms(previous)
    return _verify(model, loss_fn, batches, max_norm=max_norm, arm=arm,
                   autocast_dtype=autocast_dtype, compile=False, stop_at_first=stop_at_first,
                   **adamw_kwargs)


def _verify(model, loss_fn, batches, *, max_norm, arm, autocast_dtype, compile, stop_at_first,
            **adamw_kwargs) -> VerifyReport:
    native_model, our_model = copy.deepcopy(model), copy.deepcopy(model)
    native_params, our_params = list(native_model.parameters()), list(our_model.parameters())
    native = ReferenceUpdate(native_params, max_norm=max_norm, **adamw_kwargs)
    if arm == "batched-norms-only":
        if max_norm is None:
            raise ValueError("batched-norms-only needs max_norm")
        ours = BatchedNormsOnly(our_params, max_norm=max_norm, **adamw_kwargs)
        our_opt = ours.optimizer

        def our_step():
            return ours.step()
    else:
        our_opt = AdamW(our_params, max_norm=max_norm, batched_norms=arm == "cotangent",
                        **adamw_kwargs)

        def our_step():
            our_opt.step()
            return our_opt.last_total_norm

    run_native, run_ours = native_model, our_model
    if compile:
        run_native, run_ours = torch.compile(native_model), torch.compile(our_model)
    device_type = next(iter(native_params)).device.type if native_params else "cpu"
    names = [name for name, _ in native_model.named_parameters()]
    report = VerifyReport(arm)

    def check(what: str, a, b) -> None:
        report.checks += 1
        problem = first_difference(a, b)
        if problem is not None:
            report.failures.append(f"step {report.steps}: {what}: {problem}")

    for batch in batches:
        losses = []
        for m, opt in ((run_native, native.optimizer), (run_ours, our_opt)):
            opt.zero_grad()
            ctx = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype
                   else nullcontext())
            with ctx:
                loss = loss_fn(m, batch)
            loss.backward()
            losses.append(loss.detach())
        check("loss", *losses)
        for name, a, b in zip(names, native_params, our_params):
            check(f"gradient {name}", a.grad, b.grad)
        check("total norm", native.step(), our_step())
        for name, a, b in zip(names, native_params, our_params):
            check(f"clipped gradient {name}", a.grad, b.grad)
            check(f"parameter {name}", a, b)
            sa, sb = native.optimizer.state.get(a, {}), our_opt.state.get(b, {})
            for key in sorted(set(sa) | set(sb)):
                check(f"{key} of {name}", sa.get(key), sb.get(key))
        report.steps += 1
        if report.failures and stop_at_first:
            break
    return report
