"""The clip order with param groups: native's bits, or a clear error, never a silent choice.

A native loop with decay / no-decay groups clips ``clip_grad_norm_(model.parameters(), M)``; the
total norm's bits depend on that order. `cotangent.AdamW(groups, max_norm=M)` cannot see the
model, so with two or more param groups holding parameters it requires ``clip_order``
(``model``, a list, or ``"param_groups"``). Every case below is compared byte for byte against
the native loop (CPU, float32, torch as installed; for-loop, foreach and fused AdamW) after every
step: loss, total norm, clipped gradients, parameters, ``exp_avg``, ``exp_avg_sq``, ``step``.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cotangent
from cotangent.verify import first_difference
from bitwise import assert_same_bits, assert_same_update

IMPLS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
MAX_NORM = 1.0


class Net(nn.Module):
    """16 tensors of the kinds a small LM has: embedding, positional parameter, a frozen
    weight, LayerNorms, linears, a depthwise conv, a head, a 0-dim gate."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, 32)
        self.pos = nn.Parameter(torch.randn(8, 32) * 0.02)
        self.ln1 = nn.LayerNorm(32)
        self.fc1 = nn.Linear(32, 96)
        self.conv = nn.Conv1d(96, 96, 3, padding=1, groups=96)
        self.frozen = nn.Linear(96, 96, bias=False).requires_grad_(False)
        self.fc2 = nn.Linear(96, 32)
        self.ln2 = nn.LayerNorm(32)
        self.gate = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(32, 64)

    def forward(self, ids):  # ids: (B, T) -> logits (B, T, 64)
        x = self.ln1(self.embed(ids) + self.pos[: ids.size(1)])      # (B, T, 32)
        h = F.gelu(self.fc1(x))                                        # (B, T, 96)
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)               # (B, T, 96)
        h = self.fc2(self.frozen(h))                                   # (B, T, 32)
        return self.head(self.ln2(x + self.gate * h))                  # (B, T, 64)


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def batches(n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 9), generator=gen) for _ in range(n)]


# --- param-group recipes: (model) -> param-group dicts, as user code builds them

def decay_no_decay(model):
    """The usual recipe: decay for ``ndim >= 2``, none for the rest (out of model order)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [dict(params=[p for p in trainable if p.ndim >= 2], weight_decay=0.1),
            dict(params=[p for p in trainable if p.ndim < 2], weight_decay=0.0)]


def lora_style(model):
    """Adapter-style: the base frozen, two small trainable groups with their own lr (the head
    first: not model order)."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("fc1.", "head.")))
    return [dict(params=list(model.head.parameters()), lr=1e-2),
            dict(params=list(model.fc1.parameters()), lr=3e-3)]


def in_model_order(model):
    """Two groups whose concatenation happens to be model order (the optimizer cannot tell)."""
    params = list(model.parameters())
    return [dict(params=params[:7]), dict(params=params[7:], weight_decay=0.0)]


RECIPES = {"decay/no-decay": decay_no_decay, "lora-style": lora_style,
           "groups in model order": in_model_order}
ORDERS = ("model", "list", "param_groups")


def native_order(model, groups, order):
    """What the native loop passes to clip_grad_norm_ for `order`."""
    if order == "param_groups":
        return [p for g in groups for p in g["params"]]
    return list(model.parameters())


def cotangent_order(model, order):
    return {"model": model, "list": list(model.parameters()), "param_groups": "param_groups"}[order]


def run_native_loop(model, groups, order, impl, steps):
    """The loop as a user writes it; yields (loss, total norm) per step."""
    opt = torch.optim.AdamW(groups, **HP, **IMPLS[impl])
    for batch in batches(steps):
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(native_order(model, groups, order), MAX_NORM)
        opt.step()
        yield loss.detach(), total, opt


@pytest.mark.parametrize("recipe", RECIPES)
def test_ambiguous_clip_order_is_refused_before_anything_moves(recipe):
    model = Net()
    groups = RECIPES[recipe](model)
    before = [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"clip_order=model.*clip_order='param_groups'"):
        cotangent.AdamW(groups, max_norm=MAX_NORM, **HP)
    for (ptr, value), p in zip(before, model.parameters()):
        assert p.data_ptr() == ptr, "a parameter was moved (packed) before the error"
        assert_same_bits(value, p.detach(), "parameter untouched")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_stated_clip_order_gives_the_native_loops_bits(recipe, order, impl):
    """20 steps for decay/no-decay clipped in model order (the usual loop), 6 for the rest."""
    steps = 20 if (recipe, order) == ("decay/no-decay", "model") else 6
    native_model, our_model = Net(), Net()
    native_groups, our_groups = RECIPES[recipe](native_model), RECIPES[recipe](our_model)
    opt = cotangent.AdamW(our_groups, max_norm=MAX_NORM, clip_order=cotangent_order(our_model,
                                                                                     order),
                          **HP, **IMPLS[impl])
    native_params, our_params = list(native_model.parameters()), list(our_model.parameters())
    for step, (batch, (loss, total, native)) in enumerate(zip(
            batches(steps), run_native_loop(native_model, native_groups, order, impl, steps))):
        opt.zero_grad()
        our_loss = loss_fn(our_model, batch)
        our_loss.backward()
        opt.step()
        what = f"{recipe}, clip_order {order}, {impl}, step {step}"
        assert_same_bits(loss, our_loss.detach(), f"{what}: loss")
        assert_same_bits(total, opt.last_total_norm, f"{what}: total norm")
        assert_same_update(native_params, native.state, our_params, opt.state, what)


def _native_parameters_after(order: str, steps: int = 20):
    model = Net()
    groups = decay_no_decay(model)
    norms = [total for _, total, _ in run_native_loop(model, groups, order, "fused", steps)]
    return norms, list(model.parameters())


def test_the_two_native_clip_orders_differ_on_this_model():
    """Why the order must be stated: on this model the two native loops part at the total
    norm's last bit, and the parameters follow (so a default that picks one order silently
    diverges from the other loop)."""
    model_norms, model_params = _native_parameters_after("model")
    group_norms, group_params = _native_parameters_after("param_groups")
    assert any(first_difference(a, b) is not None for a, b in zip(model_norms, group_norms))
    assert any(first_difference(a, b) is not None for a, b in zip(model_params, group_params))


@pytest.mark.slow
@pytest.mark.slow
def test_verify_compares_against_the_model_order_loop_by_default():
    """`verify`'s clip_order is what cotangent.AdamW gets; the native loop clips what it stands
    for (None and `model`: ``model.parameters()``). Two groups with None: AdamW's own error."""
    model = Net()
    groups = decay_no_decay(model)
    with pytest.raises(ValueError, match="clip_order=model"):
        cotangent.verify(model, loss_fn, batches(2), params=groups, max_norm=MAX_NORM, **HP)
    report = cotangent.verify(model, loss_fn, batches(20), params=groups, max_norm=MAX_NORM,
                              clip_order=model, **HP, fused=True)
    assert report.passed, report.failures[:1]
    assert (report.clip_order, report.our_clip_order) == ("model.parameters()", "model")
    assert report.as_dict()["clip_order"] == "model.parameters()"
    stated = cotangent.verify(model, loss_fn, batches(20), params=groups, max_norm=MAX_NORM,
                              clip_order="param_groups", **HP, fused=True)
    assert stated.passed, stated.failures[:1]
    assert stated.clip_order == "param groups concatenated"
    listed = cotangent.verify(model, loss_fn, batches(3), params=groups, max_norm=MAX_NORM,
                              clip_order=list(model.parameters())[::-1], **HP, fused=True)
    assert listed.passed and listed.clip_order == "a list of 16 parameters"
    generated = [dict(g, params=iter(g["params"])) for g in decay_no_decay(model)]
    assert cotangent.verify(model, loss_fn, batches(2), params=generated, max_norm=MAX_NORM,
                            clip_order=model, **HP).passed  # group params as generators


@pytest.mark.parametrize("group", ["decay first, as one group", "all but the head"])
def test_verify_reports_one_group_that_is_not_what_the_loop_clips(group):
    """One param group cannot be refused (the optimizer cannot see the model), so verify is
    where it shows: a single group in another order than ``model.parameters()``, or a subset
    while the loop clips the whole model, with the default clip_order, is reported as
    different from ``clip_grad_norm_(model.parameters())``; ``clip_order=model`` passes."""
    model = Net()
    if group == "decay first, as one group":
        spec = [p for g in decay_no_decay(model) for p in g["params"]]
    else:
        spec = [p for name, p in model.named_parameters()
                if p.requires_grad and not name.startswith("head.")]
    report = cotangent.verify(model, loss_fn, batches(20), params=spec, max_norm=MAX_NORM,
                              **HP, fused=True)
    assert not report.passed and report.our_clip_order == "None"
    assert cotangent.verify(model, loss_fn, batches(20), params=spec, max_norm=MAX_NORM,
                            clip_order=model, **HP, fused=True).passed


def test_a_second_group_added_later_needs_the_order_too():
    model = Net()
    params = list(model.parameters())
    opt = cotangent.AdamW(params[:7], max_norm=MAX_NORM, **HP)
    with pytest.raises(ValueError, match="clip_order=model"):
        opt.add_param_group(dict(params=params[7:], weight_decay=0.0))
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == 7
    stated = cotangent.AdamW(params[:7], max_norm=MAX_NORM, clip_order=model, **HP)
    stated.add_param_group(dict(params=params[7:], weight_decay=0.0))
    assert len(stated.param_groups) == 2


def test_a_group_appended_by_hand_is_refused_at_the_next_step():
    model = Net()
    params = list(model.parameters())
    opt = cotangent.AdamW(params[:7], max_norm=MAX_NORM, **HP)
    loss_fn(model, batches(1)[0]).backward()
    opt.param_groups.append(dict(opt.param_groups[0], params=params[7:]))
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="clip_order=model"):
        opt.step()
    for b, p in zip(before, params):
        assert_same_bits(b, p.detach(), "nothing updated")


def test_max_norm_set_after_building_with_groups_is_refused_at_the_next_step():
    model = Net()
    opt = cotangent.AdamW(decay_no_decay(model), max_norm=None, **HP)
    opt.max_norm = MAX_NORM
    loss_fn(model, batches(1)[0]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="clip_order=model"):
        opt.step()
    for b, p in zip(before, model.parameters()):
        assert_same_bits(b, p.detach(), "nothing updated")
    assert not opt.state


def _groups_for(spec: str, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return {"one group": [dict(params=params)],
            "one group and an empty one": [dict(params=params), dict(params=[], lr=1.0)],
            "no clip": decay_no_decay(model)}[spec]


@pytest.mark.parametrize("spec", ["one group", "one group and an empty one", "no clip"])
def test_unambiguous_configurations_need_no_clip_order(spec):
    """One group holding parameters: its order is the list the user built it from, the one a
    native loop clips too; no clip: no order to state. Built without clip_order, bytes equal."""
    native_model, model = Net(), Net()
    max_norm = None if spec == "no clip" else MAX_NORM
    opt = cotangent.AdamW(_groups_for(spec, model), max_norm=max_norm, **HP)
    native_groups = _groups_for(spec, native_model)
    native = torch.optim.AdamW(native_groups, **HP)
    native_params = [p for g in native_groups for p in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for step, batch in enumerate(batches(3)):
        for m, o in ((native_model, native), (model, opt)):
            o.zero_grad()
            loss_fn(m, batch).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(native_params, max_norm)
        native.step()
        opt.step()
        assert_same_update(native_params, native.state, params, opt.state, f"{spec} {step}")


@pytest.mark.parametrize("bad", ["model", "params", ""])
def test_a_clip_order_string_other_than_param_groups_is_an_error(bad):
    model = Net()
    with pytest.raises(ValueError, match="param_groups"):
        cotangent.AdamW(model.parameters(), max_norm=MAX_NORM, clip_order=bad)
    with pytest.raises(ValueError, match="param_groups"):
        cotangent.ReferenceUpdate(model.parameters(), max_norm=MAX_NORM, clip_order=bad)


@pytest.mark.parametrize("bad", [3, object(), [("weight", torch.zeros(1))]],
                         ids=["int", "object", "named_parameters list"])
def test_a_clip_order_that_is_not_parameters_is_a_clear_error_before_packing(bad):
    model = Net()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="clip_order"):
        cotangent.AdamW(model.parameters(), max_norm=MAX_NORM, clip_order=bad)
    assert [p.data_ptr() for p in model.parameters()] == ptrs


@pytest.mark.parametrize("source", ["named_parameters", "numbers"])
def test_a_callable_clip_order_returning_other_things_is_a_clear_error(source):
    """A callable is read at every clip: what it returns is checked there, at construction
    (before anything is packed) and again at each step."""
    model = Net()
    ptrs = [p.data_ptr() for p in model.parameters()]
    order = model.named_parameters if source == "named_parameters" else (lambda: [1, 2])
    with pytest.raises(ValueError, match=r"clip_order\(\)"):
        cotangent.AdamW(model.parameters(), max_norm=MAX_NORM, clip_order=order)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    returns = [list(model.parameters())]
    opt = cotangent.AdamW(model.parameters(), max_norm=MAX_NORM, clip_order=lambda: returns[0])
    loss_fn(model, batches(1)[0]).backward()
    returns[0] = [("weight", p) for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"clip_order\(\)"):
        opt.step()
    for b, p in zip(before, model.parameters()):
        assert_same_bits(b, p.detach(), "nothing updated")


def test_the_rule_is_checked_before_a_closure_runs():
    model = Net()
    opt = cotangent.AdamW(model.parameters(), max_norm=MAX_NORM, **HP)
    opt.param_groups.append(dict(opt.param_groups[0], params=[]))  # allowed: an empty group
    opt.param_groups[1]["params"] = [opt.param_groups[0]["params"].pop()]
    calls = []

    def closure():
        calls.append(1)
        loss = loss_fn(model, batches(1)[0])
        loss.backward()
        return loss
    with pytest.raises(ValueError, match="clip_order=model"):
        opt.step(closure)
    assert not calls and all(p.grad is None for p in model.parameters())


def test_zero_redundancy_optimizer_needs_the_clip_order(single_rank_group):
    """ZeroRedundancyOptimizer builds one cotangent.AdamW per rank over that rank's shard (one
    group): without clip_order its clip would norm the shard alone (on 2 ranks every total norm
    differed from native's), so it is refused on every rank alike; with ``clip_order=model``
    each rank clips every gradient: native clip_grad_norm_(model.parameters()) then ZeRO over
    torch.optim.AdamW, byte for byte (one gloo rank here)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = Net()
    ptrs = [p.data_ptr() for p in model.parameters()]
    for order in ({}, {"clip_order": "param_groups"}):  # the local groups are the shard's
        with pytest.raises(ValueError, match="inside ZeroRedundancyOptimizer"):
            ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cotangent.AdamW,
                                    max_norm=MAX_NORM, **HP, **order)
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    native_model = Net()
    native = ZeroRedundancyOptimizer(native_model.parameters(), optimizer_class=torch.optim.AdamW,
                                     **HP)
    ours = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cotangent.AdamW,
                                   max_norm=MAX_NORM, clip_order=model, **HP)
    for step, batch in enumerate(batches(4)):
        for m, z in ((native_model, native), (model, ours)):
            z.zero_grad()
            loss_fn(m, batch).backward()
        torch.nn.utils.clip_grad_norm_(native_model.parameters(), MAX_NORM)
        native.step()
        ours.step()
        assert_same_update(native_model.parameters(), native.optim.state, model.parameters(),
                           ours.optim.state, f"ZeRO step {step}")
