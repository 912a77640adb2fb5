"""What a `cotangent train` run is: its arms, settings (`TrainConfig`), their checks, the
learning-rate schedule."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from cotangent.harness import schema
from cotangent.harness.model import MODEL_CONFIGS
from cotangent.harness.schema import section, setting


BITWISE_ARMS = ("native", "cotangent", "batched-norms-only", "packing-only", "packed",
                "cotangent-zero1", "native-fsdp2", "cotangent-fsdp2")


# FSDP2 arms: the model `fully_shard`ed (`shard_fsdp2`), native's clip + fused AdamW or
# cotangent.AdamW on the DTensor parameters; data-parallel only
FSDP2_ARMS = ("native-fsdp2", "cotangent-fsdp2")


# Study arm -> (the recurrent model's sharing, the OccurrenceAggregator mode or None).
STUDY_ARMS: dict[str, tuple[str, str | None]] = {
    "U": ("untied", None), "S": ("shared", None), "P": ("replicated", "pooled"),
    "A": ("replicated", "averaged"), "AP": ("replicated", "ap"), "PA": ("replicated", "pa")}


TRAIN_ARMS = BITWISE_ARMS + tuple(STUDY_ARMS)


DEFAULT_ARMS = ("native", "cotangent")


OCCURRENCE_KEYS = ("pooled_norm", "averaged_norm", "target_norm", "realized_norm",
                   "relative_norm_mismatch", "cosine", "sync_error", "autograd_order")


NATIVE_PATH = "clip_grad_norm_(foreach=None) + torch.optim.AdamW(fused=True)"


_SETTINGS = dict(frozen=True, kw_only=True, slots=True)


@dataclass(**_SETTINGS)
class ModelSettings:
    """Which model is trained (`[model]`)."""

    name: str = setting("byte-level model (cotangent.harness.model)", "transformer-small",
                        choices=tuple(sorted(MODEL_CONFIGS)), name="model")
    compile: bool = setting("torch.compile the model (the update phase stays outside it)",
                            False)


@dataclass(**_SETTINGS)
class OptimizerSettings:
    """The bitwise arms' clip and AdamW (`[optimizer]`): native's ``clip_grad_norm_`` +
    ``torch.optim.AdamW`` or `cotangent.AdamW` with these arguments."""

    lr: float = setting("peak learning rate", 1e-3, low=0.0)
    betas: tuple[float, float] = setting("AdamW betas", (0.9, 0.95), low=0.0, high=1.0,
                                         high_open=True)
    eps: float = setting("AdamW eps", 1e-8, low=0.0)
    weight_decay: float = setting("AdamW decoupled weight decay", 0.1, low=0.0)
    max_norm: float = setting("gradient clipping threshold (global L2 norm)", 1.0, low=0.0)


@dataclass(**_SETTINGS)
class MuonSettings:
    """The study arms' (U, S, P, A, AP, PA) `cotangent.MuonAdamW` (`[muon]`; setting names
    ``muon_*``): nanochat's defaults, without its (width / 768) ** -0.5 scaling of the AdamW
    lrs. `OptimizerSettings` does not apply to these arms."""

    lr: float = setting("study arms: peak Muon lr (block matrices)", 0.02, low=0.0)
    momentum: float = setting("study arms: Muon Nesterov momentum", 0.95, low=0.0, high=1.0,
                              high_open=True)
    ns_steps: int = setting("study arms: Polar Express iterations", 5, low=1, high=5)
    beta2: float = setting("study arms: Muon (NorMuon) second-moment decay", 0.95, low=0.0,
                           high=1.0, high_open=True)
    weight_decay: float = setting("study arms: Muon cautious weight decay", 0.0, low=0.0)
    embedding_lr: float = setting("study arms: peak AdamW lr of the token embedding", 0.2,
                                  low=0.0)
    head_lr: float = setting("study arms: peak AdamW lr of the head", 0.004, low=0.0)
    adamw_betas: tuple[float, float] = setting("study arms: AdamW betas (embedding, head)",
                                               (0.8, 0.95), low=0.0, high=1.0, high_open=True)
    adamw_eps: float = setting("study arms: AdamW eps", 1e-10, low=0.0)
    adamw_weight_decay: float = setting("study arms: AdamW decoupled weight decay", 0.0,
                                        low=0.0)
    compile: bool = setting("study arms: torch.compile MuonAdamW's step functions", False)


@dataclass(**_SETTINGS)
class EvalSettings:
    """Evaluation (`[eval]`): the final valid/test bits per byte and the probes."""

    val_bytes: int = setting("final valid and test BPB on the first this many bytes; 0 = all",
                             131_072, low=0)
    every: int = setting("probe BPB on the held-out last 5% of train every this many steps; "
                         "0 = never", 0, low=0, name="eval_every")
    probe_bytes: int = setting("bytes of that held-out tail each probe evaluates", 65_536,
                               low=1)
    batch: int = setting("windows per evaluation forward pass", 16, low=1, name="eval_batch")


@dataclass(**_SETTINGS)
class DataSettings:
    """The training batches (`[data]`)."""

    batch_size: int = setting("windows per step, each context + 1 bytes", 8, low=1)


@dataclass(**_SETTINGS)
class TrainConfig:
    """One `cotangent train` run (all its arms): run-wide settings, then one section each for
    the model, the bitwise arms' optimizer, the study arms' Muon, evaluation and data. Each
    setting's type, bounds or choices and meaning are declared once
    (`cotangent.harness.schema`), with a setting name of its own (``lr``, ``muon_lr``,
    ``eval_every``: the flag, ``--set`` key and protocol ``[train]`` key); `validate_config`,
    the CLI's flags, a TOML file's tables (``[optimizer] lr = ...``) and a campaign protocol's
    `[train]` table are all checked against them. Build one from setting names with
    `train_config`."""

    steps: int = setting("optimizer updates per arm", 300, low=1)
    seed: int = setting("model init: torch.manual_seed(seed); windows: "
                        "default_rng(seed + 100000 + rank * 2**63), rank 0 in a single "
                        "process", 0, low=0, high=2**63 - 100_000,
                        high_open=True, want="an integer in [0, 2**63 - 100000)")
    arms: tuple[str, ...] = setting("which arms, trained interleaved; the first is the "
                                    "baseline", DEFAULT_ARMS, choices=TRAIN_ARMS, min_items=1,
                                    distinct=True)
    device: str = setting("device type", "cpu", choices=("cpu", "cuda", "mps"))
    precision: str = setting("auto: fp32 on CPU, bf16 autocast (fp32 weights) on cuda/mps",
                             "auto", choices=("auto", "fp32", "bf16"))
    out: str = setting("parent directory of run directories", "runs")
    model: ModelSettings = section(ModelSettings, "the model")
    optimizer: OptimizerSettings = section(OptimizerSettings, "the bitwise arms' clip + AdamW")
    muon: MuonSettings = section(MuonSettings, "the study arms' MuonAdamW", prefix="muon_")
    eval: EvalSettings = section(EvalSettings, "evaluation")
    data: DataSettings = section(DataSettings, "training batches")

    def resolved_precision(self) -> str:
        """fp32 or bf16: `precision`, with auto resolved for `device`."""
        if self.precision == "auto":
            return "fp32" if self.device == "cpu" else "bf16"
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be auto, fp32 or bf16, not {self.precision!r}")
        return self.precision


def train_config(**settings) -> TrainConfig:
    """A `TrainConfig` from setting names (``train_config(model="tiny", lr=3e-4,
    eval_every=10)``), each value checked and converted; defaults for the rest.

    Raises:
        ValueError: one line naming the first unknown setting or bad value.
    """
    return schema.build(TrainConfig, schema.check(TrainConfig, settings))


def settings_of(cfg: TrainConfig) -> dict:
    """Every setting of `cfg` by its setting name (`train_config`'s inverse)."""
    return schema.flatten(cfg)


def validate_config(cfg: TrainConfig) -> None:
    """Check every setting of `cfg` before anything is built or written.

    Raises:
        ValueError: one line naming the first bad setting (a value of the wrong type, outside
            its bounds or not among its choices, per `TrainConfig`'s field descriptions; a
            section that is not its settings dataclass), an
            `out` path that is a file, or FSDP2 arms under ``compile`` or beside arms whose
            gradients are reduced otherwise (`check_fsdp2_arms`).
    """
    for name, (kind, _) in schema.sections(TrainConfig).items():
        if not isinstance(getattr(cfg, name), kind):
            raise ValueError(f"{name} must be a {kind.__name__} (build a config from setting "
                             f"names with train_config(...)), got {getattr(cfg, name)!r}")
    schema.check(TrainConfig, settings_of(cfg))
    check_study_arms(cfg.arms, cfg.model.name)
    check_fsdp2_arms(cfg.arms, cfg.model.compile)
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ValueError(f"out {cfg.out} exists and is not a directory")


def check_fsdp2_arms(arms, compile: bool) -> None:
    """FSDP2 arms (`FSDP2_ARMS`) run without torch.compile, and only beside each other: the
    other bitwise arms' gradients are averaged by DDP's all-reduce, FSDP2's by its
    reduce-scatter, so their final hashes need not agree (the run compares every bitwise
    arm's hash).

    Raises:
        ValueError: before any rank starts.
    """
    fsdp2 = [a for a in arms if a in FSDP2_ARMS]
    if not fsdp2:
        return
    if compile:
        raise ValueError(f"the {fsdp2[0]} arm does not run under torch.compile here: leave "
                         "compile off")
    others = [a for a in arms if a not in FSDP2_ARMS and a not in STUDY_ARMS]
    if others:
        raise ValueError(f"the FSDP2 arms ({', '.join(fsdp2)}) and the DDP arms "
                         f"({', '.join(others)}) reduce gradients differently (reduce-scatter, "
                         "all-reduce): their final hashes are not comparable; train them in "
                         "separate runs")


def check_study_arms(arms, model: str) -> None:
    """Raise ValueError (one line) when a study arm is asked of a model that is not recurrent."""
    study = [a for a in arms if a in STUDY_ARMS]
    family = MODEL_CONFIGS[model].family if model in MODEL_CONFIGS else None
    if study and family != "recurrent":
        recurrent = sorted(n for n, c in MODEL_CONFIGS.items() if c.family == "recurrent")
        raise ValueError(f"arm(s) {', '.join(study)} train a recurrent model ("
                         f"{' or '.join(recurrent)}), not {model}")


class OccurrenceSyncError(RuntimeError):
    """A replicated-core study arm ended a step with replicas that differ (sync_error != 0)."""


def check_device(name: str) -> None:
    """Raise ValueError when this torch build cannot see device type `name`."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch build sees no CUDA device")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: this torch build sees no MPS device")


def warmup_steps(steps: int) -> int:
    """Linear warmup length: min(100, max(20, steps // 10))."""
    return min(100, max(20, steps // 10))


def lr_factor(step: int, steps: int) -> float:
    """Multiplier of the peak lr at update `step` (0-based): linear warmup to 1, then cosine to
    0.1."""
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


def schedule_sha256(cfg: TrainConfig, arm: str | None = None) -> str:
    """SHA-256 of the learning rate of every update (repr of the floats, in order): the
    curve's `lr` column, `cfg.optimizer.lr` scaled by `lr_factor`, or `cfg.muon.lr` for a
    study arm."""
    peak = cfg.muon.lr if arm in STUDY_ARMS else cfg.optimizer.lr
    lrs = [peak * lr_factor(step, cfg.steps) for step in range(cfg.steps)]
    return hashlib.sha256(repr(lrs).encode()).hexdigest()


def format_config(cfg: TrainConfig) -> str:
    """The resolved config as TOML: the run-wide settings, then one table per section
    (loadable again with --config)."""
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        # (JSON's escapes are TOML's, but for surrogate pairs: non-ASCII text stays as it is,
        # and DEL, which JSON leaves bare and TOML does not allow, is escaped)
        text = json.dumps(list(v) if isinstance(v, (tuple, list)) else v, ensure_ascii=False)
        return text.replace("\x7f", "\\u007f")

    top, tables = [], []
    for key, v in asdict(cfg).items():
        if isinstance(v, dict):
            tables += ["", f"[{key}]"] + [f"{k} = {value(x)}" for k, x in v.items()]
        else:
            top.append(f"{key} = {value(v)}")
    return "\n".join(top + tables)
