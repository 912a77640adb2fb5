"""Calibrated batched norms and the clip coefficient against native, byte for byte (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from bitwise import assert_same_bits
from cotangent import calibration, norms
from cotangent.harness.packed import norms as packed_norms
from cotangent.harness.packed.layout import plan_layouts

LENGTHS = [1, 2, 3, 5, 8, 31, 33, 64, 130, 1026, 4098, 65536]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_layout_norms_and_total_equal_native(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in LENGTHS for _ in range(rows)]
    perm = torch.randperm(len(grads), generator=gen).tolist()  # parameter order != length order
    grads = [grads[i] for i in perm]
    (layout,) = plan_layouts(grads)
    packed_norms.calibrate_layout(layout, 2.0, None)
    flat = layout.new_buffer(-0.0)
    for seg in layout.segments:
        layout.view(flat, seg).copy_(grads[seg.slot])
    ours = packed_norms.layout_norms(layout, flat, 2.0, None)
    native = torch._foreach_norm(grads, 2.0)
    for pos, seg in enumerate(layout.segments):
        assert_same_bits(ours[pos], native[seg.slot], f"norm of length {seg.numel}")
    position = {seg.slot: pos for pos, seg in enumerate(layout.segments)}
    ordered = ours.index_select(0, torch.tensor([position[i] for i in range(len(grads))]))
    assert_same_bits(norms.total_norm(ordered, 2.0),
                     torch.nn.utils.get_total_norm(grads, 2.0), "total norm")


def test_clip_coefficient_is_native_arithmetic():
    gen = torch.Generator().manual_seed(0)
    totals = torch.rand(2000, generator=gen) * 10
    totals = totals[totals > 0.7]  # where the coefficient is not clamped to 1
    ours = torch.stack([norms.clip_coefficient(t, 0.7) for t in totals])
    native = []
    for t in totals:  # torch's own clipping applied to a gradient of ones yields its coefficient
        p = torch.nn.Parameter(torch.zeros(1))
        p.grad = torch.ones(1)
        torch.nn.utils.clip_grads_with_norm_([p], 0.7, t)
        native.append(p.grad[0])
    native = torch.stack(native)
    division = torch.clamp(torch.tensor(0.7) / (totals + 1e-6), max=1.0)
    assert_same_bits(ours, native, "clip coefficient")
    # The reciprocal-then-multiply form really is different from a true division somewhere,
    # so this test would catch a "simplification" to a division.
    assert not torch.equal(ours.view(torch.int32), division.view(torch.int32))


def test_calibration_is_inspectable_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    cpu = torch.device("cpu")
    assert norms.bucket_norm_is_exact(cpu, torch.float32, 64, 4, 64, 2.0, None)
    rows = calibration.table()
    assert any(r["kind"] == "bucket_norm" and r["args"][:3] == ["float32", "64", "4"] and
               r["verdict"] for r in rows)
    saved = json.loads((tmp_path / calibration.FILE_NAME).read_text())["verdicts"]
    assert len(saved) == 1 and list(saved.values()) == [True]
    # A fresh process (simulated) reads the verdict from the file instead of probing again.
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    def probed_again(key, verdict):
        raise AssertionError(f"probed again: {key}")
    monkeypatch.setattr(calibration, "record", probed_again)  # every probe records its verdict
    assert norms.bucket_norm_is_exact(cpu, torch.float32, 64, 4, 64, 2.0, None)
    # A one-row bucket is never "batched": the native per-tensor call is used as is.
    assert not norms.bucket_norm_is_exact(cpu, torch.float32, 64, 1, 64, 2.0, None)


def test_corrupt_cache_file_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    (tmp_path / calibration.FILE_NAME).write_text("{not json")
    assert norms.bucket_norm_is_exact(torch.device("cpu"), torch.float32, 32, 3, 32, 2.0, None)


def test_calibration_rejects_a_batched_call_that_differs(monkeypatch, tmp_path):
    """If the 2-D reduction were different, the probe must say so (and the fallback is used).
    The forced False verdict goes to a cache of its own, never the one later tests read."""
    monkeypatch.setenv("COTANGENT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMORY", {})
    monkeypatch.setattr(calibration, "_LOADED", set())
    real = torch.linalg.vector_norm

    def perturbed(x, ord=2, dim=None, **kw):
        out = real(x, ord, dim=dim, **kw)
        return out if dim is None else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(norms.torch.linalg, "vector_norm", perturbed)
    assert not norms.bucket_norm_is_exact(torch.device("cpu"), torch.float32, 96, 5, 96, 2.0, False)


def test_the_probes_byte_comparison_takes_0_dim_tensors():
    """A total norm is 0-dim: -0.0 and +0.0 differ, equal NaNs agree (it raised before)."""
    assert not norms._bytes_equal(torch.tensor(0.0), torch.tensor(-0.0))
    assert norms._bytes_equal(torch.tensor(float("nan")), torch.tensor(float("nan")))
    assert not norms._bytes_equal(torch.tensor(1.0), torch.tensor([1.0]))
