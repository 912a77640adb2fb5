"""End-to-end `cotangent train` on the tiny model: both arms must end bit-identical."""

from __future__ import annotations

import json
import os

import pytest

from cotangent.harness import cli
from cotangent.harness.train import lr_factor, warmup_steps


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


@pytest.mark.parametrize("model", ["tiny-transformer", "tiny-gated-gqa", "tiny-causal-conv"])
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
    assert "unknown arm" in capsys.readouterr().err
