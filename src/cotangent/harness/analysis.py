"""`cotangent analyze RUNS`: paired-seed statistics of a finished campaign.

Per run (one job's record): training time T (`summary.json` training_s, the sum of every
step's forward + backward + update seconds), update-phase time U (update_s, the sum of the
update phases), test BPB, final model hash, and time-to-target: the run's training seconds at
the first probe (`curve.jsonl`) whose probe BPB is <= the protocol's target for that model, no
interpolation; a run that never reaches it is censored (empty), never dropped.

Per pair (same model and seed, baseline arm vs one candidate arm):
    training_time_reduction   1 - T_candidate / T_baseline (fixed budget: same number of steps)
    update_phase_reduction    1 - U_candidate / U_baseline
    time_to_target_reduction  1 - TTT_candidate / TTT_baseline, when both reached the target
    quality_difference_bpb    test BPB candidate - baseline (non-inferiority against the margin)
    identical_final_hash      both runs ended with the same model SHA-256

Timing flags (rules in `cotangent.harness.contention`, recomputed here from each run's
curve.jsonl): a run is flagged when its slow steps (step_s > 5 x its median) added more than 2%
to its training time (step_outliers), or when the machine was busy while its steps were timed:
(others_cpus + threads) / host_cpus > 1.1, others_cpus being the CPUs other work kept busy
(busy; empty in runs.csv when the load was not recorded). runs.csv has every run's load record
and flags, pairs.csv says which run of a pair is flagged (timing_flagged: none, baseline,
candidate, both), results.json lists the flagged runs under timing_flags and each
comparison's flagged seeds; the statistics include flagged pairs (nothing is dropped).

Each is summarised by a paired Student-t interval at the protocol's level and a seed-bootstrap
percentile interval (scipy) as a cross-check; `cotangent.harness.stats` has the formulas. With
the four factorial arms, the 2x2 contrasts are computed on the per-seed reductions relative to
native (native's own reduction is 0): norm-only, packing-only, combined, both main effects and
the interaction, each with its intervals.

Decision rules (when the protocol declares `[[decision_rules]]`, see
`cotangent.harness.campaign`): each rule is evaluated per model on the arms' metrics over their
done seeds (bpb = mean test BPB; training_s, update_s = median seconds; peak_mib = median
peak_rss_kib / 1024), by `cotangent.harness.audit`'s evaluator. results.json's decision_rules holds the
rules as frozen, a note, and per model and rule the verdict (pass, fail or undecided), every
condition's left and right values and outcome, and the metric values used with their seeds.
They are prospective decision rules fixed before any run, not significance tests.

Outputs, in RUNS/analysis/: results.json, pairs.csv, runs.csv and manifest.json, which lists the
SHA-256 and size of every file of the campaign (records, logs, statuses, the frozen protocol and
these outputs) for `cotangent audit`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from cotangent.harness import audit
from cotangent.harness import contention, records, stats
from cotangent.harness.campaign import (
    Protocol,
    attempt_dirs,
    campaign_lock,
    job_state,
    load_frozen,
    read_status,
    runner_active,
    sha256_file,
)

ANALYSIS = "analysis"
REPORT = "report"
MANIFEST = "manifest.json"
# the 2x2 factorial {batched norms} x {packing}: "packed" (the harness's PackedAdamW) is both
FACTORIAL_ARMS = ("native", "batched-norms-only", "packing-only", "packed")
RUN_COLUMNS = ("job", "index", "block", "position", "model", "seed", "arm", "state", "run_dir",
               "steps", "training_s", "update_s", "update_ms_median", "step_ms_median",
               "target_bpb", "time_to_target_s", "test_bpb", "val_bpb", "final_model_sha256",
               "init_model_sha256", "schedule_sha256", "cpu_s", "threads", "host_cpus",
               "host_steal_s", "load_avg_1m_start", "load_avg_1m_end", "others_cpus",
               "cpu_demand_ratio", "busy", "slow_steps", "slow_excess_fraction",
               "step_outliers", "flagged")
FLAG_COLUMNS = ("others_cpus", "cpu_demand_ratio", "busy", "slow_steps", "slow_excess_fraction",
                "step_outliers", "flagged")
PAIR_METRICS = ("training_time_reduction", "update_phase_reduction",
                "time_to_target_reduction", "quality_difference_bpb")
PAIR_COLUMNS = ("model", "seed", "baseline", "candidate", "baseline_training_s",
                "candidate_training_s", "baseline_update_s", "candidate_update_s",
                "baseline_time_to_target_s", "candidate_time_to_target_s", "censored",
                "baseline_test_bpb", "candidate_test_bpb") + PAIR_METRICS + (
                "identical_final_hash", "timing_flagged")


def read_run(campaign: Path, job: dict, protocol: Protocol) -> dict:
    """One job's row of runs.csv (state 'failed' or 'pending' rows carry no measurements)."""
    state, attempt = job_state(campaign, job)
    row = {k: job[k] for k in ("index", "block", "position", "model", "seed", "arm")}
    row.update(job=job["id"], state=state, target_bpb=protocol.target_bpb[job["model"]])
    if state != "done":
        return row
    status = records.read_json(attempt / "status.json")
    run_dir = campaign / status["run_dir"]
    meta = records.read_json(run_dir / "metadata.json")
    summary = records.read_json(run_dir / "summary.json")
    curve = records.read_jsonl(run_dir / "curve.jsonl")
    probes = [r for r in curve if "probe_bpb" in r]
    ttt = stats.time_to_target(probes, row["target_bpb"], time_key="training_s")
    row.update(load_record(curve, meta, summary))
    row.update(run_dir=status["run_dir"], steps=summary["steps"],
               training_s=summary["training_s"], update_s=summary["update_s"],
               update_ms_median=summary["update_ms"], step_ms_median=summary["step_ms"],
               time_to_target_s=ttt, test_bpb=summary["test_bpb"], val_bpb=summary["val_bpb"],
               peak_rss_kib=summary.get("peak_rss_kib"),
               final_model_sha256=summary["final_model_sha256"],
               init_model_sha256=meta["init_model_sha256"],
               schedule_sha256=meta["schedule_sha256"])
    return row


def load_record(curve: list[dict], meta: dict, summary: dict) -> dict:
    """A run's machine-load record and timing flags, recomputed from its curve.jsonl step rows
    (`contention.assess`); load fields a run did not record (older records, no /proc/stat)
    are None."""
    steps = [r for r in curve if "loss_bpb" in r]

    def column(key: str) -> list[float] | None:
        return [r[key] for r in steps] if all(key in r for r in steps) else None

    cpu, host, steal = column("cpu_s"), column("host_cpu_s"), column("host_steal_s")
    threads = meta["environment"]["threads"]
    host_cpus = summary.get("host_cpus")
    flags = contention.assess([r["step_s"] for r in steps], cpu, host, host_cpus, threads)
    return {"cpu_s": None if cpu is None else sum(cpu), "threads": threads,
            "host_cpus": host_cpus, "host_steal_s": None if steal is None else sum(steal),
            "load_avg_1m_start": summary.get("load_avg_1m_start"),
            "load_avg_1m_end": summary.get("load_avg_1m_end"),
            "median_step_s": flags.pop("median_step_s"), **flags}


def _pair(base: dict, cand: dict) -> dict:
    tb, tc = base["time_to_target_s"], cand["time_to_target_s"]
    censored = {(False, False): "none", (True, False): "baseline", (False, True): "candidate",
                (True, True): "both"}[(tb is None, tc is None)]
    return {
        "model": base["model"], "seed": base["seed"], "baseline": base["arm"],
        "candidate": cand["arm"],
        "baseline_training_s": base["training_s"], "candidate_training_s": cand["training_s"],
        "baseline_update_s": base["update_s"], "candidate_update_s": cand["update_s"],
        "baseline_time_to_target_s": tb, "candidate_time_to_target_s": tc, "censored": censored,
        "baseline_test_bpb": base["test_bpb"], "candidate_test_bpb": cand["test_bpb"],
        "training_time_reduction": stats.reduction(cand["training_s"], base["training_s"]),
        "update_phase_reduction": stats.reduction(cand["update_s"], base["update_s"]),
        "time_to_target_reduction": None if censored != "none" else stats.reduction(tc, tb),
        "quality_difference_bpb": cand["test_bpb"] - base["test_bpb"],
        "identical_final_hash": base["final_model_sha256"] == cand["final_model_sha256"],
        "timing_flagged": {(False, False): "none", (True, False): "baseline",
                           (False, True): "candidate", (True, True): "both"}[
                               (base["flagged"], cand["flagged"])],
    }


def summarize(values: list[float], protocol: Protocol) -> dict:
    """{n, t, bootstrap} for paired values; intervals are None (with a reason) below 2 pairs."""
    if len(values) < 2:
        return {"n": len(values), "t": None, "bootstrap": None,
                "reason": f"{len(values)} usable pair(s); an interval needs at least 2"}
    return {"n": len(values),
            "t": stats.paired_t_interval(values, protocol.level).as_dict(),
            "bootstrap": stats.bootstrap_interval(
                values, protocol.level, resamples=protocol.bootstrap_resamples,
                seed=protocol.shuffle_seed).as_dict()}


def analyze(campaign: Path, *, log=print) -> dict:
    """Analyse a campaign whose jobs have all finished; write the outputs; return results.

    Raises:
        ValueError: not a frozen campaign, or some jobs have not run yet (the message names
            how many; finish them with `cotangent campaign run`).
    """
    campaign = Path(campaign)
    protocol, frozen = load_frozen(campaign)
    if runner_active(campaign):
        raise ValueError(f"{campaign}: a `cotangent campaign run` is still active; analyze "
                         "when it has finished")
    with campaign_lock(campaign):  # no runner may start while the records are read
        return _analyze(campaign, protocol, frozen, log)


def _analyze(campaign: Path, protocol: Protocol, frozen: dict, log) -> dict:
    running = [str(a) for job in frozen["jobs"]
               for a in attempt_dirs(campaign / "jobs" / job["id"])
               if (read_status(a) or {"state": "running"})["state"] == "running"]
    if running:
        raise ValueError(f"{running[0]}: marked running but no runner is active (the runner "
                         f"died); `cotangent campaign run {campaign}` settles it, then analyze")
    runs = [read_run(campaign, job, protocol) for job in frozen["jobs"]]
    pending = [r["job"] for r in runs if r["state"] == "pending"]
    if pending:
        raise ValueError(f"{len(pending)} of {len(runs)} jobs have not finished (first: "
                         f"{pending[0]}); run `cotangent campaign run {campaign}` first")
    done = {(r["model"], r["seed"], r["arm"]): r for r in runs if r["state"] == "done"}
    baseline = protocol.arms[0]
    pairs, comparisons = [], []
    for model in protocol.models:
        for cand in protocol.arms[1:]:
            rows, missing = [], []
            for seed in protocol.seeds:
                b, c = done.get((model, seed, baseline)), done.get((model, seed, cand))
                if b is None or c is None:
                    missing.append(seed)
                else:
                    rows.append(_pair(b, c))
            pairs += rows
            ttt_rows = [p for p in rows if p["censored"] == "none"]
            quality = summarize([p["quality_difference_bpb"] for p in rows], protocol)
            if quality["t"] is not None:
                quality["margin_bpb"] = protocol.margin_bpb
                quality["non_inferior"] = quality["t"]["high"] < protocol.margin_bpb
            comparisons.append({
                "model": model, "baseline": baseline, "candidate": cand, "pairs": len(rows),
                "missing_seeds": missing,
                "training_time_reduction": summarize(
                    [p["training_time_reduction"] for p in rows], protocol),
                "update_phase_reduction": summarize(
                    [p["update_phase_reduction"] for p in rows], protocol),
                "time_to_target_reduction": {
                    **summarize([p["time_to_target_reduction"] for p in ttt_rows], protocol),
                    "target_bpb": protocol.target_bpb[model],
                    "censored_pairs": {kind: [p["seed"] for p in rows if p["censored"] == kind]
                                       for kind in ("baseline", "candidate", "both")}},
                "quality_difference_bpb": quality,
                "identical_final_hash": {"pairs": len(rows), "identical": sum(
                    p["identical_final_hash"] for p in rows)},
                "timing_flagged_seeds": [p["seed"] for p in rows
                                         if p["timing_flagged"] != "none"],
            })
    factorial = []
    if set(FACTORIAL_ARMS) <= set(protocol.arms) and baseline == "native":
        for model in protocol.models:
            seeds = [s for s in protocol.seeds
                     if all((model, s, arm) in done for arm in FACTORIAL_ARMS)]
            for metric, key in (("training_time_reduction", "training_s"),
                                ("update_phase_reduction", "update_s")):
                red = {arm: [stats.reduction(done[(model, s, arm)][key],
                                             done[(model, s, "native")][key]) for s in seeds]
                       for arm in FACTORIAL_ARMS}
                contrasts = stats.factorial_contrasts([0.0] * len(seeds),
                                                      red["batched-norms-only"],
                                                      red["packing-only"], red["packed"])
                factorial.append({"model": model, "metric": metric, "seeds": seeds,
                                  "contrasts": {name: {"values": v, **summarize(v, protocol)}
                                                for name, v in contrasts.items()}})
    results = {
        "campaign": protocol.name,
        "protocol_sha256": frozen["protocol_sha256"],
        "protocol": {"models": list(protocol.models), "arms": list(protocol.arms),
                     "baseline": baseline, "seeds": list(protocol.seeds),
                     "steps": protocol.steps, "eval_every": protocol.eval_every,
                     "target_bpb": protocol.target_bpb, "level": protocol.level,
                     "margin_bpb": protocol.margin_bpb, "design": protocol.design,
                     "bootstrap_resamples": protocol.bootstrap_resamples,
                     "bootstrap_seed": protocol.shuffle_seed, "balanced": frozen.get("balanced")},
        "code": frozen["code"],
        "machine": frozen["machine"],
        "data": frozen["data"],
        "environment": frozen["environment"],
        "jobs": {"total": len(runs), "done": len(done),
                 "failed": [r["job"] for r in runs if r["state"] == "failed"]},
        "comparisons": comparisons,
        "factorial": factorial,
        "factorial_both_arm": FACTORIAL_ARMS[-1],
        "timing_flags": timing_flags(list(done.values())),
        "definitions": __doc__,
    }
    if protocol.decision_rules:
        results["decision_rules"] = decision_rules(protocol, done)
    out = campaign / ANALYSIS
    out.mkdir(exist_ok=True)
    records.write_json(out / "results.json", results)
    records.write_atomic(out / "runs.csv", _csv(RUN_COLUMNS, runs))
    records.write_atomic(out / "pairs.csv", _csv(PAIR_COLUMNS, pairs))
    write_manifest(campaign, out / MANIFEST, exclude_dirs=(REPORT,), exclude_files=(".lock",))
    log(f"analysed {len(done)} runs, {len(pairs)} pairs: {out}")
    return results


def decision_rules(protocol: Protocol, done: dict) -> dict:
    """results.json's `decision_rules`: the statement that these are prospective decision
    rules, not significance tests; the rules as frozen; and per model and rule its verdict with
    the numbers that decided it (`cotangent.harness.audit.decision_rule_verdicts`, which the audit
    re-runs). `done` maps (model, seed, arm) to a done run's row."""
    rules = [dict(rule) for rule in protocol.decision_rules]
    return {"note": audit.DECISION_NOTE, "rules": rules,
            "verdicts": audit.decision_rule_verdicts(rules, protocol.models, protocol.arms,
                                                     protocol.seeds, done)}


def decision_rule_line(entry: dict, seeds: list | None = None, code: bool = False) -> str:
    """One rule's verdict on one model with the numbers that decided it, e.g.
    `PASS practical (model): clause 1 holds: bpb(a)=3.412 <= bpb(b) - 0.003=3.413 (yes) and
    ...; clause 2 fails: ...`; `seeds` (the protocol's) adds which arms had fewer done seeds;
    `code` puts each expression in backticks (Markdown)."""
    kind = f" [{entry['kind']}]" if entry["kind"] else ""
    clauses = []
    for i, clause in enumerate(entry["clauses"], 1):
        state = {True: "holds", False: "fails", None: "undecided"}[clause["held"]]
        clauses.append(f"clause {i} {state}: " + " and ".join(
            _condition_text(c, code) for c in clause["conditions"]))
    short = [f"{arm} {len(m['seeds'])} of {len(seeds)}" for arm, m in entry["metrics"].items()
             if seeds is not None and len(m["seeds"]) < len(seeds)]
    return (f"{entry['verdict'].upper()} {entry['name']}{kind} ({entry['model']}): "
            + "; ".join(clauses) + (f" [done seeds: {', '.join(short)}]" if short else ""))


def _condition_text(c: dict, code: bool = False) -> str:
    """`left=value op right=value (yes|NO|unknown: why)`; a number alone is not repeated."""
    left, right = c["left"], c["right"]
    digits = 6  # enough significant digits to tell the two sides apart
    while (left is not None and right is not None and left != right and digits < 17
           and f"{left:.{digits}g}" == f"{right:.{digits}g}"):
        digits += 1

    def side(expression: str, value) -> str:
        shown = f"`{expression}`" if code else expression
        try:
            float(expression)
            return shown
        except ValueError:
            return f"{shown}=" + ("?" if value is None else f"{value:.{digits}g}")

    held = {True: "yes", False: "NO", None: f"unknown: {c.get('unknown')}"}[c["held"]]
    return (f"{side(c['left_expression'], left)} {c['op']} "
            f"{side(c['right_expression'], right)} ({held})")


def timing_flags(done_runs: list[dict]) -> dict:
    """results.json's `timing_flags`: the rules, the job ids flagged by each rule (in job
    order), those whose load was not recorded, and per flagged run its numbers and reasons."""
    runs = sorted(done_runs, key=lambda r: r["index"])
    return {
        "rules": contention.RULES,
        "flagged": [r["job"] for r in runs if r["flagged"]],
        "step_outliers": [r["job"] for r in runs if r["step_outliers"]],
        "busy": [r["job"] for r in runs if r["busy"]],
        "load_not_measured": [r["job"] for r in runs if r["busy"] is None],
        "runs": [{"job": r["job"], **{k: r[k] for k in ("model", "seed", "arm", "host_cpus")
                                      + FLAG_COLUMNS},
                  "reasons": contention.reasons(r, r["host_cpus"])}
                 for r in runs if r["flagged"]],
    }


def _csv(columns: tuple[str, ...], rows: list[dict]) -> str:
    """CSV text; floats as repr (round-trip exact), None as an empty field."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else
                         ("true" if row[k] is True else "false" if row[k] is False else row[k])
                         for k in columns})
    return buf.getvalue()


def write_manifest(campaign: Path, path: Path, *, exclude_dirs: tuple[str, ...] = (),
                   exclude_files: tuple[str, ...] = (), under: str | None = None,
                   extra: dict | None = None) -> dict:
    """Write `path`: {"files": {relative path: {sha256, bytes}}} over every file of the campaign
    (or only those under `under`), except `path` itself, the top-level directories
    `exclude_dirs` and the top-level files `exclude_files` (the runner's lock); `extra` adds
    keys to the manifest."""
    files = {}
    root = campaign / under if under else campaign
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(campaign).as_posix()
        if (not p.is_file() or p == path or rel.split("/")[0] in exclude_dirs
                or rel in exclude_files):
            continue
        files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = {"campaign": campaign.name, "files": files, **(extra or {})}
    records.write_json(path, manifest)
    return manifest


def format_results(results: dict) -> str:
    """Human-readable summary of `analyze`'s results (what the CLI prints)."""
    level = results["protocol"]["level"]

    def iv(s: dict, pct: bool = True) -> str:
        if s["t"] is None:
            return f"n={s['n']} (no interval)"
        t, b = s["t"], s["bootstrap"]
        f = (lambda x: f"{100 * x:+.1f}%") if pct else (lambda x: f"{x:+.4f}")
        return (f"{f(t['mean'])} [{f(t['low'])}, {f(t['high'])}] (bootstrap "
                f"[{f(b['low'])}, {f(b['high'])}], n={s['n']})")

    lines = [f"campaign {results['campaign']}: {results['jobs']['done']}/"
             f"{results['jobs']['total']} runs done, {level:.0%} paired t intervals"]
    lines += flag_lines(results)
    for c in results["comparisons"]:
        ttt = c["time_to_target_reduction"]
        cens = sum(len(v) for v in ttt["censored_pairs"].values())
        q = c["quality_difference_bpb"]
        lines += [
            f"{c['model']}: {c['candidate']} vs {c['baseline']} ({c['pairs']} pairs"
            + (f", missing seeds {c['missing_seeds']}" if c["missing_seeds"] else "") + ")",
            f"  training-time reduction   {iv(c['training_time_reduction'])}",
            f"  update-phase reduction    {iv(c['update_phase_reduction'])}",
            f"  time-to-target reduction  {iv(ttt)}; target {ttt['target_bpb']} BPB, "
            f"{cens} censored pair(s)",
            f"  test BPB difference       {iv(q, pct=False)}"
            + (f"; margin {q['margin_bpb']}: "
               f"{'non-inferior' if q['non_inferior'] else 'NOT shown non-inferior'}"
               if q["t"] is not None else ""),
            f"  identical final hash      {c['identical_final_hash']['identical']}/"
            f"{c['identical_final_hash']['pairs']} pairs",
            f"  timing-flagged pairs      {len(c['timing_flagged_seeds'])}"
            + (f" (seeds {c['timing_flagged_seeds']})" if c["timing_flagged_seeds"] else "")]
    for f in results["factorial"]:
        lines.append(f"{f['model']} factorial on {f['metric']} ({len(f['seeds'])} seeds):")
        for name, s in f["contrasts"].items():
            lines.append(f"  {name:<14}{iv(s)}")
    rules = results.get("decision_rules")
    if rules:
        lines.append("decision rules (prospective, fixed before any run; decision rules, not "
                     "significance tests):")
        lines += ["  " + decision_rule_line(v, results["protocol"]["seeds"])
                  for v in rules["verdicts"]]
    return "\n".join(lines)


def flag_lines(results: dict) -> list[str]:
    """The warning lines about timing-flagged runs (empty when none is flagged and every run
    recorded its load)."""
    flags = results["timing_flags"]
    done = results["jobs"]["done"]
    lines = []
    if flags["flagged"]:
        lines.append(f"WARNING: {len(flags['flagged'])} of {done} runs are timing-flagged; their "
                     "times may reflect the machine rather than the code (pairs are kept):")
        lines += [f"  {r['job']}: " + "; ".join(r["reasons"]) for r in flags["runs"]]
    if flags["load_not_measured"]:
        lines.append(f"note: {len(flags['load_not_measured'])} of {done} runs have no machine-load "
                     "record (older records or no /proc/stat): the busy rule was not applied "
                     "to them")
    return lines
