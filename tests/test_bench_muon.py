"""`cotangent bench --muon` (harness/bench_muon.py) at tiny sizes: every row bitwise and complete,
the table formats, and the byte comparison catches one arm perturbed by one ULP (after the run,
and inside the packed arm's step). Speed is measured, not tested."""

from __future__ import annotations

import json

import pytest
import torch

import cotangent.muon_adamw
from cotangent.harness import bench_muon
from cotangent.harness.bench_muon import (
    format_muon_table,
    muon_bench_header,
    muon_bench_ok,
    muon_result_json,
    run_muon_bench,
)

TINY_SETS = {"3x16x32": [(3, 16, 32)], "mix": [(2, 24, 8), (2, 8, 8), (1, 8, 24)]}
TINY = dict(repeats=2, warmup=1, batch_size=2, seq_len=16, log=lambda line: None)


def _run(**kw):
    return run_muon_bench(("recurrent-mini",), TINY_SETS, **{**TINY, **kw})


def test_rows_are_bitwise_timed_and_formatted():
    result = _run()
    (row,) = result["muon_adamw_rows"]
    assert row["model"] == "recurrent-mini" and row["compile"] is False
    assert (row["params"], row["tensors"]) == (425_984, 34)
    assert sorted(map(tuple, row["muon_groups"])) == [
        (8, 64, 64), (8, 64, 256), (8, 192, 64), (8, 256, 64)]
    assert row["batch"] == [2, 16] and row["repeats"] == 2
    for arm in ("reference", "packed"):
        for phase in ("zero_grad", "forward", "backward", "step", "update"):
            assert row[f"{arm}_{phase}_ms"] > 0
    assert row["stack_copy_ms"] > 0 and row["ratio"] > 0
    assert row["zero_accum_ms"] == pytest.approx(
        row["packed_zero_grad_backward_ms"] - row["reference_zero_grad_backward_ms"])
    assert row["net_ms"] == pytest.approx(
        row["packed_zero_grad_backward_step_ms"] - row["reference_zero_grad_backward_step_ms"])
    assert isinstance(row["zero_accum_paired_ms"], float)
    assert isinstance(row["net_paired_ms"], float)
    assert row["bitwise"] is True and row["difference"] is None
    # gradient and parameter of 34 tensors, AdamW state of 2 (step, exp_avg, exp_avg_sq),
    # Muon state on the first member of each of 4 groups (two buffers)
    assert row["tensors_compared"] == 2 * 34 + 3 * 2 + 2 * 4

    assert [r["matrices"] for r in result["muon_rows"]] == list(TINY_SETS)
    for r in result["muon_rows"]:
        assert r["bitwise"] is True and r["difference"] is None
        assert r["torch_step_ms"] > 0 and r["cotangent_step_ms"] > 0 and r["ratio"] > 0
        assert r["batches"] == len(TINY_SETS[r["matrices"]]) and 0 <= r["batched"] <= r["batches"]
        assert r["tensors"] == sum(n for n, _, _ in TINY_SETS[r["matrices"]])
    mix = result["muon_rows"][1]
    assert mix["params"] == 2 * 24 * 8 + 2 * 8 * 8 + 8 * 24

    assert muon_bench_ok(result)
    table = result["table"]
    assert table == format_muon_table(result)
    assert table.startswith(f"machine: {result['environment']['cpu_model']}")
    assert result["wall_s"] > 0 and "CPUs busy during the run" in table.splitlines()[0]
    if result["host_cpus"] is not None:  # /proc/stat readable (Linux)
        assert isinstance(result["others_cpus"], float)
    assert "recurrent-mini" in table and "3x16x32" in table and "mix" in table
    assert table.count(" yes") == 3 and "NO" not in table and "first difference" not in table
    decoded = json.loads(muon_result_json(result))
    assert "table" not in decoded and decoded["muon_adamw_rows"][0]["bitwise"] is True
    assert decoded["environment"]["torch"] == torch.__version__
    assert decoded["environment"]["threads"] == torch.get_num_threads()


def _one_ulp_up(t: torch.Tensor) -> None:
    with torch.no_grad():
        flat = t.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))


def test_one_arm_nudged_after_the_run_is_reported_not_bitwise(monkeypatch):
    compare = bench_muon.compare_arms

    def nudged(names, params_a, opt_a, params_b, opt_b):
        _one_ulp_up(params_b[-1])  # the second arm's last parameter, +1 ULP in one element
        return compare(names, params_a, opt_a, params_b, opt_b)

    monkeypatch.setattr(bench_muon, "compare_arms", nudged)
    result = _run()
    rows = result["muon_adamw_rows"] + result["muon_rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["bitwise"] is False
        assert r["difference"].startswith("parameter ") and "(1 ULP)" in r["difference"]
        assert "1 of " in r["difference"]
    assert result["table"].count(" NO") == 3 and result["table"].count("first difference") == 3
    assert not muon_bench_ok(result)


def test_packed_arm_perturbed_inside_its_step_is_reported_not_bitwise(monkeypatch):
    step = cotangent.muon_adamw.muon_step

    def perturbed(grads, params, *args):
        step(grads, params, *args)
        if not args[-1]:  # blend_in_place False: the packed path only
            _one_ulp_up(params)

    monkeypatch.setattr(cotangent.muon_adamw, "muon_step", perturbed)
    result = run_muon_bench(("recurrent-mini",), {}, **TINY)
    (row,) = result["muon_adamw_rows"]
    assert result["muon_rows"] == []
    assert row["bitwise"] is False and "ULP" in row["difference"]


def test_header_names_the_settings():
    line = muon_bench_header(("recurrent-mini",), TINY_SETS, 2, 1, compile=True)
    assert "1 model(s) (eager + compiled)" in line and "2 matrix set(s)" in line
    assert "2 repeats (+1 warm-up)" in line


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown matrix set.*foo.*valid: 8x384x384"):
        run_muon_bench((), ("foo",))
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_muon_bench((), (), repeats=0)


@pytest.mark.e2e
def test_compiled_rows_are_bitwise():
    result = run_muon_bench(("recurrent-mini",), {}, compile=True, **TINY)
    eager, compiled = result["muon_adamw_rows"]
    assert (eager["compile"], compiled["compile"]) == (False, True)
    assert compiled["bitwise"] is True and compiled["packed_update_ms"] > 0
    assert "compiled" in result["table"]


def test_cli_bench_muon(capsys):
    from cotangent.harness import cli

    assert cli.main(["bench", "--muon", "--shapes", "4x64x256", "--repeats", "2",
                     "--warmup", "0", "--json"]) == 0
    out = capsys.readouterr().out
    assert "4x64x256" in out and '"bitwise": true' in out
    assert cli.main(["bench", "--muon", "--shapes", "nope"]) == 2
    assert "valid with --muon" in capsys.readouterr().err
    assert cli.main(["bench", "--compile"]) == 2
    assert "--compile applies to --muon only" in capsys.readouterr().err
