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
