"""Audit a Cotangent campaign from its records alone, with the Python standard library only.

    python3 src/cotangent/harness/audit.py RUNS        (no install, no torch/numpy/scipy)
    cotangent audit RUNS                       (the same code)

Exit status 0 only when every check passes; 1 when any fails (each failure names the file);
2 when RUNS is not an analysed campaign directory. Checks:

1. Integrity: every file listed in analysis/manifest.json (and report/manifest.json, if the
   report exists) has the listed SHA-256 and size; no listed file is missing; no file exists
   that no manifest lists.
2. Protocol: protocol.toml's SHA-256 is freeze.json's; the frozen job set is exactly
   models x seeds x arms of the protocol, each once; the job directories are those jobs.
3. Runs: each job has one deciding attempt (done or failed); a done attempt holds exactly one
   run record, whose metadata names the job's model, seed, arm, steps and probe cadence, the
   frozen code SHA-256 and torch version, and the frozen data SHA-256s; summary.json's
   training_s and update_s equal the sums of curve.jsonl's step_s and update_s; the curve has
   one row per step and the summary's probes are the curve's. Machine load and timing flags
   (`cotangent.harness.contention`): the summary's cpu_s, host_cpu_s and host_steal_s are the
   sums of the step rows' values (every step row has them or none does), threads is the
   metadata's, and its slow_steps, slow_excess_fraction, step_outliers, others_cpus,
   cpu_demand_ratio, busy and flagged are recomputed from the step rows with this file's own
   copy of the rules; every run of a campaign reports the same host_cpus, and either every
   run or none has a load record (one code ran them all).
4. Pairs: all arms of a (model, seed) block share the initial-model and LR-schedule hashes.
5. Numbers: runs.csv, pairs.csv and results.json are recomputed from the records: per-run
   time-to-target, per-pair reductions and quality differences, and every paired Student-t
   interval (this file's own t quantile, from the regularized incomplete beta function) and
   non-inferiority decision, to 1e-9 relative agreement; the load and flag columns of
   runs.csv, pairs.csv's timing_flagged, and results.json's timing_flags (the rules' numbers,
   the flagged, step_outliers, busy and load_not_measured job lists, each flagged run's
   numbers; its reason texts are not recomputed) and each comparison's timing_flagged_seeds.
   Bootstrap intervals depend on numpy's generator, so for them the audit checks n, the mean,
   and low <= high inside the range of the paired values (where every resampled mean lies).
6. Decision rules: when protocol.toml declares `[[decision_rules]]`, they are validated and
   re-evaluated per model from the done runs' summary.json records (test_bpb, training_s,
   update_s, peak_rss_kib) with this file's evaluator (`check_decision_rules`,
   `decision_rule_verdicts`: the one implementation, which `cotangent analyze` imports);
   results.json's decision_rules must list the same rules, state that they are prospective
   decision rules and not significance tests, and record the same verdicts, clause and
   condition outcomes and (within 1e-9) values. Without rules, results.json must claim none.

Definitions are those of `cotangent.harness.analysis` (its docstring is copied into
results.json as "definitions").
"""

from __future__ import annotations

import ast
import csv
import hashlib
import json
import math
import re
import statistics
import sys
import tomllib
from datetime import datetime
from pathlib import Path

RTOL = 1e-9
# the 2x2 factorial {batched norms} x {packing}: "packed" (the harness's PackedAdamW) is both
FACTORIAL_ARMS = ("native", "batched-norms-only", "packing-only", "packed")
# The timing-flag rules of cotangent.harness.contention (its docstring defines them).
SLOW_STEP_FACTOR = 5.0
OUTLIER_EXCESS_FRACTION = 0.02
BUSY_DEMAND_RATIO = 1.1
FLAG_KEYS = ("slow_steps", "slow_excess_fraction", "step_outliers", "others_cpus",
             "cpu_demand_ratio", "busy", "flagged")
LOAD_KEYS = ("cpu_s", "threads", "host_cpus", "host_steal_s", "load_avg_1m_start",
             "load_avg_1m_end")
# Where a `cotangent train` setting sits in a run's nested config (metadata.json's "config",
# config.toml): setting name -> (section, field), for those not at the top level; a copy of
# `cotangent.harness.train.TrainConfig`'s declarations (a test keeps them equal). Records
# written before the config was nested hold every setting at the top level.
SETTING_PATHS = {
    "model": ("model", "name"), "compile": ("model", "compile"),
    **{k: ("optimizer", k) for k in ("lr", "betas", "eps", "weight_decay", "max_norm")},
    **{"muon_" + k: ("muon", k) for k in (
        "lr", "momentum", "ns_steps", "beta2", "weight_decay", "embedding_lr", "head_lr",
        "adamw_betas", "adamw_eps", "adamw_weight_decay", "compile")},
    "val_bytes": ("eval", "val_bytes"), "eval_every": ("eval", "every"),
    "probe_bytes": ("eval", "probe_bytes"), "eval_batch": ("eval", "batch"),
    "batch_size": ("data", "batch_size"),
}


class _Missing:
    def __repr__(self) -> str:
        return "(missing)"


_MISSING = _Missing()


_SECTIONS = {path[0] for path in SETTING_PATHS.values()}


def config_setting(cfg: dict, name: str):
    """Setting `name` of a run's config, or `_MISSING`: a nested config (one with a section
    table) holds it at its `SETTING_PATHS` path only; a flat one (records written before the
    sections) at the top level only."""
    nested = any(isinstance(cfg.get(section), dict) for section in _SECTIONS)
    value = cfg
    for key in SETTING_PATHS.get(name, (name,)) if nested else (name,):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def train_settings(table: dict) -> dict:
    """A protocol's `[train]` table by setting name: section tables (``[train.optimizer]``)
    and quoted dotted keys (``'optimizer.lr'``) turned into setting names through
    `SETTING_PATHS`, as `cotangent.harness.schema.nest_values` does; other keys as they are."""
    by_path = {path: name for name, path in SETTING_PATHS.items()}
    out = {}
    for key, value in table.items():
        head, dot, rest = key.partition(".")
        if head in _SECTIONS and dot:
            out[by_path.get((head, rest), key)] = value
        elif isinstance(value, dict):
            out.update({by_path.get((key, k), f"{key}.{k}"): v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _lists(value):
    """`value` with every tuple a list, recursively (JSON and TOML hold lists)."""
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return [_lists(v) for v in value] if isinstance(value, (tuple, list)) else value


# ----------------------------------------------------------------------------- t quantile

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz's method;
    Abramowitz & Stegun 26.5.8), for x < (a + 1) / (a + b + 2)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((a + m2 - 1.0) * (a + m2)),
                    -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            return h
    raise ArithmeticError("incomplete beta continued fraction did not converge")


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                 + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_upper_tail(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom, t >= 0."""
    return 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (p in (0.5, 1)), by bisection on the upper tail to full
    double precision."""
    if not 0.5 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    tail = 1.0 - p
    low, high = 0.0, 1.0
    while t_upper_tail(high, df) > tail:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if t_upper_tail(mid, df) > tail:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def t_interval(values: list[float], level: float) -> dict:
    """Paired Student-t interval: mean +- t_{(1+level)/2, n-1} * sd / sqrt(n)."""
    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values)
    half = t_quantile((1.0 + level) / 2.0, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half,
            "level": level}


# ----------------------------------------------------------------------------- decision rules

# The one implementation of prospective decision rules: `cotangent.harness.campaign` validates
# a protocol's rules with `check_decision_rules`, `cotangent.harness.analysis` evaluates them
# with `decision_rule_verdicts`, and the audit below re-evaluates them from the run records.
DECISION_METRICS = {
    "bpb": "mean test BPB over the seeds (summary.json test_bpb)",
    "training_s": "median training seconds over the seeds (summary.json training_s)",
    "update_s": "median update-phase seconds over the seeds (summary.json update_s)",
    "peak_mib": "median peak resident memory of the run's process, MiB (summary.json "
                "peak_rss_kib / 1024)",
}
DECISION_FUNCTIONS = ("min", "max")
DECISION_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
RULE_KEYS = ("name", "kind", "description", "any_of", "all_of")
RULE_NAME = re.compile(r"[A-Za-z0-9_-]+")
MAX_CONDITION_CHARS = 1000
DECISION_NOTE = (
    "These are prospective decision rules, declared in protocol.toml and frozen with it (its "
    "SHA-256 is in freeze.json) before any run. A verdict compares point estimates (the mean "
    "test BPB and the median times and peak memory over each arm's done seeds) with the "
    "thresholds the protocol fixed; it is a decision rule, not a significance test, and carries "
    "no p-value, confidence level or error rate. A rule passes when any of its clauses holds "
    "and a clause holds when all of its conditions hold; a value that cannot be computed (an "
    "arm without a done run, a run without the record) is unknown, and the verdict is "
    "'undecided' when the unknown values could change it.")


def _arm_of(call: ast.Call) -> str | None:
    """The arm written in `metric(ARM)`: a bare name or a quoted string (None: neither)."""
    if len(call.args) != 1 or call.keywords:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Name):
        return arg.id
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _check_expression(node: ast.AST, text: str, arms) -> None:
    """Refuse every node but numbers, + - * /, unary +/-, min/max and metric(ARM)."""
    allowed = ("numbers, + - * /, unary minus, parentheses, min(...), max(...) and "
               "metric(ARM)")
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{value!r} in {text!r} is not a number")
        try:
            finite = math.isfinite(float(value))
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError(f"{ast.unparse(node)} in {text!r} is not a finite number")
    elif isinstance(node, ast.BinOp):
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            raise ValueError(f"{ast.unparse(node)!r} in {text!r}: only {allowed} are allowed")
        _check_expression(node.left, text, arms)
        _check_expression(node.right, text, arms)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.UAdd)):
            raise ValueError(f"{ast.unparse(node)!r} in {text!r}: only {allowed} are allowed")
        _check_expression(node.operand, text, arms)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        if name in DECISION_FUNCTIONS:
            if not node.args or node.keywords or any(isinstance(x, ast.Starred)
                                                     for x in node.args):
                raise ValueError(f"{ast.unparse(node)!r} in {text!r}: {name} takes one or more "
                                 "expressions")
            for arg in node.args:
                _check_expression(arg, text, arms)
        elif name in DECISION_METRICS:
            arm = _arm_of(node)
            if arm is None:
                raise ValueError(f"{ast.unparse(node)!r} in {text!r}: a metric takes one arm, a "
                                 f"bare name or a quoted string (e.g. {name}(\"cotangent-zero1\"),"
                                 " quoted because of the '-')")
            if arm not in arms:
                raise ValueError(f"unknown arm {arm!r} in {text!r} (the protocol's arms: "
                                 f"{', '.join(arms)})")
        else:
            raise ValueError(f"unknown metric {name!r} in {text!r} (metrics: "
                             f"{', '.join(DECISION_METRICS)}; functions: "
                             f"{', '.join(DECISION_FUNCTIONS)})")
    elif isinstance(node, ast.Name):
        raise ValueError(f"bare name {node.id!r} in {text!r}: write a number or metric(ARM) "
                         f"with a metric from {', '.join(DECISION_METRICS)}")
    else:
        raise ValueError(f"{ast.unparse(node)!r} in {text!r}: only {allowed} are allowed")


def parse_condition(text, arms) -> ast.Compare:
    """The syntax tree of one condition, `EXPR OP EXPR` with OP one of <=, <, >=, >, checked
    node by node against a whitelist (it is evaluated by `_value`, never by eval).

    Raises:
        ValueError: one line naming the condition and what is wrong with it.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a condition must be a non-empty string, got {text!r}")
    if len(text) > MAX_CONDITION_CHARS:
        raise ValueError(f"a condition of {len(text)} characters (at most "
                         f"{MAX_CONDITION_CHARS})")
    try:
        body = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        raise ValueError(f"{text!r} is not a valid expression ({reason})") from None
    if not isinstance(body, ast.Compare):
        raise ValueError(f"{text!r} is not a comparison (EXPR <= EXPR, or <, >=, >)")
    if len(body.ops) != 1:
        raise ValueError(f"{text!r} chains comparisons; write one condition per comparison")
    if type(body.ops[0]) not in DECISION_OPS:
        raise ValueError(f"{text!r}: compare with <=, <, >= or > only")
    try:
        _check_expression(body.left, text, arms)
        _check_expression(body.comparators[0], text, arms)
    except RecursionError:
        raise ValueError(f"{text!r} is nested too deeply") from None
    return body


def check_decision_rules(raw, arms) -> list[dict]:
    """A protocol's `[[decision_rules]]` validated and normalised to {name, kind, description,
    any_of}: `all_of = [...]` becomes `any_of = [[...]]`, kind and description default to "".

    Raises:
        ValueError: one line naming the rule (by name, or by position before its name is
            known) and the problem: not an array of tables, a bad or duplicate name, an
            unknown key, neither or both of any_of and all_of, an empty clause or clause list,
            or a condition `parse_condition` refuses (bad syntax, a disallowed node, an
            unknown metric or arm).
    """
    if not isinstance(raw, (list, tuple)):
        raise ValueError("decision_rules must be an array of tables ([[decision_rules]]), got "
                         f"{raw!r}")
    rules: list[dict] = []
    for i, rule in enumerate(raw):
        label = f"decision_rules[{i}]"
        if not isinstance(rule, dict):
            raise ValueError(f"{label} must be a table, got {rule!r}")
        name = rule.get("name")
        if not isinstance(name, str) or not RULE_NAME.fullmatch(name):
            raise ValueError(f"{label}: name must be letters, digits, '_' or '-', got {name!r}")
        label = f"decision rule {name!r}"
        if any(r["name"] == name for r in rules):
            raise ValueError(f"{label}: duplicate name (each rule needs its own)")
        unknown = [key for key in rule if key not in RULE_KEYS]
        if unknown:
            raise ValueError(f"{label}: unknown key(s) {', '.join(map(str, unknown))}; known: "
                             f"{', '.join(RULE_KEYS)}")
        for key in ("kind", "description"):
            if not isinstance(rule.get(key, ""), str):
                raise ValueError(f"{label}: {key} must be a string, got {rule[key]!r}")
        if ("any_of" in rule) == ("all_of" in rule):
            raise ValueError(f"{label}: give exactly one of any_of (a list of clauses) or all_of "
                             "(one clause)")
        if "any_of" in rule:
            clauses = rule["any_of"]
            if not isinstance(clauses, (list, tuple)) or not clauses:
                raise ValueError(f"{label}: any_of must be a non-empty list of clauses, each a "
                                 f"list of conditions, got {clauses!r}")
        else:
            clauses = [rule["all_of"]]
        for j, clause in enumerate(clauses, 1):
            if isinstance(clause, str):
                raise ValueError(f"{label}: clause {j} is a string, not a list of conditions "
                                 "(any_of takes a list of clauses; all_of takes one clause)")
            if not isinstance(clause, (list, tuple)) or not clause:
                raise ValueError(f"{label}: clause {j} is empty; a clause is a non-empty list "
                                 f"of conditions, got {clause!r}")
            for condition in clause:
                try:
                    parse_condition(condition, arms)
                except ValueError as exc:
                    raise ValueError(f"{label}, clause {j}: {exc}") from None
        rules.append({"name": name, "kind": rule.get("kind", ""),
                      "description": rule.get("description", ""),
                      "any_of": [list(clause) for clause in clauses]})
    return rules


def decision_metrics(runs: list[dict]) -> dict:
    """One arm's metrics on one model from its done runs (dicts with seed, test_bpb,
    training_s, update_s and peak_rss_kib, as summary.json records them): {"seeds": [...],
    metric: value} for every metric of DECISION_METRICS; a metric is None when there is no
    run or a run lacks a finite number for it."""
    def column(key: str) -> list[float] | None:
        values = [r.get(key) for r in runs]
        ok = bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                  and math.isfinite(v) for v in values)
        return values if ok else None

    bpb, training, update, peak = (column(k) for k in ("test_bpb", "training_s", "update_s",
                                                       "peak_rss_kib"))
    return {"seeds": [r["seed"] for r in runs],
            "bpb": None if bpb is None else statistics.fmean(bpb),
            "training_s": None if training is None else statistics.median(training),
            "update_s": None if update is None else statistics.median(update),
            "peak_mib": None if peak is None else statistics.median([v / 1024 for v in peak])}


class _Unknown(Exception):
    """A value a condition needs cannot be computed (the message says why)."""


def _value(node: ast.AST, metrics: dict) -> float:
    """A checked expression's value; _Unknown when a metric is missing or arithmetic fails."""
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.UnaryOp):
        value = _value(node.operand, metrics)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, metrics), _value(node.right, metrics)
        if isinstance(node.op, ast.Div) and right == 0:
            raise _Unknown(f"division by zero in {ast.unparse(node)}")
        value = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right,
                 ast.Mult: lambda: left * right, ast.Div: lambda: left / right}[
                     type(node.op)]()
        if not math.isfinite(value):
            raise _Unknown(f"{ast.unparse(node)} is not finite")
        return value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in DECISION_FUNCTIONS:
            values = [_value(arg, metrics) for arg in node.args]
            return min(values) if node.func.id == "min" else max(values)
        arm = _arm_of(node)
        found = metrics[arm]
        if found[node.func.id] is None:
            raise _Unknown(f"{node.func.id}({arm}): " + (
                f"no done run of {arm}" if not found["seeds"] else
                f"a run of {arm} lacks the record"))
        return float(found[node.func.id])
    raise ValueError(f"unchecked node {ast.dump(node)}")  # parse_condition refuses these


def _kleene_all(values: list) -> bool | None:
    return False if False in values else None if None in values else True


def evaluate_rule(rule: dict, metrics: dict) -> dict:
    """Evaluate one normalised rule on metrics {arm: decision_metrics(...)} (every arm of the
    protocol). Returns {verdict, clauses: [{held, conditions: [{condition, left_expression,
    left, op, right_expression, right, held[, unknown]}]}]}: a condition whose value cannot be
    computed has held None (the reason under "unknown"); a clause holds when all its conditions
    hold and fails when one fails; the verdict is "pass" when a clause holds, "fail" when every
    clause fails, else "undecided"."""
    arms = list(metrics)
    clauses = []
    for clause in rule["any_of"]:
        conditions = []
        for text in clause:
            tree = parse_condition(text, arms)
            source = text.strip()
            entry = {"condition": text, "op": DECISION_OPS[type(tree.ops[0])]}
            unknown = []
            for side, node in (("left", tree.left), ("right", tree.comparators[0])):
                entry[f"{side}_expression"] = ast.get_source_segment(source, node) or \
                    ast.unparse(node)
                try:
                    entry[side] = _value(node, metrics)
                except _Unknown as exc:
                    entry[side] = None
                    unknown.append(str(exc))
            if unknown:
                entry.update(held=None, unknown="; ".join(unknown))
            else:
                left, right = entry["left"], entry["right"]
                entry["held"] = {"<": left < right, "<=": left <= right, ">": left > right,
                                 ">=": left >= right}[entry["op"]]
            conditions.append(entry)
        clauses.append({"held": _kleene_all([c["held"] for c in conditions]),
                        "conditions": conditions})
    held = [c["held"] for c in clauses]
    verdict = "pass" if True in held else "fail" if all(h is False for h in held) \
        else "undecided"
    return {"verdict": verdict, "clauses": clauses}


def rule_references(rule: dict, arms) -> dict[str, list[str]]:
    """{arm: [metric, ...]} that a normalised rule reads, in the protocol's arm and
    DECISION_METRICS order."""
    used = set()
    for clause in rule["any_of"]:
        for text in clause:
            for node in ast.walk(parse_condition(text, arms)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id in DECISION_METRICS:
                    used.add((_arm_of(node), node.func.id))
    return {arm: [m for m in DECISION_METRICS if (arm, m) in used]
            for arm in arms if any(a == arm for a, _ in used)}


def decision_rule_verdicts(rules, models, arms, seeds, done: dict) -> list[dict]:
    """Every rule evaluated on every model, models outer: {model, name, kind, description,
    verdict, clauses, metrics: {arm: {seeds, metric: value}} (the arms and metrics the rule
    reads)}. `done` maps (model, seed, arm) to a done run's facts (see decision_metrics)."""
    out = []
    for model in models:
        metrics = {arm: decision_metrics([done[(model, s, arm)] for s in seeds
                                          if (model, s, arm) in done]) for arm in arms}
        for rule in rules:
            result = evaluate_rule(rule, metrics)
            used = rule_references(rule, arms)
            out.append({"model": model, "name": rule["name"], "kind": rule["kind"],
                        "description": rule["description"], **result,
                        "metrics": {arm: {"seeds": metrics[arm]["seeds"],
                                          **{m: metrics[arm][m] for m in names}}
                                    for arm, names in used.items()}})
    return out


# ----------------------------------------------------------------------------- the audit

class Audit:
    """Collects failures (each naming a file) and counts the checks made."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.failures: list[str] = []
        self.checks = 0
        self.context = "."  # the file being interpreted, named if it cannot be

    def fail(self, file: str, message: str) -> None:
        self.failures.append(f"{file}: {message}")

    def check(self, ok: bool, file: str, message: str) -> bool:
        self.checks += 1
        if not ok:
            self.fail(file, message)
        return ok

    def close(self, a, b, file: str, what: str, scale: float = 0.0) -> bool:
        """a (recorded) agrees with b (recomputed): equal, or both numbers within RTOL."""
        self.checks += 1
        if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None \
                or isinstance(a, str) or isinstance(b, str):
            ok = a == b and type(a) is type(b)
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
            ok = (a == b) or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= RTOL * max(
                abs(a), abs(b), scale))
        else:
            ok = False
        if not ok:
            self.fail(file, f"{what} = {a!r}, recomputed {b!r}")
        return ok

    def load_json(self, rel: str, *, lines: bool = False):
        """The JSON object in `rel` (with `lines`, the list of one object per line), or None
        after a failure naming the file."""
        self.context = rel
        try:
            text = (self.root / rel).read_text(encoding="utf-8")
            objs = [json.loads(line) for line in text.splitlines()] if lines else [
                json.loads(text)]
        except FileNotFoundError:
            self.fail(rel, "missing")
            return None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self.fail(rel, f"not valid JSON{' lines' if lines else ''} ({exc})")
            return None
        if not all(isinstance(obj, dict) for obj in objs):
            self.fail(rel, "holds JSON that is not an object")
            return None
        return objs if lines else objs[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_integrity(a: Audit) -> None:
    """Check 1: every file against the manifests; nothing missing, nothing unlisted."""
    manifests = ["analysis/manifest.json"]
    if (a.root / "report/manifest.json").exists():
        manifests.append("report/manifest.json")
    listed: dict[str, str] = {}
    for rel in manifests:
        manifest = a.load_json(rel)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            a.fail(rel, "no 'files' table")
            continue
        for name, entry in manifest["files"].items():
            listed[name] = rel
            if not isinstance(entry, dict):
                a.fail(rel, f"entry {name!r} is not an object")
                continue
            path = a.root / name
            if not path.is_file():
                a.fail(name, f"listed in {rel} but missing")
                continue
            a.check(path.stat().st_size == entry.get("bytes"), name,
                    f"size {path.stat().st_size} differs from {rel} ({entry.get('bytes')})")
            a.check(_sha256(path) == entry.get("sha256"), name,
                    f"SHA-256 differs from the one in {rel} (file changed)")
    for path in sorted(a.root.rglob("*")):
        rel = path.relative_to(a.root).as_posix()
        if path.is_file() and rel not in listed and rel not in manifests and rel != ".lock":
            a.fail(rel, "not listed in any manifest (added after the analysis)")
    if len(manifests) == 2:
        report = a.load_json("report/manifest.json") or {}
        built = report.get("built_from")
        names = ("analysis/results.json", "analysis/runs.csv", "analysis/pairs.csv")
        if not isinstance(built, dict) or sorted(built) != sorted(names):
            a.fail("report/manifest.json", "does not say which analysis the report shows")
        else:
            for name in names:
                a.check((a.root / name).is_file() and _sha256(a.root / name) == built[name],
                        "report/manifest.json", f"the report was built from another {name} "
                                                "(stale: run `cotangent report` again)")


def _arm_dirs(attempt: Path) -> list[Path]:
    return sorted(p.parent for p in attempt.glob("*/*/metadata.json"))


def load_runs(a: Audit, protocol: dict, frozen: dict) -> dict:
    """Check the records of every job; return {job id: run facts} of the done jobs, and
    mark failed jobs with None."""
    jobs = {j["id"]: j for j in frozen["jobs"]}
    jobs_dir = a.root / "jobs"
    present = {p.name for p in jobs_dir.iterdir()} if jobs_dir.is_dir() else set()
    for extra in sorted(present - set(jobs)):
        a.fail(f"jobs/{extra}", "a job directory that is not in the frozen job list")
    runs: dict[str, dict | None] = {}
    periods = []  # (start, end, status file) of every attempt: one job at a time
    for job_id, job in jobs.items():
        job_dir = jobs_dir / job_id
        entries = sorted(job_dir.iterdir()) if job_dir.is_dir() else []
        for entry in entries:
            if not (entry.is_dir() and entry.name.startswith("attempt-")
                    and entry.name[8:].isdigit()):
                a.fail(entry.relative_to(a.root).as_posix(), "not an attempt directory")
        attempts = sorted((p for p in entries if p.is_dir() and p.name.startswith("attempt-")
                           and p.name[8:].isdigit()), key=lambda p: int(p.name[8:]))
        numbers = [int(p.name[8:]) for p in attempts]
        a.check(numbers == list(range(1, len(numbers) + 1)), f"jobs/{job_id}",
                f"attempts {numbers} are not 1..{len(numbers)} (an attempt was removed)")
        deciding = None
        for attempt in attempts:
            rel = f"{attempt.relative_to(a.root).as_posix()}/status.json"
            status = a.load_json(rel)
            if status is None:
                continue
            a.check(status.get("job") == job_id, rel, f"names job {status.get('job')!r}")
            a.check(status.get("attempt") == int(attempt.name[8:]), rel,
                    f"says attempt {status.get('attempt')!r}")
            state = status.get("state")
            finished = [d for d in _arm_dirs(attempt) if (d / "summary.json").is_file()
                        and not (d / "INCOMPLETE").exists()]
            if state in ("done", "failed"):
                if deciding is not None and deciding[1].get("state") == "done":
                    a.fail(rel, f"another finished attempt after the done {deciding[2]} (a "
                                "done job never runs again)")
                deciding = (attempt, status, rel)
            elif state == "interrupted":
                a.check(not finished, rel, "an interrupted attempt holds a finished run record")
            else:
                a.fail(rel, f"state {state!r} (a finished campaign has only done, failed and "
                            "interrupted attempts)")
            if state != "done" and len(_arm_dirs(attempt)) > 1:
                a.fail(rel, "more than one run record in one attempt")
            try:
                start = datetime.fromisoformat(status["started_utc"])
                end = datetime.fromisoformat(status["ended_utc"])
                if start.tzinfo is None or end.tzinfo is None or end < start:
                    raise ValueError("times must carry a time zone and end after the start")
                periods.append((start, end, rel))
            except (KeyError, TypeError, ValueError):
                a.fail(rel, "no valid started_utc / ended_utc")
        if deciding is None:
            a.fail(f"jobs/{job_id}", "no done or failed attempt: the job never finished")
            continue
        attempt, status, status_rel = deciding
        if status["state"] == "failed":
            runs[job_id] = None
            continue
        arm_dirs = _arm_dirs(attempt)
        run_rel = status.get("run_dir")
        if not a.check([d.relative_to(a.root).as_posix() for d in arm_dirs] == [run_rel],
                       status_rel, f"run_dir {run_rel!r} is not the attempt's only run record "
                                   f"({[d.relative_to(a.root).as_posix() for d in arm_dirs]})"):
            continue
        runs[job_id] = load_run(a, job, run_rel, protocol, frozen)
        a.check(not (a.root / run_rel / "INCOMPLETE").exists()
                and not (a.root / run_rel / "curve.partial.jsonl").exists(), status_rel,
                f"its run {run_rel} is marked incomplete")
    periods.sort()
    for (_, end, rel), (start, _, nxt) in zip(periods, periods[1:]):
        a.check(start >= end, nxt, f"started before {rel} ended: two jobs ran at once")
    return runs


def load_run(a: Audit, job: dict, run_rel: str, protocol: dict, frozen: dict) -> dict | None:
    """Check 3 for one done job's run record; returns the numbers runs.csv should hold."""
    meta = a.load_json(f"{run_rel}/metadata.json")
    summary = a.load_json(f"{run_rel}/summary.json")
    curve_rel = f"{run_rel}/curve.jsonl"
    curve = a.load_json(curve_rel, lines=True)
    if meta is None or summary is None or curve is None:
        return None
    m = f"{run_rel}/metadata.json"
    s = f"{run_rel}/summary.json"
    cfg = meta.get("config", {})
    for key, want in (("model", job["model"]), ("seed", job["seed"]), ("arms", [job["arm"]]),
                      ("steps", protocol["steps"]), ("eval_every", protocol["eval_every"])):
        got = config_setting(cfg, key)
        a.check(got == want, m, f"config {key} = {got!r}, the job says {want!r}")
    for key, value in train_settings(protocol.get("train", {})).items():
        got = config_setting(cfg, key)
        a.check(got == value, m, f"config {key} = {got!r}, the protocol's [train] says "
                                 f"{value!r}")
    env = meta.get("environment", {})
    a.check(env.get("code_sha256") == frozen["code"]["cotangent_sha256"], m,
            "code SHA-256 differs from the frozen one")
    a.check(env.get("torch") == frozen["code"]["torch"], m,
            f"torch {env.get('torch')} differs from the frozen {frozen['code']['torch']}")
    splits = {k: v.get("sha256") for k, v in meta.get("data", {}).get("splits", {}).items()}
    a.check(splits == frozen["data"]["splits"], m, "data SHA-256s differ from the frozen ones")
    for key, want in frozen["machine"].items():
        a.check(env.get(key) == want, m, f"ran with {key} {env.get(key)!r}, the campaign was "
                                         f"frozen with {want!r}")
    cfg_lists = _lists(cfg)
    for toml_rel in (f"{run_rel}/config.toml", f"{run_rel.rsplit('/', 2)[0]}/job.toml"):
        a.context = toml_rel
        try:
            written = tomllib.loads((a.root / toml_rel).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            a.fail(toml_rel, f"cannot be read as TOML ({exc})")
            continue
        a.check(written == cfg_lists, toml_rel, "differs from the config in metadata.json")
    a.context = curve_rel
    steps = [r for r in curve if "loss_bpb" in r]
    probes = [r for r in curve if "probe_bpb" in r]
    if not all(isinstance(r.get(k), (int, float)) for r in steps for k in ("step_s", "update_s")):
        a.fail(curve_rel, "a step row lacks a numeric step_s or update_s")
        return None
    lrs = [r.get("lr") for r in steps]
    a.check(hashlib.sha256(repr(lrs).encode()).hexdigest() == meta.get("schedule_sha256"),
            curve_rel, "its learning rates are not the schedule of metadata's schedule_sha256")
    if steps:
        step_s = [r["step_s"] for r in steps]
        update_s = [r["update_s"] for r in steps]
        for key, value in (("update_ms", 1e3 * statistics.median(update_s)),
                           ("step_ms", 1e3 * statistics.median(step_s)),
                           ("update_ms_mean", 1e3 * statistics.fmean(update_s)),
                           ("step_ms_mean", 1e3 * statistics.fmean(step_s)),
                           ("final_loss_bpb", steps[-1].get("loss_bpb")),
                           ("steps", protocol["steps"])):
            a.close(summary.get(key), value, s, f"{key} vs curve.jsonl")
    a.check([r.get("step") for r in steps] == list(range(protocol["steps"])), curve_rel,
            f"{len(steps)} step rows, the protocol has {protocol['steps']} steps")
    a.close(summary.get("training_s"), sum(r["step_s"] for r in steps), s,
            "training_s vs the sum of curve step_s")
    a.close(summary.get("update_s"), sum(r["update_s"] for r in steps), s,
            "update_s vs the sum of curve update_s")
    a.check(summary.get("probes") == probes, s, "probes differ from curve.jsonl's probe rows")
    a.check(summary.get("arm") == job["arm"] and meta.get("arm") == job["arm"], s,
            f"arm is not {job['arm']}")
    target = protocol["target"][job["model"]]
    ttt = next((float(p["training_s"]) for p in probes if p["probe_bpb"] <= target), None)
    load = check_load(a, steps, meta, summary, curve_rel, s)
    if load is None:
        return None
    return {**load,
        "job": job["id"], "model": job["model"], "seed": job["seed"], "arm": job["arm"],
        "run_dir": run_rel, "steps": summary.get("steps"),
        "training_s": summary.get("training_s"), "update_s": summary.get("update_s"),
        "update_ms_median": summary.get("update_ms"), "step_ms_median": summary.get("step_ms"),
        "time_to_target_s": ttt, "test_bpb": summary.get("test_bpb"),
        "val_bpb": summary.get("val_bpb"), "peak_rss_kib": summary.get("peak_rss_kib"),
        "final_model_sha256": summary.get("final_model_sha256"),
        "init_model_sha256": meta.get("init_model_sha256"),
        "init_canonical_sha256": meta.get("init_canonical_sha256"),
        "schedule_sha256": meta.get("schedule_sha256"), "metadata": m, "config": cfg,
    }


def _parse_cell(text: str):
    if text == "":
        return None
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def read_csv(a: Audit, rel: str) -> list[dict] | None:
    """Rows of a CSV file with numbers, booleans and empty cells (None) parsed back."""
    a.context = rel
    try:
        with open(a.root / rel, newline="", encoding="utf-8") as f:
            return [{k: _parse_cell(v) for k, v in row.items()} for row in csv.DictReader(f)]
    except FileNotFoundError:
        a.fail(rel, "missing")
    except (UnicodeDecodeError, csv.Error) as exc:
        a.fail(rel, f"not valid CSV ({exc})")
    return None


def assess_timing(step_s: list[float], cpu_s: list[float] | None,
                  host_cpu_s: list[float] | None, host_cpus, threads) -> dict:
    """This file's copy of `cotangent.harness.contention.assess` (less its median_step_s).

    The timing-flag rules: slow steps (step_s > SLOW_STEP_FACTOR x the median), the share
    of the training time they added, step_outliers (> OUTLIER_EXCESS_FRACTION), the CPUs other
    work kept busy, the CPU demand ratio (others + threads) / host_cpus and busy (>
    BUSY_DEMAND_RATIO; None without a load record); flagged = step_outliers or busy."""
    training = sum(step_s)
    median = statistics.median(step_s)
    slow = [x for x in step_s if x > SLOW_STEP_FACTOR * median]
    excess = sum(x - median for x in slow) / training
    others = demand = busy = None
    if cpu_s is not None and host_cpu_s is not None and host_cpus:
        others = (sum(host_cpu_s) - sum(cpu_s)) / training
        demand = (others + threads) / host_cpus
        busy = demand > BUSY_DEMAND_RATIO
    outliers = excess > OUTLIER_EXCESS_FRACTION
    return {"slow_steps": len(slow), "slow_excess_fraction": excess, "step_outliers": outliers,
            "others_cpus": others, "cpu_demand_ratio": demand, "busy": busy,
            "flagged": outliers or bool(busy)}


def check_load(a: Audit, steps: list[dict], meta: dict, summary: dict, curve_rel: str,
               s: str) -> dict | None:
    """Check 3's machine-load part for one run; returns its load record and recomputed flags
    (as runs.csv holds them), or None when the step rows cannot be used."""
    if not steps:
        a.fail(curve_rel, "no step rows")
        return None
    columns = {}
    for key in ("cpu_s", "host_cpu_s", "host_steal_s"):
        present = [key in r for r in steps]
        if any(present) and not all(
                isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
                for r in steps):
            a.fail(curve_rel, f"some step rows lack a numeric {key} (all or none must have it)")
            return None
        columns[key] = [r[key] for r in steps] if all(present) else None
    if (columns["host_cpu_s"] is not None and columns["cpu_s"] is None) or (
            (columns["host_cpu_s"] is None) != (columns["host_steal_s"] is None)):
        a.fail(curve_rel, "cpu_s, host_cpu_s and host_steal_s are not recorded together")
        return None
    threads = meta.get("environment", {}).get("threads")
    host_cpus = summary.get("host_cpus")
    if columns["host_cpu_s"] is not None:
        a.check(isinstance(host_cpus, int) and not isinstance(host_cpus, bool) and host_cpus > 0,
                s, f"host_cpus {host_cpus!r} is not a positive integer though the load was "
                   "measured")
    if not isinstance(threads, int) or threads < 1:
        a.fail(f"{s.rsplit('/', 1)[0]}/metadata.json", f"environment.threads {threads!r}")
        return None
    mine = assess_timing([r["step_s"] for r in steps], columns["cpu_s"], columns["host_cpu_s"],
                         host_cpus if columns["host_cpu_s"] is not None else None, threads)
    record = {"cpu_s": None if columns["cpu_s"] is None else sum(columns["cpu_s"]),
              "threads": threads, "host_cpus": host_cpus,
              "host_steal_s": (None if columns["host_steal_s"] is None
                               else sum(columns["host_steal_s"])),
              "load_avg_1m_start": summary.get("load_avg_1m_start"),
              "load_avg_1m_end": summary.get("load_avg_1m_end"), **mine}
    if "cpu_s" in summary or columns["cpu_s"] is not None:  # a run that recorded its load
        a.close(summary.get("cpu_s"), record["cpu_s"], s, "cpu_s vs the sum of curve cpu_s")
        a.close(summary.get("host_cpu_s"), None if columns["host_cpu_s"] is None
                else sum(columns["host_cpu_s"]), s, "host_cpu_s vs the sum of curve host_cpu_s")
        a.close(summary.get("host_steal_s"), record["host_steal_s"], s,
                "host_steal_s vs the sum of curve host_steal_s")
        a.close(summary.get("threads"), threads, s, "threads vs metadata environment.threads")
        for key in ("load_avg_1m_start", "load_avg_1m_end"):
            value = summary.get(key)
            a.check(value is None or (isinstance(value, (int, float)) and value >= 0), s,
                    f"{key} {value!r} is not a load average")
        for key in FLAG_KEYS:
            a.close(summary.get(key), mine[key], s, f"{key} (timing flag) vs curve.jsonl")
    return record


def reduction(candidate: float, baseline: float) -> float:
    """1 - candidate / baseline."""
    return 1.0 - candidate / baseline


def make_pair(b: dict, c: dict) -> dict:
    """One pairs.csv row recomputed from two runs (see cotangent.harness.analysis)."""
    tb, tc = b["time_to_target_s"], c["time_to_target_s"]
    censored = {(False, False): "none", (True, False): "baseline", (False, True): "candidate",
                (True, True): "both"}[(tb is None, tc is None)]
    return {
        "model": b["model"], "seed": b["seed"], "baseline": b["arm"], "candidate": c["arm"],
        "baseline_training_s": b["training_s"], "candidate_training_s": c["training_s"],
        "baseline_update_s": b["update_s"], "candidate_update_s": c["update_s"],
        "baseline_time_to_target_s": tb, "candidate_time_to_target_s": tc, "censored": censored,
        "baseline_test_bpb": b["test_bpb"], "candidate_test_bpb": c["test_bpb"],
        "training_time_reduction": reduction(c["training_s"], b["training_s"]),
        "update_phase_reduction": reduction(c["update_s"], b["update_s"]),
        "time_to_target_reduction": None if censored != "none" else reduction(tc, tb),
        "quality_difference_bpb": c["test_bpb"] - b["test_bpb"],
        "identical_final_hash": b["final_model_sha256"] == c["final_model_sha256"],
        "timing_flagged": {(False, False): "none", (True, False): "baseline",
                           (False, True): "candidate", (True, True): "both"}[
                               (b["flagged"], c["flagged"])],
    }


def check_summary(a: Audit, recorded: dict, values: list[float], level: float, where: str) -> None:
    """One {n, t, bootstrap} block of results.json against the paired values."""
    f = "analysis/results.json"
    if not isinstance(recorded, dict):
        a.fail(f, f"{where}: missing")
        return
    a.close(recorded.get("n"), len(values), f, f"{where}.n")
    if len(values) < 2:
        a.check(recorded.get("t") is None and recorded.get("bootstrap") is None, f,
                f"{where}: an interval from fewer than 2 pairs")
        return
    t, boot = recorded.get("t"), recorded.get("bootstrap")
    if not isinstance(t, dict) or not isinstance(boot, dict):
        a.fail(f, f"{where}: t or bootstrap interval missing")
        return
    mine = t_interval(values, level)
    scale = abs(mine["mean"]) + abs(mine["high"] - mine["mean"])
    for key in ("n", "mean", "sd", "low", "high", "level"):
        a.close(t.get(key), mine[key], f, f"{where}.t.{key}", scale)
    a.close(boot.get("n"), len(values), f, f"{where}.bootstrap.n")
    a.close(boot.get("mean"), mine["mean"], f, f"{where}.bootstrap.mean", scale)
    lo, hi = min(values), max(values)
    slack = RTOL * max(abs(lo), abs(hi))
    a.check(isinstance(boot.get("low"), (int, float)) and isinstance(boot.get("high"), (int, float))
            and lo - slack <= boot["low"] <= boot["high"] <= hi + slack, f,
            f"{where}.bootstrap [{boot.get('low')}, {boot.get('high')}] is not an interval "
            f"inside the paired values' range [{lo}, {hi}]")


def audit(root: Path) -> Audit:
    """Run every check on the campaign directory `root`; the failures are in `.failures`.
    Records too damaged to interpret stop the audit with a failure naming the file."""
    a = Audit(root)
    try:
        _audit(a)
    except Exception as exc:  # noqa: BLE001 - malformed records must fail, not crash
        a.fail(a.context, f"cannot be interpreted ({type(exc).__name__}: {exc}); the audit "
                          "stopped here")
    return a


def _audit(a: Audit) -> None:
    """Checks 1-5 of the module docstring, in order, as named steps; records a step cannot
    interpret stop the audit after its failure is recorded."""
    check_integrity(a)
    loaded = load_protocol(a)
    if loaded is None:
        return
    protocol, frozen = loaded
    if not check_protocol(a, protocol, frozen):
        return
    runs = load_runs(a, protocol, frozen)
    check_load_consistency(a, frozen, runs)
    done = {(r["model"], r["seed"], r["arm"]): r for r in runs.values() if r}
    check_shared_settings(a, done)
    check_blocks(a, protocol, done)
    check_runs_csv(a, protocol, frozen, runs)
    results = a.load_json("analysis/results.json")
    comparisons = make_comparisons(protocol, done)
    check_pairs_csv(a, [pair for _, _, pairs in comparisons for pair in pairs])
    if results is None:
        return
    check_results_header(a, results, protocol, frozen, runs, done)
    check_decision_rules_results(a, results, protocol, done)
    if check_comparisons(a, results, protocol, comparisons):
        check_timing_flags(a, results, frozen, runs)
        check_factorial(a, results, protocol["models"], protocol["arms"], protocol["seeds"],
                        done, protocol["level"])


def load_protocol(a: Audit) -> tuple[dict, dict] | None:
    """protocol.toml (with its bytes' SHA-256 under "sha256") and freeze.json, or None after
    a failure when either cannot be read."""
    frozen = a.load_json("freeze.json")
    try:
        raw = (a.root / "protocol.toml").read_bytes()
        p = tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        a.fail("protocol.toml", "missing")
        return None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        a.fail("protocol.toml", f"not valid TOML ({exc})")
        return None
    if frozen is None:
        return None
    return {"toml": p, "sha256": hashlib.sha256(raw).hexdigest()}, frozen


def check_protocol(a: Audit, protocol: dict, frozen: dict) -> bool:
    """Check 2: protocol.toml is the frozen one, holds what the audit reads, and the frozen
    job set is its models x seeds x arms. Fills `protocol` with what the later checks read
    (models, arms, seeds, steps, eval_every, train, target per model, level, margin); False
    when protocol.toml or freeze.json lack what they need."""
    p = protocol["toml"]
    a.check(protocol["sha256"] == frozen.get("protocol_sha256"), "protocol.toml",
            "SHA-256 differs from freeze.json's protocol_sha256")
    if not _shape_ok(a, p, frozen):
        return False
    models, arms, seeds = p["models"], p["arms"], p["seeds"]
    target = p["target_bpb"]
    protocol.update(
        models=models, arms=arms, seeds=seeds, steps=p["steps"], eval_every=p["eval_every"],
        train=p.get("train", {}), level=float(p["level"]), margin=float(p["margin_bpb"]),
        target={m: float(target[m] if isinstance(target, dict) else target) for m in models})
    expected = sorted((m, s, arm) for m in models for s in seeds for arm in arms)
    got = sorted((j["model"], j["seed"], j["arm"]) for j in frozen.get("jobs", []))
    a.check(got == expected, "freeze.json", "the frozen job set is not models x seeds x arms "
                                            "of protocol.toml, each once")
    a.check(frozen.get("balanced") == (len(seeds) % len(arms) == 0), "freeze.json",
            "balanced does not follow from the seed and arm counts")
    return True


def check_shared_settings(a: Audit, done: dict) -> None:
    """Within a model, the done runs' settings differ only in seed and arm."""
    shared = {}
    for r in sorted(done.values(), key=lambda r: r["metadata"]):
        cfg = {k: v for k, v in r["config"].items() if k not in ("seed", "arms", "out")}
        first = shared.setdefault(r["model"], (cfg, r["metadata"]))
        a.check(cfg == first[0], r["metadata"], f"its settings differ from {first[1]}'s "
                                                "(only seed and arm may differ within a model)")


def check_blocks(a: Audit, protocol: dict, done: dict) -> None:
    """Check 4: the arms of a (model, seed) block share the initial model and LR schedule.
    Where every run of the block records `init_canonical_sha256` (recurrent models, whose
    untied, shared and replicated variants hold different tensors by design), that hash of the
    tensors every variant shares is compared instead of the whole model's."""
    for m in protocol["models"]:
        for s in protocol["seeds"]:
            block = [done[(m, s, arm)] for arm in protocol["arms"] if (m, s, arm) in done]
            init = ("init_canonical_sha256" if block and all(
                r.get("init_canonical_sha256") for r in block) else "init_model_sha256")
            for key in (init, "schedule_sha256"):
                for r in block[1:]:
                    a.check(r[key] == block[0][key], r["metadata"],
                            f"{key} differs from {block[0]['metadata']} (same model and seed)")


def check_runs_csv(a: Audit, protocol: dict, frozen: dict, runs: dict) -> None:
    """runs.csv: one row per frozen job, each as recomputed from the job and its records."""
    rows = read_csv(a, "analysis/runs.csv")
    if rows is None:
        return
    by_job = {r.get("job"): r for r in rows}
    a.check(len(by_job) == len(rows) == len(frozen["jobs"]) and set(by_job) == {
        j["id"] for j in frozen["jobs"]}, "analysis/runs.csv",
        "its rows are not exactly the frozen jobs")
    for job in frozen["jobs"]:
        row = by_job.get(job["id"])
        if row is None:
            continue
        run = runs.get(job["id"])
        a.check(row.get("state") == ("done" if run else "failed"), "analysis/runs.csv",
                f"{job['id']}: state {row.get('state')!r}")
        for key in ("index", "block", "position", "model", "seed", "arm"):
            a.close(row.get(key), job[key], "analysis/runs.csv", f"{job['id']}.{key}")
        a.close(row.get("target_bpb"), protocol["target"][job["model"]], "analysis/runs.csv",
                f"{job['id']}.target_bpb")
        if run:
            for key in ("run_dir", "steps", "training_s", "update_s", "update_ms_median",
                        "step_ms_median", "time_to_target_s", "test_bpb", "val_bpb",
                        "final_model_sha256", "init_model_sha256", "schedule_sha256",
                        *LOAD_KEYS, *FLAG_KEYS):
                a.close(row.get(key), run[key], "analysis/runs.csv", f"{job['id']}.{key}")


def make_comparisons(protocol: dict, done: dict) -> list[tuple[str, str, list[dict]]]:
    """(model, candidate, its pairs.csv rows recomputed) per model and candidate arm, in
    results.json's order; a seed enters only where both runs are done."""
    baseline = protocol["arms"][0]
    comparisons = []
    for m in protocol["models"]:
        for cand in protocol["arms"][1:]:
            comparisons.append((m, cand, [
                make_pair(done[(m, s, baseline)], done[(m, s, cand)]) for s in protocol["seeds"]
                if (m, s, baseline) in done and (m, s, cand) in done]))
    return comparisons


def check_pairs_csv(a: Audit, pairs: list[dict]) -> None:
    """pairs.csv: the recomputed pairs, row by row."""
    recorded = read_csv(a, "analysis/pairs.csv")
    if recorded is None:
        return
    a.check(len(recorded) == len(pairs), "analysis/pairs.csv",
            f"{len(recorded)} rows, recomputed {len(pairs)} pairs")
    for rec, mine in zip(recorded, pairs):
        for key, value in mine.items():
            a.close(rec.get(key), value, "analysis/pairs.csv",
                    f"{mine['model']} seed {mine['seed']} {mine['candidate']}.{key}")


def check_results_header(a: Audit, results: dict, protocol: dict, frozen: dict, runs: dict,
                         done: dict) -> None:
    """results.json's protocol SHA-256, job counts, fingerprints and protocol block."""
    f = "analysis/results.json"
    p, arms = protocol["toml"], protocol["arms"]
    a.check(results.get("protocol_sha256") == frozen.get("protocol_sha256"), f,
            "protocol_sha256 is not the frozen one")
    a.check(results.get("jobs", {}).get("done") == len(done), f, "jobs.done miscounted")
    a.check(results.get("jobs", {}).get("total") == len(frozen["jobs"]), f,
            "jobs.total miscounted")
    for key in ("code", "machine", "data", "environment"):
        a.check(results.get(key) == frozen.get(key), f, f"{key} is not freeze.json's")
    want = {"models": protocol["models"], "arms": arms, "baseline": arms[0],
            "seeds": protocol["seeds"], "steps": p["steps"], "eval_every": p["eval_every"],
            "target_bpb": protocol["target"], "level": protocol["level"],
            "margin_bpb": protocol["margin"], "design": p.get("design", "latin"),
            "bootstrap_resamples": p.get("bootstrap_resamples", 10_000),
            "bootstrap_seed": p.get("shuffle_seed", 0), "balanced": frozen.get("balanced")}
    got = results.get("protocol")
    a.check(isinstance(got, dict) and sorted(got) == sorted(want), f,
            "its protocol block does not have the protocol's keys")
    for key, value in want.items():
        if not isinstance(got, dict):
            break
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            a.close(got.get(key), value, f, f"protocol.{key}")
        else:
            a.check(got.get(key) == value, f, f"protocol.{key} is not protocol.toml's")
    a.check(sorted(results.get("jobs", {}).get("failed", [])) ==
            sorted(j for j, r in runs.items() if r is None), f, "jobs.failed misreported")


def check_comparisons(a: Audit, results: dict, protocol: dict,
                      comparisons: list[tuple[str, str, list[dict]]]) -> bool:
    """results.json's comparisons against the recomputed pairs: counts, every interval, the
    non-inferiority decision, identical hashes, flagged seeds. False when their number is
    wrong (nothing else is compared then)."""
    f = "analysis/results.json"
    recorded = results.get("comparisons", [])
    if not a.check(len(recorded) == len(comparisons), f,
                   f"{len(recorded)} comparisons, expected {len(comparisons)}"):
        return False
    level, margin = protocol["level"], protocol["margin"]
    for rec, (m, cand, rows_mc) in zip(recorded, comparisons):
        where = f"comparisons[{m}, {cand}]"
        a.check(rec.get("model") == m and rec.get("candidate") == cand
                and rec.get("baseline") == protocol["arms"][0], f,
                f"{where}: names another comparison")
        a.close(rec.get("pairs"), len(rows_mc), f, f"{where}.pairs")
        a.check(rec.get("missing_seeds") == [s for s in protocol["seeds"] if s not in
                                             {r["seed"] for r in rows_mc}], f,
                f"{where}.missing_seeds")
        for metric in ("training_time_reduction", "update_phase_reduction"):
            check_summary(a, rec.get(metric), [r[metric] for r in rows_mc], level,
                          f"{where}.{metric}")
        ttt = rec.get("time_to_target_reduction") or {}
        check_summary(a, ttt, [r["time_to_target_reduction"] for r in rows_mc
                               if r["censored"] == "none"], level,
                      f"{where}.time_to_target_reduction")
        a.check(ttt.get("censored_pairs") == {k: [r["seed"] for r in rows_mc
                                                  if r["censored"] == k]
                                              for k in ("baseline", "candidate", "both")}, f,
                f"{where}.time_to_target_reduction.censored_pairs")
        a.close(ttt.get("target_bpb"), protocol["target"][m], f, f"{where}.target_bpb")
        q = rec.get("quality_difference_bpb") or {}
        diffs = [r["quality_difference_bpb"] for r in rows_mc]
        check_summary(a, q, diffs, level, f"{where}.quality_difference_bpb")
        if len(diffs) >= 2:
            a.close(q.get("margin_bpb"), margin, f, f"{where}.margin_bpb")
            a.close(q.get("non_inferior"), t_interval(diffs, level)["high"] < margin, f,
                    f"{where}.non_inferior")
        ident = rec.get("identical_final_hash") or {}
        a.close(ident.get("identical"), sum(r["identical_final_hash"] for r in rows_mc), f,
                f"{where}.identical_final_hash")
        a.close(ident.get("pairs"), len(rows_mc), f, f"{where}.identical_final_hash.pairs")
        a.check(rec.get("timing_flagged_seeds") == [r["seed"] for r in rows_mc
                                                    if r["timing_flagged"] != "none"], f,
                f"{where}.timing_flagged_seeds")
    return True


def check_load_consistency(a: Audit, frozen: dict, runs: dict) -> None:
    """Across the campaign's done runs: one machine (the same host_cpus), and a load record in
    every run or in none."""
    done = [(j["id"], runs[j["id"]]) for j in sorted(frozen["jobs"], key=lambda j: j["index"])
            if runs.get(j["id"])]
    # One code ran every job (checked above), and it records cpu_s always and host_cpu_s
    # wherever /proc/stat is readable: a run without them among runs with them was stripped.
    for key in ("cpu_s", "host_steal_s"):
        have = [r for _, r in done if r[key] is not None]
        if have:
            for _, r in done:
                a.check(r[key] is not None, r["metadata"].replace("metadata.json", "curve.jsonl"),
                        f"has no {key} record while {have[0]['metadata']}'s run of the same "
                        "campaign has one (load record removed?)")
    measured = [r for _, r in done if r["host_cpus"] is not None]
    for r in measured[1:]:
        a.check(r["host_cpus"] == measured[0]["host_cpus"],
                r["metadata"].replace("metadata.json", "summary.json"),
                f"host_cpus {r['host_cpus']} differs from {measured[0]['metadata']}'s run "
                f"({measured[0]['host_cpus']}): one machine ran the campaign")


def check_timing_flags(a: Audit, results: dict, frozen: dict, runs: dict) -> None:
    """results.json's timing_flags against the runs' recomputed flags and this file's rules."""
    f = "analysis/results.json"
    flags = results.get("timing_flags")
    if not a.check(isinstance(flags, dict), f, "timing_flags missing"):
        return
    rules = flags.get("rules") or {}
    for key, value in (("slow_step_factor", SLOW_STEP_FACTOR),
                       ("outlier_excess_fraction", OUTLIER_EXCESS_FRACTION),
                       ("busy_demand_ratio", BUSY_DEMAND_RATIO)):
        a.close(rules.get(key), value, f, f"timing_flags.rules.{key}")
    done = [(j["id"], runs[j["id"]]) for j in sorted(frozen["jobs"], key=lambda j: j["index"])
            if runs.get(j["id"])]
    for key, test in (("flagged", lambda r: r["flagged"]),
                      ("step_outliers", lambda r: r["step_outliers"]),
                      ("busy", lambda r: r["busy"] is True),
                      ("load_not_measured", lambda r: r["busy"] is None)):
        a.check(flags.get(key) == [job for job, r in done if test(r)], f,
                f"timing_flags.{key} is not the recomputed list")
    listed = flags.get("runs")
    flagged = [(job, r) for job, r in done if r["flagged"]]
    if not a.check(isinstance(listed, list) and len(listed) == len(flagged), f,
                   "timing_flags.runs: not one entry per flagged run"):
        return
    for entry, (job, r) in zip(listed, flagged):
        a.check(isinstance(entry, dict) and entry.get("job") == job, f,
                f"timing_flags.runs: {job} missing or out of order")
        if not isinstance(entry, dict):
            continue
        for key in ("model", "seed", "arm", "host_cpus", *FLAG_KEYS):
            a.close(entry.get(key), r[key], f, f"timing_flags.runs[{job}].{key}")
        reasons = entry.get("reasons")
        a.check(isinstance(reasons, list) and bool(reasons)
                and all(isinstance(x, str) for x in reasons), f,
                f"timing_flags.runs[{job}].reasons: a flagged run needs its reasons")


def _shape_ok(a: Audit, p: dict, frozen: dict) -> bool:
    """protocol.toml and freeze.json hold what the audit reads, with the right types."""
    def is_list(v, kind) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, kind) for x in v)

    ok = a.check(is_list(p.get("models"), str) and is_list(p.get("arms"), str)
                 and is_list(p.get("seeds"), int)
                 and all(isinstance(p.get(k), int) for k in ("steps", "eval_every"))
                 and all(isinstance(p.get(k), (int, float)) for k in ("level", "margin_bpb"))
                 and 0.5 <= p["level"] < 1
                 and isinstance(p.get("train", {}), dict)
                 and (isinstance(p.get("target_bpb"), (int, float)) or (
                     isinstance(p.get("target_bpb"), dict)
                     and set(p["target_bpb"]) >= set(p.get("models") or []))),
                 "protocol.toml", "lacks models, arms, seeds, steps, eval_every, level, "
                                  "margin_bpb or target_bpb of the right types")
    jobs = frozen.get("jobs")
    ok &= a.check(isinstance(frozen.get("protocol_sha256"), str)
                  and isinstance(frozen.get("code"), dict)
                  and {"cotangent_sha256", "torch"} <= set(frozen["code"])
                  and isinstance(frozen.get("machine"), dict)
                  and isinstance(frozen.get("data"), dict)
                  and isinstance(frozen["data"].get("splits"), dict)
                  and isinstance(jobs, list) and all(
                      isinstance(j, dict) and {"id", "index", "block", "position", "model",
                                               "seed", "arm"} <= set(j) for j in jobs),
                  "freeze.json", "lacks protocol_sha256, code, machine, data or a job list of "
                                 "the right shape")
    return ok


def check_factorial(a: Audit, results: dict, models, arms, seeds, done, level) -> None:
    """The 2x2 factorial contrasts of results.json, recomputed per model and metric."""
    f = "analysis/results.json"
    recorded = results.get("factorial", [])
    # the cell with both: "packed" since issue 26; analyses written before it name no cell and
    # took "cotangent", which then was the packed design
    both = results.get("factorial_both_arm", "cotangent")
    factorial_arms = FACTORIAL_ARMS[:-1] + (both,)
    if not (set(factorial_arms) <= set(arms) and arms[0] == "native"):
        a.check(recorded == [], f, "factorial contrasts without the four factorial arms")
        return
    expected = [(m, metric, key) for m in models for metric, key in
                (("training_time_reduction", "training_s"), ("update_phase_reduction", "update_s"))]
    if not a.check(len(recorded) == len(expected), f, "factorial: wrong number of blocks"):
        return
    for rec, (m, metric, key) in zip(recorded, expected):
        where = f"factorial[{m}, {metric}]"
        ok = [s for s in seeds if all((m, s, arm) in done for arm in factorial_arms)]
        a.check(rec.get("model") == m and rec.get("metric") == metric and rec.get("seeds") == ok,
                f, f"{where}: model, metric or seeds differ")
        red = {arm: [reduction(done[(m, s, arm)][key], done[(m, s, "native")][key]) for s in ok]
               for arm in factorial_arms}
        n, bn, p, b = ([0.0] * len(ok), red["batched-norms-only"], red["packing-only"],
                       red[both])
        contrasts = {
            "norm_only": [y - x for x, y in zip(n, bn)],
            "packing_only": [y - x for x, y in zip(n, p)],
            "combined": [y - x for x, y in zip(n, b)],
            "main_norms": [((bn[i] - n[i]) + (b[i] - p[i])) / 2 for i in range(len(ok))],
            "main_packing": [((p[i] - n[i]) + (b[i] - bn[i])) / 2 for i in range(len(ok))],
            "interaction": [b[i] - p[i] - bn[i] + n[i] for i in range(len(ok))],
        }
        got = rec.get("contrasts", {})
        a.check(sorted(got) == sorted(contrasts), f, f"{where}: contrast names differ")
        for name, values in contrasts.items():
            c = got.get(name, {})
            for i, (x, y) in enumerate(zip(c.get("values", []), values)):
                a.close(x, y, f, f"{where}.{name}.values[{i}]")
            a.check(len(c.get("values", [])) == len(values), f, f"{where}.{name}: value count")
            check_summary(a, c, values, level, f"{where}.{name}")


def _agree(a: Audit, recorded, mine, file: str, where: str) -> None:
    """`recorded` has the shape of `mine`: the same keys and lengths, every number within
    RTOL (Audit.close), everything else equal."""
    if isinstance(mine, dict):
        shown = sorted(recorded) if isinstance(recorded, dict) else recorded
        if not a.check(isinstance(recorded, dict) and sorted(recorded) == sorted(mine), file,
                       f"{where}: keys {shown!r}, recomputed {sorted(mine)}"):
            return
        for key in mine:
            _agree(a, recorded[key], mine[key], file, f"{where}.{key}")
    elif isinstance(mine, list):
        if not a.check(isinstance(recorded, list) and len(recorded) == len(mine), file,
                       f"{where} = {recorded!r}, recomputed {mine!r}"):
            return
        for i, (x, y) in enumerate(zip(recorded, mine)):
            _agree(a, x, y, file, f"{where}[{i}]")
    else:
        a.close(recorded, mine, file, where)


def check_decision_rules_results(a: Audit, results: dict, protocol: dict, done: dict) -> None:
    """Check 6: protocol.toml's decision rules re-evaluated from the done runs' records with
    this file's evaluator; results.json's decision_rules must hold the same rules, the standard
    statement, and per model and rule the same verdicts, clauses, conditions and metric values
    (numbers within RTOL). Without rules in protocol.toml, results.json must claim none."""
    f = "analysis/results.json"
    raw = protocol["toml"].get("decision_rules")
    recorded = results.get("decision_rules")
    if raw is None or raw == []:
        a.check(recorded is None, f, "decision_rules recorded, but protocol.toml declares none")
        return
    a.context = "protocol.toml"
    try:
        rules = check_decision_rules(raw, protocol["arms"])
    except ValueError as exc:
        a.fail("protocol.toml", str(exc))
        return
    a.context = f
    if not a.check(isinstance(recorded, dict), f, "no decision_rules, but protocol.toml "
                                                  "declares them"):
        return
    a.check(recorded.get("rules") == rules, f, "decision_rules.rules are not protocol.toml's")
    a.check(recorded.get("note") == DECISION_NOTE, f, "decision_rules.note is not the statement "
            "that these are prospective decision rules, not significance tests")
    mine = decision_rule_verdicts(rules, protocol["models"], protocol["arms"],
                                  protocol["seeds"], done)
    got = recorded.get("verdicts")
    if not a.check(isinstance(got, list) and len(got) == len(mine), f,
                   f"decision_rules.verdicts: not one entry per model and rule ({len(mine)})"):
        return
    for rec, exp in zip(got, mine):
        _agree(a, rec, exp, f, f"decision_rules.verdicts[{exp['model']}, {exp['name']}]")


def main(argv: list[str] | None = None) -> int:
    """Command line: `audit.py RUNS`; exit 0 clean, 1 failures, 2 usage error."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: audit.py RUNS   (a campaign directory after `cotangent analyze`)",
              file=sys.stderr)
        return 2
    root = Path(argv[0])
    if not (root / "freeze.json").is_file() or not (root / "analysis").is_dir():
        print(f"audit: {root} is not an analysed campaign (needs freeze.json and analysis/)",
              file=sys.stderr)
        return 2
    a = audit(root)
    for line in a.failures:
        print(f"FAIL {line}")
    verdict = "clean" if not a.failures else f"{len(a.failures)} failure(s)"
    print(f"audit of {root}: {a.checks} checks, {verdict} (Python {sys.version.split()[0]}, "
          "standard library only)")
    return 0 if not a.failures else 1


if __name__ == "__main__":
    sys.exit(main())
