"""`cotangent verify`: the built-in bitwise suite over the four research model families."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from cotangent.harness.model import TINY, Transformer, build_model
from cotangent.harness.factorial import verify_batched_norms_only, verify_packing_only
from cotangent.verify import ARMS as LIBRARY_ARMS
from cotangent.verify import verify

VERIFY_MODELS = ("transformer-small", "transformer-medium", "gated-gqa", "causal-conv")
ARMS = (*LIBRARY_ARMS, "packing-only", "batched-norms-only")
VERIFY_ADAMW_ARGS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)


def suite_model(name: str, full_width: bool, seed: int = 0) -> Transformer:
    """Research model `name` (or, unless `full_width`, its `tiny-*` variant from
    `cotangent.harness.model.TINY`) with the initial weights of `seed`."""
    return build_model(name if full_width else TINY[name], seed)


def lm_loss(model, batch):
    """Next-byte cross-entropy (nats) of `model` on a (B, T + 1) batch of byte ids."""
    logits = model(batch[:, :-1])  # (B, T, 256)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def run_suite(*, models=VERIFY_MODELS, precisions=("fp32", "bf16"), arms=ARMS,
              steps: int = 4, full_width: bool = False, compile_check: bool = True,
              max_norm: float = 0.1, log=print) -> dict:
    """Every (model, precision, arm) case for `steps` updates, plus a compiled-model case."""
    cases = []
    plan = [(m, p, a, False) for m in models for p in precisions for a in arms]
    if compile_check:
        plan.append((models[0], "fp32", "cotangent", True))
    for name, precision, arm, compiled in plan:
        model = suite_model(name, full_width)
        gen = torch.Generator().manual_seed(1)
        context = model.cfg.context
        batches = [torch.randint(0, 256, (2, context + 1), generator=gen) for _ in range(steps)]
        run = {"batched-norms-only": verify_batched_norms_only,
               "packing-only": verify_packing_only}.get(arm, functools.partial(verify, arm=arm))
        report = run(model, lm_loss, batches, max_norm=max_norm,
                     autocast_dtype=torch.bfloat16 if precision == "bf16" else None,
                     compile=compiled, **VERIFY_ADAMW_ARGS)
        case = dict(model=name, precision=precision, compiled=compiled, **report.as_dict())
        cases.append(case)
        log(f"  {name:<19} {precision:<5} {arm:<19}{' compiled' if compiled else '':<9} "
            f"{report.steps} steps, {report.checks:>5} checks: "
            f"{'identical' if report.passed else 'DIFFERENT: ' + case['first_failure']}")
    return dict(passed=all(c["passed"] for c in cases), cases=cases,
                steps=sum(c["steps"] for c in cases), checks=sum(c["checks"] for c in cases),
                native="clip_grad_norm_(foreach=None) + torch.optim.AdamW(fused=True)",
                torch=torch.__version__, device="cpu", full_width=full_width)


def write_report(result: dict, path: str) -> None:
    """Write `run_suite`'s result to `path` as indented JSON."""
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
