"""Command-line truths: `calibrate` lists the model's own verdicts, help texts match behaviour."""

from __future__ import annotations

import json

import pytest

from cotangent import calibration
from cotangent.norms import bucket_norm_is_exact
from cotangent.harness import cli


def _calibrate(model: str, capsys) -> tuple[list[str], list[dict]]:
    assert cli.main(["calibrate", "--model", model, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.mark.e2e
def test_calibrate_lists_only_the_verdicts_of_that_models_layout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    # A verdict some other model left in the cache file (a length no tiny model has).
    foreign = calibration.full_key("bucket_norm", "cpu", ("torch.float32", 123457, 3, 2.0),
                                   probe=bucket_norm_is_exact)
    calibration.record(foreign, True)
    assert foreign in {cli.calibration_key(r) for r in calibration.table()}

    lines, rows = _calibrate("tiny-transformer", capsys)
    keys = {cli.calibration_key(r) for r in rows}
    assert rows and foreign not in keys
    assert not any("123457" in line for line in lines)
    assert f"{len(rows)} verdicts used by tiny-transformer" in "\n".join(lines)
    every = {cli.calibration_key(r) for r in calibration.table()}
    assert keys < every  # a strict subset: the cache holds more than this model uses

    _, conv_rows = _calibrate("tiny-causal-conv", capsys)
    conv_keys = {cli.calibration_key(r) for r in conv_rows}
    assert conv_keys and foreign not in conv_keys
    # cotangent.AdamW packs nothing: its verdicts follow the settings, not the model's layout
    assert conv_keys == keys
    # run again from the cache: the same verdicts, none dropped, none added
    _, again = _calibrate("tiny-transformer", capsys)
    assert {cli.calibration_key(r) for r in again} == keys


@pytest.mark.e2e
def test_calibrate_restores_the_calibration_functions(capsys):
    lookup, record = calibration.lookup, calibration.record
    _calibrate("tiny", capsys)
    assert (calibration.lookup, calibration.record) == (lookup, record)


def test_report_help_counts_the_figures_it_writes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "five PNG figures," not in text
    assert "four PNG figures (five when the campaign ran the four arms of the 2x2 factorial)" \
        in text


def test_bench_help_names_the_shapes(capsys):
    from cotangent.harness.bench import SHAPES

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(shape in text for shape in SHAPES)


@pytest.mark.slow
@pytest.mark.slow
def test_command_without_the_harness_extra_names_it_in_one_line():
    """A core-only install (`pip install cotangent`): the `cotangent` command's entry point
    says which extra to install (exit 2, no traceback). Simulated by blocking numpy."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['numpy'] = None; "
            "from cotangent._entry import main; sys.exit(main(['train']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1] == (
        "cotangent: the command needs the harness extra (numpy is not installed): "
        "pip install 'cotangent[harness]'")
    assert "Traceback" not in out.stderr
