"""How native ATen divides a tensor's elements: among threads (`thread_chunks`), into vector
bodies and scalar tails (`native_pieces` for the for-loop / foreach ops, `fused_pieces` for
`torch._fused_adamw_`), so that the kernel gives each element the code path native gives it.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from cotangent import _compat
from cotangent.singlepass import kernel


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
        out = torch.maximum(torch.zeros(n, dtype=torch.float32),
                            torch.full((n,), float("nan"), dtype=torch.float32)).view(torch.int32)
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
    vmax = torch.zeros(n, dtype=torch.float32)
    f32 = dict(dtype=torch.float32)
    _compat.fused_adamw_one_group(
        [torch.zeros(n, **f32)], [torch.full((n,), float("nan"), **f32)], [torch.zeros(n, **f32)],
        [torch.zeros(n, **f32)], [vmax], [torch.tensor(0.0, **f32)], amsgrad=True, beta1=0.9,
        beta2=0.999, lr=1e-3, weight_decay=0.0, eps=1e-8, maximize=False)
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
    # for_each: serial below the grain; parallel_for: not above it
    if threads <= 1 or numel <= kernel.GRAIN_SIZE:
        return [(0, numel)]
    nt = min(threads, -(-numel // kernel.GRAIN_SIZE))
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
