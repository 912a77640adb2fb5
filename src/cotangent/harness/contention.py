"""Machine load during training, and the rules that flag a run whose step times are suspect.

Measured around every timed step (outside the timed region) and written into its curve.jsonl
row beside `step_s`:

    cpu_s         CPU seconds this process used during the step, all its threads
                  (`time.process_time`).
    host_cpu_s    busy CPU seconds, during the step, of the CPUs this process may run on (its
                  affinity set): user + nice + system + irq + softirq + steal from the per-CPU
                  lines of Linux's /proc/stat (clock ticks, 1/SC_CLK_TCK s each, so a single
                  step is resolved only to a tick per CPU; a run's sums are accurate). It
                  includes this process's own time.
    host_steal_s  of those, the seconds the hypervisor gave to other virtual machines.

`host_cpu_s` and `host_steal_s` are absent where /proc/stat cannot be read (not Linux): the
busy rule is then "not measured" (None), never "not busy". Each run's summary.json adds the
sums (`cpu_s`, `host_cpu_s`, `host_steal_s`), `host_cpus` (the size of that CPU set),
`load_avg_1m_start` / `load_avg_1m_end` (`os.getloadavg()` before the first and after the
last step, None where unavailable; recorded, not used by the rules: it lags by a minute and
counts this run's own threads) and the rule results below.

Rules, per run (`assess`), with the run's own numbers only:

    slow step             step_s > SLOW_STEP_FACTOR (5) x the run's median step_s
    slow_steps            how many steps are slow
    slow_excess_fraction  sum over slow steps of (step_s - median) / training_s: the share of
                          the run's training time that its slow steps added
    step_outliers         slow_excess_fraction > OUTLIER_EXCESS_FRACTION (0.02)
    others_cpus           (sum host_cpu_s - sum cpu_s) / training_s: how many CPUs other
                          processes and the hypervisor kept busy, on average, while this run's
                          steps were timed
    cpu_demand_ratio      (others_cpus + threads) / host_cpus, `threads` being torch's
                          intra-op thread count: above 1 the run's threads and the other work
                          together wanted more CPUs than there were
    busy                  cpu_demand_ratio > BUSY_DEMAND_RATIO (1.1); None when not measured
    flagged               step_outliers or busy

A flagged run's training time may say more about the machine than about the code: `cotangent
analyze` lists it (runs.csv, pairs.csv, results.json, a warning line), `cotangent report`
shows it, and `cotangent audit` recomputes every number and flag from the per-step records.
The arithmetic (statistics.median, left-to-right sums) is the audit's, so the flags agree bit
for bit.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

SLOW_STEP_FACTOR = 5.0
OUTLIER_EXCESS_FRACTION = 0.02
BUSY_DEMAND_RATIO = 1.1
PROC_STAT = "/proc/stat"
RULES = {
    "slow_step_factor": SLOW_STEP_FACTOR,
    "outlier_excess_fraction": OUTLIER_EXCESS_FRACTION,
    "busy_demand_ratio": BUSY_DEMAND_RATIO,
    "slow_step": "step_s > slow_step_factor x the run's median step_s",
    "step_outliers": "sum over slow steps of (step_s - median) / training_s > "
                     "outlier_excess_fraction",
    "busy": "(others_cpus + threads) / host_cpus > busy_demand_ratio, where others_cpus = "
            "(sum host_cpu_s - sum cpu_s) / training_s; null when /proc/stat was not readable",
    "flagged": "step_outliers or busy",
}


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class HostSampler:
    """Reads the busy and steal clock ticks of the CPUs this process may run on.

    `sample()` returns (busy_s, steal_s) since boot, or None when /proc/stat is unreadable
    (then every sample is None: the load is "not measured"). `cpus` is the number of CPUs
    summed (None when unreadable).
    """

    def __init__(self, path: str = PROC_STAT) -> None:
        self.path = path
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        allowed = _affinity()
        self.lines: set[bytes] | None = None
        first = self._read()
        if first is not None:
            names = [line.split(None, 1)[0] for line in first]
            self.lines = {n for n in names
                          if allowed is None or int(n[3:]) in allowed} or None
        self.cpus = None if self.lines is None else len(self.lines)

    def _read(self) -> list[bytes] | None:
        """The per-CPU lines (`cpuN ...`) of /proc/stat, or None."""
        try:
            with open(self.path, "rb") as f:
                text = f.read()
        except OSError:
            return None
        rows = [line for line in text.split(b"\n")
                if line.startswith(b"cpu") and line[3:4].isdigit()]
        return rows or None

    def sample(self) -> tuple[float, float] | None:
        """(busy seconds, steal seconds) summed over the sampled CPUs since boot, or None."""
        if self.lines is None:
            return None
        rows = self._read()
        if rows is None:
            return None
        busy = steal = 0
        for line in rows:
            fields = line.split()
            if fields[0] not in self.lines:
                continue
            # user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
            values = [int(v) for v in fields[1:9]]
            values += [0] * (8 - len(values))
            busy += values[0] + values[1] + values[2] + values[5] + values[6] + values[7]
            steal += values[7]
        return busy * self.tick_s, steal * self.tick_s


def load_average_1m() -> float | None:
    """The 1-minute load average (`os.getloadavg()[0]`), or None where unavailable."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def assess(step_s: Sequence[float], cpu_s: Sequence[float] | None,
           host_cpu_s: Sequence[float] | None, host_cpus: int | None,
           threads: int) -> dict:
    """The module docstring's rules for one run.

    Args:
        step_s: every step's wall seconds, in order (at least one).
        cpu_s: every step's process CPU seconds, or None when not recorded (older records).
        host_cpu_s: every step's busy CPU seconds of the run's CPUs, or None (not measured).
        host_cpus: how many CPUs `host_cpu_s` covers, or None.
        threads: torch's intra-op thread count of the run.

    Returns:
        {median_step_s, slow_steps, slow_excess_fraction, step_outliers, others_cpus,
        cpu_demand_ratio, busy, flagged}; others_cpus, cpu_demand_ratio and busy are None when
        the load was not measured (flagged then rests on step_outliers alone).

    Raises:
        ValueError: no steps, a non-positive training time, or per-step lists of another
            length than `step_s`.
    """
    if not step_s:
        raise ValueError("assess needs at least one step")
    training_s = sum(step_s)
    if not training_s > 0:
        raise ValueError(f"training time must be positive, got {training_s}")
    for name, values in (("cpu_s", cpu_s), ("host_cpu_s", host_cpu_s)):
        if values is not None and len(values) != len(step_s):
            raise ValueError(f"{name} has {len(values)} values for {len(step_s)} steps")
    median = statistics.median(step_s)
    slow = [s for s in step_s if s > SLOW_STEP_FACTOR * median]
    excess = sum(s - median for s in slow) / training_s
    others = demand = busy = None
    if cpu_s is not None and host_cpu_s is not None and host_cpus:
        others = (sum(host_cpu_s) - sum(cpu_s)) / training_s
        demand = (others + threads) / host_cpus
        busy = demand > BUSY_DEMAND_RATIO
    outliers = excess > OUTLIER_EXCESS_FRACTION
    return {"median_step_s": median, "slow_steps": len(slow), "slow_excess_fraction": excess,
            "step_outliers": outliers, "others_cpus": others, "cpu_demand_ratio": demand,
            "busy": busy, "flagged": outliers or bool(busy)}


def reasons(a: dict, host_cpus: int | None = None) -> list[str]:
    """Plain-language reasons of a flagged run (`assess`'s dict), empty when not flagged."""
    out = []
    if a["step_outliers"]:
        out.append(f"{a['slow_steps']} step(s) slower than {SLOW_STEP_FACTOR:g}x the median "
                   f"({1e3 * a['median_step_s']:.1f} ms) added "
                   f"{100 * a['slow_excess_fraction']:.1f}% to the training time")
    if a["busy"]:
        out.append(f"machine busy: other work kept {a['others_cpus']:.2f} CPUs busy"
                   + (f" of {host_cpus}" if host_cpus else "")
                   + f" (CPU demand {a['cpu_demand_ratio']:.2f}x)")
    return out
