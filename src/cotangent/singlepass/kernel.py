"""The single-pass kernel's compiled library and the machine it runs on.

`build` compiles `csrc/singlepass.cpp` (once per source, flags and ISA; `cotangent._build`'s
cache) and loads it through ctypes; `sqrt_kind` chooses the square root with `torch.sqrt`'s
bits here (MKL's `vmsSqrt`, called per block, or its emulation where `emulation_matches`
proved it); `team`, `mxcsr` and `flushing_now` read the OpenMP team and the float modes the
kernel will compute under.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import struct
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from cotangent import _build, _compat, calibration

GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: TensorIterator splits work among threads above it
MKL_SQRT_MODE = 0x2 | 0x140000 | 0x100  # VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
IMPLEMENTATIONS = ("for-loop", "foreach")  # native op sequences the kernel follows
KINDS = IMPLEMENTATIONS + ("fused",)  # ... and ATen's fused kernel, whose bits it has too
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-trapping-math",
                 "-fno-math-errno", "-fopenmp",
                 "-fPIC", "-shared", "-std=c++17")
# Added where ATen itself runs its AVX512 kernels (the CPU has AVX-512 F/BW/VL/DQ): the same
# per-element IEEE operations on 16 lanes instead of 8 (measured on a 2-core AMD EPYC, 3.3M
# elements: float32 7% less time per step; bfloat16, whose 16-bit lanes need BW, 2.5 -> 1.2 ms);
# the build hash, and so every verdict, differs per flag set.
AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                "-mprefer-vector-width=512")


def compile_flags() -> tuple[str, ...]:
    """The compiler flags of the kernel in this process: `COMPILE_FLAGS`, plus `AVX512_FLAGS`
    where ATen's CPU capability is AVX512."""
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        return COMPILE_FLAGS + AVX512_FLAGS
    return COMPILE_FLAGS


# the kernel's C++ source (package data); its text is part of the build key
_SOURCE = (Path(__file__).parent.parent / "csrc" / "singlepass.cpp").read_text()
# the tests' mutant mask (the source's head): nonzero only in tests, which then load the build
# with the switches (`-DCOT_MUTANT_RUNTIME`) and set its `cot_mutant_mask` to it
_MUTANT = 0


class SinglePassUnavailable(RuntimeError):
    """The single-pass kernel cannot run here (no C++ compiler, a failed build, an unsupported
    CPU or torch build); the caller keeps native's op-by-op path."""


@dataclass
class Build:
    """How the kernel library was obtained: its path, the compiler, whether it came from the
    on-disk cache, the seconds spent compiling (0.0 when cached), and the build's hash (of the
    source, the compiler and its version, and the flags: part of every verdict's key), and the
    addresses of its MKL square root imitations (None: not in this build;
    `emulated_sqrt_address`)."""
    path: str
    compiler: str
    cached: bool
    compile_s: float
    key: str = ""
    emulated_sqrt: int | None = None
    emulated_sqrt14: int | None = None


_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_BUILD: Build | None = None
_FAILURE: str | None = None


def build() -> Build:
    """Compile (or load from the cache) the kernel library; raises `SinglePassUnavailable` with
    the reason when there is no compiler or the build fails. Thread-safe; once per process."""
    global _LIB, _BUILD, _FAILURE
    with _LOCK:
        if _BUILD is not None:
            return _BUILD
        if _FAILURE is not None:
            raise SinglePassUnavailable(_FAILURE)
        try:
            _LIB, _BUILD = _build_locked()
        except SinglePassUnavailable as e:
            _FAILURE = str(e)
            raise
        return _BUILD


def _build_locked() -> tuple[ctypes.CDLL, Build]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise SinglePassUnavailable(f"single-pass AdamW supports x86-64 only, not "
                                    f"{platform.machine()}")
    try:
        flags = compile_flags() + (("-DCOT_MUTANT_RUNTIME",) if _MUTANT else ())
        built = _build.compile_cached("singlepass", _SOURCE, flags)
    except _build.BuildFailed as e:
        raise SinglePassUnavailable(str(e)) from e
    target, cxx, cached, compile_s, key = (built.path, built.compiler, built.cached,
                                           built.compile_s, built.key)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise SinglePassUnavailable(f"loading the single-pass kernel failed: {e}") from e
    if _MUTANT:
        ctypes.c_int.in_dll(lib, "cot_mutant_mask").value = _MUTANT
    lib.cot_singlepass_adamw.restype = ctypes.c_int
    lib.cot_singlepass_adamw.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_double]
    lib.cot_singlepass_adamw_bf16.restype = ctypes.c_int
    lib.cot_singlepass_adamw_bf16.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_double, ctypes.c_double,
        ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_int, ctypes.c_int]
    lib.cot_singlepass_disjoint.restype = ctypes.c_int
    lib.cot_singlepass_disjoint.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.cot_singlepass_sqrt.restype = None
    lib.cot_singlepass_sqrt.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_longlong]
    lib.cot_singlepass_mxcsr.restype = ctypes.c_int
    lib.cot_singlepass_mxcsr.argtypes = []
    lib.cot_singlepass_norms.restype = None
    lib.cot_singlepass_norms.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_int]
    lib.cot_singlepass_steps.restype = None
    lib.cot_singlepass_steps.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                         ctypes.c_int]
    if cached:
        _log.info("single-pass kernel loaded from the cache: %s", target)
    else:
        _log.info("single-pass kernel compiled in %.2f s (%s): %s", compile_s, cxx, target)
    lib.cot_singlepass_clip_scalars.restype = None
    lib.cot_singlepass_clip_scalars.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double,
                                                ctypes.c_void_p, ctypes.c_void_p]
    lib.cot_singlepass_norms_team.restype = None
    lib.cot_singlepass_norms_team.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                              ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.cot_singlepass_team.restype = ctypes.c_int
    lib.cot_singlepass_team.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.cot_singlepass_emulated_sqrt.restype = ctypes.c_void_p
    lib.cot_singlepass_emulated_sqrt.argtypes = []
    lib.cot_singlepass_emulated_sqrt14.restype = ctypes.c_void_p
    lib.cot_singlepass_emulated_sqrt14.argtypes = []
    return lib, Build(str(target), cxx, cached, compile_s, key[:20],
                      lib.cot_singlepass_emulated_sqrt(), lib.cot_singlepass_emulated_sqrt14())


def _lib() -> ctypes.CDLL:
    build()
    assert _LIB is not None
    return _LIB


@lru_cache(maxsize=None)
def mkl_sqrt_address() -> int | None:
    """Address of MKL's `vmsSqrt` inside libtorch_cpu (the function `torch.sqrt` calls for
    float32 on MKL builds), or None when this torch build does not export it
    (`cotangent._compat.mkl_vms_sqrt_address`)."""
    return _compat.mkl_vms_sqrt_address()


def _sqrt_probe_values() -> Tensor:
    gen = torch.Generator().manual_seed(11)
    n = 1 << 16
    x = torch.rand(n, generator=gen, dtype=torch.float32) * torch.pow(
        10.0, torch.randint(-44, 38, (n,), generator=gen).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            -1.0, -1e-40, 1e-45, 1e-40, 3.4e38], dtype=torch.float32)
    x = torch.cat([x, special, torch.rand(4000, generator=gen, dtype=torch.float32) * 1e-3])
    x.view(torch.int32)[-1] = -1  # all-ones NaN
    x.view(torch.int32)[-2] = 0x7FC000AB  # a NaN with a payload
    return x


def emulated_sqrt_address() -> int | None:
    """Address of the kernel's imitation of MKL's `vmsSqrt` on AMD CPUs (a vector square root
    computed from the CPU's 12-bit reciprocal square root estimate, one Goldschmidt step and a
    residual correction, each operation rounded on its own; see the kernel source). Its results
    equal MKL's only on CPUs whose estimate table and MKL code path are the ones it was derived
    on (AMD Zen 5 and an AVX2 "AMD EPYC" VM, where it equals MKL's on all 2**32 inputs):
    `sqrt_kind` uses it only after `emulation_matches` proved it here."""
    return build().emulated_sqrt


def emulated14_sqrt_address() -> int | None:
    """Address of the kernel's imitation of MKL's `vmsSqrt` on Intel CPUs with AVX-512 (from
    the 14-bit VRSQRT14PS estimate, one correction by two fused multiply-adds, the smallest
    inputs scaled; see `emu14_sqrt` in the kernel source; derived on an Intel Xeon, where it
    equals MKL's on all 2**32 inputs), or None in AVX2 builds. `sqrt_kind` uses it only after
    `emulation_matches` proved it here."""
    return build().emulated_sqrt14


EMULATION_KIND = "mkl-sqrt-emulation"  # calibration kind of `emulation_matches` verdicts
EMULATION_CHUNK = 1 << 22  # float32 inputs per comparison
# The float32 bit patterns (as int32) `emulation_matches` checks: every non-negative one (+0,
# subnormals, normals, +inf, NaN payloads; the imitation's formula covers the positive normal
# ones), every negative zero and subnormal (up to the smallest normal and one beyond), every
# pattern from just below -FLT_MAX through -inf and all negative NaNs, and the other negative
# normals at a prime stride (they all take the same branch to +NaN, checked at its edges
# exhaustively above). MKL's negative-input path is 5x slower than its positive one, which
# is why those are strided: about 2 s in all on 2 cores.
EMULATION_PATTERNS = (range(0, 1 << 31), range(-(1 << 31), -(1 << 31) + (1 << 23) + 2),
                      range(-(1 << 23) - 2, 0), range(-(1 << 31), 0, 251))


def emulation_matches(address: int, reference=torch.sqrt, *, patterns=EMULATION_PATTERNS,
                      chunk: int = EMULATION_CHUNK) -> bool:
    """Whether the square root at `address` (a kernel sqrt function) gives `reference`'s
    bytes (``reference(x, out=...)``; `torch.sqrt`, float32, CPU) for every float32 bit pattern
    of the int32 ranges `patterns` (default `EMULATION_PATTERNS`: all 2**31 non-negative
    patterns and 25.3M negative ones), called in blocks as the kernel calls it. The verdict for
    the defaults is cached in the calibration file under the CPU model
    (`calibration.cpu_model`) and the kernel build, so a machine pays the check once.

    Raises `SinglePassUnavailable` where the kernel cannot be built."""
    if not (patterns is EMULATION_PATTERNS and reference is torch.sqrt):
        return _emulation_check(address, reference, patterns, chunk)
    built = build()
    name = "emulated14" if address == built.emulated_sqrt14 else "emulated"
    key = calibration.full_key(EMULATION_KIND, "cpu", (built.key, name),
                               probe=(emulation_matches, _emulation_check, EMULATION_PATTERNS))

    def timed() -> bool:
        global _SQRT_CHECK_S
        t0 = time.perf_counter()
        try:
            return _emulation_check(address, reference, patterns, chunk)
        finally:
            _SQRT_CHECK_S += time.perf_counter() - t0

    return calibration.verdict(key, timed)


def _emulation_check(address: int, reference, patterns, chunk: int) -> bool:
    """`emulation_matches`' comparison itself, uncached."""
    lib = _lib()
    t0 = time.perf_counter()
    verdict, count = True, 0
    offsets = torch.arange(chunk, dtype=torch.int32)
    bits, got = torch.empty(chunk, dtype=torch.int32), torch.empty(chunk, dtype=torch.float32)
    want = torch.empty(chunk, dtype=torch.float32)
    for span in patterns:
        step = offsets * span.step
        for start in range(span.start, span.stop, chunk * span.step):
            n = min(chunk, len(range(start, span.stop, span.step)))
            x = torch.add(step[:n], start, out=bits[:n]).view(torch.float32)  # bit patterns
            lib.cot_singlepass_sqrt(n, x.data_ptr(), got.data_ptr(), address, MKL_SQRT_MODE)
            reference(x, out=want[:n])
            count += n
            if not torch.equal(got[:n].view(torch.int32), want[:n].view(torch.int32)):
                verdict = False
                break
        if not verdict:
            break
    _log.info("emulated MKL square root against torch.sqrt over %s float32 inputs: %s "
              "(%.2f s)", f"{count:,}", "same bits" if verdict else "differs",
              time.perf_counter() - t0)
    return verdict


@lru_cache(maxsize=None)
def sqrt_kind() -> str | None:
    """Which square root reproduces `torch.sqrt` (float32, CPU) byte for byte, in the kernel's
    blocks: "emulated" or "emulated14" (the kernel's imitations of MKL's vmsSqrt as AMD and
    Intel CPUs run it, 3x faster than calling it, where `emulation_matches` proved one on every
    non-negative float32 input and 25.3M negative ones), "mkl" (MKL's vmsSqrt, the one
    torch calls), "hardware" (a correctly rounded square root, what ATen's vectorised kernel
    does without MKL) or None (none: no single pass). Every kind must also pass the same probe
    values at several call lengths."""
    global _SQRT_CHOSEN
    x = _sqrt_probe_values()
    want = _stable_sqrt_reference(x)
    if want is None:
        _SQRT_CHOSEN = None
        return None
    lib = _lib()
    mkl = mkl_sqrt_address()
    emulated = emulated_sqrt_address() if mkl is not None else None
    emulated14 = emulated14_sqrt_address() if mkl is not None else None
    for kind, address in (("emulated", emulated), ("emulated14", emulated14), ("mkl", mkl),
                          ("hardware", None)):
        if kind != "hardware" and address is None:
            continue
        for lengths in ((x.numel(),), (1, 7, 16, 17, 100, 2047, 2049)):
            out = torch.empty_like(x)
            pos, i = 0, 0
            while pos < x.numel():  # several call lengths: the result must not depend on them
                n = min(lengths[i % len(lengths)], x.numel() - pos)
                lib.cot_singlepass_sqrt(n, x[pos:].data_ptr(), out[pos:].data_ptr(), address,
                                        MKL_SQRT_MODE)
                pos, i = pos + n, i + 1
            if not torch.equal(out.view(torch.int32), want):
                break
        else:
            if not kind.startswith("emulated") or emulation_matches(address):
                _SQRT_CHOSEN = kind
                return kind
    _SQRT_CHOSEN = None
    return None


def _stable_sqrt_reference(x: Tensor, tries: int = 4) -> Tensor | None:
    """`torch.sqrt(x)`'s bits (as int32) once two calls in a row agree, or None if no two of
    `tries` calls do. A process's first `torch.sqrt` over inputs with NaN and negative values
    has been seen to differ from every later call in one thread's share of the elements (up to
    1,500 ULP; MKL's vmsSqrt, an Intel Xeon VM, about one process in eight after Cotangent's
    setup); taken as the reference, it refused the single pass for the whole process."""
    last = torch.sqrt(x).view(torch.int32)
    for _ in range(tries - 1):
        now = torch.sqrt(x).view(torch.int32)
        if torch.equal(now, last):
            return now
        last = now
    return None


def sqrt_address(kind: str | None) -> int | None:
    """The kernel's square root function for `kind` (`sqrt_kind`): None means the hardware's."""
    if kind == "emulated":
        return emulated_sqrt_address()
    if kind == "emulated14":
        return emulated14_sqrt_address()
    return mkl_sqrt_address() if kind == "mkl" else None


DTYPES = (torch.float32, torch.bfloat16)  # parameter dtypes the single pass takes
FLT_MIN = 1.1754943508222875e-38  # smallest normal float32
FLT_MAX = 3.4028234663852886e38  # largest finite float32
MXCSR_DAZ = 0x0040  # MXCSR denormals-are-zero (torch.set_flush_denormal(True) sets it and FTZ)
_SQRT_CHECK_S = 0.0  # seconds `emulation_matches` spent checking in this process (not cached)
_SQRT_CHOSEN: str | None = "not checked"  # what `sqrt_kind` chose in this process
_log = logging.getLogger("cotangent.singlepass")
_FORKED = False  # this process is a fork of one that loaded the kernel's OpenMP runtime


def _after_fork_in_child() -> None:
    global _FORKED
    _FORKED = True


os.register_at_fork(after_in_child=_after_fork_in_child)


FORKED_REASON = ("a forked child process: the kernel's OpenMP runtime does not survive fork "
                 "(its thread team can hang), so native's op sequence runs here")


def _f32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def team() -> tuple[int, tuple[int, ...]]:
    """(size, MXCSR control fields of each member: flush-to-zero, denormals-are-zero, rounding
    mode, exception masks; bits 6-15) of the OpenMP team a parallel region asking for
    `torch.get_num_threads()` threads gets now: ATen splits its work by that size (not by the
    number asked for: OMP_THREAD_LIMIT caps it), and each member computes under its own modes
    (`torch.set_flush_denormal` after the pool started sets the calling thread's only). Size -1:
    the OpenMP runtime may change team sizes (OMP_DYNAMIC)."""
    n = torch.get_num_threads()
    out = (ctypes.c_int * n)()
    size = int(_lib().cot_singlepass_team(n, ctypes.cast(out, ctypes.c_void_p)))
    return size, tuple(int(x) & 0xFFC0 for x in out[:max(size, 0)])


def mxcsr() -> int:
    """The calling thread's MXCSR fields that change float results (flush-to-zero,
    denormals-are-zero, rounding mode; e.g. after `torch.set_flush_denormal(True)`)."""
    return int(_lib().cot_singlepass_mxcsr()) & 0xE040


def flushing_now() -> bool | None:
    """Whether float32 arithmetic on the calling thread flushes subnormals (x86 FTZ or DAZ in
    its MXCSR: what `torch.set_flush_denormal(True)` sets), read from the register where the
    kernel library is loaded (about 1 us); None where it is not (ask
    `cotangent.norms.flushing_denormals`, which reads it off a multiply)."""
    if _LIB is None:
        return None
    return bool(int(_LIB.cot_singlepass_mxcsr()) & 0x8040)
