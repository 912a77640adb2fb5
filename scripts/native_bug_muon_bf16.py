"""Show torch.optim.Muon overwriting its momentum buffer (bfloat16 parameters, nesterov=False).

With ``nesterov=False`` the update handed to the Newton-Schulz step *is* the momentum buffer;
``_zeropower_via_newtonschulz`` converts it with ``.bfloat16()``, which returns the tensor
itself (no copy) when it is already bfloat16, and normalises that in place (``div_``): the
buffer then holds the normalised update instead of ``lerp(0, grad, 1 - momentum)``.
pytorch/pytorch PR #194664 makes that conversion a copy.

For each (dtype, nesterov, shape) this prints the momentum buffer after one step from zeros
with a gradient of ones and momentum 0.9 (lr 0, no weight decay) next to the expected
``zeros.lerp(grad, 0.1)``, for torch.optim.Muon and for cotangent.Muon (its batched path for
three equal matrices, and torch's own per-matrix function for a lone one), and whether the
bytes of the two optimizers agree. CPU only; no arguments.

    PYTHONPATH=src python3 scripts/native_bug_muon_bf16.py
"""

from __future__ import annotations

import torch
from torch import nn

import cotangent
from cotangent.verify import first_difference


def _one_step(cls, dtype, nesterov, shape, n):
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = cls(params, lr=0.0, weight_decay=0.0, momentum=0.9, nesterov=nesterov)
    opt.step()
    path = ""
    if isinstance(opt, cotangent.Muon):
        path = "batched" if opt.batch_summary()[0]["batched"] else "per-matrix"
    return params, [opt.state[p]["momentum_buffer"] for p in params], path


def main() -> None:
    print(f"torch {torch.__version__}")
    print(f"{'dtype':9} {'nesterov':8} {'shape':8} {'n':>2}  {'native buf':>10} "
          f"{'expected':>10} {'cotangent':>10}  {'path':10}  same bytes")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for nesterov in (False, True):
            for shape in ((8, 5), (5, 8), (8, 16)):  # tall (transposed in Newton-Schulz), wide
                for n in (3, 1):  # a batch of three, a lone matrix
                    expected = torch.zeros(shape, dtype=dtype).lerp_(
                        torch.ones(shape, dtype=dtype), 1 - 0.9)
                    pn, bn, _ = _one_step(torch.optim.Muon, dtype, nesterov, shape, n)
                    po, bo, path = _one_step(cotangent.Muon, dtype, nesterov, shape, n)
                    same = all(first_difference(a, b) is None
                               for a, b in zip(pn + bn, po + bo))
                    print(f"{str(dtype)[6:]:9} {str(nesterov):8} {f'{shape[0]}x{shape[1]}':8} "
                          f"{n:>2}  {bn[0][0, 0].item():10.6f} {expected[0, 0].item():10.6f} "
                          f"{bo[0][0, 0].item():10.6f}  {path:10}  {same}")


if __name__ == "__main__":
    main()
