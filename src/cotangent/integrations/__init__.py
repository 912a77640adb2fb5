"""Optional integrations with training frameworks.

Each submodule imports its framework when it is imported itself (``import cotangent`` needs
torch alone): ``cotangent.integrations.hf`` (`CotangentTrainer`) needs
``pip install 'cotangent[hf]'``; ``cotangent.integrations.lightning`` (`CotangentClipping`) is
for ``pip install 'cotangent[lightning]'``.
"""


def clip_follows(opt, params) -> bool:
    """Whether `cotangent.AdamW` `opt`'s clip takes the parameters that have gradients in the
    order of `params` (an iterable of tensors), as ``clip_grad_norm_(params, ...)`` would, so
    both norms have the same bits. Identity of tensors is compared, not values."""
    from cotangent.gather import clip_order

    ours = [p for p in clip_order(opt) if p.grad is not None]
    theirs = [p for p in params if p.grad is not None]
    return len(ours) == len(theirs) and all(map(lambda a, b: a is b, ours, theirs))
