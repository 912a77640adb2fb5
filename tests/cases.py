"""The parity case table (in the style of torch's OptimizerInfo) and the one model-level driver.

`drive` runs a pattern (a generator written the way user code is) on a native and a Cotangent
`Side` and compares everything they hold at every ``yield``; every model-level parity test,
the ranks' runs included, is a pattern it runs.

A `Case` is a training scenario: a model, a loss, param groups, optimizer options, clipping, a
precision and a way of zeroing gradients. `run_case` trains it (`lockstep`) with the native oracle
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
from bitwise import assert_same_bits, assert_same_update, same_bits
from cotangent.harness.model import build_model
from cotangent.harness.packed import PackedAdamW

HP = dict(lr=5e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.05  # below the gradient norms of these models: clipping is active
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


class Side:
    """One arm of a lockstep run: its model, the optimizers it steps (compared after every
    point), the total norms of its clips, anything else it compares (`extra`: losses, EMA
    weights) and what it observed (`seen`, see `OBSERVATIONS`). A pattern is written once, as
    a generator over a side, the way user code is written: `adamw` builds
    `torch.optim.AdamW` on the native side and `cotangent.AdamW` (which clips in `step()`) on
    the other; `clip` is native code's `clip_grad_norm_` call; `step` is both."""

    def __init__(self, model: nn.Module, native: bool, impl: str = "fused",
                 opts: tuple = (), *, share: bool = False, groups: bool = True) -> None:
        self.model, self.native, self.impl = model, native, impl
        self.share = share  # holds its ZeRO-1 share's state only (`compare` then compares that)
        self.groups = groups  # whether its optimizers' param groups are compared
        self.opts: list = list(opts)  # compared after every point
        self.norms: list = []  # one per clipped step
        self.extra: dict = {}  # anything else the pattern compares (tensors)
        self.seen: set[str] = set()

    def adamw(self, params, *, max_norm=MAX_NORM, clip_order=None, **kw):
        """`torch.optim.AdamW(params, ...)` natively; `cotangent.AdamW(params, ...,
        max_norm=max_norm, clip_order=clip_order)` on the Cotangent side."""
        kw = {**HP, **IMPLS[self.impl], **kw}
        if self.native:
            opt = torch.optim.AdamW(params, **kw)
        else:
            opt = cotangent.AdamW(params, max_norm=max_norm, clip_order=clip_order, **kw)
        self.opts.append(opt)
        return opt

    def clip(self, params=None, max_norm: float = MAX_NORM) -> None:
        """Where native code calls `clip_grad_norm_(params or model.parameters(), max_norm)`."""
        if self.native:
            params = self.model.parameters() if params is None else params
            self.norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def stepped(self, opt) -> None:
        """After a clipping `opt.step()`: the norm Cotangent's step computed."""
        if not self.native:
            self.norms.append(opt.last_total_norm)

    def step(self, opt, params=None, max_norm: float | None = MAX_NORM) -> None:
        """Native's clip (of `params`, default the model's) then `opt.step()`; Cotangent's
        `opt.step()` clipping itself. `max_norm` None: no clip."""
        if max_norm is None:
            opt.step()
            return
        self.clip(params, max_norm)
        opt.step()
        self.stepped(opt)

    @staticmethod
    def batch(i: int, rows: int = 4):
        gen = torch.Generator().manual_seed(1000 + i)
        return torch.randn(rows, 8, generator=gen), torch.randn(rows, 8, generator=gen)

    def loss(self, x, y, model=None):
        return F.mse_loss((self.model if model is None else model)(x), y)


def _same_value(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and same_bits(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_value, a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _state(opt) -> dict:
    """An optimizer's state; torch's ZeroRedundancyOptimizer's: its share's (``opt.optim``)."""
    if torch.distributed.is_available():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(opt, ZeroRedundancyOptimizer):
            return opt.optim.state
    return opt.state


def compare(native: Side, ours: Side, what: str) -> int:
    """Everything the two sides hold, byte for byte (`bitwise.assert_same_update`, the one byte
    comparison): every total norm, parameter, gradient and state entry, every param group's
    hyperparameters, the extras. Returns the number of comparisons."""
    # the clip norm first: a difference there is the cause of the others
    assert len(native.norms) == len(ours.norms), f"{what}: clip count"
    for i, (a, b) in enumerate(zip(native.norms, ours.norms)):
        assert_same_bits(a, b, f"{what}: total norm of clip {i}")
    named1 = list(native.model.named_parameters())
    named2 = list(ours.model.named_parameters())
    assert [n for n, _ in named1] == [n for n, _ in named2], what
    names = [n for n, _ in named1]
    index1 = {id(p): i for i, (_, p) in enumerate(named1)}
    index2 = {id(p): i for i, (_, p) in enumerate(named2)}
    assert len(native.opts) == len(ours.opts), what
    state1 = {p: s for o in native.opts for p, s in _state(o).items()}
    state2 = {p: s for o in ours.opts for p, s in _state(o).items()}
    if ours.share:  # ZeRO-1: native's state of the parameters in this rank's share only
        held = {index2.get(id(q)) for q in state2}
        state1 = {p: s for p, s in state1.items() if index1.get(id(p)) in held}
    checks = assert_same_update([p for _, p in named1], state1, [p for _, p in named2], state2,
                                what, names=names)
    for k, (o1, o2) in enumerate(zip(native.opts, ours.opts) if ours.groups else ()):
        assert len(o1.param_groups) == len(o2.param_groups), f"{what}: optimizer {k} groups"
        for gi, (g1, g2) in enumerate(zip(o1.param_groups, o2.param_groups)):
            assert set(g1) == set(g2), f"{what}: keys of group {gi}: {sorted(set(g1) ^ set(g2))}"
            assert ([index1.get(id(p), -1) for p in g1["params"]]
                    == [index2.get(id(p), -1) for p in g2["params"]]), f"{what}: group {gi} params"
            for key in g1:
                if key != "params":
                    assert _same_value(g1[key], g2[key]), (
                        f"{what}: group {gi} {key}: {g1[key]!r} vs {g2[key]!r}")
                    checks += 1
    assert native.extra.keys() == ours.extra.keys(), what
    for key in native.extra:
        assert_same_bits(native.extra[key], ours.extra[key], f"{what}: {key}")
    return checks + len(native.norms) + len(native.extra)


def drive(pattern, native: Side, ours: Side, what: str, *, at_point=None) -> int:
    """The one model-level driver of the parity tests: run ``pattern(side)`` (a generator) on
    the native side and on Cotangent's in lockstep; at every ``yield`` both sides must hold the
    same bytes (`compare`), then ``at_point(value)`` runs with the value Cotangent's side
    yielded. Returns the number of points; the sides must end together."""
    runs = (pattern(native), pattern(ours))
    points = 0
    while True:
        reached = [next(run, _ENDED) for run in runs]  # (both advanced: neither end is missed)
        if _ENDED in reached:
            assert reached == [_ENDED, _ENDED], (
                f"{what}: the sides ran apart after {points} points "
                f"({'native' if reached[0] is _ENDED else 'Cotangent'}'s side ended first)")
            return points
        points += 1
        assert compare(native, ours, f"{what}, point {points} ({reached[1]})") > 0
        if at_point is not None:
            at_point(reached[1])


_ENDED = object()  # `drive`: a pattern's end


def lockstep(m1, ref, m2, opt, steps: int, what: str, *, loss=square, batch=vector_batch,
             zero_grad: str = "optimizer", micro_batches: int = 1, precision: str = "fp32",
             edit=None, edit_before_backward: bool = False, after_step=None, first: int = 0,
             seed: int = 11) -> set[str]:
    """The usual training loop as a pattern, run by `drive` on (model `m1`, native oracle
    `ref`) and (model `m2`, Cotangent's `opt`).

    Steps `first .. first + steps - 1`: zero the gradients (`zero_grad`), run `micro_batches`
    backwards per step (each a point: the loss and every gradient compared), apply
    ``edit(step, (model, optimizer))`` to each side if given (after the backward, or before
    zeroing the gradients with `edit_before_backward`; a point), step, compare the total norm
    and every parameter, gradient and state entry (a point), then call ``after_step(step)``.
    Returns the observations (see `OBSERVATIONS`). `ref` and `opt` may also be plain
    optimizers (native or Cotangent, no clipping), e.g. one resumed from a checkpoint."""
    max_norm = getattr(ref, "max_norm", None)
    native = Side(m1, True, opts=(getattr(ref, "optimizer", ref),))
    ours = Side(m2, False, opts=(opt,))
    stepper = {native: ref, ours: opt}

    def loop(side):
        model, o = side.model, side.opts[0]
        gen = torch.Generator().manual_seed(seed + first)
        for step in range(first, first + steps):
            if edit is not None and edit_before_backward:
                edit(step, (model, o))
                yield f"step {step}: edited"
            _zero(stepper[side], model, zero_grad)
            for micro in range(micro_batches):
                x = batch(gen, step)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    value = loss(model, x, step) / micro_batches
                value.backward()
                side.extra["loss"] = value.detach()
                yield f"step {step}.{micro}: after backward"
            if edit is not None and not edit_before_backward:
                edit(step, (model, o))
                yield f"step {step}: edited"
            if any(p.grad is None for p in model.parameters() if p.requires_grad):
                side.seen.add("skipped")
            total = stepper[side].step()
            if max_norm is not None:
                side.norms.append(total if side.native else o.last_total_norm)
                if side.native:
                    side.seen.add("clip-active" if total > max_norm else "clip-inactive")
            observe(o, side.seen)
            yield step

    def at_point(value):
        if after_step is not None and isinstance(value, int):
            after_step(value)

    drive(loop, native, ours, what, at_point=at_point)
    seen = native.seen | ours.seen | (set() if max_norm is not None else {"no-clip"})
    if {"clip-active", "clip-inactive"} <= seen:  # mixed: neither holds on every step
        seen -= {"clip-active", "clip-inactive"}
    return seen


def lockstep_params(params_n, opt_n, params_o, opt_o, steps: int, what: str, *, grads,
                    max_norm: float | None = None, share: bool = False) -> None:
    """Parameters without a model, run by `drive`: each step ``grads(step)`` (called once per
    step, its tensors cloned into each side's ``.grad``, in order; None: no gradient), native's
    ``clip_grad_norm_(params_n, max_norm)`` where `max_norm` is given (Cotangent's optimizer
    clips in its step), both steps, and every total norm, parameter, gradient and state entry
    compared (`share`: Cotangent's optimizer holds its ZeRO-1 share's state only)."""
    native = Side(nn.ParameterList(params_n), True, opts=(opt_n,))
    ours = Side(nn.ParameterList(params_o), False, opts=(opt_o,), share=share)
    drawn: dict = {}

    def loop(side):
        params, o = list(side.model.parameters()), side.opts[0]
        for step in range(steps):
            if step not in drawn:
                drawn[step] = grads(step)
            for p, g in zip(params, drawn[step], strict=True):
                p.grad = None if g is None else g.clone()
            side.step(o, params, max_norm)
            yield step

    drive(loop, native, ours, what)


def observe(opt, seen: set[str]) -> None:
    """What Cotangent's optimizer shows after a step (`OBSERVATIONS`)."""
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
