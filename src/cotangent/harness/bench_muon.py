"""`cotangent bench --muon`: the Muon optimizers' update phase, measured as in a training loop.

Two kinds of rows, each with two arms that live in one process, start from the same initial
weights, see the same batches and alternate step by step (the order flips every step). Every
step of an arm is ``zero_grad()``, forward, backward, ``step()``, each timed on its own
(`time.perf_counter`); medians over the steps after the warm-up ones. After the last step
every parameter, gradient and optimizer-state tensor of one arm is compared with the other's,
byte for byte (`cotangent.verify.compare_updates`, i.e. `first_difference`): ``bitwise``.

MuonAdamW rows (`cotangent.MuonAdamW`, reference ``packed=False`` against ``packed=True``, both
eager, or both with ``compile=True``) on a recurrent GPT of the harness (``recurrent-mini``:
width 64, 8 blocks of qkv (3W, W), out (W, W), up (4W, W), down (W, 4W) in Muon, the 256 x W
embedding and head in two AdamW groups), batches of random byte ids, cross-entropy loss:
    update_ms        median over steps of step() + zero_grad() of the same step;
    ratio            packed update_ms / reference update_ms;
    stack_copy_ms    what the packed path removes: the reference path's ``torch.stack`` of each
                     Muon group's gradients and parameters and its ``torch._foreach_copy_`` back,
                     timed alone on the reference arm's own tensors after the run (all groups
                     per step; the copy writes back the values it read);
    zero_accum_ms    what the packed path adds: its zero_grad fills the flat gradient buffers with
                     -0.0 and its backward accumulates into the existing ``.grad`` views instead
                     of allocating new gradients; measured as median(zero_grad + backward) of the
                     packed arm minus that of the reference arm (sign kept: negative = cheaper);
                     zero_accum_paired_ms: the median of the per-step differences instead;
    net_ms           median(zero_grad + backward + step) of the packed arm minus the reference
                     arm's: what the packed path changes per training step, all told (the
                     forward is not included; net_paired_ms as above).

Muon rows (`cotangent.Muon` against `torch.optim.Muon`, same arguments; torch's is a for-loop
optimizer) on sets of equal-shape matrices; each step's gradients come from a real backward of
``sum_i mean((tanh(W_i @ X_i) - Y_i)^2)`` with fresh X_i, Y_i per step. ``batched`` says for how
many of the packed batches the batched Newton-Schulz step was proven exact and used
(`cotangent.Muon.batch_summary`); the others run torch's own per-matrix step.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import cotangent
from cotangent.harness.contention import HostSampler
from cotangent.harness.model import build_model
from cotangent.harness.records import environment
from cotangent.verify import compare_updates

MUON_ADAMW_MODELS = ("recurrent-mini", "recurrent-small")
# name -> [(matrices, rows, cols), ...]: the matrices of one Muon row
MATRIX_SETS: dict[str, list[tuple[int, int, int]]] = {
    "8x384x384": [(8, 384, 384)],
    "4x64x256": [(4, 64, 256)],
    "6x96x96": [(6, 96, 96)],
    # four transformer blocks of width 128: qkv, out, MLP up, MLP down
    "transformer-mix": [(4, 384, 128), (4, 128, 128), (4, 512, 128), (4, 128, 512)],
}
# nanochat-like settings (embedding / head lr, AdamW betas and eps; cautious Muon decay)
MUON_ADAMW_ARGS = dict(adamw_betas=(0.8, 0.95), adamw_eps=1e-10, adamw_weight_decay=0.0,
                       muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.1)
EMBEDDING_LR, HEAD_LR = 0.2, 0.004
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


# ------------------------------------------------------------------ MuonAdamW rows


def muon_adamw_optimizer(model: nn.Module, packed: bool, compile: bool = False):
    """`cotangent.MuonAdamW` for a recurrent model: embedding and head in AdamW groups, every
    block matrix in Muon."""
    return cotangent.MuonAdamW(
        [{"params": [model.tok_emb.weight], "lr": EMBEDDING_LR},
         {"params": [model.head.weight], "lr": HEAD_LR}],
        model.matrix_parameters(), packed=packed, compile=compile, **MUON_ADAMW_ARGS)


def _lm_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])  # (B, T, 256)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


def stack_copy_seconds(opt, repeats: int, warmup: int) -> list[float]:
    """Per repeat, seconds of the reference path's stack + copy back over every Muon group of
    `opt` (its gradients must be present): ``torch.stack`` of the gradients and of the
    parameters, ``torch._foreach_copy_`` of the stacked parameters back (same values)."""
    groups = [g["params"] for g in opt.param_groups if g["kind"] == "muon" and g["params"]]
    out = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            for params in groups:
                torch.stack([p.grad for p in params])
                stacked = torch.stack(params)
                torch._foreach_copy_(params, list(stacked.unbind(0)))
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return out


def muon_adamw_row(model_name: str, *, repeats: int, warmup: int, compile: bool = False,
                   batch_size: int = 8, seq_len: int | None = None, seed: int = 0) -> dict:
    """One MuonAdamW row: reference against packed on `model_name` (a recurrent model)."""
    if compile:
        torch._dynamo.reset()  # each row's compiled variants count from zero
    base = build_model(model_name, seed)
    seq_len = seq_len or base.cfg.context
    models = {"reference": base, "packed": copy.deepcopy(base)}
    arms = {name: (m, muon_adamw_optimizer(m, name == "packed", compile))
            for name, m in models.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randint(0, 256, (batch_size, seq_len + 1), generator=gen)
               for _ in range(warmup + repeats)]
    times = _run_arms(arms, batches, _lm_loss, warmup)
    names = [n for n, _ in base.named_parameters()]
    params = {name: list(m.parameters()) for name, m in models.items()}
    checked, difference = compare_arms(names, params["reference"], arms["reference"][1],
                                       params["packed"], arms["packed"][1])
    stack_copy = stack_copy_seconds(arms["reference"][1], repeats, warmup)
    ms, sums = {}, {}
    for name, t in times.items():
        for ph, values in t.items():
            ms[f"{name}_{ph}_ms"] = _median_ms(values)
        sums[name] = {
            "update": [a + b for a, b in zip(t["step"], t["zero_grad"])],
            "zero_grad_backward": [a + b for a, b in zip(t["zero_grad"], t["backward"])],
            "zero_grad_backward_step": [a + b + c for a, b, c in zip(t["zero_grad"],
                                                                     t["backward"], t["step"])]}
        for key, values in sums[name].items():
            ms[f"{name}_{key}_ms"] = _median_ms(values)

    def paired(key: str) -> float:
        return _median_ms([a - b for a, b in zip(sums["packed"][key], sums["reference"][key])])
    opt = arms["packed"][1]
    muon_groups = [[len(g["params"]), *g["params"][0].shape] for g in opt.param_groups
                   if g["kind"] == "muon"]
    return dict(
        kind="muon-adamw", model=model_name, compile=compile, arms=["reference", "packed"],
        params=sum(p.numel() for p in base.parameters()), tensors=len(names),
        muon_groups=muon_groups, batch=[batch_size, seq_len], **ms,
        ratio=ms["packed_update_ms"] / ms["reference_update_ms"],
        stack_copy_ms=_median_ms(stack_copy),
        zero_accum_ms=ms["packed_zero_grad_backward_ms"] - ms["reference_zero_grad_backward_ms"],
        zero_accum_paired_ms=paired("zero_grad_backward"),
        net_ms=(ms["packed_zero_grad_backward_step_ms"]
                - ms["reference_zero_grad_backward_step_ms"]),
        net_paired_ms=paired("zero_grad_backward_step"),
        bitwise=difference is None, difference=difference, tensors_compared=checked,
        repeats=repeats, warmup=warmup)


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


def run_muon_bench(models: Sequence[str] = MUON_ADAMW_MODELS,
                   matrix_sets: Sequence[str] | Mapping[str, Sequence] = tuple(MATRIX_SETS), *,
                   repeats: int = 50, warmup: int = 3, muon_repeats: int | None = None,
                   compile: bool = False, batch_size: int = 8, seq_len: int | None = None,
                   log: Callable[[str], object] = print) -> dict:
    """Run the MuonAdamW rows (one per model; with `compile`, a compiled row after each eager
    one) and the Muon rows (one per matrix set: a name of `MATRIX_SETS`, or a mapping name ->
    [(matrices, rows, cols), ...]). `muon_repeats` (default `repeats`) for the Muon rows.

    Returns {environment, device, loadavg_start, loadavg_end, host_cpus, others_cpus (CPUs
    other processes kept busy on average during the run, from /proc/stat, as
    `cotangent.harness.contention`; None where unreadable), wall_s, muon_adamw_rows,
    muon_rows, table}. Raises ValueError for an unknown matrix-set name, repeats < 1 or
    warmup < 0."""
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
    adamw_rows = []
    for model in models:
        for compiled in (False, True) if compile else (False,):
            row = muon_adamw_row(model, repeats=repeats, warmup=warmup, compile=compiled,
                                 batch_size=batch_size, seq_len=seq_len)
            log(f"  MuonAdamW {model:<16} {'compiled' if compiled else 'eager':<8} update "
                f"reference {row['reference_update_ms']:7.2f} ms packed "
                f"{row['packed_update_ms']:7.2f} ms  ratio {row['ratio']:.3f}  bitwise "
                f"{row['bitwise']}")
            adamw_rows.append(row)
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
                  others_cpus=others, wall_s=wall1 - wall0, muon_adamw_rows=adamw_rows,
                  muon_rows=muon_rows)
    result["table"] = format_muon_table(result)
    return result


def muon_bench_header(models: Sequence[str], matrix_sets, repeats: int = 50, warmup: int = 3,
                      compile: bool = False) -> str:
    """The line printed before the rows (as `cotangent bench` prints one)."""
    modes = "eager + compiled" if compile else "eager"
    return (f"Muon benchmark on cpu: MuonAdamW on {len(models)} model(s) ({modes}), Muon on "
            f"{len(matrix_sets)} matrix set(s), {repeats} repeats (+{warmup} warm-up), arms "
            "interleaved")


def muon_bench_ok(result: dict) -> bool:
    """True when every row is bitwise (the exit status of `cotangent bench --muon`)."""
    return all(r["bitwise"] for r in result["muon_adamw_rows"] + result["muon_rows"])


def format_muon_table(result: dict) -> str:
    """Machine facts, then the two tables (MuonAdamW rows, Muon rows), ms per step, medians."""
    env = result["environment"]
    others = result["others_cpus"]
    lines = [f"machine: {env['cpu_model']} ({env['cpu_capability']}), {env['threads']} torch "
             f"threads, torch {env['torch']}, float32 parameters; other processes kept "
             f"{'(not measured)' if others is None else f'{others:.2f}'} of "
             f"{result['host_cpus']} CPUs busy during the run ({result['wall_s']:.0f} s)"]
    rows = result["muon_adamw_rows"]
    if rows:
        batches = sorted({f"{r['batch'][0]}x{r['batch'][1]}" for r in rows})
        lines += [
            "", "MuonAdamW, reference (stack + _foreach_copy_) vs packed; ms per step, medians; "
            f"update = step + zero_grad; batches of {', '.join(batches)} byte ids; net = packed - "
            "reference of zero_grad + backward + step",
            f"{'model':<16}{'params':>10}  {'mode':<9}{'bwd ref':>8}{'bwd pk':>8}"
            f"{'step ref':>9}{'step pk':>8}"
            f"{'zg ref':>7}{'zg pk':>7}{'upd ref':>8}{'upd pk':>8}{'ratio':>7}"
            f"{'stack+copy':>11}{'zero/accum':>11}{'net':>8}  bitwise"]
        for r in rows:
            lines.append(
                f"{r['model']:<16}{r['params']:>10,}  "
                f"{'compiled' if r['compile'] else 'eager':<9}"
                f"{r['reference_backward_ms']:>8.2f}{r['packed_backward_ms']:>8.2f}"
                f"{r['reference_step_ms']:>9.2f}{r['packed_step_ms']:>8.2f}"
                f"{r['reference_zero_grad_ms']:>7.2f}{r['packed_zero_grad_ms']:>7.2f}"
                f"{r['reference_update_ms']:>8.2f}{r['packed_update_ms']:>8.2f}"
                f"{r['ratio']:>7.3f}{r['stack_copy_ms']:>11.3f}{r['zero_accum_ms']:>+11.3f}"
                f"{r['net_ms']:>+8.2f}  "
                f"{'yes' if r['bitwise'] else 'NO'}")
    rows = result["muon_rows"]
    if rows:
        lines += [
            "", "cotangent.Muon vs torch.optim.Muon (for-loop); step ms, medians; batched = "
            "batches stepped by the batched Newton-Schulz (of all packed batches)",
            f"{'matrices':<17}{'params':>11}{'tensors':>8}{'torch':>10}{'cotangent':>10}"
            f"{'ratio':>7}  {'batched':<8} bitwise"]
        for r in rows:
            lines.append(
                f"{r['matrices']:<17}{r['params']:>11,}{r['tensors']:>8}"
                f"{r['torch_step_ms']:>10.2f}{r['cotangent_step_ms']:>10.2f}{r['ratio']:>7.3f}"
                f"  {str(r['batched']) + '/' + str(r['batches']):<8} "
                f"{'yes' if r['bitwise'] else 'NO'}")
    for r in result["muon_adamw_rows"] + result["muon_rows"]:
        if r["difference"]:
            name = r.get("model") or r.get("matrices")
            lines.append(f"first difference ({name}): {r['difference']}")
    return "\n".join(lines)


def muon_result_json(result: dict) -> str:
    """The result as one JSON line (without the formatted table)."""
    return json.dumps({k: v for k, v in result.items() if k != "table"}, sort_keys=True)
