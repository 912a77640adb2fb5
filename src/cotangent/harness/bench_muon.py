"""`cotangent bench --muon`: the Muon optimizer's update phase, measured as in a training loop.

Muon rows (`cotangent.Muon` against `torch.optim.Muon`, same arguments; torch's is a for-loop
optimizer) on sets of equal-shape matrices. The two arms of a row live in one process, start
from the same initial weights, see the same batches and alternate step by step (the order flips
every step). Every step of an arm is ``zero_grad()``, forward, backward, ``step()``, each timed
on its own (`time.perf_counter`); medians over the steps after the warm-up ones. Each step's
gradients come from a real backward of ``sum_i mean((tanh(W_i @ X_i) - Y_i)^2)`` with fresh
X_i, Y_i per step. After the last step every parameter, gradient and optimizer-state tensor of
one arm is compared with the other's, byte for byte (`cotangent.verify.compare_updates`, i.e.
`first_difference`): ``bitwise``. ``batched`` says for how many of the batches (two or more
equal-shape matrices of a param group; a matrix alone of its shape in its group is in no batch
and not listed) the batched Newton-Schulz step was proven exact and used
(`cotangent.Muon.batch_summary`); the others run torch's own per-matrix step.

(The MuonAdamW rows, `cotangent.MuonAdamW` reference ``packed=False`` against ``packed=True``,
were removed: MuonAdamW has a single path now, the published stack/copy one. Its former packed
path copied every gradient in the backward and saved 1.5-3% of the step.)
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

import cotangent
from cotangent.harness.contention import HostSampler
from cotangent.harness.records import environment
from cotangent.verify import compare_updates

# name -> [(matrices, rows, cols), ...]: the matrices of one Muon row
MATRIX_SETS: dict[str, list[tuple[int, int, int]]] = {
    "8x384x384": [(8, 384, 384)],
    "4x64x256": [(4, 64, 256)],
    "6x96x96": [(6, 96, 96)],
    # four transformer blocks of width 128: qkv, out, MLP up, MLP down
    "transformer-mix": [(4, 384, 128), (4, 128, 128), (4, 512, 128), (4, 128, 512)],
}
MUON_ARGS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
INPUT_COLUMNS = 16  # columns of each X_i in the Muon rows' loss


def compare_arms(names: list[str], params_a: list[torch.Tensor], opt_a, params_b, opt_b
                 ) -> tuple[int, str | None]:
    """(tensors compared, first difference or None): gradients, parameters and every state
    entry of arm a against arm b, byte for byte."""
    checks = list(compare_updates(names, params_a, opt_a.state, params_b, opt_b.state))
    problems = [f"{what}: {p}" for what, p in checks if p is not None]
    first = None if not problems else problems[0] + (
        f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
    return len(checks), first


def _median_ms(values: Sequence[float]) -> float:
    return 1e3 * statistics.median(values)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run_arms(arms: dict, batches: list, loss_fn, warmup: int) -> dict[str, dict[str, list]]:
    """Run every arm over `batches`, interleaved (order flips each step); per arm and phase the
    seconds of each step after the warm-up ones. `arms`: name -> (model, optimizer)."""
    phases = ("zero_grad", "forward", "backward", "step")
    times = {name: {ph: [] for ph in phases} for name in arms}
    order = list(arms)
    for i, batch in enumerate(batches):
        for name in order:
            model, opt = arms[name]
            t = {"zero_grad": _timed(opt.zero_grad)}
            t0 = time.perf_counter()
            loss = loss_fn(model, batch)
            t["forward"] = time.perf_counter() - t0
            t["backward"] = _timed(loss.backward)
            t["step"] = _timed(opt.step)
            if i >= warmup:
                for ph in phases:
                    times[name][ph].append(t[ph])
        order.reverse()
    return times


# ------------------------------------------------------------------ Muon rows


class MatrixSet(nn.Module):
    """Parameters: the matrices of a set (normal(0, 0.02) from `seed`), in the order listed."""

    def __init__(self, spec: Sequence[tuple[int, int, int]], seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.mats = nn.ParameterList(nn.Parameter(torch.randn(r, c, generator=gen) * 0.02)
                                     for n, r, c in spec for _ in range(n))

    def forward(self, batch: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return sum(((torch.tanh(w @ x) - y) ** 2).mean() for w, (x, y) in zip(self.mats, batch))


def _matrix_loss(model: MatrixSet, batch) -> torch.Tensor:
    return model(batch)


def muon_row(set_name: str, spec: Sequence[tuple[int, int, int]], *, repeats: int, warmup: int,
             seed: int = 0) -> dict:
    """One Muon row: `cotangent.Muon` against `torch.optim.Muon` on the matrices of `spec`."""
    base = MatrixSet(spec, seed)
    models = {"torch": base, "cotangent": copy.deepcopy(base)}
    arms = {"torch": (base, torch.optim.Muon(base.parameters(), **MUON_ARGS)),
            "cotangent": (models["cotangent"],
                          cotangent.Muon(models["cotangent"].parameters(), **MUON_ARGS))}
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [[(torch.randn(w.shape[1], INPUT_COLUMNS, generator=gen),
                 torch.randn(w.shape[0], INPUT_COLUMNS, generator=gen) * 0.5)
                for w in base.mats] for _ in range(warmup + repeats)]
    times = _run_arms(arms, batches, _matrix_loss, warmup)
    names = [n for n, _ in base.named_parameters()]
    checked, difference = compare_arms(names, list(base.parameters()), arms["torch"][1],
                                       list(models["cotangent"].parameters()),
                                       arms["cotangent"][1])
    summary = arms["cotangent"][1].batch_summary()
    ms = {}
    for name, t in times.items():
        ms[f"{name}_step_ms"] = _median_ms(t["step"])
        ms[f"{name}_zero_grad_ms"] = _median_ms(t["zero_grad"])
        ms[f"{name}_backward_ms"] = _median_ms(t["backward"])
    return dict(
        kind="muon", matrices=set_name, spec=[list(s) for s in spec],
        params=sum(p.numel() for p in base.parameters()), tensors=len(names), **ms,
        ratio=ms["cotangent_step_ms"] / ms["torch_step_ms"],
        batches=len(summary), batched=sum(1 for b in summary if b["batched"]),
        batch_summary=summary, bitwise=difference is None, difference=difference,
        tensors_compared=checked, repeats=repeats, warmup=warmup)


# ------------------------------------------------------------------ the bench


def run_muon_bench(matrix_sets: Sequence[str] | Mapping[str, Sequence] = tuple(MATRIX_SETS), *,
                   repeats: int = 50, warmup: int = 3, muon_repeats: int | None = None,
                   log: Callable[[str], object] = print) -> dict:
    """Run the Muon rows, one per matrix set (a name of `MATRIX_SETS`, or a mapping name ->
    [(matrices, rows, cols), ...]). `muon_repeats` (default `repeats`): timed steps per row.

    Returns {environment, device, loadavg_start, loadavg_end, host_cpus, others_cpus (CPUs
    other processes kept busy on average during the run, from /proc/stat, as
    `cotangent.harness.contention`; None where unreadable), wall_s, muon_rows, table}.
    Raises ValueError for an unknown matrix-set name, repeats < 1 or warmup < 0."""
    if repeats < 1 or warmup < 0 or (muon_repeats is not None and muon_repeats < 1):
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    if not isinstance(matrix_sets, Mapping):
        unknown = [s for s in matrix_sets if s not in MATRIX_SETS]
        if unknown:
            raise ValueError(f"unknown matrix set(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(MATRIX_SETS)}")
        matrix_sets = {s: MATRIX_SETS[s] for s in matrix_sets}
    load_start = os.getloadavg()
    sampler = HostSampler()
    host0, cpu0, wall0 = sampler.sample(), time.process_time(), time.perf_counter()
    muon_rows = []
    for name, spec in matrix_sets.items():
        row = muon_row(name, spec, repeats=muon_repeats or repeats, warmup=warmup)
        log(f"  Muon {name:<20} step torch {row['torch_step_ms']:8.2f} ms cotangent "
            f"{row['cotangent_step_ms']:8.2f} ms  ratio {row['ratio']:.3f}  batched "
            f"{row['batched']}/{row['batches']}  bitwise {row['bitwise']}")
        muon_rows.append(row)
    host1, cpu1, wall1 = sampler.sample(), time.process_time(), time.perf_counter()
    others = None if host0 is None or host1 is None else (
        (host1[0] - host0[0]) - (cpu1 - cpu0)) / (wall1 - wall0)
    result = dict(environment=environment(), device="cpu", loadavg_start=list(load_start),
                  loadavg_end=list(os.getloadavg()), host_cpus=sampler.cpus,
                  others_cpus=others, wall_s=wall1 - wall0, muon_rows=muon_rows)
    result["table"] = format_muon_table(result)
    return result


def muon_bench_header(matrix_sets, repeats: int = 50, warmup: int = 3) -> str:
    """The line printed before the rows (as `cotangent bench` prints one)."""
    return (f"Muon benchmark on cpu: cotangent.Muon vs torch.optim.Muon on {len(matrix_sets)} "
            f"matrix set(s), {repeats} repeats (+{warmup} warm-up), arms interleaved")


def muon_bench_ok(result: dict) -> bool:
    """True when every row is bitwise (the exit status of `cotangent bench --muon`)."""
    return all(r["bitwise"] for r in result["muon_rows"])


def format_muon_table(result: dict) -> str:
    """Machine facts, then the table of the Muon rows, step ms, medians."""
    env = result["environment"]
    others = result["others_cpus"]
    lines = [f"machine: {env['cpu_model']} ({env['cpu_capability']}), {env['threads']} torch "
             f"threads, torch {env['torch']}, float32 parameters; other processes kept "
             f"{'(not measured)' if others is None else f'{others:.2f}'} of "
             f"{result['host_cpus']} CPUs busy during the run ({result['wall_s']:.0f} s)"]
    rows = result["muon_rows"]
    if rows:
        lines += [
            "", "cotangent.Muon vs torch.optim.Muon (for-loop); step ms, medians; batched = "
            "batches stepped by the batched Newton-Schulz (of all batches: two or more "
            "equal-shape matrices of a group)",
            f"{'matrices':<17}{'params':>11}{'tensors':>8}{'torch':>10}{'cotangent':>10}"
            f"{'ratio':>7}  {'batched':<8} bitwise"]
        for r in rows:
            lines.append(
                f"{r['matrices']:<17}{r['params']:>11,}{r['tensors']:>8}"
                f"{r['torch_step_ms']:>10.2f}{r['cotangent_step_ms']:>10.2f}{r['ratio']:>7.3f}"
                f"  {str(r['batched']) + '/' + str(r['batches']):<8} "
                f"{'yes' if r['bitwise'] else 'NO'}")
    for r in rows:
        if r["difference"]:
            lines.append(f"first difference ({r['matrices']}): {r['difference']}")
    return "\n".join(lines)


def muon_result_json(result: dict) -> str:
    """The result as one JSON line (without the formatted table)."""
    return json.dumps({k: v for k, v in result.items() if k != "table"}, sort_keys=True)
