"""`cotangent.Muon`: a drop-in for `torch.optim.Muon` over packed buffers, bitwise equal to it.

torch 2.13's Muon (`torch/optim/_muon.py`) is a for-loop optimizer: per 2-D parameter it runs
``buf.lerp_(grad, 1 - momentum)``, ``update = grad.lerp(buf, momentum)`` (Nesterov; else the
buffer), the Newton-Schulz orthogonalization of `update` in bfloat16 (transposed when the
matrix is tall: normalize by the Frobenius norm clamped at `eps`, then `ns_steps` times
``gram = X @ X.T``, ``addmm(gram, gram, gram, beta=b, alpha=c)``,
``X = addmm(X, gram_update, X, beta=a)``), ``param.mul_(1 - lr * weight_decay)`` and
``param.add_(update, alpha=-adjusted_lr)`` with ``adjusted_lr = lr * sqrt(max(1, rows/cols))``
("original") or ``0.2 * lr * sqrt(max(rows, cols))`` ("match_rms_adamw").

Cotangent keeps the parameters, gradients and momentum buffers of each param group's
equal-shape matrices in one flat buffer per (group, shape, dtype, device) - a *batch* - and runs
the same arithmetic once per batch: the element-wise ops over the whole (n, rows, cols) view,
the Newton-Schulz products as `bmm`/`baddbmm`, the norms per matrix. A calibration probe
(`batched_step_is_exact`: one step of torch's own `_single_tensor_muon` on separate tensors
against the batched step on a packed copy, with random values and with NaN, infinities, signed
zeros and subnormals sprinkled in, bytes compared) decides per (device, dtype, batch shape,
momentum, nesterov, coefficients, steps, eps, lr adjustment, threads, torch version) whether
the batched form is used; otherwise, and for any batch with a missing gradient or a gradient
laid out unlike its parameter, torch's own per-matrix function runs on the packed views (the
native code itself, so native's bits by construction).

State is native's: ``optimizer.state[p]["momentum_buffer"]`` (a view of the packed buffer),
created at a parameter's first gradient, so `state_dict()` / `load_state_dict()` interchange
with `torch.optim.Muon` in both directions.

Native bug reproduced (`cotangent.native_bugs`, id "muon-bf16-buffer-overwrite"): torch 2.13's
Muon with bfloat16 parameters and ``nesterov=False`` overwrites each momentum buffer with the
normalised update (``.bfloat16()`` returns the buffer itself, and the Newton-Schulz step divides
it in place); fixed upstream by pytorch/pytorch PR #194664 (the conversion copies). Both paths
here keep native's bits - the per-matrix one is native's code, the batched one converts as
native does (aliasing where the probe `native_bugs.present` finds native aliasing, a copy where
it finds the fix) - and `Muon.step` warns once per process (`NativeBugWarning`) the first time
a batch with a gradient is in that configuration with momentum != 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cotangent import _compat, calibration, native_bugs
from cotangent.calibration import sprinkle_special_values
from cotangent.norms import _bytes_equal
from cotangent.packing import (
    FlatLayout,
    _round_up,
    align_elements,
    matrix_view,
    plan_matrix_layouts,
)
from cotangent.store import FlatStore, describe, validate_params
from cotangent.tracking import GradientTracker, gradients_to_carry

_KEY = "momentum_buffer"


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


def batched_muon_step(params: Tensor, grads: Tensor, bufs: Tensor, *, lr, weight_decay: float,
                      momentum: float, nesterov: bool, ns_coefficients: tuple[float, float, float],
                      ns_steps: int, eps: float, adjust_lr_fn: str | None) -> None:
    """One Muon step of a batch of equal-shape matrices, in place on `params` and `bufs`.

    Args:
        params, grads, bufs: (n, rows, cols) views (packed parameters, gradients, momentum
            buffers), all of one dtype and device; `grads` is read only.
        lr: float or 0-d/1-element tensor; the other arguments as torch.optim.Muon's.
    """
    lr = _compat.muon_to_scalar(lr)
    bufs.lerp_(grads, 1 - momentum)
    update = grads.lerp(bufs, momentum) if nesterov else bufs
    update = newton_schulz_batched(update, ns_coefficients, ns_steps, eps)
    adjusted_lr = _compat.muon_adjust_lr(lr, adjust_lr_fn, params.shape[1:])
    params.mul_(1 - lr * weight_decay)
    params.add_(update, alpha=-adjusted_lr)


def _hyper(group: dict) -> dict:
    return {k: group[k] for k in ("weight_decay", "momentum", "nesterov", "ns_coefficients",
                                  "ns_steps", "eps", "adjust_lr_fn")}


def batched_step_is_exact(device: torch.device, dtype: torch.dtype, n: int, rows: int, cols: int,
                          group: dict) -> bool:
    """Calibration probe: does `batched_muon_step` on packed (n, rows, cols) views give
    torch.optim.Muon's bits (its `_single_tensor_muon` on n separate tensors) for the group's
    hyperparameters? First the Newton-Schulz products alone (`_gemm_probe`: about 2^20 output
    elements of each product on random batches of this shape, through every iteration, since a
    GEMM kernel can differ from the per-matrix one in rare elements or only at large values),
    then two whole steps (random values; then
    NaN/inf/signed zeros/subnormals sprinkled into gradients, parameters and buffers), each with
    the group's lr and a second lr; bytes of parameters, momentum buffers and gradients
    compared. Cached (`cotangent.calibration`, key kind "muon-batched-v3")."""
    hyper = _hyper(group)
    key = _batched_key(device, dtype, n, rows, cols, hyper)
    verdict = calibration.lookup(key)
    if verdict is None:
        verdict = _probe(device, dtype, n, rows, cols, group["lr"], hyper)
        calibration.record(key, verdict)
    return verdict


def _batched_key(device: torch.device, dtype: torch.dtype, n: int, rows: int, cols: int,
                 hyper: dict) -> str:
    """The calibration key of `batched_step_is_exact`'s verdict (`calibration.full_key`): the
    batch, the hyperparameters, whether native's Newton-Schulz step aliases a bfloat16 input
    (`native_bugs.present`, which `newton_schulz_batched` follows; only asked for bfloat16) and
    the code of the probe and of the step it proves."""
    aliasing = (dtype == torch.bfloat16
                and native_bugs.present(native_bugs.MUON_BF16_BUFFER_OVERWRITE))
    return calibration.full_key(
        "muon-batched-v3", device.type,
        (dtype, n, rows, cols, *sorted(hyper.items()), "aliasing" if aliasing else "-"),
        probe=(batched_step_is_exact, _probe, _gemm_probe, _update_probe, _packed_copy,
               batched_muon_step, newton_schulz_batched,
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
        g = torch.randn(n, rows, cols, generator=gen).to(device=device, dtype=torch.bfloat16)
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


def _packed_copy(values: Tensor) -> Tensor:
    """`values` (n, rows, cols) copied into a fresh flat buffer laid out as a packed batch
    (members `_round_up(rows * cols, 64 bytes)` elements apart); returns the (n, rows, cols)
    view."""
    n, rows, cols = values.shape
    stride = _round_up(rows * cols, align_elements(values.dtype))
    flat = torch.zeros(stride * n, dtype=values.dtype, device=values.device)
    view = flat.as_strided((n, rows, cols), (stride, cols, 1))
    view.copy_(values)
    return view


def _update_probe(device, dtype, n, rows, cols, gen) -> bool:
    """The batched decay and update (``params.mul_``, ``params.add_(update, alpha)``) against
    per-matrix ones, with the bfloat16 update laid out as the Newton-Schulz output is (the
    transpose of a wide result for tall matrices) and holding NaNs of both signs and payloads,
    infinities, signed zeros and subnormals: a diverging iteration produces such values, and
    their encoding after a mixed-dtype add depends on the kernel path."""
    wide = (n, cols, rows) if rows > cols else (n, rows, cols)
    for shift in range(4):
        raw = torch.randn(*wide, generator=gen).to(torch.bfloat16)
        sprinkle_special_values(list(raw.view(n, -1)), shift=shift)
        sprinkle_special_values(list(raw.view(n * wide[1], -1)), shift=shift + 5)
        raw = raw.to(device)
        update = raw.mT if rows > cols else raw
        params = _packed_copy(torch.randn(n, rows, cols, generator=gen).to(device=device,
                                                                           dtype=dtype))
        for i in range(n):  # specials of their own, and infinities of both signs where the
            # update holds one (inf - inf: a NaN whose encoding depends on the path)
            sprinkle_special_values([params[i].reshape(-1)], shift=shift + 2 * i)
        signs = torch.randint(0, 2, (n, rows, cols), generator=gen).to(device) * 2 - 1
        params.copy_(torch.where(update.isinf(), signs * float("inf"), params))
        single = [p.clone() for p in params]
        params.mul_(1 - 0.02 * 0.1)
        params.add_(update, alpha=-0.0315)
        for i, p in enumerate(single):
            p.mul_(1 - 0.02 * 0.1)
            p.add_(update[i], alpha=-0.0315)
            if not _bytes_equal(p, params[i]):
                return False
    return True


def _probe(device, dtype, n, rows, cols, lr, hyper) -> bool:
    gen = torch.Generator().manual_seed(20261130 + n * 7919 + rows * 31 + cols)
    if not _gemm_probe(device, n, rows, cols, hyper["ns_coefficients"], hyper["ns_steps"], gen):
        return False
    if not _update_probe(device, dtype, n, rows, cols, gen):
        return False
    lr_values = [lr, 0.0123] if not isinstance(lr, Tensor) else [lr]
    for trial in range(2):
        for probe_lr in lr_values:
            values = [torch.randn(n, rows, cols, generator=gen).to(dtype) * s
                      for s in (1.0, 1e-3, 0.1)]
            if trial:
                for j, v in enumerate(values):
                    sprinkle_special_values(list(v.view(n, -1)), shift=3 * j)
            values = [v.to(device) for v in values]
            native = [[v[i].clone() for i in range(n)] for v in values]
            views = [_packed_copy(v) for v in values]
            _compat.muon_single_tensor(native[0], native[1], native[2], lr=probe_lr, **hyper)
            batched_muon_step(views[0], views[1], views[2], lr=probe_lr, **hyper)
            for i in range(n):
                for j in range(3):
                    if not _bytes_equal(native[j][i], views[j][i]):
                        return False
    return True


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` with packed parameters, gradients and momentum buffers and batched
    Newton-Schulz iterations; bitwise equal to `torch.optim.Muon` with the same arguments
    (same constructor, defaults, validation and errors: it is a subclass).

    Parameters are moved into flat buffers at construction (each ``p.data`` becomes a view;
    ``p.grad`` a view of the gradient buffer, None until a backward delivers one, as native).
    Param groups added later, parameters replaced in ``param_groups`` or given new storage
    (``p.data = t``) are repacked at the next `step`/`zero_grad`; state assigned from outside
    (``load_state_dict``, ``opt.state[p]["momentum_buffer"] = t``) is validated and copied in.

    Native bug reproduced: with bfloat16 parameters and ``nesterov=False`` torch 2.13's Muon
    overwrites each momentum buffer with the normalised update (fixed upstream by
    pytorch/pytorch PR #194664); this class keeps native's bits there too and `step` warns
    once per process (`cotangent.native_bugs.NativeBugWarning`), only where the running torch
    has the bug (a probe of native behaviour) and momentum != 0.

    Raises (beyond torch.optim.Muon's own):
        ValueError: a parameter that cannot be packed (appears twice, shares storage with
            another, not a leaf, sparse, complex, not floating point, on the meta device).
        RuntimeError: a state tensor of the wrong shape, dtype or device (nothing modified).
    """

    def __init__(self, params, *args, **kwargs) -> None:
        self._packed_ids: list[int] | None = None
        super().__init__(params, *args, **kwargs)
        self._pack()

    # ------------------------------------------------------------------ packing

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def _pack(self) -> None:
        params = self._all_params()
        for p in params:  # torch.optim.Muon's own check (its __init__ only; ours at every pack)
            if not isinstance(p, Tensor) or p.ndim != 2:
                raise ValueError(f"Muon only supports 2D parameters whereas we found a "
                                 f"parameter with size: {getattr(p, 'shape', type(p).__name__)}")
        validate_params(params)
        old_tracker = getattr(self, "_tracker", None)
        grads = gradients_to_carry(old_tracker, params)
        carried = {id(p): self.state[p][_KEY].detach().clone() for p in params
                   if p in self.state and _KEY in self.state[p]}
        batches, slot_group = [], []
        for gi, group in enumerate(self.param_groups):
            keys: dict[tuple, list[int]] = {}
            for p in group["params"]:
                keys.setdefault((tuple(p.shape), p.dtype, p.device), []).append(len(slot_group))
                slot_group.append(gi)
            batches += keys.values()
        layouts = plan_matrix_layouts(params, batches)  # raises before anything is changed
        if old_tracker is not None:
            old_tracker.remove_hooks()
        # each layout is one batch (or one member of a batch split for a non-contiguous member)
        self._layout_group = [slot_group[layout.segments[0].slot] for layout in layouts]
        self._store = FlatStore.pack(params, layouts, grads, {})
        self._tracker = GradientTracker(self._store)
        self._buffers = [layout.new_buffer(0.0) for layout in layouts]
        self._buffer_views = [self._store.alias(self._buffers, s) for s in range(len(params))]
        self._buffer_ptrs = [v.data_ptr() for v in self._buffer_views]
        for slot, p in enumerate(params):
            if id(p) in carried:
                self._buffer_views[slot].copy_(carried[id(p)])
                self.state[p][_KEY] = self._buffer_views[slot]
        self._packed_ids = [id(p) for p in params]
        self._packed_shapes = [p.shape for p in params]
        self._bf16_layouts = [li for li, layout in enumerate(layouts)
                              if layout.dtype == torch.bfloat16]

    def _refresh(self) -> None:
        """Repack after structural edits; adopt momentum buffers assigned from outside."""
        params = self._all_params()
        if ([id(p) for p in params] != self._packed_ids
                or [p.data_ptr() for p in params] != self._store.param_ptrs
                or [p.shape for p in params] != self._packed_shapes):
            self._pack()
            return
        for slot, p in enumerate(params):
            state = self.state.get(p)
            if not state or _KEY not in state or self._is_ours(slot, state[_KEY]):
                continue
            value = state[_KEY]
            if (not isinstance(value, Tensor) or value.shape != p.shape
                    or value.dtype != p.dtype or value.device != p.device):
                what = (f"{tuple(value.shape)} {value.dtype} {value.device}"
                        if isinstance(value, Tensor) else type(value).__name__)
                raise RuntimeError(f"{describe(slot, p)}: state['{_KEY}'] is {what}; it must "
                                   f"match the parameter ({tuple(p.shape)} {p.dtype} "
                                   f"{p.device})")
        for slot, p in enumerate(params):
            state = self.state.get(p)
            if state and _KEY in state and not self._is_ours(slot, state[_KEY]):
                value = state[_KEY]
                if value is self._buffer_views[slot]:  # its storage moved (`.data = t`)
                    self._buffer_views[slot] = self._store.alias(self._buffers, slot)
                with torch.no_grad():
                    self._buffer_views[slot].copy_(value)
                state[_KEY] = self._buffer_views[slot]

    def _is_ours(self, slot: int, value) -> bool:
        """Whether `value` is slot `slot`'s momentum view, still over the flat buffer."""
        return value is self._buffer_views[slot] and value.data_ptr() == self._buffer_ptrs[slot]

    def add_param_group(self, param_group: dict) -> None:
        """`torch.optim.Muon.add_param_group`, then a repack; a group that cannot be packed is
        removed again (ValueError from the packing, nothing else changed), a parameter that is
        not 2-D included: torch.optim.Muon checks that in its constructor only, and a later
        group's 1-D parameter fails in its `step()` after the earlier groups were updated;
        here it is refused when added (or, appended to a group by hand, at the next `step()` /
        `zero_grad()`, before anything is modified), with native's constructor message."""
        super().add_param_group(param_group)
        if self._packed_ids is not None:  # not during __init__
            try:
                self._pack()
            except Exception:
                self.param_groups.pop()
                raise

    def __getstate__(self):
        raise TypeError("cotangent.Muon cannot be pickled or copied (its parameters live in "
                        "flat buffers); save and load optimizer.state_dict() instead")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._refresh()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`Optimizer.zero_grad` over packed gradients: ``set_to_none=True``: no gradient counts
        as present until the next backward (``.grad`` reads None, as native, and the backward's
        fresh gradients are copied into the buffer as they arrive; under torch.distributed, once
        ``state`` exists, it is instead a view of the buffer filled with -0.0, which the
        backward accumulates into with the same bits); ``set_to_none=False`` zeroes the existing
        gradients in place."""
        _compat.refuse_under_compile("cotangent.Muon.zero_grad()")
        self._refresh()
        # no state yet (a fresh optimizer): .grad reads None as native, in a process group too
        # (torch.distributed.checkpoint tells a fresh optimizer by exactly that)
        self._tracker.zero_grad(set_to_none, prefill=bool(self.state))

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon update of every parameter with a gradient (torch.optim.Muon.step).

        Warns:
            NativeBugWarning (`cotangent.native_bugs`), once per process, before anything is
            modified: a bfloat16 batch with a gradient in a group with ``nesterov=False`` and
            momentum != 0, on a torch whose Muon overwrites the momentum buffer there (the
            bits are native's all the same; upstream fix: pytorch/pytorch PR #194664)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refresh()
        store = self._store
        grads = self._tracker.scan()
        present = set(grads.present)
        params = store.params
        if self._bf16_layouts and not native_bugs.warned(native_bugs.MUON_BF16_BUFFER_OVERWRITE):
            self._warn_buffer_overwrite(present)  # before anything is modified
        for slot in grads.present:  # native creates the buffer at a parameter's first gradient
            state = self.state[params[slot]]
            if _KEY not in state:
                self._buffer_views[slot].zero_()
                state[_KEY] = self._buffer_views[slot]
        for li, layout in enumerate(store.layouts):
            group = self.param_groups[self._layout_group[li]]
            slots = [seg.slot for seg in layout.segments]
            with_grad = [s for s in slots if s in present]
            if not with_grad:
                continue
            if (len(with_grad) == len(slots) and layout.segments[0].contiguous
                    and not any(s in grads.foreign for s in slots)
                    and self._batched(layout, group)):
                batched_muon_step(matrix_view(layout, store.flat_params[li]),
                                  matrix_view(layout, store.flat_grads[li]),
                                  matrix_view(layout, self._buffers[li]),
                                  lr=group["lr"], **_hyper(group))
            else:
                _compat.muon_single_tensor(
                    [params[s] for s in with_grad], [grads.tensor(store, s) for s in with_grad],
                    [self._buffer_views[s] for s in with_grad], lr=group["lr"], **_hyper(group))
        self._tracker.release_absent(grads.present)
        return loss

    def _warn_buffer_overwrite(self, present: set[int]) -> None:
        """`NativeBugWarning` (once per process) when a bfloat16 batch with a gradient is in a
        group with ``nesterov=False`` and momentum != 0, and the probe finds the running torch
        overwrites the momentum buffer there (`cotangent.native_bugs`,
        "muon-bf16-buffer-overwrite"; fixed by pytorch/pytorch PR #194664). A momentum of 0
        reads the overwritten buffer nowhere (``lerp_(grad, 1)`` returns the gradient exactly),
        so it gets no warning."""
        for li in self._bf16_layouts:
            group = self.param_groups[self._layout_group[li]]
            if group["nesterov"] or not group["momentum"]:
                continue
            slots = [seg.slot for seg in self._store.layouts[li].segments]
            if not any(s in present for s in slots):
                continue
            if native_bugs.present(native_bugs.MUON_BF16_BUFFER_OVERWRITE):
                rows, cols = self._store.layouts[li].segments[0].shape
                native_bugs.warn_once(
                    native_bugs.MUON_BF16_BUFFER_OVERWRITE,
                    f"cotangent.Muon param group {self._layout_group[li]} has bfloat16 "
                    f"({rows}, {cols}) parameters, nesterov=False and momentum "
                    f"{group['momentum']}")
            return

    def _batched(self, layout: FlatLayout, group: dict) -> bool:
        bucket = layout.buckets[0]
        rows, cols = bucket.segments[0].shape
        return batched_step_is_exact(layout.device, layout.dtype, bucket.rows, rows, cols, group)

    def batch_summary(self) -> list[dict]:
        """Per batch: group index, shape, members, dtype, device and whether the batched form
        is proven (None until the first step that needs the probe)."""
        out = []
        for li, layout in enumerate(self._store.layouts):
            bucket = layout.buckets[0]
            group = self.param_groups[self._layout_group[li]]
            rows, cols = bucket.segments[0].shape
            key = _batched_key(layout.device, layout.dtype, bucket.rows, rows, cols,
                               _hyper(group))
            out.append({"group": self._layout_group[li], "shape": [rows, cols],
                        "matrices": bucket.rows, "dtype": str(layout.dtype),
                        "device": str(layout.device), "batched": calibration.lookup(key)})
        return out
