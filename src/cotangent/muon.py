"""`cotangent.Muon`: a drop-in for `torch.optim.Muon` with batched Newton-Schulz, bitwise equal.

torch 2.13's Muon (`torch/optim/_muon.py`) is a for-loop optimizer: per 2-D parameter it runs
``buf.lerp_(grad, 1 - momentum)``, ``update = grad.lerp(buf, momentum)`` (Nesterov; else the
buffer), the Newton-Schulz orthogonalization of `update` in bfloat16 (transposed when the
matrix is tall: normalize by the Frobenius norm clamped at `eps`, then `ns_steps` times
``gram = X @ X.T``, ``addmm(gram, gram, gram, beta=b, alpha=c)``,
``X = addmm(X, gram_update, X, beta=a)``), ``param.mul_(1 - lr * weight_decay)`` and
``param.add_(update, alpha=-adjusted_lr)`` with ``adjusted_lr = lr * sqrt(max(1, rows/cols))``
("original") or ``0.2 * lr * sqrt(max(rows, cols))`` ("match_rms_adamw").

Parameters and gradients stay where the user and autograd put them (each ``p.grad`` is read
where it is, every step). What Cotangent lays out is its own state: the momentum buffers of
each param group's equal-shape matrices (two or more of one (shape, dtype, device)) are the
(rows, cols) slices of one contiguous (n, rows, cols) tensor - a *batch* - so that the
Newton-Schulz products of the batch run as `bmm`/`baddbmm` over a stack of the updates: per
matrix, the lerps are native's own ops (the Nesterov blend written into the stack with
``out=``), the norms are per matrix, and the decay and update are native's two ops on the
user's parameter, in native's parameter order. A calibration probe (`batched_step_is_exact`:
the products alone over about 2^20 output elements, then whole steps of torch's own
`_single_tensor_muon` on separate tensors against the batched step, with random values and
with NaN, infinities, signed zeros and subnormals sprinkled in, bytes compared) decides per
(device, dtype, batch shape, momentum, nesterov, coefficients, steps, eps, lr adjustment,
threads, torch version) whether the batched form is used. Otherwise - and for a step where a
member of the batch has no gradient, a gradient that is not a plain contiguous tensor of its
parameter's shape and dtype, a momentum buffer that is not the batch's slice, or a gradient
sharing memory with a parameter or buffer of its group - torch's own per-matrix function runs
on the real tensors (native's code, so native's bits by construction).

State is native's: ``optimizer.state[p]["momentum_buffer"]``, created at a parameter's first
gradient (a slice of its batch, or ``zeros_like(grad)`` as native for a matrix in no batch), so
`state_dict()` / `load_state_dict()` interchange with `torch.optim.Muon` in both directions.
When every buffer of a batch was replaced from outside (``load_state_dict``), the new values are
copied into a new batch tensor at the next `step()` (the optimizer's state is its own to lay
out; the old tensor is never written again, so an earlier `state_dict()` keeps its values);
a batch with only some buffers replaced, or one laid out unlike a slice or sharing memory,
runs per matrix on the buffers as given.

Native bug reproduced (`cotangent.native_bugs`, id "muon-bf16-buffer-overwrite"): torch 2.13's
Muon with bfloat16 parameters and ``nesterov=False`` overwrites each momentum buffer with the
normalised update (``.bfloat16()`` returns the buffer itself, and the Newton-Schulz step divides
it in place); fixed upstream by pytorch/pytorch PR #194664 (the conversion copies). Both paths
here keep native's bits - the per-matrix one is native's code, the batched one converts as
native does (aliasing where the probe `native_bugs.present` finds native aliasing, a copy where
it finds the fix) - and `Muon.step` warns once per process (`NativeBugWarning`) the first time
a bfloat16 matrix with a gradient is in that configuration with momentum != 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from cotangent import _compat, calibration, native_bugs
from cotangent.muon_batched import (apply_update, batched_key, batched_step_is_exact,
                                    batched_updates, hyper_of)

_KEY = "momentum_buffer"


@dataclass
class _Batch:
    """Two or more matrices of one param group with one (shape, dtype, device): their momentum
    buffers are the slices of `buffer`."""
    group: int
    params: list[Tensor]  # in the group's order
    buffer: Tensor  # (n, rows, cols), contiguous
    views: list[Tensor] = field(default_factory=list)  # buffer[i], what state holds
    ptrs: list[int] = field(default_factory=list)
    issued: set[int] = field(default_factory=set)  # slices handed to state at creation

    def __post_init__(self) -> None:
        self.views = list(self.buffer.unbind(0))
        self.ptrs = [v.data_ptr() for v in self.views]


def _plain_matrix(grad: Tensor, param: Tensor) -> bool:
    """Whether `grad` can join a batch as native's op would read it: a plain dense contiguous
    tensor of `param`'s shape, dtype and device (no subclass, negative-bit view, ZeroTensor or
    inference tensor: native's in-place ops on one outside inference mode raise)."""
    return (type(grad) is Tensor and grad.layout == torch.strided and grad.shape == param.shape
            and grad.dtype == param.dtype and grad.device == param.device
            and grad.is_contiguous() and not grad.is_neg() and not _compat.is_zerotensor(grad)
            and not grad.is_inference())


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` with batched Newton-Schulz iterations; bitwise equal to
    `torch.optim.Muon` with the same arguments (same constructor, defaults, validation and
    errors: it is a subclass).

    Parameters and gradients stay where they are (``p.grad`` is read in place each step, and
    `zero_grad` is native's); each param group's equal-shape matrices (two or more) keep their
    momentum buffers as slices of one (n, rows, cols) tensor (module docstring). Param groups
    added later and parameters replaced or reshaped are noticed at the next `step`; state
    assigned from outside is validated there, before anything is modified.

    Native bug reproduced: with bfloat16 parameters and ``nesterov=False`` torch 2.13's Muon
    overwrites each momentum buffer with the normalised update (fixed upstream by
    pytorch/pytorch PR #194664); this class keeps native's bits there too and `step` warns
    once per process (`cotangent.native_bugs.NativeBugWarning`), only where the running torch
    has the bug (a probe of native behaviour) and momentum != 0.

    Raises (beyond torch.optim.Muon's own):
        ValueError: a parameter that is not 2-D, in a group added later or reshaped (native's
            constructor message; native would fail at `step()` after updating the earlier
            groups), or a gradient that is not 2-D (native's message, before the group moves).
        RuntimeError: a momentum buffer of the wrong shape, dtype or device (nothing modified).
    """

    def __init__(self, params, *args, **kwargs) -> None:
        self._ready = False
        super().__init__(params, *args, **kwargs)
        self._structure: tuple | None = None
        self._batches: list[_Batch] = []
        self._ready = True

    def __setstate__(self, state: dict) -> None:  # pickle / copy.deepcopy: batches rebuilt
        super().__setstate__(state)
        self._structure, self._batches, self._ready = None, [], True

    # ------------------------------------------------------------------ batches

    def _check_2d(self) -> None:
        for group in self.param_groups:  # torch.optim.Muon's own check (its __init__ only)
            for p in group["params"]:
                if not isinstance(p, Tensor) or p.ndim != 2:
                    raise ValueError(f"Muon only supports 2D parameters whereas we found a "
                                     f"parameter with size: "
                                     f"{getattr(p, 'shape', type(p).__name__)}")

    def _refresh(self) -> None:
        """Rebuild the batches after structural edits; validate and adopt momentum buffers
        assigned from outside. Raises before anything is modified."""
        self._check_2d()
        structure = tuple(tuple((id(p), p.shape, p.dtype, p.device) for p in group["params"])
                          for group in self.param_groups)
        if structure != self._structure:
            self._batches = self._plan()
            self._structure = structure
        for group in self.param_groups:
            for p in group["params"]:
                value = self.state[p].get(_KEY) if p in self.state else None
                if value is None or p.grad is None:  # native reads it only with a gradient
                    continue
                if (not isinstance(value, Tensor) or value.shape != p.shape
                        or value.dtype != p.dtype or value.device != p.device):
                    what = (f"{tuple(value.shape)} {value.dtype} {value.device}"
                            if isinstance(value, Tensor) else type(value).__name__)
                    raise RuntimeError(f"parameter of shape {tuple(p.shape)}: "
                                       f"state['{_KEY}'] is {what}; it must match the "
                                       f"parameter ({tuple(p.shape)} {p.dtype} {p.device})")
        adoptable = self._adoptable()
        for bi, batch in enumerate(self._batches):
            values = [self.state[p].get(_KEY) if p in self.state else None
                      for p in batch.params]
            held = [(i, v) for i, v in enumerate(values) if v is not None]
            if all(self._is_ours(batch, i, v) for i, v in held):
                continue
            if any(self._is_ours(batch, i, v) or not _plain_matrix(v, batch.params[i])
                   or id(v) not in adoptable for i, v in held):
                continue  # some buffers replaced, or one unlike a slice: per matrix, as given
            # every buffer replaced (load_state_dict): copied into a new batch tensor; the old
            # one is left as it is to whoever still holds its slices (an earlier state_dict())
            with torch.inference_mode(False):
                fresh = _Batch(batch.group, batch.params, torch.zeros_like(batch.buffer))
            with torch.no_grad():
                for i, value in held:
                    fresh.views[i].copy_(value)
                    self.state[batch.params[i]][_KEY] = fresh.views[i]
                    fresh.issued.add(i)
            self._batches[bi] = fresh

    def _adoptable(self) -> set[int]:
        """Ids of the momentum buffers that may be copied into a batch tensor: those whose
        bytes overlap no other buffer's and whose storage holds no parameter or gradient
        (native would keep such aliasing: two parameters stepping one buffer, a buffer that is
        a parameter or a gradient)."""
        spans, params = [], set()
        for group in self.param_groups:
            for p in group["params"]:
                params.add(p.untyped_storage().data_ptr())
                if p.grad is not None:
                    params.add(p.grad.untyped_storage().data_ptr())
                value = self.state[p].get(_KEY) if p in self.state else None
                if isinstance(value, Tensor):
                    start = value.data_ptr()
                    spans.append((value.untyped_storage().data_ptr(), start,
                                  start + value.numel() * value.element_size(), id(value)))
        spans.sort()
        clashing, reach = set(), None  # reach: (storage, furthest end so far, its buffer)
        for storage, start, end, ident in spans:
            if reach is not None and reach[0] == storage and start < reach[1]:
                clashing.update((ident, reach[2]))
            if reach is None or reach[0] != storage or end > reach[1]:
                reach = (storage, end, ident)
        return {ident for storage, _, _, ident in spans
                if ident not in clashing and storage not in params}

    def _plan(self) -> list[_Batch]:
        batches = []
        for gi, group in enumerate(self.param_groups):
            ids = [id(p) for p in group["params"]]
            keys: dict[tuple, list[Tensor]] = {}
            for p in group["params"]:
                if ids.count(id(p)) == 1 and p.device.type != "meta":  # a repeated parameter:
                    # native steps it twice, per matrix
                    keys.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
            for (shape, dtype, device), members in keys.items():
                if len(members) > 1 and min(shape) >= _MIN_BATCHED_SIDE:
                    with torch.inference_mode(False):  # a plain tensor, whatever the caller's mode
                        buffer = torch.zeros(len(members), *shape, dtype=dtype, device=device)
                    batches.append(_Batch(gi, members, buffer))
        return batches

    @staticmethod
    def _is_ours(batch: _Batch, i: int, value) -> bool:
        return value is batch.views[i] and value.data_ptr() == batch.ptrs[i]

    def add_param_group(self, param_group: dict) -> None:
        """`torch.optim.Muon.add_param_group`; a group holding a parameter that is not 2-D is
        refused (ValueError with native's constructor message, nothing added): torch.optim.Muon
        checks that in its constructor only, and a later group's 1-D parameter fails in its
        `step()` after the earlier groups were updated. Appended to a group by hand, it is
        refused at the next `step()`, before anything is modified."""
        super().add_param_group(param_group)
        if self._ready:  # not during __init__
            try:
                self._check_2d()
            except ValueError:
                self.param_groups.pop()
                raise

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon update of every parameter with a gradient (torch.optim.Muon.step).

        Warns:
            NativeBugWarning (`cotangent.native_bugs`), once per process, before anything is
            modified: a bfloat16 matrix with a gradient in a group with ``nesterov=False`` and
            momentum != 0, on a torch whose Muon overwrites the momentum buffer there (the
            bits are native's all the same; upstream fix: pytorch/pytorch PR #194664)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refresh()
        if not native_bugs.warned(native_bugs.MUON_BF16_BUFFER_OVERWRITE):
            self._warn_buffer_overwrite()  # before anything is modified
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        return loss

    def _step_group(self, gi: int, group: dict) -> None:
        """torch.optim.Muon's `_init_group` (its checks and buffer creation, parameter by
        parameter), then its per-parameter loop in order, where a batch's updates are computed
        together at its first member."""
        with_grad = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            with_grad.append(p)
        for p in with_grad:
            if p.grad.ndim != 2:
                raise ValueError("Param gradient must be a 2D matrix")
        batch_of = {id(p): (b, i) for b in self._batches if b.group == gi
                    for i, p in enumerate(b.params)}
        for p in with_grad:
            state = self.state[p]
            if _KEY not in state:  # native: zeros_like(grad) at the first gradient
                member = batch_of.get(id(p))
                if (member is not None and _plain_matrix(p.grad, p)
                        and member[1] not in member[0].issued
                        and not torch.is_inference_mode_enabled()):
                    batch, i = member  # a slice is handed out once: a state deleted and
                    batch.issued.add(i)  # recreated gets native's own tensor, as the old
                    state[_KEY] = batch.views[i].zero_()  # slice may still be held
                else:
                    state[_KEY] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        hyper = hyper_of(group)
        lr = _compat.muon_to_scalar(group["lr"])
        updates: dict[int, Tensor] = {}
        started: set[int] = set()
        for p in with_grad:
            member = batch_of.get(id(p))
            if member is not None and id(member[0]) not in started:
                started.add(id(member[0]))
                if self._batched_now(member[0], group):
                    batch = member[0]
                    out = batched_updates([q.grad for q in batch.params], batch.buffer,
                                          **{k: hyper[k] for k in _UPDATE_KEYS})
                    updates.update(zip(map(id, batch.params), out.unbind(0)))
            update = updates.get(id(p))
            if update is None:
                _compat.muon_single_tensor([p], [p.grad], [self.state[p][_KEY]],
                                           lr=group["lr"], **hyper)
            else:
                apply_update(p, update, lr, hyper["weight_decay"], hyper["adjust_lr_fn"])

    def _batched_now(self, batch: _Batch, group: dict) -> bool:
        """Whether this step runs `batch` batched: every member has a plain gradient laid out as
        its parameter, every buffer is the batch's slice and no other matrix of the group holds
        one, no gradient shares memory with a parameter or momentum buffer of the group (native
        reads each gradient after updating the parameters before it), and the probe proved the
        batched form for this shape."""
        for i, p in enumerate(batch.params):
            grad = p.grad
            if grad is None or not _plain_matrix(grad, p):
                return False
            if not self._is_ours(batch, i, self.state[p].get(_KEY)):
                return False
        members, mine = set(map(id, batch.params)), batch.buffer.untyped_storage().data_ptr()
        for q in group["params"]:  # another matrix of the group steps, reads or is a slice
            if ((id(q) not in members and _KEY in self.state.get(q, {})
                 and self.state[q][_KEY].untyped_storage().data_ptr() == mine)
                    or q.untyped_storage().data_ptr() == mine
                    or (q.grad is not None and q.grad.untyped_storage().data_ptr() == mine)):
                return False
        written = {t.untyped_storage().data_ptr() for t in group["params"]}
        written.update(self.state[p][_KEY].untyped_storage().data_ptr()
                       for p in group["params"] if _KEY in self.state.get(p, {}))
        if any(p.grad.untyped_storage().data_ptr() in written for p in batch.params):
            return False
        rows, cols = batch.params[0].shape
        return batched_step_is_exact(batch.buffer.device, batch.buffer.dtype,
                                     len(batch.params), rows, cols, group)

    def _warn_buffer_overwrite(self) -> None:
        """`NativeBugWarning` (once per process) when a bfloat16 matrix with a gradient is in a
        group with ``nesterov=False`` and momentum != 0, and the probe finds the running torch
        overwrites the momentum buffer there (`cotangent.native_bugs`,
        "muon-bf16-buffer-overwrite"; fixed by pytorch/pytorch PR #194664). A momentum of 0
        reads the overwritten buffer nowhere (``lerp_(grad, 1)`` returns the gradient exactly),
        so it gets no warning."""
        for gi, group in enumerate(self.param_groups):
            if group["nesterov"] or not group["momentum"]:
                continue
            p = next((p for p in group["params"]
                      if p.dtype == torch.bfloat16 and p.grad is not None), None)
            if p is None:
                continue
            if native_bugs.present(native_bugs.MUON_BF16_BUFFER_OVERWRITE):
                rows, cols = p.shape
                native_bugs.warn_once(
                    native_bugs.MUON_BF16_BUFFER_OVERWRITE,
                    f"cotangent.Muon param group {gi} has bfloat16 ({rows}, {cols}) parameters, "
                    f"nesterov=False and momentum {group['momentum']}")
            return

    def batch_summary(self) -> list[dict]:
        """Per batch: group index, shape, members, dtype, device and whether the batched form
        is proven (None until the first step that needs the probe). Matrices in no batch (the
        only one of their shape in their group) are not listed: they always run per matrix."""
        self._refresh()
        out = []
        for batch in self._batches:
            group = self.param_groups[batch.group]
            rows, cols = batch.params[0].shape
            key = batched_key(batch.buffer.device, batch.buffer.dtype, len(batch.params),
                               rows, cols, hyper_of(group))
            out.append({"group": batch.group, "shape": [rows, cols],
                        "matrices": len(batch.params), "dtype": str(batch.buffer.dtype),
                        "device": str(batch.buffer.device), "batched": calibration.lookup(key)})
        return out


_UPDATE_KEYS = ("momentum", "nesterov", "ns_coefficients", "ns_steps", "eps")
# Matrices with a side under this are never batched: there `bmm` takes a small-matrix kernel
# that rounds some products unlike `mm` (a break-it review, AVX2 CPU, torch 2.13: 1 in about
# 40,000 gram elements for (1, 200), 3 in 160,000 for (2, 99)), too rarely for the probe's
# element budget to see; the batching gains little there anyway.
_MIN_BATCHED_SIDE = 16
