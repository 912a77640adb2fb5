"""Native bugs Cotangent knowingly reproduces, and the warning it gives when one affects a run.

Cotangent's contract is native's bits, so where native PyTorch has a bug in a path Cotangent
reproduces, Cotangent reproduces the bug too (diverging would break the byte-for-byte
comparison against native), and says so: once per process and bug, a `NativeBugWarning`
naming the configuration and the upstream fix.

Whether the running torch still has a bug is decided by a probe of native behaviour, not by a
list of versions: a few-element call of native's own function, run the first time the question
is asked and cached in memory for the process (`present`). A torch that has the fix gets no
warning, and Cotangent follows it (see `cotangent.muon_batched.newton_schulz_batched`).

"Once" is kept here, in `_WARNED`, not left to Python's warning filters: the first call of
`warn_once` that gets past `warnings.warn` records the bug, and later calls return without
warning, whatever filters are active ("always" included). A filter that turns the warning into
an error raises on every affected call until the warning is let through or ignored (the
callers warn before they modify anything). The warning is attributed to the first frame
outside cotangent and torch (the user's ``optimizer.step()`` line, not torch's step wrapper).

Known reproduced bugs (`KNOWN`):
    muon-bf16-buffer-overwrite: `torch.optim.Muon` with bfloat16 parameters and
        ``nesterov=False`` overwrites the momentum buffer with the normalised update inside
        the Newton-Schulz step; fixed by pytorch/pytorch PR #194664.

Deliberate differences (native behaviour Cotangent does *not* reproduce) are not listed here;
see `cotangent.AdamW` (CPU fused AdamW and gradients with other strides, pytorch#106951).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["KNOWN", "MUON_BF16_BUFFER_OVERWRITE", "NativeBug", "NativeBugWarning", "present",
           "warn_once", "warned"]


class NativeBugWarning(UserWarning):
    """A native PyTorch bug that Cotangent reproduces (to keep native's bits) affects this run.

    Filter it like any warning category, e.g.
    ``warnings.filterwarnings("ignore", category=cotangent.native_bugs.NativeBugWarning)``."""


@dataclass(frozen=True)
class NativeBug:
    """One native bug Cotangent reproduces.

    Attributes:
        id: stable identifier (the key of `KNOWN`).
        affects: the configurations and torch versions it affects, in words.
        summary: one sentence on what native does (the warning's text).
        description: what native does, why, what it should do and what is not affected.
        upstream_fix: where it is fixed upstream.
        probe: zero-argument callable returning True where the running torch still has the bug
            (a few-element call of native's own code on CPU; run once, see `present`).
    """

    id: str
    affects: str
    summary: str
    description: str
    upstream_fix: str
    probe: Callable[[], bool]


MUON_BF16_BUFFER_OVERWRITE = "muon-bf16-buffer-overwrite"


def _muon_bf16_buffer_overwritten() -> bool:
    """One step of torch.optim.Muon's own per-matrix function (`_single_tensor_muon`, which
    cotangent.Muon falls back to; called directly, not through `_compat.muon_single_tensor`,
    so that the verdict is torch's) on a 2 x 2 bfloat16 matrix on CPU: ``nesterov=False``,
    momentum 0.9, a gradient of ones, lr 0, no Newton-Schulz iterations. True when the momentum
    buffer then differs (in any byte) from ``zeros.lerp(grad, 0.1)``, i.e. it was overwritten
    (torch 2.13 leaves 0.5, the normalised 0.1s, where 0.1 belongs)."""
    from cotangent import _compat  # torch.optim._muon's helpers

    with torch.no_grad():
        grad = torch.ones(2, 2, dtype=torch.bfloat16)
        buf = torch.zeros(2, 2, dtype=torch.bfloat16)
        expected = torch.zeros(2, 2, dtype=torch.bfloat16).lerp_(grad, 1 - 0.9)
        _compat._torch_single_tensor_muon(
            [torch.zeros(2, 2, dtype=torch.bfloat16)], [grad], [buf], lr=0.0, weight_decay=0.0,
            momentum=0.9, nesterov=False, ns_coefficients=(3.4445, -4.7750, 2.0315),
            ns_steps=0, eps=1e-7, adjust_lr_fn=None, has_complex=False)
        return not torch.equal(buf.view(torch.uint8), expected.view(torch.uint8))


KNOWN: dict[str, NativeBug] = {
    MUON_BF16_BUFFER_OVERWRITE: NativeBug(
        id=MUON_BF16_BUFFER_OVERWRITE,
        affects=("torch.optim.Muon with bfloat16 parameters, nesterov=False and momentum "
                 "!= 0, on any device (the aliasing is in Python, not in a kernel); torch "
                 "2.13 has it (the version it was found on), other versions are decided by "
                 "the probe"),
        summary=("torch.optim.Muon overwrites the momentum buffer with the normalised update "
                 "(.bfloat16() returns the buffer itself, which the Newton-Schulz step then "
                 "divides in place), so from the second step on the updates differ from the "
                 "intended ones"),
        description=(
            "with nesterov=False the update is the momentum buffer itself, and the "
            "Newton-Schulz step converts it with .bfloat16(), which returns the same tensor "
            "when it is already bfloat16, then normalises it in place (div_): the buffer keeps "
            "the normalised update, not the momentum average, and every later step blends the "
            "next gradient into that (one step from zeros with momentum 0.9 and a gradient of "
            "ones leaves 1/sqrt(numel) - 0.0884 for 8 x 16 - where 0.1 belongs). The first "
            "step's parameters are as intended; from the second step on they differ too. "
            "float16, float32 and float64 parameters are not affected (.bfloat16() copies "
            "them), nor is nesterov=True (the update is a new tensor), nor momentum 0 (the "
            "buffer is replaced by the gradient, exactly, before it is read)"),
        upstream_fix=("pytorch/pytorch PR #194664, \"[optim][muon] fix momentum buffer "
                      "aliasing in Newton-Schulz\" (the conversion copies)"),
        probe=_muon_bf16_buffer_overwritten),
}

_PRESENT: dict[str, bool] = {}  # bug id -> probe verdict, for this process
_WARNED: set[str] = set()  # bug ids warned about in this process


def present(bug_id: str) -> bool:
    """Whether the running torch has bug `bug_id` (`KNOWN[bug_id].probe()`, run on the first
    call and cached for the process).

    Raises:
        KeyError: an unknown bug id."""
    verdict = _PRESENT.get(bug_id)
    if verdict is None:
        verdict = bool(KNOWN[bug_id].probe())
        _PRESENT[bug_id] = verdict
    return verdict


_INTERNAL_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                       for f in (__file__, torch.__file__))  # the cotangent and torch packages


def warned(bug_id: str) -> bool:
    """Whether this process was already warned about bug `bug_id` (`warn_once`)."""
    return bug_id in _WARNED


def _stacklevel() -> int:
    """`warnings.warn`'s stacklevel, called from `warn_once`, that names the first frame
    outside the cotangent and torch packages."""
    level, frame = 1, sys._getframe(1)  # frame: warn_once
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _INTERNAL_DIRS):
        frame = frame.f_back
        level += 1
    return level


def warn_once(bug_id: str, context: str) -> bool:
    """Warn (`NativeBugWarning`) that bug `bug_id` affects this run, unless this process was
    already warned about it. The message names the bug, `context` (which configuration hit it),
    what native does (`NativeBug.summary`), that Cotangent keeps native's bits, and the
    upstream fix.

    Returns True when it warned. Callers check `present(bug_id)` first; this does not probe.

    Raises:
        KeyError: an unknown bug id.
        NativeBugWarning: where a warnings filter turns it into an error (not recorded as
            warned, so the next affected call raises again)."""
    if bug_id in _WARNED:
        return False
    bug = KNOWN[bug_id]
    warnings.warn(f"native PyTorch bug reproduced ({bug.id}): {context}; {bug.summary}. "
                  "Cotangent keeps native's bits (its contract), so this run has the bug too. "
                  f"Upstream fix: {bug.upstream_fix}. Details: "
                  f"cotangent.native_bugs.KNOWN[{bug.id!r}].description. (Warned once per "
                  "process.)", NativeBugWarning, stacklevel=_stacklevel())
    _WARNED.add(bug_id)
    return True
