"""`cotangent.AdamW` vs `clip_grad_norm_` + `torch.optim.AdamW` over the case table, byte for byte.

Holds for: CPU (x86-64), the installed torch (2.13.0 in CI), float32 weights with FP32 or BF16
autocast, plus bfloat16 / float16 parameters where a case says so; each native AdamW
implementation (fused, foreach, for-loop) with `clip_grad_norm_(foreach=None)`.
"""

from __future__ import annotations

import pytest

from cases import CASES, OBSERVATIONS, SINGLE_PASS_OBSERVATIONS, run_case


@pytest.mark.filterwarnings("ignore:Detected call of")
@pytest.mark.parametrize("case,impl", [(c, i) for c in CASES for i in c.impls],
                         ids=lambda v: str(v).replace(" ", "_"))
def test_case_is_bitwise_equal_to_native(case, impl):
    assert case.expect <= OBSERVATIONS, case.expect - OBSERVATIONS
    seen = run_case(case, impl)
    # The case must exercise what it claims (clipping on every step or none, a skipped
    # parameter, the single pass and the clip multiply inside it; for PackedAdamW a merged AdamW
    # range, batched norms).
    expect = case.expect - SINGLE_PASS_OBSERVATIONS if impl == "fused" else case.expect
    assert expect <= seen, f"{case} ({impl}) did not show {sorted(expect - seen)}"
