"""Bitwise comparison helpers for tests: the library's one byte comparison
(`cotangent.verify.first_difference`: dtype, shape and every byte; never tolerances or
`torch.equal` on values, which calls -0.0 == +0.0 and NaN != NaN)."""

from __future__ import annotations

import contextlib

import torch

from cotangent.verify import compare_updates, first_difference


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when both are None, or dtype, shape and every byte agree."""
    return first_difference(a, b) is None


def assert_same_bits(a, b, what: str) -> None:
    problem = first_difference(a, b)
    assert problem is None, f"{what}: {problem}"


def assert_same_update(native_params, native_state, our_params, our_state, what: str,
                       names=None, grads: bool = True) -> int:
    """Every parameter, gradient and state entry byte-equal; returns the number compared."""
    native_params, our_params = list(native_params), list(our_params)
    names = names or [str(i) for i in range(len(native_params))]
    assert len(native_params) == len(our_params), what
    checks = list(compare_updates(names, native_params, native_state, our_params, our_state,
                                  grads=grads))
    problems = [f"{w}: {p}" for w, p in checks if p is not None]
    assert not problems, f"{what}: {problems[0]}" + (
        f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    return len(checks)


def assert_step_refused(opt, params, match: str) -> None:
    """`opt.step()` raises a RuntimeError matching `match` and leaves every parameter and
    gradient of `params` byte for byte as it was (a refusal modifies nothing)."""
    import pytest

    params = list(params)
    before = [p.detach().clone() for p in params]
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    for p, b, g in zip(params, before, grads):
        assert_same_bits(p, b, "parameter after the refused step")
        assert_same_bits(p.grad, g, "gradient after the refused step")


@contextlib.contextmanager
def threads(n: int):
    """ATen's thread count set to `n` for the block, restored after (bit patterns of CPU
    kernels depend on how work is split among threads, so comparisons name it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def flush_denormal():
    """`torch.set_flush_denormal(True)` for the block (the calling thread's FTZ/DAZ; ATen's
    pool threads only if they start inside it), off after."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def require_single_pass_kernel() -> None:
    """Skip the calling test module (clearly, with the reason) where `cotangent.singlepass`
    cannot run: not x86-64, or no C++ compiler / a failed build."""
    import platform

    import pytest

    from cotangent import singlepass

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the single-pass kernel is x86-64 only", allow_module_level=True)
    try:
        singlepass.build()
    except singlepass.SinglePassUnavailable as e:
        pytest.skip(f"single-pass kernel unavailable here: {e}", allow_module_level=True)


def require_register_path() -> None:
    """Skip the calling test (or module) where the single pass's register path does not run:
    it needs the kernel (`require_single_pass_kernel`) and a square root it can compute in
    registers, the MKL imitation or the hardware's (`singlepass.sqrt_kind`); with MKL's own call
    every block takes the general path."""
    import pytest

    from cotangent import singlepass

    require_single_pass_kernel()
    kind = singlepass.sqrt_kind()
    if kind not in ("emulated", "emulated14", "hardware"):
        pytest.skip(f"the register path does not run here (square root: {kind})",
                    allow_module_level=True)


def run_against_native(base, *, foreach, deliver, steps: int, max_norm=None, norm_type=2.0,
                       edit=None, adamw=None, groups=None, clip_order=None,
                       set_to_none: bool = True) -> list[tuple]:
    """Native (``clip_grad_norm_`` + `torch.optim.AdamW`) and `cotangent.AdamW` stepped side by
    side on two copies of the tensors `base` (parameters), the engine of the adversarial case
    tables. Each step: ``edit(step, params, optimizer)`` on both arms, ``deliver(step, params)``
    puts gradients on each arm's parameters (a backward or an assignment), native's clip (in
    ``clip_order(params)`` order when given, which cotangent.AdamW also gets), both steps, then
    both ``zero_grad(set_to_none)``. `groups`: param-group dicts whose "params" are indices
    into `base`. Returns [(step, first problem or None, our update_path(), (native error, our
    error))]: a problem is a byte difference anywhere (gradients, parameters, every state
    entry, total norm; `first_difference`) or one arm raising where the other does not."""
    adamw = adamw or {}
    arms = [[torch.nn.Parameter(b.clone()) for b in base] for _ in range(2)]

    def param_groups(params):
        if groups is None:
            return params
        return [dict(g, params=[params[i] for i in g["params"]]) for g in groups]

    def cloned(kw):
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in kw.items()}

    import cotangent

    native = torch.optim.AdamW(param_groups(arms[0]), foreach=foreach, **cloned(adamw))
    extra = {} if clip_order is None else dict(clip_order=lambda: clip_order(arms[1]))
    if clip_order is None and groups is not None:  # native clips `base` order: say so
        extra = dict(clip_order=arms[1])
    ours = cotangent.AdamW(param_groups(arms[1]), foreach=foreach, max_norm=max_norm,
                           norm_type=norm_type, **extra, **cloned(adamw))
    out = []
    for step in range(steps):
        if edit is not None:
            edit(step, arms[0], native)
            edit(step, arms[1], ours)
        for params in arms:
            deliver(step, params)
        total = None
        if max_norm is not None:
            order = arms[0] if clip_order is None else clip_order(arms[0])
            total = torch.nn.utils.clip_grad_norm_(order, max_norm, norm_type)
        errors = []
        for opt in (native, ours):
            try:
                opt.step()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - compared between the arms
                errors.append(f"{type(e).__name__}: {e}")
        problem = None
        if (errors[0] is None) != (errors[1] is None):
            problem = f"errors differ: {errors}"
        for k, (a, b) in enumerate(zip(*arms)):
            checks = [("gradient", a.grad, b.grad), ("parameter", a, b)]
            sa, sb = native.state.get(a, {}), ours.state.get(b, {})
            checks += [(key, sa.get(key), sb.get(key)) for key in sorted(set(sa) | set(sb))]
            for what, x, y in checks:
                d = first_difference(x, y)
                if d is not None and problem is None:
                    problem = f"{what} of parameter {k}: {d}"
        if total is not None and errors[1] is None and problem is None:
            d = first_difference(total, ours.last_total_norm)
            problem = None if d is None else f"total norm: {d}"
        out.append((step, problem, ours.update_path(), tuple(errors)))
        native.zero_grad(set_to_none=set_to_none)
        ours.zero_grad(set_to_none=set_to_none)
    return out


def group_edit(step_at: int, **values):
    """An `edit` for `run_against_native` writing `values` into every param group at step
    `step_at` (native's own checks at construction do not run: any value a training loop can
    write; tensors are cloned per arm)."""
    def edit(step, params, opt):
        if step == step_at:
            for g in opt.param_groups:
                g.update({k: v.clone() if torch.is_tensor(v) else v for k, v in values.items()})
    return edit


def thread_flip(step, params, opt):
    """An `edit` for `run_against_native`: ATen's thread count alternates 2, 1, 2, ... by step."""
    torch.set_num_threads(1 if step % 2 else 2)
