"""Cotangent: a fast update phase (gradient clipping + AdamW) bitwise equal to native PyTorch.

Public API:
    AdamW: drop-in for ``clip_grad_norm_`` + ``torch.optim.AdamW``, on the tensors where they are.
    clip_grad_norm_, get_total_norm, clip_grads_with_norm_: drop-ins for the torch.nn.utils
        functions, with batched norms only where a calibration probe proved them native's bits.
    verify: prove native == Cotangent bit for bit on your own model, step by step.
    ReferenceUpdate: the readable native path (clip_grad_norm_ + torch.optim.AdamW) it is tested
        against.
    Muon: drop-in for ``torch.optim.Muon`` with batched Newton-Schulz, gradients read in place.
    MuonAdamW: nanochat's Muon + AdamW optimizer (its published stack/copy step).
    memory: the saved-tensor storage audit (``cotangent.memory.audit``).
    occurrence: per-occurrence gradient aggregation for shared parameters.
    native_bugs, NativeBugWarning: the native PyTorch bugs Cotangent reproduces (to keep
        native's bits) and the warning it gives, once per process, when one affects a run.

The packed design of the seed study (parameters moved into flat buffers, every gradient copied
in by hooks) is no longer part of the library: it lives on as the harness's factorial arms,
``cotangent.harness.packed.PackedAdamW``.
"""

from cotangent._version import __version__
from cotangent.clip import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from cotangent import memory, native_bugs, occurrence
from cotangent.muon import Muon
from cotangent.native_bugs import NativeBugWarning
from cotangent.muon_adamw import MuonAdamW
from cotangent.adamw import AdamW
from cotangent.reference import ReferenceUpdate
from cotangent.verify import verify

__all__ = ["AdamW", "Muon", "MuonAdamW", "NativeBugWarning", "ReferenceUpdate",
           "clip_grad_norm_", "memory", "native_bugs", "occurrence", "clip_grads_with_norm_", "get_total_norm", "verify", "__version__"]


def __getattr__(name: str):
    if name == "PackedAdamW":
        raise AttributeError(
            "cotangent.PackedAdamW left the library (issue 26: gradients are read where autograd "
            "leaves them); use cotangent.AdamW, or for the seed study's packed design the "
            "harness's cotangent.harness.packed.PackedAdamW (needs the harness extra)",
            name=name)
    raise AttributeError(f"module 'cotangent' has no attribute {name!r}", name=name)
