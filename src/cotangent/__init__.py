"""Cotangent: a fast update phase (gradient clipping + AdamW) bitwise equal to native PyTorch.

Public API:
    AdamW: drop-in for ``clip_grad_norm_`` + ``torch.optim.AdamW`` over packed flat buffers.
    ReferenceUpdate: the readable native path (clip_grad_norm_ + torch.optim.AdamW) it is tested
        against.
"""

from cotangent.optim import AdamW
from cotangent.reference import ReferenceUpdate

__all__ = ["AdamW", "ReferenceUpdate", "__version__"]
__version__ = "0.1.0"
