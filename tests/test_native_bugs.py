"""Native bugs Cotangent knowingly reproduces (`cotangent.native_bugs`): the bits stay native's,
and a `NativeBugWarning` naming the upstream fix is given once per process, only where the bug
affects the run.

The one known case: torch.optim.Muon with bfloat16 parameters and ``nesterov=False`` overwrites
its momentum buffer with the normalised update (``.bfloat16()`` returns the buffer itself, then
``div_``); pytorch/pytorch PR #194664 makes the conversion a copy. "A torch with the fix" is
simulated here by wrapping torch's `_zeropower_via_newtonschulz` so that a bfloat16 input is
copied first (`fixed_torch`), which is the effect of that PR.

Every byte comparison goes through tests/bitwise.py (`cotangent.verify.first_difference`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cotangent
import cotangent.muon as cm
import cotangent.muon_batched as cmb
import cases
from bitwise import assert_same_bits, assert_same_update, same_bits
from cotangent import _compat, native_bugs
from cotangent.calibration import sprinkle_special_values
from cotangent.native_bugs import MUON_BF16_BUFFER_OVERWRITE as BUG
from cotangent.native_bugs import NativeBugWarning

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Every test starts as a fresh process would: not yet warned (the probe verdict is kept,
    except where a test simulates another torch)."""
    monkeypatch.setattr(native_bugs, "_WARNED", set())


@pytest.fixture
def fixed_torch(monkeypatch):
    """torch.optim.Muon as with the upstream fix: a bfloat16 input of the Newton-Schulz step is
    copied before it is normalised in place. Probe verdicts and calibration verdicts are
    private to the test (both would otherwise describe the unpatched torch)."""
    import torch.optim._muon as tm

    real = tm._zeropower_via_newtonschulz

    def copying(grad, *args, **kwargs):
        return real(grad.clone() if grad.dtype == BF16 else grad, *args, **kwargs)

    monkeypatch.setattr(tm, "_zeropower_via_newtonschulz", copying)
    monkeypatch.setattr(native_bugs, "_PRESENT", {})
    monkeypatch.setenv("COTANGENT_CACHE_DIR", "off")
    monkeypatch.setattr(cm.calibration, "_MEMORY", {})


def native_has_bug() -> bool:
    """Observed on torch.optim.Muon itself (never through cotangent's probe, so that a
    Cotangent that stopped reproducing the bug fails these tests rather than skipping them)."""
    buf, expected = one_native_step(BF16, nesterov=False)
    return not same_bits(buf, expected)


def needs_bug():
    if not native_has_bug():
        pytest.skip(f"torch.optim.Muon of torch {torch.__version__} does not overwrite its "
                    "bfloat16 momentum buffer")


def one_native_step(dtype, nesterov, shape=(8, 16), momentum=0.9):
    p = nn.Parameter(torch.zeros(shape, dtype=dtype))
    p.grad = torch.ones_like(p)
    opt = torch.optim.Muon([p], lr=0.0, weight_decay=0.0, momentum=momentum, nesterov=nesterov)
    opt.step()
    expected = torch.zeros(shape, dtype=dtype).lerp_(torch.ones(shape, dtype=dtype), 1 - momentum)
    return opt.state[p]["momentum_buffer"], expected


def recorded(fn):
    """NativeBugWarnings raised while `fn()` runs, with every warning let through ("always":
    the once-only rule must not depend on Python's per-location dedup)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, NativeBugWarning)]


def params_of(specs, dtype, seed=0):
    """One list of parameters per group; `specs` = per group, a list of shapes ("T" suffix:
    a transposed, non-contiguous matrix that stays on the per-matrix path)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for shapes in specs:
        ps = []
        for shape in shapes:
            if shape[-1] == "T":
                t = torch.randn(shape[1], shape[0], generator=g).mul_(0.1).to(dtype).t()
            else:
                t = torch.randn(*shape, generator=g).mul_(0.1).to(dtype)
            ps.append(nn.Parameter(t))
        groups.append(ps)
    return groups


def seeded_grads(params, dtype, step, seed, specials):
    """Gradients of one step (with `specials`, step 1's first one holds NaN, infinities,
    signed zeros and subnormals)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    grads = [torch.randn(p.shape, generator=g).to(dtype) for p in params]
    if specials and step == 1:
        sprinkle_special_values([grads[0].view(-1)], shift=step)
    return grads


def lockstep(kw, specs, dtype, steps, *, seed=0, specials=False):
    """torch.optim.Muon and cotangent.Muon on equal parameters and seeded gradients through
    `cases.lockstep_params` (after every step every parameter, gradient and momentum buffer
    byte-equal). Returns (native params, our optimizer)."""
    gn, go = params_of(specs, dtype, seed), params_of(specs, dtype, seed)
    opt_n = torch.optim.Muon([{"params": ps} for ps in gn], **kw)
    opt_o = cotangent.Muon([{"params": ps} for ps in go], **kw)
    flat_n, flat_o = [p for ps in gn for p in ps], [p for ps in go for p in ps]
    cases.lockstep_params(flat_n, opt_n, flat_o, opt_o, steps, "Muon",
                          grads=lambda step: seeded_grads(flat_n, dtype, step, seed, specials))
    return flat_n, opt_o


def on_fixed_torch(kw, specs, dtype, steps, *, seed=0, specials=False):
    """torch.optim.Muon's parameters after `steps` steps as `lockstep` runs them, on a torch
    with the upstream fix (a bfloat16 Newton-Schulz input copied first)."""
    import torch.optim._muon as tm

    real = tm._zeropower_via_newtonschulz
    tm._zeropower_via_newtonschulz = lambda grad, *a: real(grad.clone(), *a)
    try:
        flat = [p for ps in params_of(specs, dtype, seed) for p in ps]
        opt = torch.optim.Muon(flat, **kw)
        for step in range(steps):
            for p, gr in zip(flat, seeded_grads(flat, dtype, step, seed, specials)):
                p.grad = gr
            opt.step()
    finally:
        tm._zeropower_via_newtonschulz = real
    return flat


SPECS = [[(32, 32)] * 3 + [(64, 32), (24, 40, "T")]]  # a batch of 3, a tall one, a lone one
SMALL = [[(64, 64)] * 2, [(32, 64, "T")]]  # two groups: a batch of 2, a lone one
LONE = [[(16, 8, "T")] * 2, [(8, 16, "T")]]  # per-matrix only (no calibration probe to run)


# ---------------------------------------------------------------------------- the mechanism


def test_probe_agrees_with_torch_optim_muon():
    """The probe's verdict is what torch.optim.Muon itself does: on torch 2.13 the buffer after
    one step holds 1/sqrt(numel) (0.0884 for 8 x 16) instead of lerp(0, 1, 0.1) = 0.1."""
    buf, expected = one_native_step(BF16, nesterov=False)
    overwritten = not same_bits(buf, expected)
    assert native_bugs.present(BUG) == overwritten
    if torch.__version__.startswith("2.13."):
        assert overwritten
    if overwritten:
        assert same_bits(buf, torch.full((8, 16), 128 ** -0.5, dtype=BF16))
        assert abs(expected[0, 0].item() - 0.1) < 1e-3


@pytest.mark.parametrize("dtype,nesterov", [(torch.float16, False), (torch.float32, False),
                                            (torch.float64, False), (BF16, True)])
def test_other_configurations_keep_the_lerp_buffer(dtype, nesterov):
    """float16/32/64 (``.bfloat16()`` copies) and Nesterov (a new tensor) are not affected."""
    buf, expected = one_native_step(dtype, nesterov)
    assert_same_bits(buf, expected, f"{dtype} nesterov={nesterov}")


def test_fixed_torch_probe_says_absent(fixed_torch):
    buf, expected = one_native_step(BF16, nesterov=False)
    assert_same_bits(buf, expected, "patched torch")
    assert native_bugs.present(BUG) is False


def test_batched_step_overwrites_like_native():
    """The batched step (not only the per-matrix fallback, which is torch's code) leaves
    native's overwritten buffers: tall and wide batches, compared with torch's per-matrix
    function on separate tensors. The buffers do not depend on the GEMMs (the overwrite is the
    normalisation, before them), so this holds whatever the calibration probe decides."""
    needs_bug()
    hyper = dict(weight_decay=0.1, momentum=0.9, nesterov=False,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7,
                 adjust_lr_fn=None)
    g = torch.Generator().manual_seed(3)
    for n, rows, cols in ((3, 16, 8), (2, 8, 16)):
        values = [torch.randn(n, rows, cols, generator=g).to(BF16) for _ in range(3)]
        native = [[v[i].clone() for i in range(n)] for v in values]
        views = [list(values[0].clone()), list(values[1].clone()), values[2].clone()]
        lerped = [b.clone().lerp_(gr, 1 - 0.9) for b, gr in zip(native[2], native[1])]
        _compat.muon_single_tensor(*native, lr=0.02, **hyper)
        cmb.batched_muon_step(*views, lr=0.02, **hyper)
        for i in range(n):
            assert_same_bits(views[2][i], native[2][i], f"buffer {i} of ({n}, {rows}, {cols})")
            assert not same_bits(native[2][i], lerped[i])  # the overwrite happened


# ---------------------------------------------------------------------------- same bits


@pytest.mark.parametrize("kw,specials", [
    (dict(lr=0.02, nesterov=False), False),
    (dict(lr=0.05, nesterov=False, momentum=0.9, weight_decay=0.0,
          adjust_lr_fn="match_rms_adamw"), True),
], ids=["defaults", "m0.9-match_rms-specials"])
def test_buggy_configuration_keeps_native_bits(kw, specials):
    """cotangent.Muon equals torch.optim.Muon byte for byte in the buggy configuration, after
    every step (parameters, gradients, momentum buffers), on the batched and per-matrix paths;
    and native really has the bug here (a fixed torch gives other parameters from step 2 on),
    so a Cotangent that "fixed" it would fail this test."""
    needs_bug()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeBugWarning)
        flat_n, opt_o = lockstep(kw, SPECS, BF16, 4, specials=specials)
    summary = opt_o.batch_summary()
    # the 3 x (32, 32) batch was probed (batched: True here); the tall and the transposed
    # matrix are alone of their shapes: per matrix, in no batch
    assert [b["batched"] is not None for b in summary if b["matrices"] == 3] == [True]
    assert len(summary) == 1
    fixed = on_fixed_torch(kw, SPECS, BF16, 4, specials=specials)
    assert not all(same_bits(a, b) for a, b in zip(fixed, flat_n))
    fixed_1 = on_fixed_torch(kw, SPECS, BF16, 1, specials=specials)
    first = lockstep(kw, SPECS, BF16, 1, specials=specials)[0]
    assert all(same_bits(a, b) for a, b in zip(fixed_1, first))  # step 1: as intended


def test_fixed_torch_is_followed_too(fixed_torch):
    """On a torch with the fix, cotangent.Muon follows it (the batched path copies before
    normalising) and stays byte-equal to native, without a warning."""
    assert recorded(lambda: lockstep(dict(lr=0.02, nesterov=False), SPECS, BF16, 3)) == []
    assert native_bugs.present(BUG) is False
    # the batched step itself, against the (patched) per-matrix function: buffers keep the lerp
    hyper = dict(weight_decay=0.1, momentum=0.9, nesterov=False,
                 ns_coefficients=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-7,
                 adjust_lr_fn=None)
    g = torch.Generator().manual_seed(4)
    values = [torch.randn(2, 16, 8, generator=g).to(BF16) for _ in range(3)]
    native = [[v[i].clone() for i in range(2)] for v in values]
    views = [list(values[0].clone()), list(values[1].clone()), values[2].clone()]
    lerped = [b.clone().lerp_(gr, 1 - 0.9) for b, gr in zip(native[2], native[1])]
    _compat.muon_single_tensor(*native, lr=0.02, **hyper)
    cmb.batched_muon_step(*views, lr=0.02, **hyper)
    for i in range(2):
        assert_same_bits(native[2][i], lerped[i], f"native buffer {i}")
        assert_same_bits(views[2][i], lerped[i], f"batched buffer {i}")


def test_momentum_zero_is_unaffected():
    """Why momentum 0 gets no warning: the overwritten buffer is read only by
    ``lerp_(grad, 1)``, which returns the gradient, so parameters come out as on a fixed
    torch (here with NaN, infinities, signed zeros and subnormals in one step's gradient)."""
    needs_bug()
    kw = dict(lr=0.02, momentum=0.0, nesterov=False)
    specs = [[(16, 8), (8, 16)]]
    buggy = lockstep(kw, specs, BF16, 4, specials=True)[0]
    fixed = on_fixed_torch(kw, specs, BF16, 4, specials=True)
    for i, (a, b) in enumerate(zip(buggy, fixed)):
        assert_same_bits(a, b, f"parameter {i}")
    # the comparison can tell: with momentum 0.5 the parameters differ
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NativeBugWarning)
        buggy = lockstep(dict(kw, momentum=0.5), specs, BF16, 4, specials=True)[0]
    fixed = on_fixed_torch(dict(kw, momentum=0.5), specs, BF16, 4, specials=True)
    assert not all(same_bits(a, b) for a, b in zip(buggy, fixed))


# ---------------------------------------------------------------------------- the warning


def test_warns_once_per_process():
    """Two optimizers, several steps each: one NativeBugWarning, naming the bug and the
    upstream fix, attributed to the caller's line (not cotangent's or torch's)."""
    needs_bug()

    def run():
        for seed in (0, 1):
            lockstep(dict(lr=0.02, nesterov=False), SMALL, BF16, 3, seed=seed)

    caught = recorded(run)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert BUG in message and "#194664" in message and "nesterov=False" in message
    assert caught[0].filename == cases.__file__  # (the line calling opt.step(): the driver's)
    assert native_bugs.warned(BUG)
    assert recorded(lambda: lockstep(dict(lr=0.02, nesterov=False), LONE, BF16, 2)) == []


@pytest.mark.parametrize("dtype,kw", [
    (torch.float32, dict(nesterov=False)),
    (torch.float16, dict(nesterov=False)),
    (BF16, dict(nesterov=True)),
    (BF16, dict(nesterov=False, momentum=0.0)),
], ids=["fp32", "fp16", "bf16-nesterov", "bf16-momentum0"])
def test_no_warning_where_unaffected(dtype, kw):
    assert recorded(lambda: lockstep(dict(lr=0.02, **kw), LONE, dtype, 3)) == []
    assert not native_bugs.warned(BUG)


def test_no_warning_for_a_bf16_batch_without_gradients():
    """Only a batch that steps counts: a bfloat16 nesterov=False group whose parameters get no
    gradient is not affected (its neighbour group, float32, steps)."""
    bf = nn.Parameter(torch.zeros(8, 16, dtype=BF16))
    f32 = nn.Parameter(torch.zeros(8, 16))
    opt = cotangent.Muon([{"params": [bf], "nesterov": False}, {"params": [f32]}], lr=0.02)

    def run():
        for _ in range(2):
            f32.grad = torch.ones_like(f32)
            opt.step()

    assert recorded(run) == []


def test_warns_when_a_group_is_edited_into_the_buggy_configuration():
    """Checked at every step until warned: a group switched to nesterov=False later warns at
    the next step, before anything is modified (so a warnings filter set to "error" raises
    with parameters and buffers unchanged, and again at the next step)."""
    needs_bug()
    p = nn.Parameter(torch.randn(8, 16).to(BF16))
    opt = cotangent.Muon([p], lr=0.02, nesterov=True)
    p.grad = torch.ones_like(p)
    assert recorded(opt.step) == []
    opt.param_groups[0]["nesterov"] = False
    before = [p.detach().clone(), opt.state[p]["momentum_buffer"].clone()]
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", NativeBugWarning)
            with pytest.raises(NativeBugWarning, match="194664"):
                opt.step()
        assert_same_bits(p, before[0], "parameter after the refused step")
        assert_same_bits(opt.state[p]["momentum_buffer"], before[1], "buffer")
    assert len(recorded(opt.step)) == 1
    assert recorded(opt.step) == []


def test_muon_adamw_keeps_its_bfloat16_momentum_buffer():
    """nanochat's MuonAdamW (Nesterov always, out-of-place normalisation) has no such
    overwrite: after one step from zeros with a gradient of ones its momentum buffer is the
    lerp, and nothing warns."""
    w = nn.Parameter(torch.zeros(8, 16, dtype=BF16))
    b = nn.Parameter(torch.zeros(16, dtype=BF16))
    opt = cotangent.MuonAdamW([{"params": [b]}], [w], muon_momentum=0.9)

    def run():
        w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
        opt.step()

    assert recorded(run) == []
    momentum = torch.tensor(0.9).to(BF16)  # as muon_step casts it
    expected = torch.zeros(1, 8, 16, dtype=BF16).lerp_(
        torch.ones(1, 8, 16, dtype=BF16), 1 - momentum)
    assert_same_bits(opt.state[w]["momentum_buffer"], expected, "momentum buffer")


def test_known_table_entries_are_complete():
    for bug_id, bug in native_bugs.KNOWN.items():
        assert bug.id == bug_id
        assert bug.affects and bug.summary and bug.description and bug.upstream_fix
        assert isinstance(native_bugs.present(bug_id), bool)
    assert "194664" in native_bugs.KNOWN[BUG].upstream_fix
    with pytest.raises(KeyError):
        native_bugs.present("no-such-bug")
