"""The seed study's packed design, kept as the factorial's ``packing-only`` and ``packed`` arms.

`PackedAdamW` moves every parameter into one flat buffer per (device, dtype) (`layout`, `store`),
copies each backward's gradient into a matching buffer by hooks (`tracking`), norms and clips
over those buffers (`norms`, `clipping`) and plans its AdamW calls over them (`plan`). It gives
native's bits like `cotangent.AdamW`, but holds a gradient-sized buffer through the forward and
pays a copy of every gradient in each backward; issue 26 replaced it in the library by
`cotangent.AdamW`, which reads gradients where autograd leaves them. It is here so that the 2x2
factorial {batched norms} x {packing} stays measurable.
"""

from cotangent.harness.packed.optim import PackedAdamW

__all__ = ["PackedAdamW"]
