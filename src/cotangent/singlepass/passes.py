"""Running the single pass: over flat buffers (`single_pass_adamw_`), over tensor lists
(`single_pass_adamw_lists_`, `launch` of a `Prepared` table), and the clip's per-tensor 2-norms
in one C call (`tensor_norms`, `gradient_norms`).
"""

from __future__ import annotations

import array
import math

import torch
from torch import Tensor

from cotangent import _compat
from cotangent.singlepass import kernel, lists, probes, work


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
        if not isinstance(t, Tensor) or t.device.type != "cpu" or t.dtype not in kernel.DTYPES or (
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
    if implementation not in kernel.KINDS:
        raise ValueError(f"implementation must be one of {kernel.KINDS}, not {implementation!r}")
    if isinstance(beta1, Tensor) or isinstance(beta2, Tensor):
        raise ValueError("single-pass AdamW takes float betas (a tensor beta takes another "
                         "ATen kernel)")
    if isinstance(lr, Tensor) and implementation == "foreach":
        raise ValueError("native foreach AdamW refuses a tensor lr without capturable=True")
    if isinstance(lr, Tensor) and implementation == "fused":
        raise ValueError("a tensor lr with fused AdamW: native path")
    if clip_coef is not None and not (isinstance(clip_coef, float)
                                      and kernel._f32(clip_coef) == clip_coef):
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
    prepared = lists.prepare_lists(params, grads, exp_avgs, exp_avg_sqs,
                             max_exp_avg_sqs if amsgrad else None, steps)
    if not prepared.numels:
        return
    if not (prepared.disjoint if prepared.disjoint is not None else lists.spans_disjoint(
            *prepared.spans())):
        raise ValueError("single-pass AdamW needs tensors that do not share memory")
    launch(prepared, implementation=implementation, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
           weight_decay=weight_decay, maximize=maximize, amsgrad=amsgrad, threads=threads,
           clip_coef=clip_coef)


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
    return norms_at(list(map(lists._DATA_PTR, tensors)), list(map(Tensor.numel, tensors)))


def norms_at(addresses: list[int], numels) -> Tensor:
    """`tensor_norms` of the contiguous float32 tensors whose first elements are at
    `addresses` and whose lengths are `numels` (a call's checked gradients: `gradient_norms`,
    which reads them from its table)."""
    ptrs, lengths = _int64s(addresses), _int64s(list(numels))
    out = torch.empty(len(ptrs), dtype=torch.float32, device="cpu")
    kernel._lib().cot_singlepass_norms(_address(ptrs), _address(lengths), len(ptrs),
                                       out.data_ptr(), torch.get_num_threads())
    return out


def gradient_norms(prepared: lists.Prepared) -> Tensor:
    """`tensor_norms` of the gradients of `prepared` (its second row of addresses), read from
    its table without a list."""
    n = len(prepared.numels)
    out = torch.empty(n, dtype=torch.float32, device="cpu")
    if n:
        kernel._lib().cot_singlepass_norms(prepared.row(1), prepared.row(prepared.kinds + 1), n,
                                    out.data_ptr(), torch.get_num_threads())
    return out


def gradient_norms_team(prepared: lists.Prepared) -> tuple[Tensor, tuple[int, tuple[int, ...]]]:
    """`gradient_norms` of `prepared`, and the OpenMP team that computed them, as
    `kernel.team` reports one ((size, each member's MXCSR fields); size -1 where the runtime
    may resize teams), from one parallel region."""
    n = len(prepared.numels)
    threads = torch.get_num_threads()
    out = torch.empty(n, dtype=torch.float32, device="cpu")
    team = array.array("i", bytes(4 * (threads + 1)))
    kernel._lib().cot_singlepass_norms_team(prepared.row(1), prepared.row(prepared.kinds + 1), n,
                                            out.data_ptr(), threads, _address(team))
    size = team[0]
    return out, (size, tuple(x & 0xFFC0 for x in team[1:1 + max(size, 0)]))


def clip_scalars(norms: Tensor, max_norm: float) -> tuple[Tensor, Tensor, float]:
    """``clip_grad_norm_``'s total norm and clip coefficient from the per-tensor 2-norms
    `norms` (a contiguous float32 CPU tensor of shape (n,), in clip order), computed in C with
    the bits of its ATen calls (``linalg.vector_norm`` of the stack; ``clamp(max_norm / (total
    + 1e-6), max=1.0)``, where ``max_norm / tensor`` is a reciprocal then a multiply): (total,
    coef) as 0-d float32 tensors of their own and the coefficient's value as a float. Use it
    only where `norms_proven` holds (its probe compares these too)."""
    total = torch.empty((), dtype=torch.float32, device="cpu")
    coef = torch.empty((), dtype=torch.float32, device="cpu")
    kernel._lib().cot_singlepass_clip_scalars(norms.data_ptr(), norms.numel(), float(max_norm),
                                              total.data_ptr(), coef.data_ptr())
    return total, coef, coef.item()


def launch(prepared: lists.Prepared, *, implementation: str, lr, beta1: float, beta2: float,
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
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
            amsgrad=amsgrad, threads=threads, clip_coef=clip_coef)


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
        step_dtypes = {steps.dtype} if isinstance(steps, Tensor) else set(map(lists._DTYPE, steps))
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
    lib = kernel._lib()
    # bfloat16 sqrt: float hardware sqrt, rounded; fused: Vectorized<float>::sqrt and std::sqrt
    sq = "hardware" if bf16 or fused else kernel.sqrt_kind()
    if sq is None:
        raise kernel.SinglePassUnavailable("no square root here reproduces torch.sqrt's bits")
    unit = work.fused_vector_unit() if fused else work.aten_vector_unit(dtype)
    if unit is None:
        raise kernel.SinglePassUnavailable(
            "ATen's vector body / scalar tail split is unknown here")
    decay = 1 - lr * weight_decay if weight_decay != 0 else 1.0
    scalars = [_scalar(decay), 1 - beta1, beta2, 1 - beta2, eps]
    if any(s != s for s in scalars):
        raise ValueError("a NaN hyperparameter: not reproduced by the single pass")
    if bf16:
        # which scalars ATen rounds to bfloat16 first (measured, torch 2.13.0 CPU): add_ (eps)
        # always; _foreach_mul_ (the decay, beta2) too, where mul_ keeps them float
        scalars[4] = probes._bf16_value(scalars[4])
        if implementation == "foreach":
            scalars[0], scalars[2] = probes._bf16_value(scalars[0]), probes._bf16_value(scalars[2])
    # native: step_t += 1 (in the step tensor's dtype), then the scalars from step_t.item();
    # float32 step tensors (native's own) are read and incremented in C
    in_c = step_row is not None and step_dtypes == {torch.float32}
    if in_c:
        stepped_c = array.array("d", bytes(8 * len(numels)))
        kernel._lib().cot_singlepass_steps(step_row, len(numels), _address(stepped_c), 0)
        stepped = stepped_c.tolist()
    else:
        stepped = _step_values(steps)
    by_step = {t: native_step_scalars(t, implementation=implementation, lr=lr, beta1=beta1,
                                      beta2=beta2) for t in set(stepped)}
    distinct = by_step.values()  # the checks need each distinct pair once (usually one)
    if any(a != a or b != b for a, b in distinct):
        raise ValueError("a NaN step size: not reproduced by the single pass")
    # ATen converts each scalar with c10::Scalar::to<float>(), which raises for a finite value
    # beyond float32 (e.g. lr / (1 - beta1**step) > 3.4e38): native raises, so refuse
    if any(math.isfinite(x) and abs(x) > kernel.FLT_MAX
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
        threads = kernel.team()[0]
        if threads < 1:
            raise kernel.SinglePassUnavailable(
                "OpenMP may resize thread teams (OMP_DYNAMIC): ATen's chunks are unknown")
    pieces = (work._fused_pieces(numels, threads, unit) if fused
              else work._pieces(numels, threads, unit, True))
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
        None if fused else kernel.sqrt_address(sq), kernel.MKL_SQRT_MODE, torch.get_num_threads(),
        0.0 if clip_coef is None else clip_coef)
