"""Paired-seed statistics for native-vs-Cotangent comparisons (used by `cotangent analyze`).

Pure functions over per-pair numbers; scipy supplies the distributions and the bootstrap.
Definitions (one pair = the same seed trained by a baseline arm and a candidate arm):

- time-to-target: training seconds (the sum of the step times so far, the probe's `training_s`;
  evaluation and set-up excluded) at the first probe whose BPB is <= the target; no
  interpolation; a run that never reaches it is *censored* (None), never dropped.
- fixed-budget reduction: 1 - T_candidate / T_baseline.
- quality difference: candidate test BPB - baseline test BPB (lower BPB is better).
- paired Student-t interval: mean of the paired differences +- t_{(1+level)/2, n-1} * s / sqrt(n).
- non-inferiority: the candidate is non-inferior when the interval's upper bound on the quality
  difference is below the margin.
- 2x2 factorial over {batched norms} x {packing}, per seed: norm-only = BN - N, packing-only =
  P - N, combined = B - N, main effect of norms = ((BN - N) + (B - P)) / 2, main effect of
  packing = ((P - N) + (B - BN)) / 2, interaction = B - P - BN + N (N native, BN
  batched-norms-only, P packing-only, B both = cotangent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Interval:
    """A paired mean difference with its two-sided confidence interval."""

    n: int
    mean: float
    low: float
    high: float
    level: float
    sd: float

    def as_dict(self) -> dict:
        return asdict(self)


def paired_t_interval(differences: Sequence[float], level: float) -> Interval:
    """Student-t interval for the mean of paired differences.

    Raises:
        ValueError: fewer than 2 differences, or `level` outside (0, 1).
    """
    x = np.asarray(differences, dtype=float)
    if x.size < 2:
        raise ValueError(f"a paired t interval needs at least 2 pairs, got {x.size}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    mean = float(x.mean())
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, x.size - 1)) * sd / math.sqrt(x.size)
    return Interval(int(x.size), mean, mean - half, mean + half, level, sd)


def bootstrap_interval(differences: Sequence[float], level: float, *, resamples: int = 10_000,
                       seed: int = 0) -> Interval:
    """Percentile bootstrap over pairs (seeds) for the mean difference: a cross-check of
    `paired_t_interval` that does not assume normality (scipy.stats.bootstrap)."""
    x = np.asarray(differences, dtype=float)
    if x.size < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 pairs, got {x.size}")
    result = stats.bootstrap((x,), np.mean, confidence_level=level, n_resamples=resamples,
                             method="percentile", rng=np.random.default_rng(seed))
    return Interval(int(x.size), float(x.mean()), float(result.confidence_interval.low),
                    float(result.confidence_interval.high), level, float(x.std(ddof=1)))


def time_to_target(probes: Sequence[dict], target: float, *, key: str = "probe_bpb",
                   time_key: str = "training_s") -> float | None:
    """`time_key` seconds (default: training seconds) at the first probe with `key` <=
    `target`; None (censored) if none reaches it."""
    for probe in probes:
        if probe[key] <= target:
            return float(probe[time_key])
    return None


def reduction(candidate: float, baseline: float) -> float:
    """1 - candidate / baseline (e.g. 0.2 = the candidate needs 20% less time)."""
    if baseline <= 0:
        raise ValueError(f"baseline must be positive, got {baseline}")
    return 1.0 - candidate / baseline


def non_inferiority(quality_differences: Sequence[float], margin: float,
                    level: float) -> dict:
    """Decision on candidate - baseline BPB: non-inferior when the interval's upper bound is
    below `margin` (the largest BPB increase the protocol tolerates)."""
    interval = paired_t_interval(quality_differences, level)
    return dict(interval=interval.as_dict(), margin=margin, non_inferior=interval.high < margin)


CONTRASTS = ("norm_only", "packing_only", "combined", "main_norms", "main_packing",
             "interaction")


def factorial_contrasts(native: Sequence[float], norms: Sequence[float],
                        packing: Sequence[float], both: Sequence[float]) -> dict[str, list[float]]:
    """Per-seed contrasts of the 2x2 factorial (see the module docstring); inputs are per-seed
    values of one metric, aligned by seed."""
    n, bn, p, b = (np.asarray(v, dtype=float) for v in (native, norms, packing, both))
    if not n.shape == bn.shape == p.shape == b.shape:
        raise ValueError("the four cells need one value per seed each")
    return {
        "norm_only": (bn - n).tolist(),
        "packing_only": (p - n).tolist(),
        "combined": (b - n).tolist(),
        "main_norms": (((bn - n) + (b - p)) / 2).tolist(),
        "main_packing": (((p - n) + (b - bn)) / 2).tolist(),
        "interaction": (b - p - bn + n).tolist(),
    }
