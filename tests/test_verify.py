"""`cotangent.verify` and `cotangent verify`: pass on real cases, fail loudly on a broken update."""

from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch

import cotangent
from cotangent import norms
from cotangent.harness import cli
from cotangent.harness.verify_suite import ARMS, VERIFY_MODELS, lm_loss, run_suite, suite_model
from cotangent.verify import ulp_distance


def _batches(n=3):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (2, 33), generator=gen) for _ in range(n)]


def test_verify_passes_on_a_user_model():
    report = cotangent.verify(suite_model("gated-gqa", False), lm_loss, _batches(), max_norm=0.1,
                              lr=1e-3, fused=True)
    assert report.passed and report.steps == 3 and report.checks > 100


def test_verify_names_the_first_difference_when_the_update_is_broken(monkeypatch):
    real = norms.clip_coefficient

    def off_by_one_ulp(total, max_norm):
        coef = real(total, max_norm)
        return torch.nextafter(coef, torch.zeros_like(coef))

    import cotangent.clip as clip

    monkeypatch.setattr(clip, "clip_coefficient", off_by_one_ulp)
    compiled = clip.singlepass.clip_scalars

    def off_by_one_ulp_in_c(norms, max_norm):  # (the coefficient's other maker, in C)
        total, coef, _ = compiled(norms, max_norm)
        coef = torch.nextafter(coef, torch.zeros_like(coef))
        return total, coef, coef.item()

    monkeypatch.setattr(clip.singlepass, "clip_scalars", off_by_one_ulp_in_c)
    report = cotangent.verify(suite_model("transformer-small", False), lm_loss, _batches(),
                              max_norm=0.1, lr=1e-3, fused=True)
    assert not report.passed and report.steps == 1
    message = report.failures[0]
    assert message.startswith("step 0: clipped gradient ") and "first at flat index" in message
    assert "ULP" in message


@pytest.mark.slow
def test_suite_runs_every_model_precision_and_arm_and_a_compiled_model():
    """`cotangent verify`'s suite: 4 model families x {fp32, bf16} x the 3 Cotangent arms, and
    the first model compiled; every case identical on every step."""
    lines = []
    result = run_suite(steps=2, log=lines.append)
    assert result["passed"] and len(result["cases"]) == 25 and len(lines) == 25
    assert all(c["passed"] and c["steps"] == 2 and c["checks"] > 0 for c in result["cases"])
    plain = [(c["model"], c["precision"], c["arm"]) for c in result["cases"] if not c["compiled"]]
    assert sorted(plain) == sorted(itertools.product(VERIFY_MODELS, ("fp32", "bf16"), ARMS))
    compiled = [c for c in result["cases"] if c["compiled"]]
    assert [(c["model"], c["precision"], c["arm"]) for c in compiled] == [
        (VERIFY_MODELS[0], "fp32", "cotangent")]
    assert result["steps"] == 2 * 25 and result["checks"] == sum(c["checks"] for c in
                                                               result["cases"])


@pytest.mark.e2e
def test_cli_verify_writes_a_report_and_fails_on_injection(tmp_path, monkeypatch, capsys):
    # The command's wiring (flags, report, exit status) on one model and one step; the whole
    # suite is the test above.
    from cotangent.harness import verify_suite

    monkeypatch.setattr(verify_suite, "run_suite",
                        functools.partial(verify_suite.run_suite, models=("transformer-small",)))
    out = tmp_path / "verify.json"
    assert cli.main(["verify", "--steps", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and report["steps"] == 7 and len(report["cases"]) == 7
    assert [c["model"] for c in report["cases"] if c["compiled"]] == ["transformer-small"]
    assert "7/7 cases identical, 7 update steps" in capsys.readouterr().out
    import cotangent.clip as clip
    from cotangent.harness.packed import clipping

    for module in (clip, clipping):  # cotangent.AdamW's clip and PackedAdamW's
        monkeypatch.setattr(module, "clip_coefficient",
                            lambda t, m: torch.nextafter(norms.clip_coefficient(t, m),
                                                         torch.tensor(0.0)))
    assert cli.main(["verify", "--steps", "1", "--no-compile", "--json", str(out)]) == 1
    assert "FAILED" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert not report["passed"] and len(report["cases"]) == 6
    assert not any(c["compiled"] for c in report["cases"])


def test_ulp_distance():
    a = torch.tensor([1.0, -0.0, 0.0, -1.0])
    b = torch.tensor([1.0, 0.0, 0.0, -1.0])
    assert ulp_distance(a, b).tolist() == [0, 1, 0, 0]
    one = torch.tensor([1.0])
    assert ulp_distance(one, torch.nextafter(one, torch.tensor([2.0]))).tolist() == [1]
    neg = torch.tensor([-1.0])
    assert ulp_distance(neg, torch.nextafter(neg, torch.tensor([-2.0]))).tolist() == [1]
    with pytest.raises(ValueError, match="unknown arm"):
        cotangent.verify(suite_model("causal-conv", False), lm_loss, [], arm="nope")
    with pytest.raises(ValueError, match="verify_batched_norms_only"):
        cotangent.verify(suite_model("causal-conv", False), lm_loss, [], arm="batched-norms-only")
    with pytest.raises(ValueError, match="verify_packing_only"):
        cotangent.verify(suite_model("causal-conv", False), lm_loss, [], arm="packing-only")


def test_packed_design_left_the_library():
    """`cotangent.PackedAdamW` is gone from the library (issue 26); the name says where the
    seed study's packed design lives now, and no library module imports the harness's copy."""
    with pytest.raises(AttributeError, match="cotangent.harness.packed.PackedAdamW"):
        cotangent.PackedAdamW  # noqa: B018
    assert "PackedAdamW" not in cotangent.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cotangent.nope  # noqa: B018


def test_packing_only_verify_lives_in_the_harness_and_can_fail(monkeypatch):
    """The harness's packing-only verify (packed buffers, native per-tensor norms) reports
    native's bits on a tiny model, and the first difference when its clip coefficient is one
    ULP off."""
    from cotangent.harness.factorial import verify_packing_only
    from cotangent.harness.packed import clipping

    model = suite_model("causal-conv", False)
    report = verify_packing_only(model, lm_loss, _batches(2), max_norm=0.1, lr=1e-3)
    assert report.passed and report.steps == 2 and report.arm == "packing-only"
    monkeypatch.setattr(clipping, "clip_coefficient",
                        lambda t, m: torch.nextafter(norms.clip_coefficient(t, m),
                                                     torch.tensor(0.0)))
    report = verify_packing_only(model, lm_loss, _batches(2), max_norm=0.1, lr=1e-3)
    assert not report.passed and report.failures


def test_batched_norms_only_verify_lives_in_the_harness_and_can_fail(monkeypatch):
    """The harness's batched-norms-only verify reports native's bits on a tiny model, and the
    first difference when the cell's total norm is one ULP off (the comparison is not vacuous)."""
    from cotangent.harness import factorial
    from cotangent.harness.factorial import verify_batched_norms_only

    model = suite_model("causal-conv", False)
    report = verify_batched_norms_only(model, lm_loss, _batches(2), max_norm=0.1, lr=1e-3)
    assert report.passed and report.steps == 2 and report.arm == "batched-norms-only"
    exact = factorial.total_norm
    monkeypatch.setattr(factorial, "total_norm", lambda parts, norm_type: torch.nextafter(
        exact(parts, norm_type), torch.tensor(float("inf"))))
    report = verify_batched_norms_only(model, lm_loss, _batches(2), max_norm=0.1, lr=1e-3)
    assert not report.passed and report.failures[0].startswith("step 0: total norm")
    with pytest.raises(ValueError, match="needs max_norm"):
        verify_batched_norms_only(model, lm_loss, _batches(1), max_norm=None)
