"""Logging people expect from the harness: `--tensorboard DIR` (every curve row also as
TensorBoard scalars, equal to the curve.jsonl values in float32, closed on every exit path) and
progress bars only on a terminal.

The TensorBoard tests need the tensorboard package (`pip install 'cotangent[tensorboard]'`) and
skip without it; the missing-package message and the progress-bar tests run everywhere."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cotangent.harness import campaign, cli, train
from corpora import synthetic_corpus
from cotangent.harness.train import run_train, train_config

# The small --data-dir corpus is not WikiText-2; the harness says so in a warning.
pytestmark = pytest.mark.filterwarnings("ignore:.*is not a known WikiText-2:UserWarning")
needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="tensorboard is not installed: pip install 'cotangent[tensorboard]'")

EXTRA_LINE = "pip install 'cotangent[tensorboard]'"
# Keys of a tiny bitwise run's curve rows that must be TensorBoard tags (host_* where measured).
STEP_TAGS = {"loss_bpb", "lr", "grad_norm", "step_s", "update_s", "cpu_s"}
PROBE_TAGS = {"probe_bpb", "training_s", "elapsed_s"}
TINY = ["--model", "tiny", "--val-bytes", "512", "--set", "probe_bytes=512",
        "--set", "eval_batch=16"]


@pytest.fixture
def data(tmp_path) -> list[str]:
    """`--data-dir` of a small corpus (`_corpus` as train.txt, valid.txt, test.txt): the
    embedded corpus takes seconds to read in a fresh process."""
    path = tmp_path / "data"
    path.mkdir()
    for split, text in synthetic_corpus().splits.items():
        (path / f"{split}.txt").write_bytes(text)
    return ["--data-dir", str(path)]


def _tb_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    """{(tag, step): value} of every scalar event under `run_dir` (one value per pair)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep them all
    acc.Reload()
    out: dict[tuple[str, int], float] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            assert (tag, event.step) not in out, f"{tag} written twice at step {event.step}"
            out[(tag, event.step)] = event.value
    return out


def _curve_scalars(rows: list[dict]) -> dict[tuple[str, int], float]:
    """{(key, row step): value} of the numbers in curve rows (`step` and `probe` are not
    metrics; booleans and null are not numbers)."""
    out = {}
    for row in rows:
        for key, value in row.items():
            if key in ("step", "probe") or isinstance(value, bool) or value is None:
                continue
            assert isinstance(value, (int, float)), (key, value)
            out[(key, row["step"])] = value
    return out


def _f32_bytes(value: float) -> bytes:
    return np.float32(value).tobytes()


def _assert_tb_equals_curve(tb_dir: Path, rows: list[dict]) -> dict:
    """Every curve number is in the event files at its step as float32(value), byte for byte,
    and the event files hold nothing else; returns the scalars read back."""
    tb = _tb_scalars(tb_dir)
    curve = _curve_scalars(rows)
    assert tb.keys() == curve.keys()
    wrong = [(key, tb[key], curve[key]) for key in curve
             if _f32_bytes(tb[key]) != _f32_bytes(curve[key])]
    assert not wrong, wrong[:5]
    return tb


@pytest.fixture
def closes(monkeypatch) -> list[list[str]]:
    """The arms of every `TensorBoardCurves.close` call, in order (the real close runs).
    Reading the event files back cannot show a missing close in one process (the writer's
    thread has already written the events), so the calls are counted."""
    calls: list[list[str]] = []
    real_close = train.TensorBoardCurves.close

    def spy_close(self):
        calls.append(sorted(self.writers))
        real_close(self)

    monkeypatch.setattr(train.TensorBoardCurves, "close", spy_close)
    return calls


def _read_curve(run_dir: Path, name: str = "curve.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


@needs_tensorboard
@pytest.mark.e2e
def test_tensorboard_scalars_are_the_curve_values_in_float32(tmp_path, data, closes,
                                                             capsys):
    out, tb_root = tmp_path / "runs", tmp_path / "tb"
    assert cli.main(["train", *TINY, *data, "--steps", "5", "--eval-every", "2", "--out", str(out),
                     "--tensorboard", str(tb_root), "--json"]) == 0
    assert closes == [["cotangent", "native"]]  # once, at the end of the training loop
    stdout = capsys.readouterr().out
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["identical_final_hash"] is True
    (run_root,) = out.iterdir()
    assert f"tensorboard: {tb_root / run_root.name}" in stdout
    # one TensorBoard run per arm, named like the run directories
    assert sorted(p.relative_to(tb_root).as_posix() for p in tb_root.glob("*/*")) == [
        f"{run_root.name}/cotangent", f"{run_root.name}/native"]
    for arm in ("native", "cotangent"):
        rows = _read_curve(run_root / arm)
        assert sum("loss_bpb" in r for r in rows) == 5 and sum("probe_bpb" in r for r in rows) == 2
        tb = _assert_tb_equals_curve(tb_root / run_root.name / arm, rows)
        tags = {tag for tag, _ in tb}
        assert STEP_TAGS | PROBE_TAGS <= tags
        assert {step for tag, step in tb if tag == "loss_bpb"} == {0, 1, 2, 3, 4}
        assert {step for tag, step in tb if tag == "probe_bpb"} == {2, 4}  # updates done
        # Controls: the byte comparison sees a one-step shift, and TensorBoard holds float32,
        # not the float64 of the record (most values are not float32 numbers).
        losses = [r["loss_bpb"] for r in rows if "loss_bpb" in r]
        assert any(_f32_bytes(tb[("loss_bpb", s)]) != _f32_bytes(losses[s + 1])
                   for s in range(4))
        curve = _curve_scalars(rows)
        assert sum(tb[key] != curve[key] for key in curve) > len(curve) // 2


@needs_tensorboard
@pytest.mark.e2e
def test_study_arm_diagnostics_are_scalars_and_booleans_are_left_out(tmp_path):
    cfg = train_config(model="recurrent-mini", steps=2, batch_size=2, val_bytes=1024,
                      eval_batch=16, out=str(tmp_path / "runs"), arms=("P",))
    result = run_train(cfg, synthetic_corpus(), log=lambda *a: None, tensorboard=tmp_path / "tb")
    run_dir = Path(result["P"]["run_dir"])
    rows = _read_curve(run_dir)
    assert all(isinstance(r["autograd_order"], bool) for r in rows)
    tb = _assert_tb_equals_curve(tmp_path / "tb" / run_dir.parent.name / "P", rows)
    tags = {tag for tag, _ in tb}
    numbers = {k for k in train.OCCURRENCE_KEYS if isinstance(rows[0][k], float)}
    assert {"pooled_norm", "target_norm", "realized_norm", "sync_error"} <= numbers <= tags
    assert "autograd_order" not in tags and "step" not in tags


@needs_tensorboard
@pytest.mark.e2e
@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_event_files_are_closed_when_the_run_stops(tmp_path, monkeypatch, closes, stop):
    """Ctrl-C or an error in the second step: the event files hold every row written before
    it (curve.partial.jsonl), because the writers are closed on the way out."""
    real_step = train._train_step
    calls = []

    def stopping_step(run, arm, sampler, step, host):
        if step == 1:
            raise stop("stop here")
        calls.append(arm)
        return real_step(run, arm, sampler, step, host)

    monkeypatch.setattr(train.loop, "_train_step", stopping_step)
    cfg = train_config(model="tiny", steps=4, val_bytes=512, eval_batch=16,
                      out=str(tmp_path / "runs"))
    with pytest.raises(stop):
        run_train(cfg, synthetic_corpus(), log=lambda *a: None, tensorboard=tmp_path / "tb")
    assert closes == [["cotangent", "native"]] and len(calls) == 2
    (run_root,) = (tmp_path / "runs").iterdir()
    for arm in ("native", "cotangent"):
        assert (run_root / arm / "INCOMPLETE").exists()
        rows = _read_curve(run_root / arm, "curve.partial.jsonl")
        assert [r["step"] for r in rows] == [0]
        tb = _assert_tb_equals_curve(tmp_path / "tb" / run_root.name / arm, rows)
        assert STEP_TAGS <= {tag for tag, _ in tb}


@needs_tensorboard
@pytest.mark.e2e
def test_ctrl_c_through_the_command_keeps_the_event_files(tmp_path, data, monkeypatch,
                                                          closes, capsys):
    real_step = train._train_step

    def interrupted(run, arm, sampler, step, host):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(run, arm, sampler, step, host)

    monkeypatch.setattr(train.loop, "_train_step", interrupted)
    assert cli.main(["train", *TINY, *data, "--steps", "4", "--out", str(tmp_path / "runs"),
                     "--tensorboard", str(tmp_path / "tb")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert closes == [["cotangent", "native"]]
    (run_root,) = (tmp_path / "runs").iterdir()
    for arm in ("native", "cotangent"):
        rows = _read_curve(run_root / arm, "curve.partial.jsonl")
        assert [r["step"] for r in rows] == [0, 1]
        _assert_tb_equals_curve(tmp_path / "tb" / run_root.name / arm, rows)


@needs_tensorboard
@pytest.mark.e2e
def test_campaign_jobs_write_tensorboard_runs(tmp_path, data, monkeypatch):
    protocol = tmp_path / "protocol.toml"
    protocol.write_text('name = "tb"\nmodels = ["tiny-transformer"]\n'
                        'arms = ["native", "cotangent"]\nseeds = [0, 1]\nsteps = 3\n'
                        'eval_every = 3\ntarget_bpb = 7.9\nlevel = 0.9\nmargin_bpb = 0.01\n'
                        'design = "ab-ba"\nshuffle_seed = 3\nbootstrap_resamples = 10\n'
                        "[train]\nval_bytes = 512\neval_batch = 16\n")
    camp = campaign.freeze(str(protocol), str(tmp_path / "c"), data[1], log=lambda *_: None)
    monkeypatch.chdir(tmp_path)  # a relative DIR is the runner's, not the job's
    counts = campaign.run_campaign(camp, max_jobs=1, log=lambda *_: None, tensorboard="tb")
    assert counts["done"] == 1 and counts["failed"] == 0
    (job,) = [j for j in json.loads((camp / "freeze.json").read_text())["jobs"]
              if (camp / "jobs" / j["id"]).exists()]
    status = json.loads((camp / "jobs" / job["id"] / "attempt-1" / "status.json").read_text())
    assert status["command"][-2:] == ["--tensorboard", str(tmp_path / "tb")]
    run_dir = camp / status["run_dir"]
    assert run_dir.name == job["arm"]
    _assert_tb_equals_curve(tmp_path / "tb" / run_dir.parent.name / job["arm"],
                            _read_curve(run_dir))
    # the job's stdout and stderr went to a file: plain progress lines, no bar characters
    log = (camp / "jobs" / job["id"] / "attempt-1" / "log.txt").read_text()
    assert "progress: step 3/3 (100%)" in log and _no_bar_characters(log), log


@pytest.mark.slow
def test_missing_tensorboard_is_one_line_exit_2_and_nothing_written(tmp_path, data):
    """Without the tensorboard package (simulated by blocking it): exit status 2, one line
    naming the extra, no traceback, no run directory and no TensorBoard directory."""
    out, tb = tmp_path / "runs", tmp_path / "tb"
    code = ("import sys; sys.modules['tensorboard'] = None; "
            "from cotangent.harness.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "train", *TINY, *data, "--steps", "2",
                           "--out", str(out), "--tensorboard", str(tb)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stderr.splitlines() == [
        "cotangent: error: --tensorboard needs the tensorboard extra (tensorboard is not "
        f"installed): {EXTRA_LINE}"]
    assert proc.stdout == "" and not out.exists() and not tb.exists()


def test_missing_tensorboard_stops_a_campaign_before_any_job(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    # checked before the campaign directory is even read
    assert cli.main(["campaign", "run", str(tmp_path / "c"), "--tensorboard",
                     str(tmp_path / "tb")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(f": {EXTRA_LINE}\n")
    assert err.startswith("cotangent: error: --tensorboard needs the tensorboard extra")
    with pytest.raises(ValueError, match="needs the tensorboard extra"):
        campaign.run_campaign(tmp_path / "c", tensorboard=str(tmp_path / "tb"))
    assert not (tmp_path / "tb").exists()


@needs_tensorboard
def test_tensorboard_dir_that_is_a_file_is_refused(tmp_path, data, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    assert cli.main(["train", *TINY, *data, "--steps", "1", "--out", str(tmp_path / "runs"),
                     "--tensorboard", str(path)]) == 2
    assert f"--tensorboard {path} exists and is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_train_help_describes_tensorboard(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--tensorboard DIR" in text and EXTRA_LINE in text
    assert "DIR/<run directory name>/<arm>" in text


# ---------------------------------------------------------------- progress bars

class _Stream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _has_bar(text: str) -> bool:
    return "steps:" in text and "%|" in text and "\r" in text


def _no_bar_characters(text: str) -> bool:
    return not any(mark in text for mark in ("\r", "steps:", "%|", "█", "step/s", "s/step"))


def test_bar_detection_controls():
    assert _has_bar("\rsteps:  50%|█████     | 1/2 [00:00<00:00, 3.1step/s]")
    assert not _no_bar_characters("\rsteps:  50%|")
    assert _no_bar_characters("progress: step 2/2 (100%), 0.1 s, ETA 0 s\n")


@pytest.mark.e2e
@pytest.mark.parametrize("tty", [False, True])
def test_run_train_draws_a_bar_only_on_a_terminal_stderr(tmp_path, monkeypatch, tty):
    """`run_train`'s default (show_progress None): tqdm's disable=None decides by stderr."""
    err = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", err)
    cfg = train_config(model="tiny", steps=2, val_bytes=512, eval_batch=16, arms=("native",),
                      out=str(tmp_path))
    run_train(cfg, synthetic_corpus(), log=lambda *a: None)
    assert _has_bar(err.getvalue()) if tty else err.getvalue() == ""


@pytest.mark.e2e
@pytest.mark.parametrize("stdout_tty, stderr_tty", [(True, True), (True, False), (False, True)])
def test_cotangent_train_bar_needs_terminals(tmp_path, data, monkeypatch, stdout_tty,
                                            stderr_tty):
    """The command draws its bar only when stderr (and stdout) are terminals; otherwise
    stderr gets no bar characters at all (without a terminal stdout: plain lines there)."""
    out, err = _Stream(stdout_tty), _Stream(stderr_tty)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert cli.main(["train", *TINY, *data, "--steps", "2", "--arms", "native",
                     "--out", str(tmp_path)]) == 0
    if stdout_tty and stderr_tty:
        assert _has_bar(err.getvalue())
    else:
        assert _no_bar_characters(err.getvalue()), err.getvalue()
    assert ("progress: step 2/2" in out.getvalue()) == (not stdout_tty)

