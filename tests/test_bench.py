"""`cotangent bench` runs end to end and reports every required field (speed is not asserted:
benchmarks are measured, not tested)."""

from __future__ import annotations

import json

import pytest

from cotangent.harness import cli

REQUIRED = {"shape", "params", "tensors", "native_impl", "native_ms", "cotangent_ms", "ratio",
            "floor10_ms", "bitwise", "extra_persistent_bytes", "native_alloc_bytes",
            "cotangent_alloc_bytes", "native_largest_alloc_bytes", "cotangent_largest_alloc_bytes"}


@pytest.mark.e2e
def test_bench_rows_are_bitwise_and_complete(capsys):
    code = cli.main(["bench", "--shapes", "many-small", "--impls", "default,foreach,fused",
                     "--repeats", "2", "--warmup", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0
    assert len(result["rows"]) == 3
    for row in result["rows"]:
        assert REQUIRED <= row.keys()
        assert row["bitwise"] is True
        assert row["tensors"] == 146 and row["params"] == 644_817
        assert row["native_ms"] > 0 and row["cotangent_ms"] > 0 and row["floor10_ms"] > 0
        assert row["extra_persistent_bytes"] <= 0  # no more allocator blocks than native
    assert any(t["target"] == "bitwise" for t in result["targets"])
    assert result["pass_ms_per_element"] > 0


def test_bench_rejects_unknown_shapes_and_lists_the_valid_ones(capsys):
    from cotangent.harness.bench import IMPLS, SHAPES

    assert cli.main(["bench", "--shapes", "many-small,foo"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "unknown shape(s) foo" in err and "many-small," not in err.split("valid:")[0]
    assert all(shape in err.split("valid:")[1] for shape in SHAPES)
    assert cli.main(["bench", "--impls", "fast"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown implementation(s) fast" in err
    assert all(impl in err.split("valid:")[1] for impl in IMPLS)


@pytest.mark.e2e
def test_distributed_bench_runs_four_arms_bitwise_on_two_ranks(capsys):
    code = cli.main(["bench", "--distributed", "2", "--shapes", "many-small", "--repeats", "2",
                     "--warmup", "1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["world"] == 2
    (row,) = result["rows"]
    assert row["bitwise"] is True and row["native_impl"] == "fused"
    assert row["params"] == 644_817 and row["repeats"] == 2
    for arm in ("native-ddp", "cotangent-ddp", "native-zero", "cotangent-zero1"):
        assert row[f"{arm}_ms"] > 0
    state = row["state_bytes_per_rank"]
    native = 2 * 4 * 644_817 + 146 * 4  # exp_avg, exp_avg_sq (fp32) and fp32 step counts
    assert state["native-ddp"] == [native, native]
    # ZeRO-1: each rank holds one share (plus 64-byte padding and its step buffer), together
    # about one native copy, neither more than 60% of it
    assert all(b < 0.6 * native for b in state["cotangent-zero1"])
    assert native <= sum(state["cotangent-zero1"]) <= 1.05 * native


def test_distributed_bench_rejects_bad_rank_counts(capsys):
    assert cli.main(["bench", "--distributed", "0", "--shapes", "many-small"]) == 2
    err = capsys.readouterr().err.strip()
    assert "at least 1 rank" in err and "Traceback" not in err
