"""PyTorch Lightning: `cotangent.AdamW` returned from `configure_optimizers` trains with the bits
of the same Lightning run over `torch.optim.AdamW` (CPU, `deterministic=True`).

Every run records, after each training batch, the loss `training_step` returned, every
parameter, every gradient (Lightning zeroes them only inside the next closure, so they are the
clipped gradients of the step), every optimizer state entry (`exp_avg`, `exp_avg_sq`, `step`)
and the learning rate, plus, in `on_before_optimizer_step`, the gradients' total norm before
the clip; two runs are compared on bytes, key by key (`tests/bitwise.py`).

What Lightning does with the optimizer (pytorch-lightning 2.6): the automatic loop calls
`optimizer.step(closure=...)`; the closure runs `training_step`, `optimizer.zero_grad()` and the
backward, then `on_before_optimizer_step` and the Trainer's clip:
`configure_gradient_clipping` -> `LightningModule.clip_gradients` ->
`Precision.clip_gradients` -> `torch.nn.utils.clip_grad_norm_(p for g in
optimizer.param_groups for p in g["params"], gradient_clip_val)`, i.e. the optimizer's
parameter order: `cotangent.AdamW`'s own with one param group, and ``clip_order="param_groups"``
with several (without it `cotangent.AdamW` refuses them).
"""

from __future__ import annotations

import importlib
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:
    import pytorch_lightning as pl
except ImportError:  # the unified package exposes the same API as lightning.pytorch
    pl = pytest.importorskip(
        "lightning.pytorch",
        reason="PyTorch Lightning is not installed: pip install 'cotangent[lightning]'")

import cotangent  # noqa: E402
from bitwise import assert_same_bits, assert_same_update, same_bits  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended:UserWarning"),
    # pytorch-lightning 2.6's own use of a torch.utils._pytree API torch 2.13 deprecates
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
]

LR = 3e-2
WD = 0.1


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _leave_global_state_as_found():
    """`Trainer(deterministic=True)` turns on `torch.use_deterministic_algorithms` and
    `seed_everything` seeds the global generators and sets environment variables; put all of it
    back so later tests in the session see what they would have seen."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    env = {k: os.environ.get(k)
           for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")}
    rng, py_rng = torch.get_rng_state(), random.getstate()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.set_rng_state(rng)
    random.setstate(py_rng)


def native(**kw):
    """`configure_optimizers` body: torch.optim.AdamW over the module's parameters."""
    return lambda params: torch.optim.AdamW(params, lr=kw.pop("lr", LR), weight_decay=WD, **kw)


def ours(max_norm=1.0, **kw):
    """`configure_optimizers` body: cotangent.AdamW over the module's parameters."""
    return lambda params: cotangent.AdamW(params, lr=kw.pop("lr", LR), weight_decay=WD,
                                          max_norm=max_norm, **kw)


class ClipThenAdamW(torch.optim.AdamW):
    """Native reference for a clip inside `step()` after the closure (what `cotangent.AdamW`
    with `max_norm` does): closure, `clip_grad_norm_` over the optimizer's parameters, AdamW."""

    def __init__(self, params, max_norm, **kw):
        super().__init__(params, **kw)
        self.max_norm = max_norm

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        torch.nn.utils.clip_grad_norm_(
            [p for g in self.param_groups for p in g["params"]], self.max_norm)
        super().step()
        return loss


def batches(n_batches, batch_size=4):
    """A fixed regression set: x (n, 8) float32, y (n, 4) float32 with targets large enough
    that the total gradient norm exceeds 1 on every step (so a clip at 1.0 is active)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n_batches * batch_size, 8, generator=g)
    y = 10 * torch.randn(n_batches * batch_size, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                       batch_size=batch_size, shuffle=False)


class Net(pl.LightningModule):
    """Linear(8, 16) - Tanh - Linear(16, 4), MSE loss; `configure_optimizers` returns
    `make_opt(self.parameters())`, with a per-step LambdaLR when `schedule`."""

    def __init__(self, make_opt, schedule=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.make_opt, self.schedule = make_opt, schedule

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = self.make_opt(self.parameters())
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.7 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualNet(Net):
    """Manual optimization: zero_grad, `manual_backward`, optionally Lightning's
    `self.clip_gradients(opt, 1.0, "norm")` or Cotangent's `opt.clip_grad_norm_()` (through the
    LightningOptimizer wrapper), then `opt.step()`."""

    def __init__(self, make_opt, clip=None):
        super().__init__(make_opt)
        self.automatic_optimization = False
        self.clip, self.clip_norms = clip, []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        if self.clip == "lightning":
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        elif self.clip == "cotangent":  # through the LightningOptimizer wrapper
            norm = opt.clip_grad_norm_()
            assert same_bits(norm, opt.last_total_norm)
            self.clip_norms.append(norm.clone())
        opt.step()
        return loss


class Record(pl.Callback):
    """Byte-exact snapshots, keyed by what they are, of everything one training batch leaves."""

    def __init__(self):
        self.seen: dict[str, torch.Tensor | None] = {}
        self.cotangent_norms: list[torch.Tensor | None] = []
        self.steps_seen = 0

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if not module.automatic_optimization:
            return  # a manual training_step may have clipped already
        # the gradients are unclipped here in both runs (Lightning clips after this hook,
        # Cotangent after the whole closure)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
        self.seen[f"step {trainer.global_step}: norm before the clip"] = \
            torch.nn.utils.get_total_norm(grads)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        tag = f"batch {trainer.fit_loop.total_batch_idx}"
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.seen[f"{tag}: loss"] = loss.detach().clone()
        opt = trainer.optimizers[0]
        self.seen[f"{tag}: lr"] = torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float64)
        for name, p in module.named_parameters():
            self.seen[f"{tag}: parameter {name}"] = p.detach().clone()
            self.seen[f"{tag}: gradient {name}"] = None if p.grad is None else p.grad.clone()
            for key, value in opt.state.get(p, {}).items():
                self.seen[f"{tag}: {key} of {name}"] = value.clone()
        if isinstance(opt, cotangent.AdamW) and trainer.global_step != self.steps_seen:
            self.cotangent_norms.append(opt.last_total_norm)  # after each optimizer step
        self.steps_seen = trainer.global_step


class Run:
    def __init__(self, module, trainer, record):
        self.module, self.trainer, self.record = module, trainer, record

    @property
    def opt(self):
        return self.trainer.optimizers[0]

    @property
    def params(self):
        return list(self.module.parameters())


def fit(make_opt, steps=3, n_batches=3, build=None, ckpt_path=None, **trainer_kw):
    """Seed, build `Net(make_opt)` (or `build()`), fit `steps` optimizer steps on CPU over
    `n_batches` batches an epoch; returns the Run (module, trainer, record)."""
    pl.seed_everything(0, verbose=False)
    module = Net(make_opt) if build is None else build()
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True,
                         callbacks=[record], **trainer_kw)
    trainer.fit(module, batches(n_batches), ckpt_path=ckpt_path)
    return Run(module, trainer, record)


def differences(a: Run, b: Run) -> list[str]:
    """Every recorded key whose bytes differ between two runs (a key on one side only too)."""
    from cotangent.verify import first_difference
    out = []
    for key in sorted(set(a.record.seen) | set(b.record.seen)):
        if key not in a.record.seen or key not in b.record.seen:
            out.append(f"{key}: recorded in one run only")
            continue
        problem = first_difference(a.record.seen[key], b.record.seen[key])
        if problem is not None:
            out.append(f"{key}: {problem}")
    return out


def assert_same_run(reference: Run, run: Run, what: str) -> None:
    problems = differences(reference, run)
    assert reference.record.seen, what
    assert not problems, f"{what}: {problems[0]} (and {len(problems) - 1} more)"
    assert_same_update(reference.params, reference.opt.state, run.params, run.opt.state, what,
                       names=[n for n, _ in reference.module.named_parameters()])


def assert_norms_match(reference: Run, run: Run, what: str) -> None:
    """Cotangent's `last_total_norm` after each step of `run` equals the native total norm of
    that step in `reference`."""
    native_norms = [reference.record.seen[k] for k in run.record.seen if "norm before" in k]
    assert len(native_norms) == len(run.record.cotangent_norms) > 0, what
    for i, (a, b) in enumerate(zip(native_norms, run.record.cotangent_norms)):
        assert_same_bits(a, b, f"{what}: total norm of step {i}")
        assert a.item() > 1.0, f"{what}: the clip at 1.0 is not active at step {i}"


# ---------------------------------------------------------------------------- 1. Cotangent clips

IMPLEMENTATIONS = [pytest.param({}, id="for-loop"), pytest.param({"foreach": True}, id="foreach"),
                   pytest.param({"fused": True}, id="fused")]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_cotangent_clip_equals_lightning_gradient_clip_val(impl):
    """`cotangent.AdamW(max_norm=1.0)` without `gradient_clip_val` = native AdamW with
    `Trainer(gradient_clip_val=1.0, gradient_clip_algorithm="norm")`: losses, norms, clipped
    gradients, parameters, moments and step counts after every step."""
    reference = fit(native(**impl), gradient_clip_val=1.0, gradient_clip_algorithm="norm")
    run = fit(ours(max_norm=1.0, **impl))
    assert_same_run(reference, run, "cotangent max_norm vs Lightning gradient_clip_val")
    assert_norms_match(reference, run, "cotangent max_norm vs Lightning gradient_clip_val")


def test_the_comparison_sees_a_difference():
    """Controls: the same runs without any clip, and with the learning rate one float64 ULP
    higher, are caught by the byte comparison."""
    reference = fit(native(), gradient_clip_val=1.0)
    unclipped = fit(ours(max_norm=None))
    assert differences(reference, unclipped)
    nudged = fit(ours(max_norm=1.0, lr=math.nextafter(LR, 1.0)))
    assert differences(reference, nudged)


# ---------------------------------------------------------------------------- 2. Lightning clips


def test_lightning_clip_with_cotangent_max_norm_none():
    """`gradient_clip_val=1.0` with `cotangent.AdamW(max_norm=None)`: Lightning's own
    `clip_grad_norm_` on Cotangent's gradient views, then the update: native's bits."""
    reference = fit(native(), gradient_clip_val=1.0)
    run = fit(ours(max_norm=None), gradient_clip_val=1.0)
    assert_same_run(reference, run, "Lightning clip + cotangent(max_norm=None)")
    assert run.record.cotangent_norms == [None] * 3  # Cotangent did not clip


def test_both_clips_set_clip_twice():
    """`gradient_clip_val=1.0` AND `max_norm=1.0` clip twice, exactly like native code that
    clips twice (`ClipThenAdamW` under Lightning's clip); the second coefficient is
    1 / (norm + 1e-6) = 1 - 9.5e-7 with norm just below 1 after the first clip, so the bits
    are NOT those of a single clip: from the first step every gradient (3 to 17 ULP) and moment
    differs, parameters by 1 to 2 ULP."""
    single = fit(native(), gradient_clip_val=1.0)
    double_native = fit(lambda ps: ClipThenAdamW(ps, 1.0, lr=LR, weight_decay=WD),
                        gradient_clip_val=1.0)
    run = fit(ours(max_norm=1.0), gradient_clip_val=1.0)
    assert_same_run(double_native, run, "both clips vs native clipping twice")
    problems = {p.split(":")[0] + ":" + p.split(":")[1] for p in differences(single, run)}
    for name, _ in single.module.named_parameters():
        for what in ("gradient", "exp_avg of", "exp_avg_sq of"):
            assert f"batch 0: {what} {name}" in problems, (what, name, sorted(problems)[:4])
    # Cotangent's second norm is the norm of once-clipped gradients: just below max_norm
    assert all(n is not None and n.item() < 1.0 for n in run.record.cotangent_norms)


# ---------------------------------------------------------------------------- 3. accumulation


def test_accumulate_grad_batches():
    """`accumulate_grad_batches=2` (3 batches an epoch, so each epoch ends with a lone batch
    that Lightning steps on): native's bits at every batch, accumulating ones included."""
    reference = fit(native(), steps=4, gradient_clip_val=1.0, accumulate_grad_batches=2)
    run = fit(ours(max_norm=1.0), steps=4, accumulate_grad_batches=2)
    assert len([k for k in run.record.seen if k.endswith(": loss")]) == 6
    assert_same_run(reference, run, "accumulate_grad_batches=2")
    assert_norms_match(reference, run, "accumulate_grad_batches=2")


# ---------------------------------------------------------------------------- 4. bf16-mixed


@pytest.mark.parametrize("impl", [pytest.param({}, id="for-loop"),
                                  pytest.param({"foreach": True}, id="foreach")])
def test_bf16_mixed_precision(impl):
    """`precision="bf16-mixed"` (CPU autocast to bfloat16, float32 weights): Cotangent's clip
    vs Lightning's, same precision on both sides."""
    reference = fit(native(**impl), steps=2, precision="bf16-mixed", gradient_clip_val=1.0)
    run = fit(ours(max_norm=1.0, **impl), steps=2, precision="bf16-mixed")
    assert_same_run(reference, run, "bf16-mixed")
    assert_norms_match(reference, run, "bf16-mixed")


def test_bf16_mixed_fused_clips_where_lightning_refuses():
    """Lightning refuses `gradient_clip_val` with a fused optimizer under mixed precision (it
    assumes the optimizer unscales inside `step`); Cotangent's `max_norm` clips inside `step`,
    so fused + clip runs and equals native fused AdamW clipping inside `step`."""
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(native(fused=True), steps=1, precision="bf16-mixed", gradient_clip_val=1.0)
    reference = fit(lambda ps: ClipThenAdamW(ps, 1.0, lr=LR, weight_decay=WD, fused=True),
                    steps=2, precision="bf16-mixed")
    run = fit(ours(max_norm=1.0, fused=True), steps=2, precision="bf16-mixed")
    assert_same_run(reference, run, "bf16-mixed fused")


# ------------------------------------------------------------------- 5. closure, checkpoint


def test_step_receives_lightnings_closure():
    """Lightning calls `optimizer.step(closure=...)`: the forward, zero_grad and backward run
    inside `cotangent.AdamW.step`, and Cotangent clips after the closure returns."""
    events = []

    class Spy(cotangent.AdamW):
        def step(self, closure=None):
            events.append(("step begins", closure is not None))
            loss = super().step(closure)
            events.append(("step ends", self.last_total_norm is not None))
            return loss

    class SpyNet(Net):
        def training_step(self, batch, batch_idx):
            events.append(("forward", True))
            loss = super().training_step(batch, batch_idx)
            loss.register_hook(lambda g: events.append(("backward", True)))
            return loss

    run = fit(None, steps=2, build=lambda: SpyNet(
        lambda ps: Spy(ps, lr=LR, weight_decay=WD, max_norm=1.0)))
    assert events == [("step begins", True), ("forward", True), ("backward", True),
                      ("step ends", True)] * 2
    assert_same_run(fit(native(), steps=2, gradient_clip_val=1.0), run, "closure spy")


class StepKeyedNet(Net):
    """Trains on batch number `global_step` of a fixed table, whatever batch the DataLoader
    hands over: pytorch-lightning 2.6 resumes a plain DataLoader at the start of an epoch (a
    checkpoint of step 2 at the end of a 2-batch epoch replays batch 0 after resuming), so the
    data would not be the uninterrupted run's; keyed by step, they are."""

    TABLE = list(batches(4))

    def training_step(self, batch, batch_idx):
        return super().training_step(self.TABLE[self.global_step], batch_idx)


@pytest.mark.parametrize("first_half", ["cotangent", "native"])
def test_checkpoint_round_trip(tmp_path, first_half):
    """`trainer.save_checkpoint` after 2 steps, then a fresh module and Trainer
    `fit(..., ckpt_path=...)` to step 4 with `cotangent.AdamW`: the bytes of the uninterrupted
    native run, whichever optimizer wrote the checkpoint (native AdamW's format either way).
    Lightning asks `hasattr(optimizer, "consolidate_state_dict")` before saving: an unsharded
    `cotangent.AdamW` answers False and its `state_dict()` is saved."""
    uninterrupted = fit(None, steps=4, n_batches=2, build=lambda: StepKeyedNet(native()),
                        gradient_clip_val=1.0)
    if first_half == "cotangent":
        half = fit(None, steps=2, n_batches=2, build=lambda: StepKeyedNet(ours(max_norm=1.0)))
        assert not hasattr(half.opt, "consolidate_state_dict")
        with pytest.raises(RuntimeError, match="not sharded"):
            half.opt.consolidate_state_dict()
    else:
        half = fit(None, steps=2, n_batches=2, build=lambda: StepKeyedNet(native()),
                   gradient_clip_val=1.0)
    path = tmp_path / "half.ckpt"
    half.trainer.save_checkpoint(path)

    def another_initialisation():  # the checkpoint must overwrite it
        torch.manual_seed(1)
        return StepKeyedNet(ours(max_norm=1.0))

    resumed = fit(None, steps=4, n_batches=2, build=another_initialisation, ckpt_path=path)
    assert resumed.trainer.global_step == 4
    assert {k.split(":")[0] for k in resumed.record.seen} == {"batch 2", "batch 3", "step 2",
                                                              "step 3"}
    for key, value in resumed.record.seen.items():
        assert_same_bits(uninterrupted.record.seen[key], value, f"resumed, {key}")
    assert_same_update(uninterrupted.params, uninterrupted.opt.state, resumed.params,
                       resumed.opt.state, "resumed from the checkpoint")
    assert_norms_match(uninterrupted, resumed, "resumed from the checkpoint")


# ---------------------------------------------------------------------------- 6. scheduler, manual


def test_per_step_lr_scheduler():
    """`configure_optimizers` returning a LambdaLR with `"interval": "step"`: native's learning
    rates and bits."""
    reference = fit(None, build=lambda: Net(native(), schedule=True), gradient_clip_val=1.0)
    run = fit(None, build=lambda: Net(ours(max_norm=1.0), schedule=True))
    lrs = [v.item() for k, v in run.record.seen.items() if k.endswith(": lr")]
    assert len(set(lrs)) == 3, lrs
    assert_same_run(reference, run, "per-step LambdaLR")


def test_manual_optimization():
    """`automatic_optimization = False`: `manual_backward`, then Lightning's
    `self.clip_gradients(opt, 1.0, "norm")` + native AdamW, vs Cotangent clipping inside
    `opt.step()` and vs `opt.clip_grad_norm_()` called through the LightningOptimizer."""
    reference = fit(None, build=lambda: ManualNet(native(), clip="lightning"))
    in_step = fit(None, build=lambda: ManualNet(ours(max_norm=1.0)))
    assert_same_run(reference, in_step, "manual optimization, clip in step()")
    explicit = fit(None, build=lambda: ManualNet(ours(max_norm=1.0), clip="cotangent"))
    assert_same_run(reference, explicit, "manual optimization, opt.clip_grad_norm_()")
    norms = explicit.module.clip_norms
    assert len(norms) == 3
    for a, b in zip(norms, explicit.record.cotangent_norms):
        assert_same_bits(a, b, "clip_grad_norm_() return vs last_total_norm")
    assert same_bits(norms[0], in_step.record.cotangent_norms[0])


def test_calls_through_the_lightning_optimizer_wrapper_reach_the_optimizer():
    """`self.optimizers()` returns a `LightningOptimizer`: an instance of a class made on the
    fly that subclasses both LightningOptimizer and `cotangent.AdamW`, forwarding attribute
    reads to the wrapped optimizer. Cotangent's methods called on it (`zero_grad`,
    `clip_grad_norm_`, `add_param_group`, `load_state_dict`, `step`) act on the wrapped
    optimizer: nothing is written on the wrapper, and a clip through it is not done again by
    `step()` (before this was handled, that second clip changed every gradient by 10 to 25
    ULP)."""
    LightningOptimizer = importlib.import_module(pl.__name__ + ".core.optimizer").LightningOptimizer

    torch.manual_seed(0)
    model, reference = nn.Linear(6, 3), nn.Linear(6, 3)
    reference.load_state_dict(model.state_dict())
    opt = cotangent.AdamW(model.parameters(), lr=LR, max_norm=0.5, clip_order="param_groups")
    native_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    wrapper = LightningOptimizer(opt)
    own = set(vars(wrapper))
    assert isinstance(wrapper, cotangent.AdamW)
    x = torch.randn(5, 6)
    for _ in range(2):
        wrapper.zero_grad()
        native_opt.zero_grad()
        model(x).square().sum().backward()
        reference(x).square().sum().backward()
        norm = wrapper.clip_grad_norm_()
        native_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        assert_same_bits(native_norm, norm, "norm through the wrapper")
        assert_same_bits(native_norm, wrapper.last_total_norm, "last_total_norm, wrapper")
        assert native_norm.item() > 0.5
        opt.step()  # the raw optimizer, as Lightning's strategy steps it
        native_opt.step()
        assert_same_update(list(reference.parameters()), native_opt.state,
                           list(model.parameters()), opt.state, "clip through the wrapper")
    wrapper.load_state_dict(native_opt.state_dict())
    extra = nn.Parameter(torch.randn(4))
    wrapper.add_param_group({"params": [extra]})
    assert opt.param_groups[-1]["params"] == [extra]
    assert set(vars(wrapper)) == own, set(vars(wrapper)) - own


# ------------------------------------------------- 4. CotangentClipping: Lightning's clip, once


def _clipping_net(make_opt):
    from cotangent.integrations.lightning import CotangentClipping

    class ClippingNet(CotangentClipping, Net):
        pass

    return lambda: ClippingNet(make_opt)


@pytest.mark.parametrize("impl", [pytest.param({}, id="for-loop"),
                                  pytest.param({"fused": True}, id="fused")])
def test_cotangent_clipping_mixin_clips_once(impl):
    """With `CotangentClipping`, `gradient_clip_val=1.0` AND `max_norm=1.0` clip once (the
    optimizer's batched clip at Lightning's clip point): the single-clip native run's bits,
    where the plain module clips twice (`test_both_clips_set_clip_twice`)."""
    reference = fit(native(**impl), gradient_clip_val=1.0)
    run = fit(None, build=_clipping_net(ours(max_norm=1.0, **impl)), gradient_clip_val=1.0)
    assert_same_run(reference, run, "CotangentClipping, both set")
    assert_norms_match(reference, run, "CotangentClipping, both set")
    # and with the Trainer's clip unset it leaves the clip to step()
    run = fit(None, build=_clipping_net(ours(max_norm=1.0, **impl)))
    assert_same_run(reference, run, "CotangentClipping, gradient_clip_val unset")


def test_cotangent_clipping_mixin_leaves_other_optimizers_to_lightning():
    """A native optimizer (or `max_norm=None`) under the mixin: Lightning's own clip."""
    reference = fit(native(), gradient_clip_val=1.0)
    for make in (native(), ours(max_norm=None)):
        run = fit(None, build=_clipping_net(make), gradient_clip_val=1.0)
        assert_same_run(reference, run, "CotangentClipping, Lightning clips")


@pytest.mark.parametrize("trainer_kw", [
    pytest.param(dict(gradient_clip_val=0.5), id="another-value"),
    pytest.param(dict(gradient_clip_val=1.0, gradient_clip_algorithm="value"), id="by-value")])
def test_cotangent_clipping_mixin_refuses_two_different_clips(trainer_kw):
    """`gradient_clip_val` other than `max_norm`, or value clipping, is a ValueError at the
    first clip, before the optimizer moved anything."""
    pl.seed_everything(0, verbose=False)
    module = _clipping_net(ours(max_norm=1.0))()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **trainer_kw)
    with pytest.raises(ValueError, match="two different clips"):
        trainer.fit(module, batches(2))
    for a, b in zip(before, module.parameters()):
        assert_same_bits(a, b.detach(), "parameter after the refused clip")


def test_cotangent_clipping_mixin_refuses_a_clip_order_lightning_does_not_use():
    """A `clip_order` listing the parameters otherwise than the optimizer's param groups (here
    the module itself, with the groups in reverse order) would norm in another order than
    Lightning's clip: ValueError at the first clip, nothing moved."""
    def make(params):
        params = list(params)
        return cotangent.AdamW([{"params": params[2:]}, {"params": params[:2]}], lr=LR,
                               weight_decay=WD, max_norm=1.0, clip_order=module.net)

    pl.seed_everything(0, verbose=False)
    module = _clipping_net(make)()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="clip_order"):
        trainer.fit(module, batches(2))
    for a, b in zip(before, module.parameters()):
        assert_same_bits(a, b.detach(), "parameter after the refused clip")


def _groups(params):
    """Decay / no-decay groups of the module's parameters (biases last: not module order)."""
    params = list(params)
    return [{"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("mixin", [False, True], ids=["plain", "CotangentClipping"])
def test_param_groups_need_the_clip_order_lightning_uses(mixin):
    """Two param groups: `cotangent.AdamW(groups, max_norm=1.0)` without `clip_order` is refused
    in `configure_optimizers` (nothing trained); with ``clip_order="param_groups"`` (the order
    Lightning's `gradient_clip_val` clips) the run has the native Lightning run's bits."""
    def make(order):
        return lambda params: cotangent.AdamW(_groups(params), lr=LR, weight_decay=WD,
                                              max_norm=1.0, **order)
    build = (lambda m: _clipping_net(m)) if mixin else (lambda m: (lambda: Net(m)))
    with pytest.raises(ValueError, match="clip_order='param_groups'"):
        fit(None, build=build(make({})), gradient_clip_val=1.0 if mixin else None)
    reference = fit(lambda params: torch.optim.AdamW(_groups(params), lr=LR, weight_decay=WD),
                    gradient_clip_val=1.0)
    run = fit(None, build=build(make({"clip_order": "param_groups"})),
              gradient_clip_val=1.0 if mixin else None)
    assert_same_run(reference, run, "param groups, clip_order='param_groups'")
    assert_norms_match(reference, run, "param groups, clip_order='param_groups'")


MODEL_PARALLEL_SCRIPT = '''\
import hashlib, sys, warnings
warnings.filterwarnings("ignore")
import torch
import pytorch_lightning as pl
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
import cotangent
from cotangent.integrations.lightning import CotangentClipping

optimizer, clip, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]


class Model(CotangentClipping, pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(),
                                       torch.nn.Linear(33, 8))

    def configure_model(self):  # FSDP2 over the strategy's data-parallel mesh, per layer + root
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, i):
        return self.net(batch).square().mean()

    def configure_optimizers(self):
        if optimizer == "native":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        return cotangent.AdamW(self.parameters(), lr=1e-2, fused=True, max_norm=clip)


data = torch.utils.data.DataLoader(torch.randn(48, 16, generator=torch.Generator().manual_seed(1)),
                                   batch_size=4)
trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=5, gradient_clip_val=clip or None,
                     strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
model = Model()
trainer.fit(model, data)
h = hashlib.sha256()
for name, t in model.net.state_dict().items():
    assert type(t).__name__ == "DTensor", (name, type(t))
    h.update(t.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
with open(f"{out}/rank{trainer.global_rank}.sha256", "w") as f:  # (ranks share stdout)
    f.write(h.hexdigest())
# gloo's worker threads can outlive the interpreter's teardown and abort the process (SIGABRT,
# "terminate called without an active exception"): skip the teardown, as the harness's ranks
# do (cotangent.harness.train.end_rank_process)
import os
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
'''


def _model_parallel_hashes(tmp_path, optimizer: str, clip: float) -> list[str]:
    """Each rank's SHA-256 of the full final parameters of a 2-rank ModelParallelStrategy fit
    (torchrun, gloo), in a subprocess that a hung rank cannot outlive."""
    import subprocess
    import sys

    script = tmp_path / "model_parallel.py"
    script.write_text(MODEL_PARALLEL_SCRIPT)
    out = tmp_path / f"{optimizer}-{clip}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script), optimizer, str(clip),
                           str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(out / f"rank{rank}.sha256").read_text() for rank in (0, 1)]


@pytest.mark.slow
def test_model_parallel_strategy_fsdp2_is_native(tmp_path):
    """Lightning's `ModelParallelStrategy` (2 CPU ranks, gloo, FSDP2 applied in
    `configure_model`): `cotangent.AdamW(max_norm=c)` with ``gradient_clip_val=c`` (the
    `CotangentClipping` mixin) ends with the full parameters of native fused
    `torch.optim.AdamW` under Lightning's own clip, on both ranks; without the clip native
    ends elsewhere (the clip is active, so the comparison can fail)."""
    native = _model_parallel_hashes(tmp_path, "native", 0.05)
    ours = _model_parallel_hashes(tmp_path, "cotangent", 0.05)
    unclipped = _model_parallel_hashes(tmp_path, "native", 0.0)
    assert native[0] == native[1] and ours == native
    assert unclipped[0] != native[0]
