"""Training-loop patterns from public code, and torch.compile, against native byte for byte.

Training-loop patterns from public code, native vs Cotangent in lockstep, compared on bytes.

Each pattern is written once, as a generator over one "side" (a model plus the optimizers the
pattern builds), the way its public source writes it: Hugging Face no-decay and BEiT layer-wise
lr-decay groups with manual warmup, DINO's schedules, per-parameter clipping and cancelled
last-layer gradients, OneCycleLR / ReduceLROnPlateau, freezing and unfreezing (at construction,
mid-run, ULMFiT gradual unfreezing, lr = 0), LoRA adapters added mid-run (peft, also with a
trainable head), magnitude pruning, EMA / SWA (`torch.optim.swa_utils`), SAM (davda54/sam),
Lookahead (timm), `torch.save` of whole objects, `copy.deepcopy((model, opt))`, state-dict
rollbacks, rebuilt optimizers, gradient checkpointing, accumulation, `zero_grad` habits,
`torch.autograd.grad` with hand-assigned gradients (PCGrad), closures, the PyTorch DQN tutorial,
GANs (DCGAN, WGAN-GP, pix2pix), single-rank DDP with `no_sync`, MAML through
`torch.func.functional_call`, float32 master weights for a bfloat16 model, new task heads,
parametrizations.

The native side drives `torch.optim.AdamW` and calls `torch.nn.utils.clip_grad_norm_` where
the pattern clips; the Cotangent side builds `cotangent.AdamW(..., max_norm=...)` instead (whose
`step()` clips). Both sides start from the same initial model and see the same batches; after
every step the driver compares every clip norm, parameter, gradient and optimizer-state entry,
every param group's hyperparameters and the pattern's extra tensors (EMA weights, losses) byte
for byte (`tests/bitwise.py`), and each pattern asserts that its scenario really happened (the
frozen layer did not move, the adapters did, clipping was active, ...). Patterns Cotangent
refuses by design (a parameter's storage replaced with ``p.data = ...``, shared-memory
parameters, two packed optimizers sharing a parameter, a `clip_order` snapshot missing added
parameters) must fail with a message naming the cause, while native runs them to the end.

Holds for: CPU, torch 2.13.0, float32 (plus one bfloat16 model), for-loop / foreach / fused.

A `torch.compile`d model trained with cotangent.AdamW equals the compiled model with native
clip + AdamW (CPU, FP32, inductor), byte for byte.

Deterministic algorithms are on: without them inductor's CPU embedding backward accumulates in a
thread-dependent order, and two compiled copies of the same *native* model already differ.
"""

from __future__ import annotations

import copy
import math

import cotangent
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cotangent.harness.model import build_model
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, SWALR
from torch.utils.checkpoint import checkpoint

from bitwise import assert_same_bits, assert_same_update, same_bits
from cases import compare, drive, HP, MAX_NORM, Side


IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


ALL = list(IMPLS)


def across(variants, *, full=()):
    """`(impl, variant)` pairs: each variant in `full` with every AdamW implementation, the
    others with one implementation each, in turn (keeps the file fast)."""
    pairs = [(impl, v) for v in full for impl in ALL]
    rest = [v for v in variants if v not in full]
    return pairs + [(ALL[(k + 1) % len(ALL)], v) for k, v in enumerate(rest)]


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16),
                         nn.GELU(), nn.Linear(16, 8))


def run_pattern(pattern, impl: str, what: str, *, make=net, clipped: bool | None = True, **kw):
    """Run ``pattern(side, **kw)`` on a native and a Cotangent `Side` from one initial model
    through `cases.drive` (every ``yield`` of the pattern is a point where both sides must hold
    the same bytes). `clipped`: the clip must have been active (True), there must be no clip
    (False), or either (None)."""
    model = make()
    native, ours = Side(model, True, impl), Side(copy.deepcopy(model), False, impl)
    steps = drive(lambda side: pattern(side, **kw), native, ours, f"{what} [{impl}]")
    assert steps >= 3, what
    if clipped:  # clipping really changed the gradients at least once
        assert any(float(n) > MAX_NORM for n in native.norms), f"{what}: clipping never active"
    elif clipped is not None:
        assert not native.norms and not ours.norms
    return native, ours


def moved(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not same_bits(a.detach(), b.detach())


def live_order(model: nn.Module, how: str):
    """The `clip_order` that follows `model.parameters()` as it changes: the module itself, or
    a zero-argument callable."""
    return model if how == "module" else model.parameters


def llrd_groups(model: nn.Sequential, base_lr: float, decay: float = 0.5) -> list[dict]:
    """Layer-wise lr decay (BEiT / ELECTRA fine-tuning) with Hugging Face's no-decay split:
    groups from the top layer down, each with an extra `lr_scale` key, biases and norms
    without weight decay. The group order is not `model.parameters()` order."""
    groups = []
    for depth, layer in enumerate([model[5], model[3], model[1], model[0]]):
        scale = decay ** depth
        for wd, keep in ((0.1, True), (0.0, False)):
            params = [p for p in layer.parameters() if (p.dim() > 1) == keep]
            if params:
                groups.append(dict(params=params, lr=base_lr * scale, lr_scale=scale,
                                   weight_decay=wd))
    return groups


def llrd_with_manual_warmup(side, clip_order):
    model = side.model
    opt = side.adamw(llrd_groups(model, 5e-3), clip_order=(
        model.parameters() if clip_order == "snapshot" else live_order(model, clip_order)))
    for i in range(5):
        warm = min(1.0, (i + 1) / 3)
        for g in opt.param_groups:  # `optimizer.param_groups[i]["lr"] = ...` every step
            g["lr"] = 5e-3 * warm * g["lr_scale"]
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)  # native: clip_grad_norm_(model.parameters(), ...)
        yield
    assert opt.param_groups[-1]["lr"] == 5e-3 * 0.125


@pytest.mark.parametrize("impl, clip_order", across(["snapshot", "module", "callable"],
                                                    full=["snapshot"]))
def test_layerwise_lr_decay_groups_with_manual_warmup(impl, clip_order):
    run_pattern(llrd_with_manual_warmup, impl, "LLRD + warmup", clip_order=clip_order)


def dino_schedules(side):
    """DINO (facebookresearch/dino, main_dino.py): regularized / not regularized groups, lr and
    weight decay set per iteration (wd only on group 0), per-parameter gradient clipping through
    `p.grad.data.mul_`, the last layer's gradients cancelled (`p.grad = None`) in the first
    iterations, and the teacher updated as an EMA of the student. No global norm clipping."""
    student = side.model
    teacher = copy.deepcopy(student)
    teacher.requires_grad_(False)
    regularized = [p for n, p in student.named_parameters() if not n.endswith(".bias")
                   and p.dim() > 1]
    not_regularized = [p for n, p in student.named_parameters() if n.endswith(".bias")
                       or p.dim() == 1]
    opt = side.adamw([{"params": regularized}, {"params": not_regularized, "weight_decay": 0.0}],
                     max_norm=None)
    last = student[5]
    w_last = last.weight.detach().clone()
    for it in range(6):
        lr = 5e-3 * 0.5 * (1 + math.cos(math.pi * it / 6))
        wd = 0.04 + 0.5 * (0.4 - 0.04) * (1 - math.cos(math.pi * it / 6))
        for i, g in enumerate(opt.param_groups):
            g["lr"] = lr
            if i == 0:
                g["weight_decay"] = wd
        x, y = side.batch(it)
        opt.zero_grad()
        F.mse_loss(student(x), teacher(x) + y).backward()
        for p in student.parameters():  # utils.clip_gradients(student, clip_grad=0.1)
            if p.grad is not None:
                param_norm = p.grad.data.norm(2)
                clip_coef = 0.1 / (param_norm + 1e-6)
                if clip_coef < 1:
                    p.grad.data.mul_(clip_coef)
        if it < 3:  # utils.cancel_gradients_last_layer(epoch, student, freeze_last_layer)
            for p in last.parameters():
                p.grad = None
        opt.step()
        with torch.no_grad():
            m = 0.9
            for q, k in zip(student.parameters(), teacher.parameters()):
                k.data.mul_(m).add_((1 - m) * q.detach().data)
        side.extra = {f"teacher {n}": p for n, p in teacher.named_parameters()}
        if it == 2:
            assert same_bits(last.weight, w_last) and not opt.state.get(last.weight)
        yield
    assert moved(last.weight, w_last) and int(opt.state[last.weight]["step"]) == 3


@pytest.mark.parametrize("impl", ALL)
def test_dino_schedules_per_parameter_clipping_and_cancelled_last_layer(impl):
    run_pattern(dino_schedules, impl, "DINO", clipped=False)


def one_cycle(side):
    opt = side.adamw(side.model.parameters())
    sched = lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=6, cycle_momentum=True,
                                    base_momentum=0.85, max_momentum=0.95)
    betas = set()
    for i in range(6):
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        sched.step() if i < 5 else None
        betas.add(opt.param_groups[0]["betas"][0])
        yield
    assert len(betas) >= 3  # beta1 really cycled


@pytest.mark.parametrize("impl", ALL)
def test_one_cycle_lr_with_cycle_momentum(impl):
    run_pattern(one_cycle, impl, "OneCycleLR")


def plateau(side):
    opt = side.adamw(side.model.parameters())
    sched = lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    for i in range(5):
        x, y = side.batch(i)
        opt.zero_grad()
        loss = side.loss(x, y)
        loss.backward()
        side.step(opt)
        with torch.no_grad():  # validation loss on a fixed batch that stops improving
            val = side.loss(*side.batch(99)).item() if i < 2 else 10.0
        sched.step(val)
        side.extra = {"loss": loss.detach()}
        yield
    assert opt.param_groups[0]["lr"] < 5e-3 / 3


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_reduce_lr_on_plateau(impl):
    run_pattern(plateau, impl, "ReduceLROnPlateau")


def frozen_then_unfrozen(side, set_to_none):
    """The backbone is frozen before the optimizer is built over all parameters (the optimizer
    sees it from the start), then unfrozen after 3 steps (fine-tuning recipes)."""
    model = side.model
    model[0].requires_grad_(False)
    opt = side.adamw(model.parameters())
    w0 = model[0].weight.detach().clone()
    for i in range(6):
        if i == 3:
            model[0].requires_grad_(True)
        x, y = side.batch(i)
        opt.zero_grad(set_to_none=set_to_none)
        side.loss(x, y).backward()
        side.step(opt)
        if i < 3:
            assert same_bits(model[0].weight, w0) and not opt.state.get(model[0].weight)
        yield
    assert moved(model[0].weight, w0) and int(opt.state[model[0].weight]["step"]) == 3


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("impl", ALL)
def test_layer_frozen_at_construction_unfrozen_later(impl, set_to_none):
    run_pattern(frozen_then_unfrozen, impl, "unfrozen later", set_to_none=set_to_none)


def frozen_mid_run(side, set_to_none):
    """`requires_grad_(False)` after 2 steps. With `zero_grad(set_to_none=False)` native keeps
    updating the frozen layer (zero gradients, momentum and weight decay): Cotangent must too."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(5):
        if i == 2:
            model[0].requires_grad_(False)
            w = model[0].weight.detach().clone()
        x, y = side.batch(i)
        opt.zero_grad(set_to_none=set_to_none)
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert moved(model[0].weight, w) != set_to_none
    assert int(opt.state[model[0].weight]["step"]) == (2 if set_to_none else 5)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("impl", ALL)
def test_layer_frozen_mid_run(impl, set_to_none):
    run_pattern(frozen_mid_run, impl, "frozen mid-run", set_to_none=set_to_none)


def gradual_unfreezing(side, clip_order):
    """ULMFiT-style gradual unfreezing: the optimizer starts on the head only; each unfrozen
    layer arrives with `add_param_group` and a smaller lr. Native clips `model.parameters()`,
    whose order is not the optimizer's, so Cotangent gets `clip_order=model.parameters()` (a
    snapshot: it lists the frozen layers from the start) or the live `clip_order=model`."""
    model = side.model
    model.requires_grad_(False)
    model[5].requires_grad_(True)
    opt = side.adamw(model[5].parameters(), clip_order=(
        model.parameters() if clip_order == "snapshot" else live_order(model, clip_order)))
    for i in range(6):
        if i == 2:
            model[3].requires_grad_(True)
            opt.add_param_group({"params": model[3].parameters(), "lr": 2e-3})
        if i == 4:
            model[0].requires_grad_(True)
            model[1].requires_grad_(True)
            opt.add_param_group({"params": [*model[0].parameters(), *model[1].parameters()],
                                 "lr": 1e-3, "weight_decay": 0.0})
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert int(opt.state[model[5].weight]["step"]) == 6
    assert int(opt.state[model[3].weight]["step"]) == 4
    assert int(opt.state[model[0].weight]["step"]) == 2


@pytest.mark.parametrize("impl, clip_order", across(["snapshot", "module"], full=["snapshot"]))
def test_gradual_unfreezing_with_add_param_group(impl, clip_order):
    run_pattern(gradual_unfreezing, impl, "gradual unfreezing", clip_order=clip_order)


class LoRALinear(nn.Module):
    """A peft-style LoRA wrapper: frozen base plus `lora_B @ lora_A`, B starting at zero."""

    def __init__(self, base: nn.Linear, r: int = 2, alpha: float = 4.0, seed: int = 0) -> None:
        super().__init__()
        self.base = base
        gen = torch.Generator().manual_seed(seed)
        bound = 1 / math.sqrt(base.in_features)
        self.lora_A = nn.Parameter((torch.rand(r, base.in_features, generator=gen) * 2 - 1)
                                   * bound)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scaling = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling


def lora_mid_run(side):
    """Full fine-tuning for 2 steps, then the model is frozen (norms stay trainable), two layers
    are wrapped with LoRA adapters and the adapters join the optimizer via `add_param_group`
    (a second group: Cotangent is told the clip order, native's `model.parameters()`)."""
    model = side.model
    opt = side.adamw(model.parameters(), clip_order=model)
    for i in range(6):
        if i == 2:
            model.requires_grad_(False)
            model[1].requires_grad_(True)
            model[3] = LoRALinear(model[3], seed=1)
            model[5] = LoRALinear(model[5], seed=2)
            lora = [p for n, p in model.named_parameters() if "lora_" in n]
            opt.add_param_group({"params": lora, "lr": 1e-2, "weight_decay": 0.0})
            base_w = model[3].base.weight.detach().clone()
            a0, b0 = model[5].lora_A.detach().clone(), model[5].lora_B.detach().clone()
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert same_bits(model[3].base.weight, base_w)
    assert moved(model[5].lora_A, a0) and moved(model[5].lora_B, b0)
    assert int(opt.state[model[5].lora_B]["step"]) == 4


@pytest.mark.parametrize("impl", ALL)
def test_lora_adapters_added_mid_run(impl):
    run_pattern(lora_mid_run, impl, "LoRA")


def lora_with_trainable_head(side, how):
    """peft's `modules_to_save`: LoRA on a middle layer, the classifier head stays trainable.
    Native clips `model.parameters()`, where the adapters now come before the head while the
    optimizer lists them after it (added group); Cotangent follows the model's order with a
    live `clip_order` (the adapters do not exist yet when the optimizer is built)."""
    model = side.model
    opt = side.adamw(model.parameters(), clip_order=live_order(model, how))
    for i in range(24):  # a summation order shows in the bits in about one step of six
        if i == 2:
            model.requires_grad_(False)
            model[5].requires_grad_(True)  # modules_to_save=["head"]
            model[3] = LoRALinear(model[3], seed=1)
            opt.add_param_group({"params": [model[3].lora_A, model[3].lora_B],
                                 "lr": 1e-2, "weight_decay": 0.0})
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "3.lora_A", "3.lora_B", "5.weight", "5.bias"]


@pytest.mark.parametrize("impl, how", across(["module", "callable"], full=["module"]))
def test_lora_with_trainable_head_and_live_clip_order(impl, how):
    run_pattern(lora_with_trainable_head, impl, "LoRA + trainable head", how=how)


def lora_with_clip_order_snapshot(side):
    """As `lora_mid_run`, with the snapshot `clip_order=model.parameters()` given at
    construction and LoRA added later (native clips `model.parameters()` afresh)."""
    model = side.model
    snapshot = list(model.parameters())
    opt = side.adamw(model.parameters(), clip_order=snapshot)
    for i in range(4):
        if i == 2:
            model[3] = LoRALinear(model[3], seed=1)  # the base weights stay trainable
            opt.add_param_group({"params": [model[3].lora_A, model[3].lora_B],
                                 "weight_decay": 0.0})
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt, snapshot)  # native clips the same list
        yield
    assert model[3].lora_A.grad is not None and opt.state[model[3].lora_A]


@pytest.mark.parametrize("impl", ALL)
def test_lora_added_under_a_clip_order_snapshot(impl):
    """A snapshot does not list the adapters: as native `clip_grad_norm_(snapshot)`, the
    adapters are updated unclipped while the snapshot's gradients are clipped (so no single
    multiply over the whole gradient buffer)."""
    run_pattern(lora_with_clip_order_snapshot, impl, "LoRA under a snapshot")


def pruned_mid_run(side, clip):
    """Magnitude pruning mid-run (lottery-ticket style): `prune.l1_unstructured` keeps the same
    Parameter as `weight_orig` and masks its gradient through the forward pre-hook. It also
    re-registers it after the bias, so `model.parameters()` changes order mid-run. Native clips
    over `model.parameters()` (Cotangent: `clip_order=model`) or over the optimizer's own list
    (Cotangent: the default)."""
    import torch.nn.utils.prune as prune

    model = side.model
    opt = side.adamw(model.parameters(), clip_order=model if clip == "model" else None)
    for i in range(16):  # a summation order shows in the bits in about one step of six
        if i == 2:
            prune.l1_unstructured(model[3], "weight", amount=0.5)
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt, model.parameters() if clip == "model" else
                  [p for g in opt.param_groups for p in g["params"]])
        yield
    mask = model[3].weight_mask
    assert int(mask.sum()) == 128
    assert bool((model[3].weight_orig.grad[mask == 0] == 0).all())
    assert [n for n, _ in model[3].named_parameters()] == ["bias", "weight_orig"]


@pytest.mark.parametrize("impl, clip", across(["optimizer", "model"], full=["model"]))
def test_magnitude_pruning_mid_run(impl, clip):
    run_pattern(pruned_mid_run, impl, "pruning", clip=clip)


def ema(side):
    """`AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))` updated after each step
    (its `_foreach_lerp_` reads the packed parameters)."""
    model = side.model
    opt = side.adamw(model.parameters())
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for i in range(5):
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        averaged.update_parameters(model)
        with torch.no_grad():
            out = averaged(x)
        side.extra = {f"ema {n}": p for n, p in averaged.module.named_parameters()}
        side.extra.update(ema_out=out, n_averaged=averaged.n_averaged)
        yield


@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_ema_with_averaged_model(impl):
    run_pattern(ema, impl, "EMA")


def swa(side):
    """SWA recipe of the PyTorch docs: cosine schedule, then from `swa_start` an equal average
    and `SWALR`."""
    model = side.model
    opt = side.adamw(model.parameters())
    swa_model = AveragedModel(model)
    sched = lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    swa_sched = SWALR(opt, swa_lr=1e-3, anneal_epochs=2)
    for i in range(6):
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        if i >= 3:
            swa_model.update_parameters(model)
            swa_sched.step()
        else:
            sched.step()
        side.extra = {f"swa {n}": p for n, p in swa_model.module.named_parameters()}
        yield
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert int(swa_model.n_averaged) == 3


@pytest.mark.filterwarnings("ignore:.*lr_scheduler")
@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_swa_with_swalr(impl):
    run_pattern(swa, impl, "SWA")


class SAM(torch.optim.Optimizer):
    """davda54/sam (and its many copies): SAM shares its param groups with a base optimizer it
    builds, keeps `old_p` in its own state, climbs with `p.add_`, and restores the weights with
    ``p.data = old_p`` (`restore="data"`) or, in some copies, in place (`restore="copy_"`)."""

    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, restore="data",
                 **kwargs):
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)
        self.restore = restore

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.restore == "data":
                    p.data = self.state[p]["old_p"]
                else:
                    p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def _grad_norm(self):
        return torch.norm(torch.stack([
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2)
            for group in self.param_groups for p in group["params"] if p.grad is not None]), p=2)


def sam(side, restore, adaptive):
    model = side.model
    opt = SAM(model.parameters(), side.adamw, rho=0.05, adaptive=adaptive, restore=restore)
    for i in range(4):
        x, y = side.batch(i)
        loss = side.loss(x, y)
        loss.backward()
        opt.first_step(zero_grad=True)
        side.loss(x, y).backward()
        side.clip()
        opt.second_step(zero_grad=True)
        side.stepped(opt.base_optimizer)
        side.extra = {"loss": loss.detach()}
        yield


@pytest.mark.parametrize("impl, adaptive", across([False, True], full=[False]))
def test_sam_restoring_weights_in_place(impl, adaptive):
    run_pattern(sam, impl, "SAM copy_", restore="copy_", adaptive=adaptive)


@pytest.mark.parametrize("impl", ALL)
def test_sam_restoring_weights_by_data_assignment(impl):
    """davda54/sam restores with ``p.data = old_p``: the parameter's storage is replaced every
    step, and the base optimizer updates `old_p` from then on; Cotangent follows it there."""
    run_pattern(sam, impl, "SAM p.data", restore="data", adaptive=False)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead: shares the base optimizer's param groups (adding `lookahead_*` keys to
    them) and keeps the slow weights in the base optimizer's state, `lookahead_slow_buff`."""

    def __init__(self, base_optimizer, alpha=0.5, k=2):
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = base_optimizer.state
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = torch.empty_like(fast_p)
                param_state["lookahead_slow_buff"].copy_(fast_p)
            slow = param_state["lookahead_slow_buff"]
            slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
            fast_p.copy_(slow)

    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups

    def zero_grad(self, set_to_none=True):
        self._base_optimizer.zero_grad(set_to_none)


def lookahead(side):
    model = side.model
    base = side.adamw(model.parameters())
    opt = Lookahead(base, alpha=0.5, k=2)
    for i in range(6):
        if i == 4:  # checkpoint round trip through the wrapper, slow buffers included
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.clip()
        opt.step()
        side.stepped(base)
        yield
    assert "lookahead_slow_buff" in base.state[model[0].weight]


@pytest.mark.parametrize("impl", ALL)
def test_lookahead_slow_weights_in_optimizer_state(impl):
    run_pattern(lookahead, impl, "Lookahead")


def build(side, groups):
    """The optimizer over all parameters: one group, or LLRD groups with a snapshot
    `clip_order=model.parameters()`, the live `clip_order=model` or `clip_order=
    model.parameters` (each must follow the model through copies and saves)."""
    model = side.model
    if groups == "one group":
        return side.adamw(model.parameters())
    order = (model.parameters() if groups == "llrd + snapshot"
             else live_order(model, groups.removeprefix("llrd + ")))
    return side.adamw(llrd_groups(model, 5e-3), clip_order=order)


def owned_by(opt, model) -> bool:
    ids = {id(p) for p in model.parameters()}
    return all(id(p) in ids for g in opt.param_groups for p in g["params"])


def save_whole_objects(side, tmp_path, groups):
    """`torch.save({"model": model, "opt": opt, "sched": sched})` (whole objects, not state
    dicts), `torch.load(weights_only=False)` into new objects, training goes on with them."""
    model = side.model
    opt = build(side, groups)
    sched = lr_scheduler.StepLR(opt, 1, gamma=0.5)
    path = tmp_path / f"{'native' if side.native else 'ours'}.pt"
    for i in range(5):
        if i == 2:
            torch.save({"model": model, "opt": opt, "sched": sched}, path)
            del model, opt, sched
            ck = torch.load(path, weights_only=False)
            model, opt, sched = ck["model"], ck["opt"], ck["sched"]
            assert owned_by(opt, model) and sched.optimizer is opt
            side.model, side.opts = model, [opt]
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        sched.step()
        yield
    assert int(opt.state[model[0].weight]["step"]) == 5


@pytest.mark.parametrize("impl, groups", across(
    ["one group", "llrd + snapshot", "llrd + module", "llrd + callable"], full=["one group"]))
def test_torch_save_of_whole_model_and_optimizer_then_resume(impl, groups, tmp_path):
    run_pattern(save_whole_objects, impl, "torch.save whole", tmp_path=tmp_path, groups=groups)


def deepcopy_together(side, groups):
    """`model2, opt2 = copy.deepcopy((model, opt))` (population-based training, branching
    experiments), train the copy, then the original again: both must behave as native's."""
    model = side.model
    opt = build(side, groups)

    def train(m, o, steps):
        for i in steps:
            x, y = side.batch(i)
            o.zero_grad()
            side.loss(x, y, m).backward()
            side.step(o, m.parameters())
            yield

    yield from train(model, opt, range(2))
    model2, opt2 = copy.deepcopy((model, opt))
    assert owned_by(opt2, model2)
    before = [p.detach().clone() for p in model.parameters()]
    side.model, side.opts = model2, [opt2]
    yield from train(model2, opt2, range(2, 5))
    assert all(same_bits(p, b) for p, b in zip(model.parameters(), before))  # original intact
    side.model, side.opts = model, [opt]
    yield from train(model, opt, range(5, 7))
    assert int(opt2.state[model2[0].weight]["step"]) == 5
    assert int(opt.state[model[0].weight]["step"]) == 4


@pytest.mark.parametrize("impl, groups", across(
    ["one group", "llrd + snapshot", "llrd + module", "llrd + callable"], full=["one group"]))
def test_deepcopy_of_model_and_optimizer_together(impl, groups):
    run_pattern(deepcopy_together, impl, "deepcopy together", groups=groups)


def rollback_on_spike(side, deep):
    """Loss-spike recovery: keep `model.state_dict()` / `opt.state_dict()` (deep-copied, or, as
    many loops do by mistake, not: the optimizer's dict then aliases the live state) and load
    both back two steps later."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(6):
        if i == 2:
            saved = (copy.deepcopy(model.state_dict()),
                     copy.deepcopy(opt.state_dict()) if deep else opt.state_dict())
        if i == 3:  # evaluation / checkpoint code moves and casts the model: no-ops here
            model.eval().cpu().float().to(torch.float32).train()
        if i == 4:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert int(opt.state[model[0].weight]["step"]) == (4 if deep else 6)


@pytest.mark.parametrize("impl, deep", across([True, False], full=[True]))
def test_state_dict_rollback_mid_run(impl, deep):
    run_pattern(rollback_on_spike, impl, "rollback", deep=deep)


def optimizer_rebuilt(side):
    """fastai-style: a new optimizer is built mid-run over the same parameters (after a change
    of hyperparameters) and given the old one's `state_dict`; the old optimizer stays alive
    (a scheduler still refers to it)."""
    model = side.model
    opt = side.adamw(model.parameters())
    old_sched = lr_scheduler.StepLR(opt, 1, gamma=0.9)
    for i in range(5):
        if i == 2:
            sd = opt.state_dict()
            side.opts.remove(opt)
            opt = side.adamw(model.parameters(), weight_decay=0.05)
            opt.load_state_dict(sd)  # (brings the old weight decay back, as native)
            opt.param_groups[0]["weight_decay"] = 0.05
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert old_sched.optimizer is not opt


@pytest.mark.filterwarnings("ignore:.*lr_scheduler")
@pytest.mark.parametrize("impl", ALL)
def test_optimizer_rebuilt_mid_run_while_the_old_one_lives(impl):
    run_pattern(optimizer_rebuilt, impl, "optimizer rebuilt")


class CheckpointedNet(nn.Module):
    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 8)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def checkpointed(side):
    opt = side.adamw(side.model.parameters())
    for i in range(4):
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert all(p.grad is not None for p in side.model.parameters())


@pytest.mark.parametrize("impl, use_reentrant", across([True, False], full=[True]))
def test_gradient_checkpointing(impl, use_reentrant):
    run_pattern(checkpointed, impl, "checkpointing",
             make=lambda: CheckpointedNet(use_reentrant))


class TwoHeads(nn.Module):
    """A trunk with a main and an auxiliary head (the aux head is used only sometimes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU())
        self.head = nn.Linear(16, 8)
        self.aux = nn.Linear(16, 8)
        self.unused = nn.Linear(16, 8)  # never in any loss

    def forward(self, x, aux: bool = False):
        h = self.trunk(x)
        return self.head(h) + (self.aux(h) if aux else 0)


def accumulation(side):
    """Gradient accumulation over 3 micro-batches (loss / 3), a `no_grad` eval forward between
    micro-steps (logging), the aux head only in micro-batch 0 of even steps."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(5):
        opt.zero_grad()
        for micro in range(3):
            x, y = side.batch(10 * i + micro)
            F.mse_loss(model(x, aux=(micro == 0 and i % 2 == 0)), y).div(3).backward()
            model.eval()
            with torch.no_grad():
                side.extra = {"eval": model(x)}
            model.train()
        side.step(opt)
        yield
    assert int(opt.state[model.aux.weight]["step"]) == 3
    assert not opt.state.get(model.unused.weight) and model.unused.weight.grad is None


@pytest.mark.parametrize("impl", ALL)
def test_gradient_accumulation_with_no_grad_micro_steps(impl):
    run_pattern(accumulation, impl, "accumulation", make=TwoHeads)


def keep_grads(side):
    """`optimizer.zero_grad(set_to_none=False)` every step: the aux head, used only at step 0,
    keeps a zero gradient and is updated (momentum, decay) at every step, as native."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(5):
        x, y = side.batch(i)
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(x, aux=i == 0), y).backward()
        side.step(opt)
        yield
    assert int(opt.state[model.aux.weight]["step"]) == 5
    assert model.unused.weight.grad is None and not opt.state.get(model.unused.weight)


@pytest.mark.parametrize("impl", ALL)
def test_zero_grad_set_to_none_false(impl):
    run_pattern(keep_grads, impl, "set_to_none=False", make=TwoHeads)


def model_zero_grad(side, set_to_none):
    """`model.zero_grad()` instead of `optimizer.zero_grad()` (never called)."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(5):
        x, y = side.batch(i)
        model.zero_grad(set_to_none=set_to_none)
        F.mse_loss(model(x, aux=i % 2 == 1), y).backward()
        side.step(opt)
        yield
    assert int(opt.state[model.aux.weight]["step"]) == (2 if set_to_none else 4)


@pytest.mark.parametrize("impl, set_to_none", across([True, False], full=[True]))
def test_model_zero_grad_instead_of_optimizer_zero_grad(impl, set_to_none):
    run_pattern(model_zero_grad, impl, "model.zero_grad", make=TwoHeads, set_to_none=set_to_none)


def manual_grads(side):
    """Multi-task gradient surgery (PCGrad-style): per-task `torch.autograd.grad`, projection of
    conflicting gradients, then `p.grad = ...` assigned by hand (not for the unused head)."""
    model = side.model
    opt = side.adamw(model.parameters())
    params = [p for n, p in model.named_parameters() if not n.startswith("unused")]
    for i in range(5):
        x, y = side.batch(i)
        opt.zero_grad()
        out = model(x, aux=True)
        g1 = torch.autograd.grad(F.mse_loss(out, y), params, retain_graph=True)
        g2 = torch.autograd.grad(out.square().mean(), params)
        dot = sum((a * b).sum() for a, b in zip(g1, g2))
        if dot < 0:
            sq = sum(b.square().sum() for b in g2)
            g1 = [a - dot / sq * b for a, b in zip(g1, g2)]
        for p, a, b in zip(params, g1, g2):
            p.grad = a + b
        side.step(opt)
        yield
    assert model.unused.weight.grad is None and not opt.state.get(model.unused.weight)


@pytest.mark.parametrize("impl", ALL)
def test_autograd_grad_and_manual_grad_assignment(impl):
    run_pattern(manual_grads, impl, "autograd.grad", make=TwoHeads)


def closure_step(side):
    """`optimizer.step(closure)` (LBFGS-style loops): the closure zeroes, runs forward and
    backward and, natively, clips; its loss comes back from `step()`."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(4):
        x, y = side.batch(i)

        def closure():
            opt.zero_grad()
            loss = side.loss(x, y)
            loss.backward()
            side.clip()
            return loss

        loss = opt.step(closure)
        side.stepped(opt)
        side.extra = {"loss": loss.detach()}
        yield


@pytest.mark.parametrize("impl", ALL)
def test_step_with_closure(impl):
    run_pattern(closure_step, impl, "closure")


def value_then_norm_clipping(side, global_clip):
    """The PyTorch DQN tutorial: `AdamW(..., amsgrad=True)`, `clip_grad_value_(params, v)` before
    `step()`, a target network deep-copied from the policy and soft-updated through
    `state_dict()` / `load_state_dict()`; optionally a global norm clip after the value clip."""
    policy = side.model
    target = copy.deepcopy(policy)
    opt = side.adamw(policy.parameters(), amsgrad=True,
                     max_norm=MAX_NORM if global_clip else None)
    tau = 0.1
    for i in range(5):
        x, y = side.batch(i)
        with torch.no_grad():
            expected = target(y)
        loss = F.smooth_l1_loss(policy(x), expected)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_value_(policy.parameters(), 0.005)
        assert max(float(p.grad.abs().max()) for p in policy.parameters()) == pytest.approx(0.005)
        if global_clip:
            side.step(opt)
        else:
            opt.step()
        t_sd, p_sd = target.state_dict(), policy.state_dict()
        for key in p_sd:
            t_sd[key] = p_sd[key] * tau + t_sd[key] * (1 - tau)
        target.load_state_dict(t_sd)
        side.extra = {f"target {n}": p for n, p in target.named_parameters()}
        yield


@pytest.mark.parametrize("impl, global_clip", across([True, False], full=[True]))
def test_dqn_clip_grad_value_amsgrad_and_soft_target_update(impl, global_clip):
    run_pattern(value_then_norm_clipping, impl, "DQN", clipped=global_clip,
             global_clip=global_clip)


def own_clip_call(side, which):
    """The user keeps their own clip call and builds the optimizer without `max_norm`: torch's
    `clip_grad_norm_`, or Cotangent's drop-in `cotangent.clip_grad_norm_`, on the packed grads."""
    model = side.model
    opt = side.adamw(model.parameters(), max_norm=None)
    clip = (cotangent.clip_grad_norm_ if which == "cotangent" and not side.native
            else torch.nn.utils.clip_grad_norm_)
    for i in range(4):
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        total = clip(model.parameters(), MAX_NORM)
        opt.step()
        side.extra = {"total": total}
        assert float(total) > MAX_NORM
        yield


@pytest.mark.parametrize("impl, which", across(["cotangent", "torch"], full=["cotangent"]))
def test_own_clip_call_with_max_norm_none(impl, which):
    run_pattern(own_clip_call, impl, "own clip call", clipped=False, which=which)


def head_reset(side):
    """Plasticity / continual-learning resets (ReDo, "reset the head"): after 3 steps the head is
    re-initialised (`reset_parameters()`, seeded) and its Adam moments are zeroed row-wise in
    place for the reset units, its step count left running."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(6):
        if i == 3:
            torch.manual_seed(123)
            model[5].reset_parameters()
            rows = torch.tensor([0, 3, 5])
            for p in model[5].parameters():
                for key in ("exp_avg", "exp_avg_sq"):
                    opt.state[p][key][rows] = 0.0
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield


@pytest.mark.parametrize("impl", ALL)
def test_head_reset_with_moments_zeroed_in_place(impl):
    run_pattern(head_reset, impl, "head reset")


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))


def gan(side, variant):
    """Two optimizers on one model (GAN). "dcgan": D steps on detached fakes, then G steps
    through D (D's parameters receive gradients in G's backward, then D's zero_grad clears
    them). "pix2pix" (junyanz/pytorch-CycleGAN-and-pix2pix): D is frozen with
    `requires_grad_(False)` around G's step and unfrozen for its own. "wgan-gp": D's loss has
    a gradient penalty (`torch.autograd.grad(..., create_graph=True)` on interpolates, then a
    double backward), D's weights are clamped in place after its step (WGAN), and G's backward
    is restricted with `backward(inputs=...)`."""
    G, D = side.model.G, side.model.D
    opt_g = side.adamw(G.parameters(), betas=(0.5, 0.999))
    opt_d = side.adamw(D.parameters(), betas=(0.5, 0.999), lr=2e-3)
    for i in range(4):
        real, z = side.batch(i)
        D.requires_grad_(True)  # pix2pix / CycleGAN: set_requires_grad(netD, True)
        opt_d.zero_grad()
        fake = G(z)
        if variant != "wgan-gp":
            d_loss = F.softplus(-D(real)).mean() + F.softplus(D(fake.detach())).mean()
        else:
            alpha = torch.rand(4, 1, generator=torch.Generator().manual_seed(i))
            inter = (alpha * real + (1 - alpha) * fake.detach()).requires_grad_(True)
            (g_inter,) = torch.autograd.grad(D(inter).sum(), inter, create_graph=True)
            penalty = (g_inter.norm(2, dim=1) - 1).square().mean()
            d_loss = D(fake.detach()).mean() - D(real).mean() + 10 * penalty
        d_loss.backward()
        side.step(opt_d, D.parameters())
        if variant != "dcgan":
            for p in D.parameters():
                p.data.clamp_(-0.3, 0.3)
        if variant == "pix2pix":
            D.requires_grad_(False)  # set_requires_grad(netD, False): no D gradients in G's step
        opt_g.zero_grad()
        g_loss = F.softplus(-D(fake)).mean() if variant != "wgan-gp" else -D(fake).mean()
        if variant == "dcgan":
            g_loss.backward()
        elif variant == "pix2pix":
            (g_loss + F.l1_loss(fake, real)).backward()
            assert all(p.grad is not None for p in D.parameters())  # D's, from its own step
        else:
            d_grads = [p.grad.clone() for p in D.parameters()]
            g_loss.backward(inputs=list(G.parameters()))
            assert all(same_bits(p.grad, g) for p, g in zip(D.parameters(), d_grads))
        side.step(opt_g, G.parameters())
        side.extra = {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}
        yield


@pytest.mark.parametrize("impl, variant", across(["dcgan", "wgan-gp", "pix2pix"],
                                                 full=["dcgan"]))
def test_gan_with_two_optimizers(impl, variant):
    run_pattern(gan, impl, f"GAN {variant}", make=GAN, variant=variant)


class SACAE(nn.Module):
    """SAC-AE's layout (denisyarats/pytorch_sac_ae): an encoder shared by the critic and a
    decoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
        self.q = nn.Linear(16, 8)
        self.decoder = nn.Linear(16, 8)


def shared_encoder(side):
    """Two optimizers over overlapping parameters, as SAC-AE builds them: the critic's
    optimizer covers encoder + Q head, the encoder's optimizer (reconstruction) covers the
    encoder again; each steps after its own backward, so the encoder moves twice per
    iteration with two Adam states."""
    model = side.model
    critic_opt = side.adamw([*model.encoder.parameters(), *model.q.parameters()])
    encoder_opt = side.adamw(model.encoder.parameters(), lr=1e-3)
    decoder_opt = side.adamw(model.decoder.parameters(), lr=1e-3)
    for i in range(4):
        obs, target = side.batch(i)
        critic_opt.zero_grad()
        F.mse_loss(model.q(model.encoder(obs)), target).backward()
        side.step(critic_opt, [*model.encoder.parameters(), *model.q.parameters()])
        encoder_opt.zero_grad()
        decoder_opt.zero_grad()
        F.mse_loss(model.decoder(model.encoder(obs)), obs).backward()
        side.step(encoder_opt, model.encoder.parameters())
        side.step(decoder_opt, model.decoder.parameters())
        yield


@pytest.mark.parametrize("impl", ALL)
def test_two_optimizers_over_shared_parameters(impl):
    """The second packed optimizer over the encoder packs it into its own buffer; the first
    follows it there, and both update it, as native's do."""
    run_pattern(shared_encoder, impl, "shared encoder", make=SACAE)


def ddp(side, bucket_view):
    """DistributedDataParallel (one rank) built before the optimizer, with `no_sync()` on the
    first of two accumulation micro-steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = side.model
    wrapped = DDP(model, gradient_as_bucket_view=bucket_view)
    opt = side.adamw(wrapped.parameters())
    for i in range(4):
        opt.zero_grad()
        x, y = side.batch(2 * i)
        with wrapped.no_sync():
            F.mse_loss(wrapped(x), y).div(2).backward()
        x, y = side.batch(2 * i + 1)
        F.mse_loss(wrapped(x), y).div(2).backward()
        side.step(opt)
        yield


@pytest.mark.parametrize("impl, bucket_view", [("fused", True), ("for-loop", False)])
def test_ddp_single_rank_with_no_sync(impl, bucket_view, single_rank_group):
    run_pattern(ddp, impl, "DDP", bucket_view=bucket_view)


def zeroing_habits(side, how):
    """How real loops reset (or forget to reset) gradients: "detach_ + zero_" is torch < 1.7's
    own `Optimizer.zero_grad`, still copied into user code (`for p in model.parameters(): if
    p.grad is not None: p.grad.detach_(); p.grad.zero_()`); "never" forgets `zero_grad`
    (gradients accumulate across steps); "before step" zeroes after the backward by mistake
    (native then updates nothing)."""
    model = side.model
    opt = side.adamw(model.parameters())
    w = model[0].weight.detach().clone()
    for i in range(4):
        x, y = side.batch(i)
        if how == "detach_ + zero_":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()
        side.loss(x, y).backward()
        if how == "before step":
            opt.zero_grad()
            opt.step()
        else:
            side.step(opt)
        yield
    assert moved(model[0].weight, w) == (how != "before step")


@pytest.mark.parametrize("how", ["detach_ + zero_", "never", "before step"])
@pytest.mark.parametrize("impl", ALL)
def test_gradient_zeroing_habits(impl, how):
    run_pattern(zeroing_habits, impl, f"zeroing {how}", clipped=how != "before step", how=how)


def clipped_twice(side):
    """Migration leftover: the user's own `clip_grad_norm_(model.parameters(), 0.05)` stays in
    the loop and the optimizer clips again (native: two clips, the second multiplies by
    0.05 / (norm + 1e-6), not exactly 1)."""
    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(4):
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        first = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert float(first) > MAX_NORM
        side.step(opt)
        side.extra = {"first clip": first}
        yield


@pytest.mark.parametrize("impl", ALL)
def test_own_clip_left_in_place_and_max_norm(impl):
    native, _ = run_pattern(clipped_twice, impl, "clipped twice", clipped=None)
    assert all(float(n) <= MAX_NORM * 1.0001 for n in native.norms)  # the second clip's input


def hogwild(side):
    """pytorch/examples mnist_hogwild: `model.share_memory()`, then each worker process (fork)
    builds its own optimizer over its copy of the model, whose parameters live on the shared
    storages, and trains. Forking inside pytest deadlocks torch's thread pool, so a worker is
    modelled in-process exactly as fork leaves it: its own Parameter objects on the parent's
    shared storages. The workers run one after the other (deterministic); the parent must see
    their updates. (With a real fork outside pytest, native workers' updates reach the parent;
    before shared-memory parameters stayed in place, Cotangent workers' silently did not.)"""
    model = side.model
    model.share_memory()
    w = model[0].weight.detach().clone()
    for worker in range(3):
        replica = copy.deepcopy(model)
        for rp, p in zip(replica.parameters(), model.parameters()):
            rp.data = p.data  # what a forked worker holds
        opt = side.adamw(replica.parameters())
        side.opts.remove(opt)  # a worker's optimizer state is not the parent's
        for i in range(2):
            x, y = side.batch(10 * worker + i)
            opt.zero_grad()
            side.loss(x, y, replica).backward()
            side.step(opt, replica.parameters())
        yield
    assert moved(model[0].weight, w)  # the parent sees the workers' updates
    assert all(p.is_shared() for p in replica.parameters())


@pytest.mark.parametrize("impl", ALL)
def test_hogwild_shared_memory_workers(impl):
    """Shared-memory parameters stay where they are (the workers' updates reach the parent)."""
    native, _ = run_pattern(hogwild, impl, "Hogwild")
    assert len(native.norms) == 6 and all(float(n) > MAX_NORM for n in native.norms)


def maml(side):
    """MAML with `torch.func.functional_call`: an inner step on fast weights built with
    `torch.autograd.grad(..., create_graph=True)`, the outer loss backpropagated through it
    (second order) into the meta-parameters, which AdamW updates."""
    from torch.func import functional_call

    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(4):
        opt.zero_grad()
        for task in range(2):
            x_s, y_s = side.batch(100 * i + 2 * task)
            x_q, y_q = side.batch(100 * i + 2 * task + 1)
            params = dict(model.named_parameters())
            inner = F.mse_loss(functional_call(model, params, (x_s,)), y_s)
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
            F.mse_loss(functional_call(model, fast, (x_q,)), y_q).div(2).backward()
        side.step(opt)
        yield


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_maml_second_order_through_functional_call(impl):
    run_pattern(maml, impl, "MAML")


def master_weights(side):
    """Manual mixed precision (apex FP16_Optimizer, Megatron): a bfloat16 model, float32
    master copies in the optimizer, `master.grad = p.grad.float()` after each backward,
    `p.data.copy_(master)` after each step."""
    model = side.model.to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
    opt = side.adamw(masters)
    for i in range(4):
        x, y = side.batch(i)
        model.zero_grad()
        F.mse_loss(model(x.bfloat16()).float(), y).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        side.step(opt, masters)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.data.copy_(m)
        side.extra = {f"master {k}": m for k, m in enumerate(masters)}
        side.extra.update({f"master {k} {key}": v for k, m in enumerate(masters)
                           for key, v in opt.state[m].items()})
        yield


@pytest.mark.parametrize("impl", ALL)
def test_float32_master_weights_for_a_bfloat16_model(impl):
    run_pattern(master_weights, impl, "master weights")


def new_task_head(side, order, clip_order):
    """Continual / transfer learning: a new classification head replaces the old one after 3
    steps and joins the optimizer with `add_param_group` (after it is attached to the model, or
    before, as some loops write it); the old head stays in the optimizer (no gradients any
    more). Native clips `model.parameters()`; Cotangent gets the live `clip_order=model`, or
    ``"param_groups"`` (the same here: the old head has no gradient). A second group needs one
    of them (`test_a_second_group_without_a_clip_order_is_refused_mid_run`)."""
    model = side.model
    opt = side.adamw(model.parameters(), clip_order=model if clip_order == "model" else clip_order)
    for i in range(6):
        if i == 3:
            old = model[5]
            torch.manual_seed(7)
            head = nn.Linear(16, 8)
            if order == "attach, then add":
                model[5] = head
                opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
            else:
                opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
                model[5] = head
            w_old = old.weight.detach().clone()
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        yield
    assert same_bits(old.weight, w_old) and old.weight.grad is None
    assert int(opt.state[model[5].weight]["step"]) == 3


@pytest.mark.parametrize("impl, order, clip_order", [
    *[(impl, "attach, then add", "param_groups") for impl in ALL],
    ("fused", "attach, then add", "model"), ("for-loop", "add, then attach", "model")])
def test_new_task_head_added_mid_run(impl, order, clip_order):
    run_pattern(new_task_head, impl, "new head", order=order, clip_order=clip_order)


def test_a_second_group_without_a_clip_order_is_refused_mid_run():
    """The same loop without `clip_order`: `add_param_group` raises (naming ``clip_order=model``)
    and leaves the optimizer as it was, which goes on stepping."""
    model = net()
    opt = cotangent.AdamW(model.parameters(), max_norm=MAX_NORM, **HP)
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()
    head = nn.Linear(16, 8)
    with pytest.raises(ValueError, match="clip_order=model"):
        opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
    assert len(opt.param_groups) == 1 and head.weight not in opt.state
    opt.zero_grad()
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()
    assert int(opt.state[model[0].weight]["step"]) == 2


class Symmetric(nn.Module):
    """The parametrization tutorial's example (no right_inverse)."""

    def forward(self, X):
        return X.triu() + X.triu(1).T


def parametrized_mid_run(side, kind):
    """`register_parametrization` after the optimizer is built; torch keeps the same Parameter
    (as `parametrizations.weight.original`) so that the optimizer goes on working. Native clips
    over the optimizer's list (the parametrization also changes `model.parameters()` order)."""
    import torch.nn.utils.parametrize as parametrize
    from torch.nn.utils.parametrizations import orthogonal

    model = side.model
    opt = side.adamw(model.parameters())
    for i in range(5):
        if i == 2:
            if kind == "symmetric":
                parametrize.register_parametrization(model[3], "weight", Symmetric())
            else:
                orthogonal(model[3])  # its right_inverse sets the Parameter to new storage
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt, [p for g in opt.param_groups for p in g["params"]])
        yield
    w = model[3].weight.detach()
    if kind == "symmetric":
        assert same_bits(w, w.T)
    else:  # (a scenario check, not a comparison of the two sides)
        assert torch.allclose(w @ w.T, torch.eye(16), atol=1e-5)


@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_parametrization_registered_mid_run(impl):
    run_pattern(parametrized_mid_run, impl, "parametrization", kind="symmetric")


@pytest.mark.parametrize("impl", ALL)
def test_orthogonal_parametrization_mid_run(impl):
    """`orthogonal()` sets the Parameter to new storage (`original.set_(...)`, so that native
    optimizers keep it): Cotangent follows it there."""
    run_pattern(parametrized_mid_run, impl, "orthogonal", kind="orthogonal")


def lr_zero_freeze(side):
    """Freezing by learning rate: the backbone group's lr is 0 for the first steps (its moments
    still advance, weight decay multiplies by exactly 1), then warmed up."""
    model = side.model
    backbone = [*model[0].parameters(), *model[1].parameters(), *model[3].parameters()]
    opt = side.adamw([{"params": backbone, "lr": 0.0}, {"params": model[5].parameters()}],
                     clip_order=model)
    w = model[0].weight.detach().clone()
    for i in range(5):
        if i == 3:
            opt.param_groups[0]["lr"] = 1e-3
        x, y = side.batch(i)
        opt.zero_grad()
        side.loss(x, y).backward()
        side.step(opt)
        if i < 3:
            assert same_bits(model[0].weight, w)
        yield
    assert moved(model[0].weight, w) and int(opt.state[model[0].weight]["step"]) == 5


@pytest.mark.parametrize("impl", ALL)
def test_backbone_frozen_by_lr_zero_then_warmed_up(impl):
    run_pattern(lr_zero_freeze, impl, "lr = 0")


class MoCo(nn.Module):
    """MoCo v3's builder (facebookresearch/moco-v3): a base encoder and a momentum encoder
    whose parameters do not require grad but are in `model.parameters()`, which AdamW gets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base_encoder = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
        self.momentum_encoder = copy.deepcopy(self.base_encoder)
        self.momentum_encoder.requires_grad_(False)

    @torch.no_grad()
    def _update_momentum_encoder(self, m):
        for param_b, param_m in zip(self.base_encoder.parameters(),
                                    self.momentum_encoder.parameters()):
            param_m.data = param_m.data * m + param_b.data * (1. - m)

    def forward(self, x1, x2, m):
        q = self.base_encoder(x1)
        with torch.no_grad():
            self._update_momentum_encoder(m)
            k = self.momentum_encoder(x2)
        return F.cross_entropy(q @ k.T, torch.arange(len(x1)))


def moco_v3(side):
    model = side.model
    opt = side.adamw(model.parameters())  # main_moco.py: AdamW(model.parameters(), ...)
    for i in range(3):
        x1, x2 = side.batch(i)
        opt.zero_grad()
        model(x1, x2, 0.9).backward()
        side.step(opt, model.parameters())
        yield


@pytest.mark.parametrize("impl", ALL)
def test_moco_v3_momentum_encoder_updated_by_data_assignment(impl):
    """MoCo v3 updates its (frozen, never stepped) momentum encoder with ``param_m.data = ...``
    every iteration: replaced storages, followed like native."""
    run_pattern(moco_v3, impl, "MoCo v3", make=MoCo)


def step_in_backward(side):
    """The PyTorch tutorial "optimizer step in backward" (memory saving): one optimizer per
    parameter, stepped and zeroed by a post-accumulate-grad hook while the backward runs;
    native clips each parameter's gradient in the hook."""
    model = side.model
    opts = {p: side.adamw([p]) for p in model.parameters()}

    def hook(p):
        side.clip([p])
        opts[p].step()
        side.stepped(opts[p])
        opts[p].zero_grad()

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    for i in range(4):
        x, y = side.batch(i)
        side.loss(x, y).backward()
        assert all(p.grad is None for p in model.parameters())
        yield
    for handle in handles:
        handle.remove()
    assert all(int(o.state[p]["step"]) == 4 for p, o in opts.items())


@pytest.mark.parametrize("impl", ALL)
def test_optimizer_step_in_backward_hooks(impl):
    run_pattern(step_in_backward, impl, "step in backward")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_compiled_model_matches_native(impl):
    torch._dynamo.reset()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _compiled_run(impl)
    finally:
        torch.use_deterministic_algorithms(previous)


def compiled_lm(side):
    """A compiled byte-level transformer trained 3 steps, clipped at every step."""
    opt = side.adamw(side.model.parameters(), lr=3e-3, max_norm=MAX_NORM)
    model = torch.compile(side.model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = torch.randint(0, 256, (8, 33), generator=gen)
        opt.zero_grad()
        logits = model(batch[:, :-1])  # (B, T, 256)
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()
        side.extra["loss"] = loss.detach()
        side.step(opt)
        yield


def _compiled_run(impl):
    run_pattern(compiled_lm, impl, "compiled model", make=lambda: build_model("tiny-transformer", 9))


@pytest.mark.slow
@pytest.mark.slow
def test_backward_under_compiled_autograd_matches_native():
    """A backward traced by compiled autograd (``compiled_autograd._enable(torch.compile(...))``,
    not fullgraph): the optimizer's gradient hooks run eagerly (`torch.compiler.disable`d twins),
    as native trains; it failed inside the hook (an end-of-backward callback queued while
    dynamo traced it). fullgraph=True is not supported (the hooks graph-break). For-loop with
    the clip, foreach without, fused with: gradients after each backward (two micro-batches at
    step 1), parameters and state after each step, byte for byte (CPU, float32). One test,
    so that dynamo compiles the backward graphs once."""
    from torch._dynamo import compiled_autograd

    from bitwise import assert_same_update

    torch._dynamo.reset()
    compiler = torch.compile(backend="eager")
    for impl, flags, max_norm in (("for-loop", dict(foreach=False), 0.05),
                                  ("foreach", dict(foreach=True), None),
                                  ("fused", dict(fused=True), 0.05)):
        torch.manual_seed(0)
        m1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                 torch.nn.GELU(), torch.nn.Linear(16, 4))
        m2 = copy.deepcopy(m1)
        native = cotangent.ReferenceUpdate(m1.parameters(), max_norm=max_norm, lr=1e-2, **flags)
        ours = cotangent.AdamW(m2.parameters(), max_norm=max_norm, lr=1e-2, **flags)
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            for model, opt in ((m1, native), (m2, ours)):
                opt.zero_grad()
                for scale in ((1.0, 2.0) if step == 1 else (1.0,)):
                    loss = model(x * scale).square().mean()
                    with compiled_autograd._enable(compiler):
                        loss.backward()
            for a, b in zip(m1.parameters(), m2.parameters()):
                assert_same_bits(a.grad, b.grad, f"{impl} gradient, step {step}")
            native.step()
            ours.step()
            assert_same_update(m1.parameters(), native.optimizer.state, m2.parameters(),
                               ours.state, f"{impl} max_norm={max_norm} step {step}")
