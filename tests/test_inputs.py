"""Input kinds found in public bug reports, native vs Cotangent on bytes, or a clear error.

Gradient strides, non-finite values in every dtype, GradScaler (skipped steps, fused without
`unscale_`), casting the model after building the optimizer, DTensor parameters,
`torch.compile` of the step, checkpoints of another model, `verify` with param groups, pickle
size. Holds for: CPU, torch 2.13.0, for-loop / foreach / fused AdamW.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

import cotangent
from bitwise import assert_same_bits, assert_same_update, run_against_native
from cases import lockstep
from cotangent import norms

IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _params(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    return ([nn.Parameter(t.clone()) for t in init], [nn.Parameter(t.clone()) for t in init])


# ------------------------------------------------------------------ 3. gradient strides

def _strided_grads(kind: str, shape, gen, dtype, special=None):
    """Two equal gradients of `shape` laid out as `kind` (each its own storage), the element
    (3, 7) set to `special` if given."""
    rows, cols = shape
    if kind == "transposed":
        base = torch.randn(cols, rows, generator=gen).to(dtype)
        make = lambda: base.clone().t()  # noqa: E731
    elif kind == "sliced":
        base = torch.randn(rows, 2 * cols, generator=gen).to(dtype)
        make = lambda: base.clone()[:, ::2]  # noqa: E731
    else:  # "expanded"
        base = torch.randn(cols, generator=gen).to(dtype)
        return base.expand(rows, cols), base.expand(rows, cols)
    grads = make(), make()
    if special is not None:
        for g in grads:
            g[3, 7] = special
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["transposed", "sliced"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_gradient_with_other_strides_under_clipping(impl, kind, dtype):
    """Issue input 3: a (64, 300) parameter given `p.grad = randn(300, 64).t()`. The norm, the
    clip multiply and the update are native's on the gradient as it is (fused too: the native
    fused call reads it as native's does, in storage order, torch issue 106951)."""
    (ps, qs) = _params([(64, 300), (300,)], dtype)
    ref = cotangent.ReferenceUpdate(ps, max_norm=0.5, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(qs, max_norm=0.5, **HP, **IMPLS[impl])
    gen = torch.Generator().manual_seed(1)
    for step in range(6):  # a re-laid norm differs from native's in about 2 of 3 steps
        special = None if step != 1 else float("nan") if dtype == torch.bfloat16 else 1e30
        g1, g2 = _strided_grads(kind, (64, 300), gen, dtype, special)
        b = torch.randn(300, generator=gen).to(dtype)
        ps[0].grad, ps[1].grad = g1, b.clone()
        qs[0].grad, qs[1].grad = g2, b.clone()
        assert qs[0].grad.stride() != qs[0].stride()
        total = ref.clip_grad_norm_()
        ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        assert_same_update(ps, ref.optimizer.state, qs, opt.state, f"{kind} {impl} step {step}")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_expanded_gradient(impl):
    """A stride-0 gradient: native `clip_grad_norm_` raises, so Cotangent raises, with
    native's reason and the parameter named (nothing modified); without clipping, for-loop
    and foreach take it as native does."""
    (ps, qs) = _params([(64, 300)])
    g, _ = _strided_grads("expanded", (64, 300), torch.Generator().manual_seed(0), torch.float32)
    ps[0].grad, qs[0].grad = g, g
    with pytest.raises(RuntimeError) as native_error:
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
    opt = cotangent.AdamW(qs, max_norm=1.0, **HP, **IMPLS[impl])
    before = qs[0].detach().clone()
    with pytest.raises(RuntimeError) as our_error:
        opt.step()
    reason = "more than one element of the written-to tensor refers to a single memory location"
    assert reason in str(native_error.value)
    assert str(our_error.value).startswith("the gradient of parameter 0 (shape (64, 300), "
                                           "float32) overlaps itself") and reason in str(
                                               our_error.value)
    assert_same_bits(qs[0], before, "parameter after the refused step")
    if impl == "fused":
        return  # native CPU fused would read a stride-0 gradient in storage order
    (ps, qs) = _params([(64, 300)])
    ref = torch.optim.AdamW(ps, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(qs, **HP, **IMPLS[impl])
    for _ in range(2):
        ps[0].grad, qs[0].grad = g, g
        ref.step()
        opt.step()
    assert_same_update(ps, ref.state, qs, opt.state, f"expanded gradient {impl}")


# ------------------------------------------------------------------ 4. non-finite values

@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_nonfinite_gradients_under_clipping_in_every_dtype(impl, dtype, value):
    """Issue input 4: parameters `w` (64x64) and `b` (16), clip at 1.0, a special value at
    `b.grad[3]`: native's per-tensor multiply of a short tensor takes ATen's scalar path, which
    stores a bfloat16 NaN as 0x7FC0 where a vectorised multiply stores 0xFFFF."""
    (ps, qs) = _params([(64, 64), (16,)], dtype)
    ref = cotangent.ReferenceUpdate(ps, max_norm=1.0, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(qs, max_norm=1.0, **HP, **IMPLS[impl])
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=gen).to(dtype) for p in ps]
        if step == 1:
            grads[1][3] = value
        for p, q, g in zip(ps, qs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        total = ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        assert_same_update(ps, ref.optimizer.state, qs, opt.state, f"{dtype} {value} step {step}")


def test_probes_include_nonfinite_values():
    """The flat clip multiply is refused for bfloat16 (its NaN payload differs, as above) and
    the probe that says so really multiplies NaNs: a probe without them would accept it."""
    cpu = torch.device("cpu")
    assert not norms.flat_multiply_is_exact(cpu, torch.bfloat16, torch.bfloat16)
    assert norms.flat_multiply_is_exact(cpu, torch.float32, torch.float32)
    # a NaN coefficient against NaN gradient elements: the body and the tail disagree
    assert not norms.flat_multiply_is_exact(cpu, torch.float32, torch.float32, finite=False)
    flat = torch.randn(4096 + 64).to(torch.bfloat16)
    flat[4096 + 3] = float("nan")
    short = flat[4096:4096 + 16].clone()
    short.mul_(torch.tensor(0.5, dtype=torch.bfloat16))
    flat.mul_(torch.tensor(0.5, dtype=torch.bfloat16))
    assert flat[4096 + 3].view(torch.int16) != short[3].view(torch.int16)  # the fact probed


# ------------------------------------------------------------------ 5 and 8. GradScaler

def _scaler_pair(impl, init_scale=2.0 ** 10):
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    m2 = copy.deepcopy(m1)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, **HP, **IMPLS[impl])
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale) for _ in range(2)]
    return m1, ref, m2, opt, scalers


@pytest.mark.parametrize("unscale", ["unscale_ + clip_grad_norm_()", "unscale_", "no unscale_"])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_grad_scaler_with_clipping_and_overflow_steps(impl, unscale):
    """Native's documented recipe is `scaler.unscale_(opt)`, `clip_grad_norm_`,
    `scaler.step(opt)`, `scaler.update()`. Cotangent clips inside `step()`: with fused AdamW
    the scaler then hands it scaled gradients and the scale (issue input 8), so it unscales
    first; on skipped steps (inf gradients, issue input 5) `step()` never runs, so the norm
    reads None (not the previous step's) unless `opt.clip_grad_norm_()` clipped as native."""
    m1, ref, m2, opt, (s1, s2) = _scaler_pair(impl)
    gen = torch.Generator().manual_seed(0)
    skipped = 0
    for step in range(6):
        x = torch.randn(4, 8, generator=gen)
        if step in (2, 4):
            x[0, 0] = float("inf")  # overflow: the scaler skips the update
        for m, o, s in ((m1, ref, s1), (m2, opt, s2)):
            o.zero_grad()
            s.scale(m(x).square().mean()).backward()
        s1.unscale_(ref.optimizer)
        total = ref.clip_grad_norm_()
        if unscale != "no unscale_":
            s2.unscale_(opt)
        ours = opt.clip_grad_norm_() if unscale.endswith("clip_grad_norm_()") else None
        s1.step(ref.optimizer)
        s2.step(opt)
        s1.update()
        s2.update()
        overflow = not torch.isfinite(total)
        skipped += overflow
        if ours is not None:
            assert_same_bits(total, ours, f"step {step} total norm")
            assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        elif overflow and impl != "fused":
            assert opt.last_total_norm is None  # step() never ran: no stale number
        else:
            assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        assert s1.get_scale() == s2.get_scale()
        assert_same_update(m1.parameters(), ref.optimizer.state, m2.parameters(), opt.state,
                           f"{unscale} step {step}", grads=not overflow or ours is not None
                           or impl == "fused")
    assert skipped == 2
    assert int(opt.state[m2[0].weight]["step"]) == 4


# ------------------------------------------------------------------ 6. clear errors

@pytest.mark.parametrize("cast", ["half", "double", "bfloat16", "to float64"])
def test_model_cast_after_building_is_followed_like_native(cast):
    """``model.half()`` (or ``.double()``, ``.to(float64)``) after building, before the first
    step: native reads the cast parameters at its step; so does Cotangent (nothing was moved).
    After a step the float32 state no longer matches: a clear error, nothing modified."""
    def do(m):
        return m.to(torch.float64) if cast == "to float64" else getattr(m, cast)()

    torch.manual_seed(0)
    m1 = nn.Linear(8, 8)
    m2 = copy.deepcopy(m1)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.5, **HP)
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.5, **HP)
    for m in (m1, m2):
        do(m)
    dtype = m1.weight.dtype
    for step in range(3):
        x = torch.randn(4, 8).to(dtype)
        for m, o in ((m1, ref), (m2, opt)):
            o.zero_grad()
            m(x).float().square().sum().backward()
        total = ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"{cast} step {step} total norm")
        assert_same_update(m1.parameters(), ref.optimizer.state, m2.parameters(), opt.state,
                           f"{cast} step {step}")
    m3 = nn.Linear(8, 8)
    opt3 = cotangent.AdamW(m3.parameters(), **HP)
    m3(torch.randn(4, 8)).sum().backward()
    opt3.step()
    do(m3)
    m3(torch.randn(4, 8).to(m3.weight.dtype)).float().sum().backward()
    before = [p.detach().clone() for p in m3.parameters()]
    with pytest.raises(RuntimeError, match="must match the parameter"):
        opt3.step()
    for p, q in zip(before, m3.parameters()):
        assert_same_bits(p, q, f"{cast}: parameter after the refused step")


def _sum_of_squares(m, x, step):
    return m(x).square().sum()

@pytest.mark.parametrize("impl", list(IMPLS))
def test_parameter_data_replaced_is_followed_like_native(impl):
    """`p.data = t` (SAM restoring the weights, a momentum encoder, a parametrization): native
    updates `t` from then on; so does Cotangent (that parameter is then updated by its own
    call), and `t` keeps aliasing the parameter."""
    torch.manual_seed(0)
    m1 = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    m2 = copy.deepcopy(m1)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, **HP, **IMPLS[impl])
    assigned = {}

    def assign(step, side):
        m, _ = side
        if step in (1, 3):  # a fresh tensor of the same shape, dtype and strides
            assigned[id(m)] = m[1].weight.data.clone() * 0.5
            m[1].weight.data = assigned[id(m)]

    def check(step):
        if step >= 1:  # the assigned tensor is the parameter's memory, updated in place
            assert m2[1].weight.data_ptr() == assigned[id(m2)].data_ptr()
            assert_same_bits(assigned[id(m1)], assigned[id(m2)], f"step {step} assigned")

    lockstep(m1, ref, m2, opt, 5, "p.data replaced", loss=_sum_of_squares,
             batch=lambda gen, step: torch.randn(3, 4, generator=gen), edit=assign,
             edit_before_backward=True, after_step=check)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_parameters_tied_through_data_update_that_memory_like_native(impl):
    """`b.weight.data = a.weight.data` after building: native updates that memory twice per
    step, in its own order; so does Cotangent (the single pass refuses tensors that share memory:
    native's calls run there)."""
    torch.manual_seed(0)
    pair = [nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]) for _ in range(2)]
    pair[1].load_state_dict(pair[0].state_dict())
    opts = [cls(pair[i].parameters(), **HP, **IMPLS[impl])
            for i, cls in enumerate((torch.optim.AdamW, cotangent.AdamW))]
    for m in pair:
        m[1].weight.data = m[0].weight.data
    for step in range(3):
        x = torch.randn(3, 4)
        for m, o in zip(pair, opts):
            o.zero_grad()
            (m[1](m[0](x)).square().sum()).backward()
            o.step()
        assert_same_update(pair[0].parameters(), opts[0].state, pair[1].parameters(),
                           opts[1].state, f"tied through .data, {impl}, step {step}")
    if impl != "fused":
        assert opts[1].update_path()["path"] == "native"


@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_two_optimizers_sharing_parameters(impl):
    """An encoder updated by two optimizers (e.g. SAC-AE's critic and decoder): the second
    packs the shared parameters; the first follows them there, as native's both update them."""
    torch.manual_seed(0)
    base = nn.ModuleDict({"enc": nn.Linear(8, 8), "a": nn.Linear(8, 4), "b": nn.Linear(8, 4)})
    sides = []
    for cls in (torch.optim.AdamW, cotangent.AdamW):
        m = copy.deepcopy(base)
        o1 = cls(list(m["enc"].parameters()) + list(m["a"].parameters()), **HP, **IMPLS[impl])
        o2 = cls(list(m["enc"].parameters()) + list(m["b"].parameters()), **HP, **IMPLS[impl])
        sides.append((m, o1, o2))
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(3, 8, generator=gen)
        for m, o1, o2 in sides:
            o1.zero_grad()
            m["a"](m["enc"](x)).square().sum().backward()
            o1.step()
            o2.zero_grad()
            m["b"](m["enc"](x)).square().sum().backward()
            o2.step()
        (m1, n1, n2), (m2, c1, c2) = sides
        for native, ours in ((n1, c1), (n2, c2)):
            assert_same_update(m1.parameters(), native.state, m2.parameters(), ours.state,
                               f"step {step}")


def test_shared_memory_parameters_stay_in_place():
    """Hogwild: workers update parameters in shared memory. They are not moved into a private
    buffer (other processes would never see the updates) but updated where they are."""
    torch.manual_seed(0)
    m1 = nn.Linear(8, 8)
    m2 = copy.deepcopy(m1)
    for m in (m1, m2):
        m.share_memory()
    ptrs = [p.data_ptr() for p in m2.parameters()]
    ref = torch.optim.AdamW(m1.parameters(), **HP)
    opt = cotangent.AdamW(m2.parameters(), **HP)
    for step in range(3):
        for m, o in ((m1, ref), (m2, opt)):
            o.zero_grad()
            m(torch.ones(2, 8)).sum().backward()
            o.step()
        assert_same_update(m1.parameters(), ref.state, m2.parameters(), opt.state, f"step {step}")
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    assert all(p.is_shared() for p in m2.parameters())
    m3 = nn.Linear(8, 8)
    opt3 = cotangent.AdamW(m3.parameters())
    m3.share_memory()  # after building: the whole buffer moved into shared memory
    m3(torch.ones(2, 8)).sum().backward()
    opt3.step()
    assert all(p.is_shared() for p in m3.parameters())


def test_lazy_parameters_are_read_once_materialised_like_native():
    """An optimizer built over a lazy module before its first forward: native updates the
    parameters materialised in place; so does Cotangent."""
    torch.manual_seed(0)
    models = [nn.LazyLinear(4), nn.LazyLinear(4)]
    opts = [torch.optim.AdamW(models[0].parameters(), **HP),
            cotangent.AdamW(models[1].parameters(), max_norm=None, **HP)]
    x = torch.randn(3, 6)
    for m in models:
        m(x)
    models[1].load_state_dict(models[0].state_dict())
    for step in range(3):
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
        assert_same_update(models[0].parameters(), opts[0].state, models[1].parameters(),
                           opts[1].state, f"lazy step {step}")


def test_fsdp2_on_one_rank_and_the_placements_it_refuses(single_rank_group):
    """fully_shard on a one-rank group: native's bytes (the two-rank cases are in
    test_distributed.py); a DTensor parameter placed Shard(1) (tensor parallelism) is a
    ValueError naming the placement at construction, and so is FSDP2 with shard='zero1'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from cotangent import dtensor

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 7), nn.Tanh(), nn.Linear(7, 8))
    models = [copy.deepcopy(base) for _ in range(2)]
    for m in models:
        fully_shard(m)
    native = torch.optim.AdamW(models[0].parameters(), lr=1e-2, fused=True)
    ours = cotangent.AdamW(models[1].parameters(), lr=1e-2, fused=True, max_norm=0.05)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        for m in models:
            m(x).square().mean().backward()
        total = torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.05)
        native.step()
        ours.step()
        assert_same_bits(dtensor.local(ours.last_total_norm), dtensor.local(total), "norm")
        for p, q in zip(models[0].parameters(), models[1].parameters()):
            assert_same_bits(dtensor.local(q.detach()), dtensor.local(p.detach()), "param")
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert_same_bits(dtensor.local(ours.state[q][key]),
                                 dtensor.local(native.state[p][key]), key)
        native.zero_grad()
        ours.zero_grad()
    # state native's DTensor ops would read otherwise (a checkpoint of the unsharded model, a
    # moment redistributed, a DTensor step): a RuntimeError before anything changes
    from torch.distributed.tensor import DTensor, Replicate

    w = next(models[1].parameters())
    models[1](torch.ones(2, 8)).sum().backward()
    entry = ours.state[w]
    saved = dict(entry)
    edits = [("exp_avg", lambda: dtensor.local(saved["exp_avg"]).clone(), "a plain tensor"),
             ("exp_avg_sq", lambda: saved["exp_avg_sq"].redistribute(
                 saved["exp_avg_sq"].device_mesh, [Replicate()]), r"a DTensor placed \(Repl"),
             ("step", lambda: DTensor.from_local(saved["step"], w.device_mesh, [Replicate()]),
              "a step of type DTensor")]
    for key, make, match in edits:
        entry[key] = make()
        before = [dtensor.local(q.detach()).clone() for q in models[1].parameters()]
        grads = [dtensor.local(q.grad).clone() for q in models[1].parameters()]
        with pytest.raises(RuntimeError, match=match):
            ours.step()
        for b, g, q in zip(before, grads, models[1].parameters()):
            assert_same_bits(dtensor.local(q.detach()), b, f"{key}: nothing modified")
            assert_same_bits(dtensor.local(q.grad), g, f"{key}: gradients not clipped")
        entry.update(saved)
    ours.zero_grad()
    # plain parameters beside DTensors: native's for-loop updates each alone (so does ours);
    # its clip and its foreach / fused list ops raise (ours too, before anything changes)
    pair = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mixed, twin = copy.deepcopy(pair), copy.deepcopy(pair)
    for m in (mixed, twin):
        fully_shard(m[0])
    for m in (mixed, twin):
        m(torch.ones(2, 4)).sum().backward()
    native = torch.optim.AdamW(mixed.parameters(), lr=1e-2, foreach=False)
    ours = cotangent.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    native.step()
    ours.step()
    for p, q in zip(mixed.parameters(), twin.parameters()):
        assert_same_bits(dtensor.local(q.detach()), dtensor.local(p.detach()), "mixed")
    before = [dtensor.local(q.detach()).clone() for q in twin.parameters()]
    for make, match in [(lambda: cotangent.AdamW(twin.parameters(), max_norm=1.0),
                         "DTensor and plain gradients"),
                        (lambda: cotangent.AdamW(twin.parameters(), foreach=True),
                         "plain parameter beside DTensor parameters in one foreach")]:
        with pytest.raises(RuntimeError, match=match):
            make().step()
        for b, q in zip(before, twin.parameters()):
            assert_same_bits(dtensor.local(q.detach()), b, "nothing modified")
    mesh = init_device_mesh("cpu", (1,))
    column = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    torch.optim.AdamW([column])  # native accepts it
    with pytest.raises(ValueError, match=r"Shard\(dim=1\) on mesh dimension 0"):
        cotangent.AdamW([column])
    with pytest.raises(ValueError, match="shard='zero1' is for DistributedDataParallel"):
        cotangent.AdamW(models[1].parameters(), shard="zero1")


def test_zero_redundancy_optimizer_state_round_trip(single_rank_group):
    """ZeroRedundancyOptimizer's load_state_dict replaces `optim.state[p]` dicts wholesale."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    models = [copy.deepcopy(base) for _ in range(2)]
    zeros = [ZeroRedundancyOptimizer(m.parameters(), optimizer_class=cls, **HP)
             for m, cls in zip(models, (torch.optim.AdamW, cotangent.AdamW))]
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.randn(4, 8, generator=gen)
        for m, z in zip(models, zeros):
            z.zero_grad()
            m(x).square().mean().backward()
            z.step()
        if step == 2:
            saved = []
            for z in zeros:
                z.consolidate_state_dict(to=0)
                saved.append(copy.deepcopy(z.state_dict()))
        if step == 4:  # roll back to step 2's optimizer state
            for z, sd in zip(zeros, saved):
                z.load_state_dict(sd)
        assert_same_update(models[0].parameters(), zeros[0].optim.state,
                           models[1].parameters(), zeros[1].optim.state, f"ZeRO step {step}")


# ------------------------------------------------------------------ 7. torch.compile of step()

@pytest.mark.parametrize("flags", [dict(fused=True, lr=torch.tensor(1e-3)), dict(fused=True),
                                   dict(foreach=False)], ids=["fused-tensor-lr", "fused", "for-loop"])
def test_compiling_the_step_is_one_clear_error(flags):
    torch._dynamo.reset()
    m = nn.Linear(4, 4)
    opt = cotangent.AdamW(m.parameters(), **flags)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    m(torch.ones(2, 4)).sum().backward()
    compiled = torch.compile(lambda: (opt.step(), sched.step()))
    with pytest.raises(Exception, match="cannot run inside torch.compile"):
        compiled()
    opt.step()  # eager use still works


# ------------------------------------------------------------------ 9. another model's checkpoint

@pytest.mark.parametrize("moment_shape", [(1, 8), (8, 4), (4,)])
def test_loading_another_models_checkpoint_fails_cleanly(moment_shape):
    """Issue input 9: moments of shape (1, 8) would broadcast into a (4, 8) parameter; other
    shapes would fail naming no parameter. A ValueError names it and nothing changes."""
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(4, 8, generator=gen))
    native_w = nn.Parameter(w.detach().clone())
    opt = cotangent.AdamW([w], **HP)
    native = torch.optim.AdamW([native_w], **HP)
    for o, p in ((opt, w), (native, native_w)):
        p.grad = torch.ones(4, 8)
        o.step()
    other = nn.Parameter(torch.zeros(moment_shape))
    other_opt = torch.optim.AdamW([other], **HP)
    other.grad = torch.ones(moment_shape)
    other_opt.step()
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(4, 8\)"):
        opt.load_state_dict(other_opt.state_dict())
    for o, p in ((opt, w), (native, native_w)):  # exactly as before the failed load
        p.grad = torch.full((4, 8), 0.5)
        o.step()
    assert_same_update([native_w], native.state, [w], opt.state, "after a refused load")


# ------------------------------------------------------------------ 10. verify

def _lm_loss(model, batch):
    return model(batch).square().mean()


def test_verify_accepts_param_groups_and_clip_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    groups = [{"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
              {"params": [p for p in model.parameters() if p.dim() >= 2]}]
    batches = [torch.randn(4, 8) for _ in range(3)]
    report = cotangent.verify(model, _lm_loss, batches, params=groups,
                              clip_order=model.parameters(), max_norm=0.05, fused=True, lr=1e-2)
    assert report.passed and report.steps == 3, report.failures
    with pytest.raises(ValueError, match="at least one batch"):
        cotangent.verify(model, _lm_loss, [])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        cotangent.verify(model, _lm_loss, batches, params=[nn.Parameter(torch.ones(2))])


# ------------------------------------------------------------------ 11. pickle size

def test_pickle_size_is_linear_in_the_parameters():
    """Issue input 11: 80 tensors / 666 KB of parameters pickled to 160 MB (each view carried
    the whole flat buffer); now within 5% of native's size, for the optimizer and the model."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(64, 64) for _ in range(40)])
    sizes = {}
    for name, cls in (("native", torch.optim.AdamW), ("cotangent", cotangent.AdamW)):
        model = copy.deepcopy(base)
        opt = cls(model.parameters(), **HP)
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        sizes[name] = (len(pickle.dumps(opt)), len(pickle.dumps(model)))
        if name == "cotangent":
            clone = pickle.loads(pickle.dumps((model, opt)))  # identity kept across the pair
            clone_params = list(clone[0].parameters())
            assert clone[1].param_groups[0]["params"][0] is clone_params[0]
            assert_same_update(model.parameters(), opt.state, clone_params, clone[1].state,
                               "unpickled", grads=False)
    assert sizes["cotangent"][0] <= 1.05 * sizes["native"][0], sizes
    assert sizes["cotangent"][1] <= 1.05 * sizes["native"][1], sizes


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout contract")
@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_other_strides_gradient_kept_by_zero_grad_set_to_none_false(impl):
    """Native `zero_grad(set_to_none=False)` zeroes such a gradient in place and the next
    backward accumulates into it, strides and all; its norm must keep native's bits."""
    (ps, qs) = _params([(64, 300)])
    ref = cotangent.ReferenceUpdate(ps, max_norm=0.5, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(qs, max_norm=0.5, **HP, **IMPLS[impl])
    g1, g2 = _strided_grads("transposed", (64, 300), torch.Generator().manual_seed(3),
                            torch.float32)
    ps[0].grad, qs[0].grad = g1, g2
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        if step:
            ref.zero_grad(set_to_none=False)
            opt.zero_grad(set_to_none=False)
            w = torch.randn(64, 300, generator=gen)
            for p in (ps[0], qs[0]):
                (p * w).sum().backward()
        assert qs[0].grad.stride() == ps[0].grad.stride() == (1, 64)
        total = ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        assert_same_update(ps, ref.optimizer.state, qs, opt.state, f"step {step}")


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_gradient_bits_after_backward_in_every_dtype(dtype, set_to_none):
    """A fresh bfloat16 gradient holding NaN (0x7FC0) would come out as 0xFFFF if accumulated
    into a -0.0 buffer (the add rounds through float32): such dtypes get None from zero_grad,
    as native, and a fresh tensor from the backward."""
    torch.manual_seed(0)
    m1 = nn.Linear(8, 8).to(dtype)
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.AdamW(m1.parameters(), **HP), cotangent.AdamW(m2.parameters(), **HP)
    x = torch.randn(4, 8).to(dtype)
    x[0, 0] = float("nan")
    for step in range(3):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=set_to_none)
            (m(x).float() * -1).sum().backward()
        assert_same_update(m1.parameters(), o1.state, m2.parameters(), o2.state,
                           f"step {step} after backward")
        o1.step()
        o2.step()
        assert_same_update(m1.parameters(), o1.state, m2.parameters(), o2.state, f"step {step}")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_one_overflowed_gradient_element_then_nan_everywhere(impl):
    """An inf gradient element makes the total norm inf, the clip coefficient 0, the clipped
    gradient NaN (the default NaN, 0xFFC00000) and then every later step NaN against NaN: where
    both the gradient element and the coefficient are NaN, ATen's vector body and scalar tail
    keep different ones, so one multiply over the flat buffer is not used for a non-finite
    coefficient."""
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    m2 = copy.deepcopy(m1)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=1.0, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(m2.parameters(), max_norm=1.0, **HP, **IMPLS[impl])
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(4, 8, generator=gen)
        for m, o in ((m1, ref), (m2, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            if step == 0:
                m[0].weight.grad[0, 0] = float("inf")
        total = ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        assert_same_update(m1.parameters(), ref.optimizer.state, m2.parameters(), opt.state,
                           f"step {step}")


def test_fp16_merged_fused_range_with_nan_parameters():
    """fp16 fused AdamW: a NaN parameter element (0xFE00) and a NaN gradient (0xFFFF) keep the
    parameter's NaN per tensor; a merged range must not be used where it keeps the other."""
    def make():
        ps = [nn.Parameter(torch.full((8,), 0.01, dtype=torch.float16)) for _ in range(4)]
        for p in ps:
            p.data.view(torch.int16)[4] = -512  # 0xFE00
            p.grad = torch.zeros_like(p)
            p.grad.view(torch.int16).fill_(-1)  # 0xFFFF
        return ps

    ps, qs = make(), make()
    ref = torch.optim.AdamW(ps, lr=1e-2, fused=True)
    opt = cotangent.AdamW(qs, lr=1e-2, fused=True)
    ref.step()
    opt.step()
    assert_same_update(ps, ref.state, qs, opt.state, "fp16 NaN parameters")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_parameter_clipped_twice_like_native(impl):
    """A tied embedding/head listed twice in `clip_order` (e.g. encoder then decoder
    parameters): native counts its norm twice and multiplies its gradient twice."""
    class TiedAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(8, 8)
            self.dec = nn.Linear(8, 8)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            return self.dec(torch.tanh(self.enc(x)))

    torch.manual_seed(0)
    m1 = TiedAE()
    m2 = copy.deepcopy(m1)

    def order(m):
        return lambda: list(m.enc.parameters()) + list(m.dec.parameters())

    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, clip_order=order(m1), **HP,
                                    **IMPLS[impl])
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, clip_order=order(m2), **HP,
                          **IMPLS[impl])
    lockstep(m1, ref, m2, opt, 3, "tied autoencoder", loss=_sum_of_squares)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_two_parameters_sharing_one_gradient_tensor(impl):
    """`e.grad = w.grad`: native clips that tensor twice (it is in the list twice) and both
    parameters read it; a copy into the buffer would untie them."""
    torch.manual_seed(0)
    m1 = nn.ModuleDict({"lin": nn.Linear(8, 8), "e": nn.ParameterList([nn.Parameter(
        torch.zeros(8))])})
    m2 = copy.deepcopy(m1)
    ref = cotangent.ReferenceUpdate(m1.parameters(), max_norm=0.05, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(m2.parameters(), max_norm=0.05, **HP, **IMPLS[impl])
    for step in range(3):
        x = torch.randn(4, 8)
        for m, o in ((m1, ref), (m2, opt)):
            o.zero_grad()
            m["lin"](x).square().sum().backward()
            m["e"][0].grad = m["lin"].bias.grad
        total = ref.step()
        opt.step()
        assert_same_bits(total, opt.last_total_norm, f"step {step} total norm")
        assert_same_update(m1.parameters(), ref.optimizer.state, m2.parameters(), opt.state,
                           f"step {step}")


# ------------------------------------------------------------------ issue 26: tensors the user holds

@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_gradient_assigned_once_and_refilled_every_step_is_read_every_step(impl):
    """The asynchronous actor-critic pattern: a worker's gradient tensor is assigned once as the
    shared model's ``.grad``, zeroed with ``zero_grad(set_to_none=False)`` and refilled in place
    by the worker (here ``copy_`` of the worker's gradient): native reads the user's tensor at
    every step, and so must Cotangent (it did not before: it read its own copy from the second
    step on)."""
    torch.manual_seed(0)
    shared = [nn.Linear(6, 4) for _ in range(2)]
    shared[1].load_state_dict(shared[0].state_dict())
    worker = nn.Linear(6, 4)
    opts = [torch.optim.AdamW(shared[0].parameters(), **HP, **IMPLS[impl]),
            cotangent.AdamW(shared[1].parameters(), max_norm=0.05, **HP, **IMPLS[impl])]
    held = [[torch.zeros_like(p) for p in m.parameters()] for m in shared]
    for m, grads in zip(shared, held):
        for p, g in zip(m.parameters(), grads):
            p.grad = g
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        worker.zero_grad()
        worker(torch.randn(5, 6, generator=gen)).square().sum().backward()
        for (m, o), grads in zip(zip(shared, opts), held):
            o.zero_grad(set_to_none=False)
            for g, w in zip(grads, worker.parameters()):
                g.copy_(w.grad)
        total = torch.nn.utils.clip_grad_norm_(shared[0].parameters(), 0.05)
        for o in opts:
            o.step()
        assert_same_bits(total, opts[1].last_total_norm, f"{impl} step {step}: total norm")
        assert all(p.grad is g for p, g in zip(shared[1].parameters(), held[1]))
        assert_same_update(shared[0].parameters(), opts[0].state, shared[1].parameters(),
                           opts[1].state, f"{impl} step {step}")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_parameter_memory_shared_with_tensors_outside_the_optimizer_is_updated_there(impl):
    """Two siblings of the second silent divergence of issue 26, which moved parameters into
    buffers of its own: (a) two modules built from one weight tensor (``from_pretrained`` with
    ``freeze=False`` twice): the other module sees every update; (b) an optimizer over
    parameters that are views of one flat tensor: the flat tensor sees every update. Native
    updates the memory itself, and so does Cotangent, with native's bits."""
    torch.manual_seed(0)
    weight = torch.randn(10, 4)
    sides = []
    for cls in (torch.optim.AdamW, cotangent.AdamW):
        a = nn.Embedding.from_pretrained(weight.clone(), freeze=False)
        b = nn.Embedding.from_pretrained(a.weight.data, freeze=True)  # shares a's memory
        flat = torch.randn(40, generator=torch.Generator().manual_seed(1))
        views = [nn.Parameter(flat[:24].view(6, 4)), nn.Parameter(flat[24:])]
        kw = dict(max_norm=0.05) if cls is cotangent.AdamW else {}
        opt = cls([a.weight] + views, **HP, **IMPLS[impl], **kw)
        sides.append((a, b, flat, views, opt))
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        idx = torch.randint(0, 10, (7,), generator=gen)
        x = torch.randn(3, 4, generator=gen)
        for a, b, flat, views, opt in sides:
            opt.zero_grad()
            (a(idx).square().sum() + (views[0] @ x.T).square().sum()
             + views[1].square().sum()).backward()
            if isinstance(opt, torch.optim.AdamW) and not isinstance(opt, cotangent.AdamW):
                torch.nn.utils.clip_grad_norm_([a.weight] + views, 0.05)
            opt.step()
        (a1, b1, f1, v1, o1), (a2, b2, f2, v2, o2) = sides
        assert_same_bits(b1.weight, b2.weight, f"{impl} step {step}: the other module")
        assert_same_bits(b2.weight, a2.weight, "the other module sees the update")
        assert_same_bits(f1, f2, f"{impl} step {step}: the flat tensor")
        assert v2[0].data_ptr() == f2.data_ptr()  # nothing moved
        assert_same_update([a1.weight] + v1, o1.state, [a2.weight] + v2, o2.state,
                           f"{impl} step {step}")


# ------------------------------------------------------------------ a review's inputs (issue 26)

def _two_params_run(make_opt, native_clip, variant, steps=2):
    torch.manual_seed(0)
    p0 = torch.randn(8, 8, requires_grad=True)
    p1 = torch.randn(8, 8, requires_grad=True)
    opt = make_opt([p0, p1])
    for s in range(steps):
        torch.manual_seed(1 + s)
        p1.grad = torch.randn(8, 8)
        p0.grad = p1.detach().t() if variant == "grad aliases a parameter" else (
            torch.randn(8, 8).t())
        if native_clip:
            torch.nn.utils.clip_grad_norm_([p0, p1], 1e6)
        opt.step()
        if s == 0 and variant == "shared step":
            opt.state[p1]["step"] = opt.state[p0]["step"]
    return [p0, p1], opt


@pytest.mark.parametrize("variant", ["grad aliases a parameter", "shared step"])
@pytest.mark.parametrize("impl", ["for-loop", "foreach"])
def test_a_parameter_left_out_of_the_pass_keeps_native_order(impl, variant):
    """A transposed gradient sends its parameter to a native call beside the single pass; when
    it shares memory with another parameter of the step (its gradient is that parameter, or a
    step tensor is shared), the whole step runs natively in native's order (a review found the
    left-out parameter updated after the others: other bytes)."""
    ps, on = _two_params_run(lambda q: torch.optim.AdamW(q, **IMPLS[impl]), True, variant)
    qs, oo = _two_params_run(lambda q: cotangent.AdamW(q, max_norm=1e6, **IMPLS[impl]), False,
                             variant)
    assert_same_update(ps, on.state, qs, oo.state, f"{impl} {variant}", grads=False)
    assert oo.update_path()["path"] == "native"


def test_a_clip_in_the_pass_never_reads_memory_a_native_call_wrote():
    """A for-loop group's gradient is a fused group's parameter: native multiplies every
    gradient before any update; the pass, multiplying inside the update, would read the
    parameter after the fused call updated it. Such a step runs natively."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)]

    def deliver(step, params):
        a, b = params
        a.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(1 + step))
        b.grad = a.detach()  # b's gradient is a's memory

    (step, problem, path, errors), = run_against_native(
        base, foreach=None, deliver=deliver, steps=1, max_norm=0.1,
        groups=[dict(params=[0], fused=True), dict(params=[1])])
    assert problem is None and errors == (None, None), problem
    assert path["clip_in_pass"] == 0


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_one_element_step_tensor_runs_as_native_runs_it(impl):
    """`state[p]["step"]` reshaped to (1,): native reads it with `.item()` and runs; so does
    Cotangent (natively: the pass takes 0-d step tensors only)."""
    def run(cls, **kw):
        torch.manual_seed(0)
        w = torch.randn(4, 4, requires_grad=True)
        opt = cls([w], **IMPLS[impl], **kw)
        for s in range(3):
            torch.manual_seed(5 + s)
            w.grad = torch.randn(4, 4)
            if s == 1:
                opt.state[w]["step"] = opt.state[w]["step"].reshape(1)
            opt.step()
        return [w], opt

    ps, on = run(torch.optim.AdamW)
    qs, oo = run(cotangent.AdamW)
    assert_same_update(ps, on.state, qs, oo.state, f"(1,) step, {impl}")


@pytest.mark.parametrize("impl", list(IMPLS))
def test_an_expanded_gradient_under_an_inactive_clip_raises_as_native(impl):
    """Native's clip multiplies by 1.0 too, which raises for an expanded (self-overlapping)
    gradient; Cotangent's skip of a multiply by exactly 1.0 must not hide that."""
    errors = []
    for cls, kw in ((torch.optim.AdamW, {}), (cotangent.AdamW, dict(max_norm=1e6))):
        w = torch.randn(4, 4, requires_grad=True)
        opt = cls([w], **IMPLS[impl], **kw)
        w.grad = torch.randn(4).expand(4, 4)
        before = w.detach().clone()
        with pytest.raises(RuntimeError) as error:
            if cls is torch.optim.AdamW:
                torch.nn.utils.clip_grad_norm_([w], 1e6)
            opt.step()
        errors.append(str(error.value))
        assert_same_bits(w, before, "nothing updated")
    # native's reason, the parameter named, raised before anything is modified
    assert "more than one element of the written-to tensor refers to a single memory " \
        "location" in errors[0]
    assert errors[1].startswith("the gradient of parameter 0 (shape (4, 4), float32) overlaps "
                                "itself") and "refers to a single memory location" in errors[1]


def _unmultipliable(kind: str) -> torch.Tensor:
    """A 16-element gradient native's clip multiply raises on: expanded (one element for all)
    or an inference tensor."""
    if kind == "expanded":
        return torch.ones(1).expand(16)
    with torch.inference_mode():
        return torch.randn(16)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_a_gradient_the_clip_cannot_multiply_is_refused_before_anything_changes(impl, kind):
    """Native's clip multiplies gradient by gradient and raises at an expanded or an inference
    gradient, the ones before it multiplied already, and its optimizer never starts. Cotangent
    refuses it before anything is modified: no gradient multiplied (single pass or not), no
    state created, no parameter moved; the error names the parameter. (Found by a review:
    the state was created and the single pass left the first gradient unmultiplied.)"""
    ps = [torch.nn.Parameter(torch.randn(16)) for _ in range(3)]
    opt = cotangent.AdamW(ps, max_norm=0.1, **IMPLS[impl])
    ps[0].grad, ps[2].grad = torch.randn(16), torch.randn(16)
    ps[1].grad = _unmultipliable(kind)
    before = [t.detach().clone() for t in (*ps, ps[0].grad, ps[2].grad)]
    with pytest.raises(RuntimeError, match=r"^the gradient of parameter 1 \(shape \(16,\), "
                       r"float32\) (overlaps itself|is an inference tensor)"):
        opt.step()
    for t, b in zip((*ps, ps[0].grad, ps[2].grad), before):
        assert_same_bits(t.detach(), b, "nothing modified")
    assert len(opt.state) == 0
    with pytest.raises(RuntimeError, match="the gradient of parameter 1"):
        opt.clip_grad_norm_()  # (the clip on its own too)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("kind", ["expanded", "inference"])
def test_a_clip_order_gradient_outside_the_optimizer_is_checked_like_its_own(impl, kind):
    """The same refusal where the gradient the clip cannot multiply belongs to a parameter of
    the clip order outside the optimizer, while the optimizer's own group is read whole in C++
    (state created by two steps first): the C++ reader's checks cover the group's gradients,
    not the clip order's others, which are checked as before."""
    ps = [torch.nn.Parameter(torch.randn(16)) for _ in range(3)]
    opt = cotangent.AdamW([ps[0], ps[2]], max_norm=0.1, clip_order=list(ps), **IMPLS[impl])
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(16)
        opt.step()
    ps[0].grad, ps[2].grad = torch.randn(16), torch.randn(16)
    ps[1].grad = _unmultipliable(kind)
    state = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    before = [t.detach().clone() for t in (*ps, ps[0].grad, ps[2].grad)]
    with pytest.raises(RuntimeError, match="the gradient of a|overlaps itself|inference"):
        opt.step()
    for t, b in zip((*ps, ps[0].grad, ps[2].grad), before):
        assert_same_bits(t.detach(), b, "nothing modified")
    for k, v in state.items():
        assert_same_bits(opt.state[ps[0]][k], v, k)


# ------------------------------------------------------------------ complex parameters

@pytest.mark.parametrize("max_norm", [None, 1.0, 1e30], ids=["no-clip", "clip", "clip-inactive"])
@pytest.mark.parametrize("impl", ["foreach", "for-loop"])
def test_complex_parameters_are_updated_as_real_pairs_like_native(impl, max_norm):
    """Native AdamW updates a complex parameter as pairs of reals (`_init_group` finds
    ``has_complex``; foreach then views every complex tensor as real, the for-loop each one);
    so must Cotangent's native call, alone or beside a real parameter in the group (a review's
    input: foreach had squared the gradient as a complex number, exp_avg_sq with negative real
    parts)."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(3, dtype=torch.complex64, generator=gen), torch.randn(5, generator=gen)]
    for shapes in (init[:1], init):
        pa = [nn.Parameter(t.clone()) for t in shapes]
        pb = [nn.Parameter(t.clone()) for t in shapes]
        ref = torch.optim.AdamW(pa, **HP, **IMPLS[impl])
        opt = cotangent.AdamW(pb, max_norm=max_norm, **HP, **IMPLS[impl])
        for step in range(3):
            g = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in shapes]
            for p, q, t in zip(pa, pb, g):
                p.grad, q.grad = t.clone(), t.clone()
            if max_norm is not None:
                total = torch.nn.utils.clip_grad_norm_(pa, max_norm)
            ref.step()
            opt.step()
            what = f"{impl} {len(shapes)} parameters, step {step}"
            assert_same_update(pa, ref.state, pb, opt.state, what)
            if max_norm is not None:
                assert_same_bits(opt.last_total_norm, total, what + ": total norm")


# ------------------------------------------------------------------ tensors whose memory is not
#                                                                     plainly theirs to write

def _inference_copy(t):
    with torch.inference_mode():
        return t.clone()


class _RoundingTensor(torch.Tensor):
    """A tensor subclass with a `__torch_dispatch__` of its own (`__torch_function__` disabled,
    as nn.Parameter's): after every in-place op on it, its values are rounded to bfloat16."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._mode_utils import no_dispatch
        with no_dispatch():
            out = func(*args, **(kwargs or {}))
            if func._schema.name.endswith("_") and isinstance(args[0], _RoundingTensor):
                args[0].copy_(args[0].bfloat16().float())
        return out


# a tensor the single pass must leave to native: how it is made, which tensors it may replace
SPECIAL_TENSORS = {
    # reads give t, memory holds -t
    "negative-bit view": (lambda t: (-t)._neg_view(), ("grad", "exp_avg", "step")),
    # native's in-place ops refuse it outside inference mode (its fused kernel takes some)
    "inference tensor": (_inference_copy, ("grad", "exp_avg", "exp_avg_sq", "step")),
    # no memory (a null data pointer), immutable
    "ZeroTensor": (lambda t: torch._efficientzerotensor(t.shape), ("grad", "exp_avg",
                                                                   "exp_avg_sq")),
    # native's ops run its own code
    "dispatch subclass": (_RoundingTensor, ("exp_avg",)),
}
SPECIAL_CASES = [(kind, target) for kind, (_, targets) in SPECIAL_TENSORS.items()
                 for target in targets]


def _values(t):
    """`t` as a plain tensor holding its values (for the byte comparison)."""
    return t.as_subclass(torch.Tensor).resolve_neg().clone()


def _special_tensor_run(make, impl: str, clip: bool, kind: str, target: str):
    """Two steps over two parameters, the second with a `SPECIAL_TENSORS` tensor as its
    gradient (both steps) or, on the second step, as a state entry (so a call split around it
    would show): (what each step raised or "ok", the parameters, their states)."""
    special = SPECIAL_TENSORS[kind][0]
    gen = torch.Generator().manual_seed(5)
    params = [nn.Parameter(torch.randn(100, generator=gen)) for _ in range(2)]
    extra = dict(max_norm=1.0) if clip and make is cotangent.AdamW else {}
    opt = make(params, **HP, **IMPLS[impl], **extra)
    outcome = []
    for i in range(2):
        for j, p in enumerate(params):
            g = torch.randn(100, generator=torch.Generator().manual_seed(10 * i + j))
            p.grad = special(g) if target == "grad" and j == 1 else g
        if i == 1 and target != "grad":
            opt.state[params[1]][target] = special(opt.state[params[1]][target].clone())
        try:
            if clip and make is torch.optim.AdamW:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            outcome.append("ok")
        except Exception as e:  # (native raises RuntimeError, or ZeroDivisionError at step 0)
            outcome.append(f"{type(e).__name__}: {e}")
    return outcome, params, [opt.state[p] for p in params]


@pytest.mark.parametrize("reader", [True, False], ids=["compiled-reader", "python-checks"])
@pytest.mark.parametrize("kind,target", SPECIAL_CASES, ids=[f"{k}-{t}" for k, t in SPECIAL_CASES])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_tensors_not_plain_memory_get_natives_bytes_or_natives_error(impl, clip, kind, target,
                                                                      reader, monkeypatch):
    """The single pass and the norm kernel read and write memory, so a tensor whose memory
    does not hold its values (a negative-bit view, a ZeroTensor), that native may not write in
    place (an inference tensor) or whose ops run code of its own (a `__torch_dispatch__`
    subclass) is native's to handle, with its whole call (a call split around it would have
    updated the other parameter when native raises): the same error where native raises, else
    the same bytes. Both list checks (the compiled reader and the Python reference) send it
    there."""
    from cotangent import tensorlists
    if not reader:
        monkeypatch.setattr(tensorlists, "reader", lambda: None)
    ours, ps, states = _special_tensor_run(cotangent.AdamW, impl, clip, kind, target)
    theirs, ps_native, states_native = _special_tensor_run(torch.optim.AdamW, impl, clip, kind,
                                                           target)
    for mine, native in zip(ours, theirs, strict=True):
        if mine != native:  # a gradient native's clip multiply raises at: refused up front,
            assert clip and native.startswith("RuntimeError: ") and mine.startswith(  # named
                "RuntimeError: the gradient of parameter 1 "), (mine, native)
    for i in range(2):
        assert_same_bits(_values(ps[i].detach()), _values(ps_native[i].detach()), f"param {i}")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in states_native[i]:
                assert_same_bits(_values(states[i][key]), _values(states_native[i][key]),
                                 f"{key} {i}")


class _CountingParameter(nn.Parameter):
    """A parameter subclass with a `__torch_function__` of its own (here it counts the torch
    calls made on it and, for `mul_` by a float, rounds the factor to bfloat16 first: a stand-in
    for subclasses that compute otherwise)."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        if func is torch.Tensor.mul_ and len(args) == 2 and isinstance(args[1], float):
            args = (args[0], float(torch.tensor(args[1]).bfloat16()))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reader", [True, False], ids=["compiled-reader", "python-checks"])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_parameter_subclass_overriding_torch_function_sees_natives_calls(impl, reader,
                                                                          monkeypatch):
    """Native's ops go through a subclass's `__torch_function__`; the single pass would skip
    it (other bytes where it computes otherwise), so such a call runs natively."""
    from cotangent import tensorlists
    if not reader:
        monkeypatch.setattr(tensorlists, "reader", lambda: None)
    out = []
    for make in (torch.optim.AdamW, cotangent.AdamW):
        p = _CountingParameter(torch.randn(64, generator=torch.Generator().manual_seed(3)))
        opt = make([p], **HP, **IMPLS[impl])
        for i in range(2):
            p.grad = torch.randn(64, generator=torch.Generator().manual_seed(i))
            opt.step()
        out.append((p.detach().clone(), opt.state[p]["exp_avg"].clone(), _CountingParameter.calls))
        _CountingParameter.calls = 0
    assert_same_bits(out[0][0], out[1][0], "parameter")
    assert_same_bits(out[0][1], out[1][1], "exp_avg")
    assert out[1][2] >= out[0][2] > 0  # (every native call reached it)


# ------------------------------------------------------------------ torch's default dtype
# A break-it review's input: `torch.set_default_dtype` changed once the process had stepped (the
# probes run, their verdicts kept): the C norms wrote float32 values into buffers allocated in
# the default dtype (float64: a garbage total norm and gradients clipped to about 0, no error;
# bfloat16 / float16: four-byte writes into two-byte buffers). Its siblings: every tensor the
# library makes for its probes, its vector-width readings and its C buffers now names its dtype.

def _default_dtype_case(impl: str, steps: int) -> list[tuple]:
    """`run_against_native` over three float32 tensors, the clip active every step."""
    base = [t.detach() for t in _params([(37,), (8, 16), (300,)])[0]]
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(b.shape, generator=gen, dtype=torch.float32) * 2 for b in base]
             for _ in range(steps)]

    def deliver(step, params):
        for p, g in zip(params, grads[step]):
            p.grad = g.clone()

    flags = dict(IMPLS[impl])
    return run_against_native(base, foreach=flags.pop("foreach", None), deliver=deliver,
                              steps=steps, max_norm=0.5, adamw=dict(HP, **flags))


@pytest.mark.parametrize("default", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", list(IMPLS))
def test_default_dtype_changed_after_the_first_step_keeps_natives_bits(impl, default):
    _default_dtype_case(impl, steps=1)  # (the probes, under float32)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        runs = _default_dtype_case(impl, steps=3)
    finally:
        torch.set_default_dtype(before)
    for step, problem, path, errors in runs:
        assert problem is None and errors == (None, None), (step, problem, errors)
        assert path["path"] == "single-pass" and path["clip_in_pass"] == 3, path


_FLOAT64_FROM_THE_START = """
import json, sys, torch
torch.set_default_dtype(torch.float64)
sys.path.insert(0, sys.argv[1])
import test_inputs
out = {}
for impl in test_inputs.IMPLS:
    runs = test_inputs._default_dtype_case(impl, steps=3)
    out[impl] = [[problem, errors, path["path"]] for _, problem, path, errors in runs]
print(json.dumps(out))
"""


def test_default_dtype_float64_before_the_probes_keeps_natives_bits_and_the_single_pass(
        tmp_path):
    """A process whose default dtype is float64 before its first step (its probes, vector
    widths and square-root check run under it; a fresh verdict cache): native's bytes, and the
    single pass proven as under float32 (it was refused: the probe data came out float64)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, COTANGENT_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", _FLOAT64_FROM_THE_START,
                          str(Path(__file__).parent)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(out) == sorted(IMPLS)
    for impl, runs in out.items():
        assert len(runs) == 3
        for problem, errors, path in runs:
            assert problem is None and errors == [None, None], (impl, problem, errors)
            assert path == "single-pass", (impl, path)


# ------------------------------------------------------------------ containers with their own protocol

class _SkipsFirst(list):
    """A list whose iteration leaves out its first entry (native iterates it)."""

    def __iter__(self):
        return iter(list.__getitem__(self, slice(1, None)))


class _HalvedLr(dict):
    """A param group that reads its lr through ``__getitem__`` at half the stored value."""

    def __getitem__(self, key):
        value = super().__getitem__(key)
        return value * 0.5 if key == "lr" else value


def _mlp_pair(impl, group=None):
    from cases import HP, IMPLS, mlp

    m1 = mlp()
    m2 = copy.deepcopy(m1)
    make = (lambda m: list(m.parameters())) if group is None else (
        lambda m: [group(params=list(m.parameters()))])
    ref = cotangent.ReferenceUpdate(make(m1), max_norm=0.05, **HP, **IMPLS[impl])
    opt = cotangent.AdamW(make(m2), max_norm=0.05, **HP, **IMPLS[impl])
    return m1, ref, m2, opt


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_a_params_list_subclass_is_refused_before_anything_moves(impl):
    """A review's input: ``group["params"]`` replaced by a list subclass whose iteration
    differs from its storage (native iterates it; the C++ readers read the storage) made the
    full step create state for other parameters than native's and, with fused, corrupt the heap.
    Now a TypeError before anything is modified, on a full step and on one the last step
    planned (the replay declines a params list that is not exactly a list)."""
    from cases import square

    m1, ref, m2, opt = _mlp_pair(impl)
    lockstep(m1, ref, m2, opt, 3, f"before ({impl})")
    assert opt.update_path()["replayed"]
    opt.zero_grad()
    square(m2, torch.randn(4, 8), 0).backward()
    opt.param_groups[0]["params"] = _SkipsFirst(opt.param_groups[0]["params"])
    params = list(list.__iter__(opt.param_groups[0]["params"]))  # (its storage: all four)
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    with pytest.raises(TypeError, match="'params' is a _SkipsFirst, not a list"):
        opt.step()
    for p, (value, grad) in zip(params, before):
        assert_same_bits(p.detach(), value, "parameter after the refusal")
        assert_same_bits(p.grad, grad, "gradient after the refusal")
        for key, kept in states[id(p)].items():
            assert_same_bits(opt.state[p][key], kept, f"{key} after the refusal")


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_a_param_group_reading_through_getitem_is_followed_and_never_replayed(impl):
    """A review's input: a param group of a dict subclass whose ``__getitem__`` changes the lr.
    Native reads through it, and so does the full step; the replay read the dict's storage and
    stepped with the stored lr (different bytes, no error). Now such a group never replays:
    native's bytes at every step (CPU, float32, torch 2.13.0)."""
    m1, ref, m2, opt = _mlp_pair(impl, group=_HalvedLr)
    replayed = []
    lockstep(m1, ref, m2, opt, 5, f"dict subclass group ({impl})",
             after_step=lambda step: replayed.append(opt.update_path()["replayed"]))
    assert replayed == [False] * 5, replayed
    assert opt.update_path()["path"] == "single-pass", opt.update_path()


def test_a_max_norm_past_floats_range_after_a_plan_raises_natives_error():
    """A review's input: ``max_norm`` set to an int no float holds (2**1100) after a step made
    a plan: native's clip raises OverflowError, and so does Cotangent's step (the replay
    declines; it raised struct.error), nothing modified."""
    from cases import square

    m1, ref, m2, opt = _mlp_pair("fused")
    lockstep(m1, ref, m2, opt, 3, "before")
    assert opt.update_path()["replayed"]
    for m in (m1, m2):
        m.zero_grad()
        square(m, torch.randn(4, 8, generator=torch.Generator().manual_seed(3)), 0).backward()
    with pytest.raises(OverflowError) as native:
        torch.nn.utils.clip_grad_norm_(m1.parameters(), 2 ** 1100)
    opt.max_norm = 2 ** 1100
    before = [(p.detach().clone(), p.grad.clone()) for p in m2.parameters()]
    with pytest.raises(OverflowError) as ours:
        opt.step()
    assert str(ours.value) == str(native.value)
    for p, (value, grad) in zip(m2.parameters(), before):
        assert_same_bits(p.detach(), value, "parameter after the error")
        assert_same_bits(p.grad, grad, "gradient after the error")
