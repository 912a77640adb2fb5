"""End-to-end `cotangent train` on the tiny model: both arms must end bit-identical."""

from __future__ import annotations

import json
import os

import pytest

from cotangent.harness import cli
from cotangent.harness.train import lr_factor, warmup_steps


@pytest.mark.e2e
def test_thirty_step_train_gives_identical_final_hashes(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--steps", "30", "--seed", "3", "--val-bytes", "8192",
            "--out", str(tmp_path), "--json"]
    # Data: $COTANGENT_DATA_DIR (WikiText-2 in CI), else the embedded standard-library corpus.
    assert cli.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["identical_final_hash"] is True
    native, ours = result["native"], result["cotangent"]
    assert native["final_model_sha256"] == ours["final_model_sha256"]
    assert native["val_bpb"] == ours["val_bpb"] and 0 < native["val_bpb"] < 8
    for arm in (native, ours):
        assert arm["update_ms"] > 0 and arm["step_ms"] > arm["update_ms"]
        run_dir = tmp_path / os.path.relpath(arm["run_dir"], tmp_path)
        meta = json.loads((run_dir / "metadata.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
        assert len(curve) == 30 and summary["final_model_sha256"] == arm["final_model_sha256"]
        # training really moved the model away from its initial weights
        assert meta["init_model_sha256"] != summary["final_model_sha256"]
        assert curve[-1]["loss_bpb"] < curve[0]["loss_bpb"]
    assert "identical final model SHA-256: yes" in "\n".join(out)


def test_lr_schedule_warmup_then_cosine_to_a_tenth():
    assert warmup_steps(300) == 30 and warmup_steps(50) == 20 and warmup_steps(5000) == 100
    assert lr_factor(0, 300) == pytest.approx(1 / 30)
    assert lr_factor(29, 300) == 1.0
    assert lr_factor(30, 300) == 1.0
    assert lr_factor(299, 300) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_factor(s, 300) >= lr_factor(s + 1, 300) for s in range(30, 299))


def test_bad_data_dir_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["train", "--model", "tiny", "--steps", "1", "--data-dir",
                     str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["tiny-transformer", "tiny-gated-gqa", "tiny-causal-conv",
                                   "tiny-transformer-medium"])
@pytest.mark.e2e
def test_all_four_arms_end_identical(model, tmp_path, capsys):
    args = ["train", "--model", model, "--steps", "12", "--val-bytes", "4096", "--out",
            str(tmp_path), "--arms", "native,cotangent,batched-norms-only,packing-only", "--json"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hashes = {result[a]["final_model_sha256"] for a in
              ("native", "cotangent", "batched-norms-only", "packing-only")}
    assert result["identical_final_hash"] is True and len(hashes) == 1


def test_unknown_arm_is_a_clear_error(capsys):
    assert cli.main(["train", "--model", "tiny", "--arms", "native,fast"]) == 2
    assert "arms must be a non-empty list of distinct names from native, cotangent, " \
        "batched-norms-only, packing-only, packed, cotangent-zero1, U, S, P, A, AP or PA, got " \
        "['native', 'fast']" in capsys.readouterr().err


def _run_dirs(root):
    return sorted(p for p in root.glob("*/*") if p.is_dir())


@pytest.mark.e2e
def test_config_file_flags_and_overrides_resolve_in_order(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "tiny"\nsteps = 50\nseed = 4\nval_bytes = 4096\n')
    args = ["train", "--config", str(cfg), "--steps", "6", "--set", "seed=5",
            "--set", "eval_every=3", "--out", str(tmp_path / "runs"), "--json"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "steps = 6" in out and "seed = 5" in out and 'model = "tiny"' in out
    for run_dir in _run_dirs(tmp_path / "runs"):
        meta = json.loads((run_dir / "metadata.json").read_text())
        assert meta["config"]["steps"] == 6 and meta["config"]["seed"] == 5
        assert "seed = 5" in (run_dir / "config.toml").read_text()
    assert cli.main(["train", "--set", "nope=1"]) == 2
    assert "unknown setting" in capsys.readouterr().err
    assert cli.main(["train", "--set", "steps=1.5"]) == 2
    assert "steps must be an integer >= 1, got 1.5" in capsys.readouterr().err


@pytest.mark.e2e
def test_records_are_complete(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--steps", "6", "--eval-every", "3", "--val-bytes",
            "4096", "--out", str(tmp_path), "--json"]
    assert cli.main(args) == 0
    for run_dir in _run_dirs(tmp_path):
        assert not (run_dir / "INCOMPLETE").exists()
        assert not (run_dir / "curve.partial.jsonl").exists()
        meta = json.loads((run_dir / "metadata.json").read_text())
        for key in ("config", "arm", "seed", "environment", "device_name", "data",
                    "init_model_sha256", "schedule_sha256", "parameters", "tensors"):
            assert key in meta, key
        for key in ("torch", "torch_git", "threads", "code_sha256", "cpu_capability"):
            assert key in meta["environment"], key
        curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
        steps = [r for r in curve if "loss_bpb" in r]
        probes = [r for r in curve if "probe_bpb" in r]
        assert len(steps) == 6 and [p["step"] for p in probes] == [3, 6]
        assert all({"step_s", "update_s", "grad_norm"} <= r.keys() for r in steps)
        assert all({"training_s", "elapsed_s"} <= r.keys() for r in probes)
        summary = json.loads((run_dir / "summary.json").read_text())
        for key in ("setup_s", "training_s", "update_s", "total_s", "probes", "val_bpb",
                    "val_targets", "test_bpb", "test_targets", "final_model_sha256",
                    "peak_rss_kib"):
            assert key in summary, key
        assert abs(summary["training_s"] - sum(r["step_s"] for r in steps)) < 1e-9
        # machine load beside every step's wall time, and the run's sums and timing flags
        assert all(r["cpu_s"] >= 0 for r in steps)
        assert summary["cpu_s"] == sum(r["cpu_s"] for r in steps)
        assert summary["threads"] == meta["environment"]["threads"]
        for key in ("load_avg_1m_start", "load_avg_1m_end", "host_cpus", "others_cpus",
                    "cpu_demand_ratio", "busy", "slow_steps", "slow_excess_fraction",
                    "step_outliers", "flagged"):
            assert key in summary, key
        if os.path.exists("/proc/stat"):  # Linux: the machine's busy time is measured
            assert all(r["host_cpu_s"] >= 0 and r["host_steal_s"] >= 0 for r in steps)
            assert summary["host_cpu_s"] == sum(r["host_cpu_s"] for r in steps)
            assert summary["host_cpus"] == len(os.sched_getaffinity(0))
            assert isinstance(summary["busy"], bool)
            assert summary["flagged"] == (summary["busy"] or summary["step_outliers"])


@pytest.mark.e2e
def test_progress_lines_without_a_terminal(tmp_path):
    """stdout and stderr are pipes: plain, flushed progress lines on stdout, no tqdm bar."""
    import re
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "cotangent.harness.cli", "train", "--model", "tiny", "--steps",
         "40", "--val-bytes", "4096", "--out", str(tmp_path), "--progress-every", "0.05"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "\r" not in proc.stdout + proc.stderr and "steps:" not in proc.stderr  # no bar
    pattern = re.compile(r"progress: step (\d+)/40 \(\d+%\), [\d.]+ s, ETA \d+ s; median step "
                         r"ms native [\d.]+, cotangent [\d.]+(; other work -?[\d.]+ CPUs)?$")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("progress:")]
    done = [int(pattern.match(line).group(1)) for line in lines]
    assert len(done) >= 2 and done == sorted(set(done)) and done[-1] == 40, lines
    # the lines come before the final comparison table, as the run goes
    out = proc.stdout.splitlines()
    assert out.index(lines[-1]) < next(i for i, line in enumerate(out) if line.startswith("arm "))
    # the final evaluation says what it does, then each arm's result as it finishes
    evaluating = next(i for i, line in enumerate(out)
                      if line.startswith("evaluating the final models: "))
    per_arm = [i for i, line in enumerate(out) if re.fullmatch(
        r"  (native|cotangent): valid [\d.]+ BPB, test [\d.]+ BPB \([\d.]+ s\)", line)]
    assert out.index(lines[-1]) < evaluating < per_arm[0] and len(per_arm) == 2, out


@pytest.mark.e2e
def test_default_progress_without_a_terminal_is_a_final_line(tmp_path, capsys):
    # capsys: stdout is not a terminal, no --progress-every: the default interval (20 s)
    args = ["train", "--model", "tiny", "--steps", "5", "--val-bytes", "4096", "--out",
            str(tmp_path)]
    assert cli.main(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("progress:")]
    assert lines and lines[-1].startswith("progress: step 5/5 (100%)")
    assert cli.main(args + ["--progress-every", "0"]) == 0
    assert "progress:" not in capsys.readouterr().out
    assert cli.main(args + ["--progress-every", "-1"]) == 2
    assert "--progress-every must be" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_killed_run_stays_marked_incomplete(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "cotangent.harness.cli", "train", "--model", "tiny", "--steps",
         "100000", "--val-bytes", "4096", "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120

        def curves_started() -> bool:
            files = list(tmp_path.glob("*/*/curve.partial.jsonl"))
            return len(files) == 2 and all(f.read_text().count("\n") >= 1 for f in files)

        while time.time() < deadline and not curves_started():
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    dirs = _run_dirs(tmp_path)
    assert len(dirs) == 2
    for run_dir in dirs:
        assert (run_dir / "INCOMPLETE").exists()
        assert not (run_dir / "summary.json").exists()
        rows = (run_dir / "curve.partial.jsonl").read_text().splitlines()
        assert rows and json.loads(rows[0])["step"] == 0  # the curve so far survives the kill
        json.loads((run_dir / "metadata.json").read_text())  # complete, valid JSON (atomic)


@pytest.mark.e2e
def test_compiled_model_arms_end_identical(tmp_path, capsys):
    args = ["train", "--model", "tiny-transformer", "--steps", "3", "--compile", "--val-bytes",
            "4096", "--out", str(tmp_path), "--arms", "native,cotangent", "--json"]
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical_final_hash"] is True


@pytest.mark.parametrize("override,message", [
    ("betas=[0.9]", "betas must be a list of two numbers in [0, 1), got [0.9]"),
    ("betas=[0.9, 0.9, 0.9]", "betas must be a list of two numbers"),
    ('device="tpu"', "device must be cpu, cuda or mps"),
    ("seed=-1", "seed must be an integer in [0, 2**63 - 100000), got -1"),
    ("lr=-0.1", "lr must be a finite number >= 0, got -0.1"),
    ("lr=inf", "lr must be a finite number >= 0, got inf"),
])
def test_bad_settings_are_one_line_errors(override, message, tmp_path, capsys):
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # refused before any run directory exists


def test_config_syntax_error_names_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    assert cli.main(["train", "--config", str(bad)]) == 2
    assert "bad.toml: not valid TOML" in capsys.readouterr().err
