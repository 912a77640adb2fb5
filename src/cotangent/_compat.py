"""The one place where Cotangent touches private PyTorch APIs.

Every private name used by the library is imported here, so that a torch upgrade that moves or
changes one breaks a single, small module (and its test) instead of the whole library.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Groups tensors by (device, dtype) exactly as `torch.nn.utils.clip_grad_norm_` and the
# foreach/fused optimizers do. The order of the returned groups decides the order in which
# native clipping stacks per-tensor norms, and so the bits of the total norm
# (../shared/notes/native-numerics.md, item 2). We reuse the helper instead of re-deriving it.
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
from torch.utils._foreach_utils import _has_foreach_support as _torch_has_foreach_support
from torch.utils._foreach_utils import _device_has_foreach_support


def group_by_device_and_dtype(tensors: list[Tensor]) -> list[tuple[torch.device, torch.dtype, list[int]]]:
    """Native (device, dtype) grouping of `tensors`, in native group order.

    Returns a list of `(device, dtype, indices)` where `indices` are positions in `tensors`, in the
    order native code visits them (`torch.utils._foreach_utils._group_tensors_by_device_and_dtype`
    with `with_indices=True`).
    """
    grouped = _group_tensors_by_device_and_dtype([list(tensors)], with_indices=True)
    return [(device, dtype, list(indices)) for (device, dtype), (_, indices) in grouped.items()]


def foreach_norm_is_used(tensors: list[Tensor], device: torch.device, foreach: bool | None) -> bool:
    """Whether `clip_grad_norm_(..., foreach=foreach)` takes `torch._foreach_norm` for this group.

    Mirrors the branch in `torch.nn.utils.clip_grad._get_total_norm` (torch 2.4-2.13); raises
    RuntimeError like native code when `foreach=True` is impossible on `device`.
    """
    if foreach is None:
        return _torch_has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return bool(foreach)


def foreach_norm(tensors: list[Tensor], ord: float) -> list[Tensor]:
    """`torch._foreach_norm`: one norm per tensor, as native clipping computes them."""
    return list(torch._foreach_norm(tensors, ord))


def check_fused_support(p: Tensor) -> None:
    """Native check run when fused AdamW initialises a parameter's state (raises RuntimeError)."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    _device_dtype_check_for_fused(p)


def new_step_tensor(p: Tensor, *, fused: bool, capturable: bool) -> Tensor:
    """A zero `step` counter placed and typed as `torch.optim.Adam._init_group` places it.

    Fused or capturable: 0-dim on the parameter's device in `_get_scalar_dtype(is_fused=True)`;
    otherwise a 0-dim CPU tensor in `_get_scalar_dtype()` (float32, or float64 when that is the
    default dtype).
    """
    from torch.optim.optimizer import _get_scalar_dtype

    if fused or capturable:
        return torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
    return torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")


def foreach_mul_(tensors: list[Tensor], scalar: Tensor) -> None:
    """`torch._foreach_mul_`: native clipping's per-gradient multiply."""
    torch._foreach_mul_(tensors, scalar)


def default_foreach(params: list[Tensor], differentiable: bool) -> bool:
    """Whether native optimizers default to foreach for `params` (foreach=None, fused unset)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(params, differentiable, use_fused=False)[1]


def queue_backward_callback(fn) -> None:
    """Run `fn()` once the current backward pass has finished (called from inside a hook).

    The autograd engine's `queue_callback`, the mechanism DistributedDataParallel uses to act
    at the end of backward.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def fused_adamw_one_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                          exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor],
                          steps: list[Tensor], *, amsgrad: bool, beta1, beta2, lr,
                          weight_decay: float, eps: float, maximize: bool) -> None:
    """The body of `torch.optim.adam._fused_adam` (decoupled weight decay, no grad scaler) for
    tensors of one device and dtype: increment the steps, then one `torch._fused_adamw_` call.

    Skips the per-call Python of the functional path; `cotangent.coalesce.calibrate_direct`
    proves it bitwise equal to that path before it is used.
    """
    device = params[0].device
    if isinstance(lr, Tensor) and lr.device.type != "cpu":
        lr = lr.to(device=device, non_blocking=True)
    beta1 = beta1.item() if isinstance(beta1, Tensor) else beta1
    beta2 = beta2.item() if isinstance(beta2, Tensor) else beta2
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                        amsgrad=amsgrad, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, maximize=maximize)


def has_step_pre_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any step pre-hook (global or on `optimizer`) will run before its step body."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    return bool(_global_optimizer_pre_hooks) or bool(optimizer._optimizer_step_pre_hooks)
