"""Adversarial checks of how the single-pass AdamW kernel splits its blocks among OpenMP threads
(`for_each_block` in `cotangent.singlepass`: by cumulative element count, each thread taking
the blocks whose first element lies in its share, since commit 07e7746). Which thread updates
an element must not change its bits, no block may be skipped or done twice, and threads with
empty shares must do nothing.

The review found no divergence (torch 2.13.0+cpu, 2-core AVX-512 CPU): 792 combinations of the
layouts below x float32/bfloat16 x for-loop/foreach x clip or not x amsgrad x 1-4 threads x
gradients missing on some steps, plus 7 and 16 threads, OMP_THREAD_LIMIT=1 and 3 below torch's
count, and direct kernel calls with empty and zero-length segments, all byte-equal to native.
Kept here, the strongest of them:
- `test_split_layouts`: `cotangent.AdamW` against ``clip_grad_norm_`` + ``torch.optim.AdamW``
  on layouts made to stress the split (120 1-element or tiny tensors with one large
  one first, last or in the middle, tensors of exactly one block (16384) and one more, shares
  ending exactly on a block start, a single 1-element tensor: every other thread's share
  empty), at 1-4 and 16 threads, with some gradients None (the pass covers a subset);
- `test_direct_kernel_segments`: `single_pass_adamw_` itself with an empty segment list, an
  empty buffer, zero-length segments and padding (never read or written) against native
  `torch.optim.adam.adam` on each segment;
- `test_omp_thread_limit_with_many_small_tensors`: a team smaller than torch's thread count;
- a control: the comparison reports another lr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cotangent
from bitwise import assert_same_bits, require_single_pass_kernel, run_against_native, threads
from cotangent import singlepass as sp

require_single_pass_kernel()

BLOCK = 16384  # the kernel's block (elements per array)


def _tiny(count: int, seed: int = 1) -> list[tuple[int, ...]]:
    sizes = torch.randint(1, 18, (count,), generator=torch.Generator().manual_seed(seed))
    return [(int(s),) for s in sizes]


# (id, shapes, thread counts)
LAYOUTS = [
    ("120 x 1-element, large last", [(1,)] * 120 + [(40003,)], (2,)),
    ("large first, 120 x 1-element", [(40003,)] + [(1,)] * 120, (4,)),
    ("tiny 1..17 around a large one", _tiny(60) + [(40003,)] + _tiny(60, 2), (3,)),
    ("2 blocks exactly (share ends on a block start)", [(BLOCK,), (BLOCK,)], (2,)),
    ("4 blocks exactly at 4 threads", [(BLOCK,)] * 4, (4,)),
    ("16384, 16385, 16383, 1", [(BLOCK,), (BLOCK + 1,), (BLOCK - 1,), (1,)], (2, 3)),
    ("a single 1-element tensor (empty shares)", [(1,)], (1, 4, 16)),
    ("one tensor of 3 blocks + 1", [(3 * BLOCK + 1,)], (2, 16)),
]

# (id, dtype, foreach, max_norm, amsgrad); bfloat16: no amsgrad in the pass
CONFIGS = [
    ("f32 for-loop clip amsgrad", torch.float32, False, 1e-2, True),
    ("f32 foreach", torch.float32, True, None, False),
    ("bf16 foreach clip", torch.bfloat16, True, 1e-2, False),
    ("bf16 for-loop", torch.bfloat16, False, None, False),
]


def compare(shapes, dtype, foreach, max_norm, amsgrad, nthreads, lr=1e-3, steps=2):
    """`run_against_native` with gradients assigned, None where (i + step) % 3 == 1."""
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    delivered = []

    def deliver(step, params):
        n = 0
        for i, p in enumerate(params):
            if (i + step) % 3 == 1:
                continue
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            p.grad = g.to(dtype)
            n += 1
        delivered.append(n)

    with threads(nthreads):
        results = run_against_native(
            base, foreach=foreach, deliver=deliver, steps=steps, max_norm=max_norm,
            adamw=dict(lr=lr, amsgrad=amsgrad, weight_decay=0.1))
    return results, delivered[::2]  # each step delivers to both arms


@pytest.mark.parametrize("config", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_split_layouts(layout, config, monkeypatch):
    monkeypatch.setenv(sp.ENV_SWITCH, "1")
    name, shapes, counts = layout
    cname, dtype, foreach, max_norm, amsgrad = config
    for n in counts:
        results, delivered = compare(shapes, dtype, foreach, max_norm, amsgrad, n)
        for (step, problem, path, _), got in zip(results, delivered):
            assert problem is None, f"{name}, {cname}, {n} threads, step {step}: {problem}"
            if got:  # a step where some gradient exists ran the single pass
                assert path["path"] == "single-pass", (name, cname, n, step, path)


def test_control_the_comparison_sees_another_lr(monkeypatch):
    """The byte comparison does report a difference: native at lr 1e-3, ours at 2e-3."""
    monkeypatch.setenv(sp.ENV_SWITCH, "1")
    shapes = [(1,)] * 120 + [(40003,)]
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=gen) for s in shapes]

    def deliver(step, params):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))

    def edit(step, params, opt):
        if step == 0 and isinstance(opt, cotangent.AdamW):
            for g in opt.param_groups:
                g["lr"] = 2e-3

    with threads(2):
        results = run_against_native(base, foreach=False, deliver=deliver, steps=1, edit=edit)
    assert results[0][2]["path"] == "single-pass", results[0][2]
    assert results[0][1] is not None and "parameter" in results[0][1], results[0][1]


def _direct(segments, n, nthreads, dtype=torch.float32, amsgrad=False, clip=None,
            implementation="for-loop"):
    """`single_pass_adamw_` over buffers of `n` elements on `segments` against native
    `torch.optim.adam.adam` (decoupled decay) on each segment as its own tensor (after
    ``mul_(clip)`` when given); elements outside every segment must keep their bytes."""
    from torch.optim.adam import adam

    gen = torch.Generator().manual_seed(n + len(segments))
    bufs = [torch.randn(n, generator=gen).to(dtype) for _ in range(3)]
    bufs += [torch.rand(n, generator=gen).to(dtype) for _ in range(2 if amsgrad else 1)]
    bufs += [None] * (5 - len(bufs))
    native = [[t[o:o + k].clone() for o, k in segments] if t is not None else None for t in bufs]
    ours = [t.clone() if t is not None else None for t in bufs]
    native_steps = [torch.tensor(float(i)) for i in range(len(segments))]
    our_steps = [s.clone() for s in native_steps]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False,
              amsgrad=amsgrad)
    foreach = implementation == "foreach"
    with threads(nthreads), torch.no_grad():
        if segments:
            if clip is not None:
                for g in native[1]:
                    g.mul_(clip)
            adam(native[0], native[1], native[2], native[3], native[4] if amsgrad else [],
                 native_steps, foreach=foreach, decoupled_weight_decay=True, **kw)
        sp.single_pass_adamw_(*ours, our_steps, segments=segments, clip_coef=clip,
                              implementation=implementation, **kw)
    covered = torch.zeros(n, dtype=torch.bool)
    names = ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    for j, (o, k) in enumerate(segments):
        covered[o:o + k] = True
        for i, what in enumerate(names):
            if bufs[i] is not None:
                assert_same_bits(ours[i][o:o + k], native[i][j],
                                 f"{what} of segment {j} ({o}, {k}), {nthreads} threads")
        assert_same_bits(our_steps[j], native_steps[j], f"step of segment {j}")
    for i, what in enumerate(names):
        if bufs[i] is not None:
            assert_same_bits(ours[i][~covered], bufs[i][~covered], f"{what} outside segments")


@pytest.mark.parametrize("nthreads", [1, 2, 3, 4, 16])
def test_direct_kernel_segments(nthreads):
    _direct([], 100, nthreads)
    _direct([], 0, nthreads)
    _direct([(0, 0), (5, 0), (100, 0)], 100, nthreads)
    _direct([(0, 0), (3, 1), (4, 0), (10, BLOCK + 1), (BLOCK + 11, 0), (BLOCK + 11, BLOCK)],
            40000, nthreads, amsgrad=True, clip=0.5)
    small = [(2 * i, 1) for i in range(300)]  # padding between them
    _direct(small + [(600, 70001)], 70601, nthreads, amsgrad=True, clip=0.25,
            implementation="foreach")
    _direct([(0, 70001)] + [(o + 70001, k) for o, k in small], 70601, nthreads,
            dtype=torch.bfloat16)
    _direct([(0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, BLOCK), (3 * BLOCK, BLOCK)], 4 * BLOCK,
            nthreads, amsgrad=True)


def test_direct_kernel_control():
    """`_direct` reports a difference: native's gradient of segment 0 changed before the step."""
    from torch.optim import adam as adam_module

    real = adam_module.adam

    def tampered(params, grads, *a, **k):
        grads[0][0] += 1.0
        return real(params, grads, *a, **k)

    adam_module.adam = tampered
    try:
        with pytest.raises(AssertionError, match="segment 0"):
            _direct([(0, 5), (5, BLOCK + 3)], BLOCK + 8, 2)
    finally:
        adam_module.adam = real


@pytest.mark.slow
def test_omp_thread_limit_with_many_small_tensors():
    """OMP_THREAD_LIMIT=1 with torch.set_num_threads(2): a team of one takes every block."""
    script = textwrap.dedent("""
        import os, sys, torch
        sys.path.insert(0, sys.argv[1])
        from bitwise import run_against_native
        os.environ["COTANGENT_SINGLE_PASS"] = "1"
        torch.set_num_threads(2)
        gen = torch.Generator().manual_seed(0)
        shapes = [(1,)] * 100 + [(40003,)] + [(3,)] * 50
        for dtype, foreach, max_norm, ams in [(torch.float32, False, 1e-2, True)]:
            base = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
            def deliver(step, params):
                for i, p in enumerate(params):
                    if (i + step) % 3 != 1:
                        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(
                            100 * step + i)).to(dtype)
            res = run_against_native(base, foreach=foreach, deliver=deliver, steps=3,
                                     max_norm=max_norm, adamw=dict(amsgrad=ams))
            for step, problem, path, _ in res:
                assert problem is None, (dtype, foreach, step, problem)
                assert path["path"] == "single-pass", path
        print("SAME BYTES")
    """)
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SAME BYTES" in proc.stdout, proc.stderr[-1500:]
