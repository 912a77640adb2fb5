"""cotangent bench: the AdamW update-phase benchmark and the Muon rows, at tiny sizes.

`cotangent bench`: both gradient methods run, are bitwise and say which one ran; the default
is the training loop's (real forward + backward); every required field is reported (speed is
not asserted: benchmarks are measured, not tested).

`cotangent bench --muon` (harness/bench_muon.py) at tiny sizes: every Muon row bitwise and
complete, the table formats, and the byte comparison catches one arm perturbed by one ULP (after
the run, and inside cotangent.Muon's step). Speed is measured, not tested.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import weakref

import cotangent
import pytest
import torch
from cotangent.harness import bench, bench_muon, cli
from cotangent.harness.bench_muon import (
    format_muon_table, muon_bench_header, muon_bench_ok, muon_result_json, run_muon_bench,
)
from cotangent.harness.packed import PackedAdamW


pytest.importorskip("numpy", reason="the bench is part of the harness: pip install "
                                    "'cotangent[harness]'")


REQUIRED = {"shape", "params", "tensors", "native_impl", "method", "native_ms", "cotangent_ms",
            "ratio", "native_step_ms", "cotangent_step_ms", "step_ratio", "native_zero_grad_ms",
            "cotangent_zero_grad_ms", "native_backward_ms", "cotangent_backward_ms",
            "native_loop_ms", "cotangent_loop_ms", "loop_ratio", "floor10_ms", "pass_ms",
            "bitwise",
            "extra_persistent_bytes", "native_alloc_bytes", "cotangent_alloc_bytes",
            "native_largest_alloc_bytes", "cotangent_largest_alloc_bytes", "batch_size",
            "seq_len", "others_cpus", "busy"}


PASS_MS = 1e-7  # a made-up pass cost: the floor is not what these tests look at


def _row(method: str, impl: str = "fused", shape: str = "tiny-transformer", **kw) -> bench.Row:
    return bench.bench_row(shape, impl, pass_ms=PASS_MS, repeats=2, warmup=1, method=method,
                           **kw)


def test_each_row_times_its_own_pass_cost_in_its_interleaving(monkeypatch):
    """Without a given pass cost a row times one large add before each repeat's arms and takes
    the median of the timed repeats (the floor describes the minutes the row ran in)."""
    costs = iter([5e-7, 1e-6, 2e-6, 4e-6])  # one warm-up, then three timed repeats
    calls, real_probe = [], bench.pass_probe

    def fake_probe(elements=bench.PASS_ELEMENTS, device="cpu"):
        calls.append(elements)
        return lambda: next(costs)

    monkeypatch.setattr(bench, "pass_probe", fake_probe)
    row = bench.bench_row("tiny-transformer", "fused", repeats=3, warmup=1)
    assert calls == [bench.PASS_ELEMENTS]
    assert row.pass_ms == 2e-6  # the median of the timed repeats, not the warm-up
    assert row.floor10_ms == 10 * row.params * 2e-6
    assert row.cotangent_over_floor == row.cotangent_ms / row.floor10_ms
    real = real_probe(elements=1 << 16)()
    assert 0 < real < 1e-3  # ms per element per pass


def test_the_default_method_is_the_training_loops_real_backward():
    import inspect

    assert bench.METHODS == ("real-backward", "synthetic-grads")
    for fn in (bench.bench_row, bench.run_bench):
        assert inspect.signature(fn).parameters["method"].default == "real-backward"


@pytest.mark.parametrize("impl", ["default", "fused"])
@pytest.mark.parametrize("method", bench.METHODS)
def test_both_methods_run_bitwise_and_record_the_method(method, impl):
    row = _row(method, impl)
    assert row.method == method and row.bitwise is True
    assert REQUIRED <= row.__dict__.keys()
    if method == "real-backward":  # 1 sequence of min(64, context 32) tokens
        assert (row.batch_size, row.seq_len) == (1, 32)
    else:
        assert (row.batch_size, row.seq_len) == (None, None)
    for field in ("native_ms", "cotangent_ms", "native_step_ms", "cotangent_step_ms",
                  "native_zero_grad_ms", "cotangent_zero_grad_ms", "native_backward_ms",
                  "cotangent_backward_ms", "native_loop_ms", "cotangent_loop_ms"):
        assert getattr(row, field) > 0, field
    # zero_grad is inside the update phase: the median update is not below the median step
    # alone by more than timer noise could explain
    assert row.native_ms >= 0.5 * row.native_step_ms
    assert row.native_loop_ms >= row.native_ms and row.cotangent_loop_ms >= row.cotangent_ms


@pytest.mark.slow
@pytest.mark.slow
def test_real_backward_on_many_small_and_a_larger_batch_is_bitwise():
    row = _row("real-backward", "default", "many-small", batch_size=2, seq_len=8)
    assert row.bitwise is True and row.tensors == 146 and (row.batch_size, row.seq_len) == (2, 8)


@pytest.mark.parametrize("method", bench.METHODS)
def test_the_rows_byte_check_sees_another_learning_rate(method, monkeypatch):
    """Control: the row's bitwise flag is computed, not assumed. A Cotangent arm with another
    learning rate must be reported as not bitwise by either method."""
    real_adamw = cotangent.AdamW

    def other_lr(params, **kw):
        return real_adamw(params, **{**kw, "lr": kw["lr"] * 2})

    monkeypatch.setattr(cotangent, "AdamW", other_lr)
    assert _row(method).bitwise is False


@pytest.mark.slow
@pytest.mark.slow
def test_every_row_times_the_single_pass_and_the_path_before_it(monkeypatch):
    """For-loop, foreach and fused rows carry a third arm, Cotangent with COTANGENT_SINGLE_PASS=0, in
    the same interleaving and the same byte checks; each row names the path its arms took
    (the single pass wherever the kernel is available here, else native's op sequence)."""
    from cotangent import singlepass

    monkeypatch.delenv(singlepass.ENV_SWITCH, raising=False)
    expected = "single-pass" if singlepass.unavailable_reason() is None else "native"
    rows = []
    for impl in bench.OFF_ARM_IMPLS:
        row = _row("real-backward", impl)
        assert row.bitwise is True and row.cotangent_path == expected, row.cotangent_path_notes
        assert row.cotangent_off_path == "native"  # switched off: native's op sequence ran
        assert row.cotangent_off_ms > 0 and row.off_ratio == row.cotangent_off_ms / row.native_ms
        rows.append(row)
    assert singlepass.ENV_SWITCH not in os.environ  # restored after every off step
    assert tuple(r.native_impl for r in rows) == bench.OFF_ARM_IMPLS
    table = bench.format_table(rows, PASS_MS, single_pass=singlepass.process_report())
    assert f"  {expected:<12}" in table and "single pass: " in table


def test_the_byte_check_covers_the_single_pass_off_arm(monkeypatch):
    """Control: only the third arm (the second cotangent.AdamW a row builds) steps with another
    learning rate: the row must say not bitwise."""
    real_adamw, built = cotangent.AdamW, []

    def second_other_lr(params, **kw):
        built.append(1)
        return real_adamw(params, **{**kw, "lr": kw["lr"] * (2 if len(built) == 2 else 1)})

    monkeypatch.setattr(cotangent, "AdamW", second_other_lr)
    # (the third build is the memory measurement's, on a copy of its own)
    assert _row("real-backward", "default").bitwise is False and len(built) == 3


def test_the_byte_check_covers_the_packed_arm(monkeypatch):
    """Control: the PackedAdamW arm (the design before issue 26) stepping with another learning
    rate makes the row not bitwise."""
    real = PackedAdamW

    def other_lr(params, **kw):
        return real(params, **{**kw, "lr": kw["lr"] * 2})

    monkeypatch.setattr(bench, "PackedAdamW", other_lr)
    assert _row("real-backward", "fused").bitwise is False


def test_forward_end_bytes_see_a_buffer_an_optimizer_keeps():
    """The memory row's measure: an optimizer that keeps one extra 1 MiB tensor alive through the
    forward reads 1 MiB more at the end of the forward than native's."""
    model = bench.bench_model("tiny-transformer")
    batches = bench.bench_batches(model, 3, batch_size=1, seq_len=16)
    kept = []

    def native(params):
        return torch.optim.AdamW(params, fused=True)

    def hoarding(params):
        kept.append(torch.empty(1 << 18))  # allocated inside the profiled region
        return torch.optim.AdamW(params, fused=True)

    base = bench.forward_end_bytes(copy.deepcopy(model), native, lambda o: o.step(), batches)
    more = bench.forward_end_bytes(copy.deepcopy(model), hoarding, lambda o: o.step(), batches)
    assert [b - a for a, b in zip(base, more)] == [1 << 20] * 3


def test_real_backward_gives_both_arms_fresh_gradients_freed_by_zero_grad():
    """The mechanism of a real loop: native's backward hands AccumulateGrad new gradient tensors
    after every zero_grad(set_to_none=True), and so does Cotangent's (it reads them where they
    are: no buffer of its own); zero_grad frees them in both arms."""
    model = bench.bench_model("tiny-transformer")
    ours_model = bench.bench_model("tiny-transformer")
    native = torch.optim.AdamW(model.parameters(), **bench.BENCH_ADAMW_ARGS, fused=True)
    ours = cotangent.AdamW(ours_model.parameters(), max_norm=1.0, **bench.BENCH_ADAMW_ARGS,
                           fused=True)
    batches = bench.bench_batches(model, 3, batch_size=1, seq_len=16)
    refs = {"native": [], "ours": []}
    for batch in batches:
        for name, m, opt in (("native", model, native), ("ours", ours_model, ours)):
            bench.bench_loss(m, batch).backward()
            if opt is native:
                torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
            opt.step()
            refs[name].append([weakref.ref(p.grad) for p in m.parameters()])
            opt.zero_grad()
            assert all(p.grad is None for p in m.parameters())
    for name, steps in refs.items():
        assert all(r() is None for step in steps for r in step), name  # freed by zero_grad


def test_rows_on_a_busy_machine_are_marked(monkeypatch):
    """The harness's busy rule: (other CPUs + torch threads) / CPUs > 1.1."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert bench._busy(0.0, 2) is False and bench._busy(0.1, 2) is False
    assert bench._busy(0.5, 2) is True and bench._busy(None, 2) is None
    row = _row("synthetic-grads")
    row.busy = False
    quiet = bench.format_table([row], PASS_MS, "synthetic-grads")
    row.busy, row.others_cpus = True, 0.93
    table = bench.format_table([row], PASS_MS, "synthetic-grads")
    assert "warning: 1 of 1 rows ran on a busy machine" in table and "0.93*" in table
    assert "warning" not in quiet and table.startswith("method: synthetic-grads")


def test_bench_functions_refuse_bad_methods_and_batches():
    with pytest.raises(ValueError, match="unknown method 'fake'.*real-backward"):
        bench.run_bench(["tiny-transformer"], ["fused"], method="fake")
    with pytest.raises(ValueError, match="batch_size and seq_len must be >= 1"):
        bench.run_bench(["tiny-transformer"], ["fused"], batch_size=0)
    with pytest.raises(ValueError, match="unknown method"):
        _row("fake")


def test_cli_method_options_are_checked(capsys):
    for argv, text in (
            (["bench", "--muon", "--method", "synthetic-grads"], "plain bench only"),
            (["bench", "--distributed", "2", "--seq-len", "8"], "plain bench only"),
            (["bench", "--method", "synthetic-grads", "--batch-size", "4"],
             "--method real-backward only")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert text in err and "Traceback" not in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):  # argparse: not a method
        cli.main(["bench", "--method", "fake"])
    capsys.readouterr()


@pytest.mark.e2e
def test_bench_rows_are_bitwise_and_complete(capsys):
    code = cli.main(["bench", "--shapes", "many-small", "--impls", "default,foreach,fused",
                     "--repeats", "2", "--warmup", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0
    assert result["method"] == "real-backward"  # the default
    assert (result["batch_size"], result["seq_len"]) == (bench.BATCH_SIZE, bench.SEQ_LEN)
    assert any(line.startswith("method: real-backward") for line in out)
    assert "loadavg_start" in result and "others_cpus" in result
    assert len(result["rows"]) == 3
    for row in result["rows"]:
        assert REQUIRED <= row.keys()
        assert row["bitwise"] is True and row["method"] == "real-backward"
        assert row["tensors"] == 146 and row["params"] == 644_817
        assert row["native_ms"] > 0 and row["cotangent_ms"] > 0 and row["floor10_ms"] > 0
        assert row["extra_persistent_bytes"] <= 0  # no more allocator blocks than native
        # each row's floor from its own pass cost, timed in its interleaving
        assert row["pass_ms"] > 0 and row["floor10_ms"] == 10 * row["params"] * row["pass_ms"]
    assert any(t["target"] == "bitwise" for t in result["targets"])
    assert result["pass_ms_per_element"] == statistics.median(
        row["pass_ms"] for row in result["rows"])


@pytest.mark.e2e
def test_bench_synthetic_grads_method_is_recorded(capsys):
    code = cli.main(["bench", "--shapes", "many-small", "--impls", "fused", "--method",
                     "synthetic-grads", "--repeats", "2", "--warmup", "1", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert code == 0 and result["method"] == "synthetic-grads"
    assert (result["batch_size"], result["seq_len"]) == (None, None)
    assert any(line.startswith("method: synthetic-grads") for line in out)
    (row,) = result["rows"]
    assert row["bitwise"] is True and row["method"] == "synthetic-grads"


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
    assert cli.main(["bench", "--fsdp2", "--shapes", "many-small"]) == 2
    assert "--fsdp2 needs --distributed N" in capsys.readouterr().err


@pytest.mark.e2e
def test_fsdp2_bench_runs_both_arms_bitwise_on_two_ranks(capsys):
    """`bench --distributed 2 --fsdp2`: native and Cotangent on fully_shard copies of
    many-small (25 units), real backward, bitwise, Cotangent's update by the single pass."""
    code = cli.main(["bench", "--distributed", "2", "--fsdp2", "--shapes", "many-small",
                     "--impls", "foreach", "--repeats", "2", "--warmup", "1", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["world"] == 2 and "FSDP2" in out
    (row,) = result["rows"]
    assert row["fsdp2"] and row["bitwise"] is True and row["native_impl"] == "foreach"
    assert row["params"] == 644_817 and row["repeats"] == 2 and row["path"] == "single-pass"
    for key in ("native_update_ms", "cotangent_update_ms", "native_loop_ms",
                "cotangent_loop_ms"):
        assert row[key] > 0
    assert row["update_ratio"] == row["cotangent_update_ms"] / row["native_update_ms"]


def test_the_single_pass_line_says_what_happened(monkeypatch):
    """The run's one line on the kernel: switched off by the environment, not asked for (only
    fused rows), unavailable with the reason, or built / loaded with its probes."""
    from cotangent import singlepass

    built = dict(unavailable_reason=None, probes=1, probe_s=0.05, square_root="emulated",
                 sqrt_check_s=1.9,
                 build=dict(key="abc", cached=False, compile_s=1.5, compiler="c++", flags=[]))
    monkeypatch.setenv(singlepass.ENV_SWITCH, "0")
    assert bench.single_pass_line(built).startswith("single pass: switched off (")
    monkeypatch.delenv(singlepass.ENV_SWITCH)
    assert "1 probe in 0.05 s" in bench.single_pass_line(built)
    assert "built in 1.50 s by c++" in bench.single_pass_line(built)
    assert "square root: emulated (checked against torch.sqrt in 1.90 s)" in (
        bench.single_pass_line(built))
    assert "square root: mkl (one-off" in bench.single_pass_line(
        dict(built, square_root="mkl", sqrt_check_s=0.0))
    cached = dict(built, probes=2, build=dict(built["build"], cached=True, compile_s=0.0))
    assert "loaded from the kernel cache" in bench.single_pass_line(cached)
    assert "2 probes" in bench.single_pass_line(cached)
    assert "not asked for" in bench.single_pass_line(dict(built, unavailable_reason="not checked"))
    assert "unavailable (no C++ compiler)" in bench.single_pass_line(
        dict(built, unavailable_reason="no C++ compiler", build=None))


def test_the_single_pass_line_says_how_the_lists_were_read():
    """The list reader's one-off cost (built, loaded) or why the lists were checked in Python."""
    base = dict(unavailable_reason=None, probes=0, probe_s=0.0, square_root="hardware",
                sqrt_check_s=0.0,
                build=dict(key="abc", cached=True, compile_s=0.0, compiler="c++", flags=[]))
    line = bench.single_pass_line
    assert "list reader" not in line(dict(base, list_reader=None))
    assert "list reader: built in 16.00 s" in line(dict(base, list_reader=dict(
        available=True, cached=False, compile_s=16.0, why_not=None)))
    assert "list reader: loaded from the kernel cache" in line(dict(base, list_reader=dict(
        available=True, cached=True, compile_s=0.0, why_not=None)))
    assert "list reader: unavailable (no Python headers), lists checked in Python" in line(
        dict(base, list_reader=dict(available=False, cached=None, compile_s=0.0,
                                    why_not="no Python headers")))


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
