"""Checkpoint formats with Cotangent's optimizers, one process, no process group.

`torch.distributed.checkpoint` (DCP): `get_model_state_dict` / `get_optimizer_state_dict`,
`dcp.save` / `dcp.load` to a directory, `set_model_state_dict` / `set_optimizer_state_dict`, for
`cotangent.AdamW` (with its built-in clip), `cotangent.Muon` and `cotangent.MuonAdamW`. The
oracle is the uninterrupted native run (`clip_grad_norm_` + `torch.optim.AdamW`,
`torch.optim.Muon`, an uninterrupted MuonAdamW): after a resume every
parameter, gradient and state entry is compared with it byte for byte (`tests/bitwise.py`) at
every step. Then what DCP and `torch.save` write for a packed model or a part of it: the bytes a
native model's checkpoint holds, never the flat buffer. CPU, torch 2.13.0.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import cotangent
from bitwise import assert_same_bits, assert_same_update, same_bits

from cotangent.verify import first_difference

if not torch.distributed.is_available():
    pytest.skip("torch.distributed (and so torch.distributed.checkpoint) is not available in "
                "this torch build", allow_module_level=True)
dcp = pytest.importorskip("torch.distributed.checkpoint",
                          reason="torch.distributed.checkpoint is not importable")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# DCP warns once per call that it saves/loads in a single process without a process group.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized")

STEPS, RESUME_AT = 6, 3
MAX_NORM = 1.0


def make_model() -> nn.Sequential:
    """Three equal 64 x 64 matrices: one Muon batch, so one Muon calibration probe (~6 s here;
    every distinct matrix shape costs one)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64))


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(4, 64, generator=gen) for _ in range(STEPS)]


def _matrices(m):
    return [p for p in m.parameters() if p.ndim == 2]


def _others(m):
    return [p for p in m.parameters() if p.ndim != 2]


# arm -> (build the optimizer for a model, whether the loop calls clip_grad_norm_ itself)
ARMS = {
    "native AdamW": (lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1),
                     True),
    "cotangent.AdamW": (lambda m, lr: cotangent.AdamW(m.parameters(), lr=lr, weight_decay=0.1,
                                                      max_norm=MAX_NORM), False),
    "native Muon": (lambda m, lr: torch.optim.Muon(_matrices(m), lr=lr), False),
    "cotangent.Muon": (lambda m, lr: cotangent.Muon(_matrices(m), lr=lr), False),
    "MuonAdamW": (lambda m, lr: cotangent.MuonAdamW(
        [{"params": _others(m)}], _matrices(m), muon_lr=lr), False),
}
LR = {"AdamW": 1e-2, "Muon": 2e-2}


def _lr(arm: str) -> float:
    return LR["AdamW"] if arm.endswith("AdamW") and "Muon" not in arm else LR["Muon"]


def snapshot(model, opt) -> dict:
    """Clones of every parameter, gradient and state entry (ints kept as they are)."""
    params = list(model.parameters())
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "state": [{k: v.clone() if isinstance(v, torch.Tensor) else v
                   for k, v in opt.state.get(p, {}).items()} for p in params],
    }


def differences(a: dict, b: dict, what: str, grads: bool = True) -> list[str]:
    """Every tensor of two snapshots compared on bytes; the differences found, named."""
    found = []
    kinds = ("params", "grads", "state") if grads else ("params", "state")
    for kind in kinds:
        for i, (x, y) in enumerate(zip(a[kind], b[kind])):
            if kind != "state":
                if not same_bits(x, y):
                    found.append(f"{what}: {kind[:-1]} {i}")
                continue
            if set(x) != set(y):
                found.append(f"{what}: state keys of {i}: {sorted(x)} vs {sorted(y)}")
                continue
            for key in x:
                equal = (same_bits(x[key], y[key]) if isinstance(x[key], torch.Tensor)
                         else x[key] == y[key])
                if not equal:
                    found.append(f"{what}: {key} of {i}")
    return found


def train(model, opt, clip: bool, xs, after_step=None) -> None:
    """Steps of backward, (native clip), step, zero_grad; parameters the optimizer does not
    hold (biases under Muon) get their gradient reset too, so that nothing accumulates."""
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    for x in xs:
        model(x).square().mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        if after_step is not None:
            after_step(snapshot(model, opt))
        opt.zero_grad()
        for p in model.parameters():
            if id(p) not in held:
                p.grad = None


def uninterrupted(arm: str) -> list[dict]:
    build, clip = ARMS[arm]
    model = make_model()
    opt = build(model, _lr(arm))
    snaps = []
    train(model, opt, clip, batches(), snaps.append)
    return snaps


def dcp_save(model, opt, path) -> None:
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)


def dcp_load(model, opt, path, strict: bool = True) -> None:
    """DCP's documented resume: state dicts of the live objects, loaded in place, then set
    (`strict` False: `set_optimizer_state_dict` accepts parameters without a state entry)."""
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=StateDictOptions(strict=strict))


def resumed(first: str, second: str, path, zero_grad_first: bool = False,
            first_lr: float | None = None, load_optimizer: bool = True) -> tuple[dict, list]:
    """`first` trains RESUME_AT steps and is saved with DCP; a fresh model and `second`
    optimizer load it (after an `opt.zero_grad()` with `zero_grad_first`) and train the rest.
    Returns the snapshot right after loading and those of the resumed steps."""
    xs = batches()
    build, clip = ARMS[first]
    model = make_model()
    opt = build(model, first_lr or _lr(first))
    train(model, opt, clip, xs[:RESUME_AT])
    dcp_save(model, opt, path)
    build, clip = ARMS[second]
    model = make_model()
    opt = build(model, _lr(second))
    if zero_grad_first:
        opt.zero_grad()
    if load_optimizer:
        dcp_load(model, opt, path, strict="MuonAdamW" not in second)
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
    loaded = snapshot(model, opt)
    snaps = []
    train(model, opt, clip, xs[RESUME_AT:], snaps.append)
    return loaded, snaps


def assert_resume_matches(reference: list[dict], loaded: dict, snaps: list[dict], what: str):
    problems = differences(reference[RESUME_AT - 1], loaded, f"{what}, as loaded", grads=False)
    for step, (ref, got) in enumerate(zip(reference[RESUME_AT:], snaps), RESUME_AT + 1):
        problems += differences(ref, got, f"{what}, step {step}")
    assert len(snaps) == STEPS - RESUME_AT
    assert not problems, problems[:5]


PAIRS = {
    "AdamW": ("native AdamW", [("cotangent.AdamW", "cotangent.AdamW"),
                               ("native AdamW", "cotangent.AdamW"),
                               ("cotangent.AdamW", "native AdamW")]),
    "Muon": ("native Muon", [("cotangent.Muon", "cotangent.Muon"),
                             ("native Muon", "cotangent.Muon"),
                             ("cotangent.Muon", "native Muon")]),
    "MuonAdamW": ("MuonAdamW", [("MuonAdamW", "MuonAdamW")]),
}
CASES = [(family, first, second) for family, (_, pairs) in PAIRS.items()
         for first, second in pairs]


@pytest.mark.parametrize("zero_grad_first", [False, True], ids=["", "zero_grad-before-load"])
@pytest.mark.parametrize("family,first,second", CASES,
                         ids=[f"{a}->{b}".replace(" ", "-") for _, a, b in CASES])
def test_dcp_resume_mid_run_is_the_uninterrupted_native_run(tmp_path, family, first, second,
                                                            zero_grad_first):
    """Save with DCP after 3 steps, load into a fresh model and optimizer (of the same or the
    other implementation), train 3 more: every parameter, gradient and state entry equals the
    uninterrupted native run's, as loaded and after each step. With ``zero_grad-before-load``
    the fresh optimizer's `zero_grad()` runs before `get_optimizer_state_dict`: DCP initialises
    an optimizer's state (one zero-lr step) only when it has no state and every ``.grad`` is
    None, and otherwise loads nothing into it; Cotangent's `zero_grad()` is native's and leaves
    ``.grad`` None, so the state is loaded. MuonAdamW
    loads with ``StateDictOptions(strict=False)`` (next test)."""
    reference = uninterrupted(PAIRS[family][0])
    loaded, snaps = resumed(first, second, tmp_path / "ckpt", zero_grad_first)
    assert_resume_matches(reference, loaded, snaps, f"{first} -> {second}")


def test_dcp_strict_load_refuses_muon_adamw_state_layout(tmp_path):
    """MuonAdamW keeps a Muon group's momentum buffers, (n, rows, cols), in the state of the
    group's first matrix only (nanochat's layout): the other members have no state
    entry, and `set_optimizer_state_dict` with the default ``strict=True`` refuses the
    checkpoint with a clear error (nothing silent); ``strict=False`` loads it (resume test)."""
    model = make_model()
    opt = ARMS["MuonAdamW"][0](model, 2e-2)
    train(model, opt, False, batches()[:1])
    dcp_save(model, opt, tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match=r"Missing optimizer state for parameter '2\.weight' "
                                            r"in checkpoint.*StateDictOptions\(strict=False\)"):
        dcp_load(model, opt, tmp_path / "ckpt")


def test_the_comparison_sees_a_lost_optimizer_state_and_another_lr(tmp_path):
    """Controls: the same resume with the optimizer state not loaded (what DCP silently does
    when the fresh optimizer has gradients but no state), or with another lr before the
    checkpoint, is reported."""
    reference = uninterrupted("native AdamW")
    for what, kwargs in (("state not loaded", dict(load_optimizer=False)),
                         ("lr 2e-2 before the checkpoint", dict(first_lr=2e-2))):
        loaded, snaps = resumed("cotangent.AdamW", "cotangent.AdamW", tmp_path / what, **kwargs)
        with pytest.raises(AssertionError):
            assert_resume_matches(reference, loaded, snaps, what)


@pytest.mark.parametrize("arm", ["cotangent.AdamW", "cotangent.Muon", "MuonAdamW"])
def test_zero_grad_leaves_grad_none_and_the_backward_fills_it_in_place(arm):
    """Before the first update `zero_grad()` leaves every ``.grad`` None, as native (what
    DCP's state initialisation tests), and so it does after updates; the next backward's
    gradients are autograd's own tensors, read where they are (first step compared with
    the uninterrupted reference run)."""
    native_arm = {"cotangent.AdamW": "native AdamW", "cotangent.Muon": "native Muon",
                  "MuonAdamW": "MuonAdamW"}[arm]
    build, clip = ARMS[arm]
    model = make_model()
    opt = build(model, _lr(arm))
    opt.zero_grad()
    packed = _matrices(model) if "Muon" in arm else list(model.parameters())
    assert all(p.grad is None for p in model.parameters())
    after = []
    train(model, opt, clip, batches()[:1], after.append)
    assert not differences(uninterrupted(native_arm)[0], after[0], arm)
    assert all(p.grad is None for p in packed)
    model(batches()[1]).square().mean().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(p.grad.untyped_storage().data_ptr() not in params for p in packed)


def _dcp_files(path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


PACKERS = {
    "AdamW": lambda m: cotangent.AdamW(m.parameters(), max_norm=MAX_NORM),
    "Muon": lambda m: cotangent.Muon(_matrices(m)),
    "MuonAdamW": lambda m: cotangent.MuonAdamW([{"params": _others(m)}], _matrices(m)),
}


@pytest.mark.filterwarnings("ignore:Getting submodules only model/optim state_dict is deprecated")
@pytest.mark.parametrize("packer", list(PACKERS))
def test_saved_packed_model_and_part_hold_a_native_models_bytes(tmp_path, packer):
    """Each packed parameter has a storage of its own over its segment: DCP of the whole model
    or of one layer, and `torch.save` of one layer's state_dict, write exactly the bytes of a
    native model's (DCP data files and torch.save files byte-equal; DCP's .metadata files have
    equal lengths: they name their own checkpoint). So no file holds the flat buffer."""
    native = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                           nn.Linear(128, 8))
    packed = copy.deepcopy(native)
    opt = PACKERS[packer](packed)
    assert packed[4].weight.untyped_storage().nbytes() == packed[4].weight.nbytes
    written = {}
    for name, m in (("native", native), ("packed", packed)):
        dcp.save(get_model_state_dict(m), checkpoint_id=tmp_path / name / "model")
        dcp.save(m[4].state_dict(), checkpoint_id=tmp_path / name / "part")
        dcp.save(get_model_state_dict(m, submodules={m[4]}),
                 checkpoint_id=tmp_path / name / "submodule")
        buf = io.BytesIO()
        torch.save(m[4].state_dict(), buf)
        written[name] = {kind: _dcp_files(tmp_path / name / kind)
                         for kind in ("model", "part", "submodule")}
        written[name]["torch.save"] = {"part.pt": buf.getvalue()}
    for kind, files in written["native"].items():
        theirs = written["packed"][kind]
        assert sorted(files) == sorted(theirs), kind
        for fname, data in files.items():
            if fname == ".metadata":
                assert len(theirs[fname]) == len(data), (kind, fname)
            else:
                assert theirs[fname] == data, (kind, fname, len(theirs[fname]), len(data))
    part_bytes = sum(p.nbytes for p in native[4].parameters())
    whole_bytes = sum(p.nbytes for p in native.parameters())
    part_file = len(written["packed"]["part"]["__0_0.distcp"])
    assert part_bytes <= part_file < whole_bytes, (part_bytes, part_file, whole_bytes)
    restored = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                             nn.Linear(128, 8))
    state = get_model_state_dict(restored)
    dcp.load(state, checkpoint_id=tmp_path / "packed" / "model")
    set_model_state_dict(restored, state)
    for a, b in zip(restored.parameters(), packed.parameters()):
        assert_same_bits(a, b, "restored parameter")
    assert opt is not None


def test_dcp_optimizer_state_of_a_packed_adamw_is_native_bytes(tmp_path):
    """The state tensors of a packed AdamW are views of flat moment buffers; DCP copies a
    tensor whose storage is larger than it before writing, so its data file is byte for byte
    the native optimizer's after the same steps (and no larger)."""
    native, packed = make_model(), make_model()
    opts = {"native": ARMS["native AdamW"][0](native, 1e-2),
            "packed": ARMS["cotangent.AdamW"][0](packed, 1e-2)}
    train(native, opts["native"], True, batches()[:2])
    train(packed, opts["packed"], False, batches()[:2])
    files = {}
    for name, m in (("native", native), ("packed", packed)):
        dcp.save(get_optimizer_state_dict(m, opts[name]), checkpoint_id=tmp_path / name)
        files[name] = _dcp_files(tmp_path / name)
    assert files["packed"]["__0_0.distcp"] == files["native"]["__0_0.distcp"]
    assert len(files["packed"][".metadata"]) == len(files["native"][".metadata"])


# Regressions found in review: optimizer-state tensors stay views of the flat buffers (a state
# tensor with a storage of its own made these diverge silently). `torch.save(opt.state[p])`
# alone therefore writes the flat buffers (docs/usage.md, "Checkpoint formats").


@pytest.mark.parametrize("event", ["share_memory_", "async-checkpoint-queue", ".data ="])
def test_muon_momentum_moved_to_shared_memory_keeps_native_bits(event):
    """`opt.state[w]["momentum_buffer"].share_memory_()` after a step (or sending the state
    dict through a torch.multiprocessing queue, which moves storages to shared memory in
    place), or its `.data` replaced: cotangent.Muon's batched path keeps native's momentum and
    parameters."""
    import torch.multiprocessing as mp

    def run(cls):
        torch.manual_seed(0)
        ws = [nn.Parameter(torch.randn(64, 64) / 8) for _ in range(3)]
        opt = cls(ws, lr=2e-2)
        gen = torch.Generator().manual_seed(1)
        for i in range(3):
            x = torch.randn(4, 64, generator=gen)
            for w in ws:
                x = torch.tanh(x @ w)
            x.square().mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 0 and event == "share_memory_":
                for w in ws:
                    opt.state[w]["momentum_buffer"].share_memory_()
            elif i == 0 and event == ".data =":
                for w in ws:
                    buf = opt.state[w]["momentum_buffer"]
                    buf.data = buf.clone()
            elif i == 0:
                queue = mp.get_context("fork").SimpleQueue()
                queue.put(opt.state_dict())
                queue.get()
        return ws, opt

    (pn, on), (pc, oc) = run(torch.optim.Muon), run(cotangent.Muon)
    assert oc.batch_summary()[0]["batched"]
    assert_same_update(pn, on.state, pc, oc.state, event, grads=False)


def test_adamw_moments_shared_with_a_forked_worker_see_its_step():
    """The A3C/Hogwild shared-optimizer pattern: moments moved to shared memory with
    `share_memory_()`, then a forked worker steps; the parent sees the worker's update of the
    moments and parameters, as with native AdamW."""
    import torch.multiprocessing as mp

    def worker(m, opt):
        m(torch.ones(2, 8)).sum().backward()
        opt.step()

    seen = {}
    for cls in (torch.optim.AdamW, cotangent.AdamW):
        torch.manual_seed(0)
        m = nn.Linear(8, 8)
        opt = cls(m.parameters(), lr=1e-2)
        m(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        m.share_memory()
        for p in m.parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                opt.state[p][key].share_memory_()
        before = [(p.detach().clone(), opt.state[p]["exp_avg"].clone()) for p in m.parameters()]
        proc = mp.get_context("fork").Process(target=worker, args=(m, opt))
        proc.start()
        proc.join(timeout=120)  # a forked child that hangs (e.g. in OpenMP) fails, not blocks
        if proc.is_alive():
            proc.kill()
            proc.join()
            pytest.fail(f"the forked worker of {cls.__name__} did not finish within 120 s")
        assert proc.exitcode == 0
        seen[cls.__module__] = [(p.detach().clone(), opt.state[p]["exp_avg"].clone())
                                for p in m.parameters()]
        for (p0, m0), (p1, m1) in zip(before, seen[cls.__module__]):
            assert first_difference(p0, p1) is not None and first_difference(m0, m1) is not None
    for (pa, ma), (pb, mb) in zip(*seen.values()):
        assert_same_bits(pa, pb, "parameter after the worker's step")
        assert_same_bits(ma, mb, "exp_avg after the worker's step")
