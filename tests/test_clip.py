"""Clipping: the clip_grad_norm_ drop-ins, the per-tensor and batched norms and their probes, the clip order.

`cotangent.clip_grad_norm_` vs `torch.nn.utils.clip_grad_norm_`, byte for byte (CPU).

Calibrated batched norms and the clip coefficient against native, byte for byte (CPU).

The clip order with param groups: native's bits, or a clear error, never a silent choice.

A native loop with decay / no-decay groups clips ``clip_grad_norm_(model.parameters(), M)``; the
total norm's bits depend on that order. `cotangent.AdamW(groups, max_norm=M)` cannot see the
model, so with two or more param groups holding parameters it requires ``clip_order``
(``model``, a list, or ``"param_groups"``). Every case below is compared byte for byte against
the native loop (CPU, float32, torch as installed; for-loop, foreach and fused AdamW) after every
step: loss, total norm, clipped gradients, parameters, ``exp_avg``, ``exp_avg_sq``, ``step``.
"""

from __future__ import annotations

import json
import warnings

import cotangent
import pytest
import torch
import torch.nn.functional as F
from cotangent import calibration, norms
from cotangent.clip import group_norms
from cotangent.harness.packed import norms as packed_norms
from cotangent.harness.packed.layout import plan_layouts
from cotangent.verify import first_difference
from torch import nn

from bitwise import assert_same_bits, assert_same_update


LENGTHS = [1, 2, 3, 4, 5, 6, 8, 10, 31, 32, 33, 62, 64, 66, 126, 128, 130, 254, 256, 258, 510,
           512, 514, 1022, 1024, 1026, 4094, 4096, 4098, 16384, 65536, 262144]


def _rows_in_one_buffer(n: int, k: int, dtype, seed: int) -> list[torch.Tensor]:
    """k gradients of n elements as 64-byte aligned rows of one flat buffer (like cotangent.AdamW)."""
    align = 64 // torch.empty((), dtype=dtype).element_size()
    stride = -(-n // align) * align
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(k * stride, generator=gen).to(dtype)
    return [flat[i * stride:i * stride + n] for i in range(k)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_norm_sweep_per_tensor_and_total(dtype, k):
    """32 lengths x bucket sizes {1, 3, 8}: per-tensor norms, total and clipped grads."""
    for n in LENGTHS:
        rows = _rows_in_one_buffer(n, k, dtype, seed=n * 10 + k)
        ours = group_norms(rows, 2.0, None)
        native = torch._foreach_norm([r.clone() for r in rows], 2.0)
        for i in range(k):
            assert_same_bits(ours[i], native[i], f"norm of row {i}, n={n}, k={k}, {dtype}")
        params_ours = [torch.nn.Parameter(torch.zeros_like(r)) for r in rows]
        params_native = [torch.nn.Parameter(torch.zeros_like(r)) for r in rows]
        for po, pn, r in zip(params_ours, params_native, rows):
            po.grad = r  # the views into the flat buffer
            pn.grad = r.clone()
        t_ours = cotangent.clip_grad_norm_(params_ours, 0.5)
        t_native = torch.nn.utils.clip_grad_norm_(params_native, 0.5)
        assert_same_bits(t_ours, t_native, f"total norm n={n}, k={k}, {dtype}")
        for po, pn in zip(params_ours, params_native):
            assert_same_bits(po.grad, pn.grad, f"clipped grad n={n}, k={k}, {dtype}")


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
def test_mixed_dtypes_order_and_norm_types(foreach, norm_type):
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    shapes = [(7,), (3, 4), (16,), (5, 5), (2, 3, 4)]
    ps = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    qs = [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    for p, q in zip(ps, qs):
        p.grad = (torch.randn(p.shape, generator=gen) * 3).to(p.dtype)
        q.grad = p.grad.clone()
    t1 = torch.nn.utils.clip_grad_norm_(ps, 0.1, norm_type, foreach=foreach)
    t2 = cotangent.clip_grad_norm_(qs, 0.1, norm_type, foreach=foreach)
    assert_same_bits(t1, t2, "total")
    for p, q in zip(ps, qs):
        assert_same_bits(p.grad, q.grad, "clipped grad")


def test_edge_cases_match_native():
    # empty list: a CPU float32 zero, nothing clipped
    assert_same_bits(cotangent.clip_grad_norm_([], 1.0), torch.nn.utils.clip_grad_norm_([], 1.0),
                     "empty")
    # empty generator warns, as native
    with pytest.warns(UserWarning, match="empty generator"):
        cotangent.clip_grad_norm_((p for p in []), 1.0)
    # a zero-size gradient with the inf norm raises, as native
    p = torch.nn.Parameter(torch.zeros(0))
    p.grad = torch.zeros(0)
    with pytest.raises(RuntimeError) as native_err:
        torch.nn.utils.clip_grad_norm_([p], 1.0, float("inf"))
    with pytest.raises(RuntimeError) as our_err:
        cotangent.clip_grad_norm_([p], 1.0, float("inf"))
    assert str(native_err.value) == str(our_err.value)
    # non-finite with error_if_nonfinite: raises before modifying anything
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.tensor([1.0, float("inf"), 2.0])
    before = q.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):
        cotangent.clip_grad_norm_([q], 1.0, error_if_nonfinite=True)
    assert_same_bits(q.grad, before, "grad after refused clip")
    # duplicates are counted twice and scaled twice, as native
    r1, r2 = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    r1.grad, r2.grad = torch.arange(4.0), torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_bits(torch.nn.utils.clip_grad_norm_([r1, r1], 1.0),
                         cotangent.clip_grad_norm_([r2, r2], 1.0), "duplicates total")
    assert_same_bits(r1.grad, r2.grad, "duplicates grad")


NORM_LENGTHS = [1, 2, 3, 5, 8, 31, 33, 64, 130, 1026, 4098, 65536]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_layout_norms_and_total_equal_native(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in NORM_LENGTHS for _ in range(rows)]
    perm = torch.randperm(len(grads), generator=gen).tolist()  # parameter order != length order
    grads = [grads[i] for i in perm]
    (layout,) = plan_layouts(grads)
    packed_norms.calibrate_layout(layout, 2.0, None)
    flat = layout.new_buffer(-0.0)
    for seg in layout.segments:
        layout.view(flat, seg).copy_(grads[seg.slot])
    ours = packed_norms.layout_norms(layout, flat, 2.0, None)
    native = torch._foreach_norm(grads, 2.0)
    for pos, seg in enumerate(layout.segments):
        assert_same_bits(ours[pos], native[seg.slot], f"norm of length {seg.numel}")
    position = {seg.slot: pos for pos, seg in enumerate(layout.segments)}
    ordered = ours.index_select(0, torch.tensor([position[i] for i in range(len(grads))]))
    assert_same_bits(norms.total_norm(ordered, 2.0),
                     torch.nn.utils.get_total_norm(grads, 2.0), "total norm")


def test_clip_coefficient_is_native_arithmetic():
    gen = torch.Generator().manual_seed(0)
    totals = torch.rand(2000, generator=gen) * 10
    totals = totals[totals > 0.7]  # where the coefficient is not clamped to 1
    ours = torch.stack([norms.clip_coefficient(t, 0.7) for t in totals])
    native = []
    for t in totals:  # torch's own clipping applied to a gradient of ones yields its coefficient
        p = torch.nn.Parameter(torch.zeros(1))
        p.grad = torch.ones(1)
        torch.nn.utils.clip_grads_with_norm_([p], 0.7, t)
        native.append(p.grad[0])
    native = torch.stack(native)
    division = torch.clamp(torch.tensor(0.7) / (totals + 1e-6), max=1.0)
    assert_same_bits(ours, native, "clip coefficient")
    # The reciprocal-then-multiply form really is different from a true division somewhere,
    # so this test would catch a "simplification" to a division.
    assert not torch.equal(ours.view(torch.int32), division.view(torch.int32))


@pytest.mark.parametrize("max_norm", [0.7, 1.0, 5, 0.0, -1.0, 1e-30, 3e38, float("inf")])
def test_the_compiled_clip_scalars_are_clip_grad_norm_s(max_norm):
    """`singlepass.clip_scalars` (the total norm and the coefficient in C) against
    clip_grad_norm_'s Python ops on the same per-tensor norms, byte for byte: random norms of
    every scale, and special ones (zeros, subnormals, inf, NaN, the largest float32), one and
    many per total (the norm probe checks fewer of these wherever they are used)."""
    from cotangent import singlepass
    from cotangent.calibration import SPECIAL_VALUES, write_special

    scalars = singlepass.clip_scalars
    gen = torch.Generator().manual_seed(1)
    scales = 10.0 ** torch.randint(-40, 39, (200,), generator=gen).double()
    cases = [torch.rand(k, generator=gen) * float(scales[i])
             for i, k in enumerate((1, 2, 7, 146, 1000) * 40)]
    for v in (*SPECIAL_VALUES, 3.4e38, 1e-45):
        one = torch.zeros(1)
        write_special(one, 0, v)
        cases += [one, torch.cat([torch.rand(5, generator=gen), one])]
    for norms_ in cases:
        total, coef, value = scalars(norms_, float(max_norm))
        native_total = torch.linalg.vector_norm(norms_, 2.0)
        assert_same_bits(total, native_total, "total norm")
        assert_same_bits(coef, norms.clip_coefficient(native_total, max_norm), "coefficient")
        assert value == coef.item() or (value != value and coef.item() != coef.item())


def test_calibration_is_inspectable_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    cpu = torch.device("cpu")
    assert norms.bucket_norm_is_exact(cpu, torch.float32, 64, 4, 64, 2.0, None)
    rows = calibration.table()
    assert any(r["kind"] == "bucket_norm" and r["args"][:3] == ["float32", "64", "4"] and
               r["verdict"] for r in rows)
    saved = json.loads((tmp_path / calibration.FILE_NAME).read_text())["verdicts"]
    assert len(saved) == 1 and list(saved.values()) == [True]
    # A fresh process (simulated) reads the verdict from the file instead of probing again.
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    def probed_again(key, verdict):
        raise AssertionError(f"probed again: {key}")
    monkeypatch.setattr(calibration, "record", probed_again)  # every probe records its verdict
    assert norms.bucket_norm_is_exact(cpu, torch.float32, 64, 4, 64, 2.0, None)
    # A one-row bucket is never "batched": the native per-tensor call is used as is.
    assert not norms.bucket_norm_is_exact(cpu, torch.float32, 64, 1, 64, 2.0, None)


def test_corrupt_cache_file_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    (tmp_path / calibration.FILE_NAME).write_text("{not json")
    assert norms.bucket_norm_is_exact(torch.device("cpu"), torch.float32, 32, 3, 32, 2.0, None)


def test_calibration_rejects_a_batched_call_that_differs(monkeypatch, tmp_path):
    """If the 2-D reduction were different, the probe must say so (and the fallback is used).
    The forced False verdict goes to a cache of its own, never the one later tests read."""
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    real = torch.linalg.vector_norm

    def perturbed(x, ord=2, dim=None, **kw):
        out = real(x, ord, dim=dim, **kw)
        return out if dim is None else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(norms.torch.linalg, "vector_norm", perturbed)
    assert not norms.bucket_norm_is_exact(torch.device("cpu"), torch.float32, 96, 5, 96, 2.0, False)


def test_the_probes_byte_comparison_takes_0_dim_tensors():
    """A total norm is 0-dim: -0.0 and +0.0 differ, equal NaNs agree (it raised before)."""
    assert not norms._bytes_equal(torch.tensor(0.0), torch.tensor(-0.0))
    assert norms._bytes_equal(torch.tensor(float("nan")), torch.tensor(float("nan")))
    assert not norms._bytes_equal(torch.tensor(1.0), torch.tensor([1.0]))


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
