"""`cotangent bench --muon` (harness/bench_muon.py) at tiny sizes: every Muon row bitwise and
complete, the table formats, and the byte comparison catches one arm perturbed by one ULP (after
the run, and inside cotangent.Muon's step). Speed is measured, not tested."""

from __future__ import annotations

import json

import pytest
import torch

import cotangent
from cotangent.harness import bench_muon
from cotangent.harness.bench_muon import (
    format_muon_table,
    muon_bench_header,
    muon_bench_ok,
    muon_result_json,
    run_muon_bench,
)

# "mix": one matrix of (8, 24) alone in its shape, so in no batch
# every side >= 16: cotangent.Muon batches no smaller matrix (bmm's small-matrix kernel)
TINY_SETS = {"3x16x32": [(3, 16, 32)], "mix": [(2, 24, 16), (2, 16, 16), (1, 16, 24)]}
TINY = dict(repeats=2, warmup=1, log=lambda line: None)


def _run(sets=TINY_SETS, **kw):
    return run_muon_bench(sets, **{**TINY, **kw})


def test_rows_are_bitwise_timed_and_formatted():
    logged = []
    result = _run(log=logged.append)
    assert "muon_adamw_rows" not in result
    assert [r["matrices"] for r in result["muon_rows"]] == list(TINY_SETS)
    assert len(logged) == 2 and "3x16x32" in logged[0] and "mix" in logged[1]
    for r in result["muon_rows"]:
        assert r["kind"] == "muon" and r["repeats"] == 2 and r["warmup"] == 1
        assert r["bitwise"] is True and r["difference"] is None
        for arm in ("torch", "cotangent"):
            for phase in ("step", "zero_grad", "backward"):
                assert r[f"{arm}_{phase}_ms"] > 0
        assert r["ratio"] == pytest.approx(r["cotangent_step_ms"] / r["torch_step_ms"])
        assert r["tensors"] == sum(n for n, _, _ in TINY_SETS[r["matrices"]])
        # only batches of two or more equal-shape matrices are listed
        assert r["batches"] == sum(1 for n, _, _ in TINY_SETS[r["matrices"]] if n >= 2)
        assert r["batches"] == len(r["batch_summary"])
        assert 0 <= r["batched"] <= r["batches"]
        assert all(b["matrices"] >= 2 for b in r["batch_summary"])
        # gradient and parameter of every matrix, momentum buffer of every matrix
        assert r["tensors_compared"] == 3 * r["tensors"]
    three, mix = result["muon_rows"]
    assert three["spec"] == [[3, 16, 32]] and three["params"] == 3 * 16 * 32
    assert mix["params"] == 2 * 24 * 16 + 2 * 16 * 16 + 16 * 24
    assert sorted(b["shape"] for b in mix["batch_summary"]) == [[16, 16], [24, 16]]

    assert muon_bench_ok(result)
    table = result["table"]
    assert table == format_muon_table(result)
    assert table.startswith(f"machine: {result['environment']['cpu_model']}")
    assert result["wall_s"] > 0 and "CPUs busy during the run" in table.splitlines()[0]
    if result["host_cpus"] is not None:  # /proc/stat readable (Linux)
        assert isinstance(result["others_cpus"], float)
    assert "MuonAdamW" not in table and "packed" not in table
    assert "(of all batches: two or more equal-shape matrices of a group)" in table
    assert "3x16x32" in table and "mix" in table and f"{mix['batched']}/2 " in table
    assert table.count(" yes") == 2 and "NO" not in table and "first difference" not in table
    decoded = json.loads(muon_result_json(result))
    assert "table" not in decoded and "muon_adamw_rows" not in decoded
    assert [r["bitwise"] for r in decoded["muon_rows"]] == [True, True]
    assert decoded["environment"]["torch"] == torch.__version__
    assert decoded["environment"]["threads"] == torch.get_num_threads()


def test_muon_repeats_sets_the_timed_steps():
    (row,) = _run({"3x16x32": TINY_SETS["3x16x32"]}, muon_repeats=3)["muon_rows"]
    assert row["repeats"] == 3 and row["bitwise"] is True


def _one_ulp_up(t: torch.Tensor) -> None:
    with torch.no_grad():
        flat = t.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


def test_one_arm_nudged_after_the_run_is_reported_not_bitwise(monkeypatch):
    compare = bench_muon.compare_arms

    def nudged(names, params_a, opt_a, params_b, opt_b):
        _one_ulp_up(params_b[-1])  # the cotangent arm's last matrix, +1 ULP in one element
        return compare(names, params_a, opt_a, params_b, opt_b)

    monkeypatch.setattr(bench_muon, "compare_arms", nudged)
    result = _run()
    rows = result["muon_rows"]
    assert len(rows) == 2
    for r in rows:
        assert r["bitwise"] is False
        assert r["difference"].startswith("parameter ") and "(1 ULP)" in r["difference"]
        assert "1 of " in r["difference"]
    assert result["table"].count(" NO") == 2 and result["table"].count("first difference") == 2
    assert "first difference (mix): parameter" in result["table"]
    assert not muon_bench_ok(result)


def test_cotangent_arm_perturbed_inside_its_step_is_reported_not_bitwise(monkeypatch):
    step = cotangent.Muon.step
    calls = []

    def perturbed(self, *args, **kw):
        out = step(self, *args, **kw)
        calls.append(self)
        if len(calls) == 3:  # the last step (1 warm-up + 2 timed) of the only row
            _one_ulp_up(self.param_groups[0]["params"][0])
        return out

    monkeypatch.setattr(cotangent.Muon, "step", perturbed)
    result = _run({"3x16x32": TINY_SETS["3x16x32"]})
    (row,) = result["muon_rows"]
    assert len(calls) == 3 and all(isinstance(o, cotangent.Muon) for o in calls)
    assert row["bitwise"] is False and "(1 ULP)" in row["difference"]
    assert row["difference"].startswith("parameter ")
    assert not muon_bench_ok(result)


def test_header_names_the_settings():
    line = muon_bench_header(TINY_SETS, 2, 1)
    assert line.startswith("Muon benchmark on cpu: cotangent.Muon vs torch.optim.Muon")
    assert "2 matrix set(s)" in line and "2 repeats (+1 warm-up)" in line
    assert "MuonAdamW" not in line and "model" not in line


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown matrix set.*foo.*valid: 8x384x384"):
        run_muon_bench(("foo",))
    with pytest.raises(ValueError, match="unknown matrix set.*recurrent-mini"):
        run_muon_bench(("recurrent-mini",))  # the former MuonAdamW rows' model
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_muon_bench((), repeats=0)
    with pytest.raises(ValueError, match="repeats must be >= 1 and warmup >= 0"):
        run_muon_bench((), warmup=-1)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_muon_bench((), muon_repeats=0)
    with pytest.raises(TypeError):
        run_muon_bench((), compile=True)  # the MuonAdamW rows' keyword is gone


def test_cli_bench_muon(capsys):
    from cotangent.harness import cli

    assert cli.main(["bench", "--muon", "--shapes", "4x64x256", "--repeats", "2",
                     "--warmup", "0", "--json"]) == 0
    out = capsys.readouterr().out
    assert "1 matrix set(s), 2 repeats (+0 warm-up)" in out
    assert "4x64x256" in out and '"bitwise": true' in out
    doc = json.loads(out.strip().splitlines()[-1])
    assert [r["matrices"] for r in doc["muon_rows"]] == ["4x64x256"]
    assert "muon_adamw_rows" not in doc
    for bad in ("nope", "recurrent-mini"):
        assert cli.main(["bench", "--muon", "--shapes", bad]) == 2
        err = capsys.readouterr().err
        assert f"unknown shape(s) {bad}" in err
        assert f"valid with --muon: {', '.join(bench_muon.MATRIX_SETS)}" in err
    with pytest.raises(SystemExit) as exc:  # bench has no --compile any more
        cli.main(["bench", "--muon", "--compile"])
    assert exc.value.code == 2 and "unrecognized arguments: --compile" in capsys.readouterr().err


def test_cli_help_names_the_matrix_sets_and_no_muon_adamw(capsys, monkeypatch):
    from cotangent.harness import cli

    monkeypatch.setenv("COLUMNS", "1000")  # no line breaks inside a set's name
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "cotangent.Muon vs torch.optim.Muon" in text
    assert ", ".join(bench_muon.MATRIX_SETS) in text
    assert "MuonAdamW" not in text and "--compile" not in text
