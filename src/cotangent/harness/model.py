"""Byte-level language models used by the training harness: three families in one file.

In the spirit of nanoGPT: a `ModelConfig` dataclass and plain modules. All models take byte ids
(vocabulary 256), have learned token and position embeddings, pre-norm residual blocks, a final
norm and an untied head; every linear layer is bias-free (norms keep their affine parameters).
Initialisation follows GPT-2 (Radford et al., 2019) as written in nanoGPT: normal(0, 0.02) for
every linear and embedding weight, with the residual output projections scaled by
1/sqrt(2 * n_layer); norms start at weight 1 (bias 0); convolutions keep PyTorch's default init.

Families:
    transformer  LayerNorm -> causal self-attention (qkv, out) and LayerNorm -> GELU MLP (up, down).
    gated-gqa    RMSNorm -> grouped-query attention (q, kv; K/V heads repeated to the query heads;
                 out) and RMSNorm -> SiLU-gated FFN (gate, up, down) (Ainslie et al., 2023;
                 Shazeer, 2020).
    causal-conv  LayerNorm -> depthwise causal Conv1d (kernel 3, dilation 2**i, left padding
                 2 * dilation) -> GELU -> mix, and LayerNorm -> GELU MLP (up, down).

Shapes use B (batch), T (time, <= context), C (width), H (query heads), G (K/V heads), D (head size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Architecture of one byte-level model."""

    family: str = "transformer"  # transformer | gated-gqa | causal-conv
    vocab_size: int = 256  # bytes
    context: int = 256  # maximum sequence length T, in bytes
    width: int = 256  # embedding width C
    n_layer: int = 4
    n_head: int = 4  # attention (query) heads; unused by causal-conv
    n_kv_head: int = 0  # gated-gqa: K/V heads (0: same as n_head)
    ffn_hidden: int = 0  # hidden width of the MLP / gated FFN (0: 4 * width)

    def __post_init__(self) -> None:
        if self.family not in ("transformer", "gated-gqa", "causal-conv"):
            raise ValueError(f"unknown model family {self.family!r}")
        if self.width % self.n_head:
            raise ValueError(f"width {self.width} is not divisible by n_head {self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or 4 * self.width


MODEL_CONFIGS: dict[str, ModelConfig] = {
    # 3,346,944 parameters in 37 tensors (the default model of `cotangent train`).
    "transformer-small": ModelConfig(),
    # 19,280,896 parameters in 53 tensors.
    "transformer-medium": ModelConfig(width=512, n_layer=6, n_head=8),
    # 9,737,088 parameters in 52 tensors.
    "gated-gqa": ModelConfig(family="gated-gqa", width=384, n_layer=6, n_head=6, n_kv_head=2,
                             ffn_hidden=1024),
    # 3,746,816 parameters in 53 tensors.
    "causal-conv": ModelConfig(family="causal-conv", width=256, n_layer=6),
    # 862,464 parameters in 37 tensors: transformer-small at half the width and a quarter of the
    # context, for the ~10-minute CPU campaign (protocols/cpu-quick.toml).
    "transformer-quick": ModelConfig(context=64, width=128, n_layer=4, n_head=4),
    # About 50M parameters, for the update-phase benchmark.
    "transformer-50m": ModelConfig(width=768, n_layer=7, n_head=12),
    # Tiny variants for tests (fast even in BF16 autocast on a CPU).
    "tiny-transformer": ModelConfig(context=32, width=32, n_layer=2, n_head=2),
    "tiny-gated-gqa": ModelConfig(family="gated-gqa", context=32, width=48, n_layer=2, n_head=6,
                                  n_kv_head=2, ffn_hidden=96),
    "tiny-causal-conv": ModelConfig(family="causal-conv", context=32, width=32, n_layer=3),
    "tiny-transformer-medium": ModelConfig(context=32, width=48, n_layer=3, n_head=4),
}
MODEL_CONFIGS["tiny"] = MODEL_CONFIGS["tiny-transformer"]

# The tiny variant of each research model: same family and block structure, fewer features
# (`cotangent verify` runs these unless --full-width).
TINY: dict[str, str] = {
    "transformer-small": "tiny-transformer",
    "transformer-medium": "tiny-transformer-medium",
    "gated-gqa": "tiny-gated-gqa",
    "causal-conv": "tiny-causal-conv",
}


def model_config(name: str, **overrides) -> ModelConfig:
    """Return the named `ModelConfig`; raises ValueError naming the known models."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_CONFIGS))}")
    return replace(MODEL_CONFIGS[name], **overrides)


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
        self.up = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv = cfg.n_head, cfg.kv_heads
        self.head_dim = cfg.width // cfg.n_head
        self.q = nn.Linear(cfg.width, cfg.width, bias=False)
        self.kv = nn.Linear(cfg.width, 2 * self.n_kv * self.head_dim, bias=False)
        self.out = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        D, G = self.head_dim, self.n_kv
        q = self.q(x).view(B, T, self.n_head, D).transpose(1, 2)  # (B, H, T, D)
        k, v = self.kv(x).split(G * D, dim=2)  # 2 x (B, T, G*D)
        k = k.view(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
        v = v.view(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
        k = k.repeat_interleave(self.n_head // G, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(self.n_head // G, dim=1)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.out(y)


class GatedFFN(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.width, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class CausalConvMixer(nn.Module):
    """Depthwise causal Conv1d over time, GELU, then a bias-free `mix` projection."""

    def __init__(self, cfg: ModelConfig, dilation: int) -> None:
        super().__init__()
        self.pad = 2 * dilation  # (kernel - 1) * dilation, all on the left: causal
        self.conv = nn.Conv1d(cfg.width, cfg.width, 3, dilation=dilation, groups=cfg.width,
                              bias=False)
        self.mix = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.pad(x.transpose(1, 2), (self.pad, 0))  # (B, C, pad + T)
        h = self.conv(h).transpose(1, 2)  # (B, T, C)
        return self.mix(F.gelu(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        if cfg.family == "gated-gqa":
            self.norm1, self.norm2 = nn.RMSNorm(cfg.width), nn.RMSNorm(cfg.width)
            self.mixer: nn.Module = GroupedQueryAttention(cfg)
            self.ffn: nn.Module = GatedFFN(cfg)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
            self.mixer = (CausalSelfAttention(cfg) if cfg.family == "transformer"
                          else CausalConvMixer(cfg, dilation=2 ** index))
            self.ffn = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.ffn(self.norm2(x))

    def residual_projections(self) -> list[nn.Parameter]:
        """The weights whose init is scaled by 1/sqrt(2 * n_layer)."""
        out = self.mixer.mix if isinstance(self.mixer, CausalConvMixer) else self.mixer.out
        return [out.weight, self.ffn.down.weight]


class Transformer(nn.Module):
    """Byte-level decoder of any family.

    Input: int64 byte ids of shape (B, T), T <= `cfg.context`. Output: logits of shape
    (B, T, vocab_size) (float32 weights; bfloat16 activations under BF16 autocast).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_emb = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.RMSNorm(cfg.width) if cfg.family == "gated-gqa" else nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in self.blocks:
            for weight in block.residual_projections():
                nn.init.normal_(weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # Norms keep weight 1 / bias 0; Conv1d keeps PyTorch's default init.

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
