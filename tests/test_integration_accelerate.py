"""Accelerate with `cotangent.AdamW`, one CPU process (``Accelerator(cpu=True)``).

The oracle is the same Accelerate loop with `torch.optim.AdamW` and
``accelerator.clip_grad_norm_(model.parameters(), max_norm)``: losses, the norms returned,
clipped gradients, parameters and optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) are
compared byte for byte (`tests/bitwise.py`) after every optimizer step. `accelerator.prepare`
wraps the optimizer in `AcceleratedOptimizer`, whose ``step``/``zero_grad`` call ours (skipped on
the micro-steps of gradient accumulation) and whose construction round-trips our
``state_dict``; it does not replace parameters. CPU, torch 2.13.0, accelerate 1.15.0 and 1.16.0
(1.16's clip gives a NaN total norm another sign: `accelerator_clip_is_torchs_at_a_nan_norm`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cotangent
from bitwise import same_bits

pytest.importorskip("accelerate", reason="the Accelerate integration tests need accelerate: "
                                         "pip install 'cotangent[accelerate]'")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

MAX_NORM = 1.0
LR = 1e-2
BATCH = 4
IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """`Accelerator` keeps process-wide singletons (AcceleratorState, GradientState); each run
    starts from none, as Accelerate's own `AccelerateTestCase` resets them."""
    reset_accelerate()
    yield
    reset_accelerate()


def reset_accelerate() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def accelerator_clip_is_torchs_at_a_nan_norm() -> bool:
    """Behaviour probe of the installed accelerate: does ``Accelerator.clip_grad_norm_`` give the
    bytes of ``torch.nn.utils.clip_grad_norm_`` (total norm and clipped gradients) when the total
    norm is NaN? Two gradients holding -NaN: torch's total norm is -NaN (0xffc00000 on torch
    2.13). accelerate 1.15.0 called torch's function (yes); 1.16.0 takes `vector_norm` of the
    stacked per-device-mesh norms once more, which makes it +NaN, and the clipped gradients
    then hold +NaN where torch's hold -NaN (no). Leaves Accelerate's singletons reset."""
    reset_accelerate()
    try:
        acc = Accelerator(cpu=True)
        theirs = [nn.Parameter(torch.ones(2)) for _ in range(2)]
        torchs = [nn.Parameter(torch.ones(2)) for _ in range(2)]
        for a, b in zip(theirs, torchs):
            a.grad = torch.tensor([-float("nan"), 1.0])
            b.grad = a.grad.clone()
        norms = (acc.clip_grad_norm_(theirs, MAX_NORM),
                 torch.nn.utils.clip_grad_norm_(torchs, MAX_NORM))
        return same_bits(*norms) and all(same_bits(a.grad, b.grad)
                                         for a, b in zip(theirs, torchs))
    finally:
        reset_accelerate()


def nan_signs_only(a: Record, b: Record, step: int) -> bool:
    """The gradients of 1-based `step` in both records differ, and only in the sign of NaNs
    (every other byte equal, NaN where the other is NaN)."""
    differ = False
    for u, v in zip(a.snaps[step - 1]["grads"], b.snaps[step - 1]["grads"]):
        x, y = u.view(torch.int32), v.view(torch.int32)
        if not torch.equal(u.isnan(), v.isnan()):
            return False
        xor = x ^ y
        if not bool(((xor == 0) | ((xor == -2 ** 31) & u.isnan())).all()):
            return False
        differ |= bool((xor != 0).any())
    return differ


@dataclass
class Setup:
    acc: Accelerator
    model: nn.Module
    opt: torch.optim.Optimizer  # as prepared (AcceleratedOptimizer)
    inner: torch.optim.Optimizer  # torch.optim.AdamW or cotangent.AdamW
    dl: object
    sched: object


@dataclass
class Record:
    losses: list = field(default_factory=list)  # every micro-step
    norms: list = field(default_factory=list)  # every optimizer step: the norm the loop reads
    inner_norms: list = field(default_factory=list)  # cotangent's last_total_norm, per step
    snaps: list = field(default_factory=list)  # every optimizer step: params, grads, state
    skipped: list = field(default_factory=list)  # AcceleratedOptimizer.step_was_skipped, per step


def setup(arm: str, *, steps: int, accum: int = 1, mixed_precision: str = "no",
          build: str = "before", impl: str = "for-loop", lr: float = LR,
          max_norm: float | None = MAX_NORM, grad_scaler: bool = False) -> Setup:
    """A fresh Accelerator, model (seed 0), data (seed 1, `steps` batches of 4, no shuffle),
    optimizer and StepLR(2, 0.5), prepared together (``build="before"``: the optimizer is built
    on the bare model, as usual; ``"after"``: on the prepared model, prepared second)."""
    reset_accelerate()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum,
                      mixed_precision=mixed_precision)
    if grad_scaler:  # Accelerate's fp16 path, which it enables off-CPU only (see its test)
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(steps * BATCH, 8, generator=gen)
    y = torch.randn(steps * BATCH, 4, generator=gen)
    if grad_scaler:
        x[BATCH, 0] = float("inf")  # batch 2 overflows: the scaler skips that update
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)

    def make(params):
        kwargs = dict(lr=lr, weight_decay=0.1, **IMPLS[impl])
        if arm == "native":
            return torch.optim.AdamW(params, **kwargs)
        return cotangent.AdamW(params, max_norm=max_norm, **kwargs)

    if build == "before":
        inner = make(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(inner, 2, 0.5)
        model, opt, dl, sched = acc.prepare(model, inner, dl, sched)
    else:
        model, dl = acc.prepare(model, dl)
        inner = make(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(inner, 2, 0.5)
        opt, sched = acc.prepare(inner, sched)
    assert opt.optimizer is inner
    assert all(a is b for a, b in zip(model.parameters(),
                                      (p for g in inner.param_groups for p in g["params"])))
    return Setup(acc, model, opt, inner, dl, sched)


def snapshot(model, inner) -> dict:
    params = list(model.parameters())
    return {"params": [p.detach().clone() for p in params],
            "grads": [None if p.grad is None else p.grad.clone() for p in params],
            "state": [{k: v.clone() for k, v in inner.state.get(p, {}).items()}
                      for p in params]}


def train(s: Setup, *, accelerate_clip: bool, start: int = 0, stop: int | None = None,
          record: Record | None = None) -> Record:
    """Accelerate's loop: ``with accelerator.accumulate(model)``, `accelerator.backward`, on
    sync steps `accelerator.clip_grad_norm_` (with `accelerate_clip`), then `opt.step()`,
    `sched.step()`, `opt.zero_grad()`. Batches [start, stop)."""
    record = record or Record()
    dl = s.acc.skip_first_batches(s.dl, start) if start else s.dl
    for i, (x, y) in enumerate(dl, start):
        if i == stop:
            break
        with s.acc.accumulate(s.model):
            loss = F.mse_loss(s.model(x), y)
            s.acc.backward(loss)
            norm = None
            if s.acc.sync_gradients and accelerate_clip:
                norm = s.acc.clip_grad_norm_(s.model.parameters(), MAX_NORM)
            s.opt.step()
            s.sched.step()
            if s.acc.sync_gradients:
                inner_norm = getattr(s.inner, "last_total_norm", None)
                record.norms.append(norm if accelerate_clip else inner_norm)
                record.inner_norms.append(inner_norm)
                record.snaps.append(snapshot(s.model, s.inner))
                record.skipped.append(s.opt.step_was_skipped)
            s.opt.zero_grad()
        record.losses.append(loss.detach().clone())
    return record


def differences(a: Record, b: Record, what: str = "", norms: bool = True,
                skip_grads_at: tuple = ()) -> list[str]:
    """Byte comparison of two records: losses, norms (with `norms`), and every snapshot's
    tensors (but the gradients of the 1-based steps in `skip_grads_at`)."""
    found = []
    if (len(a.losses), len(a.snaps)) != (len(b.losses), len(b.snaps)):
        return [f"{what}: {len(a.losses)}/{len(a.snaps)} vs {len(b.losses)}/{len(b.snaps)} "
                "micro-steps/steps"]
    found += [f"{what}: loss {i}" for i, (x, y) in enumerate(zip(a.losses, b.losses))
              if not same_bits(x, y)]
    found += [f"{what}: norm at step {i + 1}: {x} vs {y}"
              for i, (x, y) in enumerate(zip(a.norms, b.norms))
              if norms and not same_bits(x, y)]
    for step, (x, y) in enumerate(zip(a.snaps, b.snaps), 1):
        for kind in ("params", "grads") if step not in skip_grads_at else ("params",):
            found += [f"{what}: {kind[:-1]} {j} at step {step}"
                      for j, (u, v) in enumerate(zip(x[kind], y[kind])) if not same_bits(u, v)]
        for j, (u, v) in enumerate(zip(x["state"], y["state"])):
            if set(u) != set(v):
                found.append(f"{what}: state keys of {j} at step {step}")
            found += [f"{what}: {k} of {j} at step {step}" for k in u
                      if k in v and not same_bits(u[k], v[k])]
    return found


def assert_same_run(a: Record, b: Record, what: str, norms: bool = True,
                    skip_grads_at: tuple = ()) -> None:
    problems = differences(a, b, what, norms, skip_grads_at)
    assert not problems, problems[:5] + ([f"... {len(problems)} in all"]
                                         if len(problems) > 5 else [])
    assert a.snaps, f"{what}: no optimizer step was compared"


def native_run(**kwargs) -> Record:
    steps = kwargs.pop("steps")
    return train(setup("native", steps=steps, **kwargs), accelerate_clip=True)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_built_in_clip_is_accelerates_clip_grad_norm(impl):
    """``accelerator.prepare(model, cotangent.AdamW(..., max_norm=1.0), dl, sched)`` and no
    clip call in the loop: the bits of the loop with `accelerator.clip_grad_norm_` and
    `torch.optim.AdamW` (its returned norm against ``opt.optimizer.last_total_norm``)."""
    native = native_run(steps=6, impl=impl)
    ours = train(setup("cotangent", steps=6, impl=impl), accelerate_clip=False)
    assert_same_run(native, ours, f"built-in clip, {impl}")
    assert any(float(n) > MAX_NORM for n in native.norms)  # some steps were really clipped


def test_accelerate_clip_with_an_unclipped_optimizer():
    """``cotangent.AdamW(max_norm=None)`` with the loop's own `accelerator.clip_grad_norm_`
    (it calls `torch.nn.utils.clip_grad_norm_` on the packed gradient views): native's bits."""
    for impl in ("for-loop", "fused"):
        native = native_run(steps=6, impl=impl)
        ours = train(setup("cotangent", steps=6, impl=impl, max_norm=None), accelerate_clip=True)
        assert_same_run(native, ours, f"accelerate clip, max_norm=None, {impl}")
        assert all(n is None for n in ours.inner_norms)


def test_clipping_twice_gives_other_bits_and_the_comparison_sees_it():
    """Both `accelerator.clip_grad_norm_` and ``max_norm=1.0`` clip twice (Cotangent cannot see
    a clip done outside it): on a step whose norm exceeded max_norm the second clip finds the
    norm about ``1 - 2e-7`` and scales every gradient again by ``1 / (norm + 1e-6)``, about
    ``1 - 8e-7``, so the run leaves native's bits from the first clipped step on (relative
    differences about 1e-7). Accelerate's returned norm of that step is still native's. Also
    the control that the byte comparison reports such a difference, and another lr."""
    native = native_run(steps=4)
    twice = train(setup("cotangent", steps=4), accelerate_clip=True)
    assert float(native.norms[0]) > MAX_NORM  # step 1 is clipped
    assert same_bits(native.norms[0], twice.norms[0])
    second = float(twice.inner_norms[0])
    assert 1 - 1e-6 < second < MAX_NORM, second
    problems = differences(native, twice)
    assert any(p.startswith(": grad 0 at step 1") for p in problems), problems[:3]
    other_lr = train(setup("cotangent", steps=4, lr=2 * LR), accelerate_clip=False)
    assert differences(native, other_lr)


@pytest.mark.parametrize("accelerate_clip", [False, True], ids=["built-in", "accelerate-clip"])
def test_gradient_accumulation(accelerate_clip):
    """``Accelerator(gradient_accumulation_steps=2)`` with ``accelerator.accumulate(model)``:
    `accelerator.backward` divides each loss by 2, AcceleratedOptimizer skips ``step`` and
    ``zero_grad`` on the first micro-step of each pair; 8 batches = 4 updates, native's bits
    (the clip runs on the accumulated gradient at each update)."""
    native = native_run(steps=8, accum=2)
    ours = train(setup("cotangent", steps=8, accum=2,
                       max_norm=None if accelerate_clip else MAX_NORM),
                 accelerate_clip=accelerate_clip)
    assert len(ours.snaps) == 4 and len(ours.losses) == 8
    assert_same_run(native, ours, "gradient accumulation 2")
    assert all(int(st["step"]) == 4 for st in ours.snaps[-1]["state"])


def test_bf16_autocast():
    """``mixed_precision="bf16"`` (CPU autocast around the model's forward): native's bits."""
    native = native_run(steps=3, mixed_precision="bf16")
    ours = train(setup("cotangent", steps=3, mixed_precision="bf16"), accelerate_clip=False)
    assert_same_run(native, ours, "bf16 autocast")


def test_optimizer_built_after_prepare():
    """The optimizer built on the prepared model and prepared on its own afterwards."""
    native = native_run(steps=4)
    ours = train(setup("cotangent", steps=4, build="after"), accelerate_clip=False)
    assert_same_run(native, ours, "built after prepare")


@pytest.mark.parametrize("impl", ["for-loop", "fused"])
def test_grad_scaler_path_of_accelerated_optimizer(impl):
    """Accelerate's fp16 path (GPU only: on CPU ``mixed_precision="fp16"`` leaves training in
    fp32) emulated on CPU by handing the Accelerator a CPU GradScaler: `accelerator.backward`
    scales the loss, AcceleratedOptimizer calls ``scaler.step`` through its patched
    ``optimizer.step`` and ``scaler.update``; batch 2 overflows. Cotangent's built-in clip and
    `accelerator.clip_grad_norm_` (which unscales first) both give native's bits, skipped
    update and scale included, except (docs/integrations.md, GradScaler) the gradients of the skipped step
    with for-loop AdamW and the built-in clip: the scaler does not call ``step()`` there, so
    they stay unscaled and unclipped where native's loop clipped them (to NaN and 0). On an
    accelerate whose clip gives a -NaN total norm +NaN (1.16.0; the probe
    `accelerator_clip_is_torchs_at_a_nan_norm`) the built-in clip, which is `clip_grad_norm_`'s,
    leaves that step's fused gradients NaN of another sign than Accelerate's: the sign of those
    NaNs is the only difference (checked); parameters and state are equal."""
    nan_sign_differs = not accelerator_clip_is_torchs_at_a_nan_norm()
    kwargs = dict(steps=4, mixed_precision="fp16", grad_scaler=True, impl=impl)
    native_setup = setup("native", **kwargs)
    native = train(native_setup, accelerate_clip=True)
    native_scale = native_setup.acc.scaler.get_scale()
    assert native_scale < 2.0 ** 16  # the overflow was seen
    for accelerate_clip in (False, True):
        s = setup("cotangent", max_norm=None if accelerate_clip else MAX_NORM, **kwargs)
        ours = train(s, accelerate_clip=accelerate_clip)
        # norms compared where both come from accelerator.clip_grad_norm_ (the built-in clip
        # of a skipped step does not run: for-loop AdamW's last_total_norm reads None there)
        skipped = 2 if impl == "for-loop" and not accelerate_clip else None
        nan_signs = 2 if nan_sign_differs and impl != "for-loop" and not accelerate_clip else None
        assert_same_run(native, ours, f"GradScaler, accelerate clip {accelerate_clip}",
                        norms=accelerate_clip, skip_grads_at=(skipped, nan_signs))
        if skipped:
            assert differences(native, ours, norms=False)  # the skipped step's gradients
        if nan_signs:
            assert nan_signs_only(native, ours, nan_signs)
        assert s.acc.scaler.get_scale() == native_scale
        assert ours.skipped == native.skipped == [False, impl == "for-loop", False, False]


def test_optimizer_holding_state_when_prepared():
    """Two steps outside Accelerate, then `accelerator.prepare(model, opt)` (AcceleratedOptimizer's
    construction loads the optimizer's own ``state_dict()`` back into it) and two steps inside:
    native's parameters and state."""
    def go(arm):
        reset_accelerate()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = (torch.optim.AdamW(model.parameters(), lr=LR) if arm == "native"
               else cotangent.AdamW(model.parameters(), lr=LR, max_norm=MAX_NORM))
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen))
                for _ in range(4)]
        for x, y in data[:2]:
            F.mse_loss(model(x), y).backward()
            if arm == "native":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
        acc = Accelerator(cpu=True)
        model, prepared = acc.prepare(model, opt)
        for x, y in data[2:]:
            acc.backward(F.mse_loss(model(x), y))
            if arm == "native":
                acc.clip_grad_norm_(model.parameters(), MAX_NORM)
            prepared.step()
            snap = snapshot(model, opt)
            prepared.zero_grad()
        return Record(snaps=[snap])

    assert_same_run(go("native"), go("cotangent"), "state before prepare")


@pytest.mark.parametrize("first,second", [("cotangent", "cotangent"), ("native", "cotangent"),
                                          ("cotangent", "native")])
def test_save_state_load_state_resume(tmp_path, first, second):
    """`accelerator.save_state(dir)` after 3 of 6 steps (model as safetensors, optimizer
    ``state_dict`` with torch.save, scheduler, RNG), a fresh Accelerator, model and optimizer,
    `accelerator.load_state(dir)`, `skip_first_batches(dl, 3)`, 3 more steps: every step, loss
    and final state equal the uninterrupted native run's, whichever optimizer wrote or reads the
    checkpoint (its optimizer file is native AdamW's format either way)."""
    uninterrupted = native_run(steps=6)
    s = setup(first, steps=6)
    record = train(s, accelerate_clip=first == "native", stop=3)
    s.acc.save_state(str(tmp_path / "ckpt"))
    s = setup(second, steps=6)
    s.acc.load_state(str(tmp_path / "ckpt"))
    train(s, accelerate_clip=second == "native", start=3, record=record)
    assert_same_run(uninterrupted, record, f"{first} -> save_state/load_state -> {second}")
    assert s.sched.get_last_lr() == [LR * 0.5 ** 3]
