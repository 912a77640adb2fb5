"""Byte-level GPT-style transformer used by the training harness.

One readable file in the spirit of nanoGPT: a `ModelConfig` dataclass, pre-norm blocks
(LayerNorm -> causal self-attention -> residual, LayerNorm -> GELU MLP -> residual), learned
token and position embeddings, a final LayerNorm and an untied head. Every linear layer is
bias-free; the norms keep their weight and bias. Initialisation follows GPT-2 (Radford et al.,
2019) as written in nanoGPT: normal(0, 0.02) for every linear and embedding weight, with the
residual output projections (`attn.out`, `mlp.down`) scaled by 1/sqrt(2 * n_layer).

Shapes use B (batch), T (time, <= context), C (width), H (heads), D (head size = C / H).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Architecture of the byte-level transformer."""

    vocab_size: int = 256  # bytes
    context: int = 256  # maximum sequence length T, in bytes
    width: int = 256  # embedding width C
    n_layer: int = 4
    n_head: int = 4
    mlp_ratio: int = 4  # hidden width of the MLP = mlp_ratio * width

    def __post_init__(self) -> None:
        if self.width % self.n_head:
            raise ValueError(f"width {self.width} is not divisible by n_head {self.n_head}")


MODELS: dict[str, ModelConfig] = {
    # 3,346,944 parameters in 37 tensors (the walking skeleton's model).
    "transformer-small": ModelConfig(),
    # For tests: 4 tensor lengths shared by several tensors, fast even in BF16 on this CPU.
    "tiny": ModelConfig(context=32, width=32, n_layer=2, n_head=2),
}


def model_config(name: str, **overrides) -> ModelConfig:
    """Return the named `ModelConfig`; raises ValueError naming the known models."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return replace(MODELS[name], **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.out = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Byte-level decoder-only transformer.

    Input: int64 byte ids of shape (B, T), T <= `cfg.context`. Output: float logits of shape
    (B, T, vocab_size) (float32 weights; bfloat16 activations under BF16 autocast).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_emb = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # nn.LayerNorm keeps its default init: weight 1, bias 0.

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds context {self.cfg.context}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def build_model(name: str, seed: int) -> Transformer:
    """Build model `name` with its initial weights drawn after `torch.manual_seed(seed)`."""
    cfg = model_config(name)
    torch.manual_seed(seed)
    return Transformer(cfg)
