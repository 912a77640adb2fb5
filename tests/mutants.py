"""Variants of the single-pass kernel for the tests that show a probe catches a kind of error:
each name is one bit of the mask of the kernel's test build (``-DCOT_MUTANT_RUNTIME``; the head
of ``src/cotangent/csrc/singlepass.cpp`` says what each bit breaks). That build is compiled once
per kernel cache for every variant (its flags are part of its key), never by editing the
source."""

from __future__ import annotations

import cotangent.singlepass as sp

MUTANTS = {
    "tail-lerp-as-body": 0,          # the scalar tail's lerp takes the vector body's formula
    "register-div-reciprocal": 1,    # the register path divides through the reciprocal
    "general-div-reciprocal": 2,     # the general path does
    "tail-maximum-as-body": 3,       # amsgrad's maximum in the tail as in the body
    "body-maximum-as-tail": 4,       # ... in the body as in the tail
    "nan-maximum-kept": 5,           # a NaN maximum stays in registers
    "norm-tail-fused": 6,            # the norm fuses every tail square into its sum
    "fused-inline-sign-lost": 7,     # fused AdamW's inline copy forgets the NaN sign (maximize)
    "register-nan-flags-dropped": 8,  # no NaN flags on grad - exp_avg and on the quotient
}


def use_mutant(monkeypatch, *names: str) -> int:
    """Make the next kernel call load the test build (compiled on first use, then from the
    kernel cache) with the switches of `names` on, undone with `monkeypatch`; returns the mask. Raises AssertionError when the source
    lacks a mutant's switch (a variant equal to the shipped kernel would prove nothing)."""
    mask = 0
    for name in names:
        bit = MUTANTS[name]
        assert f"MUTANT({bit})" in sp.kernel._SOURCE, f"the kernel has no switch for {name}"
        mask |= 1 << bit
    monkeypatch.setattr(sp.kernel, "_MUTANT", mask)
    for attr in ("_LIB", "_BUILD", "_FAILURE"):
        monkeypatch.setattr(sp.kernel, attr, None)
    return mask
