"""Byte-level language models used by the training harness: four families in one file.

In the spirit of nanoGPT: a `ModelConfig` dataclass and plain modules. All models take byte ids
(vocabulary 256) and have pre-norm residual blocks, a final norm and an untied head; every linear
layer is bias-free. The transformer, gated-gqa and causal-conv families have learned token and
position embeddings and norms with affine parameters; the recurrent family (below) has neither.
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
    recurrent    `RecurrentGPT`: a prelude of blocks, a core of blocks applied `n_repeat` times,
                 a coda (effective depth n_layer = n_prelude + n_core * n_repeat + n_coda).
                 Each block: parameter-free RMSNorm -> causal self-attention (qkv, out; rotary
                 positions and parameter-free RMSNorm of q and k per head, as nanochat) and
                 parameter-free RMSNorm -> ReLU^2 MLP (up, down). Only the token embedding, the
                 head and the four block matrices have parameters: every block parameter is a
                 2-D matrix (for Muon). The core is untied, shared or replicated (`SHARINGS`).

Shapes use B (batch), T (time, <= context), C (width), H (query heads), G (K/V heads), D (head
size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


FAMILIES = ("transformer", "gated-gqa", "causal-conv", "recurrent")
SHARINGS = ("untied", "shared", "replicated")  # how a recurrent model holds its core


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Architecture of one byte-level model."""

    family: str = "transformer"  # transformer | gated-gqa | causal-conv | recurrent
    vocab_size: int = 256  # bytes
    context: int = 256  # maximum sequence length T, in bytes
    width: int = 256  # embedding width C
    n_layer: int = 4
    n_head: int = 4  # attention (query) heads; unused by causal-conv
    n_kv_head: int = 0  # gated-gqa: K/V heads (0: same as n_head)
    ffn_hidden: int = 0  # hidden width of the MLP / gated FFN (0: 4 * width)
    # recurrent only (0 elsewhere): blocks before the core, core blocks, core applications,
    # blocks after the core; n_layer is the effective depth n_prelude + n_core * n_repeat + n_coda
    n_prelude: int = 0
    n_core: int = 0
    n_repeat: int = 0
    n_coda: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}")
        recurrence = (self.n_prelude, self.n_core, self.n_repeat, self.n_coda)
        if self.family == "recurrent":
            if self.n_core < 1 or self.n_repeat < 1 or min(recurrence) < 0:
                raise ValueError("a recurrent model needs n_core >= 1, n_repeat >= 1 and "
                                 f"n_prelude, n_coda >= 0, got {recurrence}")
            depth = self.n_prelude + self.n_core * self.n_repeat + self.n_coda
            if depth != self.n_layer:
                raise ValueError(f"n_layer {self.n_layer} is not the effective depth n_prelude "
                                 f"+ n_core * n_repeat + n_coda = {depth}")
            if self.width // self.n_head % 2:
                raise ValueError(f"rotary positions need an even head size, got "
                                 f"{self.width // self.n_head}")
        elif any(recurrence):
            raise ValueError(f"n_prelude, n_core, n_repeat, n_coda are for the recurrent family, "
                             f"not {self.family}")
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
    # Recurrent (effective depth 8: 1 prelude block, 2 core blocks x 3, 1 coda block), for the
    # occurrence-aggregation study arms of `cotangent train` (U, S, P, A, AP, PA). Parameters
    # (tensors) untied or replicated / shared: 425,984 (34) / 229,376 (18) ...
    "recurrent-mini": ModelConfig(family="recurrent", context=64, width=64, n_layer=8, n_head=4,
                                  n_prelude=1, n_core=2, n_repeat=3, n_coda=1),
    # ... 1,638,400 (34) / 851,968 (18).
    "recurrent-small": ModelConfig(family="recurrent", context=128, width=128, n_layer=8,
                                   n_head=4, n_prelude=1, n_core=2, n_repeat=3, n_coda=1),
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


# ---------------------------------------------------------------------------------------------
# The recurrent family


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dimension."""
    return F.rms_norm(x, (x.size(-1),))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: x (B, H, T, D), cos and sin (T, D/2); the two halves of the head
    dimension are rotated as pairs (nanochat's convention)."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]  # 2 x (B, H, T, D/2)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)  # (B, H, T, D)


class RotaryAttention(nn.Module):
    """Causal self-attention with rotary positions and parameter-free q/k RMSNorm per head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.out = nn.Linear(cfg.width, cfg.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        H, D = self.n_head, C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # (T, D/2); bf16 under autocast
        q, k = _rms(_rotate(q, cos, sin)), _rms(_rotate(k, cos, sin))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.out(y)


class ReluSquaredMLP(MLP):
    """`MLP` with relu(x)^2 in place of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())  # (B, T, C)


class RecurrentBlock(nn.Module):
    """x + attn(rms(x)), then + mlp(rms(x)); four bias-free matrices: attn.qkv (3C, C),
    attn.out (C, C), mlp.up (hidden, C), mlp.down (C, hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = RotaryAttention(cfg)
        self.mlp = ReluSquaredMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(_rms(x), cos, sin)  # (B, T, C)
        return x + self.mlp(_rms(x))  # (B, T, C)

    def residual_projections(self) -> list[nn.Parameter]:
        """The weights whose init is scaled by 1/sqrt(2 * n_layer)."""
        return [self.attn.out.weight, self.mlp.down.weight]


class RecurrentGPT(nn.Module):
    """Byte-level recurrent-depth decoder: prelude, a core applied `n_repeat` times, coda.

    Input: int64 byte ids (B, T), T <= `cfg.context`. Output: logits (B, T, vocab_size).

    Parameters: `tok_emb` (vocab, C) and `head` (vocab, C) (AdamW in the study arms) and the
    block matrices (Muon), registered as `prelude.i`, `core.r.j` (occurrence r of core block
    j), `coda.i`. `sharing` (`SHARINGS`) decides how the core is held:
        untied      n_repeat * n_core independent blocks (every occurrence its own weights);
        shared      the n_core core blocks are stored once (`core.0.j`) and applied at every
                    occurrence, so autograd sums their gradients over the occurrences;
        replicated  one replica module per occurrence (`core.r.j`), separate leaves holding
                    copies of occurrence 0's values at init; `occurrence_groups()` lists them.
    Shared and replicated models compute the same function while the replicas agree.

    Initialisation (GPT-2 as in `Transformer`: normal(0, 0.02), residual projections attn.out
    and mlp.down normal(0, 0.02 / sqrt(2 * n_layer)), n_layer the effective depth) is drawn
    from a generator seeded by one draw of torch's global RNG, in a fixed order that does not
    depend on `sharing`: tok_emb, prelude, core occurrence 0 (block 0, 1, ...), coda, head,
    then (untied only) occurrences 1, 2, ... of the core. So for one seed every variant has
    the same embedding, prelude, coda and head, the shared core and every replica equal the
    untied model's occurrence 0, and `canonical_state()` (those tensors) hashes alike.
    """

    def __init__(self, cfg: ModelConfig, sharing: str = "untied") -> None:
        super().__init__()
        if cfg.family != "recurrent":
            raise ValueError(f"RecurrentGPT needs a recurrent config, got family {cfg.family!r}")
        if sharing not in SHARINGS:
            raise ValueError(f"unknown sharing {sharing!r}; known: {', '.join(SHARINGS)}")
        # One draw of the global RNG seeds every init draw (module constructors below also
        # draw from the global RNG, a number of times that depends on `sharing`).
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        self.cfg, self.sharing = cfg, sharing
        stored = 1 if sharing == "shared" else cfg.n_repeat  # core occurrences held as modules
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.prelude = nn.ModuleList(RecurrentBlock(cfg) for _ in range(cfg.n_prelude))
        self.core = nn.ModuleList(nn.ModuleList(RecurrentBlock(cfg) for _ in range(cfg.n_core))
                                  for _ in range(stored))
        self.coda = nn.ModuleList(RecurrentBlock(cfg) for _ in range(cfg.n_coda))
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        D = cfg.width // cfg.n_head
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # (D/2,)
        angles = torch.outer(torch.arange(cfg.context, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # (context, D/2)
        self.register_buffer("sin", angles.sin(), persistent=False)  # (context, D/2)
        self._init_weights(generator)

    @torch.no_grad()
    def _init_weights(self, generator: torch.Generator) -> None:
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * self.cfg.n_layer)

        def draw(block: RecurrentBlock) -> None:
            residual = {id(w) for w in block.residual_projections()}
            for w in block.parameters():
                w.normal_(0.0, residual_std if id(w) in residual else std, generator=generator)

        self.tok_emb.weight.normal_(0.0, std, generator=generator)
        for block in [*self.prelude, *self.core[0], *self.coda]:
            draw(block)
        self.head.weight.normal_(0.0, std, generator=generator)
        for occurrence in self.core[1:]:
            for block, first in zip(occurrence, self.core[0], strict=True):
                if self.sharing == "untied":
                    draw(block)
                else:  # replicated: a copy of occurrence 0
                    for w, w0 in zip(block.parameters(), first.parameters(), strict=True):
                        w.copy_(w0)

    def occurrence_blocks(self, r: int) -> nn.ModuleList:
        """The core blocks applied at occurrence `r` (0 <= r < n_repeat)."""
        return self.core[0 if self.sharing == "shared" else r]

    def occurrence_groups(self) -> list[list[nn.Parameter]]:
        """Replicated only: per core parameter, in the order core block j, then its
        parameters (attn.qkv, attn.out, mlp.up, mlp.down), the list of its n_repeat replica
        leaves (occurrence 0 first). Raises ValueError for another sharing."""
        if self.sharing != "replicated":
            raise ValueError(f"occurrence_groups() needs a replicated core, this one is "
                             f"{self.sharing}")
        return [list(replicas) for j in range(self.cfg.n_core)
                for replicas in zip(*(self.core[r][j].parameters()
                                      for r in range(self.cfg.n_repeat)), strict=True)]

    def matrix_parameters(self) -> list[nn.Parameter]:
        """Every block parameter (2-D matrices), in `parameters()` order."""
        embedding_and_head = {id(self.tok_emb.weight), id(self.head.weight)}
        return [p for p in self.parameters() if id(p) not in embedding_and_head]

    def canonical_state(self) -> dict[str, torch.Tensor]:
        """The tensors every sharing variant holds with the same meaning, under names that do
        not depend on the variant: tok_emb.weight, prelude.i.*, core.j.* (occurrence 0),
        coda.i.*, head.weight. Equal across variants at init for one seed."""
        state = {"tok_emb.weight": self.tok_emb.weight}
        for prefix, blocks in (("prelude", self.prelude), ("core", self.core[0]),
                               ("coda", self.coda)):
            for i, block in enumerate(blocks):
                for name, p in block.named_parameters():
                    state[f"{prefix}.{i}.{name}"] = p
        state["head.weight"] = self.head.weight
        return state

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds context {self.cfg.context}")
        cos, sin = self.cos[:T], self.sin[:T]  # (T, D/2)
        x = self.tok_emb(idx)  # (B, T, C)
        for block in self.prelude:
            x = block(x, cos, sin)  # (B, T, C)
        for r in range(self.cfg.n_repeat):
            for block in self.occurrence_blocks(r):
                x = block(x, cos, sin)  # (B, T, C)
        for block in self.coda:
            x = block(x, cos, sin)  # (B, T, C)
        return self.head(_rms(x))  # (B, T, vocab)



def build_model(name: str, seed: int, sharing: str | None = None) -> nn.Module:
    """Build model `name` with its initial weights drawn after `torch.manual_seed(seed)`.

    `sharing` (recurrent models only; default "untied"): how the core is held (`SHARINGS`,
    `RecurrentGPT`). Raises ValueError for an unknown model or sharing, or a sharing other
    than "untied" for a model of another family.
    """
    cfg = model_config(name)
    if cfg.family != "recurrent" and sharing not in (None, "untied"):
        raise ValueError(f"sharing {sharing!r} needs a recurrent model (recurrent-*); {name} "
                         f"is a {cfg.family} model")
    torch.manual_seed(seed)
    if cfg.family == "recurrent":
        return RecurrentGPT(cfg, sharing or "untied")
    return Transformer(cfg)


def shard_fsdp2(model: nn.Module) -> nn.Module:
    """`fully_shard` as torchtitan applies it: each block of the model (each element of its
    `nn.ModuleList`s; each layer with parameters of an `nn.Sequential`), then the root."""
    from torch.distributed.fsdp import fully_shard

    if isinstance(model, nn.Sequential):
        blocks = [m for m in model if any(True for _ in m.parameters())]
    else:
        blocks = [b for m in model.children() if isinstance(m, nn.ModuleList) for b in m]
    for block in blocks:
        fully_shard(block)
    return fully_shard(model)
