"""Which AdamW calls over several packed parameters at once keep native bits.

Native AdamW updates each parameter separately (one kernel call per tensor for the for-loop and
fused implementations, one list element per tensor for foreach). AdamW is elementwise, so running
it once over a *range* of adjacent segments of the flat buffers (padding included) gives the same
numbers per element - except where the element's position changes the code path: CPU kernels run
a vectorised body and a scalar tail that may round differently (the CPU fused kernel uses a fused
multiply-add only in its body: one call over 2000 float32 tensors of 7 elements gave other bits
than per-tensor calls in 769 of 14,000 elements after 20 steps; bfloat16 NaN payloads differ the
same way), and TensorIterator kernels split work between threads at positions that depend on the
call's length.

So a segment joins a range only where a calibration probe has shown it safe: for its
implementation, device type, dtype, length and hyperparameter branches, the probe runs the native
functional AdamW (`torch.optim.adam.adam`, the function `torch.optim.AdamW.step` calls) for several
steps once per tensor and once over merged ranges laid out like the flat buffers (each length at
both 64-byte offset parities), on ordinary values and again with inf, NaN, signed zeros and a
subnormal in body and tail positions, and compares every byte of the parameters and moments. For
the
TensorIterator-based implementations (for-loop, foreach) ranges also stay below ATen's parallel
grain size, so they run single-threaded, like the per-tensor calls of tensors that small.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adam import adam as functional_adam

from cotangent import _compat, calibration
from cotangent.calibration import sprinkle_special_values
from cotangent.spans import align_elements

GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: TensorIterator ops below this run on one thread


def implementation(group: dict, params: list[Tensor]) -> str:
    """The AdamW implementation native code runs for `group` over `params`.

    Returns "fused", "foreach" or "for-loop", following `torch.optim.adam.adam` (torch 2.4-2.13):
    `fused=True` wins; only when both `fused` and `foreach` are None does the device choose
    (`torch.optim.optimizer._default_to_fused_or_foreach`), and then a tensor `lr` without
    `capturable` falls back from foreach to the for-loop. An explicit `fused=False` with
    `foreach=None` is the for-loop, on every device.
    """
    fused, foreach = group["fused"], group["foreach"]
    if fused:
        return "fused"
    if fused is None and foreach is None:
        foreach = _compat.default_foreach(params, bool(group["differentiable"]))
        if foreach and torch.is_tensor(group["lr"]) and not group["capturable"]:
            foreach = False
    return "foreach" if foreach else "for-loop"


def max_range_elements(kind: str) -> int | None:
    """Largest merged call, in elements; None when unlimited (the fused CPU kernel splits work at
    64-byte boundaries only, so a merged call never moves a body/tail boundary)."""
    return None if kind == "fused" else GRAIN_SIZE - 1


def _flags(kind: str) -> dict:
    return {"fused": dict(fused=True, foreach=False),
            "foreach": dict(fused=None, foreach=True),
            "for-loop": dict(fused=None, foreach=False)}[kind]


def run_native_adamw(kind: str, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
                     group: dict, grad_scale=None, found_inf=None) -> None:
    """One native functional AdamW update (`torch.optim.adam.adam`, the function
    `torch.optim.AdamW.step` calls) over the given lists, with `group`'s hyperparameters
    (decoupled weight decay unless the group sets ``decoupled_weight_decay=False``, as native
    honours per group) and the implementation `kind`."""
    beta1, beta2 = group["betas"]
    functional_adam(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        # (as `_init_group` finds it: foreach AdamW then updates complex tensors as real pairs)
        amsgrad=group["amsgrad"], has_complex=any(map(torch.is_complex, params)),
        beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
        capturable=group["capturable"], differentiable=group["differentiable"],
        grad_scale=grad_scale, found_inf=found_inf,
        decoupled_weight_decay=group.get("decoupled_weight_decay", True),
        **_flags(kind),
    )


def merge_key(kind: str, device: torch.device, dtype: torch.dtype, numel: int,
              group: dict) -> str:
    """The calibration key of a merge verdict: implementation, device type, dtype, length and
    the hyperparameter branches that change the kernel path (amsgrad, maximize, decay, lr kind).
    ("adamw_merge2": verdicts of the probe that compares after every step, not those of the
    earlier one that compared after the last.)"""
    return calibration.full_key("adamw_merge2", device.type, (
        kind, dtype, numel, "amsgrad" if group["amsgrad"] else "-",
        "maximize" if group["maximize"] else "-", decay_kind(group),
        "tensor_lr" if torch.is_tensor(group["lr"]) else "float_lr"),
        probe=(merge_is_exact, _merge_probe, run_native_adamw))


def decay_kind(group: dict) -> str:
    """The weight-decay branch a group takes: none, decoupled (AdamW) or coupled (L2, Adam)."""
    if group["weight_decay"] == 0:
        return "-"
    return "decay" if group.get("decoupled_weight_decay", True) else "l2-decay"


def fused_flags_accepted(group: dict) -> bool:
    """Whether native's fused AdamW kernel (`torch._fused_adamw_`) takes the group's
    ``maximize`` and ``amsgrad`` as they are: it accepts Python bools only (anything else is its
    TypeError, which the functional path raises as native's step does)."""
    return type(group.get("maximize")) is bool and type(group.get("amsgrad")) is bool


def has_nan_scalar(group: dict) -> bool:
    """Whether lr (a float or a CPU tensor), a beta, eps or the weight decay is NaN: ATen's
    vector body and scalar tail then keep different NaNs (`lerp_` with a NaN weight), so no
    merged range is exact. A tensor lr on an accelerator is not read (no device sync)."""
    lr = group["lr"]
    if torch.is_tensor(lr):
        lr = lr.item() if lr.device.type == "cpu" and lr.numel() == 1 else 0.0
    values = [lr, *group["betas"], group["eps"], group["weight_decay"]]
    return any(isinstance(v, float) and v != v for v in values)


def merge_is_exact(kind: str, device: torch.device, dtype: torch.dtype, numel: int,
                   group: dict) -> bool:
    """Whether segments of `numel` elements may join a merged AdamW call (see module docstring).

    The probe uses `group`'s betas, eps, weight decay, amsgrad and maximize, lr 1e-2 (a tensor if
    the group's lr is one), and 6 steps three times: with a random gradient, with one whose rows
    also hold inf, NaNs, signed zeros and a subnormal, and with such values in the parameters
    too; parameters and moments compared byte for byte after every step. The verdict is cached
    per `merge_key`.
    Lengths too large for a merged call of this implementation are never merged.
    """
    if has_nan_scalar(group):
        return False
    return calibration.verdict(merge_key(kind, device, dtype, numel, group),
                               lambda: _merge_probe(kind, device, dtype, numel, group))


def _merge_probe(kind: str, device: torch.device, dtype: torch.dtype, numel: int,
                 group: dict) -> bool:
    limit = max_range_elements(kind)
    align = align_elements(dtype)
    row = -(-numel // align) * align
    rows = max(2 if numel > 65536 else 3, min(64, 4096 // max(1, numel)))
    if limit is not None:
        rows = min(rows, (limit - align) // (row + align))
    if numel == 0 or rows < 2:
        return False
    # rows at alternating offsets: odd rows get one extra alignment unit before them
    offsets, size = [], 0
    for i in range(rows):
        size += align if i % 2 else 0
        offsets.append(size)
        size += row
    gen = torch.Generator().manual_seed(numel)
    start = torch.randn(size, generator=gen, dtype=torch.float32).to(dtype).to(device)
    grad = (torch.randn(size, generator=gen, dtype=torch.float32) * 0.1).to(dtype).to(device)
    special = grad.clone()
    sprinkle_special_values([special[o:o + numel] for o in offsets])
    special_start = start.clone()  # parameters holding NaNs too (NaN against NaN)
    sprinkle_special_values([special_start[o:o + numel] for o in offsets], shift=3)
    probe_group = dict(group)
    probe_group["lr"] = (torch.tensor(1e-2, device=group["lr"].device)
                         if torch.is_tensor(group["lr"]) else 1e-2)
    verdict = True
    for p0, g0 in ((start, grad), (start, special), (special_start, special)):
        results = []
        for merged in (False, True):
            p = p0.clone()
            m, v, vmax = (torch.zeros_like(p) for _ in range(3))
            step_dtype = _compat.new_step_tensor(p, fused=kind == "fused", capturable=False)
            if merged:
                views = lambda t: [t]  # noqa: E731
                steps = [step_dtype]
            else:
                views = lambda t: [t[o:o + numel] for o in offsets]  # noqa: E731
                steps = [step_dtype.clone() for _ in offsets]
            snapshots = []  # after every step: a difference a later step overwrites counts
            for _ in range(6):
                g = g0.clone()
                run_native_adamw(kind, views(p), views(g), views(m), views(v),
                                 views(vmax) if group["amsgrad"] else [], steps, group=probe_group)
                snapshots += [torch.cat([t[o:o + numel] for o in offsets])
                              for t in (p, m, v, vmax)]
            results.append(snapshots)
        verdict = verdict and all(map(calibration.same_bytes, *results))
    return verdict


def run_direct_fused(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *,
                     group: dict) -> None:
    """Fused AdamW for one device and dtype without the functional wrapper's Python."""
    beta1, beta2 = group["betas"]
    _compat.fused_adamw_one_group(
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group["maximize"])


def direct_fused_is_exact(device: torch.device, dtype: torch.dtype, group: dict) -> bool:
    """Whether `run_direct_fused` equals the native functional fused AdamW byte for byte.

    Probe: tensors of 1-40, 63-65 and 1000 elements (half of them holding inf, NaN, signed zeros
    and a subnormal), `group`'s hyperparameter branches, 6 steps, each path on its own copy;
    parameters, every moment and the steps compared after every step. Cached like the others
    ("fused_direct2": verdicts of this per-step comparison).
    """
    if not group.get("decoupled_weight_decay", True):
        return False  # the direct call is `_fused_adamw_` (decoupled) only
    key = calibration.full_key("fused_direct2", device.type, (
        dtype, "amsgrad" if group["amsgrad"] else "-", "maximize" if group["maximize"] else "-",
        decay_kind(group),
        "tensor_lr" if torch.is_tensor(group["lr"]) else "float_lr"),
        probe=(direct_fused_is_exact, _direct_fused_probe, run_direct_fused, run_native_adamw))
    def probe() -> bool | None:
        try:
            return _direct_fused_probe(device, dtype, group)
        except (TypeError, ValueError, RuntimeError):
            return None  # (settings native's fused kernel refuses: nothing proven, nothing
                         # recorded; the functional path runs and raises as native's does)

    return calibration.verdict(key, probe)


def _direct_fused_probe(device: torch.device, dtype: torch.dtype, group: dict) -> bool:
    lengths = list(range(1, 41)) + [63, 64, 65, 1000]
    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(n, generator=gen, dtype=torch.float32).to(dtype).to(device)
             for n in lengths]
    grad = [(torch.randn(n, generator=gen, dtype=torch.float32) * 0.1).to(dtype).to(device)
            for n in lengths]
    sprinkle_special_values(grad[::2])
    sprinkle_special_values(start[::3], shift=3)
    probe_group = dict(group)
    probe_group["lr"] = (torch.tensor(1e-2, device=group["lr"].device)
                         if torch.is_tensor(group["lr"]) else 1e-2)
    results = []
    for direct in (False, True):
        p = [t.clone() for t in start]
        m, v, vmax = ([torch.zeros_like(t) for t in start] for _ in range(3))
        steps = [_compat.new_step_tensor(t, fused=True, capturable=False) for t in start]
        snapshots = []  # after every step: a difference a later step overwrites counts
        for _ in range(6):
            g = [t.clone() for t in grad]
            args = (p, g, m, v, vmax if group["amsgrad"] else [], steps)
            if direct:
                run_direct_fused(*args, group=probe_group)
            else:
                run_native_adamw("fused", *args, group=probe_group)
            snapshots += [t.clone() for t in p + m + v + vmax + steps]
        results.append(snapshots)
    return all(map(calibration.same_bytes, *results))
