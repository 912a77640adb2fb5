"""Data-parallel `cotangent train`: the launcher's environment, the process group, each rank's
windows, the ranks' hashes compared."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist



# Set by torchrun (and torch.distributed's elastic launcher) in every rank it starts.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT")


BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # device type -> process group backend


SAMPLER_SEED_FORMULA = "numpy.random.default_rng(seed + 100000 + rank * 2**63)"


def rank_sampler_seed(seed: int, rank: int) -> int:
    """The `seed` given to rank `rank`'s `WindowSampler`: `seed + rank * 2**63`.

    The sampler draws from `numpy.random.default_rng(seed + 100000 + rank * 2**63)`
    (`SAMPLER_SEED_FORMULA`). Rank 0, and a run without data parallelism, draws exactly the
    windows of a one-process run of the same seed. The map (seed, rank) -> generator seed is
    one-to-one because `TrainConfig` bounds seed + 100000 below 2**63.

    Raises:
        ValueError: a negative seed or rank.
    """
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be >= 0, got seed {seed}, rank {rank}")
    return seed + rank * 2**63


@dataclass(frozen=True, kw_only=True, slots=True)
class DataParallel:
    """This process's place in a data-parallel run (an initialised default process group)."""

    rank: int  # global rank, 0 .. world_size - 1
    world_size: int  # ranks in the run
    local_rank: int  # rank on this machine (the CUDA device index on cuda)
    local_world_size: int  # ranks on this machine; torchrun gives ranks 0 .. this - 1 to rank 0's
    backend: str  # gloo (cpu) or nccl (cuda)
    threads: int  # torch intra-op threads of each rank
    threads_from: str  # "OMP_NUM_THREADS" (set by the user or torchrun) or "cores // local ranks"

    @property
    def on_rank0_host(self) -> bool:
        """Whether this rank shares rank 0's machine (torchrun numbers ranks node by node)."""
        return self.rank < self.local_world_size

    def record(self) -> dict:
        """The metadata.json entry `data_parallel`."""
        return {"world_size": self.world_size, "backend": self.backend,
                "local_world_size": self.local_world_size, "threads_per_rank": self.threads,
                "threads_from": self.threads_from, "sampler_seed": SAMPLER_SEED_FORMULA,
                "model": "torch.nn.parallel.DistributedDataParallel per arm (defaults: "
                         "gradient_as_bucket_view=False, broadcast_buffers=True), the optimizer "
                         "over the unwrapped model's parameters",
                "loss_bpb": "mean over ranks of each rank's batch loss",
                "timing": "rank 0's clock; cpu_s: the CPU seconds of every rank on rank 0's "
                          "machine",
                "evaluation": "windows split into world_size contiguous parts, NLL sums "
                              "gathered and added in rank order"}


SINGLE_PROCESS_RECORD = {"world_size": 1, "backend": None, "sampler_seed": SAMPLER_SEED_FORMULA}


def launcher_env(environ: Mapping[str, str] = os.environ) -> dict[str, int | str] | None:
    """The rank variables torchrun sets (`LAUNCHER_ENV`), or None when none of them is set.

    Returns:
        {RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE: int, MASTER_ADDR: str, MASTER_PORT: int}.

    Raises:
        ValueError: some but not all of them are set, one is not an integer where one is
            needed, or the ranks are out of range (RANK not below WORLD_SIZE, ...).
    """
    present = [k for k in LAUNCHER_ENV if k in environ]
    if not present:
        return None
    missing = [k for k in LAUNCHER_ENV if k not in environ]
    if missing:
        raise ValueError(f"incomplete torchrun environment: {', '.join(present)} set but not "
                         f"{', '.join(missing)}; start data-parallel runs with torchrun or "
                         "--nproc, or unset these variables")
    env: dict[str, int | str] = {"MASTER_ADDR": environ["MASTER_ADDR"]}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        try:
            env[key] = int(environ[key])
        except ValueError:
            raise ValueError(f"environment variable {key} must be an integer, got "
                             f"{environ[key]!r}") from None
    if not (0 <= env["RANK"] < env["WORLD_SIZE"]
            and 0 <= env["LOCAL_RANK"] < env["LOCAL_WORLD_SIZE"] <= env["WORLD_SIZE"]):
        raise ValueError("torchrun environment out of range: RANK {RANK}, WORLD_SIZE "
                         "{WORLD_SIZE}, LOCAL_RANK {LOCAL_RANK}, LOCAL_WORLD_SIZE "
                         "{LOCAL_WORLD_SIZE}".format(**env))
    return env


def check_data_parallel_device(device_type: str, local_ranks: int) -> None:
    """Raise ValueError unless `local_ranks` data-parallel ranks per machine can train on
    `device_type`: cpu (gloo), or cuda (nccl, one CUDA device per rank)."""
    if device_type not in BACKENDS:
        raise ValueError(f"data-parallel training runs on {' or '.join(BACKENDS)}, not "
                         f"{device_type}")
    if device_type == "cuda" and torch.cuda.device_count() < local_ranks:
        raise ValueError(f"{local_ranks} ranks per machine on cuda need one CUDA device each; "
                         f"this machine has {torch.cuda.device_count()}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def process_group(env: dict | None, device_type: str) -> Iterator[DataParallel | None]:
    """Join the data-parallel run described by `env` (`launcher_env`) for the block, or yield
    None when `env` is None (one process, nothing changed).

    Before joining: torch's intra-op threads become max(1, cores // LOCAL_WORLD_SIZE) (cores:
    this process's CPU affinity set) unless OMP_NUM_THREADS is set (torchrun sets it to 1 when
    unset and it starts more than one process per machine; `cotangent train --nproc` does
    not); on cuda the current device becomes cuda:LOCAL_RANK. The default process group
    (gloo on cpu, nccl on cuda, rendezvous through MASTER_ADDR:MASTER_PORT) is destroyed when
    the block ends, also on an error.

    Raises:
        ValueError: a device type without a backend here, or too few CUDA devices.
    """
    if env is None:
        yield None
        return
    check_data_parallel_device(device_type, env["LOCAL_WORLD_SIZE"])
    if "OMP_NUM_THREADS" in os.environ:
        threads_from = "OMP_NUM_THREADS"
    else:
        torch.set_num_threads(max(1, _cores() // env["LOCAL_WORLD_SIZE"]))
        threads_from = "cores // local ranks"
    backend = BACKENDS[device_type]
    if device_type == "cuda":
        torch.cuda.set_device(env["LOCAL_RANK"])
    dist.init_process_group(backend, rank=env["RANK"], world_size=env["WORLD_SIZE"])
    try:
        yield DataParallel(rank=env["RANK"], world_size=env["WORLD_SIZE"],
                           local_rank=env["LOCAL_RANK"],
                           local_world_size=env["LOCAL_WORLD_SIZE"], backend=backend,
                           threads=torch.get_num_threads(), threads_from=threads_from)
    finally:
        dist.destroy_process_group()


def _compare_ranks(result: dict, arms: tuple[str, ...], dp: DataParallel) -> None:
    """Gather every rank's final model hashes (collective); add each arm summary's
    `data_parallel` entry and the result's `ranks_agree` and `data_parallel`."""
    mine = {name: result[name]["final_model_sha256"] for name in arms}
    every: list = [None] * dp.world_size
    dist.all_gather_object(every, mine)
    agree = all(other == mine for other in every)
    for name in arms:
        hashes = [other[name] for other in every]
        result[name]["data_parallel"] = {
            "world_size": dp.world_size, "backend": dp.backend,
            "rank_final_model_sha256": hashes, "ranks_agree": len(set(hashes)) == 1,
            "timed_rank": 0, "busy_rule_threads": dp.threads * dp.local_world_size}
    result["ranks_agree"] = agree
    result["data_parallel"] = {"world_size": dp.world_size, "backend": dp.backend,
                               "threads_per_rank": dp.threads}


def _across_ranks(dp: DataParallel | None, loss: float, cpu_s: float) -> tuple[float, float]:
    """(loss, cpu_s) unchanged in one process; data parallel (collective, one float64
    all_reduce, outside the timed region): (mean loss over ranks, the CPU seconds summed over
    the ranks on rank 0's machine)."""
    if dp is None:
        return loss, cpu_s
    device = torch.device("cuda", dp.local_rank) if dp.backend == "nccl" else torch.device("cpu")
    both = torch.tensor([loss, cpu_s if dp.on_rank0_host else 0.0], dtype=torch.float64,
                        device=device)
    dist.all_reduce(both)
    total_loss, host_cpu_s = both.tolist()
    return total_loss / dp.world_size, host_cpu_s


def end_rank_process(code: int) -> None:
    """End this data-parallel rank's process with exit status `code`, skipping the
    interpreter's teardown (`os._exit` after flushing logging, stdout and stderr).

    Why: `DistributedDataParallel`'s reducer keeps the gloo process group alive after
    `destroy_process_group` (torch 2.13 here), so its worker threads outlive the Python code. A
    worker that releases the tensors of a finished collective while the interpreter shuts down
    needs the GIL and aborts the process (SIGABRT, "terminate called without an active
    exception"): seen in about 1 of 20 two-rank runs on a busy 2-core machine, always after the
    run's records were complete. Records are written atomically and the calibration cache
    synchronously, so nothing is lost by skipping the teardown.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
