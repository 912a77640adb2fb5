"""The records of a `cotangent train` run: run directories, metadata, curves (JSONL and
TensorBoard), the printed comparison."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from cotangent.harness import contention, records
from cotangent.harness.data import Corpus
from cotangent.harness.packed import PackedAdamW
from cotangent.harness.train import arm_setup, config, distributed, loop


def _count(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters, tensors) of `model`."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


def canonical_sha256(model: torch.nn.Module) -> str | None:
    """A recurrent model's `canonical_state()` hashed as `records.model_sha256` hashes a state
    dict (the same for every sharing variant of one seed at init); None for other models."""
    if not hasattr(model, "canonical_state"):
        return None
    return records.state_sha256(model.canonical_state())


def _finish_records(run: loop._Run, curves: _Curves, result: dict) -> None:
    """Each arm's curve.jsonl and summary.json, then the removal of its INCOMPLETE marker."""
    for name in run.cfg.arms:
        curves.finish(name)
        records.write_json(run.root / name / "summary.json", result[name])
        (run.root / name / "INCOMPLETE").unlink()  # only now is the run complete


def _start_records(run: loop._Run, arms: dict[str, arm_setup.Arm], corpus: Corpus, env: dict,
                   precision: str, config_toml: str | None) -> None:
    """Create each arm's run directory (never an existing one) with its INCOMPLETE marker,
    metadata.json and config.toml. A recurrent model's metadata adds
    `init_canonical_sha256` (`canonical_sha256`: equal for every arm of one seed, whatever the
    sharing); a study arm's adds `study` (`Arm.study_record`) and has no `native_path`."""
    cfg = run.cfg
    dp = run.data_parallel
    for name, arm in arms.items():
        run_dir = run.root / name
        run_dir.mkdir(parents=True, exist_ok=False)  # never reuse or overwrite a run
        records.write_atomic(run_dir / "INCOMPLETE", "this run has not finished\n")
        n_params, n_tensors = _count(arm.model)
        meta = {
            "arm": name,
            "config": asdict(cfg),
            "precision": precision,
            "seed": cfg.seed,
            "environment": env,
            "device_name": _device_name(run.device),
            "data": corpus.manifest(),
            "native_path": None if name in config.STUDY_ARMS else config.NATIVE_PATH,
            "parameters": n_params,
            "tensors": n_tensors,
            "init_model_sha256": arm.init_sha256,
            "schedule_sha256": config.schedule_sha256(cfg, name),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "command": sys.argv,
            "data_parallel": distributed.SINGLE_PROCESS_RECORD if dp is None else dp.record(),
        }
        if isinstance(arm.optimizer, PackedAdamW):
            meta["layout"] = arm.optimizer.layout_summary()
            meta["buckets"] = sum(layout["buckets"] for layout in meta["layout"])
        canonical = canonical_sha256(arm.model)
        if canonical is not None:
            meta["init_canonical_sha256"] = canonical
        if name in config.STUDY_ARMS:
            meta["study"] = arm.study_record()
        records.write_json(run_dir / "metadata.json", meta)
        if config_toml is not None:
            records.write_atomic(run_dir / "config.toml", config_toml + "\n")


TENSORBOARD_EXTRA = "pip install 'cotangent[tensorboard]'"


# Curve-row keys that are not TensorBoard scalars: `step` is the global step, `probe` the
# probe's index; non-numbers (autograd_order: true, false or null) are left out too.
TENSORBOARD_SKIP = ("step", "probe")


def tensorboard_writer_class() -> type:
    """`torch.utils.tensorboard.SummaryWriter`, imported now.

    Raises:
        ValueError: one line naming the `tensorboard` extra when the tensorboard package is
            not installed (or too old for torch).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        why = (f"{exc.name} is not installed" if isinstance(exc, ModuleNotFoundError)
               and exc.name else str(exc).splitlines()[0])
        raise ValueError(f"--tensorboard needs the tensorboard extra ({why}): "
                         f"{TENSORBOARD_EXTRA}") from None
    return SummaryWriter


class TensorBoardCurves:
    """Curve rows as TensorBoard scalars: one `SummaryWriter` (event file) per arm, in
    `root/<arm>`.

    Each row's numbers (int or float, not bool) become scalars whose tag is the curve key
    itself, with its unit (`loss_bpb`: bits per byte, `lr`, `grad_norm`, `step_s`, `update_s`,
    `cpu_s`, `host_cpu_s`, `host_steal_s` in seconds; probes: `probe_bpb`, `training_s`,
    `elapsed_s`; study arms: the `OCCURRENCE_KEYS` numbers), at global_step = the row's `step`
    (a step row: the update's 0-based index; a probe row: the updates done). TensorBoard
    stores float32 (`simple_value`): each scalar is float32(the curve value), rounded to
    nearest. Written as the rows come, so the event files match curve.partial.jsonl (a run
    that drops its partial host columns from curve.jsonl keeps them here). Never read back.
    """

    def __init__(self, root: Path, names: tuple[str, ...], writer_class: type) -> None:
        self.root = Path(root)
        self.writers = {name: writer_class(log_dir=str(self.root / name), flush_secs=10)
                        for name in names}

    def add(self, name: str, row: dict) -> None:
        """Write the numbers of arm `name`'s curve row `row` at global_step `row["step"]`."""
        writer = self.writers[name]
        for key, value in row.items():
            if (key in TENSORBOARD_SKIP or isinstance(value, bool)
                    or not isinstance(value, (int, float))):
                continue
            writer.add_scalar(key, value, global_step=row["step"])

    def close(self) -> None:
        """Flush and close every arm's event file (each one, even if another fails)."""
        errors = []
        for writer in self.writers.values():
            try:
                writer.close()
            except Exception as exc:  # close the others first
                errors.append(exc)
        if errors:
            raise errors[0]


class _Curves:
    """Each arm's curve rows (steps and probes) in memory and, one flushed line each, in its
    run directory's curve.partial.jsonl, so a killed run keeps its curve; `finish` replaces
    that file by curve.jsonl, written atomically. With `write` False (a data-parallel rank
    other than 0) the rows stay in memory only. With `tensorboard`, each row is also given to
    it as it is written (`TensorBoardCurves.add`)."""

    def __init__(self, root: Path, names: tuple[str, ...], *, write: bool = True,
                 tensorboard: TensorBoardCurves | None = None) -> None:
        self.root = root
        self.tensorboard = tensorboard
        self.rows: dict[str, list[dict]] = {name: [] for name in names}
        self.probes: dict[str, list[dict]] = {name: [] for name in names}
        self.trained_s = {name: 0.0 for name in names}  # sum of the arm's step_s so far
        self._partial = {name: open(root / name / "curve.partial.jsonl", "a", encoding="utf-8")
                         for name in names} if write else None

    def add(self, name: str, row: dict) -> None:
        """Record one row of arm `name` (a step row has step_s, a probe row probe_bpb)."""
        if "probe_bpb" in row:
            self.probes[name].append(row)
        else:
            self.trained_s[name] += row["step_s"]
        self.rows[name].append(row)
        if self._partial is not None:
            self._partial[name].write(json.dumps(row, sort_keys=True) + "\n")
            self._partial[name].flush()
        if self.tensorboard is not None:
            self.tensorboard.add(name, row)

    def finish(self, name: str) -> None:
        """Write arm `name`'s curve.jsonl and remove its curve.partial.jsonl (`write` only)."""
        run_dir = self.root / name
        self._partial[name].close()
        records.write_jsonl(run_dir / "curve.jsonl", self.rows[name])
        (run_dir / "curve.partial.jsonl").unlink()


def progress_line(done: int, steps: int, elapsed_s: float, rows: dict[str, list[dict]]) -> str:
    """One plain progress line: steps done, seconds of the training loop so far and the
    estimated seconds left, each arm's median step time (ms) over the `rows` since the last
    line, and how many CPUs other work kept busy meanwhile (when measured)."""
    eta = elapsed_s / done * (steps - done)
    parts = [f"step {done}/{steps} ({100 * done / steps:.0f}%), {elapsed_s:.1f} s, "
             f"ETA {eta:.0f} s"]
    medians = [f"{name} {1e3 * statistics.median(r['step_s'] for r in arm_rows):.1f}"
               for name, arm_rows in rows.items() if arm_rows]
    if medians:
        parts.append("median step ms " + ", ".join(medians))
    flat = [r for arm_rows in rows.values() for r in arm_rows]
    wall = sum(r["step_s"] for r in flat)
    if flat and wall > 0 and all("host_cpu_s" in r for r in flat):
        others = (sum(r["host_cpu_s"] for r in flat) - sum(r["cpu_s"] for r in flat)) / wall
        parts.append(f"other work {others:.2f} CPUs")
    return "progress: " + "; ".join(parts)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine()


def format_comparison(result: dict) -> str:
    """Human-readable comparison table of `run_train`'s result (a data-parallel run adds
    whether every rank ended with the same hashes). Only the bitwise arms are compared by
    hash; the study arms are listed as such, the replicated-core ones with their largest
    sync_error and relative_norm_mismatch."""
    arms = result["arms"]
    lines = [f"{'arm':<19} {'update_ms':>10} {'step_ms':>9} {'val_bpb':>8} {'test_bpb':>8}  "
             "final_model_sha256"]
    for name in arms:
        r = result[name]
        lines.append(f"{name:<19} {r['update_ms']:>10.2f} {r['step_ms']:>9.1f} "
                     f"{r['val_bpb']:>8.4f} {r['test_bpb']:>8.4f}  {r['final_model_sha256']}")
    base = result[arms[0]]
    study = [name for name in arms if name in config.STUDY_ARMS]
    bitwise = [name for name in arms if name not in config.STUDY_ARMS]
    if len(arms) == 1:
        lines.append("one arm: no comparison")
    elif len(bitwise) > 1:
        which = f" ({', '.join(bitwise)})" if study else ""
        lines.append(f"identical final model SHA-256{which}: "
                     f"{'yes' if result['identical_final_hash'] else 'NO'}")
    if study:
        lines.append(f"study arms {', '.join(study)}: final hashes recorded, not required to "
                     "agree (an occurrence-aggregation study, not a bitwise family)")
    for name in study:
        r = result[name]
        if "max_sync_error" in r:
            lines.append(f"{name}: replicas in sync after every step (max sync_error "
                         f"{r['max_sync_error']!r}), max relative_norm_mismatch "
                         f"{r['max_relative_norm_mismatch']:.3g}")
    dp = result.get("data_parallel")
    if dp is not None:
        lines.append(f"same final model SHA-256 on all {dp['world_size']} ranks "
                     f"({dp['backend']}): {'yes' if result['ranks_agree'] else 'NO'}; "
                     "the times are rank 0's")
    for name in arms[1:]:
        r = result[name]
        lines.append(f"{name} / {arms[0]} (medians per step): update phase "
                     f"{r['update_ms'] / base['update_ms']:.3f}, whole step "
                     f"{r['step_ms'] / base['step_ms']:.3f}")
    for name in arms:
        r = result[name]
        for reason in contention.reasons({**r, "median_step_s": r["step_ms"] / 1e3},
                                         r["host_cpus"]):
            lines.append(f"WARNING: {name}: {reason}; its times may not reflect the code")
    lines.append(f"records: {Path(base['run_dir']).parent}")
    return "\n".join(lines)


def result_json(result: dict) -> str:
    """One-line JSON of the comparison (the last line of `cotangent train --json`); a
    data-parallel run adds `ranks_agree` and `data_parallel` (world_size, backend,
    threads_per_rank); study arms add `study_arms` and, replicated-core ones,
    `max_sync_error` and `max_relative_norm_mismatch` in their entries."""
    keys = ("update_ms", "step_ms", "val_bpb", "test_bpb", "final_model_sha256", "run_dir",
            "max_sync_error", "max_relative_norm_mismatch")
    obj = {"identical_final_hash": result["identical_final_hash"]}
    obj.update({name: {k: result[name][k] for k in keys if k in result[name]}
                for name in result["arms"]})
    if result.get("study_arms"):
        obj["study_arms"] = result["study_arms"]
    if "data_parallel" in result:
        obj["ranks_agree"] = result["ranks_agree"]
        obj["data_parallel"] = result["data_parallel"]
    return json.dumps(obj, sort_keys=True)
