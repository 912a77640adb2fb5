"""Campaigns end to end: protocol validation, freeze, run (resume, failures), analyze, audit
(clean, and failing on each kind of tampering), report (deterministic figures)."""

from __future__ import annotations

import ast
import collections
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from cotangent.harness import audit
from cotangent.harness import analysis, campaign, report, stats

ROOT = Path(__file__).resolve().parents[1]
AUDIT_PY = ROOT / "src" / "cotangent" / "harness" / "audit.py"

TINY = """
name = "tiny"
models = ["tiny-transformer"]
arms = {arms}
seeds = {seeds}
steps = 12
eval_every = 4
target_bpb = 7.9
level = 0.9
margin_bpb = 0.01
design = "{design}"
shuffle_seed = 3
bootstrap_resamples = 500

[train]  # its [eval] section's settings (dotted keys: [train.eval] as a table)
eval.val_bytes = 2048
eval.probe_bytes = 1024
eval.batch = 8
"""
# the seed study's 2x2 factorial (native is neither cell, packed both)
FACTORIAL = '["native", "packed", "batched-norms-only", "packing-only"]'


def write_protocol(tmp: Path, *, arms: str = FACTORIAL, seeds: str = "[0, 1]",
                   design: str = "latin") -> Path:
    path = tmp / "protocol.toml"
    path.write_text(TINY.format(arms=arms, seeds=seeds, design=design))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A frozen, run, analysed and reported 4-arm campaign (embedded corpus)."""
    tmp = tmp_path_factory.mktemp("campaign")
    camp = campaign.freeze(str(write_protocol(tmp)), str(tmp / "c"), None, log=lambda *_: None)
    counts = campaign.run_campaign(camp, log=lambda *_: None)
    assert counts == {"total": 8, "done": 8, "failed": 0, "pending": 0}
    analysis.analyze(camp, log=lambda *_: None)
    report.build_report(camp, log=lambda *_: None)
    return camp


def test_every_test_of_the_finished_campaign_is_marked_e2e():
    """`pytest -m "not e2e"` never builds the campaign of the `finished` fixture."""
    tree = ast.parse(Path(__file__).read_text())
    tests = [node for node in tree.body if isinstance(node, ast.FunctionDef)
             and node.name.startswith("test_") and any(a.arg == "finished" for a in node.args.args)]
    assert len(tests) >= 10
    for node in tests:
        assert "pytest.mark.e2e" in map(ast.unparse, node.decorator_list), node.name


def audit_lines(path: Path) -> tuple[int, list[str]]:
    a = audit.audit(path)
    return (0 if not a.failures else 1), a.failures


# ---------------------------------------------------------------- protocol and plan

@pytest.mark.parametrize("edit, message", [
    ("unknown_key = 1", "unknown key(s) unknown_key"),
    ('design = "ab-ba"', "exactly two arms for design ab-ba"),
    ("level = 1.5", "level must be a number in [0.5, 1)"),
    ("margin_bpb = inf", "margin_bpb must be a positive number"),
    ('name = ".."', "name must be a directory name"),
    ("seeds = [0, -1]", "seed must be an integer in [0, 2**63 - 100000), got -1"),
    ("bootstrap_resamples = 1000000000000", "bootstrap_resamples must be an integer from 1"),
    ("margin_bpb = 0", "margin_bpb must be a positive number"),
    ("eval_every = 13", "eval_every must be at most steps"),
    ("seeds = [1, 1]", "seeds must be a list of at least two distinct integers"),
    ("target_bpb = {other = 3.0}", "target_bpb must be a positive number, or a table"),
])
def test_protocol_errors_name_the_key(tmp_path, edit, message):
    text = write_protocol(tmp_path).read_text()
    key = edit.split(" =")[0]
    lines = [line for line in text.splitlines() if not line.startswith(key + " ")]
    lines.insert(1, edit)
    with pytest.raises(ValueError) as info:
        campaign.parse_protocol("\n".join(lines), "p.toml")
    assert message in str(info.value) and "p.toml" in str(info.value)


@pytest.mark.parametrize("train, message", [
    ("model = 'tiny'", "[train] may not set model"),
    ("steps = 3", "[train] may not set steps"),
    ("nonsense = 3", "[train] unknown setting(s) nonsense"),
    ("batch_size = 'x'", "[train] batch_size must be an integer >= 1, got 'x'"),
    ("batch_size = 0", "[train] batch_size must be an integer >= 1, got 0"),
    ("optimizer.nope = 1", "[train] unknown setting optimizer.nope; known in [optimizer]"),
    ("val_bytes = 5", "[train] setting val_bytes is given twice"),
    ("data = 5", "[train] data must be a table of settings ([data])"),
])
def test_protocol_train_table_is_checked(tmp_path, train, message):
    text = write_protocol(tmp_path).read_text() + train + "\n"
    with pytest.raises(ValueError, match=None) as info:
        campaign.parse_protocol(text, "p.toml")
    assert message in str(info.value)


def test_protocol_train_sections_reach_every_job(tmp_path):
    """`[train]` by section (``eval.val_bytes``, ``[train.optimizer]``) or by setting name:
    stored by setting name, and every job's config holds the values in its sections."""
    text = write_protocol(tmp_path).read_text() + "lr = 0.002\nmuon.lr = 0.03\n"
    protocol = campaign.parse_protocol(text, "p.toml")
    assert protocol.train == {"val_bytes": 2048, "probe_bytes": 1024, "eval_batch": 8,
                              "lr": 0.002, "muon_lr": 0.03}
    job = campaign.plan_jobs(protocol)[0]
    cfg = protocol.job_config(job, str(tmp_path))
    assert (cfg.eval.val_bytes, cfg.eval.batch, cfg.optimizer.lr, cfg.muon.lr) == (
        2048, 8, 0.002, 0.03)
    assert (cfg.model.name, cfg.eval.every, cfg.steps) == ("tiny-transformer", 4, 12)


def test_shipped_protocols_parse_and_balance():
    for name, jobs, arms in (("cpu-quick", 50, 5), ("paper-v6", 96, 2)):
        path = ROOT / "protocols" / f"{name}.toml"
        protocol = campaign.parse_protocol(path.read_text(), str(path))
        plan = campaign.plan_jobs(protocol)
        assert len(plan) == jobs and len({j["id"] for j in plan}) == jobs
        # every arm takes every position inside a block equally often, per model
        for model in protocol.models:
            counts = collections.Counter((j["arm"], j["position"]) for j in plan
                                         if j["model"] == model)
            assert set(counts.values()) == {len(protocol.seeds) // arms}, counts
        # blocks are contiguous: a block's arms run one after another
        assert [j["block"] for j in plan] == sorted(j["block"] for j in plan)
    assert protocol.level == 0.99 and protocol.steps == 1200


# ---------------------------------------------------------------- statistics

@pytest.mark.parametrize("df", [1, 2, 3, 5, 7, 11, 30, 100])
@pytest.mark.parametrize("level", [0.8, 0.9, 0.95, 0.99, 0.999])
def test_audit_t_quantile_matches_scipy(df, level):
    p = (1 + level) / 2
    assert audit.t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-12)


def test_audit_t_quantile_hand_values():
    # Exact closed forms: df=1 is Cauchy (tan), df=2 has
    # t = (2p - 1) * sqrt(2 / (1 - (2p - 1)^2)).
    assert audit.t_quantile(0.975, 1) == pytest.approx(12.706204736174698, rel=1e-12)
    import math
    for p in (0.6, 0.9, 0.995):
        assert audit.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-12)
        q = 2 * p - 1
        assert audit.t_quantile(p, 2) == pytest.approx(q * math.sqrt(2 / (1 - q * q)), rel=1e-12)


def test_audit_interval_agrees_with_stats_module():
    values = [0.12, 0.08, 0.15, 0.11, 0.09, 0.13, 0.10, 0.14]
    mine = audit.t_interval(values, 0.95)
    ref = stats.paired_t_interval(values, 0.95)
    for key in ("mean", "sd", "low", "high"):
        assert mine[key] == pytest.approx(getattr(ref, key), rel=1e-12)


# ---------------------------------------------------------------- end to end

@pytest.mark.e2e
def test_campaign_end_to_end(finished):
    frozen = json.loads((finished / "freeze.json").read_text())
    assert frozen["protocol_sha256"] == hashlib.sha256(
        (finished / "protocol.toml").read_bytes()).hexdigest()
    results = json.loads((finished / "analysis" / "results.json").read_text())
    assert [c["candidate"] for c in results["comparisons"]] == [
        "packed", "batched-norms-only", "packing-only"]
    for c in results["comparisons"]:
        assert c["pairs"] == 2 and c["identical_final_hash"] == {"pairs": 2, "identical": 2}
        q = c["quality_difference_bpb"]
        # identical arithmetic: every test BPB difference is exactly 0.0
        assert q["t"]["mean"] == 0.0 and q["t"]["high"] == 0.0 and q["non_inferior"] is True
    assert {f["metric"] for f in results["factorial"]} == {"training_time_reduction",
                                                          "update_phase_reduction"}
    for f in results["factorial"]:
        assert set(f["contrasts"]) == set(stats.CONTRASTS)
    pairs = (finished / "analysis" / "pairs.csv").read_text().splitlines()
    assert len(pairs) == 1 + 3 * 2
    runs = (finished / "analysis" / "runs.csv").read_text().splitlines()
    assert len(runs) == 1 + 8
    manifest = json.loads((finished / "analysis" / "manifest.json").read_text())
    assert "analysis/results.json" in manifest["files"]
    assert "protocol.toml" in manifest["files"] and "freeze.json" in manifest["files"]
    assert sorted(p.name for p in (finished / "report").iterdir()) == sorted([
        "fig-curves.png", "fig-factorial.png", "fig-quality.png", "fig-reductions.png",
        "fig-update-ms.png", "manifest.json", "report.html", "report.md"])
    assert "data:image/png;base64," in (finished / "report" / "report.html").read_text()
    assert results["protocol_sha256"] in (finished / "report" / "report.md").read_text()
    # every run's machine-load record and timing flags, recomputed from its curve
    import csv

    with open(finished / "analysis" / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    flags = results["timing_flags"]
    assert flags["rules"]["slow_step_factor"] == 5.0 and flags["rules"]["busy_demand_ratio"] == 1.1
    for row in rows:
        curve = [json.loads(line) for line in
                 (finished / row["run_dir"] / "curve.jsonl").read_text().splitlines()]
        steps = [r for r in curve if "loss_bpb" in r]
        assert float(row["cpu_s"]) == sum(r["cpu_s"] for r in steps) > 0
        median = sorted(r["step_s"] for r in steps)[len(steps) // 2 - 1: len(steps) // 2 + 1]
        slow = [r for r in steps if r["step_s"] > 5 * sum(median) / 2]
        assert int(row["slow_steps"]) == len(slow)
        assert (row["job"] in flags["flagged"]) == (row["flagged"] == "true")
        if os.path.exists("/proc/stat"):
            assert row["busy"] in ("true", "false") and row["host_cpus"] != ""
    assert flags["load_not_measured"] == ([] if os.path.exists("/proc/stat") else
                                          [r["job"] for r in rows])
    assert "Timing quality" in (finished / "report" / "report.md").read_text()


@pytest.mark.e2e
def test_time_to_target_is_the_first_crossing_probe_or_censored(finished):
    import csv
    import dataclasses

    with open(finished / "analysis" / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    protocol, frozen = campaign.load_frozen(finished)
    jobs = {j["id"]: j for j in frozen["jobs"]}
    crossed = censored = 0
    for r in runs:
        curve = [json.loads(line) for line in
                 (finished / r["run_dir"] / "curve.jsonl").read_text().splitlines()]
        probes = [p for p in curve if "probe_bpb" in p]
        assert [p["step"] for p in probes] == [4, 8, 12]
        # runs.csv, at the protocol's target: training seconds at the first crossing, or empty
        crossing = [p for p in probes if p["probe_bpb"] <= protocol.target_bpb[r["model"]]]
        if crossing:
            assert float(r["time_to_target_s"]) == crossing[0]["training_s"]
        else:
            assert r["time_to_target_s"] == ""
        # Both branches, whatever this run's BPB: at each probe's own BPB as the target the
        # run is timed at the first probe at or below it (training_s, not elapsed_s); just
        # below its best probe it is censored (None, never dropped).
        bpbs = [p["probe_bpb"] for p in probes]
        for target in [*bpbs, min(bpbs) - 1e-6]:
            at = dataclasses.replace(protocol, target_bpb={r["model"]: target})
            got = analysis.read_run(finished, jobs[r["job"]], at)["time_to_target_s"]
            first = next((p for p in probes if p["probe_bpb"] <= target), None)
            if first is None:
                censored += 1
                assert got is None
            else:
                crossed += 1
                assert got == first["training_s"] and got != first["elapsed_s"]
    assert crossed == 3 * len(runs) and censored == len(runs)


@pytest.mark.e2e
def test_audit_clean_standalone_with_a_bare_interpreter(finished):
    # -I (isolated) and -S (no site-packages): no torch, numpy or scipy can be imported.
    proc = subprocess.run([sys.executable, "-I", "-S", str(AUDIT_PY), str(finished)],
                          capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "clean" in proc.stdout and "FAIL" not in proc.stdout


def test_audit_imports_only_the_standard_library():
    tree = ast.parse(AUDIT_PY.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import in audit.py"
            modules.add(node.module.split(".")[0])
    assert modules and modules <= set(sys.stdlib_module_names) | {"__future__"}, modules


@pytest.mark.e2e
def test_figures_have_deterministic_bytes(finished, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(finished, copy)
    report.build_report(copy, log=lambda *_: None)
    for png in sorted((finished / "report").glob("*.png")):
        assert (copy / "report" / png.name).read_bytes() == png.read_bytes(), png.name


def _copy(finished: Path, tmp: Path) -> Path:
    copy = tmp / "c"
    shutil.copytree(finished, copy)
    return copy


def _rehash(camp: Path, rel: str) -> None:
    """Update the manifest entry of `rel` (a forger who also rewrites the manifest)."""
    path = camp / "analysis" / "manifest.json"
    manifest = json.loads(path.read_text())
    data = (camp / rel).read_bytes()
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@pytest.mark.e2e
def test_audit_fails_on_one_changed_byte_in_any_file(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    # every record; `.lock` (empty, the runner's lock, not a record) is the one file ignored
    files = sorted(p for p in camp.rglob("*") if p.is_file() and p.name != ".lock")
    assert len(files) > 50
    for path in files:
        rel = path.relative_to(camp).as_posix()
        original = path.read_bytes()
        changed = bytearray(original)
        changed[len(changed) // 2] ^= 0x01
        path.write_bytes(bytes(changed))
        rc, failures = audit_lines(camp)
        path.write_bytes(original)
        assert rc == 1 and any(rel in line for line in failures), (rel, failures[:3])
    assert audit_lines(camp) == (0, [])


@pytest.mark.e2e
def test_audit_names_a_removed_file(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    victim = next(camp.glob("jobs/*/attempt-1/*/*/curve.jsonl"))
    victim.unlink()
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(victim.relative_to(camp).as_posix() in f and "missing" in f
                           for f in failures)


@pytest.mark.e2e
def test_audit_names_an_extra_run(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    run = next(p for p in camp.glob("jobs/000-*/attempt-1/*") if p.is_dir())
    extra = run.parent / (run.name + "-again")
    shutil.copytree(run, extra)
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(extra.relative_to(camp).as_posix() in f for f in failures)
    # also re-listed in the manifest by a forger: the attempt now holds two run records
    for p in extra.rglob("*"):
        if p.is_file():
            _rehash(camp, p.relative_to(camp).as_posix())
    rc, failures = audit_lines(camp)
    assert rc == 1 and any("status.json" in f and "only run record" in f for f in failures)


@pytest.mark.e2e
def test_audit_recomputes_an_edited_number_even_with_a_forged_manifest(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    results = json.loads((camp / "analysis" / "results.json").read_text())
    t = results["comparisons"][0]["training_time_reduction"]["t"]
    t["high"] = t["high"] * (1 + 1e-6)
    (camp / "analysis" / "results.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    _rehash(camp, "analysis/results.json")
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith("analysis/results.json") and "t.high" in f
                           for f in failures), failures


@pytest.mark.e2e
def test_audit_names_a_mismatched_init_hash(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    meta_path = sorted(camp.glob("jobs/*/attempt-1/*/*/metadata.json"))[3]
    meta = json.loads(meta_path.read_text())
    meta["init_model_sha256"] = "0" * 64
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    rel = meta_path.relative_to(camp).as_posix()
    _rehash(camp, rel)
    rc, failures = audit_lines(camp)
    assert rc == 1 and any("init_model_sha256 differs" in f and
                           (rel in f or "runs.csv" in f) for f in failures), failures


@pytest.mark.e2e
def test_audit_names_an_extra_job_in_runs_csv_and_an_edited_step_time(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    runs = camp / "analysis" / "runs.csv"
    lines = runs.read_text().splitlines()
    runs.write_text("\n".join(lines + [lines[-1].replace(",", "-x,", 1)]) + "\n")
    _rehash(camp, "analysis/runs.csv")
    curve = next(camp.glob("jobs/*/attempt-1/*/*/curve.jsonl"))
    rows = curve.read_text().splitlines()
    first = json.loads(rows[0])
    first["step_s"] *= 2
    curve.write_text("\n".join([json.dumps(first, sort_keys=True)] + rows[1:]) + "\n")
    _rehash(camp, curve.relative_to(camp).as_posix())
    rc, failures = audit_lines(camp)
    summary = curve.parent / "summary.json"
    assert rc == 1
    assert any(f.startswith("analysis/runs.csv") and "not exactly the frozen jobs" in f
               for f in failures), failures
    assert any(f.startswith(summary.relative_to(camp).as_posix()) and "training_s" in f
               for f in failures), failures


def _make_busy(camp: Path) -> tuple[Path, Path]:
    """Rewrite one run's load record as if other work had kept 3 x its CPUs busy (with
    consistent sums and flags) and re-analyse; returns (curve, summary) of that run."""
    from cotangent.harness import contention

    if not os.path.exists("/proc/stat"):  # the other runs would lack host_cpu_s
        pytest.skip("needs a campaign with load records (Linux)")
    curve_path = sorted(camp.glob("jobs/*/attempt-1/*/*/curve.jsonl"))[0]
    summary_path = curve_path.parent / "summary.json"
    meta = json.loads((curve_path.parent / "metadata.json").read_text())
    summary = json.loads(summary_path.read_text())
    cpus = summary["host_cpus"] or 2
    rows = [json.loads(line) for line in curve_path.read_text().splitlines()]
    for r in rows:
        if "loss_bpb" in r:
            r["host_cpu_s"] = r["cpu_s"] + 3 * cpus * r["step_s"]
            r["host_steal_s"] = 0.0
    steps = [r for r in rows if "loss_bpb" in r]
    flags = contention.assess([r["step_s"] for r in steps], [r["cpu_s"] for r in steps],
                              [r["host_cpu_s"] for r in steps], cpus,
                              meta["environment"]["threads"])
    flags.pop("median_step_s")
    summary.update(flags, host_cpus=cpus, host_cpu_s=sum(r["host_cpu_s"] for r in steps),
                   host_steal_s=0.0)
    assert summary["busy"] is True and summary["flagged"] is True
    curve_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    analysis.analyze(camp, log=lambda *_: None)
    return curve_path, summary_path


@pytest.mark.e2e
def test_audit_recomputes_the_busy_flag_and_rejects_a_forged_not_busy(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    shutil.rmtree(camp / "report")
    curve_path, summary_path = _make_busy(camp)
    job = curve_path.relative_to(camp).parts[1]
    results = json.loads((camp / "analysis" / "results.json").read_text())
    assert job in results["timing_flags"]["busy"] and job in results["timing_flags"]["flagged"]
    assert audit_lines(camp) == (0, [])  # a consistent busy record audits clean, flagged
    lines = analysis.format_results(results).splitlines()
    assert lines[1].startswith("WARNING:") and any(job in line and "machine busy" in line
                                                   for line in lines)
    summary_rel = summary_path.relative_to(camp).as_posix()
    # 1. the run's own summary says "not busy"
    original = summary_path.read_text()
    forged = json.loads(original)
    forged.update(busy=False, flagged=False)
    summary_path.write_text(json.dumps(forged, indent=2, sort_keys=True) + "\n")
    _rehash(camp, summary_rel)
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith(summary_rel) and "busy (timing flag)" in f
                           for f in failures), failures
    summary_path.write_text(original)
    _rehash(camp, summary_rel)
    assert audit_lines(camp) == (0, [])
    # 2. runs.csv and results.json say "not busy"
    runs = camp / "analysis" / "runs.csv"
    text = runs.read_text()
    line = next(x for x in text.splitlines() if x.startswith(job))
    runs.write_text(text.replace(line, line.replace(",true,", ",false,")))
    _rehash(camp, "analysis/runs.csv")
    res = json.loads((camp / "analysis" / "results.json").read_text())
    res["timing_flags"]["busy"].remove(job)
    (camp / "analysis" / "results.json").write_text(json.dumps(res, indent=2, sort_keys=True))
    _rehash(camp, "analysis/results.json")
    rc, failures = audit_lines(camp)
    assert rc == 1
    assert any(f.startswith("analysis/runs.csv") and f"{job}.busy" in f for f in failures)
    assert any(f.startswith("analysis/results.json") and "timing_flags.busy" in f
               for f in failures), failures


@pytest.mark.e2e
def test_audit_finds_a_removed_load_record(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    curve_path = sorted(camp.glob("jobs/*/attempt-1/*/*/curve.jsonl"))[2]
    rel = curve_path.relative_to(camp).as_posix()
    rows = [json.loads(line) for line in curve_path.read_text().splitlines()]
    # a step row without its cpu_s
    del rows[3]["cpu_s"]
    curve_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    _rehash(camp, rel)
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith(rel) and "lack a numeric cpu_s" in f
                           for f in failures), failures
    # the whole load record stripped from the curve and the summary: the other runs have one
    for r in rows:
        for key in ("cpu_s", "host_cpu_s", "host_steal_s"):
            r.pop(key, None)
    curve_path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    _rehash(camp, rel)
    summary_path = curve_path.parent / "summary.json"
    summary = json.loads(summary_path.read_text())
    for key in ("cpu_s", "host_cpu_s", "host_steal_s", "threads", "slow_steps", "busy",
                "slow_excess_fraction", "step_outliers", "others_cpus", "cpu_demand_ratio",
                "flagged", "host_cpus", "load_avg_1m_start", "load_avg_1m_end"):
        summary.pop(key)
    summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    _rehash(camp, summary_path.relative_to(camp).as_posix())
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith(rel) and "has no cpu_s record" in f
                           for f in failures), failures


@pytest.mark.e2e
def test_audit_names_a_changed_job_set(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    frozen = json.loads((camp / "freeze.json").read_text())
    frozen["jobs"] = frozen["jobs"][:-1]
    (camp / "freeze.json").write_text(json.dumps(frozen, indent=2, sort_keys=True) + "\n")
    _rehash(camp, "freeze.json")
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith("freeze.json") and "job set" in f for f in failures)


def _edit_json(camp: Path, rel: str, edit) -> None:
    path = camp / rel
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    _rehash(camp, rel)


def _first(camp: Path, pattern: str) -> str:
    return sorted(camp.glob(pattern))[0].relative_to(camp).as_posix()


@pytest.mark.parametrize("kind", ["threads", "update_ms", "protocol_level", "attempt_number",
                                  "interrupted_holds_finished_run", "second_done_attempt",
                                  "identical_pairs", "incomplete_marker", "lr_in_config",
                                  "removed_attempt"])
@pytest.mark.e2e
def test_audit_catches_consistent_forgeries(finished, tmp_path, kind):
    """Edits whose manifest entries were updated too: the cross-checks must still fail."""
    camp = _copy(finished, tmp_path)
    meta = _first(camp, "jobs/*/attempt-1/*/*/metadata.json")
    run = meta.rsplit("/", 1)[0]
    status = run.rsplit("/", 2)[0] + "/status.json"
    expect = meta
    if kind == "threads":
        _edit_json(camp, meta, lambda m: m["environment"].update(threads=64))
    elif kind == "update_ms":
        _edit_json(camp, f"{run}/summary.json", lambda m: m.update(update_ms=m["update_ms"] / 10))
        expect = f"{run}/summary.json"
    elif kind == "protocol_level":
        _edit_json(camp, "analysis/results.json", lambda m: m["protocol"].update(level=0.99))
        expect = "analysis/results.json"
    elif kind == "attempt_number":
        _edit_json(camp, status, lambda m: m.update(attempt=7))
        expect = status
    elif kind == "interrupted_holds_finished_run":
        _edit_json(camp, status, lambda m: m.update(state="interrupted"))
        expect = status
    elif kind == "second_done_attempt":
        src = camp / status.rsplit("/", 1)[0]
        dst = src.parent / "attempt-2"
        shutil.copytree(src, dst)
        for p in dst.rglob("*"):
            if p.is_file():
                _rehash(camp, p.relative_to(camp).as_posix())
        _edit_json(camp, dst.relative_to(camp).as_posix() + "/status.json",
                   lambda m: m.update(attempt=2))
        expect = dst.relative_to(camp).as_posix() + "/status.json"
    elif kind == "identical_pairs":
        _edit_json(camp, "analysis/results.json",
                   lambda m: m["comparisons"][0]["identical_final_hash"].update(pairs=77))
        expect = "analysis/results.json"
    elif kind == "incomplete_marker":
        (camp / run / "INCOMPLETE").write_text("x")
        _rehash(camp, f"{run}/INCOMPLETE")
        expect = status
    elif kind == "removed_attempt":
        src = camp / status.rsplit("/", 1)[0]
        src.rename(src.parent / "attempt-2")
        moved = (src.parent / "attempt-2").relative_to(camp).as_posix()
        manifest = json.loads((camp / "analysis" / "manifest.json").read_text())
        manifest["files"] = {k.replace(status.rsplit("/", 1)[0], moved): v
                             for k, v in manifest["files"].items()}
        (camp / "analysis" / "manifest.json").write_text(json.dumps(manifest))
        expect = status.rsplit("/", 2)[0]
    elif kind == "lr_in_config":
        path = camp / run / "config.toml"
        path.write_text(path.read_text().replace("lr = 0.001", "lr = 0.002"))
        _rehash(camp, f"{run}/config.toml")
        expect = f"{run}/config.toml"
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith(expect) for f in failures), failures


@pytest.mark.e2e
def test_audit_finds_a_stale_report(finished, tmp_path):
    camp = _copy(finished, tmp_path)
    results = json.loads((camp / "analysis" / "results.json").read_text())
    (camp / "analysis" / "results.json").write_text(json.dumps(results, indent=1))
    _rehash(camp, "analysis/results.json")
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith("report/manifest.json") and "stale" in f
                           for f in failures), failures


@pytest.mark.parametrize("rel, content", [
    ("freeze.json", "[1, 2]"),
    ("analysis/results.json", "[1]"),
])
@pytest.mark.e2e
def test_audit_names_a_malformed_file(finished, tmp_path, rel, content):
    camp = _copy(finished, tmp_path)
    (camp / rel).write_text(content)
    _rehash(camp, rel)
    rc, failures = audit_lines(camp)
    assert rc == 1 and any(f.startswith(rel) for f in failures), failures


def test_audit_usage_errors(tmp_path):
    assert audit.main([str(tmp_path)]) == 2
    assert audit.main([]) == 2


# ---------------------------------------------------------------- freeze and run guards

def test_freeze_refuses_a_used_directory_and_run_refuses_changed_fingerprints(tmp_path):
    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lambda *_: None)
    with pytest.raises(ValueError, match="already exists and is not empty"):
        campaign.freeze(str(proto), str(camp), None, log=lambda *_: None)
    frozen_bytes = (camp / "freeze.json").read_bytes()
    # the protocol changed after freezing
    (camp / "protocol.toml").write_text((camp / "protocol.toml").read_text() + "\n")
    with pytest.raises(ValueError, match="protocol changed after freezing"):
        campaign.run_campaign(camp, log=lambda *_: None)
    (camp / "protocol.toml").write_bytes(proto.read_bytes())
    # the code changed after freezing
    frozen = json.loads(frozen_bytes)
    frozen["code"]["cotangent_sha256"] = "1" * 64
    (camp / "freeze.json").write_text(json.dumps(frozen))
    with pytest.raises(ValueError, match="code differs from the frozen campaign"):
        campaign.run_campaign(camp, log=lambda *_: None)
    # the data changed (frozen on the embedded corpus, run on a different corpus)
    frozen = json.loads(frozen_bytes)
    frozen["data"]["splits"]["train"] = "2" * 64
    (camp / "freeze.json").write_text(json.dumps(frozen))
    with pytest.raises(ValueError, match="differ from the frozen fingerprints"):
        campaign.run_campaign(camp, log=lambda *_: None)
    # an edited job list
    frozen = json.loads(frozen_bytes)
    frozen["jobs"].reverse()
    (camp / "freeze.json").write_text(json.dumps(frozen))
    with pytest.raises(ValueError, match="job list is not the protocol's plan"):
        campaign.run_campaign(camp, log=lambda *_: None)
    assert not (camp / "jobs").exists()


def _wait_for(predicate, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.05)


def _states(camp: Path) -> dict[str, list[str]]:
    out = {}
    for job_dir in sorted((camp / "jobs").iterdir()):
        out[job_dir.name] = [json.loads((a / "status.json").read_text())["state"]
                             for a in campaign.attempt_dirs(job_dir)]
    return out


@pytest.mark.e2e
def test_resume_after_ctrl_c_and_a_killed_runner(tmp_path):
    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lambda *_: None)
    jobs = json.loads((camp / "freeze.json").read_text())["jobs"]
    cmd = [sys.executable, "-m", "cotangent.harness.cli", "campaign", "run", str(camp)]

    def running(index: int):
        status = camp / "jobs" / jobs[index]["id"] / "attempt-1" / "status.json"
        return lambda: status.exists() and json.loads(status.read_text())["state"] == "running"

    # 1. Ctrl-C while the second job runs: the runner records it as interrupted, exits 130.
    runner = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    _wait_for(running(1))
    time.sleep(0.5)
    os.killpg(runner.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the group
    out, _ = runner.communicate(timeout=120)
    assert runner.returncode == 130, out
    assert "runs again as attempt 2" in out
    states = _states(camp)
    assert states[jobs[0]["id"]] == ["done"] and states[jobs[1]["id"]] == ["interrupted"]
    reason = json.loads((camp / "jobs" / jobs[1]["id"] / "attempt-1" / "status.json").read_text())
    assert "Ctrl-C" in reason["reason"]
    # 2. SIGKILL the runner alone (no chance to record anything) during the third job: its
    #    job must not survive it and keep training beside the resumed one.
    runner = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    _wait_for(running(2))
    status = camp / "jobs" / jobs[2]["id"] / "attempt-1" / "status.json"
    _wait_for(lambda: "pid" in json.loads(status.read_text()))
    child = json.loads(status.read_text())["pid"]
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait()

    def gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    _wait_for(gone, timeout=10)  # PR_SET_PDEATHSIG: the job died with its runner
    assert _states(camp)[jobs[2]["id"]] == ["running"]  # on disk, until the next run settles it
    # `campaign status` does not call it running next to "no runner active"
    lines = campaign.status_lines(camp)
    assert lines[0].endswith("no runner active"), lines
    line = next(line for line in lines if jobs[2]["id"] in line)
    assert f"attempt-1 interrupted (was running, pid {child}; the runner stopped" in line, line
    assert not any(" running (" in line for line in lines), lines
    with pytest.raises(ValueError, match="marked running but no runner is active"):
        analysis.analyze(camp, log=lambda *_: None)
    # 3. Resume: the dead attempt is recorded as interrupted, nothing finished runs again.
    lines = []
    counts = campaign.run_campaign(camp, log=lines.append)
    assert counts == {"total": 4, "done": 4, "failed": 0, "pending": 0}
    assert any("runner stopped" in line for line in lines)
    states = _states(camp)
    assert states[jobs[0]["id"]] == ["done"]
    assert states[jobs[1]["id"]] == ["interrupted", "done"]
    assert states[jobs[2]["id"]] == ["interrupted", "done"]
    assert states[jobs[3]["id"]] == ["done"]
    # 4. Running again does nothing; the interrupted attempts stay as evidence and audit clean.
    assert campaign.run_campaign(camp, log=lambda *_: None)["done"] == 4
    assert all(len(v) == len(states[k]) for k, v in _states(camp).items())
    analysis.analyze(camp, log=lambda *_: None)
    assert audit_lines(camp) == (0, [])


@pytest.mark.e2e
def test_failed_jobs_are_recorded_never_silently_rerun(tmp_path, monkeypatch):
    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba",
                           seeds="[0, 1, 2]")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lambda *_: None)
    jobs = json.loads((camp / "freeze.json").read_text())["jobs"]
    victim = jobs[1]["id"]
    real = campaign.job_command

    def failing(campaign_dir, attempt, data_dir):
        if victim in attempt:
            return [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
        return real(campaign_dir, attempt, data_dir)

    # A run that finishes on other data than the frozen is a failure too.
    other = tmp_path / "other-data"
    other.mkdir()
    for split in ("train", "valid", "test"):
        (other / f"{split}.txt").write_bytes(bytes(range(256)) * 64)
    wrong_data = jobs[3]["id"]

    def failing_or_other_data(campaign_dir, attempt, data_dir):
        if wrong_data in attempt:
            return real(campaign_dir, attempt, str(other))
        return failing(campaign_dir, attempt, data_dir)

    monkeypatch.setattr(campaign, "job_command", failing_or_other_data)
    # A data directory in the environment must not leak into the jobs (frozen: embedded).
    monkeypatch.setenv("COTANGENT_DATA_DIR", str(other))
    counts = campaign.run_campaign(camp, log=lambda *_: None)
    assert counts == {"total": 6, "done": 4, "failed": 2, "pending": 0}
    status = json.loads((camp / "jobs" / victim / "attempt-1" / "status.json").read_text())
    assert status["state"] == "failed" and status["returncode"] == 3
    assert status["log_tail"] == ["boom"]
    status = json.loads((camp / "jobs" / wrong_data / "attempt-1" / "status.json").read_text())
    assert status["state"] == "failed" and status["returncode"] == 0
    assert status["reason"] == "the run read other data than the frozen fingerprints"
    assert campaign.run_campaign(camp, log=lambda *_: None)["failed"] == 2  # not re-run
    assert [len(campaign.attempt_dirs(camp / "jobs" / j)) for j in (victim, wrong_data)] == [1, 1]
    results = analysis.analyze(camp, log=lambda *_: None)
    assert sorted(results["jobs"]["failed"]) == sorted([victim, wrong_data])
    missing = sorted({jobs[1]["seed"], jobs[3]["seed"]})
    assert results["comparisons"][0]["missing_seeds"] == missing
    assert results["comparisons"][0]["pairs"] == 3 - len(missing)
    assert audit_lines(camp) == (0, [])
    # --retry-failed: new attempts; the failed ones stay as evidence
    monkeypatch.setattr(campaign, "job_command", real)
    counts = campaign.run_campaign(camp, retry_failed=True, log=lambda *_: None)
    assert counts["done"] == 6 and counts["failed"] == 0
    for job in (victim, wrong_data):
        assert [json.loads((a / "status.json").read_text())["state"] for a in
                campaign.attempt_dirs(camp / "jobs" / job)] == ["failed", "done"]
    results = analysis.analyze(camp, log=lambda *_: None)
    assert results["jobs"]["failed"] == [] and results["comparisons"][0]["pairs"] == 3
    assert audit_lines(camp) == (0, [])  # failed then done on retry is a clean record


@pytest.mark.e2e
def test_symlinked_campaign_relative_data_and_an_attempt_without_status(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid", "test"):
        (data / f"{split}.txt").write_bytes(bytes(range(256)) * 64)
    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba")
    (tmp_path / "deep" / "er").mkdir(parents=True)
    unknown = r"is not a known WikiText-2 (train|valid|test) file; using it anyway"
    with pytest.warns(UserWarning, match=unknown) as record:  # these bytes are not WikiText-2
        camp = campaign.freeze(str(proto), str(tmp_path / "deep" / "er" / "c"), str(data),
                               log=lambda *_: None)
    assert len(record) == 3
    link = tmp_path / "link"
    link.symlink_to(camp)
    jobs = json.loads((camp / "freeze.json").read_text())["jobs"]
    # A runner killed between creating an attempt directory and writing its status.
    (camp / "jobs" / jobs[0]["id"] / "attempt-1").mkdir(parents=True)
    with pytest.warns(UserWarning, match=unknown) as record:
        counts = campaign.run_campaign(link, log=lambda *_: None)
    assert len(record) == 3
    assert counts == {"total": 4, "done": 4, "failed": 0, "pending": 0}
    first = [json.loads((a / "status.json").read_text()) for a in
             campaign.attempt_dirs(camp / "jobs" / jobs[0]["id"])]
    assert [st["state"] for st in first] == ["interrupted", "done"]
    assert first[0]["started_utc"] <= first[0]["ended_utc"] <= first[1]["started_utc"]
    analysis.analyze(link, log=lambda *_: None)
    assert audit_lines(camp) == (0, [])
    # two arms, no factorial: four figures (five only with the 2x2 factorial's four arms)
    report.build_report(link, log=lambda *_: None)
    assert sorted(p.name for p in (camp / "report").glob("*.png")) == [
        "fig-curves.png", "fig-quality.png", "fig-reductions.png", "fig-update-ms.png"]


def test_a_second_runner_and_analyze_are_refused_while_one_is_active(tmp_path):
    import fcntl

    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lambda *_: None)
    with open(camp / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="another `cotangent campaign run`, or a job"):
            campaign.run_campaign(camp, log=lambda *_: None)
        assert (camp / ".lock").exists()
        assert campaign.runner_active(camp)
        assert "a runner is active" in campaign.status_lines(camp)[0]
        with pytest.raises(ValueError, match="still active"):
            analysis.analyze(camp, log=lambda *_: None)
        assert (camp / ".lock").exists()
        assert not any((camp / "jobs").iterdir())
        # an attempt the (lock-holding) runner is running is shown as running
        job = json.loads((camp / "freeze.json").read_text())["jobs"][0]
        attempt = camp / "jobs" / job["id"] / "attempt-1"
        attempt.mkdir(parents=True)
        (attempt / "status.json").write_text(json.dumps(
            {"job": job["id"], "attempt": 1, "state": "running", "pid": 4242}))
        line = next(x for x in campaign.status_lines(camp) if job["id"] in x)
        assert line.endswith("attempt-1 running (pid 4242)"), line
    assert not campaign.runner_active(camp)
    # the lock is free: that runner is gone, so its attempt is not running any more
    lines = campaign.status_lines(camp)
    assert lines[0].endswith("no runner active")
    line = next(x for x in lines if job["id"] in x)
    assert "attempt-1 interrupted (was running, pid 4242; the runner stopped" in line, line


def test_run_refuses_another_thread_count(tmp_path):
    import torch

    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lambda *_: None)
    frozen = json.loads((camp / "freeze.json").read_text())
    assert frozen["machine"]["threads"] == torch.get_num_threads()
    assert frozen["balanced"] is True
    frozen["machine"]["threads"] += 1
    (camp / "freeze.json").write_text(json.dumps(frozen))
    with pytest.raises(ValueError, match="this machine differs from the frozen campaign's"):
        campaign.run_campaign(camp, log=lambda *_: None)


def test_freeze_warns_about_an_unbalanced_design(tmp_path):
    lines = []
    proto = write_protocol(tmp_path, seeds="[0, 1, 2]")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lines.append)
    assert any("cannot be balanced (use a multiple of 4 seeds)" in line for line in lines)
    assert json.loads((camp / "freeze.json").read_text())["balanced"] is False


def test_analyze_refuses_unfinished_campaigns(tmp_path):
    proto = write_protocol(tmp_path, arms='["native", "cotangent"]', design="ab-ba")
    camp = campaign.freeze(str(proto), str(tmp_path / "c"), None, log=lambda *_: None)
    with pytest.raises(ValueError, match="4 of 4 jobs have not finished"):
        analysis.analyze(camp, log=lambda *_: None)


@pytest.mark.e2e
def test_committed_cpu_quick_results_audit_clean():
    camp = ROOT / "results" / "cpu-quick"
    assert (camp / "analysis" / "results.json").is_file(), "results/cpu-quick is committed"
    proc = subprocess.run([sys.executable, "-I", "-S", str(AUDIT_PY), str(camp)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
