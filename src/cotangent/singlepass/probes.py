"""The probes: data that meets every branch (`probe_data`: lengths around the vector unit and
the thread-split grain, NaNs of both signs and several payloads, infinities, signed zeros,
subnormals) and the byte comparisons against native (`matches_native` for AdamW,
`norms_match_native` for the norms).
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from cotangent.singlepass import kernel, passes, work


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
        scale = 10.0 ** (float(torch.rand((), generator=gen, dtype=torch.float32)) * 40 - 20)
        out.append(torch.randn(n, generator=gen, dtype=torch.float32) * scale)
    special = [t.clone() for t in out[1:300]]
    sprinkle_special_values(special)
    ones = []
    for v in (*SPECIAL_VALUES, 3e38, -1e-30):
        ones.append(torch.zeros(1, dtype=torch.float32))
        write_special(ones[-1], 0, v)
    signalling = torch.zeros(1, dtype=torch.float32)
    signalling.view(torch.int32)[0] = 0x7FA00001
    return out + special + ones + [signalling]


CLIP_PROBE_MAX_NORMS = (1.0, 0.05, 7, 0.0, -0.0, -1.0, 1e-30, 3.4e38, 1e39, float("inf"),
                        float("nan"))


def norms_match_native(seed: int = 0) -> bool:
    """Probe: does `tensor_norms` give, byte for byte, native clipping's per-tensor norms
    (`cotangent.norms.native_tensor_norms`, ord 2) of `norm_probe_tensors` here, and
    `clip_scalars` its total norm and clip coefficient (`cotangent.norms.total_norm`,
    `cotangent.norms.clip_coefficient`) over those norms, runs of them of 1 to 146, and each
    with a 0, subnormal, huge, inf and NaN total beside, for each of `CLIP_PROBE_MAX_NORMS`,
    under the current thread count and float modes? False (never raises) when the kernel
    cannot run."""
    from cotangent.norms import _bytes_equal, clip_coefficient, native_tensor_norms, total_norm

    try:
        tensors = norm_probe_tensors(seed)
        ours = passes.tensor_norms(tensors)
    except kernel.SinglePassUnavailable:
        return False
    if not _bytes_equal(ours, torch.stack(native_tensor_norms(tensors, 2.0, None))):
        return False
    stacks = [ours[i:i + k].contiguous() for k in (1, 2, 7, 146) for i in (0, 300)]
    stacks += [torch.tensor([v], dtype=torch.float32)
               for v in (0.0, 1e-45, 3.4e38, float("inf"), float("nan"))]
    for max_norm in CLIP_PROBE_MAX_NORMS:
        for norms in stacks:
            total, coef, value = passes.clip_scalars(norms, max_norm)
            native_total = total_norm(norms, 2.0)
            native_coef = clip_coefficient(native_total, max_norm)
            if not (_bytes_equal(total, native_total) and _bytes_equal(coef, native_coef)
                    and _bytes_equal(torch.tensor(value, dtype=torch.float32), native_coef)):
                return False
    return True


PROBE_LENGTHS = (1, 7, 15, 16, 17, 33, 100, 1000, 2047, 2049, kernel.GRAIN_SIZE,
                 kernel.GRAIN_SIZE + 1, 2 * kernel.GRAIN_SIZE + 17)
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
    f32 = dict(generator=gen, dtype=torch.float32)
    state = dict(param=torch.randn(size, **f32),
                 exp_avg=torch.randn(size, **f32) * 1e-2,
                 exp_avg_sq=torch.rand(size, **f32) * 1e-4)
    state["max_exp_avg_sq"] = state["exp_avg_sq"] + torch.rand(size, **f32) * 1e-5
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
        g = torch.randn(size, generator=torch.Generator().manual_seed(seed * 1000 + k),
                        dtype=torch.float32)
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
    f = kernel._f32(x)
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
                    fused=implementation == "fused" or None, capturable=False,
                    differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
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
    Single pass: `single_pass_adamw_lists_` on the same segments as views of flat buffers. With
    `clip_coef`, native first multiplies each segment's gradient by it as `clip_grad_norm_`
    does on the CPU (``g.mul_(coef)`` with a 0-d float32 tensor) and the single pass gets it as
    `clip_coef`; the clipped gradients are compared too. `dtype` bfloat16: every buffer holds
    the top 16 bits of the float32 probe values (so NaN payloads, subnormals and signs carry
    over), spread over many magnitudes; with `stress` the probe runs a second time with lr 0.1,
    eps 1e-3, beta2 0.95 and weight decay 0.5 (where decay is on), values at which each
    scalar's own rounding to bfloat16 or float32 shows in the results (with the defaults such a
    difference can hide: measured). `steps` steps; parameters, moments and step counts compared
    byte for byte after every step. Returns False (never raises) when the kernel cannot run
    here, and for amsgrad under denormals-are-zero in the calling thread (`AMSGRAD_DAZ`). Runs
    under the current `torch.get_num_threads()`: a verdict holds for that thread count (it
    decides where native's scalar tails are), this CPU ISA and this torch build.
    """
    try:
        kernel.build()
        if implementation == "fused" and (dtype != torch.float32
                                          or work.fused_vector_unit() is None):
            return False
        if implementation != "fused" and (kernel.sqrt_kind() is None
                                          or work.aten_vector_unit(dtype) is None):
            return False
        if amsgrad and kernel.mxcsr() & kernel.MXCSR_DAZ:
            return False  # see AMSGRAD_DAZ: and this probe's subnormals are flushed under it
    except kernel.SinglePassUnavailable:
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
    native_steps = [torch.tensor(s, dtype=torch.float32) for s in start]
    ours_steps = [torch.tensor(s, dtype=torch.float32) for s in start]
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
                passes.single_pass_adamw_lists_(
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
    except (kernel.SinglePassUnavailable, ValueError, TypeError):
        return False
    if dtype == torch.bfloat16 and stress:
        stress_lr = torch.tensor(0.1, dtype=lr.dtype) if isinstance(lr, Tensor) else 0.1
        return matches_native(
            implementation=implementation, lr=stress_lr, beta1=beta1, beta2=0.95, eps=1e-3,
            weight_decay=0.5 if weight_decay != 0 else 0.0, maximize=maximize, amsgrad=amsgrad,
            lengths=lengths, steps=steps, seed=seed + 1, grid=grid, clip_coef=clip_coef,
            dtype=dtype, stress=False)
    return True


def _probe_code() -> tuple:
    """What the single-pass verdicts' fingerprint covers (`calibration.probe_fingerprint`): the
    probe, the functions that build its inputs and run native's side, and the value grids."""
    return (matches_native, probe_data, special_grid, _native_adamw, PROBE_LENGTHS, GRID_GRAD,
            GRID_EXP_AVG, GRID_EXP_AVG_SQ, GRID_PARAM, GRID_MAX, GRID_GRAD_CLEAN,
            GRID_EXP_AVG_CLEAN, GRID_EXP_AVG_SQ_CLEAN, GRID_PARAM_CLEAN, GRID_MAX_CLEAN)
