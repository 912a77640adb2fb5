"""Every calibration probe that runs several steps compares after each step, not only after the
last: a path that differs at one step and agrees again later (its difference overwritten, as a
-0.0 maximum is by the next step's positive one) differs for a user who reads the state at
that step, so the probe must fail it. Each case breaks the probed path exactly so: after its
first call one parameter's sign bit is flipped, and flipped back before its second call, so
the final state equals native's."""

from __future__ import annotations

import pytest
import torch

from bitwise import threads
from cotangent import calibration, merge
from cotangent import singlepass as sp


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
