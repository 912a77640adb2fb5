"""Hugging Face `transformers.Trainer` with `cotangent.AdamW`, byte for byte against the same
Trainer run with `torch.optim.AdamW` (CPU, `use_cpu=True`, a GPT-2 built from a config, random
tokens, fixed seeds).

Every comparison covers every parameter, every optimizer state entry (`exp_avg`, `exp_avg_sq`,
`step`), the gradients left at the end, and the Trainer's `log_history` (loss, grad_norm,
learning rate, epoch, step, train_loss) as IEEE bytes (`tests/bitwise.py`).

What the Trainer does with the optimizer (transformers 5.x, `Trainer._inner_training_loop`):
after the last micro-batch's backward, ``max_grad_norm > 0`` ->
``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` (= `torch.nn.utils.
clip_grad_norm_` over the model's parameter order); ``max_grad_norm == 0`` -> the same call with
``inf`` to have a norm to log (a full native norm pass, then every gradient multiplied by the
clamped coefficient 1.0, or by NaN when the norm is inf or NaN); then `optimizer.step()`, the
scheduler, and ``model.zero_grad()`` (gradients set to None).
"""

from __future__ import annotations

import copy
import os
import struct
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face Trainer is not installed: pip install 'cotangent[hf]'")
pytest.importorskip("accelerate", reason="accelerate is not installed: pip install 'cotangent[hf]'")
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="safetensors is not installed: pip install 'cotangent[hf]'")

import cotangent  # noqa: E402
from bitwise import assert_same_bits, assert_same_update, same_bits  # noqa: E402
from cotangent.integrations.hf import (  # noqa: E402
    CotangentTrainer, CotangentTrainerMixin, unwrap_optimizer)
from transformers import (  # noqa: E402
    GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments)

LR = 1e-2
VOCAB, SEQ, ROWS = 64, 16, 32
LOG_KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "step", "train_loss", "total_flos")


# ---------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _leave_global_state_as_found():
    """The Trainer seeds the global generators and accelerate sets environment variables; put
    them back so that later tests in the session see what they would have seen."""
    rng, env = torch.get_rng_state(), dict(os.environ)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)
    torch.set_rng_state(rng)
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


class Tokens(torch.utils.data.Dataset):
    """ROWS random token rows of SEQ tokens (labels = inputs: causal LM loss)."""

    def __init__(self):
        self.rows = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


_BASE = {}


def fresh_model():
    """The same initial GPT-2 every time (2 layers, 32 wide, dropout on, tied embeddings)."""
    if "model" not in _BASE:
        torch.manual_seed(0)
        _BASE["model"] = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2,
                                                    vocab_size=VOCAB, n_positions=SEQ))
    return copy.deepcopy(_BASE["model"])


def native(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=LR, **kw)


def ours(max_norm=1.0, **kw):
    return lambda model: cotangent.AdamW(model.parameters(), lr=LR, max_norm=max_norm, **kw)


class Run:
    def __init__(self, trainer, model, optimizer):
        self.trainer, self.model = trainer, model
        self.optimizer = unwrap_optimizer(optimizer)
        self.logs = trainer.state.log_history


def train(out, make_opt=native, max_grad_norm=1.0, *, cls=Trainer, steps=4, model=None,
          resume=None, hook=None, cls_and_kwargs=None, **args) -> Run:
    """One `cls` run of `steps` optimizer steps; `make_opt(model)` builds the optimizer (a
    LambdaLR schedule on top), or `cls_and_kwargs` lets the Trainer build both."""
    model = fresh_model() if model is None else model
    if hook is not None:
        hook(model)
    kwargs = {}
    if cls_and_kwargs is not None:
        kwargs["optimizer_cls_and_kwargs"] = cls_and_kwargs(model)
    else:
        opt = make_opt(model)
        kwargs["optimizers"] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 8))
    args.setdefault("save_strategy", "no")
    targs = TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, data_seed=0, max_grad_norm=max_grad_norm,
        disable_tqdm=True, **args)
    trainer = cls(model=model, args=targs, train_dataset=Tokens(), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return Run(trainer, model, trainer.optimizer)


def log_bits(logs):
    """Each log entry's numbers as IEEE-754 double bytes (NaN payloads included)."""
    return [{k: struct.pack("<d", e[k]).hex() if isinstance(e[k], float) else e[k]
             for k in LOG_KEYS if k in e} for e in logs]


def assert_same_run(ref: Run, got: Run, what: str) -> None:
    names = [n for n, _ in ref.model.named_parameters()]
    assert names == [n for n, _ in got.model.named_parameters()], what
    checks = assert_same_update(ref.model.parameters(), ref.optimizer.state,
                                got.model.parameters(), got.optimizer.state, what, names)
    assert checks >= 4 * len(names), what  # gradient, parameter, exp_avg, exp_avg_sq, step
    assert ref.optimizer.state and all(
        int(s["step"]) == ref.trainer.state.global_step for s in ref.optimizer.state.values())
    ref_logs, got_logs = log_bits(ref.logs), log_bits(got.logs)
    assert sum("grad_norm" in e for e in ref_logs) == ref.trainer.state.global_step, what
    assert ref_logs == got_logs, f"{what}: log_history differs: {ref_logs} vs {got_logs}"


def assert_other_run(ref: Run, got: Run, what: str) -> None:
    """The comparison fails, and on the bytes of parameters (not for another reason)."""
    assert [n for n, _ in ref.model.named_parameters()] == [
        n for n, _ in got.model.named_parameters()], what
    assert any(not same_bits(a.detach(), b.detach())
               for a, b in zip(ref.model.parameters(), got.model.parameters())), what
    with pytest.raises(AssertionError, match="parameter|gradient|exp_avg"):
        assert_same_run(ref, got, what)


_SHARED = {}


def shared_run(tmp_path_factory, key, **kw) -> Run:
    """Runs several tests read (never train further) are made once."""
    if key not in _SHARED:
        _SHARED[key] = train(tmp_path_factory.mktemp(key.replace("=", "-")), **kw)
    return _SHARED[key]


def native_run(tmp_path_factory, key, **kw) -> Run:
    return shared_run(tmp_path_factory, f"native-{key}", **kw)


# ---------------------------------------------------------------------------- the plain Trainer


@pytest.mark.parametrize("fused", [None, True], ids=["for-loop", "fused"])
@pytest.mark.slow
def test_one_clip_matches_native(tmp_path, tmp_path_factory, fused):
    """Three configurations clip once and give native's bits (native: the same Trainer with
    `torch.optim.AdamW` and `max_grad_norm=1.0`): `CotangentTrainer` with `max_grad_norm=1.0` and
    `cotangent.AdamW(max_norm=1.0)` (the optimizer's batched clip is the Trainer's clip); the
    plain Trainer with `max_grad_norm=1.0` and `max_norm=None` (the Trainer clips natively); the
    plain Trainer with `max_grad_norm=0` and `max_norm=1.0` (the Trainer's logging pass with
    max_norm=inf multiplies every gradient by 1.0, which keeps finite bits; see
    `test_non_finite_norm_step` for where it does not)."""
    ref = native_run(tmp_path_factory, f"fused={fused}", make_opt=lambda m: native(m, fused=fused))
    assert_same_run(ref, train(tmp_path / "ct", ours(1.0, fused=fused), 1.0, cls=CotangentTrainer),
                    "CotangentTrainer(max_grad_norm=1.0) + cotangent.AdamW(max_norm=1.0)")
    assert_same_run(ref, train(tmp_path / "b", ours(None, fused=fused), 1.0),
                    "Trainer(max_grad_norm=1.0) + cotangent.AdamW(max_norm=None)")
    assert_same_run(ref, train(tmp_path / "a", ours(1.0, fused=fused), 0.0),
                    "Trainer(max_grad_norm=0) + cotangent.AdamW(max_norm=1.0)")
    if fused is None:  # control: the comparison sees another learning rate
        other = train(tmp_path / "c", lambda m: cotangent.AdamW(m.parameters(), lr=LR * 1.5,
                                                                max_norm=1.0), 1.0,
                      cls=CotangentTrainer)
        assert_other_run(ref, other, "control")


class ClipThenAdamW(torch.optim.AdamW):
    """What `cotangent.AdamW(max_norm=1.0)` means: `clip_grad_norm_(params, 1.0)`, then AdamW."""

    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_([p for g in self.param_groups for p in g["params"]], 1.0)
        return super().step(closure)


@pytest.mark.slow
def test_double_clip_plain_trainer_clips_twice_cotangent_trainer_once(tmp_path, tmp_path_factory):
    """`max_grad_norm=1.0` with `cotangent.AdamW(max_norm=1.0)`: the plain Trainer clips, then
    the optimizer clips again (its coefficient 1/(norm+1e-6) is just below 1 in float32): the
    bits of a native double clip, 1 ULP away from native's single clip on most elements.
    `CotangentTrainer` hands the Trainer's clip to the optimizer: one clip, native's bits, for
    `max_grad_norm` equal to the optimizer's `max_norm` or 0; with `max_norm=None` it leaves the
    Trainer's native clip alone."""
    ref = native_run(tmp_path_factory, "fused=None", make_opt=native)
    twice = train(tmp_path / "n2", lambda m: ClipThenAdamW(m.parameters(), lr=LR), 1.0)
    plain = train(tmp_path / "p", ours(1.0), 1.0)
    assert_same_run(twice, plain, "plain Trainer double clip = native double clip")
    assert_other_run(ref, plain, "double clip vs single clip")  # the 1-ULP control
    for name, make, mgn in [("max_grad_norm=0, max_norm=1.0", ours(1.0), 0.0),
                            ("max_grad_norm=1.0, max_norm=None", ours(None), 1.0)]:
        run = train(tmp_path / name.replace(" ", ""), make, mgn, cls=CotangentTrainer)
        assert_same_run(ref, run, f"CotangentTrainer {name}")


def _inf_at_second_backward(model):
    """An inf in one gradient element at the second backward (step 2)."""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        if calls[0] != 2:
            return grad
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    model.transformer.h[0].mlp.c_fc.weight.register_hook(hook)


@pytest.mark.slow
def test_non_finite_norm_step(tmp_path, tmp_path_factory):
    """An inf gradient at step 2: native (max_grad_norm=1.0) multiplies the gradients by
    1/(inf+1e-6) = 0 (the inf element becomes NaN, the others 0). The plain Trainer with
    `max_grad_norm=0` computes its logged norm with `accelerator.clip_grad_norm_(params, inf)`:
    where that multiplies (accelerate 1.15.0: torch's `clip_grad_norm_`), its coefficient
    inf/inf is NaN and every gradient becomes NaN before `cotangent.AdamW` clips, so that
    configuration is bitwise only while norms are finite; where it does not (1.16.0), native's
    bits. `CotangentTrainer` (no native
    pass) and the plain Trainer clipping natively (`max_norm=None`) keep native's bits."""
    ref = native_run(tmp_path_factory, "inf", make_opt=native, steps=3,
                     hook=_inf_at_second_backward)
    assert ref.logs[1]["grad_norm"] == float("inf")
    for name, make, mgn, cls in [("CotangentTrainer 1.0/1.0", ours(1.0), 1.0, CotangentTrainer),
                                 ("Trainer 1.0/None", ours(None), 1.0, Trainer)]:
        run = train(tmp_path / name.replace(" ", ""), make, mgn, cls=cls, steps=3,
                    hook=_inf_at_second_backward)
        assert_same_run(ref, run, name)
    plain = train(tmp_path / "plain", ours(1.0), 0.0, steps=3, hook=_inf_at_second_backward)
    if accelerator_clip_multiplies_at_an_infinite_max_norm():
        assert_other_run(ref, plain, "plain Trainer(max_grad_norm=0): NaN-poisoned by its "
                                     "norm pass")
    else:
        assert_same_run(ref, plain, "plain Trainer(max_grad_norm=0): its norm pass multiplies "
                                    "nothing")


def accelerator_clip_multiplies_at_an_infinite_max_norm() -> bool:
    """Behaviour probe of the installed accelerate: does ``Accelerator.clip_grad_norm_(params,
    inf)`` (the Trainer's logging pass at ``max_grad_norm=0``) multiply the gradients, as
    ``torch.nn.utils.clip_grad_norm_`` does (coefficient inf / (inf + 1e-6) = NaN when a gradient
    holds inf)? accelerate 1.15.0 called torch's function (yes); 1.16.0 skips the multiply for an
    infinite max_norm (no). Accelerate's singletons are reset after."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    try:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.tensor([float("inf"), 1.0])
        Accelerator(cpu=True).clip_grad_norm_([p], float("inf"))
        return bool(p.grad[1].isnan())
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


# ---------------------------------------------------------------------------- CotangentTrainer


@pytest.mark.slow
def test_cotangent_trainer_refuses_two_clips_or_another_order(tmp_path, tmp_path_factory):
    """Two different thresholds are a ValueError at the first step, and the Trainer's own param
    groups (decay / no decay) without a `clip_order` one when the Trainer builds the optimizer
    (`optimizer_cls_and_kwargs`), before any parameter moves; `clip_order=model` states the
    Trainer's order and gives native's bits."""
    model = fresh_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="two different clips"):
        train(tmp_path / "t", ours(1.0), 0.5, cls=CotangentTrainer, model=model)
    for p, q in zip(before, model.parameters()):
        assert_same_bits(p, q.detach(), "no parameter moved")
    with pytest.raises(ValueError, match="clip_order=model"):
        train(tmp_path / "o", cls=CotangentTrainer, weight_decay=0.1,
              cls_and_kwargs=lambda m: (cotangent.AdamW, {"lr": LR, "max_norm": 1.0}))
    # a stated order other than the Trainer's: refused at the first step
    model = fresh_model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="CotangentTrainer: the Trainer clips"):
        train(tmp_path / "p", cls=CotangentTrainer, weight_decay=0.1, model=model,
              cls_and_kwargs=lambda m: (cotangent.AdamW, {"lr": LR, "max_norm": 1.0,
                                                          "clip_order": "param_groups"}))
    for p, q in zip(before, model.parameters()):
        assert_same_bits(p, q.detach(), "no parameter moved")
    ref = native_run(tmp_path_factory, "groups", weight_decay=0.1,
                     cls_and_kwargs=lambda m: (torch.optim.AdamW, {"lr": LR}))
    assert len(ref.optimizer.param_groups) == 2
    got = train(tmp_path / "g", cls=CotangentTrainer, weight_decay=0.1, cls_and_kwargs=lambda m: (
        cotangent.AdamW, {"lr": LR, "max_norm": 1.0, "clip_order": m}))
    assert isinstance(got.optimizer, cotangent.AdamW)
    assert_same_run(ref, got, "Trainer-built cotangent.AdamW with clip_order=model")


@pytest.mark.slow
def test_gradient_accumulation(tmp_path, tmp_path_factory):
    """`gradient_accumulation_steps=2`: each step's first micro-batch finds ``.grad`` None (the
    Trainer's ``model.zero_grad()``), its backward creates the gradients, the second
    accumulates into them, and the optimizer step reads those very tensors."""
    ref = native_run(tmp_path_factory, "accumulate", steps=3, gradient_accumulation_steps=2)
    seen, held = [], []

    class Look(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step > 0:
                seen.append(all(p.grad is None for p in model.parameters()))

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None,
                                  **kwargs):
            held.append(isinstance(unwrap_optimizer(optimizer), cotangent.AdamW)
                        and all(p.grad is not None for p in model.parameters()))

    class Trainer_(CotangentTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(Look())

    assert_same_run(ref, train(tmp_path / "c", ours(1.0), 1.0, cls=Trainer_, steps=3,
                               gradient_accumulation_steps=2), "CotangentTrainer, accumulation")
    assert seen == [True, True] and held == [True, True, True]
    assert_same_run(ref, train(tmp_path / "p", ours(None), 1.0, steps=3,
                               gradient_accumulation_steps=2),
                    "Trainer(max_norm=None), accumulation")


def test_bf16_autocast(tmp_path, tmp_path_factory):
    """`bf16=True` on CPU: accelerate runs the forward under bfloat16 autocast (float32
    parameters and gradients)."""
    ref = native_run(tmp_path_factory, "bf16", steps=2, bf16=True)
    assert ref.trainer.accelerator.mixed_precision == "bf16"
    assert_same_run(ref, train(tmp_path / "c", ours(1.0), 1.0, cls=CotangentTrainer, steps=2,
                               bf16=True), "CotangentTrainer, bf16 autocast")
    fp32 = native_run(tmp_path_factory, "fused=None", make_opt=native)
    assert log_bits(fp32.logs[:1]) != log_bits(ref.logs[:1])  # autocast did change the loss


# ---------------------------------------------------------------------------- checkpoints


def saving_runs(tmp_path_factory):
    """Native and CotangentTrainer (max_grad_norm=1.0, max_norm=1.0), 4 steps saving at 2."""
    return (native_run(tmp_path_factory, "saving", save_strategy="steps", save_steps=2),
            shared_run(tmp_path_factory, "cotangent-saving", make_opt=ours(1.0),
                       cls=CotangentTrainer, save_strategy="steps", save_steps=2))


@pytest.mark.slow
def test_resume_from_checkpoint(tmp_path, tmp_path_factory):
    """4 steps saving at step 2; a fresh model and a fresh `cotangent.AdamW` resumed by the
    Trainer from checkpoint-2 end with the bits of the uninterrupted native run. The Trainer
    loads the weights with ``model.load_state_dict(state_dict, strict=False)`` (copies into the
    packed parameters, no `assign=True`), the optimizer with ``load_state_dict``; the
    checkpoint's model file and optimizer state equal native's byte for byte, and a native
    checkpoint resumes into Cotangent with the same bits."""
    ref, whole = saving_runs(tmp_path_factory)
    assert_same_run(ref, whole, "uninterrupted CotangentTrainer")
    ckpt = os.path.join(whole.trainer.args.output_dir, "checkpoint-2")
    native_ckpt = os.path.join(ref.trainer.args.output_dir, "checkpoint-2")
    assert (open(os.path.join(ckpt, "model.safetensors"), "rb").read()
            == open(os.path.join(native_ckpt, "model.safetensors"), "rb").read())
    ours_state = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    native_state = torch.load(os.path.join(native_ckpt, "optimizer.pt"), weights_only=True)
    assert ours_state["param_groups"] == native_state["param_groups"]
    assert ours_state["state"].keys() == native_state["state"].keys()
    for i, entry in native_state["state"].items():
        assert entry.keys() == ours_state["state"][i].keys()
        for key, value in entry.items():
            assert_same_bits(value, ours_state["state"][i][key], f"optimizer.pt {i} {key}")

    for source in (ckpt, native_ckpt):
        resumed = train(tmp_path / "resumed", ours(1.0), 1.0, cls=CotangentTrainer,
                        resume=str(source), save_strategy="steps", save_steps=2)
        opt_params = [p for g in resumed.optimizer.param_groups for p in g["params"]]
        assert all(a is b for a, b in zip(opt_params, resumed.model.parameters()))
        what = f"resumed from {'cotangent' if source == ckpt else 'native'} checkpoint-2"
        names = [n for n, _ in ref.model.named_parameters()]
        assert_same_update(ref.model.parameters(), ref.optimizer.state,
                           resumed.model.parameters(), resumed.optimizer.state, what, names)
        # the step logs (steps 1-2 read back from the checkpoint's trainer_state.json, 3-4 new)
        steps = [e for e in log_bits(resumed.logs) if "grad_norm" in e]
        assert [e["step"] for e in steps] == [1, 2, 3, 4], what
        assert steps == [e for e in log_bits(ref.logs) if "grad_norm" in e], what


def test_save_pretrained_of_a_model_trained_by_cotangent(tmp_path, tmp_path_factory):
    """`save_pretrained` of a model trained by `cotangent.AdamW` writes the file a native model
    with the same weights writes (every byte, header included), and `from_pretrained` loads it
    back bit for bit."""
    ref, run = saving_runs(tmp_path_factory)
    ref.model.save_pretrained(tmp_path / "native")
    run.model.save_pretrained(tmp_path / "packed")
    assert ((tmp_path / "packed" / "model.safetensors").read_bytes()
            == (tmp_path / "native" / "model.safetensors").read_bytes())
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "packed")
    for (name, p), q in zip(ref.model.named_parameters(), loaded.parameters()):
        assert_same_bits(p.detach(), q.detach(), f"from_pretrained {name}")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tying survives


@pytest.mark.slow
def test_core_import_needs_no_transformers():
    """`import cotangent` (and the integrations package) does not import transformers; without
    it, importing `cotangent.integrations.hf` names the extra to install."""
    code = ("import sys, cotangent, cotangent.integrations\n"
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules\n"
            "sys.modules['transformers'] = None\n"
            "try:\n    import cotangent.integrations.hf\n"
            "except ImportError as e:\n    assert \"cotangent[hf]\" in str(e), e\n"
            "else:\n    raise SystemExit('imported without transformers')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cotangent_trainer_needs_the_trainer_hooks():
    """On a Trainer without `_clip_grad_norm` / `_get_grad_norm` (transformers 4.x) the mixin
    refuses at construction instead of silently leaving the Trainer's clip in place."""
    class OldTrainer:
        def __init__(self, *args, **kwargs):
            raise AssertionError("not reached")

    class Mixed(CotangentTrainerMixin, OldTrainer):
        pass

    with pytest.raises(TypeError, match="max_grad_norm=0"):
        Mixed()
