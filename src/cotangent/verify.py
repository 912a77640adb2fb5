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

from cotangent import dtensor
from cotangent.clip_order import PARAM_GROUPS, normalize_clip_order
from cotangent.adamw import AdamW
from cotangent.reference import ReferenceUpdate

ARMS = ("cotangent",)
# the factorial's other cells, verified by the harness (`cotangent.harness.factorial`)
HARNESS_ARMS = {"batched-norms-only": "verify_batched_norms_only",
                "packing-only": "verify_packing_only"}
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
    """None when bit-identical (dtype, shape and every byte), else where and by how much they
    first differ: the count of differing elements, the first flat index, both values and their
    distance in ULP (the one byte comparison of the library and its tests). A DTensor is
    compared by its local tensor (this rank's shard, `cotangent.dtensor.local`)."""
    if a is not None and b is not None:
        a, b = dtensor.local(a), dtensor.local(b)
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


def compare_updates(names: list[str], native_params: list[Tensor], native_state,
                    our_params: list[Tensor], our_state, *, grads: bool = True):
    """Yield ``(what, difference or None)`` for every tensor an update phase touches, native
    against Cotangent: each parameter's gradient (with `grads`), the parameter, and every entry of its
    optimizer state (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `step`; a key present on one
    side only is a difference). `native_state` / `our_state` are the optimizers' `state`."""
    for name, a, b in zip(names, native_params, our_params):
        if grads:  # first: a gradient difference is the cause of the others
            yield f"gradient {name}", first_difference(a.grad, b.grad)
        yield f"parameter {name}", first_difference(a, b)
        sa, sb = native_state.get(a, {}), our_state.get(b, {})
        for key in sorted(set(sa) | set(sb)):
            va, vb = sa.get(key), sb.get(key)
            if isinstance(va, Tensor) or isinstance(vb, Tensor):
                yield f"{key} of {name}", first_difference(va, vb)
            else:
                yield f"{key} of {name}", None if va == vb else f"{va!r} vs {vb!r}"


@dataclass
class VerifyReport:
    """Outcome of `verify`: one entry per step, and the first difference if any."""

    arm: str
    clip_order: str = "model.parameters()"  # what the native loop passed to clip_grad_norm_
    our_clip_order: str = "None"  # what cotangent.AdamW was given as clip_order
    steps: int = 0
    checks: int = 0  # comparisons made (one per tensor per step)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.steps > 0 and not self.failures

    def as_dict(self) -> dict:
        return dict(arm=self.arm, clip_order=self.clip_order,
                    our_clip_order=self.our_clip_order, steps=self.steps,
                    checks=self.checks, passed=self.passed,
                    first_failure=self.failures[0] if self.failures else None)


def verify(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, object], Tensor],
           batches: Iterable, *, max_norm: float | None = 1.0, arm: str = "cotangent",
           autocast_dtype: torch.dtype | None = None, compile: bool = False,
           stop_at_first: bool = True, params=None, clip_order=None, norm_type: float = 2.0,
           error_if_nonfinite: bool = False, **adamw_kwargs) -> VerifyReport:
    """Compare native and Cotangent updates step by step; returns a `VerifyReport`.

    Args:
        model: your model; it is deep-copied twice (it is not modified).
        loss_fn: ``loss_fn(model, batch) -> 0-dim loss``, called once per batch per side.
        batches: one batch per update step (at least one).
        max_norm: clipping threshold (None: no clipping).
        arm: "cotangent" (the research harness verifies the factorial's other cells:
            `cotangent.harness.factorial.verify_batched_norms_only`, `verify_packing_only`).
        autocast_dtype: run forward passes under `torch.autocast` with this dtype.
        compile: `torch.compile` both copies (after the optimizers are built), under
            `torch.use_deterministic_algorithms(True)` for the duration of the call.
        stop_at_first: stop at the first step with a difference.
        params: what you would pass to the optimizer, built from `model`'s parameters: a list
            of them or of param-group dicts (e.g. no weight decay on biases). Default: all of
            `model.parameters()` in one group.
        clip_order: what you give `cotangent.AdamW` as its `clip_order`; the Cotangent side is
            built with it, exactly as you would build it, and the native side clips what it
            stands for. Default (None, as `cotangent.AdamW`'s default) and `model`: the native
            loop most code writes, ``clip_grad_norm_(model.parameters(), max_norm)`` then
            ``torch.optim.AdamW(params).step()``; so a Cotangent optimizer whose default order
            (one param group) is not ``model.parameters()``'s (another order, or a subset
            while the loop clips the whole model) is reported as different, and two or more
            groups with None raise `cotangent.AdamW`'s ValueError (pass ``clip_order=model``).
            ``"param_groups"``: the native loop clips the optimizer's parameters, param groups
            concatenated (Lightning's ``gradient_clip_val``). A list of `model`'s parameters:
            that list. The report's ``clip_order`` names what the native loop clipped and
            ``our_clip_order`` what the Cotangent optimizer was given.
        norm_type, error_if_nonfinite: as `clip_grad_norm_`.
        **adamw_kwargs: `torch.optim.AdamW` arguments (lr, betas, weight_decay, fused, ...).
    Raises:
        ValueError: unknown `arm`; no batches; `params` or `clip_order` holding a tensor that is
            not a parameter of `model`; a `clip_order` string other than ``"param_groups"``, a
            callable or a submodule (pass a list of its parameters); what `cotangent.AdamW`
            raises for these arguments (two or more param groups with ``max_norm`` and no
            `clip_order`).
    """
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}" + (
            f" ({arm} is the harness's: cotangent.harness.factorial.{HARNESS_ARMS[arm]})"
            if arm in HARNESS_ARMS else ""))
    return _verify_with(optimizer_builder(AdamW, arm=arm), model, loss_fn, batches, max_norm=max_norm,
                        autocast_dtype=autocast_dtype, compile=compile,
                        stop_at_first=stop_at_first, params=params, clip_order=clip_order,
                        norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                        **adamw_kwargs)


def optimizer_builder(cls, *, arm: str, **fixed):
    """The side under test for `_verify_with`: ``cls(params_or_groups, max_norm=...,
    norm_type=..., error_if_nonfinite=..., clip_order=..., **fixed, **adamw_kwargs)``, an
    optimizer that clips in `step()` and keeps the total norm in ``last_total_norm``."""
    def build(our_spec, our_order, *, max_norm, norm_type, error_if_nonfinite, **adamw_kwargs):
        opt = cls(our_spec, max_norm=max_norm, norm_type=norm_type,
                  error_if_nonfinite=error_if_nonfinite, clip_order=our_order, **fixed,
                  **adamw_kwargs)

        def step():
            opt.step()
            return opt.last_total_norm
        return opt, step
    build.arm = arm
    return build


def _verify_with(build, model, loss_fn, batches, *, max_norm, autocast_dtype, compile,
                 stop_at_first, params, clip_order, norm_type, error_if_nonfinite,
                 **adamw_kwargs) -> VerifyReport:
    """`verify` with the side under test built by ``build(params_or_groups, clip_order, *,
    max_norm, norm_type, error_if_nonfinite, **adamw_kwargs) -> (optimizer, step)``, where
    ``step()`` updates and returns the total norm; ``build.arm`` names it in the report."""
    batches = list(batches)
    if not batches:
        raise ValueError("verify needs at least one batch (one per update step to compare)")
    options = dict(max_norm=max_norm, build=build, autocast_dtype=autocast_dtype,
                   stop_at_first=stop_at_first, params=params, clip_order=clip_order,
                   norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, **adamw_kwargs)
    if compile:
        # inductor's CPU embedding backward accumulates in a thread-dependent order: two
        # compiled copies of one native model differ unless deterministic mode is on.
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            return _verify(model, loss_fn, batches, compile=True, **options)
        finally:
            torch.use_deterministic_algorithms(previous)
    return _verify(model, loss_fn, batches, compile=False, **options)


def _map_params(spec, model: torch.nn.Module, copy_params: list[Tensor], what: str):
    """`spec` (parameters of `model`, or param-group dicts of them) with each parameter replaced
    by the one at the same position in `copy_params`."""
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def mapped(tensors):
        out = []
        for t in tensors:
            if id(t) not in index:
                raise ValueError(f"{what} holds a tensor of shape {tuple(t.shape)} that is not a "
                                 "parameter of the model given to verify")
            out.append(copy_params[index[id(t)]])
        return out

    spec = list(spec)
    if spec and isinstance(spec[0], dict):  # (`_verify` made each group's params a list)
        return [dict(g, params=mapped(g["params"])) for g in spec]
    return mapped(spec)


def _verify(model, loss_fn, batches, *, max_norm, build, autocast_dtype, compile, stop_at_first,
            params, clip_order, norm_type, error_if_nonfinite, **adamw_kwargs) -> VerifyReport:
    native_model, our_model = copy.deepcopy(model), copy.deepcopy(model)
    native_params, our_params = list(native_model.parameters()), list(our_model.parameters())
    spec = list(model.parameters() if params is None else params)
    if spec and isinstance(spec[0], dict):  # a generator of parameters is read once, here
        spec = [dict(g, params=[g["params"]] if isinstance(g["params"], Tensor)
                     else list(g["params"])) for g in spec]
    if clip_order is None or clip_order is model:  # the loop a user writes
        native_order, order_name = native_model, "model.parameters()"
        our_order, our_name = (None, "None") if clip_order is None else (our_model, "model")
    elif (clip_order := normalize_clip_order(clip_order)) == PARAM_GROUPS:
        native_order = our_order = PARAM_GROUPS
        order_name, our_name = "param groups concatenated", repr(PARAM_GROUPS)
    elif not isinstance(clip_order, list):
        raise ValueError("verify's clip_order is None, the model, 'param_groups' or a list of "
                         f"the model's parameters, got {type(clip_order).__name__!r}")
    else:
        native_order = _map_params(clip_order, model, native_params, "clip_order")
        our_order = _map_params(clip_order, model, our_params, "clip_order")
        order_name = our_name = f"a list of {len(clip_order)} parameters"
    native_spec = _map_params(spec, model, native_params, "params")
    our_spec = _map_params(spec, model, our_params, "params")
    native = ReferenceUpdate(native_spec, max_norm=max_norm, norm_type=norm_type,
                             error_if_nonfinite=error_if_nonfinite, clip_order=native_order,
                             **adamw_kwargs)
    our_opt, our_step = build(our_spec, our_order, max_norm=max_norm, norm_type=norm_type,
                              error_if_nonfinite=error_if_nonfinite, **adamw_kwargs)
    run_native, run_ours = native_model, our_model
    if compile:
        run_native, run_ours = torch.compile(native_model), torch.compile(our_model)
    device_type = native_params[0].device.type if native_params else "cpu"
    names = [name for name, _ in native_model.named_parameters()]
    if max_norm is None:
        order_name = "none (max_norm=None: no clip)"
    report = VerifyReport(build.arm, clip_order=order_name, our_clip_order=our_name)

    def check(what: str, problem: str | None) -> None:
        report.checks += 1
        if problem is not None:
            report.failures.append(f"step {report.steps}: {what}: {problem}")

    for batch in batches:
        losses = []
        for m, opt in ((run_native, native), (run_ours, our_opt)):
            opt.zero_grad()
            ctx = (torch.autocast(device_type, dtype=autocast_dtype) if autocast_dtype
                   else nullcontext())
            with ctx:
                loss = loss_fn(m, batch)
            loss.backward()
            losses.append(loss.detach())
        check("loss", first_difference(*losses))
        for name, a, b in zip(names, native_params, our_params):
            check(f"gradient {name}", first_difference(a.grad, b.grad))
        check("total norm", first_difference(native.step(), our_step()))
        for what, problem in compare_updates(names, native_params, native.optimizer.state,
                                             our_params, our_opt.state):
            check(what.replace("gradient", "clipped gradient", 1), problem)
        report.steps += 1
        if report.failures and stop_at_first:
            break
    return report
