"""Fresh gradients copied into the flat buffer as the backward delivers them
(`cotangent.harness.packed.tracking.GradientTracker.can_copy_in`), outside torch.distributed: `.grad` reads None
after `zero_grad()` as native, each backward's fresh gradient is copied into its view (gradients
of `COPY_NOW_MIN` elements or more in their hook, smaller ones together at the end of the
backward), and what cannot be copied that way is left where native leaves it. Every case runs
native and cotangent.AdamW side by side (`bitwise.run_against_native`) and compares every byte
after every step (CPU, float32 and bfloat16, torch's for-loop and foreach implementations)."""

from __future__ import annotations

import copy

import pytest
import torch

from bitwise import run_against_native, same_bits
from cotangent.harness.packed import tracking
from cotangent.harness.packed import PackedAdamW

SMALL, BIG = 37, tracking.COPY_NOW_MIN + 3  # one gradient each side of the threshold


def _base(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(SMALL, generator=gen).to(dtype), torch.randn(4, 5, generator=gen)
            .to(dtype), torch.randn(BIG, generator=gen).to(dtype)]


def _backward(step, params, **kw):
    gen = torch.Generator().manual_seed(10 + step)
    loss = sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in params)
    loss.backward(**kw)


def _two_micro_batches(step, params):
    _backward(step, params)
    _backward(step + 100, params)


def _create_graph(step, params):
    # native keeps a gradient that carries a graph: it must not be copied (its grad_fn is lost)
    gen = torch.Generator().manual_seed(step)
    loss = sum((p.float() ** 2 * torch.randn(p.shape, generator=gen)).sum() for p in params)
    loss.backward(create_graph=True)
    assert all(p.grad.requires_grad for p in params)


class _AliasFlat(torch.autograd.Function):
    """Identity whose backward returns, as the input's gradient, a fresh view of the memory
    that the `target` parameter lives in (a pathological backward)."""

    @staticmethod
    def forward(ctx, x, target):
        ctx.target = target
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        t = ctx.target.detach()
        return t.view(-1)[: grad.numel()].view(grad.shape), None


def _alias_backward(step, params):
    out = _AliasFlat.apply(params[0], params[2])
    (out.sum() + sum(p.sum() for p in params[1:])).backward()


def _channels_last(step, params):
    # a gradient laid out unlike its parameter: not copied in (native keeps its strides)
    for p in params:
        g = torch.full(p.shape, 0.5 + step, dtype=p.dtype)
        p.grad = g.t().contiguous().t() if p.ndim == 2 else g


CASES = [  # (name, deliver, dtype, steps)
    ("one-backward", _backward, torch.float32, 3),
    ("two-micro-batches", _two_micro_batches, torch.float32, 3),
    ("create-graph", _create_graph, torch.float32, 2),
    ("assigned-other-strides", _channels_last, torch.float32, 2),
    ("bfloat16", _backward, torch.bfloat16, 3),
]


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name,deliver,dtype,steps", CASES, ids=[c[0] for c in CASES])
def test_copy_in_gives_native_bytes(name, deliver, dtype, steps, foreach):
    rows = run_against_native(_base(dtype), foreach=foreach, deliver=deliver, steps=steps,
                              max_norm=1.0)
    assert [problem for _, problem, _, _ in rows] == [None] * steps


def test_grad_reads_none_after_zero_grad_and_views_after_the_backward():
    params = [torch.nn.Parameter(b) for b in _base()]
    opt = PackedAdamW(params, max_norm=1.0)
    flat = opt._store.flat_grads[0].untyped_storage().data_ptr()
    for step in range(3):
        _backward(step, params)
        assert all(p.grad.untyped_storage().data_ptr() == flat for p in params)
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in params)
    opt.zero_grad(set_to_none=False)  # None stays None, as native
    assert all(p.grad is None for p in params)


def test_large_fresh_gradient_is_copied_in_its_hook_small_ones_at_the_end(monkeypatch):
    """The end-of-backward copy takes the two small gradients in one call; the large one was
    copied in its own hook (and its fresh tensor freed there)."""
    params = [torch.nn.Parameter(b) for b in _base()]
    opt = PackedAdamW(params)
    batches = []
    real = tracking._compat.foreach_copy_

    def counted(dst, src):
        batches.append(sorted(t.numel() for t in dst))
        real(dst, src)

    monkeypatch.setattr(tracking._compat, "foreach_copy_", counted)
    _backward(0, params)
    assert batches == [sorted([SMALL, 20])]
    flat = opt._store.flat_grads[0].untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == flat for p in params)


def test_a_gradient_replaced_before_the_end_of_the_backward_is_left_alone():
    """A user hook that swaps a small parameter's fresh gradient for its own tensor: that
    tensor stays `.grad` (native keeps it), and the step copies its values in as for any
    gradient assigned from outside."""
    params = [torch.nn.Parameter(b) for b in _base()]
    opt = PackedAdamW(params)
    mine = torch.full((SMALL,), 0.25)

    def swap(p):
        p.grad = mine

    params[0].register_post_accumulate_grad_hook(swap)
    _backward(0, params)
    assert params[0].grad is mine
    flat = opt._store.flat_grads[0].untyped_storage().data_ptr()
    assert all(p.grad.untyped_storage().data_ptr() == flat for p in params[1:])


def test_a_failed_backward_leaves_native_state_and_the_next_step_takes_it_in():
    """A backward that raises after some gradients arrived: no end-of-backward copy; `.grad`
    holds autograd's fresh tensors, as native, and the next step adopts them with native's
    bytes."""
    def deliver(step, params):
        if step == 0:
            def boom(grad):
                raise RuntimeError("boom")
            x = params[0] * 2
            x.register_hook(boom)
            loss = (x.sum() + sum((p.float() * 3).sum() for p in params[1:]))
            with pytest.raises(RuntimeError, match="boom"):
                loss.backward()
        _backward(step, params)

    rows = run_against_native(_base(), foreach=False, deliver=deliver, steps=2, max_norm=1.0)
    assert [problem for _, problem, _, _ in rows] == [None, None]


def _assigned_alias(step, params):
    _backward(step, params)
    params[0].grad = params[2].detach()[:SMALL]


@pytest.mark.parametrize("deliver", [_alias_backward, _assigned_alias],
                         ids=["from-a-backward", "assigned"])
def test_a_gradient_sharing_memory_with_a_parameter_is_refused(deliver):
    """Native's step reads such a gradient while it updates that parameter in place, so what
    it reads depends on the order of its updates (the single pass and merged calls have
    another): a clear error before anything changes. Before this check the backward case was
    copied into the -0.0 prefill and diverged silently (parameter 0: 9 of 37 elements)."""
    params = [torch.nn.Parameter(b) for b in _base()]
    opt = PackedAdamW(params, max_norm=1.0)
    _backward(0, params)
    opt.step()
    opt.zero_grad()
    deliver(1, params)
    assert params[0].grad.untyped_storage().data_ptr() == params[2].untyped_storage().data_ptr()
    before = [p.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    with pytest.raises(RuntimeError, match="shares memory with a parameter"):
        opt.step()
    assert all(same_bits(a, b) for a, b in zip(before, params))
    assert all(same_bits(v, opt.state[p][k]) for p, st in zip(params, state)
               for k, v in st.items())


@pytest.mark.parametrize("numel", [4, BIG], ids=["small", "large"])
@pytest.mark.parametrize("before", [True, False], ids=["hook-first", "optimizer-first"])
def test_a_gradient_kept_by_a_user_hook_stays_the_live_gradient(numel, before):
    """A post-accumulate-grad hook that keeps `p.grad` and edits it after the backward: native's
    step sees the edit (it is the live gradient), and so must ours. Such parameters keep the
    -0.0 view as `.grad` (found by an adversarial review: copy-in replaced the kept tensor)."""
    def run(make):
        p = torch.nn.Parameter(torch.ones(numel))
        held = []

        def keep(p):
            held.append(p.grad)

        if before:
            p.register_post_accumulate_grad_hook(keep)
        opt = make([p])
        if not before:
            p.register_post_accumulate_grad_hook(keep)
        for step in range(3):
            held.clear()
            (p * torch.arange(float(numel))).sum().backward()
            held[0].mul_(0.5).add_(1.0)  # the user's edit of the gradient it kept
            assert held[0] is p.grad
            opt.step()
            opt.zero_grad()
        return p.detach().clone(), opt.state[p]

    native_p, native_state = run(lambda ps: torch.optim.AdamW(ps, lr=0.1))
    ours_p, ours_state = run(lambda ps: PackedAdamW(ps, lr=0.1, max_norm=1e9))
    assert same_bits(native_p, ours_p)
    assert all(same_bits(native_state[k], ours_state[k]) for k in native_state)


def test_a_failed_backward_then_model_zero_grad_does_not_stop_copy_in():
    """A backward that raises (its end-of-backward callback never runs), then the loop resets
    with `model.zero_grad()` only: later backwards still copy in (nothing piles up), count as
    new gradients (`clip_grad_norm_()` then a second backward: the step clips again), and the
    bytes stay native's (found by an adversarial review: the first gradient's flag stuck)."""
    def loop(model, clip_then_step):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

        def boom(g):
            raise RuntimeError("simulated failure")

        h = model[0](x)
        h.register_hook(boom)
        with pytest.raises(RuntimeError, match="simulated failure"):
            model[1](h).sum().backward()
        model.zero_grad()
        for step in range(3):
            model(x * (step + 1)).square().sum().backward()
            clip_then_step(model)
            model.zero_grad()

    torch.manual_seed(0)
    native_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    ours_model = copy.deepcopy(native_model)
    native = torch.optim.AdamW(native_model.parameters(), lr=0.1)
    ours = PackedAdamW(ours_model.parameters(), lr=0.1, max_norm=1.0)

    def native_step(m):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        m(torch.ones(4, 8)).sum().backward()  # a second backward after the clip
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        native.step()

    def our_step(m):
        ours.clip_grad_norm_()
        m(torch.ones(4, 8)).sum().backward()
        assert not ours._tracker.pending  # copied in at the end of each backward
        ours.step()  # clips the new gradients again, as native's second clip

    loop(native_model, native_step)
    loop(ours_model, our_step)
    for a, b in zip(native_model.parameters(), ours_model.parameters()):
        assert same_bits(a, b)
        assert all(same_bits(native.state[a][k], ours.state[b][k]) for k in native.state[a])
    flat = ours._store.flat_grads[0].untyped_storage().data_ptr()
    ours_model(torch.ones(4, 8)).sum().backward()
    assert all(p.grad.untyped_storage().data_ptr() == flat for p in ours_model.parameters())
