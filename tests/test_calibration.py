"""Calibration: verdict keys, the cache, and probes that see a difference a later step overwrites.

Calibration verdicts are keyed by the probe's own code, Cotangent's version and the CPU model:
a changed probe, another release or another CPU of the same ISA class probes again instead of
reusing an old verdict (`cotangent.calibration.full_key`).

Every calibration probe that runs several steps compares after each step, not only after the
last: a path that differs at one step and agrees again later (its difference overwritten, as a
-0.0 maximum is by the next step's positive one) differs for a user who reads the state at
that step, so the probe must fail it. Each case breaks the probed path exactly so: after its
first call one parameter's sign bit is flipped, and flipped back before its second call, so
the final state equals native's.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cotangent import calibration, merge, norms, singlepass, singlepass as sp
from cotangent.harness.packed import tracking

from bitwise import threads


CPU = torch.device("cpu")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty verdict cache (file and memory) for the test, the process's own restored after."""
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    return tmp_path


@pytest.fixture
def recorded(monkeypatch):
    """The keys `calibration.record` is called with (each one a probe that ran)."""
    keys: list[str] = []
    record = calibration.record

    def traced(key, verdict):
        keys.append(key)
        return record(key, verdict)
    monkeypatch.setattr(calibration, "record", traced)
    return keys


def _variant(module, name: str, old: str, new: str, body: str | None = None):
    """`module.name` recompiled from its source with `old` replaced by `new` (a strengthened
    probe, as a new release would ship it), in a copy of the module's namespace so that the
    function names itself as its probe. `body`: the function holding the probe's code, which
    `name` runs through `calibration.verdict`; it gets the edit, and `name` is recompiled
    beside it so that it runs (and names) the edited one."""
    namespace = dict(vars(module))
    edited = body or name
    for fn in ([edited, name] if body else [name]):
        source = textwrap.dedent(inspect.getsource(getattr(module, fn)))
        if fn == edited:
            assert old in source
            source = source.replace(old, new)
        exec(compile(source, inspect.getfile(module), "exec"), namespace)
    return namespace[name]


def test_key_names_versions_cpu_model_and_probe_fingerprint():
    key = calibration.full_key("accumulate_into_negative_zero", "cpu", (torch.float32,),
                               probe=tracking.accumulate_into_negative_zero_is_exact)
    fields = key.split("|")
    assert fields[0] == "accumulate_into_negative_zero"
    assert calibration.cpu_model() in fields[1]
    assert fields[2] == torch.__version__
    import cotangent
    assert fields[3] == cotangent.__version__
    assert fields[4] == "probe-" + calibration.probe_fingerprint(
        tracking.accumulate_into_negative_zero_is_exact)
    assert fields[5] == str(torch.get_num_threads()) and fields[6] == "float32"


def test_a_changed_probe_runs_again(fresh_cache, recorded):
    probe = tracking.accumulate_into_negative_zero_is_exact
    assert probe(CPU, torch.float32) is True
    assert len(recorded) == 1
    assert probe(CPU, torch.float32) is True
    assert len(recorded) == 1  # the same probe: its verdict is reused
    stronger = _variant(tracking, "accumulate_into_negative_zero_is_exact",
                        "manual_seed(5)", "manual_seed(6)")
    assert stronger(CPU, torch.float32) is True
    assert len(recorded) == 2 and recorded[1] != recorded[0]  # the changed probe ran
    assert recorded[0].split("|")[4] != recorded[1].split("|")[4]


def test_a_probe_changed_in_a_value_it_feeds_runs_again(fresh_cache, recorded, monkeypatch):
    """The special values every probe writes are part of every fingerprint."""
    probe = tracking.accumulate_into_negative_zero_is_exact
    probe(CPU, torch.float32)
    before = len(recorded)
    monkeypatch.setattr(calibration, "SPECIAL_VALUES", calibration.SPECIAL_VALUES + (2.5,))
    calibration.probe_fingerprint.cache_clear()
    try:
        probe(CPU, torch.float32)
    finally:
        monkeypatch.undo()
        calibration.probe_fingerprint.cache_clear()
    assert len(recorded) == before + 1


@pytest.mark.parametrize("probe, old, new", [
    (("merge", "direct_fused_is_exact", "_direct_fused_probe"), "manual_seed(7)",
     "manual_seed(8)"),
    (("norms", "flat_multiply_is_exact", "_flat_multiply_probe"), "manual_seed(99)",
     "manual_seed(98)"),
])
def test_every_kind_of_probe_key_follows_its_code(probe, old, new, fresh_cache, recorded):
    module = {"merge": merge, "norms": norms}[probe[0]]
    group = torch.optim.AdamW([torch.zeros(1)], fused=True).param_groups[0]
    args = {"direct_fused_is_exact": (CPU, torch.float32, group),
            "flat_multiply_is_exact": (CPU, torch.float32, torch.float32)}[probe[1]]
    getattr(module, probe[1])(*args)
    getattr(module, probe[1])(*args)
    assert len(recorded) == 1
    _variant(module, probe[1], old, new, body=probe[2])(*args)
    assert len(recorded) == 2 and recorded[0] != recorded[1]


def test_another_cpu_model_or_release_gets_other_keys(monkeypatch):
    probe = tracking.accumulate_into_negative_zero_is_exact

    def key():
        return calibration.full_key("accumulate_into_negative_zero", "cpu", (torch.float32,),
                                    probe=probe)
    here = key()
    monkeypatch.setattr(calibration, "cpu_model",
                        lambda: "GenuineIntel / 6 / 143 / 8 / 0x2b000603 / another model")
    calibration._machine.cache_clear()
    try:
        other_cpu = key()
    finally:
        monkeypatch.undo()
        calibration._machine.cache_clear()
    monkeypatch.setattr(calibration, "__version__", "99.0")
    other_release = key()
    assert len({here, other_cpu, other_release}) == 3


def test_cpu_model_reads_microcode_where_linux_shows_it():
    model = calibration.cpu_model()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    if "microcode" not in text:
        pytest.skip("this kernel shows no microcode revision")
    first = text.split("\n\n")[0]
    microcode = next(line.split(":", 1)[1].strip() for line in first.splitlines()
                     if line.startswith("microcode"))
    assert model.split(" / ")[4] == microcode


@pytest.mark.slow
@pytest.mark.slow
def test_fingerprints_are_the_same_in_every_process(tmp_path, monkeypatch):
    """A fingerprint must not change between processes: not with an object's address, a hash
    seed, the process's own state (singlepass records its probe count and seconds and the square
    root it chose in module globals: a CI run found the fingerprint differing once `sqrt_kind`
    had run), nor the install
    path (a copy of the package elsewhere keys the same verdicts)."""
    import shutil

    code = ("from cotangent import calibration, singlepass, norms; "
            "print(calibration.probe_fingerprint(singlepass.probes._probe_code()), "
            "calibration.probe_fingerprint((norms.bucket_norm_is_exact, norms._probe_values)))")
    copy = tmp_path / "elsewhere"
    shutil.copytree(Path(calibration.__file__).parent, copy / "cotangent",
                    ignore=shutil.ignore_patterns("__pycache__"))
    runs = set()
    for seed, path in (("1", None), ("2", None), ("3", str(copy))):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        if path is not None:
            env["PYTHONPATH"] = path
        runs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True, env=env, cwd=tmp_path).stdout)
    assert len(runs) == 1
    # as after probes ran: counters, timers and the square root chosen (`sqrt_kind`)
    monkeypatch.setattr(singlepass.verdicts, "_PROBES", singlepass.verdicts._PROBES + 7)
    monkeypatch.setattr(singlepass.verdicts, "_PROBE_S", singlepass.verdicts._PROBE_S + 1.25)
    monkeypatch.setattr(singlepass.kernel, "_SQRT_CHOSEN", "a kind chosen in this process")
    calibration.probe_fingerprint.cache_clear()
    try:
        here = (f"{calibration.probe_fingerprint(singlepass.probes._probe_code())} "
                f"{calibration.probe_fingerprint((norms.bucket_norm_is_exact, norms._probe_values))}")
    finally:
        monkeypatch.undo()
        calibration.probe_fingerprint.cache_clear()
    assert runs == {here + "\n"}


def test_fingerprint_refuses_what_it_cannot_hash():
    with pytest.raises(TypeError, match="Python functions"):
        calibration.probe_fingerprint(torch.add)


@pytest.mark.parametrize("edit", ["a helper it calls", "a module constant it reads",
                                  "a function of another module it calls"])
def test_the_fingerprint_covers_what_the_probe_calls_and_reads(edit, monkeypatch):
    """A probe's helpers and constants are part of its code: a `_bytes_equal` that proves
    nothing, one trial instead of four, another `_compat` call on the proven path each change
    the fingerprint (found by a review: only the named functions were hashed)."""
    probes = {"a helper it calls": (norms.bucket_norm_is_exact, norms._probe_values),
              "a module constant it reads": (norms.bucket_norm_is_exact, norms._probe_values),
              "a function of another module it calls": (merge.direct_fused_is_exact,
                                                        merge.run_direct_fused)}
    probe = probes[edit]
    before = calibration.probe_fingerprint(probe)
    if edit == "a helper it calls":
        monkeypatch.setattr(norms, "_bytes_equal", lambda a, b: True)
    elif edit == "a module constant it reads":
        monkeypatch.setattr(norms, "_PROBE_TRIALS", 1)
    else:
        from cotangent import _compat
        monkeypatch.setattr(_compat, "fused_adamw_one_group", lambda *a, **k: None)
    calibration.probe_fingerprint.cache_clear()
    try:
        after = calibration.probe_fingerprint(probe)
    finally:
        monkeypatch.undo()
        calibration.probe_fingerprint.cache_clear()
    assert after != before
    assert calibration.probe_fingerprint(probe) == before  # and back


@pytest.mark.slow
@pytest.mark.slow
def test_a_set_constant_in_a_probe_hashes_alike_under_every_hash_seed(tmp_path):
    """``x in {"a", "b"}`` compiles to a frozenset constant whose iteration order follows the
    string hash seed: the fingerprint sorts it."""
    source = tmp_path / "probe_with_a_set.py"
    source.write_text("def probe(x):\n    return x in {'alpha', 'beta', 'gamma', 'delta'}\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import probe_with_a_set as m; "
            "from cotangent import calibration; print(calibration.probe_fingerprint(m.probe))")
    runs = {subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                           text=True, check=True, env=dict(os.environ, PYTHONHASHSEED=seed)
                           ).stdout for seed in ("1", "2", "3", "4")}
    assert len(runs) == 1


def _flip_sign(t: torch.Tensor) -> None:
    t.view(torch.int32)[0] ^= -2**31


def flipped_once(real, target):
    """`real` wrapped: `target(*args)` names the tensor (or None: a call left alone); the first
    such call's result has element 0's sign flipped, undone just before the second."""
    calls = []

    def wrapper(*args, **kwargs):
        t = target(*args)
        if t is not None and len(calls) == 1:
            _flip_sign(t)  # undo: the second step starts from native's state
        out = real(*args, **kwargs)
        if t is not None:
            calls.append(1)
            if len(calls) == 1:
                _flip_sign(t)
        return out

    return wrapper, calls


GROUP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False,
             maximize=False, foreach=None, fused=None, capturable=False, differentiable=False,
             decoupled_weight_decay=True)


def _single_pass():
    kw = dict(implementation="for-loop", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.1, maximize=False, amsgrad=True)
    return sp.matches_native(**kw)


CASES = {
    # (module holding the probed function, its name, the tensor to break, the probe)
    "single-pass": (sp.passes, "single_pass_adamw_lists_", lambda *a: a[0][0], _single_pass),
    "merged-call": (merge, "run_native_adamw",
                    lambda *a: a[1][0] if len(a[1]) == 1 else None,  # the merged call only
                    lambda: merge.merge_is_exact("for-loop", torch.device("cpu"),
                                                 torch.float32, 100, dict(GROUP))),
    "direct-fused": (merge, "run_direct_fused", lambda *a: a[0][0],
                     lambda: merge.direct_fused_is_exact(torch.device("cpu"), torch.float32,
                                                         dict(GROUP, fused=True))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_multi_step_probes_see_a_difference_a_later_step_overwrites(case, tmp_path,
                                                                    monkeypatch):
    if case == "single-pass":
        try:
            sp.build()
        except sp.SinglePassUnavailable as e:
            pytest.skip(f"single-pass kernel unavailable: {e}")
    module, name, target, probe = CASES[case]
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    with threads(2):
        assert probe()  # the unbroken path passes
        monkeypatch.setattr(calibration, "_MEMORY", {})  # no verdict kept in memory
        monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path / "broken"))
        wrapper, calls = flipped_once(getattr(module, name), target)
        monkeypatch.setattr(module, name, wrapper)
        assert not probe()
    assert calls  # the broken path ran (a probe may stop at the first difference)
