"""`cotangent train`: the same seed trained with the native and the Cotangent update phase.

Arms (the 2x2 factorial {batched norms} x {packing}; every arm gives native's bits):
    native              `torch.nn.utils.clip_grad_norm_(params, max_norm)` (foreach=None) then
                        `torch.optim.AdamW(..., fused=True)` - the fastest native CPU path.
    cotangent           `cotangent.AdamW(..., fused=True, max_norm=max_norm)`: both.
    batched-norms-only  `cotangent.factorial.BatchedNormsOnly`: stacked batched norms, native
                        tensors, native clip multiply and AdamW.
    packing-only        `cotangent.AdamW(..., batched_norms=False)`: packed buffers, merged
                        AdamW calls, native per-tensor norms.

The arms run interleaved in one process (step i of both before step i + 1, their order
alternating), each from `torch.manual_seed(seed)` and its own window sampler, so machine drift
hits both alike. Timed regions are bracketed by a device synchronisation. The update phase is
clip + AdamW step + zero_grad (the moment the gradients are ready until the next backward may
start); the whole step adds forward and backward.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import cotangent
from cotangent.harness import records
from cotangent.harness.data import BITS_PER_NAT, Corpus, WindowSampler, eval_windows
from cotangent.factorial import BatchedNormsOnly
from cotangent.harness.model import build_model

ARMS = ("native", "cotangent", "batched-norms-only", "packing-only")
DEFAULT_ARMS = ("native", "cotangent")
NATIVE_PATH = "clip_grad_norm_(foreach=None) + torch.optim.AdamW(fused=True)"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """One `cotangent train` run (both arms)."""

    model: str = "transformer-small"
    steps: int = 300  # optimizer updates per arm
    seed: int = 0  # model init: torch.manual_seed(seed); windows: default_rng(seed + 100000)
    batch_size: int = 8  # windows per step, each context + 1 bytes
    lr: float = 1e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_norm: float = 1.0  # gradient clipping threshold (global L2 norm)
    device: str = "cpu"  # cpu | cuda | mps
    precision: str = "auto"  # auto (fp32 on CPU, bf16 autocast elsewhere) | fp32 | bf16
    val_bytes: int = 262_144  # validation on the first this many bytes of valid; 0 = all
    eval_batch: int = 16  # windows per evaluation forward pass
    out: str = "runs"  # parent directory of run directories
    arms: tuple[str, ...] = DEFAULT_ARMS  # which arms, trained interleaved; the first is the baseline

    def resolved_precision(self) -> str:
        if self.precision == "auto":
            return "fp32" if self.device == "cpu" else "bf16"
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be auto, fp32 or bf16, not {self.precision!r}")
        return self.precision


def warmup_steps(steps: int) -> int:
    """Linear warmup length: min(100, max(20, steps // 10))."""
    return min(100, max(20, steps // 10))


def lr_factor(step: int, steps: int) -> float:
    """Multiplier of the peak lr at update `step` (0-based): linear warmup to 1, then cosine to 0.1."""
    w = warmup_steps(steps)
    if step < w:
        return (step + 1) / w
    progress = (step - w) / max(1, steps - w)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def sync(device: torch.device) -> None:
    """Wait for queued device work, so wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Arm:
    """One arm's model, optimizer and update phase."""

    def __init__(self, name: str, cfg: TrainConfig, device: torch.device) -> None:
        if name not in ARMS:
            raise ValueError(f"unknown arm {name!r}; known: {', '.join(ARMS)}")
        self.name = name
        self.model = build_model(cfg.model, cfg.seed).to(device)
        params = list(self.model.parameters())
        kw = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                  fused=True)
        if name == "native":
            self.update = cotangent.ReferenceUpdate(params, max_norm=cfg.max_norm, **kw)
            self.optimizer = self.update.optimizer
        elif name == "batched-norms-only":
            self.update = BatchedNormsOnly(params, max_norm=cfg.max_norm, **kw)
            self.optimizer = self.update.optimizer
        else:
            self.update = None
            self.optimizer = cotangent.AdamW(params, max_norm=cfg.max_norm,
                                             batched_norms=name == "cotangent", **kw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, cfg.steps))

    def update_phase(self) -> torch.Tensor:
        """Clip, step, zero_grad; returns the total gradient norm before clipping."""
        if self.update is not None:
            total = self.update.step()
        else:
            self.optimizer.step()
            total = self.optimizer.last_total_norm
        self.optimizer.zero_grad(set_to_none=True)
        return total


@torch.no_grad()
def evaluate_bpb(model: torch.nn.Module, windows: torch.Tensor, *, batch: int,
                 device: torch.device, autocast) -> tuple[float, int]:
    """Bits per byte over `windows` (N, T + 1): total next-byte NLL / targets / ln 2."""
    model.eval()
    total_nll, targets = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device)
        with autocast():
            logits = model(w[:, :-1])  # (b, T, 256)
        nll = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1),
                              reduction="sum")
        total_nll += nll.item()
        targets += w[:, 1:].numel()
    model.train()
    return total_nll / targets * BITS_PER_NAT, targets


def run_train(cfg: TrainConfig, corpus: Corpus, *, show_progress: bool | None = None,
              log=print) -> dict:
    """Train both arms interleaved, evaluate, write records; returns the comparison dict.

    The dict has `identical_final_hash` and, per arm, `update_ms` and `step_ms` (medians over
    steps), `update_ms_mean`, `step_ms_mean`, `val_bpb`, `final_model_sha256`, `run_dir`.
    """
    device = torch.device(cfg.device)
    precision = cfg.resolved_precision()
    if precision == "bf16":
        def autocast():
            return torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        autocast = nullcontext
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    run_root = Path(cfg.out) / f"{stamp}-{cfg.model}-seed{cfg.seed}"
    env = records.environment()
    if not cfg.arms or len(set(cfg.arms)) != len(cfg.arms):
        raise ValueError(f"arms must be distinct and at least one, got {cfg.arms}")
    arms = {name: Arm(name, cfg, device) for name in cfg.arms}
    first = arms[cfg.arms[0]]
    # Fail now, not after training, if validation cannot run on this split and context.
    val = eval_windows(corpus.splits["valid"], first.model.cfg.context, cfg.val_bytes)
    samplers = {name: WindowSampler(corpus.splits["train"], seed=cfg.seed,
                                    batch_size=cfg.batch_size,
                                    context=arms[name].model.cfg.context) for name in cfg.arms}
    n_params = sum(p.numel() for p in first.model.parameters())
    n_tensors = len(list(first.model.parameters()))
    for name, arm in arms.items():
        meta = {
            "arm": name,
            "config": asdict(cfg),
            "precision": precision,
            "seed": cfg.seed,
            "environment": env,
            "device_name": _device_name(device),
            "data": corpus.manifest(),
            "native_path": NATIVE_PATH,
            "parameters": n_params,
            "tensors": n_tensors,
            "init_model_sha256": records.model_sha256(arm.model),
            "command": sys.argv,
        }
        if isinstance(arm.optimizer, cotangent.AdamW):
            meta["layout"] = arm.optimizer.layout_summary()
        records.write_json(run_root / name / "metadata.json", meta)
        arm.optimizer.zero_grad(set_to_none=True)
    log(f"training {cfg.model} ({n_params:,} parameters, {n_tensors} tensors) for {cfg.steps} "
        f"steps per arm on {device.type} in {precision}, arms interleaved: {', '.join(cfg.arms)}")
    curves: dict[str, list[dict]] = {name: [] for name in cfg.arms}
    if show_progress is None:
        show_progress = sys.stderr.isatty()
    order = list(cfg.arms)
    for step in tqdm(range(cfg.steps), disable=not show_progress, desc="steps", unit="step"):
        for name in order:
            arm = arms[name]
            batch = samplers[name].next_batch().to(device)
            lr = arm.optimizer.param_groups[0]["lr"]
            sync(device)
            t0 = time.perf_counter()
            with autocast():
                logits = arm.model(batch[:, :-1])  # (B, T, 256)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   batch[:, 1:].reshape(-1))
            loss.backward()
            sync(device)
            t1 = time.perf_counter()
            total = arm.update_phase()
            sync(device)
            t2 = time.perf_counter()
            arm.scheduler.step()
            curves[name].append({
                "step": step, "loss_bpb": loss.item() * BITS_PER_NAT, "lr": lr,
                "grad_norm": total.item(), "step_s": t2 - t0, "update_s": t2 - t1,
            })
        order.reverse()
    result: dict = {}
    for name, arm in arms.items():
        bpb, targets = evaluate_bpb(arm.model, val, batch=cfg.eval_batch, device=device,
                                    autocast=autocast)
        curve = curves[name]
        step_s = [r["step_s"] for r in curve]
        update_s = [r["update_s"] for r in curve]
        summary = {
            "arm": name,
            "steps": cfg.steps,
            "update_ms": 1e3 * statistics.median(update_s),
            "step_ms": 1e3 * statistics.median(step_s),
            "update_ms_mean": 1e3 * statistics.fmean(update_s),
            "step_ms_mean": 1e3 * statistics.fmean(step_s),
            "training_s": sum(step_s),
            "update_s": sum(update_s),
            "final_loss_bpb": curve[-1]["loss_bpb"],
            "val_bpb": bpb,
            "val_targets": targets,
            "final_model_sha256": records.model_sha256(arm.model),
            "run_dir": str(run_root / name),
        }
        records.write_jsonl(run_root / name / "curve.jsonl", curve)
        records.write_json(run_root / name / "summary.json", summary)
        result[name] = summary
    result["arms"] = list(cfg.arms)
    result["identical_final_hash"] = len(
        {result[name]["final_model_sha256"] for name in cfg.arms}) == 1
    return result


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine()


def format_comparison(result: dict) -> str:
    """Human-readable comparison table of `run_train`'s result."""
    arms = result["arms"]
    lines = [f"{'arm':<19} {'update_ms':>10} {'step_ms':>9} {'val_bpb':>9}  final_model_sha256"]
    for name in arms:
        r = result[name]
        lines.append(f"{name:<19} {r['update_ms']:>10.2f} {r['step_ms']:>9.1f} "
                     f"{r['val_bpb']:>9.4f}  {r['final_model_sha256']}")
    base = result[arms[0]]
    lines.append(f"identical final model SHA-256: {'yes' if result['identical_final_hash'] else 'NO'}")
    for name in arms[1:]:
        r = result[name]
        lines.append(f"{name} / {arms[0]} (medians per step): update phase "
                     f"{r['update_ms'] / base['update_ms']:.3f}, whole step "
                     f"{r['step_ms'] / base['step_ms']:.3f}")
    lines.append(f"records: {Path(base['run_dir']).parent}")
    return "\n".join(lines)


def result_json(result: dict) -> str:
    """One-line JSON of the comparison (the last line of `cotangent train --json`)."""
    keys = ("update_ms", "step_ms", "val_bpb", "final_model_sha256", "run_dir")
    obj = {"identical_final_hash": result["identical_final_hash"]}
    obj.update({name: {k: result[name][k] for k in keys} for name in result["arms"]})
    return json.dumps(obj, sort_keys=True)
