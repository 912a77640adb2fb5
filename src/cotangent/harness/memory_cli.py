"""`cotangent memory`: the saved-tensor storage audit (`cotangent.memory`) over the harness
models and a demo stack of gated blocks.

The demo block reproduces the pattern the audit is for: a projection's first K=32 channels
gate the block's output, and the multiply that applies the gate saves its input for backward.
Three variants of the gate:

- ``slice``: ``g = h[..., :32]`` is saved as a view, which keeps the whole (B, T, d)
  projection ``h`` alive until the backward;
- ``contiguous``: ``h[..., :32].contiguous()`` saves a (B, T, 32) copy instead (bitwise equal
  to ``slice`` in eager FP32);
- ``weight-fused``: the gate is computed by its own (32, d) projection whose weights already
  include the scale, so no slice of ``h`` is saved (not bitwise equal to ``slice``: the scale is
  applied before the sum instead of after it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cotangent.memory import MemoryReport, audit

GATE_CHANNELS = 32
DEMO_VARIANTS = ("slice", "contiguous", "weight-fused")


class GatedBlock(nn.Module):
    """x (B, T, d) -> x + h + sum(gate), h = proj(x), gate = h[..., :32] * scale."""

    def __init__(self, width: int, variant: str) -> None:
        super().__init__()
        if variant not in DEMO_VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; known: {', '.join(DEMO_VARIANTS)}")
        self.proj = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, GATE_CHANNELS))
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = GATE_CHANNELS
        h = self.proj(x)  # (B, T, d): saved by nothing else, so only the gate can pin it
        if self.variant == "weight-fused":
            # (32, d) weights with the scale folded in: the gate's own projection of x
            gate = F.linear(x, self.proj.weight[:k] * self.scale[:, None],
                            self.proj.bias[:k] * self.scale)  # (B, T, 32)
        else:
            g = h[..., :k]  # (B, T, 32) view of h's storage
            if self.variant == "contiguous":
                g = g.contiguous()  # (B, T, 32) storage of its own
            gate = g * self.scale  # the multiply saves g for backward
        return x + h + gate.sum(-1, keepdim=True)  # (B, T, d); add and sum save nothing


class DemoStack(nn.Module):
    """`layers` gated blocks over a (B, T, d) input; the loss is the mean square (which saves
    the last block's output)."""

    def __init__(self, width: int, layers: int, variant: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(GatedBlock(width, variant) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def run_demo(variant: str, *, batch: int, context: int, width: int, layers: int,
             compiled: bool, dtype: torch.dtype) -> MemoryReport:
    """Audit one forward of the demo stack (fresh model and compile)."""
    model = DemoStack(width, layers, variant).to(dtype)
    x = torch.randn(batch, context, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    fn = torch.compile(model) if compiled else model
    item = torch.empty((), dtype=dtype).element_size()
    labels = {"B,T,d": batch * context * width * item,
              f"B,T,{GATE_CHANNELS}": batch * context * GATE_CHANNELS * item}
    return audit(fn, x, params=list(model.parameters()), labels=labels)


def run_model(name: str, *, batch: int, compiled: bool, dtype: torch.dtype) -> MemoryReport:
    """Audit one forward + loss of harness model `name` on random bytes (B, context + 1)."""
    from cotangent.harness.model import build_model

    model = build_model(name, 0)
    cfg = model.cfg
    windows = torch.randint(0, 256, (batch, cfg.context + 1),
                            generator=torch.Generator().manual_seed(1))
    fn = torch.compile(model) if compiled else model
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16
                else torch.autocast("cpu", enabled=False))
    item = torch.empty((), dtype=dtype).element_size()
    labels = {"B,T,C": batch * cfg.context * cfg.width * item,
              "B,T,hidden": batch * cfg.context * cfg.hidden * item,
              "B,T,256": batch * cfg.context * 256 * item}

    def forward():
        with autocast:
            logits = fn(windows[:, :-1])  # (B, T, 256)
        return F.cross_entropy(logits.float().reshape(-1, 256), windows[:, 1:].reshape(-1))

    return audit(forward, params=list(model.parameters()), labels=labels,
                 mode="compiled" if compiled else "eager")
