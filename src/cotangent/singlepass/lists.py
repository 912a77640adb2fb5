"""Preparing a single pass over tensor lists: `prepare_lists` checks a call's parameters,
gradients and state (dense, the parameter's dtype and shape, on the CPU; distinct 0-d steps)
and reads their addresses into a `Prepared` table, modifying nothing.
"""

from __future__ import annotations

import array
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from operator import attrgetter, is_

import torch
from torch import Tensor

from cotangent import _compat, tensorlists
from cotangent.spans import is_dense_non_overlapping, overlapping_pair
from cotangent.singlepass import kernel, passes


@dataclass(slots=True)
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


def read_group(params: list[Tensor], state: dict, amsgrad: bool) -> tuple | None:
    """One param group's AdamW lists, as native's ``_init_group`` reads them for a group
    whose parameters all have state: the parameters with a gradient, in group order, their
    gradients, ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq`` with `amsgrad`) and ``step``,
    read and checked in one C++ loop (`cotangent.tensorlists.group_reader`); modifies nothing.

    Returns None (the caller reads the group in Python, which is the reference and raises
    native's errors, and warns where native reads a non-leaf's ``.grad``) unless every
    parameter is a plain CPU leaf tensor and every one with a gradient is dense, contiguous,
    of one dtype, its gradient one too, of its dtype and shape, each gradient a tensor of its
    own, and whose state holds plain tensors of its dtype and shape and a step tensor of its
    own (0-d, CPU); always None where the compiled reader is unavailable or a torch mode is
    active (`_compat.torch_modes_active`). Else ``(pos, params, grads, exp_avgs, exp_avg_sqs,
    max_exp_avg_sqs, steps, prepared)``: each parameter's index in `params`, the lists
    (``max_exp_avg_sqs`` empty without `amsgrad`), and the `Prepared` table of their addresses
    (contiguous, `Prepared.disjoint` read).
    """
    read = tensorlists.group_reader()
    if (read is None or type(params) is not list or type(state) not in (dict, defaultdict)
            or _compat.torch_modes_active()):  # (a mode sees native's `.grad` reads)
        return None
    got = read(params, state, amsgrad, torch.is_grad_enabled())
    if got is None:
        return None
    flags, pos, ps, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, raw = got
    table = array.array("q")
    table.frombytes(raw)
    kinds, n = 5 if amsgrad else 4, len(pos)
    prepared = Prepared(ps[0].dtype if n else torch.float32, table, kinds,
                        tuple(table[(kinds + 1) * n:]), steps, bool(flags & 2),
                        contiguous=True, disjoint=bool(flags & 4))
    return pos, ps, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, prepared


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
    if dtype not in kernel.DTYPES:
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
        lib = kernel._lib()
    except kernel.SinglePassUnavailable:
        return overlapping_pair(starts, nbytes) is None
    a, b = passes._int64s(starts), passes._int64s(nbytes)
    return bool(lib.cot_singlepass_disjoint(passes._address(a), passes._address(b), len(starts)))
