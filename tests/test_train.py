"""cotangent train: single-process and distributed arms, records, hashes.

End-to-end `cotangent train` on the tiny model: both arms must end bit-identical.

Data-parallel `cotangent train`: `--nproc N` (torch's elastic launcher) and torchrun.

Every rank trains every arm wrapped in DistributedDataParallel (gloo, CPU) on its own windows;
the final model SHA-256 must be identical between the arms and between the ranks. Runs go
through `python -m cotangent.harness.cli` in a subprocess with a timeout, so a rank that
crashes or hangs fails the test instead of hanging it.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cotangent.harness import cli, train
from cotangent.harness.data import BITS_PER_NAT, embedded_corpus, load_wikitext2, WindowSampler
from cotangent.harness.model import build_model
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
        "batched-norms-only, packing-only, packed, cotangent-zero1, native-fsdp2, " \
        "cotangent-fsdp2, U, S, P, A, AP or PA, got ['native', 'fast']" in capsys.readouterr().err


@pytest.mark.parametrize("arms, message", [
    ("native-fsdp2,cotangent-fsdp2", "the native-fsdp2 arm shards the model over ranks "
     "(fully_shard): run it data-parallel (--nproc N or torchrun)"),
    ("cotangent-fsdp2", "the cotangent-fsdp2 arm shards the model over ranks"),
    ("native,cotangent-fsdp2", "the FSDP2 arms (cotangent-fsdp2) and the DDP arms (native) "
     "reduce gradients differently"),
])
def test_fsdp2_arms_need_data_parallel_and_each_other(arms, message, capsys):
    assert cli.main(["train", "--model", "tiny", "--arms", arms]) == 2
    assert message in capsys.readouterr().err


def test_fsdp2_arms_refuse_compile_before_any_rank_starts(capsys, monkeypatch):
    """Refused while the configuration is checked, before `--nproc` starts a rank (a review
    saw the refusal come from both ranks, after the launcher had started them)."""
    from cotangent.harness.commands import train as train_command

    monkeypatch.setattr(train_command, "launch_ranks",
                        lambda *a: pytest.fail("ranks started before the refusal"))
    assert cli.main(["train", "--model", "tiny", "--nproc", "2", "--compile", "--arms",
                     "native-fsdp2,cotangent-fsdp2"]) == 2
    assert "the native-fsdp2 arm does not run under torch.compile here" in \
        capsys.readouterr().err


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
    assert "steps = 6" in out and "seed = 5" in out and '[model]\n  name = "tiny"' in out
    assert "[eval]\n  val_bytes = 4096\n  every = 3" in out
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


RUN_TIMEOUT_S = 180  # one tiny run takes about 7 s on an idle 2-core machine


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher's rank variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in train.LAUNCHER_ENV and k != "OMP_NUM_THREADS"}
    env.update(extra)
    return env


def _run(command: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run `command`; on a timeout stop it (SIGTERM: the launcher stops its ranks, then
    SIGKILL) and fail."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)  # not communicate(): an orphaned rank may hold the pipes
            out, err = "", "(killed)"
        pytest.fail(f"{' '.join(command)} did not finish in {RUN_TIMEOUT_S} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "cotangent.harness.cli", *args]


def _tiny_args(out, *extra: str) -> list[str]:
    # Data: $COTANGENT_DATA_DIR (WikiText-2 in CI), else the embedded standard-library corpus.
    return ["train", "--model", "tiny", "--steps", "6", "--eval-every", "3", "--val-bytes",
            "4096", "--out", str(out), "--json", *extra]


def _arm_dirs(root):
    return sorted(p for p in root.glob("*/*") if p.is_dir())


@functools.cache
def _corpus():
    data_dir = os.environ.get("COTANGENT_DATA_DIR")
    return load_wikitext2(data_dir) if data_dir else embedded_corpus()


def _step0_loss_bpb(rank: int, seed: int = 0) -> float:
    """Rank `rank`'s first-step loss (bits per byte) of the tiny model, computed here from
    the documented formula: windows from default_rng(seed + 100000 + rank * 2**63)."""
    corpus = _corpus()
    model = build_model("tiny", seed)
    batch = WindowSampler(corpus.splits["train"], seed=seed + rank * 2**63, batch_size=8,
                          context=model.cfg.context).next_batch()
    with torch.no_grad():
        logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             batch[:, 1:].reshape(-1))
    return loss.item() * BITS_PER_NAT


@pytest.mark.e2e
def test_two_ranks_end_identical_across_arms_and_ranks(tmp_path):
    t0 = time.perf_counter()
    code, out, err = _run(_cli(*_tiny_args(tmp_path / "nproc", "--nproc", "2")), _clean_env())
    nproc_s = time.perf_counter() - t0
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["identical_final_hash"] is True and result["ranks_agree"] is True
    threads = max(1, train._cores() // 2)  # cores // ranks: OMP_NUM_THREADS is unset here
    assert result["data_parallel"] == {"world_size": 2, "backend": "gloo",
                                       "threads_per_rank": threads}
    final = result["native"]["final_model_sha256"]
    assert result["cotangent"]["final_model_sha256"] == final
    # rank 0 alone prints (one config, one table) and writes (one run directory per arm)
    assert out.count("\nconfig:\n") == 1 and out.count("\narm ") == 1
    assert "same final model SHA-256 on all 2 ranks (gloo): yes; the times are rank 0's" in out
    dirs = _arm_dirs(tmp_path / "nproc")
    assert [d.name for d in dirs] == ["cotangent", "native"]
    for run_dir in dirs:
        assert not (run_dir / "INCOMPLETE").exists()
        meta = json.loads((run_dir / "metadata.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        dp = meta["data_parallel"]
        assert (dp["world_size"], dp["backend"], dp["local_world_size"]) == (2, "gloo", 2)
        assert dp["sampler_seed"] == "numpy.random.default_rng(seed + 100000 + rank * 2**63)"
        assert dp["threads_from"] == "cores // local ranks"
        assert meta["environment"]["threads"] == dp["threads_per_rank"]
        assert summary["final_model_sha256"] == final
        assert summary["data_parallel"]["rank_final_model_sha256"] == [final, final]
        assert summary["data_parallel"]["ranks_agree"] is True
        assert summary["data_parallel"]["backend"] == "gloo"
        curve = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
        steps = [r for r in curve if "loss_bpb" in r]
        assert len(steps) == 6 and [r["step"] for r in curve if "probe_bpb" in r] == [3, 6]
        assert meta["init_model_sha256"] != final  # training moved the model
    # Each rank trained on its own windows: the first step's loss is the mean of both ranks'
    # losses on their own batches (computed here, other threads: not a bitwise comparison).
    loss0, loss1 = _step0_loss_bpb(0), _step0_loss_bpb(1)
    assert abs(loss0 - loss1) > 1e-3
    assert steps[0]["loss_bpb"] == pytest.approx((loss0 + loss1) / 2, rel=1e-5)

    # torchrun itself gives the same run (its OMP_NUM_THREADS=1 is honoured).
    t0 = time.perf_counter()
    code, out, err = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "cotangent.harness.cli",
                           *_tiny_args(tmp_path / "torchrun", "--arms",
                                       "native,cotangent,cotangent-zero1")], _clean_env())
    torchrun_s = time.perf_counter() - t0
    assert code == 0, err[-3000:]
    again = json.loads(out.strip().splitlines()[-1])
    assert again["ranks_agree"] is True and again["identical_final_hash"] is True
    assert again["native"]["final_model_sha256"] == final
    assert again["cotangent-zero1"]["final_model_sha256"] == final  # ZeRO-1: the same bits
    meta = json.loads((_arm_dirs(tmp_path / "torchrun")[0] / "metadata.json").read_text())
    assert meta["data_parallel"]["threads_from"] == "OMP_NUM_THREADS"
    print(f"--nproc 2: {nproc_s:.1f} s, torchrun: {torchrun_s:.1f} s")


@pytest.mark.e2e
def test_two_ranks_fsdp2_arms_end_with_native_hashes(tmp_path):
    """`--arms native-fsdp2,cotangent-fsdp2 --nproc 2`: the model fully_shard'ed per block and
    at the root on 2 gloo ranks, native's clip_grad_norm_ + fused AdamW on the DTensor
    parameters against cotangent.AdamW; the full final model (gathered from both ranks) has
    the same SHA-256 in both arms and on both ranks, training moved it, and every curve row
    and BPB agrees between the arms."""
    code, out, err = _run(_cli(*_tiny_args(tmp_path, "--nproc", "2", "--arms",
                                           "native-fsdp2,cotangent-fsdp2")), _clean_env())
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["identical_final_hash"] is True and result["ranks_agree"] is True
    final = result["native-fsdp2"]["final_model_sha256"]
    assert result["cotangent-fsdp2"]["final_model_sha256"] == final
    assert result["native-fsdp2"]["val_bpb"] == result["cotangent-fsdp2"]["val_bpb"]
    curves = {}
    for run_dir in _arm_dirs(tmp_path):
        meta = json.loads((run_dir / "metadata.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["data_parallel"]["rank_final_model_sha256"] == [final, final]
        assert meta["init_model_sha256"] != final  # training moved the model
        curves[run_dir.name] = [
            {k: v for k, v in json.loads(line).items() if not k.endswith("_s")}
            for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    assert sorted(curves) == ["cotangent-fsdp2", "native-fsdp2"]
    assert curves["native-fsdp2"] == curves["cotangent-fsdp2"]  # losses, norms, lrs, probes
    assert len([r for r in curves["native-fsdp2"] if "loss_bpb" in r]) == 6


SITECUSTOMIZE = '''\
import os

# Test only: the rank named by COTANGENT_TEST_KILL_RANK kills itself with SIGKILL (as the
# kernel's OOM killer would) once both arms' curves of rank 0 have a row, i.e. in the middle
# of training.
if os.environ.get("RANK") is not None and \\
        os.environ.get("RANK") == os.environ.get("COTANGENT_TEST_KILL_RANK"):
    import glob
    import signal
    import threading
    import time

    def _kill_when_training():
        pattern = os.environ["COTANGENT_TEST_KILL_WHEN"]
        while True:
            paths = glob.glob(pattern)
            if len(paths) == 2 and all(os.path.getsize(p) for p in paths):
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=_kill_when_training, daemon=True).start()
'''


@pytest.mark.e2e
def test_a_rank_killed_mid_run_stops_the_run(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out_dir = tmp_path / "runs"
    env = _clean_env(COTANGENT_TEST_KILL_RANK="1",
                     COTANGENT_TEST_KILL_WHEN=str(out_dir / "*" / "*" / "curve.partial.jsonl"),
                     PYTHONPATH=os.pathsep.join(filter(None, [str(hook),
                                                              os.environ.get("PYTHONPATH")])))
    args = ["train", "--model", "tiny", "--steps", "100000", "--val-bytes", "4096", "--out",
            str(out_dir), "--nproc", "2"]
    t0 = time.perf_counter()
    code, _, err = _run(_cli(*args), env)
    assert code != 0 and time.perf_counter() - t0 < RUN_TIMEOUT_S
    assert "ranks failed: " in err and "rank 1 killed by SIGKILL" in err, err[-3000:]
    dirs = _arm_dirs(out_dir)
    assert len(dirs) == 2
    for run_dir in dirs:  # the run was under way, and stays marked unfinished
        assert (run_dir / "INCOMPLETE").exists() and not (run_dir / "summary.json").exists()
        assert (run_dir / "curve.partial.jsonl").read_text().count("\n") >= 1


@pytest.mark.parametrize("value", ["0", "-1", "-8"])
def test_nproc_below_one_is_a_clear_error(value, tmp_path, capsys):
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path), "--nproc", value]) == 2
    err = capsys.readouterr().err
    assert f"--nproc must be an integer >= 1, got {value}" in err
    assert len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # refused before any run directory exists


def test_nproc_not_an_integer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--model", "tiny", "--nproc", "two"])
    assert exc.value.code == 2
    assert "--nproc: invalid int value: 'two'" in capsys.readouterr().err


def test_nproc_is_in_the_train_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--nproc N data-parallel ranks on this machine" in text
    assert "DistributedDataParallel" in text and "gloo" in text


def _fake_launcher_env(monkeypatch, **values: str) -> None:
    for key in train.LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_rank_env(monkeypatch) -> None:
    _fake_launcher_env(monkeypatch, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                       LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()))


def test_launcher_env_is_read_whole_or_refused(monkeypatch):
    _fake_launcher_env(monkeypatch)
    assert train.launcher_env() is None
    _one_rank_env(monkeypatch)
    env = train.launcher_env()
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (0, 1, 1)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="incomplete torchrun environment: .* but not "
                                         "MASTER_PORT"):
        train.launcher_env()
    monkeypatch.setenv("MASTER_PORT", "x")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer, got 'x'"):
        train.launcher_env()
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="out of range: RANK 1, WORLD_SIZE 1"):
        train.launcher_env()


def test_nproc_other_than_the_launchers_is_a_clear_error(monkeypatch, tmp_path, capsys):
    _one_rank_env(monkeypatch)
    assert cli.main(["train", "--model", "tiny", "--out", str(tmp_path), "--nproc", "2"]) == 2
    assert "--nproc 2, but the launcher started 1 process(es)" in capsys.readouterr().err
    assert not dist.is_initialized() and not any(tmp_path.iterdir())


def test_data_parallel_devices():
    with pytest.raises(ValueError, match="data-parallel training runs on cpu or cuda, not mps"):
        train.check_data_parallel_device("mps", 2)
    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"{n} ranks per machine on cuda need one CUDA device "
                                         f"each; this machine has {n - 1}"):
        train.check_data_parallel_device("cuda", n)
    train.check_data_parallel_device("cpu", 64)


def test_rank_sampler_seed_keeps_rank_0_and_separates_ranks():
    data = bytes(range(256)) * 64
    windows = {}
    for seed, rank in ((7, 0), (7, 1), (8, 0), (7, 2)):
        s = WindowSampler(data, seed=train.rank_sampler_seed(seed, rank), batch_size=4,
                          context=16)
        windows[seed, rank] = s.offsets()
    plain = WindowSampler(data, seed=7, batch_size=4, context=16).offsets()
    assert np.array_equal(windows[7, 0], plain)  # rank 0 draws the one-process windows
    assert len({w.tobytes() for w in windows.values()}) == 4
    # one-to-one over the seed range TrainConfig allows: the largest seed of rank 0 and the
    # smallest of rank 1 give different generator seeds
    top = 2**63 - 100_001
    assert train.rank_sampler_seed(top, 0) + 100_000 < train.rank_sampler_seed(0, 1) + 100_000
    with pytest.raises(ValueError, match="seed and rank must be >= 0"):
        train.rank_sampler_seed(0, -1)


@pytest.mark.e2e
def test_one_rank_under_torchrun_variables_runs_in_a_process_group(tmp_path):
    """RANK, WORLD_SIZE, ... set by hand (one rank, no launcher): a gloo group of one, DDP-wrapped
    arms and a result that says so. A subprocess: DDP keeps its process group (and gloo's
    threads) alive after destroy_process_group, which this test process should not inherit."""
    env = _clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    code, out, err = _run(_cli("train", "--model", "tiny", "--steps", "2", "--val-bytes",
                               "2048", "--out", str(tmp_path), "--json"), env)
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ranks_agree"] is True and result["identical_final_hash"] is True
    assert result["data_parallel"]["world_size"] == 1
    assert result["data_parallel"]["backend"] == "gloo"
    assert "same final model SHA-256 on all 1 ranks (gloo): yes" in out


def test_process_group_is_destroyed_after_an_error(monkeypatch):
    threads = torch.get_num_threads()
    _one_rank_env(monkeypatch)
    try:
        with (pytest.raises(RuntimeError, match="inside the group"),
              train.process_group(train.launcher_env(), "cpu") as dp):
            assert dist.is_initialized() and dp.world_size == 1 and dp.rank == 0
            raise RuntimeError("inside the group")
        assert not dist.is_initialized()
    finally:
        torch.set_num_threads(threads)


def test_ranks_that_disagree_fail_the_comparison(monkeypatch):
    """`_compare_ranks` with a second rank (faked gather) whose cotangent hash differs."""
    dp = train.DataParallel(rank=0, world_size=2, local_rank=0, local_world_size=2,
                            backend="gloo", threads=1, threads_from="cores // local ranks")

    def gather(out, obj):
        out[0] = obj
        out[1] = {**obj, "cotangent": "0" * 64}

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    result = {"native": {"final_model_sha256": "a" * 64},
              "cotangent": {"final_model_sha256": "a" * 64}}
    train._compare_ranks(result, ("native", "cotangent"), dp)
    assert result["ranks_agree"] is False
    assert result["native"]["data_parallel"]["ranks_agree"] is True
    assert result["cotangent"]["data_parallel"]["ranks_agree"] is False
    assert result["cotangent"]["data_parallel"]["rank_final_model_sha256"] == ["a" * 64,
                                                                              "0" * 64]
    assert json.loads(train.result_json({
        **result, "arms": ["native", "cotangent"], "identical_final_hash": True,
        **{arm: {**result[arm], "update_ms": 1.0, "step_ms": 2.0, "val_bpb": 3.0,
                 "test_bpb": 3.0, "run_dir": "r/" + arm} for arm in ("native", "cotangent")},
    }))["ranks_agree"] is False


def test_zero1_arm_without_data_parallelism_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["train", "--model", "tiny", "--steps", "1", "--out", str(tmp_path),
                     "--arms", "native,cotangent-zero1"])
    assert code == 2
    assert "run it data-parallel (--nproc N or torchrun)" in capsys.readouterr().err
