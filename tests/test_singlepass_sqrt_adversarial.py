"""Adversarial checks of the single pass's imitation of MKL's vmsSqrt (`emulated_mkl_sqrt` in
`cotangent.singlepass`, chosen by `sqrt_kind` where `emulation_matches` proved it under the
default float modes): cotangent.AdamW against ``torch.optim.AdamW`` on CPU float32, byte for
byte, under float modes the proof did not cover.

MKL's vmsSqrt (VML_HA) rounds to nearest whatever the caller's MXCSR rounding mode (measured:
all subnormal inputs and the top 4096 finite values, under up, down and toward-zero rounding,
give the round-to-nearest bytes) and raises no trap for negative inputs. The imitation takes the
hardware square root (``_mm512_sqrt_ps``) for subnormals, the top 4096 finite values and
negatives: under a directed rounding mode that root is rounded the other way (1 ULP), and with
FE_INVALID unmasked a negative input kills the process with SIGFPE. The single pass's probe
(`matches_native`, run again for the new MXCSR key) feeds neither kind of input, so it passes
and the difference is silent. Each test below failed at commit 2c35afc; with the previous
square root (the MKL call, ``sqrt_kind() == "mkl"``) each passes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import subprocess
import sys
import textwrap

import pytest
import torch

from bitwise import require_single_pass_kernel, run_against_native, same_bits, threads
from cotangent import singlepass as sp

require_single_pass_kernel()

if not sys.platform.startswith("linux"):
    pytest.skip("fesetround/feenableexcept through glibc's libm: Linux only",
                allow_module_level=True)

LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
# glibc x86-64 <fenv.h>: rounding-mode and exception constants
ROUNDING = {"upward": 0x800, "downward": 0x400, "toward-zero": 0xC00}
FE_INVALID = 0x01


@contextlib.contextmanager
def rounding(mode: int):
    """The calling thread's rounding mode (x87 and MXCSR) set to `mode`, back to nearest after."""
    assert LIBM.fesetround(mode) == 0
    try:
        yield
    finally:
        LIBM.fesetround(0)


def _hw_sqrt(x: torch.Tensor) -> torch.Tensor:
    """The kernel's hardware square root (correctly rounded in the current rounding mode)."""
    out = torch.empty_like(x)
    sp.kernel._lib().cot_singlepass_sqrt(x.numel(), x.data_ptr(), out.data_ptr(), None,
                                  sp.MKL_SQRT_MODE)
    return out


@pytest.fixture
def one_thread_rn_first(monkeypatch, tmp_path):
    """One ATen thread (the rounding mode is set in the calling thread only; the team is that
    thread), the square root chosen under round-to-nearest as at an ordinary first step, and
    verdicts of this test kept out of the user's calibration file."""
    sp.sqrt_kind()
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    with threads(1):
        yield


# 40 float32 values spread over the top 4096 finite ones (0x7F7FF000..0x7F7FFFFF): with
# beta2 = 0 the second moment is g * g; these g give g * g in that range (checked below)
TOP = torch.arange(0x7F7FF000, 0x7F7FF000 + 40 * 97, 97, dtype=torch.int32).view(torch.float32)
G_TOP = TOP.double().sqrt().float()


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("mode", list(ROUNDING), ids=list(ROUNDING))
def test_directed_rounding_second_moment_in_the_top_4096(one_thread_rn_first, mode, foreach):
    """Default lr, eps and weight decay, beta2 = 0, a second moment in the top 4096 finite
    values, under a directed rounding mode: native's square root is MKL's (rounded to
    nearest); at 2c35afc the pass's was the hardware's in the directed mode, 1 ULP off in
    about half the elements (24 of 40 parameters differed after step 1 rounding upward)."""
    def deliver(step, params):
        for p in params:
            p.grad = G_TOP * (1.0 if step == 0 else 0.5)

    with rounding(ROUNDING[mode]):
        # control: the second moments of step 1 (g * g rounded in this mode) lie in the top
        # 4096, and a square root that follows the mode rounds them otherwise than torch.sqrt
        sq = G_TOP * G_TOP
        assert torch.isfinite(sq).all() and (sq.view(torch.int32) >= 0x7F7FF000).all()
        assert not same_bits(_hw_sqrt(sq), torch.sqrt(sq))
        rows = run_against_native([torch.zeros(40)], foreach=foreach, deliver=deliver,
                                  steps=2, adamw=dict(betas=(0.9, 0.0)))
    problems = [(step, problem, path["path"]) for step, problem, path, _ in rows if problem]
    assert not problems, problems


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_toward_zero_rounding_subnormal_second_moment(one_thread_rn_first, foreach):
    """eps = 0 and gradients near 1e-19 (second moments 1e-41, subnormal) rounding toward
    zero: at 2c35afc 13 of 40 parameters differed from native after one step."""
    def deliver(step, params):
        for i, p in enumerate(params):
            p.grad = 1e-19 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
                10 * step + i))

    with rounding(ROUNDING["toward-zero"]):
        rows = run_against_native([torch.zeros(40), torch.zeros(17)], foreach=foreach,
                                  deliver=deliver, steps=2, adamw=dict(eps=0.0))
    problems = [(step, problem, path["path"]) for step, problem, path, _ in rows if problem]
    assert not problems, problems
    # control: the second moments here are subnormal, and a square root that follows the
    # rounding mode gives other bytes for them than torch.sqrt
    v = torch.zeros(40).addcmul_(deliver_grad := 1e-19 * torch.randn(
        40, generator=torch.Generator().manual_seed(0)), deliver_grad, value=0.001)
    assert (v.abs() < torch.finfo(torch.float32).tiny).all() and (v != 0).any()
    with rounding(ROUNDING["toward-zero"]):
        assert not same_bits(_hw_sqrt(v), torch.sqrt(v))

CHILD = textwrap.dedent("""
    import ctypes, ctypes.util, sys, torch, cotangent
    from cotangent.verify import first_difference
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    torch.set_num_threads(1)
    foreach = sys.argv[1] == "1"
    out = []
    for cls in (torch.optim.AdamW, cotangent.AdamW):
        p = torch.nn.Parameter(torch.zeros(40))
        opt = cls([p], foreach=foreach)
        p.grad = torch.ones(40)
        opt.step()  # an ordinary first step: square root chosen, probe run, no traps
        sd = opt.state_dict()
        sd["state"][0]["exp_avg_sq"] = -torch.ones(40)  # a negative second moment (loaded)
        opt.load_state_dict(sd)
        p.grad = torch.ones(40)
        libm.feenableexcept(0x01)  # FE_INVALID unmasked in this thread
        try:
            opt.step()
        finally:
            libm.fedisableexcept(0x01)
        out.append(p.detach().clone())
    print("DIFF", first_difference(out[0], out[1]))
    print("NOTES", opt.update_path()["single_pass_notes"])
""")


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.slow
def test_invalid_trap_unmasked_negative_second_moment(foreach):
    """FE_INVALID unmasked (feenableexcept) and a negative exp_avg_sq loaded through a state
    dict: native's step survives (MKL's square root gives NaN without a trap) with NaN
    parameters; at 2c35afc the pass's hardware square root of the negative lanes raised the
    trap and the process died of SIGFPE (exit -8). Now the single pass refuses wherever an
    exception is unmasked (any of its operations could trap where native's do not), and the
    square root runs under the default MXCSR anyway."""
    r = subprocess.run([sys.executable, "-c", CHILD, "1" if foreach else "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child exited {r.returncode}: {r.stderr[-2000:]}"
    assert "DIFF None" in r.stdout, r.stdout
    assert "unmasked floating-point exceptions" in r.stdout, r.stdout
