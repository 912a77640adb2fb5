"""Data-parallel `cotangent train`: `--nproc N` (torch's elastic launcher) and torchrun.

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
from cotangent.harness.data import BITS_PER_NAT, WindowSampler, embedded_corpus, load_wikitext2
from cotangent.harness.model import build_model

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

    monkeypatch.setattr(train.dist, "all_gather_object", gather)
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
