"""The parity case table and its one lockstep runner (in the style of torch's OptimizerInfo).

A `Case` is a training scenario: a model, a loss, param groups, optimizer options, clipping, a
precision and a way of zeroing gradients. `run_case` trains it with the native oracle
(`cotangent.ReferenceUpdate`: `clip_grad_norm_` + `torch.optim.AdamW`) and with
`cotangent.AdamW` from one initial state, compares the loss, every gradient, the total norm,
every parameter and every state entry byte for byte after every step
(`cotangent.verify.first_difference`), and returns what it observed, so that each case can assert
that its scenario really happened (clipping active, a parameter skipped, a merged range used).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import cotangent
from bitwise import assert_same_bits, assert_same_update
from cotangent.harness.model import build_model
from cotangent.harness.packed import PackedAdamW

HP = dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}
ALL = tuple(IMPLS)


# ------------------------------------------------------------------ models, inputs, losses

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)
        self.head = nn.Linear(4, 8)

    def forward(self, x):  # x: (B, 8) -> image (B, 2, 2, 2)
        img = x.view(-1, 2, 2, 2)  # (B, C=2, H=2, W=2)
        y = self.conv2(torch.relu(self.bn(self.conv1(img))))  # (B, 4, 2, 2)
        return self.head(y.mean(dim=(2, 3)))  # (B, 8)


def channels_last_conv() -> nn.Module:
    torch.manual_seed(1)
    return ConvNet().to(memory_format=torch.channels_last)


class Tied(nn.Module):
    """Tied embedding/head, a frozen parameter and a zero-size one."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 8)
        self.mid = nn.Linear(8, 8, bias=False)
        self.zero = nn.Parameter(torch.zeros(0))
        self.frozen = nn.Parameter(torch.ones(8), requires_grad=False)

    def forward(self, x):
        h = self.emb(x.abs().argmax(dim=1))  # (B, 8)
        h = torch.tanh(self.mid(h)) * self.frozen + self.zero.sum()
        return h @ self.emb.weight.t()  # tied output projection (B, 8)


def tied() -> nn.Module:
    torch.manual_seed(2)
    return Tied()


def mixed_dtypes() -> nn.Module:
    m = mlp()
    m[1].to(torch.bfloat16)
    return m


def fp16_linear() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(8, 8).half())


def lm(family: str) -> Callable[[], nn.Module]:
    """A tiny byte-level LM of the harness; "-tied" shares the head with the token embedding."""
    def make():
        model = build_model(family.removesuffix("-tied"), 3)
        if family.endswith("-tied"):
            model.head.weight = model.tok_emb.weight
        return model
    return make


def vector_batch(gen, step):
    return torch.randn(4, 8, generator=gen)


def token_batch(gen, step):
    return torch.randint(0, 256, (4, 33), generator=gen)


def square(m, x, step):
    return m(x).square().mean()


def lm_loss(m, batch, step):
    logits = m(batch[:, :-1])  # (B, T, 256)
    return F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))


def mixed_loss(m, x, step):
    h = m[1](m[0](x).bfloat16()).float()
    return m[3](m[2](h)).square().mean()


def layer_norm_every_other_step(m, x, step):
    h = m[0](x)
    if step % 2 == 0:  # the LayerNorm is skipped every other step
        h = m[1](h)
    return m[3](m[2](h)).square().mean()


def nonfinite_on_steps_1_and_3(m, x, step):
    y = m(x)
    if step == 1:
        y = y * float("inf")
    if step == 3:
        y = y * float("nan")
    return y.square().mean()


def fp16_overflow(m, x, step):
    return (m(x.half()).float() * 3e4).sum()


def no_decay_groups(m):
    return [{"params": [p for p in m.parameters() if p.dim() >= 2]},
            {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0,
             "lr": 1e-2}]


def groups_out_of_model_order(m):
    return [{"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
            {"params": [p for p in m.parameters() if p.dim() >= 2]}]


def halve_tensor_lr(*optimizers):
    """A hand-written schedule: each optimizer's own tensor lr halved in place after a step."""
    def after_step(step):
        for o in optimizers:
            for g in o.param_groups:
                g["lr"].mul_(0.5)
    return after_step


def step_lr(*optimizers):
    """A StepLR scheduler per optimizer, created after the first step."""
    schedulers = []

    def after_step(step):
        if not schedulers:
            schedulers.extend(torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.7)
                              for o in optimizers)
        for s in schedulers:
            s.step()
    return after_step


# ------------------------------------------------------------------ the table

@dataclass(frozen=True)
class Case:
    """One parity scenario; `expect` lists what `run_case` must observe for it to count."""

    name: str
    model: Callable[[], nn.Module] = mlp
    loss: Callable = square
    batch: Callable = vector_batch
    impls: tuple[str, ...] = ALL
    groups: Callable | None = None  # model -> param groups (default: model.parameters())
    max_norm: float | None = 0.05
    opt: dict = field(default_factory=dict)  # more optimizer arguments (both sides)
    ours: dict = field(default_factory=dict)  # cotangent.AdamW-only arguments
    # what both sides clip: None (the optimizer's one group), "model" (model.parameters(): the
    # usual loop) or "param_groups" (the groups concatenated); with groups it must be stated
    clip_order: str | None = None
    precision: str = "fp32"  # or "bf16": forward under CPU autocast
    zero_grad: str = "optimizer"  # "optimizer" | "model" (set_to_none) | "keep" (set_to_none=False)
    micro_batches: int = 1
    steps: int = 5
    # (native optimizer, our optimizer) -> a callback run with the step index after each step
    schedule: Callable | None = None
    expect: frozenset = frozenset()  # subset of OBSERVATIONS
    packed: bool = False  # Cotangent's side is PackedAdamW (the packed design)

    def __str__(self) -> str:
        return self.name


OBSERVATIONS = {"clip-active", "clip-inactive", "skipped", "merged", "batched-norms",
                "no-clip", "single-pass", "clip-in-pass", "replayed"}
# what only the single pass shows: not expected of fused rows (native's fused kernel runs there)
SINGLE_PASS_OBSERVATIONS = frozenset({"single-pass", "clip-in-pass"})


def _lm_cases():
    cases = []
    for family in ("tiny-transformer-tied", "tiny-gated-gqa", "tiny-causal-conv"):
        for precision in ("fp32", "bf16"):
            for max_norm, expect in ((0.05, "clip-active"), (1e6, "clip-inactive")):
                cases.append(Case(
                    f"{family} {precision} {expect}", model=lm(family), loss=lm_loss,
                    batch=token_batch, max_norm=max_norm, precision=precision, steps=8,
                    opt=dict(lr=3e-3), expect=frozenset(
                        {expect, "single-pass", "replayed"}
                        | ({"clip-in-pass"} if max_norm < 1 else set()))))
    return cases


CASES: list[Case] = _lm_cases() + [
    Case("param groups, no decay on biases and norms, clip_order=model",
         groups=no_decay_groups, clip_order="model", expect=frozenset({"clip-active"})),
    Case("param groups, no decay on biases and norms, clip_order='param_groups'",
         groups=no_decay_groups, clip_order="param_groups", impls=("fused", "for-loop"),
         expect=frozenset({"clip-active"})),
    Case("groups out of model order, clip_order=model",
         groups=groups_out_of_model_order, clip_order="model", impls=("fused",),
         expect=frozenset({"clip-active"})),
    Case("amsgrad", opt=dict(amsgrad=True), expect=frozenset({"clip-active"})),
    Case("maximize", opt=dict(maximize=True), expect=frozenset({"clip-active"})),
    Case("amsgrad + maximize, no decay", opt=dict(amsgrad=True, maximize=True, weight_decay=0.0)),
    Case("tensor lr halved every step", opt=dict(lr=torch.tensor(5e-3)),
         impls=("fused", "for-loop"), schedule=halve_tensor_lr),
    Case("StepLR scheduler", steps=6, schedule=step_lr, expect=frozenset({"replayed"})),
    Case("clipping inactive", max_norm=1e6, impls=("fused",), expect=frozenset({"clip-inactive"})),
    Case("no clipping", max_norm=None, expect=frozenset({"no-clip"})),
    Case("negative max_norm flips gradients", max_norm=-0.5, impls=("fused",)),
    Case("norm type 1", opt=dict(norm_type=1.0), impls=("fused",), steps=3),
    Case("norm type 3", opt=dict(norm_type=3.0), impls=("fused",), steps=3),
    Case("norm type inf", opt=dict(norm_type=float("inf")), impls=("fused",), steps=3),
    Case("channels_last conv net", model=channels_last_conv, expect=frozenset({"clip-active"})),
    Case("tied, frozen and zero-size parameters", model=tied),
    Case("mixed dtypes (a bfloat16 LayerNorm)", model=mixed_dtypes, loss=mixed_loss,
         impls=("for-loop", "fused")),
    Case("a parameter unused every other step", loss=layer_norm_every_other_step, steps=6,
         expect=frozenset({"skipped"})),
    Case("inf then NaN gradients", loss=nonfinite_on_steps_1_and_3, steps=4),
    Case("fp16 norm overflow zeroes gradients", model=fp16_linear, loss=fp16_overflow,
         impls=("for-loop",), steps=2),
    Case("per-tensor native norms only (batched_norms=False)", ours=dict(batched_norms=False),
         expect=frozenset({"clip-active"})),
    Case("PackedAdamW: the packing-only cell", ours=dict(batched_norms=False), packed=True,
         expect=frozenset({"clip-active"})),
    Case("PackedAdamW with batched norms", model=lm("tiny-transformer-tied"), loss=lm_loss,
         batch=token_batch, packed=True, steps=4, opt=dict(lr=3e-3),
         expect=frozenset({"clip-active", "merged", "batched-norms"})),
    Case("model.zero_grad()", model=lm("tiny"),
         loss=lm_loss, batch=token_batch, zero_grad="model", impls=("fused",), steps=3),
    Case("zero_grad(set_to_none=False)", zero_grad="keep", impls=("fused", "for-loop")),
    Case("gradient accumulation over 3 micro-batches", model=lm("tiny"), loss=lm_loss,
         batch=token_batch, micro_batches=3, impls=("fused",), steps=3),
]


# ------------------------------------------------------------------ the runner

def _zero(o, model, how):
    if how == "optimizer":
        o.zero_grad()
    elif how == "keep":
        o.zero_grad(set_to_none=False)
    else:
        model.zero_grad()


def run_case(case: Case, impl: str) -> set[str]:
    """Train `case` with native and Cotangent in lockstep (see `lockstep`); returns the
    observations (see `OBSERVATIONS`)."""
    m1 = case.model()
    m2 = copy.deepcopy(m1)
    kw = dict(HP, **IMPLS[impl], **case.opt)
    norm_type = kw.pop("norm_type", 2.0)
    spec1 = case.groups(m1) if case.groups else m1.parameters()
    spec2 = case.groups(m2) if case.groups else m2.parameters()
    order1, order2 = ((m1, m2) if case.clip_order == "model"
                      else (case.clip_order, case.clip_order))
    ref = cotangent.ReferenceUpdate(spec1, max_norm=case.max_norm, norm_type=norm_type,
                                    clip_order=order1, **copy.deepcopy(kw))
    cls = PackedAdamW if case.packed else cotangent.AdamW
    opt = cls(spec2, max_norm=case.max_norm, norm_type=norm_type, clip_order=order2,
                          **copy.deepcopy(kw), **case.ours)
    return lockstep(m1, ref, m2, opt, case.steps, f"{case} ({impl})", loss=case.loss,
                    batch=case.batch, zero_grad=case.zero_grad,
                    micro_batches=case.micro_batches, precision=case.precision,
                    after_step=case.schedule(ref.optimizer, opt) if case.schedule else None)


def lockstep(m1, ref, m2, opt, steps: int, what: str, *, loss=square, batch=vector_batch,
             zero_grad: str = "optimizer", micro_batches: int = 1, precision: str = "fp32",
             edit=None, edit_before_backward: bool = False, after_step=None, first: int = 0,
             seed: int = 11) -> set[str]:
    """The one lockstep loop of the parity tests.

    Steps `first .. first + steps - 1`: zero the gradients (`zero_grad`), run `micro_batches`
    backwards per step (loss bytes compared, then every gradient), apply `edit(step, (model,
    optimizer))` to each side if given (after the backward, or before zeroing the gradients
    with `edit_before_backward`), step the native oracle `ref` and `opt`, compare the
    total norm and every parameter, gradient and state entry, then call `after_step(step)`.
    Returns the observations (see `OBSERVATIONS`). `ref` and `opt` may also be plain
    optimizers (native or Cotangent, no clipping), e.g. one resumed from a checkpoint."""
    names = [n for n, _ in m1.named_parameters()]
    gen = torch.Generator().manual_seed(seed + first)
    max_norm = getattr(ref, "max_norm", None)
    ref_opt = getattr(ref, "optimizer", ref)
    seen: set[str] = set() if max_norm is not None else {"no-clip"}
    for step in range(first, first + steps):
        if edit is not None and edit_before_backward:
            edit(step, (m1, ref_opt))
            edit(step, (m2, opt))
        _zero(ref, m1, zero_grad)
        _zero(opt, m2, zero_grad)
        for micro in range(micro_batches):
            x = batch(gen, step)
            losses = []
            for m in (m1, m2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    value = loss(m, x, step) / micro_batches
                value.backward()
                losses.append(value)
            assert_same_bits(*losses, f"{what}, step {step}.{micro}: loss")
            assert_same_update(m1.parameters(), ref_opt.state, m2.parameters(), opt.state,
                               f"{what}, step {step}.{micro} after backward", names)
        if edit is not None and not edit_before_backward:
            edit(step, (m1, ref_opt))
            edit(step, (m2, opt))
        if any(p.grad is None for p in m2.parameters() if p.requires_grad):
            seen.add("skipped")
        total = ref.step()
        opt.step()
        if max_norm is not None:
            assert_same_bits(total, opt.last_total_norm, f"{what}, step {step}: total norm")
            seen.add("clip-active" if total > max_norm else "clip-inactive")
        assert_same_update(m1.parameters(), ref_opt.state, m2.parameters(), opt.state,
                           f"{what}, step {step}", names)
        if isinstance(opt, PackedAdamW):
            calls = opt.call_summary()
            if calls["calls"] < calls["parameters"]:
                seen.add("merged")
            if any(layout["batched_buckets"] for layout in opt.layout_summary()):
                seen.add("batched-norms")
        if isinstance(opt, cotangent.AdamW):
            path = opt.update_path()
            if path["single_pass"]:
                seen.add("single-pass")
            if path["clip_in_pass"]:
                seen.add("clip-in-pass")
            if path["replayed"]:
                seen.add("replayed")
        if after_step is not None:
            after_step(step)
    if {"clip-active", "clip-inactive"} <= seen:  # mixed: neither holds on every step
        seen -= {"clip-active", "clip-inactive"}
    return seen
