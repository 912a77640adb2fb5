"""Whether a call may take the single pass now: `decide` (switched on, the kernel available,
hyperparameters it takes, a probe passed for the verdict key `key_parts`, cached in memory and
in the calibration file like every probe), `norms_proven` for the norms, `process_report`.
"""

from __future__ import annotations

import math
import os
import platform
import struct
import time
import warnings

import torch
from torch import Tensor

from cotangent import _compat, calibration, merge, tensorlists
from cotangent.singlepass import kernel, passes, probes, work


NORM_PROBE_KIND = "singlepass_norm"


def norms_proven(team_now=None, step: Step | None = None) -> bool:
    """Whether the per-tensor 2-norms may come from `tensor_norms` now: the single pass is
    switched on and available (`off_reason`; `step`'s, read once per step, where given), the
    OpenMP team computes under one set of float modes with exceptions masked, and a
    `norms_match_native` probe passed for this build, float modes and thread count (cached in
    memory and in the calibration file like every probe)."""
    if (off_reason() if step is None else step.off()) is not None:
        return False
    size, modes = (team_now or kernel.team)()
    if size < 1 or len(set(modes)) > 1 or modes[0] & 0x1F80 != 0x1F80:
        return False
    memo = (NORM_PROBE_KIND, size, modes[0], torch.get_num_threads())
    verdict = _VERDICTS.get(memo)
    if verdict is None:
        parts = (f"build-{kernel.build().key}", f"mxcsr{modes[0]:#x}", f"team{size}")
        key = calibration.full_key(NORM_PROBE_KIND, "cpu", parts,
                                   probe=(probes.norms_match_native, probes.norm_probe_tensors))
        verdict = _run_probe(key, probes.norms_match_native)
        if not verdict:
            kernel._log.info("the kernel's norms differ from native's for %s: native norms", key)
        _VERDICTS[memo] = verdict
    return verdict


ENV_SWITCH = "COTANGENT_SINGLE_PASS"  # "0" / "off" / "false" / "no": native's op sequence
ISAS = ("AVX2", "AVX512")  # ATen CPU capabilities whose kernels the probes have met
PROBE_KIND = "adamw_single_pass"
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


def switched_on() -> bool:
    """Whether the single pass (and the kernel's norms) may run now: ``COTANGENT_SINGLE_PASS``
    unset or anything but ``0``, ``off``, ``false``, ``no`` (read at every step), and no
    `TorchFunctionMode` or `TorchDispatchMode` active (`_compat.torch_modes_active`: native's
    ops run through its code, which the pass would skip)."""
    return (os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")
            and not _compat.torch_modes_active())


def unavailable_reason() -> str | None:
    """Why the kernel cannot run in this process, or None when it can: not x86-64, an ATen CPU
    capability other than `ISAS`, no C++ compiler or a failed build (`build`), no square root
    with `torch.sqrt`'s bits (`sqrt_kind`), an unknown vector body / scalar tail split
    (`aten_vector_unit`), a forked child (`FORKED_REASON`). Checked once per process (building
    the kernel on first use); the first time it finds a reason it issues one
    `SinglePassWarning`."""
    global _UNAVAILABLE, _WARNED
    if kernel._FORKED:
        return kernel.FORKED_REASON  # (no warning: the parent's choice, the same bits)
    if _UNAVAILABLE is _NOT_CHECKED:
        reason = None
        capability = torch.backends.cpu.get_cpu_capability()
        if platform.machine().lower() not in ("x86_64", "amd64"):
            reason = f"x86-64 only, this machine is {platform.machine()}"
        elif capability not in ISAS:
            reason = f"ATen runs its {capability} CPU kernels here (probed: {', '.join(ISAS)})"
        else:
            try:
                kernel.build()
                if kernel.sqrt_kind() is None:
                    reason = "no square root here reproduces torch.sqrt's bits"
                elif work.aten_vector_unit() is None:
                    reason = "ATen's vector body / scalar tail split is not the known one"
                else:
                    tensorlists.reader()  # (built now: its cost is not a probe's; optional)
            except kernel.SinglePassUnavailable as e:
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
    other than float32 or bfloat16, coupled (L2) weight decay, capturable or differentiable,
    a fused call whose maximize or amsgrad is not a bool (native's fused kernel refuses it)."""
    if kind not in kernel.KINDS:
        return f"{kind} AdamW runs natively (the single pass reproduces for-loop, foreach, fused)"
    if device.type != "cpu":
        return f"{device.type} buffers run natively (the single pass is a CPU kernel)"
    if dtype not in kernel.DTYPES:
        return (f"{str(dtype).removeprefix('torch.')} buffers run natively (float32 and "
                f"bfloat16 only)")
    if kind == "fused" and dtype != torch.float32:
        return "fused AdamW over bfloat16 runs natively (the single pass has its float32 bits)"
    if kind == "fused" and not merge.fused_flags_accepted(group):
        return ("fused AdamW with a maximize or amsgrad that is not a bool runs natively "
                "(native's fused kernel takes bools only: its error)")
    if not group.get("decoupled_weight_decay", True):
        return "coupled (L2) weight decay runs natively"
    if group.get("capturable") or group.get("differentiable"):
        return "capturable / differentiable groups run natively"
    return None


def scalar_class(x: float) -> str:
    """The IEEE class of `x` rounded to float32 (as ATen receives a Python scalar): "nan",
    "+inf"/"-inf", "+0"/"-0", "+sub"/"-sub" (subnormal) or "+"/"-" (normal)."""
    f = kernel._f32(float(x))
    if f != f:
        return "nan"
    sign = "-" if math.copysign(1.0, f) < 0 else "+"
    if math.isinf(f):
        return sign + "inf"
    if f == 0:
        return sign + "0"
    return sign + ("sub" if abs(f) < kernel.FLT_MIN else "")


def lerp_branch(beta1: float) -> str:
    """Which of ATen's lerp formulas `exp_avg.lerp_(grad, 1 - beta1)` takes: "small" weight
    (``|w| < 0.5``), "one" (``w == 1``, beta1 = 0: body and tail differ in zero signs) or
    "large"."""
    w = kernel._f32(1 - beta1)
    return "small" if abs(w) < 0.5 else ("one" if w == 1.0 else "large")


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
    size, modes = (team_now or kernel.team)()
    if size < 1:
        return "the OpenMP runtime may resize thread teams (OMP_DYNAMIC): native path"
    if len(set(modes)) > 1:  # member 0 is the calling thread (the team's master)
        return ("threads compute under different float modes (set_flush_denormal after the "
                "thread pool started): native path")
    if modes[0] & 0x1F80 != 0x1F80:
        return ("unmasked floating-point exceptions (the kernel's operations could trap where "
                "native's do not): native path")
    if group["amsgrad"] and modes[0] & kernel.MXCSR_DAZ:
        return AMSGRAD_DAZ
    lr_value = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
    decay = passes._scalar(1 - lr * wd) if wd != 0 else 1.0
    return (kind, str(dtype).removeprefix("torch."), "amsgrad" if group["amsgrad"] else "-",
            "maximize" if group["maximize"] else "-", "decay" if wd != 0 else "-", lr_kind,
            lerp_branch(beta1), "lr" + scalar_class(lr_value), "decay" + scalar_class(decay),
            "w" + scalar_class(1 - beta1), "b2" + scalar_class(beta2),
            "v2" + scalar_class(1 - beta2), "eps" + scalar_class(eps),
            "sqrt-" + ("hardware" if dtype == torch.bfloat16 or kind == "fused"
                       else str(kernel.sqrt_kind())),
            f"unit{work.fused_vector_unit() if kind == 'fused' else work.aten_vector_unit(dtype)}",
            f"build-{kernel.build().key}", f"mxcsr{modes[0]:#x}",
            f"team{size}",
            "noclip" if clip_coef is None else "clip" + scalar_class(clip_coef))


def proven(kind: str, group: dict, parts: tuple, clip_coef: float | None = None,
           dtype: torch.dtype = torch.float32) -> bool:
    """The verdict for `parts` (`key_parts(kind, group, clip_coef)`): from this process, the
    calibration cache file, or a new `matches_native` probe with `group`'s own hyperparameters
    and `clip_coef` (about 50 ms
    on a 2-core CPU), recorded like every other probe. A probe that raises gives False (kept
    in memory only)."""
    memo = parts + (torch.get_num_threads(),)
    verdict = _VERDICTS.get(memo)
    if verdict is not None:
        return verdict
    key = calibration.full_key(PROBE_KIND, "cpu", parts, probe=probes._probe_code())
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    verdict = _run_probe(key, lambda: probes.matches_native(
        implementation=kind, lr=lr.clone() if isinstance(lr, Tensor) else lr,
        beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        maximize=bool(group["maximize"]), amsgrad=bool(group["amsgrad"]),
        clip_coef=clip_coef, dtype=dtype))
    if not verdict:
        kernel._log.info("single-pass AdamW does not match native for %s: native path", key)
    _VERDICTS[memo] = verdict
    return verdict


def _run_probe(key: str, run) -> bool:
    """`calibration.verdict(key, run)`, the probe counted in `_PROBES` and timed in `_PROBE_S`
    when it runs; a probe that raises proves nothing: False, kept in memory only (logged)."""
    def counted() -> bool | None:
        global _PROBES, _PROBE_S
        _PROBES += 1
        t0 = time.perf_counter()
        try:
            return run()
        except Exception as e:  # noqa: BLE001 - a probe that cannot run proves nothing
            kernel._log.info("single-pass probe raised for %s: %r", key, e)
            return None
        finally:
            _PROBE_S += time.perf_counter() - t0

    return calibration.verdict(key, counted)


GENERATION = 0  # counts `forget_verdicts` calls: plans made under older verdicts are void


def forget_verdicts() -> None:
    """Drop this process's memo of verdicts: the next `proven` reads the calibration cache
    (or probes) again, and so does the square root's choice (`sqrt_kind`). For
    `cotangent calibrate`, which lists the verdicts a layout uses."""
    global GENERATION
    GENERATION += 1
    _VERDICTS.clear()
    _KEY_PARTS.clear()
    kernel.sqrt_kind.cache_clear()


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
    b = kernel._BUILD
    return dict(unavailable_reason=reason, list_reader=tensorlists.report(),
                build=None if b is None else dict(compiler=b.compiler, cached=b.cached,
                                                  compile_s=b.compile_s, key=b.key,
                                                  flags=list(kernel.compile_flags())),
                probes=_PROBES, probe_s=_PROBE_S, square_root=kernel._SQRT_CHOSEN,
                sqrt_check_s=kernel._SQRT_CHECK_S)


def off_reason() -> str | None:
    """Why neither the single pass nor the kernel's norms may run now, or None: switched off by
    ``COTANGENT_SINGLE_PASS=0``, a torch mode active (`switched_on`), the kernel unavailable
    (`unavailable_reason`, warned once)."""
    if not switched_on():
        if _compat.torch_modes_active():
            return ("a TorchFunctionMode or TorchDispatchMode is active (its code sees "
                    "native's ops): native path")
        return f"off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)})"
    reason = unavailable_reason()
    return None if reason is None else f"unavailable: {reason}"


_UNREAD = object()


class Step:
    """One optimizer step's OpenMP team, `off_reason` and single-pass verdicts, each asked once
    (no user code runs between a step's decisions and its passes): the team is read by the
    first of `team()` and `gradient_norms()`, the latter reading it in the norms' own parallel
    region."""

    __slots__ = ("_team", "_verdicts", "_off")

    def __init__(self) -> None:
        self._team: tuple | None = None
        self._verdicts: dict = {}
        self._off = _UNREAD

    def off(self) -> str | None:
        """`off_reason()`, read once per step."""
        if self._off is _UNREAD:
            self._off = off_reason()
        return self._off

    def team(self) -> tuple[int, tuple[int, ...]]:
        """`kernel.team()`: (team size, each member's MXCSR fields)."""
        if self._team is None:
            self._team = kernel.team()
        return self._team

    def flushing(self) -> bool | None:
        """`kernel.flushing_now()`: whether the calling thread flushes subnormals (FTZ or DAZ),
        from the team's member 0 (the calling thread) where the team was read this step."""
        if self._team is not None and self._team[0] >= 1:
            return bool(self._team[1][0] & 0x8040)
        return kernel.flushing_now()

    def gradient_norms(self, prepared) -> Tensor:
        """`passes.gradient_norms(prepared)`; the step's first question to the team is
        answered by the region that computes them (`passes.gradient_norms_team`)."""
        if self._team is not None:
            return passes.gradient_norms(prepared)
        norms, self._team = passes.gradient_norms_team(prepared)
        return norms

    def decide(self, kind: str, group: dict, clip_coef: float | None,
               dtype: torch.dtype) -> str | None:
        """`decide` for a call of `kind` over `group`'s parameters of `dtype` this step."""
        key = (kind, id(group), clip_coef, dtype)
        if key not in self._verdicts:
            off = self.off()
            self._verdicts[key] = off if off is not None else decide_remembered(
                kind, group, clip_coef, dtype, self.team)
        return self._verdicts[key]


def decide_remembered(kind: str, group: dict, clip_coef: float | None, dtype: torch.dtype,
                      team_now) -> str | None:
    """`decide` where `off_reason` is None, with `key_parts` remembered for the group's exact
    hyperparameters when they are Python numbers (their bytes: -0.0 is not 0.0), the clip
    coefficient's class, the team, the thread count and the kernel build (a dict lookup where
    `key_parts` costs about twenty Python steps at every step); a tensor hyperparameter's
    parts are read afresh. The verdict itself is `proven`'s, as in `decide`."""
    try:
        beta1, beta2 = group["betas"]
        numbers = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"])
    except (TypeError, ValueError):
        numbers = None
    build = kernel._BUILD
    if numbers is None or build is None or not all(
            type(x) is float or type(x) is int for x in numbers):
        return decide(kind, group, clip_coef, dtype, team_now, checked=True)
    memo = (kind, dtype, struct.pack("5d", *numbers), bool(group["amsgrad"]),
            bool(group["maximize"]), None if clip_coef is None else scalar_class(clip_coef),
            team_now(), torch.get_num_threads(), build.key, kernel._MUTANT)
    parts = _KEY_PARTS.get(memo)
    if parts is None:
        if len(_KEY_PARTS) > 4096:
            _KEY_PARTS.clear()
        parts = _KEY_PARTS[memo] = key_parts(kind, group, clip_coef, dtype, team_now)
    return verdict_for(kind, group, parts, clip_coef, dtype)


_KEY_PARTS: dict = {}  # `decide_remembered`'s memo of `key_parts`


def decide(kind: str, group: dict, clip_coef: float | None = None,
           dtype: torch.dtype = torch.float32, team_now=None, *,
           checked: bool = False) -> str | None:
    """None when a for-loop, foreach or fused call (CPU; see `static_refusal`) with `group`'s
    hyperparameters as they are now (and the clip multiply by `clip_coef` joined to it, when
    given) may take the single pass; otherwise why not: switched off or unavailable
    (`off_reason`; `checked`: the caller found it None this step), hyperparameters it does not
    take (`key_parts`), or a failed probe (`proven`)."""
    reason = None if checked else off_reason()
    if reason is not None:
        return reason
    return verdict_for(kind, group, key_parts(kind, group, clip_coef, dtype, team_now),
                       clip_coef, dtype)


def verdict_for(kind: str, group: dict, parts: tuple | str, clip_coef: float | None,
                dtype: torch.dtype) -> str | None:
    """`decide`'s answer for `key_parts`' result `parts`: its reason, or `proven`'s verdict."""
    if isinstance(parts, str):
        return parts
    if not proven(kind, group, parts, clip_coef, dtype):
        return "the probe found other bytes than native for these settings: native path"
    return None
