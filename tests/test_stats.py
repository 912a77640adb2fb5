"""Paired statistics against hand-computed cases and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from cotangent.harness import stats


def test_paired_t_interval_hand_computed():
    # differences 1, 2, 3: mean 2, sd 1, n 3. With 2 degrees of freedom the t quantile has a
    # closed form: t_p = (2p - 1) / sqrt(2 p (1 - p)); p = 0.975 gives 4.3026527...
    iv = stats.paired_t_interval([1.0, 2.0, 3.0], 0.95)
    p = 0.975
    half = (2 * p - 1) / math.sqrt(2 * p * (1 - p)) / math.sqrt(3)
    assert iv.mean == 2.0 and iv.sd == 1.0 and iv.n == 3
    assert iv.low == pytest.approx(2 - half, rel=1e-12) and iv.high == pytest.approx(2 + half,
                                                                                     rel=1e-12)


def test_paired_t_interval_matches_scipy_ttest():
    rng = np.random.default_rng(3)
    base, cand = rng.normal(10, 1, 12), rng.normal(9.5, 1, 12)
    iv = stats.paired_t_interval(cand - base, 0.99)
    ci = sps.ttest_rel(cand, base).confidence_interval(0.99)
    assert iv.low == pytest.approx(ci.low, rel=1e-12)
    assert iv.high == pytest.approx(ci.high, rel=1e-12)


def test_bootstrap_is_a_close_cross_check():
    rng = np.random.default_rng(0)
    d = rng.normal(0.2, 0.05, 40)
    t, b = stats.paired_t_interval(d, 0.95), stats.bootstrap_interval(d, 0.95, seed=1)
    assert b.low < t.mean < b.high
    assert abs(b.low - t.low) < 0.01 and abs(b.high - t.high) < 0.01


def test_time_to_target_is_first_crossing_and_censors():
    # training seconds (the default, as analysis, audit and README use) differ from elapsed ones
    probes = [dict(probe_bpb=3.0, training_s=1.0, elapsed_s=10.0),
              dict(probe_bpb=2.4, training_s=2.0, elapsed_s=20.0),
              dict(probe_bpb=2.5, training_s=3.0, elapsed_s=30.0),
              dict(probe_bpb=2.0, training_s=4.0, elapsed_s=40.0)]
    assert stats.time_to_target(probes, 2.5) == 2.0  # first probe at or below, no interpolation
    assert stats.time_to_target(probes, 2.0) == 4.0
    assert stats.time_to_target(probes, 1.0) is None  # censored, not dropped
    assert stats.time_to_target(probes, 2.5, time_key="elapsed_s") == 20.0


def test_reduction_and_non_inferiority():
    assert stats.reduction(80.0, 100.0) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        stats.reduction(1.0, 0.0)
    ok = stats.non_inferiority([0.001, -0.002, 0.0005, 0.0], margin=0.01, level=0.95)
    bad = stats.non_inferiority([0.02, 0.03, 0.025, 0.01], margin=0.01, level=0.95)
    assert ok["non_inferior"] and not bad["non_inferior"]


def test_factorial_contrasts_hand_computed():
    c = stats.factorial_contrasts(native=[10.0], norms=[9.0], packing=[8.0], both=[6.0])
    assert c == {"norm_only": [-1.0], "packing_only": [-2.0], "combined": [-4.0],
                 "main_norms": [-1.5], "main_packing": [-2.5], "interaction": [-1.0]}
    with pytest.raises(ValueError):
        stats.factorial_contrasts([1.0], [1.0, 2.0], [1.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):
        stats.paired_t_interval([1.0], 0.95)
