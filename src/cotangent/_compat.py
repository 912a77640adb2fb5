"""The one place where Cotangent touches private PyTorch APIs.

Every private name used by the library is imported here, so that a torch upgrade that moves or
changes one breaks a single, small module (and its test) instead of the whole library.
"""

from __future__ import annotations

import contextlib
import sys
from itertools import chain

import torch
from torch import Tensor
# (the step hooks' registries: module-level dicts torch fills in place, read at every step)
from torch.optim import optimizer as _optimizer_module

# Groups tensors by (device, dtype) exactly as `torch.nn.utils.clip_grad_norm_` and the
# foreach/fused optimizers do. The order of the returned groups decides the order in which
# native clipping stacks per-tensor norms, and so the bits of the total norm (on torch 2.13 the
# groups come out in reverse order of first appearance). We reuse the helper instead of
# re-deriving that order.
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


def foreach_add_(tensors: list[Tensor], scalar) -> None:
    """`torch._foreach_add_`: on the CPU a loop of `add_` in C++ (the step counters'
    ``step_t += 1``)."""
    torch._foreach_add_(tensors, scalar)


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


def graph_task_id() -> int | None:
    """The id of the autograd graph task (one backward pass) running the calling hook, unique in
    the process (`torch._C._current_graph_task_id`); None where torch lacks it."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return None if current is None else current()


def post_accumulate_grad_hook_count(p: Tensor) -> int:
    """How many post-accumulate-grad hooks `p` has (`Tensor._post_accumulate_grad_hooks`)."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    return len(hooks) if hooks else 0


def fused_adamw_one_group(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                          exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor],
                          steps: list[Tensor], *, amsgrad: bool, beta1, beta2, lr,
                          weight_decay: float, eps: float, maximize: bool) -> None:
    """The body of `torch.optim.adam._fused_adam` (decoupled weight decay, no grad scaler) for
    tensors of one device and dtype: increment the steps, then one `torch._fused_adamw_` call.

    Skips the per-call Python of the functional path; `cotangent.merge.direct_fused_is_exact`
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


def unscale_grads_(grads: list[Tensor], grad_scale: Tensor) -> None:
    """Divide gradients by a GradScaler scale exactly as `torch.amp.GradScaler.unscale_` does.

    `GradScaler.unscale_` computes ``inv_scale = scale.double().reciprocal().float()`` (plain
    ``reciprocal()`` on MPS), groups the gradients by device and dtype and calls
    `torch._amp_foreach_non_finite_check_and_unscale_` on each group (a per-element multiply; the
    inf/NaN flag it also writes is discarded here: the caller already has GradScaler's own).
    """
    if not grads:
        return
    if grad_scale.device.type == "mps":
        inv_scale = grad_scale.reciprocal()
    else:
        inv_scale = grad_scale.double().reciprocal().float()
    for device, _, indices in group_by_device_and_dtype(grads):
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            [grads[i] for i in indices], found_inf, inv_scale.to(device))


def has_step_pre_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether any step pre-hook (global or on `optimizer`) will run before its step body."""
    return (bool(_optimizer_module._global_optimizer_pre_hooks)
            or bool(optimizer._optimizer_step_pre_hooks))


def with_step_hooks(body):
    """Wrap a step body as torch wraps every optimizer's `step`: a profiler range, the global
    and per-optimizer step pre-hooks (which may replace the arguments), the body, the
    optimizer's step counter for LR schedulers, then the post-hooks
    (`torch.optim.Optimizer.profile_hook_step`)."""
    return torch.optim.Optimizer.profile_hook_step(body)


def run_with_step_hooks(optimizer: torch.optim.Optimizer, body, args: tuple, kwargs: dict):
    """What torch wraps around every optimizer's step body (`Optimizer.profile_hook_step`,
    torch 2.4-2.13): a profiler range named ``Optimizer.step#<class>.step``, the global then
    per-optimizer step pre-hooks (each called as ``hook(optimizer, args, kwargs)``, where
    `args` starts with the optimizer; one may return new ``(args, kwargs)``), then
    ``body(*args[1:], **kwargs)``, the step counter LR schedulers read, then the per-optimizer
    and global post-hooks. Returns the body's result.

    Raises:
        RuntimeError: a pre-hook returned something other than None or a pair (native message).
    """
    name = f"Optimizer.step#{type(optimizer).__name__}.step"
    with torch.autograd.profiler.record_function(name):
        for pre_hook in chain(_optimizer_module._global_optimizer_pre_hooks.values(),
                              optimizer._optimizer_step_pre_hooks.values()):
            result = pre_hook(optimizer, args, kwargs)
            if result is not None:
                if isinstance(result, tuple) and len(result) == 2:
                    args, kwargs = result
                else:
                    raise RuntimeError(f"{body} must return None or a tuple of (new_args, "
                                       f"new_kwargs), but got {result}.")
        out = body(*args[1:], **kwargs)
        optimizer._optimizer_step_code()
        for post_hook in chain(optimizer._optimizer_step_post_hooks.values(),
                               _optimizer_module._global_optimizer_post_hooks.values()):
            post_hook(optimizer, args, kwargs)
        return out


def graph_capture_health_check(optimizer: torch.optim.Optimizer) -> None:
    """Native's first act in `torch.optim.AdamW.step`: refuse CUDA/XPU graph capture of a step
    whose groups are not all capturable (`Optimizer._accelerator_graph_capture_health_check`,
    torch 2.7-2.13; `_cuda_graph_capture_health_check` before)."""
    check = getattr(optimizer, "_accelerator_graph_capture_health_check", None)
    if check is None:
        check = optimizer._cuda_graph_capture_health_check
    check()


def mark_step_hooked(step) -> None:
    """Tell `torch.optim.Optimizer` not to wrap `step` again: it already runs the hooks (torch
    patches every subclass's `step` whose function lacks the `hooked` attribute)."""
    step.hooked = True


def tensor_kind_refusal(p: Tensor) -> str | None:
    """Why a parameter of this tensor kind cannot be packed, or None when it can.

    Refused: DTensor (FSDP2 `fully_shard`, tensor parallelism), other tensor subclasses that
    wrap their data (their storage is not the parameter's values), and the uninitialised
    parameters of lazy modules.
    """
    if isinstance(p, torch.nn.parameter.UninitializedTensorMixin):
        return ("is an uninitialised parameter of a lazy module (e.g. nn.LazyLinear); run a "
                "forward pass to materialise the model, then build cotangent.AdamW")
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(p, getattr(dtensor, "DTensor", ())):
        return ("is a DTensor (FSDP2 `fully_shard` or tensor parallelism); cotangent.AdamW does "
                "not support FSDP2 / DTensor parameters: use torch.optim.AdamW for this model, "
                "or DistributedDataParallel with cotangent.AdamW (shard='zero1' shards the "
                "optimizer state across ranks)")
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(p):
        return (f"is a tensor subclass that wraps its data ({type(p).__name__}); only plain "
                "dense tensors can be packed")
    return None


def _compile_refusal(what: str):
    """A function Dynamo refuses to trace (`torch._dynamo.forbid_in_graph` sets the same
    attribute; setting it directly avoids importing Dynamo with the library). Tracing a call to
    it stops the compilation with an error that shows its name: this message."""
    def refusal() -> None:
        raise RuntimeError(f"{what} cannot run inside torch.compile")

    refusal._dynamo_forbidden = True
    refusal.__qualname__ = (
        f"{what} cannot run inside torch.compile: Cotangent's packed update is eager code "
        "proven against eager native AdamW, and a compiled native step rounds differently; "
        "compile the model and call the optimizer outside the compiled function")
    return refusal


_REFUSALS = {what: _compile_refusal(what) for what in (
    "cotangent.AdamW.step()", "cotangent.AdamW.zero_grad()", "cotangent.AdamW.clip_grad_norm_()")}


def refuse_under_compile(what: str) -> None:
    """Stop torch.compile (Dynamo) when it traces into `what` (one of `_REFUSALS`' keys)."""
    if torch.compiler.is_compiling():
        _REFUSALS[what]()


def built_by_zero_redundancy_optimizer() -> bool:
    """Whether the optimizer constructor calling this runs inside a
    `torch.distributed.optim.ZeroRedundancyOptimizer`, which builds one local optimizer per rank
    over that rank's shard of the parameters (its ``_optim_constructor`` call; torch has no
    public way to tell): a frame on the stack whose ``self`` is one. False when that module was
    never imported."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if module is None:
        return False
    zero = module.ZeroRedundancyOptimizer
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), zero):
            return True
        frame = frame.f_back
    return False


def storage_identity(t: Tensor) -> tuple:
    """A key for `t`'s storage: (device, data pointer), or, for storages without data (meta
    tensors, zero bytes: their pointer is 0), the storage object's own C++ address
    (`UntypedStorage._cdata`)."""
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    return (str(t.device), ptr) if ptr else (str(t.device), "storage", storage._cdata)


def is_compiled(fn) -> bool:
    """Whether `fn` is what `torch.compile` returned (a module wrapper or a function)."""
    return hasattr(fn, "_orig_mod") or hasattr(fn, "_torchdynamo_orig_callable")


# torch.optim.Muon's own helpers (torch/optim/_muon.py): its per-matrix step, learning-rate
# adjustment and hyperparameter normalisation. `cotangent.Muon` calls the native step itself
# wherever its batched form is not proven, so those matrices get native's bits by construction.
from torch.optim._muon import _adjust_lr as muon_adjust_lr  # noqa: E402, F401
from torch.optim._muon import _single_tensor_muon as _torch_single_tensor_muon  # noqa: E402
from torch.optim.optimizer import _to_scalar as muon_to_scalar  # noqa: E402, F401


def muon_single_tensor(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], *, lr,
                       weight_decay: float, momentum: float, nesterov: bool,
                       ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                       adjust_lr_fn: str | None) -> None:
    """torch.optim.Muon's for-loop step (`_single_tensor_muon`) on real parameters."""
    _torch_single_tensor_muon(params, grads, bufs, lr=lr, weight_decay=weight_decay,
                              momentum=momentum, nesterov=nesterov,
                              ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps,
                              adjust_lr_fn=adjust_lr_fn, has_complex=False)


@contextlib.contextmanager
def compiled_strictly(active: bool):
    """While `active`: a torch.compile'd call that would exceed Dynamo's recompile limit raises
    (``torch._dynamo.config.fail_on_recompile_limit_hit``) instead of silently running eager,
    whose bits may differ from the compiled code's."""
    if not active:
        yield
        return
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        raise RuntimeError(
            "MuonAdamW(compile=True): Dynamo's recompile limit "
            f"({torch._dynamo.config.recompile_limit}) is reached by the compiled step "
            "functions, which every MuonAdamW in this process shares (one variant per Muon "
            "group shape and AdamW parameter shape); step inside "
            "`with cotangent.muon_adamw.recompile_room(*optimizers):`, raise "
            "torch._dynamo.config.recompile_limit, or call torch._dynamo.reset() between "
            "models. Nothing ran eagerly; the groups before this one were already updated "
            "in this step, so restore a checkpoint before continuing.") from exc


def foreach_copy_(dst: list[Tensor], src: list[Tensor]) -> None:
    """`torch._foreach_copy_`: the copy back into the parameters that MuonAdamW's published
    (reference) path makes after stepping its stacks; small fresh gradients into their flat
    buffer views at the end of a backward."""
    torch._foreach_copy_(dst, src)


def recompile_limit() -> int:
    """Dynamo's current recompile limit (variants per code object)."""
    config = torch._dynamo.config
    return getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8))


@contextlib.contextmanager
def recompile_limit_at_least(needed: int):
    """Dynamo's recompile limit raised to at least `needed` inside the block. MuonAdamW's
    compiled step functions are shared by every MuonAdamW in the process (Dynamo counts
    variants per code object): one variant per Muon group shape and AdamW parameter shape
    (`MuonAdamW.compiled_variants()`), so several optimizers together can need more than the
    default 8; past the limit `compiled_strictly` raises instead of running eager."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if needed <= getattr(config, name):
        yield
        return
    with config.patch(**{name: needed}):
        yield


def mkl_vms_sqrt_address() -> int | None:
    """Address of MKL's `vmsSqrt` (float32 square roots of a vector) inside this torch build's
    `libtorch_cpu` shared library: the function ATen's CPU `torch.sqrt` calls for float32
    (`ATen/cpu/vml.h`) where torch is built with MKL. None when the library or the symbol is
    not there (another build, another platform). The single-pass AdamW kernel
    (`cotangent.singlepass`) calls it to get `torch.sqrt`'s bits; `singlepass.sqrt_kind` proves
    that it does before it is used."""
    import ctypes
    from pathlib import Path

    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            lib = ctypes.CDLL(str(lib_dir / name))
            return ctypes.cast(lib.vmsSqrt, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    return None



def cxx11_abi() -> int:
    """1 if this torch was built with the C++11 std::string ABI (``_GLIBCXX_USE_CXX11_ABI``),
    else 0: what code compiled against its headers must be built with
    (`cotangent.tensorlists`; torch 2.x reports it as ``torch._C._GLIBCXX_USE_CXX11_ABI``)."""
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


def default_torch_functions() -> tuple:
    """The `__torch_function__` implementations of plain tensors: torch.Tensor's (its function)
    and the one that disables it (``torch._C._disabled_torch_function_impl``, nn.Parameter's);
    a subclass with any other runs code of its own on every torch op."""
    return (Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


class grad_disabled:
    """``torch.no_grad()`` as a plain context manager (the grad mode saved, switched off,
    restored: what `torch.no_grad`'s enter and exit do, without its decorator machinery, a
    handful of Python calls at every step)."""

    __slots__ = ("prev",)

    def __enter__(self) -> None:
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        torch._C._set_grad_enabled(self.prev)


def torch_modes_active() -> bool:
    """Whether a `TorchFunctionMode` or `TorchDispatchMode` is active on this thread (a
    profiler's or flop counter's, or one that computes otherwise): native's ops and its
    ``.grad`` reads then run through the mode's code, which the single pass, the C++ norms
    and list readers would skip."""
    return torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack() > 0


def default_torch_dispatch():
    """torch.Tensor's `__torch_dispatch__` (``torch._C._disabled_torch_dispatch_impl``): a
    subclass with any other has its own code on every ATen op (the Python dispatch key)."""
    return torch._C._disabled_torch_dispatch_impl


def is_zerotensor(t: Tensor) -> bool:
    """Whether `t` is a ZeroTensor (``torch._efficientzerotensor``: no memory behind it, its
    data pointer null, immutable)."""
    return t._is_zerotensor()


def dtensor_local(t: Tensor) -> Tensor:
    """A DTensor's local tensor itself (``t._local_tensor``: what ``t.to_local()`` returns under
    ``torch.no_grad()``, without the autograd wrapper it adds with gradients enabled)."""
    return t._local_tensor


def norm_reduction_placement(norm_type: float):
    """The placement DTensor gives the norm of a shard of order `norm_type` (a partial norm:
    `_NormPartial(p)`, ``Partial("max")`` for inf, ``Partial("sum")`` for 0; torch 2.13's
    `torch.distributed.tensor._ops._math_ops`), whose redistribution to Replicate is the
    reduction native's clip of DTensor gradients runs."""
    from torch.distributed.tensor._ops import _math_ops

    return _math_ops.get_placement_from_reduction_op(_math_ops._get_norm_reduction_op(norm_type))


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether some elements of `t` share memory (an expanded tensor): what ATen's in-place ops
    refuse (`at::assert_no_internal_overlap`, MemOverlap::Yes; "too hard" counts as no, as
    there), through `torch._debug_has_internal_overlap` (torch 2.4-2.13: 0 no, 1 yes, 2 too
    hard)."""
    return torch._debug_has_internal_overlap(t) == 1
