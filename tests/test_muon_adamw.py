"""`cotangent.MuonAdamW` (nanochat's published step, one path): gradients read in place,
parameters left where they are, the grouping, errors, resumes, and the occurrence modes on top
(CPU, float32 parameters, torch 2.13; eager here, compiled in the e2e tests). Width 64: a
full-width Muon step takes tens of seconds on CPU. (The packed path these tests once compared
with is gone: it copied every gradient in the backward.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cotangent
from bitwise import assert_same_update, same_bits
from cotangent.muon_adamw import MuonAdamW, muon_groups, recompile_room
from cotangent.occurrence import MODES, OccurrenceAggregator

W = 64


class TinyLM(nn.Module):
    """Embedding, four square matrices, an MLP pair (tall and wide), head; `shared`: the
    square core applied `repeats` times as one module, else `repeats` replica leaves."""

    def __init__(self, repeats: int = 1, replicas: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, W)
        core = [nn.Linear(W, W, bias=False) for _ in range(2)]
        self.core = nn.ModuleList(core)
        self.repeats = repeats
        self.up = nn.Linear(W, 4 * W, bias=False)
        self.down = nn.Linear(4 * W, W, bias=False)
        self.head = nn.Linear(W, 256, bias=False)
        self.replicas = nn.ModuleList(  # drawn last: the other weights match the shared model's
            nn.ModuleList(nn.Linear(W, W, bias=False) for _ in range(2))
            for _ in range(repeats - 1)) if replicas else None
        if replicas:
            with torch.no_grad():
                for rep in self.replicas:
                    for mine, src in zip(rep, self.core):
                        mine.weight.copy_(src.weight)

    def occurrence_groups(self):
        return [[self.core[i].weight] + [rep[i].weight for rep in self.replicas]
                for i in range(2)]

    def forward(self, idx):
        x = self.emb(idx)  # (B, T, W)
        for r in range(self.repeats):
            core = self.core if r == 0 or self.replicas is None else self.replicas[r - 1]
            for layer in core:
                x = x + torch.tanh(layer(F.rms_norm(x, (W,))))  # (B, T, W)
        x = x + self.down(torch.relu(self.up(F.rms_norm(x, (W,)))))
        return self.head(F.rms_norm(x, (W,)))  # (B, T, 256)


def build(repeats=1, replicas=False, seed=0):
    torch.manual_seed(seed)
    return TinyLM(repeats, replicas)


def matrices(model):
    return [p for n, p in model.named_parameters() if p.ndim == 2 and "emb" not in n
            and "head" not in n]


def make_opt(model, compile=False, extra=(), **kw):
    kw = {"adamw_betas": (0.8, 0.95), "adamw_eps": 1e-10, "adamw_weight_decay": 0.0,
          "muon_weight_decay": 0.1, **kw}
    return MuonAdamW([{"params": [model.emb.weight], "lr": 0.2},
                      {"params": [model.head.weight], "lr": 0.004}],
                     matrices(model) + list(extra), compile=compile, **kw)


def lm_loss(model, step, gen):
    idx = torch.randint(0, 256, (4, 32), generator=gen)
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 256), idx[:, 1:].reshape(-1))


def special_grads(model, step):
    """Exact +0.0 and -0.0 gradient entries."""
    with torch.no_grad():
        model.core[0].weight.grad[0].zero_()
        model.core[1].weight.grad[:, 1].fill_(-0.0)
        model.down.weight.grad[2].fill_(-0.0)


def lockstep(ref, ours, opt_r, opt_o, steps=6, hook=special_grads, aggs=None):
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)]
    diags = []
    for step in range(steps):
        for i, (model, opt, gen) in enumerate(((ref, opt_r, gens[0]), (ours, opt_o, gens[1]))):
            lm_loss(model, step, gen).backward()
            if hook is not None:
                hook(model, step)
            if aggs:
                aggs[i].before_step()
            opt.step()
            if aggs:
                diags.append(aggs[i].after_step())
        assert_same_update(ref.parameters(), opt_r.state, ours.parameters(), opt_o.state,
                           f"step {step}")
        for opt in (opt_r, opt_o):
            opt.zero_grad(set_to_none=True)
    return diags


CASES = [
    dict(),
    dict(muon_beta2=None, muon_weight_decay=0.0),
    dict(muon_ns_steps=3, muon_momentum=0.9),
]


@pytest.mark.parametrize("kw", CASES, ids=["defaults", "no-beta2-no-decay", "ns3"])
def test_gradients_are_read_in_place_and_parameters_stay(kw):
    """Each step reads the gradients autograd left (the same tensors, unchanged: the published
    blend writes into its stacked copy), parameters keep their storage, `zero_grad` leaves
    None; two identical runs agree byte for byte (the step is deterministic on CPU)."""
    runs = []
    for _ in range(2):
        model = build()
        model.head.weight.wd_mul = 0.5
        opt = make_opt(model, **kw)
        ptrs = [p.data_ptr() for p in model.parameters()]
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            lm_loss(model, step, gen).backward()
            special_grads(model, step)
            grads = [(p.grad, p.grad.clone()) for p in model.parameters()]
            opt.step()
            for p, (g, before) in zip(model.parameters(), grads):
                assert p.grad is g and same_bits(g, before), f"step {step}"
            assert [p.data_ptr() for p in model.parameters()] == ptrs
            opt.zero_grad()
            assert all(p.grad is None for p in model.parameters())
        runs.append((model, opt))
    (a, opt_a), (b, opt_b) = runs
    assert_same_update(a.parameters(), opt_a.state, b.parameters(), opt_b.state, "rerun",
                       grads=False)


def test_groups_follow_the_reference_order():
    model = build()
    opt = make_opt(model)
    mats = matrices(model)
    expect = muon_groups(mats)  # the published grouping: sorted shapes, given member order
    got = [g["params"] for g in opt.param_groups if g["kind"] == "muon"]
    assert [[id(p) for p in g] for g in got] == [[id(p) for p in g] for g in expect]
    assert [tuple(g[0].shape) for g in got] == [(W, W), (W, 4 * W), (4 * W, W)]


def test_a_resume_from_the_state_dict_equals_the_uninterrupted_run():
    ref, ours = build(), build()
    opt_r, opt_o = make_opt(ref), make_opt(ours)
    lockstep(ref, ours, opt_r, opt_o, steps=2)
    resumed = build()
    with torch.no_grad():
        for a, c in zip(resumed.parameters(), ours.parameters()):
            a.copy_(c)
    opt_resumed = make_opt(resumed)
    opt_resumed.load_state_dict(opt_o.state_dict())
    lockstep(ref, resumed, opt_r, opt_resumed, steps=2)


def test_errors_leave_everything_untouched():
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([], [nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="muon_ns_steps"):
        MuonAdamW([], [nn.Parameter(torch.zeros(3, 3))], muon_ns_steps=6)
    model = build()
    opt = make_opt(model)
    lm_loss(model, 0, torch.Generator().manual_seed(1)).backward()
    model.up.weight.grad = None
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="no gradient"):
        opt.step()
    assert all(same_bits(a, b) for a, b in zip(before, model.parameters()))
    assert not opt.state


@pytest.mark.parametrize("mode", MODES)
def test_occurrence_modes_keep_the_replicas_in_sync(mode):
    model = build(3, True)
    agg = OccurrenceAggregator(model.occurrence_groups(), mode)
    opt = make_opt(model, extra=agg.pooled_leaves())
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        lm_loss(model, step, gen).backward()
        agg.before_step()
        opt.step()
        d = agg.after_step()
        assert d["sync_error"] == 0.0
        assert d["realized_norm"] > 0
        if mode in ("ap", "pa"):
            assert d["relative_norm_mismatch"] <= 1e-5
            assert -1.0 <= d["cosine"] <= 1.0
        opt.zero_grad()
    for p, q in zip(agg.pooled_leaves(), [g[0] for g in model.occurrence_groups()]):
        assert same_bits(p.detach(), q.detach())  # pooled leaves follow the replicas


def test_sync_check_reports_a_desynchronized_replica():
    model = build(3, True)
    agg = OccurrenceAggregator(model.occurrence_groups(), "averaged")
    assert agg.sync_error() == 0.0
    with torch.no_grad():
        model.replicas[1][0].weight[0, 0] += 1e-3
    assert agg.sync_error() > 0.0
    with pytest.raises(ValueError, match="start identical"):
        OccurrenceAggregator(model.occurrence_groups(), "pooled")
    with pytest.raises(ValueError, match="unknown occurrence mode"):
        OccurrenceAggregator([], "mean")


@pytest.mark.parametrize("backwards", [1, 3], ids=["one-backward", "accumulate-3"])
def test_pooled_versus_native_sharing(backwards):
    """Measured fact (CPU, float32, torch 2.13): the pooled mode with its default autograd-order
    sum gives a natively shared module's bits (the shared core against every replica, and every
    other parameter) for 6 steps, with one backward per step or gradients accumulated over 3
    (an adversarial review found the plain backward-order sum of the replicas' accumulated
    gradients differing there: (g2+h2)+(g1+h1) is not (g2+g1)+(h2+h1)), though the Muon
    batches differ (2 shared matrices against 6 replicas); summed in forward order the pooled
    gradient already differs from autograd's."""
    shared, replicated = build(3, False), build(3, True)
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(5))
    assert same_bits(shared(idx).detach(), replicated(idx).detach())
    agg = OccurrenceAggregator(replicated.occurrence_groups(), "pooled")
    opt_s, opt_p = make_opt(shared), make_opt(replicated)
    gens = [torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)]
    for step in range(6):
        for _ in range(backwards):
            lm_loss(shared, step, gens[0]).backward()
            lm_loss(replicated, step, gens[1]).backward()
        if step == 0 and backwards == 1:  # the forward-order sum differs from autograd's
            forward = [g[0].grad + g[1].grad + g[2].grad for g in replicated.occurrence_groups()]
            assert not all(same_bits(a, shared.core[i].weight.grad)
                           for i, a in enumerate(forward))
        agg.before_step()
        for i, group in enumerate(replicated.occurrence_groups()):
            assert same_bits(group[0].grad, shared.core[i].weight.grad), f"step {step}"
        opt_s.step()
        opt_p.step()
        diag = agg.after_step()
        assert diag["sync_error"] == 0.0 and diag["autograd_order"] is True
        for i, group in enumerate(replicated.occurrence_groups()):
            for replica in group:
                assert same_bits(replica.detach(), shared.core[i].weight.detach()), f"step {step}"
        for name in ("emb", "up", "down", "head"):
            assert same_bits(getattr(shared, name).weight.detach(),
                             getattr(replicated, name).weight.detach()), f"{name} step {step}"
        opt_s.zero_grad()
        opt_p.zero_grad()


@pytest.mark.e2e
def test_compiled_steps_do_not_recompile_when_the_lr_moves():
    torch._dynamo.reset()  # variants compiled by other tests in this process count too
    ref, ours = build(), build()
    opt_r, opt_o = make_opt(ref, compile=True), make_opt(ours, compile=True)
    assert opt_o.compiled_variants() <= torch._dynamo.config.recompile_limit
    lockstep(ref, ours, opt_r, opt_o, steps=3)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0
    for opt in (opt_r, opt_o):  # a scheduler moves every lr: the 0-D tensors keep the graphs
        for group in opt.param_groups:
            group["lr"] *= 0.5
    lockstep(ref, ours, opt_r, opt_o, steps=3)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile


def test_public_names():
    assert cotangent.MuonAdamW is MuonAdamW


def test_add_param_group_fills_the_constructor_settings():
    model = build()
    opt = MuonAdamW([{"params": [model.emb.weight]}], [model.up.weight, model.down.weight],
                    adamw_betas=(0.8, 0.95), muon_momentum=0.9)
    opt.add_param_group({"params": [model.head.weight]})
    opt.add_param_group({"params": [model.core[0].weight, model.core[1].weight],
                         "kind": "muon"})
    assert opt.param_groups[-2]["betas"] == (0.8, 0.95)
    assert opt.param_groups[-1]["momentum"] == 0.9
    with pytest.raises(ValueError, match="one shape"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3)),
                                        nn.Parameter(torch.zeros(4, 4))], "kind": "muon"})
    with pytest.raises(ValueError, match="kind"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "kind": "sgd"})
    lm_loss(model, 0, torch.Generator().manual_seed(1)).backward()
    opt.step()  # every group steps (a late group used to fail here: KeyError 'betas')
    assert set(opt.state[model.head.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_copies_are_refused_clearly():
    import copy
    import pickle

    opt = make_opt(build())
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="state_dict"):
            copier(opt)


def test_before_step_twice_is_refused():
    model = build(3, True)
    agg = OccurrenceAggregator(model.occurrence_groups(), "pooled")
    lm_loss(model, 0, torch.Generator().manual_seed(1)).backward()
    agg.before_step()
    grads = [t.grad.clone() for g in model.occurrence_groups() for t in g]
    with pytest.raises(RuntimeError, match="twice"):
        agg.before_step()
    assert all(same_bits(a, t.grad) for a, t in zip(
        grads, [t for g in model.occurrence_groups() for t in g]))


def test_gradients_changed_outside_a_backward_fall_back_to_the_plain_sum():
    model = build(3, True)
    agg = OccurrenceAggregator(model.occurrence_groups(), "pooled")
    opt = make_opt(model)
    for step, edit in enumerate((False, True, False)):
        lm_loss(model, step, torch.Generator().manual_seed(step)).backward()
        if edit:  # e.g. a scaled gradient: the tracked accumulation no longer matches
            with torch.no_grad():
                model.replicas[0][0].weight.grad.mul_(0.5)
        groups = model.occurrence_groups()
        expect = [g[2].grad + g[1].grad + g[0].grad for g in groups]  # backward order
        agg.before_step()
        if edit:
            assert all(same_bits(e, g[0].grad) for e, g in zip(expect, groups))
        opt.step()
        diag = agg.after_step()
        assert diag["autograd_order"] is (not edit) and diag["sync_error"] == 0.0
        opt.zero_grad()


def test_ap_without_the_pooled_leaves_in_the_optimizer_is_refused():
    """Newcomer's trap: the pooled leaves left out of the optimizer would freeze the shared
    weights silently (pooled displacement 0, so AP's target norm 0)."""
    model = build(3, True)
    agg = OccurrenceAggregator(model.occurrence_groups(), "ap")
    opt = make_opt(model)  # agg.pooled_leaves() forgotten
    lm_loss(model, 0, torch.Generator().manual_seed(1)).backward()
    agg.before_step()
    opt.step()
    with pytest.raises(RuntimeError, match="pooled_leaves"):
        agg.after_step()


@pytest.mark.e2e
def test_recompile_limit_is_a_clear_error_not_an_eager_fallback():
    config = torch._dynamo.config
    torch._dynamo.reset()
    with config.patch(recompile_limit=3), pytest.raises(ValueError, match="recompile limit"):
        make_opt(build(), compile=True)  # 3 Muon + 1 AdamW shape > 3: before any step
    a, b = build(), build()
    with config.patch(recompile_limit=4):
        opt_a, opt_b = make_opt(a, compile=True), make_opt(b, compile=True, muon_ns_steps=3)
        for model in (a, b):
            lm_loss(model, 0, torch.Generator().manual_seed(1)).backward()
        groups = len(opt_a.param_groups)
        with pytest.raises(ValueError, match="recompile limit"):  # a 5th variant, refused
            opt_a.add_param_group({"params": [nn.Parameter(torch.zeros(5, 7))],
                                   "kind": "muon"})
        assert len(opt_a.param_groups) == groups
        opt_a.step()
        with pytest.raises(RuntimeError, match="recompile_room"):  # they share the functions
            opt_b.step()
        torch._dynamo.reset()
        with recompile_room(opt_a, opt_b):
            opt_a.step()
            opt_b.step()
    torch._dynamo.reset()


def test_a_refused_param_group_leaves_the_optimizer_as_it_was():
    """Second adversarial review: a Muon group mixing float32 and float64 stayed in
    param_groups after its error, and every later step failed."""
    ref, model = build(), build()
    opt_r = make_opt(ref)
    opt = make_opt(model)
    groups = len(opt.param_groups)
    mixed = [nn.Parameter(torch.zeros(6, 6)),
             nn.Parameter(torch.zeros(6, 6, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one shape, dtype"):
        opt.add_param_group({"params": mixed, "kind": "muon"})
    with pytest.raises(ValueError, match="ns_steps"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(6, 6))], "kind": "muon",
                             "ns_steps": 9})
    assert len(opt.param_groups) == groups
    lockstep(ref, model, opt_r, opt, steps=2)  # still steps, still an untouched twin's bits


def test_a_strided_muon_matrix_added_later_gets_natives_bits():
    """A matrix that is not dense (every other column of a buffer) used to be refused by
    cotangent.Muon (it could not be packed); nothing is packed now, and it steps as
    torch.optim.Muon steps it, leaving the columns between untouched."""
    runs = []
    for cls in (torch.optim.Muon, cotangent.Muon):
        torch.manual_seed(0)
        model = nn.Linear(8, 8, bias=False)
        base = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        strided = nn.Parameter(base[:, ::2])
        opt = cls(model.parameters(), lr=0.02)
        opt.add_param_group({"params": [strided]})
        for step in range(3):
            model(torch.ones(2, 8)).sum().backward()
            strided.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            opt.step()
            opt.zero_grad()
        runs.append(([model.weight, strided], opt, base))
    (pn, opt_n, base_n), (po, opt_o, base_o) = runs
    assert_same_update(pn, opt_n.state, po, opt_o.state, "strided matrix", grads=False)
    assert same_bits(base_n, base_o)


def test_ap_with_a_pooled_gradient_of_zero_is_not_an_error():
    """Second adversarial review: replica gradients g, g, -2g pool to zero, so the pooled leaf
    legitimately stays put; that used to raise "must hold pooled_leaves" after the replicas had
    moved, leaving them out of sync."""
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    reps = [nn.Parameter(w.clone()) for _ in range(3)]
    for mode in ("ap", "pa"):
        agg = OccurrenceAggregator([reps], mode)
        opt = torch.optim.Adam(reps + agg.pooled_leaves(), lr=1e-2)
        g = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        for r, scale in zip(reps, (1.0, 1.0, -2.0)):
            r.grad = g * scale
        agg.before_step()
        opt.step()
        diag = agg.after_step()
        assert diag["sync_error"] == 0.0
        opt.zero_grad()


def test_occurrences_must_be_a_list_of_lists():
    a, b = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="one list of replica leaves"):
        OccurrenceAggregator([a, b], "pooled")
