"""One pass over memory for the for-loop, foreach and fused AdamW of `torch.optim.AdamW` (CPU;
float32 parameters, and bfloat16 for for-loop and foreach), and the clip's per-tensor norms in
one call.

Native for-loop (`torch.optim.adam._single_tensor_adam`) and foreach (`_multi_tensor_adam`) AdamW
run about ten elementwise ATen operations per parameter, each a pass over memory. This module
runs the same IEEE float operations, in the same order, element by element, in one pass over the
parameters, gradients and moments (a C++ kernel compiled on first use with the system C++
compiler, loaded through ctypes; no Python loop over elements). What it has to reproduce,
measured on torch 2.13.0+cpu (x86-64; the AVX2 builds of these ATen kernels run on AVX2 and
AVX512 machines alike):

* `exp_avg.lerp_(grad, w)` rounds once: ``fma(w, grad - exp_avg, exp_avg)`` when ``|w| < 0.5``,
  else ``fma(w - 1, grad - exp_avg, grad)`` in ATen's vector body and
  ``-((grad - exp_avg) * (1 - w)) + grad`` in its scalar tail, which differ in the sign of zeros
  at ``w == 1`` (beta1 = 0) (`ATen/native/Lerp.h`, `LerpKernel.cpp`, contracted by the compiler);
* `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)` is
  ``fma(value * grad, grad, exp_avg_sq * beta2)`` (`PointwiseOpsKernel.cpp`, contracted);
* `param.addcdiv_(exp_avg, denom, value=-step_size)` is ``(value * exp_avg) / denom + param``;
* Python-float scalars are rounded to float32 once (`c10::Scalar::to<float>()`) and divisions by
  them are true divisions;
* `exp_avg_sq.sqrt()` is MKL's `vmsSqrt` (`ATen/cpu/vml.h`, mode ``VML_HA | VML_FTZDAZ_OFF |
  VML_ERRMODE_IGNORE``) where torch is built with MKL; it is *not* correctly rounded (about 20% of
  uniformly random inputs come out 1 ULP away from a hardware square root) and returns
  ``+NaN`` (0x7FC00000) for negative inputs. On AMD Zen 5 its outputs, observed for every input
  (black-box), are those of the CPU's 12-bit reciprocal square root estimate, one Goldschmidt
  step and a residual correction with every operation rounded on its own (correctly rounded
  for subnormals and the top 4096 finite values): the kernel computes that itself, 3x faster
  than the call (0.10 against 0.34 ns per element, one thread, L2-resident), where
  `emulation_matches` proved it against `torch.sqrt` on this machine (all 2**31 non-negative
  inputs and 25.3M negative ones, about 2 s once, cached); elsewhere it calls that same function
  on each block (`sqrt_kind`);
* where two operands of one ATen operation are NaN, the NaN kept is the gradient's (lerp,
  addcmul), then ``value * exp_avg`` over the denominator over the parameter (addcdiv);
* `torch.maximum` (amsgrad) differs between ATen's vector body and scalar tail: any NaN gives
  0xFFFFFFFF in the body and 0x7FC00000 in the tail, and for ``+0.0`` against ``-0.0`` the body
  keeps the second operand and the tail the first. So the kernel is told where native's tails
  are: the last ``numel % 16`` elements of each thread chunk of each tensor (`native_pieces`).

bfloat16 parameters (gradients and moments then bfloat16 too) run the same float formulas with
every op's result rounded to bfloat16 as ATen's op does (round to nearest even; a NaN becomes
0xFFFF in the op's vector body, whose unit is 32 elements, and 0x7FC0 in its scalar tail, but
0xFFFF everywhere for `torch.sqrt`, a hardware float square root here, not MKL's); `add_` rounds
its scalar (eps) to bfloat16 first, and so does `_foreach_mul_` (the decay, beta2) where `mul_`
keeps them float (measured on torch 2.13.0, ATen's `BinaryOpsKernel.cpp`, `LerpKernel.cpp`,
`PointwiseOpsKernel.cpp`). amsgrad and the clip multiply stay native for bfloat16.

Fused AdamW (``implementation="fused"``, float32) follows `torch._fused_adamw_` instead
(`FusedAdamKernel.cpp`'s `adam_math`, ADAMW mode; measured on torch 2.13.0+cpu, x86-64): its
AVX2 build runs on AVX2 and AVX512 machines (a vector body of 8 lanes, `fused_vector_unit`, and a
scalar tail of the last ``numel % 8`` elements of each tensor: its thread chunks are whole cache
lines); double scalars rounded to float once; the hardware square root; ``fma(w, d, exp_avg)``
(or ``fma(w - 1, d, grad)`` / ``fma(-d, 1 - w, grad)``) for the lerp; ``fma((1 - beta2) * g, g,
exp_avg_sq * beta2)`` in the body and ``fma(exp_avg_sq, beta2, (1 - beta2) * g * g)`` in the
tail; ``param * decay + (-step_size * exp_avg) / denom``. Its NaN rules differ between body and
tail and between the two compiled copies `at::parallel_for` runs (inline for a tensor of one
cache line or on one thread, else in its parallel region: `fused_pieces`); the kernel source
names each. `tensor_norms` gives ATen's per-tensor CPU 2-norms of contiguous float32 tensors
(`aten_norm2` in the source), where `norms_proven` found them equal to native's.

Nothing here is trusted blindly: `matches_native` runs native AdamW and this pass on probe data
(lengths around the vector unit and the thread-split grain, NaNs of both signs and several
payloads, infinities, signed zeros, subnormals, in parameters, gradients and moments) and
compares every byte; a caller uses the pass only where that probe passed.

`cotangent.AdamW` uses it for its for-loop, foreach and fused calls over CPU tensor lists
(decoupled weight decay, float betas, not capturable / differentiable): one `launch` per (param
group, device, dtype) over the parameters with a gradient at that step, reading and writing
every tensor where it is (`prepare_lists`); the harness's `PackedAdamW` for its for-loop and
foreach calls over flat buffers (`single_pass_adamw_`). `decide` gates every call at every step:
``COTANGENT_SINGLE_PASS=0`` switches it off; without the kernel (`unavailable_reason`: not
x86-64, an ATen CPU capability other than AVX2/AVX512, no C++ compiler, a failed build) native's
op sequence runs and one `SinglePassWarning` per process says so; otherwise a `matches_native`
probe with the group's own hyperparameters must have passed for the verdict key (`key_parts`,
cached in memory and in the calibration file like every other probe). `AdamW.update_path()`
names the path each step took.
"""

from __future__ import annotations

import array
import ctypes
import logging
import math
import os
import platform
import struct
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from operator import attrgetter, is_
from pathlib import Path

import torch
from torch import Tensor

from cotangent import _build, _compat, calibration, tensorlists
from cotangent.spans import is_dense_non_overlapping, overlapping_pair

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
_SOURCE = (Path(__file__).with_name("csrc") / "singlepass.cpp").read_text()
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
    address of its MKL square root imitation (None: not in this build; `emulated_sqrt_address`)."""
    path: str
    compiler: str
    cached: bool
    compile_s: float
    key: str = ""
    emulated_sqrt: int | None = None


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
    lib.cot_singlepass_team.restype = ctypes.c_int
    lib.cot_singlepass_team.argtypes = [ctypes.c_int, ctypes.c_void_p]
    emulated = None
    if hasattr(lib, "cot_singlepass_emulated_sqrt"):  # AVX-512 builds
        lib.cot_singlepass_emulated_sqrt.restype = ctypes.c_void_p
        lib.cot_singlepass_emulated_sqrt.argtypes = []
        emulated = lib.cot_singlepass_emulated_sqrt()
    return lib, Build(str(target), cxx, cached, compile_s, key[:20], emulated)


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
    x = torch.rand(n, generator=gen) * torch.pow(10.0, torch.randint(-44, 38, (n,),
                                                                     generator=gen).float())
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
                            -1.0, -1e-40, 1e-45, 1e-40, 3.4e38])
    x = torch.cat([x, special, torch.rand(4000, generator=gen) * 1e-3])
    x.view(torch.int32)[-1] = -1  # all-ones NaN
    x.view(torch.int32)[-2] = 0x7FC000AB  # a NaN with a payload
    return x


def emulated_sqrt_address() -> int | None:
    """Address of the kernel's imitation of MKL's `vmsSqrt` (a vector square root computed
    from the CPU's 12-bit reciprocal square root estimate, one Goldschmidt step and a residual
    correction, each operation rounded on its own; see the kernel source), or None where the
    build has none (not an AVX-512 build). Its results equal MKL's only on CPUs whose estimate
    table and MKL code path are the ones it was derived on (AMD Zen 5, where it equals MKL's on
    all 2**32 inputs): `sqrt_kind` uses it only after `emulation_matches` proved it here."""
    return build().emulated_sqrt


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
    the defaults is cached in the calibration file under the CPU model (`calibration.cpu_model`) and the
    kernel build, so a machine pays the check once.

    Raises `SinglePassUnavailable` where the kernel cannot be built."""
    lib = _lib()
    key = None
    if patterns is EMULATION_PATTERNS and reference is torch.sqrt:
        key = calibration.full_key(EMULATION_KIND, "cpu", (build().key,),
                                   probe=(emulation_matches, EMULATION_PATTERNS))
        cached = calibration.lookup(key)
        if cached is not None:
            return cached
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
    seconds = time.perf_counter() - t0
    _log.info("emulated MKL square root against torch.sqrt over %s float32 inputs: %s "
              "(%.2f s)", f"{count:,}", "same bits" if verdict else "differs", seconds)
    if key is not None:
        global _SQRT_CHECK_S
        _SQRT_CHECK_S += seconds
        calibration.record(key, verdict)
    return verdict


@lru_cache(maxsize=None)
def sqrt_kind() -> str | None:
    """Which square root reproduces `torch.sqrt` (float32, CPU) byte for byte, in the kernel's
    blocks: "emulated" (the kernel's imitation of MKL's vmsSqrt, 3x faster than calling it,
    where `emulation_matches` proved it on every non-negative float32 input and 25.3M negative
    ones), "mkl" (MKL's vmsSqrt, the one
    torch calls), "hardware" (a correctly rounded square root, what ATen's vectorised kernel
    does without MKL) or None (none: no single pass). Every kind must also pass the same probe
    values at several call lengths."""
    global _SQRT_CHOSEN
    x = _sqrt_probe_values()
    want = torch.sqrt(x).view(torch.int32)
    lib = _lib()
    mkl = mkl_sqrt_address()
    emulated = emulated_sqrt_address() if mkl is not None else None
    for kind, address in (("emulated", emulated), ("mkl", mkl), ("hardware", None)):
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
            if kind != "emulated" or emulation_matches(address):
                _SQRT_CHOSEN = kind
                return kind
    _SQRT_CHOSEN = None
    return None


def sqrt_address(kind: str | None) -> int | None:
    """The kernel's square root function for `kind` (`sqrt_kind`): None means the hardware's."""
    if kind == "emulated":
        return emulated_sqrt_address()
    return mkl_sqrt_address() if kind == "mkl" else None


DTYPES = (torch.float32, torch.bfloat16)  # parameter dtypes the single pass takes


@lru_cache(maxsize=None)
def aten_vector_unit(dtype: torch.dtype = torch.float32) -> int | None:
    """Elements per iteration of ATen's vectorised loop (`cpu_kernel_vec`) for `dtype`, read off
    a NaN pattern that differs between its vector body and its scalar tail: float32
    `torch.maximum` (0xFFFFFFFF in the body, 0x7FC00000 in the tail), bfloat16 multiplication by
    a scalar (0xFFFF / 0x7FC0: the body's and the tail's float-to-bfloat16 conversions); None if
    the pattern is not that."""
    n = 127
    if dtype == torch.bfloat16:
        out = (torch.full((n,), float("nan"), dtype=dtype) * 0.5).view(torch.int16)
        body_bits, tail_bits = -1, 0x7FC0
    else:
        out = torch.maximum(torch.zeros(n), torch.full((n,), float("nan"))).view(torch.int32)
        body_bits, tail_bits = -1, 0x7FC00000
    body = [i for i in range(n) if int(out[i]) == body_bits]
    tail = [i for i in range(n) if int(out[i]) == tail_bits]
    if len(body) + len(tail) != n or body != list(range(len(body))):
        return None
    for unit in (8, 16, 32, 64):
        if n // unit * unit == len(body):
            return unit
    return None


@lru_cache(maxsize=None)
def fused_vector_unit() -> int | None:
    """Elements per vector of ATen's fused CPU AdamW (`torch._fused_adamw_`, float32): its
    scalar tail is the last ``numel % unit`` elements of each tensor. Read off amsgrad's maximum
    of a zero max_exp_avg_sq and a NaN exp_avg_sq, 0xFFFFFFFF in the vector body (Vectorized
    `maximum`) and the zero kept in the tail (std::max); None if the pattern is not that."""
    n = 127
    vmax = torch.zeros(n)
    _compat.fused_adamw_one_group(
        [torch.zeros(n)], [torch.full((n,), float("nan"))], [torch.zeros(n)], [torch.zeros(n)],
        [vmax], [torch.tensor(0.0)], amsgrad=True, beta1=0.9, beta2=0.999, lr=1e-3,
        weight_decay=0.0, eps=1e-8, maximize=False)
    bits = vmax.view(torch.int32).tolist()
    body = sum(1 for b in bits if b == -1)
    if bits[:body] != [-1] * body or any(b != 0 for b in bits[body:]):
        return None
    for unit in (8, 16, 32):
        if n // unit * unit == body:
            return unit
    return None


def thread_chunks(numel: int, threads: int) -> list[tuple[int, int]]:
    """The (start, end) ranges in which a TensorIterator op over `numel` contiguous elements runs
    its inner loop with `threads` ATen threads (`TensorIteratorBase::for_each`, `at::parallel_for`
    with GRAIN_SIZE, `at::internal::invoke_parallel` on OpenMP)."""
    if numel <= 0:
        return []
    if threads <= 1 or numel <= GRAIN_SIZE:  # for_each: serial below; parallel_for: not above
        return [(0, numel)]
    nt = min(threads, -(-numel // GRAIN_SIZE))
    chunk = -(-numel // nt)
    return [(b, min(numel, b + chunk)) for b in range(0, numel, chunk)]


def native_pieces(numels: tuple[int, ...], threads: int, unit: int, split_tails: bool) -> Tensor:
    """Rows of (start, length, segment index, is_tail) covering each segment (a native tensor
    of ``numels[k]`` elements; starts count from the segment's first element); with
    `split_tails`, each thread chunk of each segment is split into ATen's vector body (multiples
    of `unit`) and its scalar tail. int64 tensor of shape (pieces, 4)."""
    rows = []
    for k, numel in enumerate(numels):
        if not split_tails:
            if numel:
                rows.append((0, numel, k, 0))
            continue
        for b, e in thread_chunks(numel, threads):
            body = (e - b) // unit * unit
            if body:
                rows.append((b, body, k, 0))
            if e - b - body:
                rows.append((b + body, e - b - body, k, 1))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


_PIECES: dict = {}


def _pieces(numels, threads, unit, split_tails) -> Tensor:
    key = (numels, threads, unit, split_tails)
    t = _PIECES.get(key)
    if t is None:
        if len(_PIECES) > 256:
            _PIECES.clear()
        t = _PIECES[key] = native_pieces(numels, threads, unit, split_tails)
    return t


FUSED_TASK_UNIT = 16  # float32 elements per cache line: the fused kernel's parallel_for unit


def fused_pieces(numels: tuple[int, ...], threads: int, unit: int) -> Tensor:
    """Rows of (start, length, segment index, flags) covering each segment as ATen's fused CPU
    AdamW runs it: its vector body (multiples of `unit`) and scalar tail (the last
    ``numel % unit`` elements; its thread chunks are whole cache lines, so no other tails);
    flags bit 0: the tail; bit 1: the copy of the kernel `at::parallel_for` runs inline (one
    cache line of elements, or one thread), whose compiled code keeps other NaNs than the copy
    in the parallel region (measured: the sign of exp_avg_sq's NaN under maximize). int64 tensor
    of shape (pieces, 4)."""
    rows = []
    for k, numel in enumerate(numels):
        inline = 2 if threads <= 1 or numel <= FUSED_TASK_UNIT else 0
        body = numel // unit * unit
        if body:
            rows.append((0, body, k, inline))
        if numel - body:
            rows.append((body, numel - body, k, inline | 1))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


def _fused_pieces(numels, threads, unit) -> Tensor:
    key = ("fused", numels, threads, unit)
    t = _PIECES.get(key)
    if t is None:
        if len(_PIECES) > 256:
            _PIECES.clear()
        t = _PIECES[key] = fused_pieces(numels, threads, unit)
    return t


def _scalar(x) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def native_step_scalars(step: float, *, implementation: str, lr, beta1: float, beta2: float):
    """(addcdiv value, bias_correction2_sqrt) for one tensor at `step`, computed with the very
    Python/tensor expressions of `_single_tensor_adam` / `_multi_tensor_adam` (capturable=False),
    returned as Python floats (exact copies of what native hands to ATen); for "fused", the
    double expressions of ATen's `adam_fused_step_impl` (the value is ``-step_size``)."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    if implementation == "fused":  # FusedAdamKernel.cpp: doubles, std::pow and std::sqrt
        return -(_scalar(lr) / bias_correction1), math.sqrt(bias_correction2)
    if implementation == "for-loop":
        step_size = lr / bias_correction1  # a 0-d tensor when lr is one
        value = -step_size
    else:
        value = (lr / bias_correction1) * -1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    return _scalar(value), _scalar(bias_correction2_sqrt)


def _check_buffers(tensors: list[Tensor]) -> int:
    n = tensors[0].numel()
    for t in tensors:
        if not isinstance(t, Tensor) or t.device.type != "cpu" or t.dtype not in DTYPES or (
                t.dtype != tensors[0].dtype):
            raise TypeError("single-pass AdamW needs CPU tensors of one dtype, float32 or "
                            "bfloat16")
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise ValueError("single-pass AdamW needs 1-D contiguous buffers of one length")
        if t.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("single-pass AdamW updates in place: call it under torch.no_grad()")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.element_size() * n) for t in tensors)
    if n and any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError("single-pass AdamW needs buffers that do not overlap")
    return n


def _check_scalars(implementation: str, lr, beta1, beta2, clip_coef) -> None:
    if implementation not in KINDS:
        raise ValueError(f"implementation must be one of {KINDS}, not {implementation!r}")
    if isinstance(beta1, Tensor) or isinstance(beta2, Tensor):
        raise ValueError("single-pass AdamW takes float betas (a tensor beta takes another "
                         "ATen kernel)")
    if isinstance(lr, Tensor) and implementation == "foreach":
        raise ValueError("native foreach AdamW refuses a tensor lr without capturable=True")
    if isinstance(lr, Tensor) and implementation == "fused":
        raise ValueError("a tensor lr with fused AdamW: native path")
    if clip_coef is not None and not (isinstance(clip_coef, float)
                                      and _f32(clip_coef) == clip_coef):
        raise ValueError(f"clip_coef must be a float32 value as a Python float, not NaN, not "
                         f"{clip_coef!r} (a NaN coefficient: multiply the gradients apart)")


def single_pass_adamw_(params: Tensor, grads: Tensor, exp_avgs: Tensor, exp_avg_sqs: Tensor,
                       max_exp_avg_sqs: Tensor | None, steps: list[Tensor] | Tensor, *,
                       segments: list[tuple[int, int]] | None = None,
                       implementation: str = "for-loop", lr: float | Tensor, beta1: float,
                       beta2: float, eps: float, weight_decay: float, maximize: bool,
                       amsgrad: bool, threads: int | None = None,
                       clip_coef: float | None = None) -> None:
    """One AdamW step (decoupled weight decay) over flat buffers, in one pass, with the bits of
    native `torch.optim.AdamW(foreach=...)` stepping each segment as its own parameter (after
    ``grad.mul_(clip_coef)`` on each segment when `clip_coef` is given).

    `params`, `grads`, `exp_avgs`, `exp_avg_sqs` (and `max_exp_avg_sqs` when `amsgrad`): 1-D
    contiguous CPU tensors of one length N and one dtype, float32 or bfloat16 (bfloat16: not
    with `amsgrad` or `clip_coef`), distinct. `segments`: the native tensors as
    (offset, numel) ranges of the buffers (default: one segment over all N); elements outside
    every segment (padding) are not read or written. `steps`: one 0-d step tensor per segment
    (native's `state["step"]`), or one 1-D tensor with an entry per segment; incremented here by
    1 in their dtype, like native. The other arguments and the errors are those of
    `single_pass_adamw_lists_`, which runs the same kernel over one tensor per segment.
    """
    _check_scalars(implementation, lr, beta1, beta2, clip_coef)
    buffers = [params, grads, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
    n = _check_buffers(buffers)
    segs = tuple((int(o), int(k)) for o, k in (segments if segments is not None else [(0, n)]))
    if isinstance(steps, Tensor):
        if steps.dim() != 1 or steps.numel() != len(segs) or steps.device.type != "cpu":
            raise ValueError(f"{len(segs)} segments: steps must be a CPU tensor of that length")
    else:
        if len(steps) != len(segs):
            raise ValueError(f"{len(segs)} segments but {len(steps)} step tensors")
    for o, k in segs:
        if o < 0 or k < 0 or o + k > n:
            raise ValueError(f"segment ({o}, {k}) outside buffers of {n} elements")
    size = params.element_size()
    arrays = [_int64s([b.data_ptr() + size * o for o, _ in segs]) for b in buffers]
    _launch(params.dtype, list(map(_address, arrays)), tuple(k for _, k in segs), steps,
            implementation=implementation,
            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
            maximize=maximize, amsgrad=amsgrad, threads=threads, clip_coef=clip_coef)


def single_pass_adamw_lists_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                             exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor],
                             steps: list[Tensor], *, implementation: str = "for-loop",
                             lr: float | Tensor, beta1: float, beta2: float, eps: float,
                             weight_decay: float, maximize: bool, amsgrad: bool,
                             threads: int | None = None, clip_coef: float | None = None) -> None:
    """One AdamW step (decoupled weight decay) over tensor lists, in one pass over memory, with
    the bits of native `torch.optim.adam.adam(..., foreach=implementation == "foreach")` on the
    same lists (after ``grad.mul_(clip_coef)`` on each gradient when `clip_coef` is given, as
    `clip_grad_norm_` does on the CPU), reading and writing every tensor where it is.

    Args:
        params, grads, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs with `amsgrad`, else ``[]``):
            one entry per parameter, as native's `_init_group` lists them: CPU tensors of one
            dtype, float32 or bfloat16 (bfloat16: not with `amsgrad` or `clip_coef`); each
            parameter dense (contiguous, channels_last or another dense permutation), its
            gradient and moments of its shape and strides; no two tensors anywhere in the lists
            sharing memory.
        steps: native's ``state["step"]`` per parameter, distinct 0-d CPU tensors; incremented
            here by 1 in their dtype, like native.
        implementation: "for-loop" (`_single_tensor_adam`), "foreach" (`_multi_tensor_adam`),
            their scalars computed with native's own expressions, or "fused"
            (`torch._fused_adamw_`'s bits: float32 tensors, a float lr, float32 steps; its
            scalars as ATen's doubles).
        lr: a float, or a 0-d tensor (for-loop only: native foreach refuses a tensor lr without
            capturable).
        beta1, beta2, eps, weight_decay, maximize, amsgrad: as `torch.optim.AdamW`.
        threads: ATen's thread count whose work split native used (default: the OpenMP team
            `torch.get_num_threads()` gets); it fixes where native's scalar tails are (they
            differ from its vector body in torch.maximum, amsgrad, and in lerp at beta1 = 0).
            The kernel itself runs with `torch.get_num_threads()` threads.
        clip_coef: the value of `clip_grad_norm_`'s float32 clip coefficient
            (``clamp(max_norm / (total + 1e-6), max=1.0)``, read with ``.item()``), not NaN
            (where both the coefficient and a gradient are NaN, which payload ATen's multiply
            keeps depends on the element's place in its compiled loops: measured, torch 2.13.0
            AVX512 CPU); each gradient is multiplied by it in the same pass and written back
            (the clipped gradient, as native leaves it), then used.

    Raises:
        SinglePassUnavailable: the kernel cannot run here or no square root reproduces
            torch's (see `sqrt_kind`).
        ValueError / TypeError: arguments native would not run the same way (tensor betas, a
            NaN scalar, a tensor lr with foreach, tensors of other dtypes, devices, shapes or
            strides, overlapping memory, shared step tensors), before anything is modified.
    Use it only where `matches_native` passed for these settings.
    """
    _check_scalars(implementation, lr, beta1, beta2, clip_coef)
    prepared = prepare_lists(params, grads, exp_avgs, exp_avg_sqs,
                             max_exp_avg_sqs if amsgrad else None, steps)
    if not prepared.numels:
        return
    if not (prepared.disjoint if prepared.disjoint is not None else spans_disjoint(
            *prepared.spans())):
        raise ValueError("single-pass AdamW needs tensors that do not share memory")
    launch(prepared, implementation=implementation, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad, threads=threads,
           clip_coef=clip_coef)


@dataclass(frozen=True, slots=True)
class Prepared:
    """Tensor lists checked for the kernel (`prepare_lists`). `table`: int64, ``kinds + 2``
    rows of ``len(numels)`` entries: per tensor kind (parameter, gradient, exp_avg,
    exp_avg_sq[, max_exp_avg_sq]) each tensor's address, then each step tensor's address, then
    each parameter's numel. `float32_steps`: every step tensor is float32; `disjoint`: no two
    of these tensors share a byte (None: not read yet, see `spans`)."""

    dtype: torch.dtype
    table: array.array
    kinds: int
    numels: tuple[int, ...]
    steps: list[Tensor]
    float32_steps: bool
    contiguous: bool = False  # every tensor contiguous (the common case's check took them)
    disjoint: bool | None = None

    def row(self, r: int) -> int | None:
        """The address of row `r` of `table` (None when the lists are empty)."""
        n = len(self.numels)
        return self.table.buffer_info()[0] + 8 * r * n if n else None

    @property
    def bases(self) -> list[list[int]]:
        """Per tensor kind, each tensor's address."""
        n = len(self.numels)
        return [self.table[r * n:(r + 1) * n].tolist() for r in range(self.kinds)]

    @property
    def step_bases(self) -> list[int]:
        """Each step tensor's address."""
        n = len(self.numels)
        return self.table[self.kinds * n:(self.kinds + 1) * n].tolist()

    def spans(self) -> tuple[list[int], list[int]]:
        """(start addresses, byte lengths) of every tensor, step tensors included."""
        size = 2 if self.dtype == torch.bfloat16 else 4
        n = len(self.numels)
        starts = self.table[:(self.kinds + 1) * n].tolist()
        nbytes = [k * size for k in self.numels] * self.kinds + list(
            map(Tensor.element_size, self.steps))
        return starts, nbytes


def _table(bases: list[list[int]], step_bases: list[int], numels) -> array.array:
    return array.array("q", [x for b in bases for x in b] + list(step_bases) + list(numels))


def prepare_lists(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                  exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor] | None,
                  steps: list[Tensor], leave_out: list[int] | None = None) -> Prepared:
    """Check lists for `launch` (see `single_pass_adamw_lists_`'s Args) except that they do
    not share memory (`spans_disjoint`, which a caller may run once over several lists; the
    compiled reader reports it as `Prepared.disjoint`), and read their addresses. Modifies
    nothing. With `leave_out` (a list), a parameter whose gradient or state has another dtype,
    device, shape or strides, or that is not dense, is appended to it by index and left out of
    the result instead of raising (the caller updates it natively: for for-loop and foreach
    every tensor's update is its own).

    The common case (every tensor contiguous, of its parameter's shape and dtype, on the CPU)
    is read by `cotangent.tensorlists` in C++ where it is built; this function's Python checks
    are the reference and run wherever that reader declines.

    Raises:
        TypeError / ValueError: as `single_pass_adamw_lists_`.
    """
    lists = [params, grads, exp_avgs, exp_avg_sqs] + (
        [max_exp_avg_sqs] if max_exp_avg_sqs is not None else [])
    count = len(params)
    if any(len(x) != count for x in lists) or len(steps) != count:
        raise ValueError("single-pass AdamW needs lists of equal length")
    dtype = params[0].dtype if count else torch.float32
    if dtype not in DTYPES:
        raise TypeError("single-pass AdamW needs CPU tensors of one dtype, float32 or bfloat16")
    read = tensorlists.reader() if count else None
    if read is not None:
        table = array.array("q", bytes(8 * (len(lists) + 2) * count))
        code = read([x if type(x) is list else list(x) for x in lists],
                    steps if type(steps) is list else list(steps), torch.is_grad_enabled(),
                    table)
        if code:
            return Prepared(dtype, table, len(lists), tuple(table[-count:]), steps,
                            bool(code & 2), contiguous=True, disjoint=bool(code & 4))
    if any(isinstance(t, Tensor) and _not_plain_memory(t) for x in (*lists, steps) for t in x):
        # the whole call is native's (its error or its bytes), never split: a call split around
        # it would have updated the rest when native raises for it
        raise RuntimeError("a negative-bit view, an inference tensor or a ZeroTensor in the "
                           "lists: native path")
    if not all(map(_plain_type, {type(t) for x in (*lists, steps) for t in x})):
        # native's ops call its __torch_function__ / __torch_dispatch__ (which may log, or
        # compute otherwise)
        raise RuntimeError("a tensor subclass with __torch_function__ or __torch_dispatch__ of "
                           "its own: native path")
    shapes = list(map(_SHAPE, params))
    if all(_contiguous_alike(x, dtype, shapes) for x in lists):
        # (the common case, checked a list at a time in C loops: each tensor contiguous, of
        # its parameter's shape, the dtype, on the CPU)
        if torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, params)):
            raise RuntimeError("single-pass AdamW updates in place: call it under "
                               "torch.no_grad()")
        numels = tuple(map(Tensor.numel, params))
        steps, step_bases = _checked_steps(steps)
        return Prepared(dtype, _table([list(map(_DATA_PTR, x)) for x in lists], step_bases,
                                      numels), len(lists), numels, steps,
                        _float32(steps), contiguous=True)
    bases: list[list[int]] = [[] for _ in lists]
    numels = []
    strided = torch.strided
    taken = []
    for i, p in enumerate(params):
        shape = p.shape
        if p.is_contiguous():  # (the common case: contiguous tensors of one shape are alike)
            ptrs = []
            for x in lists:
                t = x[i]
                if not (isinstance(t, Tensor) and t.dtype is dtype and t.is_cpu
                        and t.layout is strided and t.is_contiguous() and t.shape == shape):
                    break
                ptrs.append(t.data_ptr())
            else:
                for b, ptr in zip(bases, ptrs):
                    b.append(ptr)
                numels.append(p.numel())
                taken.append(i)
                continue
        stride = p.stride()
        ptrs = []
        for x in lists:
            t = x[i]
            if not isinstance(t, Tensor) or (
                    t.dtype is not dtype or not t.is_cpu or t.layout is not strided):
                if leave_out is not None:
                    break
                raise TypeError("single-pass AdamW needs dense CPU tensors of one dtype, "
                                "float32 or bfloat16")
            if t.shape != shape or t.stride() != stride:
                if leave_out is not None:
                    break
                raise ValueError("single-pass AdamW needs each parameter's gradient and state "
                                 "in its shape and strides")
            ptrs.append(t.data_ptr())
        else:
            if is_dense_non_overlapping(p):
                for b, ptr in zip(bases, ptrs):
                    b.append(ptr)
                numels.append(p.numel())
                taken.append(i)
                continue
            if leave_out is None:
                raise ValueError("single-pass AdamW needs dense parameters (no gaps, no "
                                 "overlap)")
        leave_out.append(i)
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        raise RuntimeError("single-pass AdamW updates in place: call it under torch.no_grad()")
    steps = [steps[i] for i in taken] if len(taken) != count else list(steps)
    steps, step_bases = _checked_steps(steps)
    return Prepared(dtype, _table(bases, step_bases, numels), len(lists), tuple(numels), steps,
                    _float32(steps))


def _float32(steps: list[Tensor]) -> bool:
    return all(map(is_, map(_DTYPE, steps), repeat(torch.float32)))


_TORCH_FUNCTION_DEFAULTS = _compat.default_torch_functions()
_TORCH_DISPATCH_DEFAULT = _compat.default_torch_dispatch()


@lru_cache(maxsize=None)
def _plain_type(cls: type) -> bool:
    """Whether objects of `cls` go through torch ops as plain tensors: not a tensor subclass
    with a `__torch_function__` or `__torch_dispatch__` of its own (torch.Tensor's and
    nn.Parameter's, which disables the first, are plain; so are other types, which the checks
    refuse by name)."""
    if not issubclass(cls, Tensor):
        return True
    f = cls.__torch_function__
    d = getattr(cls, "__torch_dispatch__", _TORCH_DISPATCH_DEFAULT)
    return (getattr(f, "__func__", f) in _TORCH_FUNCTION_DEFAULTS
            and getattr(d, "__func__", d) is _TORCH_DISPATCH_DEFAULT)


def _not_plain_memory(t: Tensor) -> bool:
    """A tensor whose memory the pass may not read or write as its values: a negative-bit view
    (memory holds -x; native's fused kernel and foreach multiply refuse it, its for-loop
    resolves it), an inference tensor (native's in-place ops refuse it outside inference mode;
    its fused kernel takes some) or a ZeroTensor (no memory; immutable)."""
    return t.is_neg() or t.is_inference() or _compat.is_zerotensor(t)


_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")
_LAYOUT = attrgetter("layout")
_IS_CPU = attrgetter("is_cpu")
_REQUIRES_GRAD = attrgetter("requires_grad")
_DATA_PTR = Tensor.data_ptr


def _contiguous_alike(tensors: list, dtype: torch.dtype, shapes: list) -> bool:
    """Whether every entry of `tensors` is a contiguous strided CPU tensor of `dtype` with the
    shape at its place in `shapes` (C-level loops: `map` over methods and attribute
    getters)."""
    return (all(map(isinstance, tensors, repeat(Tensor)))
            and all(map(is_, map(_DTYPE, tensors), repeat(dtype)))
            and all(map(_IS_CPU, tensors))
            and all(map(is_, map(_LAYOUT, tensors), repeat(torch.strided)))
            and all(map(Tensor.is_contiguous, tensors))
            and list(map(_SHAPE, tensors)) == shapes)


def _checked_steps(steps: list) -> tuple[list, list[int]]:
    """(steps, their addresses) after checking they are distinct 0-d CPU tensors."""
    if not all(map(isinstance, steps, repeat(Tensor))) or len(set(map(id, steps))) != len(
            steps) or any(map(Tensor.dim, steps)) or not all(map(_IS_CPU, steps)):
        raise ValueError("one 0-d CPU step tensor per parameter, each its own (native "
                         "increments each)")
    return steps, list(map(_DATA_PTR, steps))


def spans_disjoint(starts: list[int], nbytes: list[int]) -> bool:
    """Whether no two of the byte spans ``[starts[i], starts[i] + nbytes[i])`` overlap (empty
    spans never do): one sort in C++, or in Python where the kernel library cannot be built
    (`cotangent.spans.overlapping_pair`: the same answer)."""
    try:
        lib = _lib()
    except SinglePassUnavailable:
        return overlapping_pair(starts, nbytes) is None
    a, b = _int64s(starts), _int64s(nbytes)
    return bool(lib.cot_singlepass_disjoint(_address(a), _address(b), len(starts)))


NORM_PROBE_KIND = "singlepass_norm"


def tensor_norms(tensors: list[Tensor]) -> Tensor:
    """The 2-norm of each tensor, computed in one C call (the tensors shared among
    `torch.get_num_threads()` threads) with the bits ATen's CPU norm gives each (see
    `aten_norm2` in the kernel source): a float32 tensor of shape (len(tensors),). Use it only
    where `norms_proven` holds.

    Args:
        tensors: contiguous float32 CPU tensors, any shapes (unchecked: the caller checks).
    Raises:
        SinglePassUnavailable: the kernel library cannot be built here.
    """
    return norms_at(list(map(_DATA_PTR, tensors)), list(map(Tensor.numel, tensors)))


def norms_at(addresses: list[int], numels) -> Tensor:
    """`tensor_norms` of the contiguous float32 tensors whose first elements are at
    `addresses` and whose lengths are `numels` (a call's checked gradients: `gradient_norms`,
    which reads them from its table)."""
    ptrs, lengths = _int64s(addresses), _int64s(list(numels))
    out = torch.empty(len(ptrs))
    _lib().cot_singlepass_norms(_address(ptrs), _address(lengths), len(ptrs), out.data_ptr(),
                                torch.get_num_threads())
    return out


def gradient_norms(prepared: Prepared) -> Tensor:
    """`tensor_norms` of the gradients of `prepared` (its second row of addresses), read from
    its table without a list."""
    n = len(prepared.numels)
    out = torch.empty(n)
    if n:
        _lib().cot_singlepass_norms(prepared.row(1), prepared.row(prepared.kinds + 1), n,
                                    out.data_ptr(), torch.get_num_threads())
    return out


def norm_probe_tensors(seed: int = 0) -> list[Tensor]:
    """The norm probe's inputs: float32 tensors of every length 0-299 and longer ones (around
    ATen's thread grain, up to 3M elements), values at random magnitudes from 1e-20 to 1e20
    (squares overflowing and underflowing), then copies with special values written in (NaNs
    of both signs and several payloads, infinities, signed zeros, subnormals), and one-element
    tensors of each special and extreme value."""
    from cotangent.calibration import SPECIAL_VALUES, sprinkle_special_values, write_special

    gen = torch.Generator().manual_seed(seed)
    lengths = list(range(300)) + [1023, 4099, 32767, 32768, 32769, 65537, 100003, (1 << 20) + 3,
                                  3_000_001]
    out = []
    for n in lengths:
        scale = 10.0 ** (float(torch.rand((), generator=gen)) * 40 - 20)
        out.append(torch.randn(n, generator=gen) * scale)
    special = [t.clone() for t in out[1:300]]
    sprinkle_special_values(special)
    ones = []
    for v in (*SPECIAL_VALUES, 3e38, -1e-30):
        ones.append(torch.zeros(1))
        write_special(ones[-1], 0, v)
    signalling = torch.zeros(1)
    signalling.view(torch.int32)[0] = 0x7FA00001
    return out + special + ones + [signalling]


def norms_match_native(seed: int = 0) -> bool:
    """Probe: does `tensor_norms` give, byte for byte, native clipping's per-tensor norms
    (`cotangent.norms.native_tensor_norms`, ord 2) of `norm_probe_tensors` here, under the
    current thread count and float modes? False (never raises) when the kernel cannot run."""
    from cotangent.norms import _bytes_equal, native_tensor_norms

    try:
        tensors = norm_probe_tensors(seed)
        ours = tensor_norms(tensors)
    except SinglePassUnavailable:
        return False
    return _bytes_equal(ours, torch.stack(native_tensor_norms(tensors, 2.0, None)))


def norms_proven(team_now=None) -> bool:
    """Whether the per-tensor 2-norms may come from `tensor_norms` now: the single pass is
    switched on and available, the OpenMP team computes under one set of float modes with
    exceptions masked, and a `norms_match_native` probe passed for this build, float modes
    and thread count (cached in memory and in the calibration file like every probe)."""
    global _PROBES, _PROBE_S
    if not switched_on() or unavailable_reason() is not None:
        return False
    size, modes = (team_now or team)()
    if size < 1 or len(set(modes)) > 1 or modes[0] & 0x1F80 != 0x1F80:
        return False
    memo = (NORM_PROBE_KIND, size, modes[0], torch.get_num_threads())
    verdict = _VERDICTS.get(memo)
    if verdict is None:
        parts = (f"build-{build().key}", f"mxcsr{modes[0]:#x}", f"team{size}")
        key = calibration.full_key(NORM_PROBE_KIND, "cpu", parts,
                                   probe=(norms_match_native, norm_probe_tensors))
        verdict = calibration.lookup(key)
        if verdict is None:
            _PROBES += 1
            t0 = time.perf_counter()
            verdict = norms_match_native()
            _PROBE_S += time.perf_counter() - t0
            calibration.record(key, verdict)
            if not verdict:
                _log.info("the kernel's norms differ from native's for %s: native norms", key)
        _VERDICTS[memo] = verdict
    return verdict


def launch(prepared: Prepared, *, implementation: str, lr, beta1: float, beta2: float,
           eps: float, weight_decay: float, maximize: bool, amsgrad: bool,
           threads: int | None = None, clip_coef: float | None = None) -> None:
    """Run the kernel over `prepared` lists (checked by `prepare_lists`, their memory by
    `spans_disjoint`); arguments and errors as `single_pass_adamw_lists_`, raised before
    anything is modified."""
    _check_scalars(implementation, lr, beta1, beta2, clip_coef)
    if amsgrad != (prepared.kinds == 5):
        raise ValueError("amsgrad needs the max_exp_avg_sq list, and only amsgrad")
    _launch(prepared.dtype, [prepared.row(r) for r in range(prepared.kinds)],
            prepared.numels, prepared.steps, step_row=prepared.row(prepared.kinds),
            float32_steps=prepared.float32_steps, implementation=implementation, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad, threads=threads,
            clip_coef=clip_coef)


def _int64s(values: list[int]) -> array.array:
    """`values` (pointers as integers) as a C array of int64, filled in C (`array.array`); pass
    `_address` of it to the kernel while it is alive (no ctypes array type per call: making one
    costs about 50 us)."""
    return array.array("q", values)


def _address(buf: array.array) -> int | None:
    """The address of `buf`'s first element, None when it is empty."""
    return buf.buffer_info()[0] if len(buf) else None


def _step_values(steps: list[Tensor] | Tensor) -> list[float]:
    """``(step_t + 1).item()`` for every step tensor (native increments first, in the step's
    dtype, then reads), without modifying them."""
    if isinstance(steps, Tensor):
        return (steps + 1).tolist()
    if not steps:
        return []
    dtypes = {s.dtype for s in steps}
    if len(dtypes) == 1:
        return (torch.stack(steps) + 1).tolist()
    return [(s + 1).item() for s in steps]


def _launch(dtype: torch.dtype, rows: list[int | None], numels: tuple[int, ...], steps, *,
            step_row: int | None = None, float32_steps: bool = False, implementation: str, lr,
            beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool,
            amsgrad: bool, threads: int | None, clip_coef: float | None) -> None:
    """The kernel call shared by the flat and the list API: `rows` holds, per tensor kind
    (parameter, gradient, exp_avg, exp_avg_sq[, max_exp_avg_sq]), the address of an int64
    array of each segment's first element's address (kept alive by the caller); `numels` the
    segments' lengths. `step_row`: such an array of the step tensors' addresses, which the
    caller has checked are distinct 0-d tensors (`float32_steps`: all float32). Raises before
    modifying anything."""
    bf16 = dtype == torch.bfloat16
    if bf16 and (amsgrad or clip_coef is not None):
        raise ValueError("bfloat16 buffers: amsgrad and the clip multiply are not reproduced by "
                         "the single pass")
    if float32_steps:
        step_dtypes = {torch.float32}
    else:
        step_dtypes = {steps.dtype} if isinstance(steps, Tensor) else set(map(_DTYPE, steps))
    if implementation == "foreach" and not step_dtypes <= {torch.float32, torch.float64}:
        raise ValueError("native foreach AdamW refuses step tensors that are not float32 or "
                         "float64: native path (and its error)")
    if step_row is None and not isinstance(steps, Tensor) and len(set(map(id, steps))) != len(
            steps):
        raise ValueError("one step tensor per segment, each its own (native increments each)")
    fused = implementation == "fused"
    if fused and (bf16 or step_dtypes != {torch.float32}):
        raise ValueError("the fused bits: float32 parameters and float32 step tensors only "
                         "(native path)")
    lib = _lib()
    # bfloat16 sqrt: float hardware sqrt, rounded; fused: Vectorized<float>::sqrt and std::sqrt
    sq = "hardware" if bf16 or fused else sqrt_kind()
    if sq is None:
        raise SinglePassUnavailable("no square root here reproduces torch.sqrt's bits")
    unit = fused_vector_unit() if fused else aten_vector_unit(dtype)
    if unit is None:
        raise SinglePassUnavailable("ATen's vector body / scalar tail split is unknown here")
    decay = 1 - lr * weight_decay if weight_decay != 0 else 1.0
    scalars = [_scalar(decay), 1 - beta1, beta2, 1 - beta2, eps]
    if any(s != s for s in scalars):
        raise ValueError("a NaN hyperparameter: not reproduced by the single pass")
    if bf16:
        # which scalars ATen rounds to bfloat16 first (measured, torch 2.13.0 CPU): add_ (eps)
        # always; _foreach_mul_ (the decay, beta2) too, where mul_ keeps them float
        scalars[4] = _bf16_value(scalars[4])
        if implementation == "foreach":
            scalars[0], scalars[2] = _bf16_value(scalars[0]), _bf16_value(scalars[2])
    # native: step_t += 1 (in the step tensor's dtype), then the scalars from step_t.item();
    # float32 step tensors (native's own) are read and incremented in C
    in_c = step_row is not None and step_dtypes == {torch.float32}
    if in_c:
        stepped_c = array.array("d", bytes(8 * len(numels)))
        _lib().cot_singlepass_steps(step_row, len(numels), _address(stepped_c), 0)
        stepped = stepped_c.tolist()
    else:
        stepped = _step_values(steps)
    by_step: dict[float, tuple[float, float]] = {}
    for t in stepped:
        if t not in by_step:
            by_step[t] = native_step_scalars(t, implementation=implementation, lr=lr,
                                             beta1=beta1, beta2=beta2)
    distinct = by_step.values()  # the checks need each distinct pair once (usually one)
    if any(a != a or b != b for a, b in distinct):
        raise ValueError("a NaN step size: not reproduced by the single pass")
    # ATen converts each scalar with c10::Scalar::to<float>(), which raises for a finite value
    # beyond float32 (e.g. lr / (1 - beta1**step) > 3.4e38): native raises, so refuse
    if any(math.isfinite(x) and abs(x) > FLT_MAX
           for x in [*scalars, *(a for a, _ in distinct), *(b for _, b in distinct)]):
        raise ValueError("a scalar beyond float32 (native raises converting it): native path")
    if len(by_step) == 1:
        (a, b), = distinct
        nstep = array.array("d", [a]) * len(stepped)
        bc2s = array.array("d", [b]) * len(stepped)
    else:
        nstep = array.array("d", [by_step[t][0] for t in stepped])
        bc2s = array.array("d", [by_step[t][1] for t in stepped])
    if threads is None:
        threads = team()[0]
        if threads < 1:
            raise SinglePassUnavailable("OpenMP may resize thread teams (OMP_DYNAMIC): ATen's "
                                        "chunks are unknown")
    pieces = _fused_pieces(numels, threads, unit) if fused else _pieces(numels, threads, unit,
                                                                         True)
    if not numels:
        return
    flags = (1 if weight_decay != 0 else 0) | (2 if maximize else 0) | (4 if amsgrad else 0)
    flags |= (8 if clip_coef is not None else 0) | (16 if fused else 0)
    if isinstance(steps, Tensor):
        steps.add_(1)
    elif in_c:
        lib.cot_singlepass_steps(step_row, len(numels), _address(stepped_c), 1)
        torch.autograd.graph.increment_version(steps)  # (as the add's version bump)
    else:
        _compat.foreach_add_(steps, 1)  # (per tensor on the CPU: `step_t += 1`'s bits)
    if bf16:
        lib.cot_singlepass_adamw_bf16(
            *rows, pieces.data_ptr(), pieces.shape[0],
            _address(nstep), _address(bc2s), scalars[0], scalars[1], scalars[2], scalars[3],
            scalars[4], flags, torch.get_num_threads())
        return
    lib.cot_singlepass_adamw(
        *rows[:4], rows[4] if amsgrad else None,
        pieces.data_ptr(), pieces.shape[0],
        _address(nstep), _address(bc2s),
        scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], flags,
        None if fused else sqrt_address(sq), MKL_SQRT_MODE, torch.get_num_threads(),
        0.0 if clip_coef is None else clip_coef)


PROBE_LENGTHS = (1, 7, 15, 16, 17, 33, 100, 1000, 2047, 2049, GRAIN_SIZE, GRAIN_SIZE + 1,
                 2 * GRAIN_SIZE + 17)
_ALL_ONES = object()  # stands for the NaN whose bits are all ones (0xFFFFFFFF)


def _as_float32(values) -> Tensor:
    t = torch.tensor([0.0 if v is _ALL_ONES else v for v in values], dtype=torch.float32)
    for i, v in enumerate(values):
        if v is _ALL_ONES:
            t.view(torch.int32)[i] = -1
    return t


_NAN = float("nan")
GRID_GRAD = (0.0, -0.0, 1e-3, -2.5e-3, 1e-40, -1e-40, float("inf"), -float("inf"), _NAN, -_NAN,
             _ALL_ONES, 3e38)
GRID_EXP_AVG = (0.0, -0.0, 1e-2, -1e-2, 1e-40, float("inf"), -float("inf"), _NAN, -_NAN)
GRID_EXP_AVG_SQ = (0.0, -0.0, 1e-4, 1e-40, float("inf"), _NAN, -1.0)
GRID_PARAM = (1.0, -0.0, 0.0, -2.0, float("inf"), -float("inf"), _NAN, -_NAN, 1e-40, 3e38)
GRID_MAX = (0.0, 1e-4, _NAN, float("inf"), -0.0, 1e-40)


# The grid without NaN lanes to come (`special_grid(nan=False)`): no NaNs, no infinite gradient or
# exp_avg (they make NaNs in the update), no negative second moment (a NaN square root); six
# maxima against five second moments (coprime cycles: every pairing occurs, e.g. a -0.0 maximum
# against the +0.0 second moment of a zero gradient)
GRID_GRAD_CLEAN = (0.0, -0.0, 1e-3, -2.5e-3, 1e-40, -1e-40, 3e38)
GRID_EXP_AVG_CLEAN = (0.0, -0.0, 1e-2, -1e-2, 1e-40)
GRID_EXP_AVG_SQ_CLEAN = (0.0, -0.0, 1e-4, 1e-40, float("inf"))
GRID_PARAM_CLEAN = (1.0, -0.0, 0.0, -2.0, float("inf"), -float("inf"), 1e-40, 3e38)
GRID_MAX_CLEAN = (0.0, 1e-4, float("inf"), -0.0, 1e-40, 1e30)


def special_grid(copies: int = 3, nan: bool = True) -> dict[str, Tensor]:
    """Probe values: every combination of special gradient, exp_avg and exp_avg_sq values
    (zeros of both signs, subnormals, infinities, NaNs of both signs, an all-ones NaN, huge and
    ordinary values, a negative second moment), `copies` times with the parameter and the
    maximum cycling through their own special values at other phases. Float32 tensors of
    ``copies * 756`` elements keyed "grad", "exp_avg", "exp_avg_sq", "param", "max_exp_avg_sq".
    `nan` False: the `GRID_*_CLEAN` values (``copies * 175`` elements), without the values
    that make NaNs, so that the vectors the kernel keeps in registers (those without a NaN
    lane) see the other special values too, in every pairing."""
    import itertools

    grad, exp_avg, exp_avg_sq, param, maximum = (
        (GRID_GRAD, GRID_EXP_AVG, GRID_EXP_AVG_SQ, GRID_PARAM, GRID_MAX) if nan else
        (GRID_GRAD_CLEAN, GRID_EXP_AVG_CLEAN, GRID_EXP_AVG_SQ_CLEAN, GRID_PARAM_CLEAN,
         GRID_MAX_CLEAN))
    combos = list(itertools.product(grad, exp_avg, exp_avg_sq)) * copies
    n, period = len(combos), len(combos) // copies
    return dict(
        grad=_as_float32([c[0] for c in combos]), exp_avg=_as_float32([c[1] for c in combos]),
        exp_avg_sq=_as_float32([c[2] for c in combos]),
        param=_as_float32([param[(i + i // period) % len(param)] for i in range(n)]),
        max_exp_avg_sq=_as_float32([maximum[(i + 2 * (i // period)) % len(maximum)]
                                    for i in range(n)]))


def probe_data(lengths: tuple[int, ...] = PROBE_LENGTHS, seed: int = 0, grid: bool = True,
               grid_copies: int = 3):
    """The probe's layout and values: segments (offset, numel) of flat buffers, at alternating
    64-byte offset parities with padding, for `lengths` (random values with special values
    sprinkled into parameters, gradients, both moments and the maximum, and a negative second
    moment), then, with `grid`, the `special_grid` (`grid_copies` copies) and its NaN-free
    version, each twice: as one segment (ATen's vector body) and as 15-element segments (all
    scalar tail). Returns (segments, initial dict of flat
    float32 buffers "param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", start steps, and
    ``grad(k)`` giving step k's flat gradient)."""
    from cotangent.calibration import sprinkle_special_values

    gen = torch.Generator().manual_seed(seed)
    grids = [special_grid(grid_copies), special_grid(grid_copies, nan=False)] if grid else []
    sizes = list(lengths)
    for g_grid in grids:
        n = g_grid["grad"].numel()
        sizes += [n] + [15] * (n // 15)
    segments, pos = [], 0
    for i, n in enumerate(sizes):
        pos += 16 if i % 2 else 0
        segments.append((pos, n))
        pos += -(-n // 16) * 16
    size = pos
    views = lambda t: [t[o:o + n] for o, n in segments]  # noqa: E731
    state = dict(param=torch.randn(size, generator=gen),
                 exp_avg=torch.randn(size, generator=gen) * 1e-2,
                 exp_avg_sq=torch.rand(size, generator=gen) * 1e-4)
    state["max_exp_avg_sq"] = state["exp_avg_sq"] + torch.rand(size, generator=gen) * 1e-5
    k_random = len(lengths)
    for shift, key in ((3, "param"), (1, "exp_avg"), (5, "exp_avg_sq"), (6, "max_exp_avg_sq")):
        sprinkle_special_values(views(state[key])[:k_random], shift=shift)
    for row in views(state["exp_avg_sq"])[:k_random][2::3]:
        row[row.numel() // 2] = -1.0

    def put_grid(t: Tensor, key: str, k: int = 0) -> None:
        rows = views(t)[k_random:]
        for g_grid in grids:
            values = g_grid[key].roll(k * 53)
            n = values.numel()
            rows[0].copy_(values)  # one segment: ATen's vector body (but its last elements)
            tails, rows = rows[1:1 + n // 15], rows[1 + n // 15:]
            for j, r in enumerate(tails):  # 15-element segments: ATen's scalar tail throughout
                r.copy_(values[15 * j:15 * j + 15])

    for key, t in state.items():
        put_grid(t, key)
    steps = [float(i % 3) for i in range(len(sizes))]

    def grad(k: int) -> Tensor:
        g = torch.randn(size, generator=torch.Generator().manual_seed(seed * 1000 + k))
        g *= 10.0 ** (k % 3 - 2)
        sprinkle_special_values(views(g)[:k_random], shift=k)
        if k == 2:
            g[::7] = 1e-40
        put_grid(g, "grad", k)
        return g

    return segments, state, steps, grad


def _bf16_value(x: float) -> float:
    """`x` as ATen turns a Python scalar into bfloat16 (to float32, then round to nearest even),
    back as a Python float."""
    f = _f32(x)
    if f != f:
        return f
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", u & 0xFFFFFFFF))[0]


def _top_bf16(t: Tensor) -> Tensor:
    """bfloat16 tensor of the top 16 bits of float32 `t` (truncation: NaN payloads survive)."""
    return (t.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _native_adamw(implementation: str, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                  steps, *, lr, beta1, beta2, eps, weight_decay, maximize, amsgrad) -> None:
    from torch.optim.adam import adam as functional_adam  # what torch.optim.AdamW.step calls

    functional_adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                    foreach=implementation == "foreach",
                    fused=implementation == "fused" or None, capturable=False, differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
                    decoupled_weight_decay=True, amsgrad=amsgrad, beta1=beta1, beta2=beta2,
                    lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)


def matches_native(*, implementation: str, lr, beta1: float, beta2: float, eps: float,
                   weight_decay: float, maximize: bool, amsgrad: bool,
                   lengths: tuple[int, ...] = PROBE_LENGTHS, steps: int = 6, seed: int = 0,
                   grid: bool = True, clip_coef: float | None = None,
                   dtype: torch.dtype = torch.float32, stress: bool = True) -> bool:
    """Probe: does `single_pass_adamw_` give native's bytes for these settings here?

    Native: `torch.optim.adam.adam` (the function `torch.optim.AdamW.step` calls, decoupled
    decay) on one separately allocated tensor per segment of `probe_data` (random lengths with
    special values sprinkled in every buffer, and the `special_grid` of special-value
    combinations in ATen's vector body and in its scalar tail; per-segment step counts differ).
    Single pass: `single_pass_adamw_lists_` on the same segments as views of flat buffers. With `clip_coef`, native first multiplies
    each segment's gradient by it as `clip_grad_norm_` does on the CPU (``g.mul_(coef)`` with
    a 0-d float32 tensor) and the single pass gets it as `clip_coef`; the clipped gradients are
    compared too. `dtype` bfloat16: every buffer holds the top 16 bits of the float32 probe
    values (so NaN payloads, subnormals and signs carry over), spread over many magnitudes; with
    `stress` the probe runs a second time with lr 0.1, eps 1e-3, beta2 0.95 and weight decay 0.5
    (where decay is on), values at which each scalar's own rounding to bfloat16 or float32 shows
    in the results (with the defaults such a difference can hide: measured). `steps` steps;
    parameters, moments and step counts compared byte for byte after every step. Returns False
    (never raises) when the kernel cannot run here, and for amsgrad under denormals-are-zero
    in the calling thread (`AMSGRAD_DAZ`).
    Runs under the current `torch.get_num_threads()`: a verdict holds for that thread count (it
    decides where native's scalar tails are), this CPU ISA and this torch build.
    """
    try:
        build()
        if implementation == "fused" and (dtype != torch.float32 or fused_vector_unit() is None):
            return False
        if implementation != "fused" and (sqrt_kind() is None or aten_vector_unit(dtype) is None):
            return False
        if amsgrad and mxcsr() & MXCSR_DAZ:
            return False  # see AMSGRAD_DAZ: and this probe's subnormals are flushed under it
    except SinglePassUnavailable:
        return False
    segments, state, start, grad = probe_data(lengths, seed, grid)
    if dtype == torch.bfloat16:
        # bfloat16 rounds coarsely: the probe must make each scalar's rounding visible, so
        # parameters and second moments span many magnitudes (updates as large as a parameter's
        # last bit; square roots near eps)
        idx = torch.arange(state["param"].numel())
        state["param"] *= torch.pow(10.0, -(idx % 5).float())
        state["exp_avg_sq"] *= torch.pow(10.0, -2.0 * (idx % 7).float())
        state = {k: _top_bf16(t) for k, t in state.items()}
        float_grad = grad
        grad = lambda k: _top_bf16(float_grad(k))  # noqa: E731
    views = lambda t: [t[o:o + n] for o, n in segments]  # noqa: E731
    keys = ["param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    native = [[t.clone() for t in views(state[k])] for k in keys]
    ours = [state[k].clone() for k in keys]
    native_steps = [torch.tensor(s) for s in start]
    ours_steps = [torch.tensor(s) for s in start]
    native_lr = lr.clone() if isinstance(lr, Tensor) else lr
    coef = None if clip_coef is None else torch.tensor(clip_coef, dtype=torch.float32)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    state_pairs = list(zip(ours[:4 if amsgrad else 3], native))
    try:
        for k in range(steps):
            g = grad(k)
            native_grads = [t.clone() for t in views(g)]
            compared = list(state_pairs)
            if coef is not None:
                for t in native_grads:  # clip_grad_norm_'s multiply (CPU: one tensor at a time)
                    t.mul_(coef)
                compared.append((g, native_grads))
            _native_adamw(implementation, native[0], native_grads, native[1],
                          native[2], native[3] if amsgrad else [], native_steps, lr=native_lr,
                          beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                          maximize=maximize, amsgrad=amsgrad)
            with torch.no_grad():
                single_pass_adamw_lists_(
                    views(ours[0]), views(g), views(ours[1]), views(ours[2]),
                    views(ours[3]) if amsgrad else [], ours_steps,
                    implementation=implementation, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad,
                    clip_coef=clip_coef)
            # after every step: a difference a later step overwrites (e.g. the sign of a zero
            # maximum) is still one a user reading the state at that step would see
            for mine, theirs in compared:
                for a, b in zip(views(mine), theirs):
                    if not torch.equal(a.view(bits), b.view(bits)):
                        return False
            if not all(a.item() == b.item() and a.dtype == b.dtype
                       for a, b in zip(native_steps, ours_steps)):
                return False
    except (SinglePassUnavailable, ValueError, TypeError):
        return False
    if dtype == torch.bfloat16 and stress:
        stress_lr = torch.tensor(0.1, dtype=lr.dtype) if isinstance(lr, Tensor) else 0.1
        return matches_native(
            implementation=implementation, lr=stress_lr, beta1=beta1, beta2=0.95, eps=1e-3,
            weight_decay=0.5 if weight_decay != 0 else 0.0, maximize=maximize, amsgrad=amsgrad,
            lengths=lengths, steps=steps, seed=seed + 1, grid=grid, clip_coef=clip_coef,
            dtype=dtype, stress=False)
    return True


# ---------------------------------------------------------------------- the gate (cotangent.AdamW)

def _probe_code() -> tuple:
    """What the single-pass verdicts' fingerprint covers (`calibration.probe_fingerprint`): the
    probe, the functions that build its inputs and run native's side, and the value grids."""
    return (matches_native, probe_data, special_grid, _native_adamw, PROBE_LENGTHS, GRID_GRAD,
            GRID_EXP_AVG, GRID_EXP_AVG_SQ, GRID_PARAM, GRID_MAX, GRID_GRAD_CLEAN,
            GRID_EXP_AVG_CLEAN, GRID_EXP_AVG_SQ_CLEAN, GRID_PARAM_CLEAN, GRID_MAX_CLEAN)


ENV_SWITCH = "COTANGENT_SINGLE_PASS"  # "0" / "off" / "false" / "no": native's op sequence
ISAS = ("AVX2", "AVX512")  # ATen CPU capabilities whose kernels the probes have met
PROBE_KIND = "adamw_single_pass"
FLT_MIN = 1.1754943508222875e-38  # smallest normal float32
FLT_MAX = 3.4028234663852886e38  # largest finite float32
MXCSR_DAZ = 0x0040  # MXCSR denormals-are-zero (torch.set_flush_denormal(True) sets it and FTZ)
# Why amsgrad runs natively under denormals-are-zero: torch.maximum(max_exp_avg_sq,
# exp_avg_sq) then keeps a subnormal operand as it is or flushes it to zero by the element's
# place in ATen's compiled loops (measured, torch 2.13.0 AVX512, one thread, a maximum
# 0x00000001 against a zero second moment: of 31 elements the first 16 and the last 3 flush it,
# the 12 between keep it; of 5, the first 4 keep it), which the kernel does not follow; and the
# probe builds its values under the caller's modes, so its subnormals are zeros there already
# (it passed while the state differed)
AMSGRAD_DAZ = ("amsgrad under denormals-are-zero (torch.set_flush_denormal): torch.maximum "
               "keeps or flushes a subnormal by the element's place in ATen's loops: native path")
_NOT_CHECKED = object()


class SinglePassWarning(UserWarning):
    """The single-pass kernel cannot run in this process: for-loop and foreach AdamW run
    native's op sequence (same bits, more passes over memory). Issued once per process."""


_UNAVAILABLE: object = _NOT_CHECKED  # None (available) or the reason, once checked
_WARNED = False
_VERDICTS: dict[tuple, bool] = {}  # verdict per key parts, this process
_PROBES = 0  # probes run by `proven` in this process (introspection and tests)
_PROBE_S = 0.0  # seconds those probes took
_SQRT_CHECK_S = 0.0  # seconds `emulation_matches` spent checking in this process (not cached)
_SQRT_CHOSEN: str | None = "not checked"  # what `sqrt_kind` chose in this process
_log = logging.getLogger("cotangent.singlepass")


def switched_on() -> bool:
    """Whether the environment allows the single pass: ``COTANGENT_SINGLE_PASS`` unset or
    anything but ``0``, ``off``, ``false``, ``no`` (read at every step)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


_FORKED = False  # this process is a fork of one that loaded the kernel's OpenMP runtime


def _after_fork_in_child() -> None:
    global _FORKED
    _FORKED = True


os.register_at_fork(after_in_child=_after_fork_in_child)

FORKED_REASON = ("a forked child process: the kernel's OpenMP runtime does not survive fork "
                 "(its thread team can hang), so native's op sequence runs here")


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None when it can: not x86-64, an ATen CPU
    capability other than `ISAS`, no C++ compiler or a failed build (`build`), no square root
    with `torch.sqrt`'s bits (`sqrt_kind`), an unknown vector body / scalar tail split
    (`aten_vector_unit`), a forked child (`FORKED_REASON`). Checked once per process (building
    the kernel on first use); the first time it finds a reason it issues one
    `SinglePassWarning`."""
    global _UNAVAILABLE, _WARNED
    if _FORKED:
        return FORKED_REASON  # (no warning: the parent's choice, the same bits)
    if _UNAVAILABLE is _NOT_CHECKED:
        reason = None
        capability = torch.backends.cpu.get_cpu_capability()
        if platform.machine().lower() not in ("x86_64", "amd64"):
            reason = f"x86-64 only, this machine is {platform.machine()}"
        elif capability not in ISAS:
            reason = f"ATen runs its {capability} CPU kernels here (probed: {', '.join(ISAS)})"
        else:
            try:
                build()
                if sqrt_kind() is None:
                    reason = "no square root here reproduces torch.sqrt's bits"
                elif aten_vector_unit() is None:
                    reason = "ATen's vector body / scalar tail split is not the known one"
                else:
                    tensorlists.reader()  # (built now: its cost is not a probe's; optional)
            except SinglePassUnavailable as e:
                reason = str(e)
        _UNAVAILABLE = reason
    reason = _UNAVAILABLE
    if reason is not None and not _WARNED:
        _WARNED = True
        warnings.warn(
            f"cotangent: the single-pass AdamW kernel is unavailable ({reason}); for-loop, "
            "foreach and fused AdamW run native's calls instead (the same bits, more "
            f"passes over memory). Set {ENV_SWITCH}=0 to choose that path and silence this.",
            SinglePassWarning, stacklevel=3)
    return reason  # type: ignore[return-value]


def static_refusal(kind: str, device: torch.device, dtype: torch.dtype,
                   group: dict) -> str | None:
    """Why a call of implementation `kind` over a (device, dtype) list for param group `group`
    can never take the single pass (None when it may, subject to `decide` at each step): an
    unknown implementation, fused AdamW over bfloat16, a device other than the CPU, a dtype
    other than float32 or bfloat16, coupled
    (L2) weight decay, capturable or differentiable."""
    if kind not in KINDS:
        return f"{kind} AdamW runs natively (the single pass reproduces for-loop, foreach, fused)"
    if device.type != "cpu":
        return f"{device.type} buffers run natively (the single pass is a CPU kernel)"
    if dtype not in DTYPES:
        return (f"{str(dtype).removeprefix('torch.')} buffers run natively (float32 and "
                f"bfloat16 only)")
    if kind == "fused" and dtype != torch.float32:
        return "fused AdamW over bfloat16 runs natively (the single pass has its float32 bits)"
    if not group.get("decoupled_weight_decay", True):
        return "coupled (L2) weight decay runs natively"
    if group.get("capturable") or group.get("differentiable"):
        return "capturable / differentiable groups run natively"
    return None


def _f32(x: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def scalar_class(x: float) -> str:
    """The IEEE class of `x` rounded to float32 (as ATen receives a Python scalar): "nan",
    "+inf"/"-inf", "+0"/"-0", "+sub"/"-sub" (subnormal) or "+"/"-" (normal)."""
    f = _f32(float(x))
    if f != f:
        return "nan"
    sign = "-" if math.copysign(1.0, f) < 0 else "+"
    if math.isinf(f):
        return sign + "inf"
    if f == 0:
        return sign + "0"
    return sign + ("sub" if abs(f) < FLT_MIN else "")


def lerp_branch(beta1: float) -> str:
    """Which of ATen's lerp formulas `exp_avg.lerp_(grad, 1 - beta1)` takes: "small" weight
    (``|w| < 0.5``), "one" (``w == 1``, beta1 = 0: body and tail differ in zero signs) or
    "large"."""
    w = _f32(1 - beta1)
    return "small" if abs(w) < 0.5 else ("one" if w == 1.0 else "large")


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


def key_parts(kind: str, group: dict, clip_coef: float | None = None,
              dtype: torch.dtype = torch.float32, team_now=None) -> tuple | str:
    """The parts of the calibration key of a single-pass verdict for a call of implementation
    `kind` with `group`'s hyperparameters as they are now, or the reason the single pass cannot
    take them (tensor betas, a tensor lr off the CPU or with foreach, a non-numeric scalar).

    Parts: implementation, dtype, amsgrad, maximize, decay on/off, the lr kind (float, or the
    tensor's dtype and dimensions), lerp branch (`lerp_branch`), the float32 IEEE class
    (`scalar_class`) of lr, ``1 - lr * weight_decay``, ``1 - beta1``, beta2, ``1 - beta2`` and
    eps, the square root (`sqrt_kind`), ATen's vector unit, the kernel build's hash and the MXCSR
    modes, and whether the clip multiply joins the pass (with its coefficient's class: "clip+",
    "clip+0", "clipnan", ...; or "noclip"); `calibration.full_key` adds the CPU capability,
    torch version and thread count. `team_now`: a function returning `team()` now (a caller
    deciding several calls at one step asks the OpenMP team once); default `team`. The
    values themselves are not in the key: the kernel has no branch on them beyond these (the
    scalars are rounded to float32 once, as ATen rounds them), so an lr schedule does not probe
    at every step, while an edit that changes a branch or a class does."""
    beta1, beta2 = group["betas"]
    if isinstance(beta1, Tensor) or isinstance(beta2, Tensor):
        return "tensor betas run natively (another ATen lerp kernel)"
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    if isinstance(lr, Tensor):
        if kind == "foreach":
            return "a tensor lr with foreach runs natively (native refuses it)"
        if kind == "fused":
            return "a tensor lr with fused runs natively"
        if lr.device.type != "cpu" or lr.numel() != 1 or not lr.is_floating_point():
            return "a tensor lr that is not one floating-point CPU value runs natively"
        lr_kind = f"tensor-{str(lr.dtype).removeprefix('torch.')}-{lr.dim()}d"
    else:
        lr_kind = "float"
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool)
               for x in (beta1, beta2, wd, eps)) or not (
                   isinstance(lr, Tensor) or isinstance(lr, (int, float))):
        return "non-numeric hyperparameters run natively"
    if clip_coef is not None and clip_coef != clip_coef:
        return "a NaN clip coefficient: the clip multiply runs apart"
    if dtype == torch.bfloat16 and group["amsgrad"]:
        return "bfloat16 with amsgrad runs natively (its torch.maximum is not reproduced)"
    if dtype == torch.bfloat16 and clip_coef is not None:
        return "bfloat16: the clip multiply runs apart"
    size, modes = (team_now or team)()
    if size < 1:
        return "the OpenMP runtime may resize thread teams (OMP_DYNAMIC): native path"
    if len(set(modes)) > 1:  # member 0 is the calling thread (the team's master)
        return ("threads compute under different float modes (set_flush_denormal after the "
                "thread pool started): native path")
    if modes[0] & 0x1F80 != 0x1F80:
        return ("unmasked floating-point exceptions (the kernel's operations could trap where "
                "native's do not): native path")
    if group["amsgrad"] and modes[0] & MXCSR_DAZ:
        return AMSGRAD_DAZ
    lr_value = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
    decay = _scalar(1 - lr * wd) if wd != 0 else 1.0
    return (kind, str(dtype).removeprefix("torch."), "amsgrad" if group["amsgrad"] else "-",
            "maximize" if group["maximize"] else "-", "decay" if wd != 0 else "-", lr_kind,
            lerp_branch(beta1), "lr" + scalar_class(lr_value), "decay" + scalar_class(decay),
            "w" + scalar_class(1 - beta1), "b2" + scalar_class(beta2),
            "v2" + scalar_class(1 - beta2), "eps" + scalar_class(eps),
            "sqrt-" + ("hardware" if dtype == torch.bfloat16 or kind == "fused"
                       else str(sqrt_kind())),
            f"unit{fused_vector_unit() if kind == 'fused' else aten_vector_unit(dtype)}",
            f"build-{build().key}", f"mxcsr{modes[0]:#x}",
            f"team{size}",
            "noclip" if clip_coef is None else "clip" + scalar_class(clip_coef))


def proven(kind: str, group: dict, parts: tuple, clip_coef: float | None = None,
           dtype: torch.dtype = torch.float32) -> bool:
    """The verdict for `parts` (`key_parts(kind, group, clip_coef)`): from this process, the
    calibration cache file, or a new `matches_native` probe with `group`'s own hyperparameters
    and `clip_coef` (about 50 ms
    on a 2-core CPU), recorded like every other probe. A probe that raises gives False (kept
    in memory only)."""
    global _PROBES, _PROBE_S
    memo = parts + (torch.get_num_threads(),)
    verdict = _VERDICTS.get(memo)
    if verdict is not None:
        return verdict
    key = calibration.full_key(PROBE_KIND, "cpu", parts, probe=_probe_code())
    verdict = calibration.lookup(key)
    if verdict is None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        _PROBES += 1
        t0 = time.perf_counter()
        try:
            verdict = matches_native(
                implementation=kind, lr=lr.clone() if isinstance(lr, Tensor) else lr,
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                maximize=bool(group["maximize"]), amsgrad=bool(group["amsgrad"]),
                clip_coef=clip_coef, dtype=dtype)
            calibration.record(key, verdict)
        except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
            _log.info("single-pass probe raised for %s: %r", key, e)
            verdict = False
        finally:
            _PROBE_S += time.perf_counter() - t0
        if not verdict:
            _log.info("single-pass AdamW does not match native for %s: native path", key)
    _VERDICTS[memo] = verdict
    return verdict


def forget_verdicts() -> None:
    """Drop this process's memo of verdicts: the next `proven` reads the calibration cache
    (or probes) again, and so does the square root's choice (`sqrt_kind`). For
    `cotangent calibrate`, which lists the verdicts a layout uses."""
    _VERDICTS.clear()
    sqrt_kind.cache_clear()


def process_report() -> dict:
    """What the single pass cost and found in this process, for benchmarks and logs (the one-off
    costs kept apart from per-step times): ``unavailable_reason`` (None when it can run, or why
    not; "not checked" before any for-loop/foreach float32 CPU step asked), ``build`` (None before
    a build, else compiler, cached (loaded from the on-disk cache of an earlier process),
    compile_s (0.0 when cached), key (the build hash), flags), ``probes`` (`matches_native`
    probes run here), ``probe_s`` (their seconds), ``square_root`` (`sqrt_kind`'s choice, or
    "not checked") and ``sqrt_check_s`` (seconds `emulation_matches` checked here; 0.0 when its
    verdict came from the calibration cache), ``list_reader`` (`cotangent.tensorlists`: None
    before any list was read, else available, cached, compile_s and why_not)."""
    reason = "not checked" if _UNAVAILABLE is _NOT_CHECKED else _UNAVAILABLE
    b = _BUILD
    return dict(unavailable_reason=reason, list_reader=tensorlists.report(),
                build=None if b is None else dict(compiler=b.compiler, cached=b.cached,
                                                  compile_s=b.compile_s, key=b.key,
                                                  flags=list(compile_flags())),
                probes=_PROBES, probe_s=_PROBE_S, square_root=_SQRT_CHOSEN,
                sqrt_check_s=_SQRT_CHECK_S)


def decide(kind: str, group: dict, clip_coef: float | None = None,
           dtype: torch.dtype = torch.float32, team_now=None) -> str | None:
    """None when a for-loop, foreach or fused call (CPU; see `static_refusal`) with `group`'s
    hyperparameters as they are now (and the clip multiply by `clip_coef` joined to it, when
    given) may take the single pass; otherwise why not: switched off
    by ``COTANGENT_SINGLE_PASS=0``, the kernel unavailable (`unavailable_reason`, warned once),
    hyperparameters it does not take (`key_parts`), or a failed probe (`proven`)."""
    if not switched_on():
        return f"off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)})"
    reason = unavailable_reason()
    if reason is not None:
        return f"unavailable: {reason}"
    parts = key_parts(kind, group, clip_coef, dtype, team_now)
    if isinstance(parts, str):
        return parts
    if not proven(kind, group, parts, clip_coef, dtype):
        return "the probe found other bytes than native for these settings: native path"
    return None
