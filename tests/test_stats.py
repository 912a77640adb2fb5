"""Statistics and machine-contention measurement.

Paired statistics against hand-computed cases and scipy.

Machine-load records and timing-flag rules (cotangent.harness.contention), and the audit's
standard-library copy of the rules.
"""

from __future__ import annotations

import math
import os
import random
import time

import numpy as np
import pytest
from cotangent.harness import audit, contention, stats
from cotangent.harness.train import progress_line
from scipy import stats as sps


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


def test_slow_steps_and_their_excess_share_of_training_time():
    # The run: ~15 ms steps with a stretch of ~1.4 s steps.
    steps = [0.015] * 280 + [1.4] * 20
    a = contention.assess(steps, None, None, None, threads=2)
    median = 0.015
    assert a["median_step_s"] == median and a["slow_steps"] == 20
    assert a["slow_excess_fraction"] == pytest.approx(20 * (1.4 - median) / sum(steps))
    assert a["slow_excess_fraction"] > 0.8
    assert a["step_outliers"] is True and a["flagged"] is True
    assert a["busy"] is None and a["others_cpus"] is None  # load not recorded: unknown


def test_outlier_rule_boundaries():
    # 999 steps of 10 ms and one more: slow only above 5x the median; flagged only when the
    # slow steps' excess is more than 2% of the training time: (x - 0.01) / (9.99 + x) > 0.02
    # <=> x > 0.2141 s.
    def run(last: float) -> dict:
        return contention.assess([0.01] * 999 + [last], None, None, None, threads=1)

    assert run(0.05)["slow_steps"] == 0  # exactly 5x the median is not slow
    a = run(0.2)
    assert a["slow_steps"] == 1 and a["slow_excess_fraction"] == pytest.approx(0.19 / 10.19)
    assert not a["step_outliers"] and not a["flagged"]
    b = run(0.3)
    assert b["slow_excess_fraction"] == pytest.approx(0.29 / 10.29)
    assert b["step_outliers"] and b["flagged"]
    assert contention.reasons(b) == [
        "1 step(s) slower than 5x the median (10.0 ms) added 2.8% to the training time"]


@pytest.mark.parametrize("others, threads, cpus, busy", [
    (0.0, 2, 2, False),     # only this run: demand 1.0
    (0.19, 2, 2, False),    # (0.19 + 2) / 2 = 1.095
    (0.21, 2, 2, True),     # 1.105
    (1.6, 2, 2, True),      # a busy loop and more on a 2-CPU machine
    (13.5, 2, 16, False),   # (13.5 + 2) / 16 = 0.97: other work used CPUs this run left free
    (15.7, 2, 16, True),
])
def test_busy_rule_is_cpu_demand_against_cpus(others, threads, cpus, busy):
    n, step = 100, 0.02
    cpu = [0.03] * n  # this process: 1.5 CPUs during each step
    host = [c + others * step for c in cpu]
    a = contention.assess([step] * n, cpu, host, cpus, threads)
    assert a["others_cpus"] == pytest.approx(others)
    assert a["cpu_demand_ratio"] == pytest.approx((others + threads) / cpus)
    assert a["busy"] is busy and a["flagged"] is busy and not a["step_outliers"]
    assert bool(contention.reasons(a, cpus)) is busy


def test_assess_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one step"):
        contention.assess([], None, None, None, 1)
    with pytest.raises(ValueError, match="cpu_s has 1 values for 2 steps"):
        contention.assess([0.1, 0.1], [0.1], None, None, 1)
    with pytest.raises(ValueError, match="training time must be positive"):
        contention.assess([0.0], None, None, None, 1)


def test_audit_rules_agree_bit_for_bit_with_the_harness():
    rng = random.Random(7)
    for trial in range(200):
        n = rng.randint(1, 60)
        steps = [rng.lognormvariate(-4, 1.0 if trial % 2 else 0.2) for _ in range(n)]
        cpu = [s * rng.uniform(0.2, 2.0) for s in steps]
        host = [c + s * rng.uniform(-0.1, 2.0) for c, s in zip(cpu, steps)]
        cpus, threads = rng.choice([1, 2, 4, 16]), rng.choice([1, 2, 8])
        for args in ((steps, cpu, host, cpus, threads), (steps, None, None, None, threads)):
            mine = contention.assess(*args)
            mine.pop("median_step_s")
            assert audit.assess_timing(*args) == mine


def test_host_sampler_reads_the_cpus_of_its_affinity_set(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 1 4 100 3 1 1 2 0 0\n"
                    "cpu0 5 1 2 50 1 1 1 1 0 0\n"
                    "cpu1 5 0 2 50 2 0 0 1 0 0\n"
                    "intr 123 0 0\n")
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    monkeypatch.setattr(contention, "_affinity", lambda: {1})
    sampler = contention.HostSampler(str(stat))
    assert sampler.cpus == 1
    busy, steal = sampler.sample()
    # cpu1: user 5 + nice 0 + system 2 + irq 0 + softirq 0 + steal 1 (idle, iowait excluded)
    assert busy == pytest.approx(8 * tick) and steal == pytest.approx(1 * tick)
    monkeypatch.setattr(contention, "_affinity", lambda: None)
    both = contention.HostSampler(str(stat))
    assert both.cpus == 2 and both.sample()[0] == pytest.approx((11 + 8) * tick)
    missing = contention.HostSampler(str(tmp_path / "nope"))
    assert missing.cpus is None and missing.sample() is None  # not measured, never "idle"


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc/stat only")
def test_host_sampler_sees_this_process_burn_cpu():
    sampler = contention.HostSampler()
    assert sampler.cpus == len(os.sched_getaffinity(0))
    h0, c0 = sampler.sample(), time.process_time()
    end = time.perf_counter() + 0.4
    while time.perf_counter() < end:
        pass
    h1, c1 = sampler.sample(), time.process_time()
    own = c1 - c0
    assert own > 0.1  # we did burn CPU (shared machine: at least a quarter of 0.4 s)
    # the machine's busy ticks include ours (tick sampling: allow half of them to be missed)
    assert h1[0] - h0[0] >= 0.5 * own


def test_progress_line():
    rows = {"native": [{"step_s": 0.02, "cpu_s": 0.03, "host_cpu_s": 0.06}] * 3,
            "cotangent": [{"step_s": 0.01, "cpu_s": 0.02, "host_cpu_s": 0.02}] * 3}
    line = progress_line(30, 120, 12.0, rows)
    # others: (3 * 0.06 + 3 * 0.02 - 3 * 0.03 - 3 * 0.02) / (3 * 0.02 + 3 * 0.01) = 1.0 CPU
    assert line == ("progress: step 30/120 (25%), 12.0 s, ETA 36 s; median step ms native 20.0, "
                    "cotangent 10.0; other work 1.00 CPUs")
    assert "\r" not in line and "other work" not in progress_line(
        1, 2, 1.0, {"native": [{"step_s": 0.1, "cpu_s": 0.1}]})
