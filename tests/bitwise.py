"""Bitwise comparison helpers for tests: the library's one byte comparison
(`cotangent.verify.first_difference`: dtype, shape and every byte; never tolerances or
`torch.equal` on values, which calls -0.0 == +0.0 and NaN != NaN)."""

from __future__ import annotations

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
