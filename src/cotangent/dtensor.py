"""FSDP2 (`torch.distributed.fsdp.fully_shard`) parameters: AdamW on each rank's local shards,
and the clip's total norm reduced across ranks exactly as native's clip of DTensor gradients
reduces it.

What native does with DTensor parameters (read from torch 2.13.0's DTensor op strategies and
checked byte for byte on two gloo ranks in ``tests/test_distributed.py``):

- AdamW (for-loop, foreach and fused): every op dispatches to the same ATen op over the local
  shards (pointwise and foreach strategies keep the shard placement), with the step tensors
  plain 0-d tensors; so AdamW over the local tensors gives native's bits on every rank.
- ``clip_grad_norm_``: the per-tensor norms (``torch._foreach_norm``: DTensor is a foreach
  type) run on the local shards and come out partial (a shard's norm: `_NormPartial(p)`,
  ``Partial("max")`` for inf); ``torch.stack`` keeps them partial; for a p-norm
  ``vector_norm`` of that stack first redistributes it to Replicate (``x ** p``, one
  all-reduce of sums over the whole stack, ``** (1 / p)``: seen with `CommDebugMode`, one
  collective per clip), then norms it on every rank alike; for inf the norm of the local
  maxima stays ``Partial("max")`` (the total norm native returns holds each rank's own
  maximum) until the coefficient's ``+ 1e-6`` reduces it; the multiply is a local op by the
  replicated coefficient. Cotangent computes the local norms its own way (native's bits) and
  hands the stack to DTensor for the rest, so every reduction is DTensor's own code.

Only ``Shard(0)`` (FSDP2's placement) and ``Replicate`` (HSDP's replica dimension) are
followed; other placements (tensor parallelism) are refused, as are partial gradients.
"""

from __future__ import annotations

import sys
from itertools import repeat

from torch import Tensor

from cotangent import _compat


_DTENSOR: list = []  # the DTensor class, once torch.distributed.tensor is imported


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (without importing torch.distributed when nothing has)."""
    if not _DTENSOR:
        module = sys.modules.get("torch.distributed.tensor")
        if module is None or not hasattr(module, "DTensor"):
            return False
        _DTENSOR.append(module.DTensor)
    return isinstance(t, _DTENSOR[0])


def any_dtensor(tensors) -> bool:
    """Whether any of `tensors` is a DTensor (one C-level pass; False without importing
    torch.distributed when nothing has)."""
    is_dtensor(None)  # (finds the DTensor class once torch.distributed.tensor is imported)
    return bool(_DTENSOR) and any(map(isinstance, tensors, repeat(_DTENSOR[0])))


def local(t: Tensor) -> Tensor:
    """`t`'s local tensor where `t` is a DTensor (the tensor itself, not a copy), else `t`."""
    return _compat.dtensor_local(t) if is_dtensor(t) else t


def placed_as(t, like: Tensor) -> bool:
    """Whether `t` is a DTensor on DTensor `like`'s mesh with `like`'s placements."""
    return (is_dtensor(t) and t.device_mesh == like.device_mesh
            and tuple(t.placements) == tuple(like.placements))


def placement_refusal(p: Tensor, what: str = "parameter") -> str | None:
    """Why a DTensor parameter (or gradient, `what`) cannot be followed, or None: every mesh
    dimension must place it ``Shard(0)`` or ``Replicate()``."""
    placements = tuple(p.placements)
    if placements in _FOLLOWED:
        return None
    from torch.distributed.tensor import Replicate, Shard

    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) or (isinstance(placement, Shard)
                                                 and placement.dim == 0):
            continue
        return (f"is a DTensor {what} placed {placement!r} on mesh dimension {dim}: "
                "cotangent.AdamW follows FSDP2's Shard(0) and Replicate placements only (tensor "
                "parallelism and partial gradients are not supported; use torch.optim.AdamW)")
    _FOLLOWED.add(placements)
    return None


_FOLLOWED: set = set()  # placement tuples `placement_refusal` accepted


def gradient_refusal(p: Tensor) -> str | None:
    """Why the gradient of DTensor parameter `p` cannot be followed, or None: it must be a
    DTensor on `p`'s mesh with `p`'s placements (what FSDP2's reduce-scatter leaves)."""
    g = p.grad
    if not is_dtensor(g):
        return ("is a DTensor parameter whose gradient is a plain tensor: native's AdamW "
                "raises mixing DTensor and Tensor; cotangent.AdamW refuses it before anything "
                "changes")
    if not placed_as(g, p):
        return (f"is placed {tuple(p.placements)} on {p.device_mesh} and its gradient "
                f"{tuple(g.placements)} on {g.device_mesh}: not followed")
    return placement_refusal(g, "gradient")


def clip_mesh_gradient(grads: list[Tensor]) -> Tensor | None:
    """The clip's DTensor gradient that stands for all of them (they share its mesh and
    placements, which `spread_stack` follows), or None when none is a DTensor.

    Raises:
        RuntimeError: DTensor and plain gradients in one clip, or DTensor gradients on other
            meshes or placements (native's ``torch.stack`` of their norms would redistribute
            them in ways not followed here).
    """
    if not any_dtensor(grads):  # (one C-level pass: the plain case)
        return None
    spread = [g for g in grads if is_dtensor(g)]
    first = spread[0]
    if len(spread) != len(grads):
        raise RuntimeError("the clip meets DTensor and plain gradients together: native's "
                           "clip_grad_norm_ raises mixing DTensor and Tensor; cotangent.AdamW "
                           "refuses it before anything changes")
    for g in spread:
        if not placed_as(g, first):
            raise RuntimeError(
                f"the clip meets DTensor gradients placed {tuple(first.placements)} on "
                f"{first.device_mesh} and {tuple(g.placements)} on {g.device_mesh}: "
                "cotangent.AdamW follows one mesh and one placement per clip")
        problem = placement_refusal(g, "gradient")
        if problem:
            raise RuntimeError(f"a gradient of the clip {problem}")
    return first


def spread_stack(stacked: Tensor, like: Tensor, norm_type: float) -> Tensor:
    """`stacked`, the 1-D stack of the local shards' norms (native's local bits) of DTensor
    gradients placed as `like` (`clip_mesh_gradient`), as the DTensor native's ``torch.stack``
    of their norms makes: partial (`_compat.norm_reduction_placement`) on every mesh dimension
    that shards the gradients, replicated on the others. Its ``vector_norm``, the clip
    coefficient's ops and their reduction then run in DTensor's own code, as in native's clip
    (for a p-norm: ``x ** p``, one all-reduce of sums over the stack, ``** (1 / p)``, then the
    norm; for inf the norm of the local maxima stays partial until the coefficient's add)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    partial = _compat.norm_reduction_placement(norm_type)
    placements = [partial if isinstance(pl, Shard) else Replicate() for pl in like.placements]
    return DTensor.from_local(stacked, like.device_mesh, placements, run_check=False)


def replicated(t) -> bool:
    """Whether `t` is a DTensor replicated on every dimension of its mesh (every rank holds
    its whole value)."""
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) for p in t.placements)


def replicated_local(t: Tensor) -> Tensor:
    """The value of DTensor `t` on every rank (reduced where it is partial: a collective), as a
    local tensor; a plain `t` as it is."""
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    mesh = t.device_mesh
    return _compat.dtensor_local(t.redistribute(mesh, [Replicate()] * mesh.ndim))


__all__ = ["clip_mesh_gradient", "gradient_refusal", "is_dtensor", "local", "placed_as",
           "placement_refusal", "replicated", "replicated_local", "spread_stack"]
