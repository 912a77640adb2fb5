"""The batched Newton-Schulz step of `cotangent.Muon` and its calibration probe.

`batched_muon_step` runs torch 2.13's Muon (`torch/optim/_muon.py`, `_single_tensor_muon`) over a
batch of equal-shape matrices whose momentum buffers are the (rows, cols) slices of one
contiguous (n, rows, cols) tensor: per matrix native's lerps and norm, the Newton-Schulz products
as `bmm` / `baddbmm` over the stack (`newton_schulz_batched`), then native's decay and update on
each parameter (`apply_update`). `batched_step_is_exact` decides, per (device, dtype, batch shape,
hyperparameters, threads, torch version), whether that equals torch's per-matrix code byte for
byte (first the products alone, then whole steps with special values sprinkled in); its verdict
is cached like every probe (`cotangent.calibration`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cotangent import _compat, calibration, native_bugs
from cotangent.calibration import sprinkle_special_values
from cotangent.norms import _bytes_equal


def newton_schulz_batched(update: Tensor, ns_coefficients: tuple[float, float, float],
                          ns_steps: int, eps: float) -> Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalization of each matrix of a batch.

    Args:
        update: (n, rows, cols) floating-point tensor (any strides).
    Returns:
        (n, rows, cols) bfloat16: per matrix, the arithmetic of torch's
        `_zeropower_via_newtonschulz` with `mm`/`addmm` replaced by `bmm`/`baddbmm` and the
        Frobenius norm taken per matrix (whether that gives torch's bits is what
        `batched_step_is_exact` probes).

    A bfloat16 `update` is normalised in place, as torch 2.13 does (its ``.bfloat16()`` returns
    the tensor itself; with ``nesterov=False`` that is the momentum buffer: the native bug
    "muon-bf16-buffer-overwrite" of `cotangent.native_bugs`), unless the probe
    `native_bugs.present` finds the running torch copies (the fix of pytorch/pytorch
    PR #194664); then it is copied first, and `update` is left as it was.
    """
    a, b, c = ns_coefficients
    if (update.dtype == torch.bfloat16
            and not native_bugs.present(native_bugs.MUON_BF16_BUFFER_OVERWRITE)):
        x = update.to(dtype=torch.bfloat16, copy=True)  # a torch with the upstream fix
    else:
        x = update.bfloat16()  # torch 2.13: `update` itself when it is already bfloat16
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    norms = torch.stack([m.norm() for m in x]).view(-1, 1, 1)
    x.div_(norms.clamp(min=eps))
    for _ in range(ns_steps):
        gram = torch.bmm(x, x.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def batched_updates(grads: list[Tensor], bufs: Tensor, *, momentum: float, nesterov: bool,
                    ns_coefficients: tuple[float, float, float], ns_steps: int,
                    eps: float) -> Tensor:
    """The momentum step and orthogonalized updates of a batch of equal-shape matrices.

    Args:
        grads: n (rows, cols) gradients (read only).
        bufs: (n, rows, cols) contiguous momentum buffers, updated in place: per matrix
            ``bufs[i].lerp_(grads[i], 1 - momentum)``, native's op.
    Returns:
        (n, rows, cols) bfloat16 updates, ``newton_schulz_batched`` of the Nesterov blend
        (``torch.lerp(grads[i], bufs[i], momentum)`` per matrix, written into one stack) or of
        `bufs` itself (``nesterov=False``, as native: its `.bfloat16()` aliasing included).
    """
    views = bufs.unbind(0)
    for buf, grad in zip(views, grads):
        buf.lerp_(grad, 1 - momentum)
    if nesterov:
        update = torch.empty_like(bufs)
        for out, grad, buf in zip(update.unbind(0), grads, views):
            torch.lerp(grad, buf, momentum, out=out)
    else:
        update = bufs
    return newton_schulz_batched(update, ns_coefficients, ns_steps, eps)


def apply_update(param: Tensor, update: Tensor, lr, weight_decay: float,
                 adjust_lr_fn: str | None) -> None:
    """torch.optim.Muon's last two ops on one parameter: ``param.mul_(1 - lr * weight_decay)``,
    ``param.add_(update, alpha=-adjusted_lr)``; `lr` a float (see `_compat.muon_to_scalar`)."""
    adjusted_lr = _compat.muon_adjust_lr(lr, adjust_lr_fn, param.shape)
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr)


def batched_muon_step(params: list[Tensor], grads: list[Tensor], bufs: Tensor, *, lr,
                      weight_decay: float, momentum: float, nesterov: bool,
                      ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                      adjust_lr_fn: str | None) -> None:
    """One Muon step of a batch: `batched_updates`, then `apply_update` per parameter in order.

    Args:
        params, grads: n (rows, cols) tensors of one dtype and device (`grads` read only).
        bufs: (n, rows, cols) contiguous momentum buffers.
        lr: float or 0-d/1-element tensor; the other arguments as torch.optim.Muon's.
    """
    lr = _compat.muon_to_scalar(lr)
    updates = batched_updates(grads, bufs, momentum=momentum, nesterov=nesterov,
                              ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps)
    for param, update in zip(params, updates.unbind(0)):
        apply_update(param, update, lr, weight_decay, adjust_lr_fn)


def hyper_of(group: dict) -> dict:
    return {k: group[k] for k in ("weight_decay", "momentum", "nesterov", "ns_coefficients",
                                  "ns_steps", "eps", "adjust_lr_fn")}


def batched_step_is_exact(device: torch.device, dtype: torch.dtype, n: int, rows: int, cols: int,
                          group: dict) -> bool:
    """Calibration probe: does `batched_muon_step` (n separate parameters and gradients, one
    contiguous (n, rows, cols) momentum buffer) give
    torch.optim.Muon's bits (its `_single_tensor_muon` on n separate tensors) for the group's
    hyperparameters? First the Newton-Schulz products alone (`_gemm_probe`: about 2^20 output
    elements of each product on random batches of this shape, through every iteration, since a
    GEMM kernel can differ from the per-matrix one in rare elements or only at large values),
    then two whole steps (random values; then
    NaN/inf/signed zeros/subnormals sprinkled into gradients, parameters and buffers), each with
    the group's lr and a second lr; bytes of parameters, momentum buffers and gradients
    compared. Cached (`cotangent.calibration`, key kind "muon-batched-v4")."""
    hyper = hyper_of(group)
    return calibration.verdict(batched_key(device, dtype, n, rows, cols, hyper),
                               lambda: _probe(device, dtype, n, rows, cols, group["lr"], hyper))


def batched_key(device: torch.device, dtype: torch.dtype, n: int, rows: int, cols: int,
                 hyper: dict) -> str:
    """The calibration key of `batched_step_is_exact`'s verdict (`calibration.full_key`): the
    batch, the hyperparameters, whether native's Newton-Schulz step aliases a bfloat16 input
    (`native_bugs.present`, which `newton_schulz_batched` follows; only asked for bfloat16) and
    the code of the probe and of the step it proves."""
    aliasing = (dtype == torch.bfloat16
                and native_bugs.present(native_bugs.MUON_BF16_BUFFER_OVERWRITE))
    return calibration.full_key(
        "muon-batched-v4", device.type,
        (dtype, n, rows, cols, *sorted(hyper.items()), "aliasing" if aliasing else "-"),
        probe=(batched_step_is_exact, _probe, _gemm_probe,
               batched_muon_step, batched_updates, apply_update, newton_schulz_batched,
               (GEMM_PROBE_ELEMENTS, GEMM_PROBE_MIN_TRIALS, GEMM_PROBE_MAX_TRIALS)))


# Output elements the op-level probe compares per Newton-Schulz product (at least
# GEMM_PROBE_MIN_TRIALS and at most GEMM_PROBE_MAX_TRIALS random batches of the real shape).
# Measured on CPU (AMD EPYC, AVX512, torch 2.13, bf16): `baddbmm` differs from per-matrix
# `addmm` in 51 of 576,000 output elements for (3, 6, 10) batches and 33 of 2.9 million for
# (2, 16, 48) - rarely enough that one random step agreed - and in none of 1.1-2.6 million for
# (3, 48, 48), (8, 64, 64) and (6, 96, 96).
GEMM_PROBE_ELEMENTS = 1 << 20
GEMM_PROBE_MIN_TRIALS = 8
GEMM_PROBE_MAX_TRIALS = 1024


def _gemm_probe(device, n, rows, cols, ns_coefficients, ns_steps, gen) -> bool:
    """The batched Newton-Schulz products against torch's per-matrix ones, byte for byte, on
    random bfloat16 batches of the real shape (orientation and strides as the step uses them),
    through all `ns_steps` iterations with the step's coefficients (so that the values reach
    the range the real iteration reaches: growing without bound, inf and NaN, for coefficients
    that diverge), until about `GEMM_PROBE_ELEMENTS` output elements of each product were
    compared: `bmm` against ``x @ x.T``, each `baddbmm` against `addmm`. The per-matrix chain
    continues from its own results, as torch's does."""
    a, b, c = ns_coefficients
    small = min(rows, cols)
    per_trial = n * small * small * max(1, ns_steps)
    trials = min(GEMM_PROBE_MAX_TRIALS,
                 max(GEMM_PROBE_MIN_TRIALS, -(-GEMM_PROBE_ELEMENTS // per_trial)))
    for _ in range(trials):
        g = torch.randn(n, rows, cols, generator=gen, dtype=torch.float32).to(
            device=device, dtype=torch.bfloat16)
        x = g.mT if rows > cols else g
        xs = [m.T if rows > cols else m for m in g]  # the per-matrix step's views
        norms = torch.stack([m.norm() for m in x]).view(-1, 1, 1)
        x = x / norms
        xs = [m / m.norm() for m in xs]
        for _ in range(ns_steps):
            gram = torch.bmm(x, x.mT)
            grams = [m @ m.T for m in xs]
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            polys = [torch.addmm(m, m, m, beta=b, alpha=c) for m in grams]
            x = torch.baddbmm(x, poly, x, beta=a)
            xs = [torch.addmm(m, p, m, beta=a) for m, p in zip(xs, polys)]
            for batched, single in ((gram, grams), (poly, polys), (x, xs)):
                if not all(_bytes_equal(batched[i], single[i]) for i in range(n)):
                    return False
    return True


def _probe(device, dtype, n, rows, cols, lr, hyper) -> bool:
    gen = torch.Generator().manual_seed(20261130 + n * 7919 + rows * 31 + cols)
    if not _gemm_probe(device, n, rows, cols, hyper["ns_coefficients"], hyper["ns_steps"], gen):
        return False
    lr_values = [lr, 0.0123] if not isinstance(lr, Tensor) else [lr]
    for trial in range(2):
        for probe_lr in lr_values:
            values = [torch.randn(n, rows, cols, generator=gen, dtype=torch.float32).to(dtype) * s
                      for s in (1.0, 1e-3, 0.1)]
            if trial:
                for j, v in enumerate(values):
                    sprinkle_special_values(list(v.view(n, -1)), shift=3 * j)
            values = [v.to(device) for v in values]
            native = [[v[i].clone() for i in range(n)] for v in values]
            params, grads = [v.clone() for v in values[0]], [v.clone() for v in values[1]]
            bufs = values[2].clone()
            _compat.muon_single_tensor(native[0], native[1], native[2], lr=probe_lr, **hyper)
            batched_muon_step(params, grads, bufs, lr=probe_lr, **hyper)
            ours = (params, grads, bufs)
            for i in range(n):
                for j in range(3):
                    if not _bytes_equal(native[j][i], ours[j][i]):
                        return False
    return True
