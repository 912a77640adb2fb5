"""`cotangent.memory`: the saved-tensor storage audit, with exact byte counts (CPU, FP32,
torch 2.13.0; the compiled cases use torch.compile's default inductor backend)."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch import nn

from cotangent.memory import SavedTensorAudit, audit
from cotangent.verify import first_difference

B, T, D, K = 4, 16, 128, 32
FULL = B * T * D * 4  # bytes of a (B, T, d) float32 activation
SLICE = B * T * K * 4  # bytes the 32-channel slice reads


class Gate(nn.Module):
    """A projection whose first K channels gate the output: the slice feeds a multiply, which
    saves it for backward (a view: the whole (B, T, d) projection stays alive)."""

    def __init__(self, variant: str = "slice") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, K))
        self.variant = variant

    def forward(self, x):
        h = self.proj(x)  # (B, T, d)
        g = h[..., :K]  # (B, T, K) view of h's storage
        if self.variant == "contiguous":
            g = g.contiguous()  # (B, T, K) storage of its own
        return (g * self.scale).sum()


def _x():
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.slow
def test_a_saved_slice_pins_its_storage_and_contiguous_removes_the_pin(compiled):
    reports = {}
    for variant in ("slice", "contiguous"):
        model = Gate(variant)
        fn = torch.compile(model) if compiled else model
        reports[variant] = audit(fn, _x(), params=list(model.parameters()))
    s, c = reports["slice"].summary, reports["contiguous"].summary
    assert s["hook_errors"] == c["hook_errors"] == 0
    # slice: the input (saved by the projection) and the projection's whole output
    assert s["activation_bytes"] == 2 * FULL and s["pinned_storages"] == 1
    assert s["pinned_unreferenced_bytes"] == FULL - SLICE
    assert s["referenced_bytes"] == FULL + SLICE
    # contiguous: the input and a (B, T, K) copy; nothing pinned
    assert c["activation_bytes"] == FULL + SLICE and c["pinned_storages"] == 0
    assert s["activation_bytes"] - c["activation_bytes"] == FULL - SLICE
    assert reports["slice"].as_dict()["mode"] == ("compiled" if compiled else "eager")
    delta = reports["slice"].compare(reports["contiguous"])
    assert delta["summary"]["activation_bytes"] == SLICE - FULL
    assert {(d["nbytes"], d["count_delta"]) for d in delta["classes"]} == {(FULL, -1),
                                                                           (SLICE, 1)}


def test_the_audit_is_transparent_and_keeps_nothing_alive():
    outputs = []
    for audited in (False, True):
        model = Gate()
        x = _x().requires_grad_()
        loss = audit(model, x).result if audited else model(x)
        loss.backward()
        outputs.append([loss.detach(), x.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*outputs):
        assert first_difference(a, b) is None

    t = torch.randn(64, requires_grad=True)
    with SavedTensorAudit() as rec:
        out = (t * 2).sin().sum()  # sin saves the intermediate t * 2
    assert rec.report().summary["activation_bytes"] == 64 * 4
    del out
    assert rec.report().summary["activation_bytes"] == 0  # released with the graph
    with SavedTensorAudit():
        y = t.exp()  # exp saves its own output: no reference cycle through the hook
    ref = weakref.ref(y)
    del y
    assert ref() is None


def test_regressions_from_review():
    """In-place edits of saved tensors still raise; meta storages are told apart; freed and
    reused addresses are not merged; broadcast views cost nothing; attribution survives a
    caught exception; a compiled function is reported as compiled."""
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    with SavedTensorAudit():
        y = x.exp()
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    w = torch.randn(10, 1000, device="meta", requires_grad=True)
    report = audit(lambda a, b: (a @ b).sum(), torch.randn(5, 10, device="meta"), w,
                   params=[w])
    assert report.summary["activation_bytes"] == 5 * 10 * 4  # not merged with w (pointer 0)

    p = torch.randn(64, 1024, requires_grad=True)

    def reuse():
        (p * 1.0).exp().sum().backward()  # a graph built and released inside fn
        return (p * 2.0).sin().sum()  # may reuse the freed addresses

    report = audit(reuse, params=[p])
    assert report.summary["activation_bytes"] == 64 * 1024 * 4
    assert report.summary["saved_references"] == 1

    mask = torch.rand(256, 256) > 0.5
    s = torch.randn(2, 8, 256, 256, requires_grad=True)
    report = audit(lambda: s.masked_fill(mask.expand(2, 8, 256, 256), 0.0).sum())
    (row,) = [r for r in report.storages if r["dtype"] == "bool"]
    assert row["referenced_bytes"] == 256 * 256

    class Flaky(nn.Module):
        def forward(self, a):
            raise ValueError("caught by the caller")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.flaky = Flaky()

        def forward(self, a):
            try:
                self.flaky(a)
            except ValueError:
                pass
            return a.exp().sum()

    report = audit(Net(), torch.randn(4, 8, requires_grad=True))
    assert [r["modules"] for r in report.storages] == [["Net"]]
    assert audit(torch.compile(lambda a: a.exp().sum()),
                 torch.randn(8, requires_grad=True)).as_dict()["mode"] == "compiled"


def test_deduplication_by_storage_and_exact_coverage():
    w1, w2 = torch.ones(K, requires_grad=True), torch.ones(K, requires_grad=True)
    x = torch.randn(B, T, D, requires_grad=True)

    def twice_and_two_slices(x):
        y = x * 2  # (B, T, d), saved by nothing below except through views/itself
        same = (y * y).sum()  # the same tensor saved twice
        halves = (y[..., :K] * w1 + y[..., 2 * K:3 * K] * w2).sum()  # two disjoint slices
        return same + halves

    report = audit(twice_and_two_slices, x, params=[w1, w2])
    rows = [r for r in report.storages if not r["is_parameter"]]
    (y_row,) = [r for r in rows if r["saved_refs"] == 4]  # y, y, and the two slices
    assert y_row["nbytes"] == FULL and y_row["referenced_bytes"] == FULL  # y itself covers all
    report2 = audit(lambda x: (x[..., :K] * w1 + x[..., 2 * K:3 * K] * w2).sum(), x * 2,
                    params=[w1, w2])
    (row,) = [r for r in report2.storages if not r["is_parameter"]]
    assert row["saved_refs"] == 2 and row["referenced_bytes"] == 2 * SLICE
    assert row["coverage"] == 0.5 and row["pinned"] is False  # half is not below half
    params = [r for r in report2.storages if r["is_parameter"]]
    assert len(params) == 2 and report2.summary["activation_bytes"] == FULL


def test_unsupported_kinds_are_hook_errors_and_json_round_trips():
    s = torch.eye(4).to_sparse().requires_grad_()
    d = torch.randn(4, 4, requires_grad=True)
    report = audit(lambda: torch.sparse.mm(s, d).sum(), labels={"4x4": 64})
    doc = report.as_dict()
    assert doc["summary"]["hook_errors"] >= 1 and "sparse" in " ".join(doc["errors"]).lower()
    assert json.loads(report.to_json()) == doc
    assert set(doc) == {"schema_version", "torch", "device", "mode", "dtype", "threads",
                        "summary", "storages", "classes", "diff", "errors"}
    assert set(doc["summary"]) == {"saved_references", "unique_storages", "activation_bytes",
                                   "referenced_bytes", "pinned_storages",
                                   "pinned_unreferenced_bytes", "hook_errors"}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.slow
def test_demo_stack_storage_classes_per_gate_variant(compiled):
    from cotangent.harness.memory_cli import run_demo

    # the gate reads 32 of 128 channels (pinned); T = 24 keeps (B, T, d) apart from the (32, d)
    # fused weight in size
    b, t, d, layers = 2, 24, 128, 2
    full, gate = b * t * d * 4, b * t * 32 * 4
    counts = {}
    for variant in ("slice", "contiguous", "weight-fused"):
        report = run_demo(variant, batch=b, context=t, width=d, layers=layers,
                          compiled=compiled, dtype=torch.float32)
        assert report.summary["hook_errors"] == 0
        counts[variant] = {c["nbytes"]: c["count"] for c in report.classes()}
        if variant == "slice":
            assert report.summary["pinned_storages"] == layers
            assert report.summary["pinned_unreferenced_bytes"] == layers * (full - gate)
    assert counts["slice"][full] - counts["contiguous"][full] == layers
    assert counts["contiguous"].get(gate, 0) - counts["slice"].get(gate, 0) == layers
    assert counts["weight-fused"].get(gate, 0) == counts["slice"].get(gate, 0) == 0
    assert counts["weight-fused"][full] == counts["contiguous"][full]


def test_memory_command_prints_the_comparison_and_json(capsys):
    from cotangent.harness import cli

    code = cli.main(["memory", "--demo", "--compare", "contiguous", "--batch", "2",
                     "--context", "16", "--width", "128", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out.strip().splitlines()[-1])
    full, gate = 2 * 16 * 128 * 4, 2 * 16 * 32 * 4
    assert {(d["nbytes"], d["count_delta"], d["label"]) for d in doc["diff"]["classes"]} == {
        (full, -2, "B,T,d"), (gate, 2, "B,T,32")}
    assert "-2 x 16,384 B (B,T,d)" in out and "remedies for pinned storages" in out
    assert cli.main(["memory", "--model", "tiny", "--batch", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["summary"]["hook_errors"] == 0 and doc["summary"]["activation_bytes"] > 0
    assert cli.main(["memory", "--demo", "--width", "16"]) == 2
    assert "gate channels" in capsys.readouterr().err
    assert cli.main(["memory", "--model", "tiny", "--compare", "slice"]) == 2
    assert cli.main(["memory", "--model", "tiny", "--width", "16"]) == 2
    assert "--width: demo settings" in capsys.readouterr().err
    assert cli.main(["memory", "--demo", "--context", "100000000", "--width", "4096"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cotangent: error: the audited forward failed") and "Traceback" not in err


def test_contiguous_gate_is_bitwise_equal_to_the_slice_in_eager_fp32_and_bf16_counts():
    """The remedy's precision note: `.contiguous()` changes no bit in eager FP32 (loss and
    every gradient); in BF16 (tiny, eager) the audit counts 2-byte storages the same way."""
    from cotangent.harness.memory_cli import DemoStack, run_demo

    results = []
    for variant in ("slice", "contiguous"):
        model = DemoStack(128, 2, variant)
        x = torch.randn(2, 8, 128, generator=torch.Generator().manual_seed(1))
        loss = model(x)
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert first_difference(a, b) is None
    report = run_demo("slice", batch=2, context=8, width=128, layers=2, compiled=False,
                      dtype=torch.bfloat16)
    s = report.summary
    assert report.as_dict()["dtype"] == "bfloat16" and s["pinned_storages"] == 2
    assert s["pinned_unreferenced_bytes"] == 2 * (2 * 8 * 128 * 2 - 2 * 8 * 32 * 2)


@pytest.mark.parametrize("make", [
    lambda s: s[:, :3],  # row slices
    lambda s: s.t()[1:5],  # transposed, then sliced: runs of one element
    lambda s: s[::2, 1::3],  # stepped
    lambda s: s[:1].expand(5, 12),  # stride 0: the same bytes many times
    lambda s: s.reshape(2, 3, 2, 5).permute(0, 2, 3, 1),  # channels_last-like
], ids=["rows", "transposed", "stepped", "expanded", "permuted"])
def test_referenced_bytes_equal_a_brute_force_count(make):
    from cotangent.memory import _union_bytes

    base = torch.zeros(60, dtype=torch.float32)
    storage = base.view(5, 12)
    views = [make(storage), storage[4, 7:9]]
    seen = set()
    for v in views:
        idx = torch.arange(60).as_strided(v.shape, v.stride(), v.storage_offset())
        seen.update(idx.reshape(-1).tolist())
    meta = [(v.storage_offset(), tuple(v.shape), tuple(v.stride()), 4) for v in views]
    assert _union_bytes(meta, 240) == 4 * len(seen)


@pytest.mark.slow
def test_memory_is_reachable_after_a_plain_import():
    """`import cotangent` alone makes `cotangent.memory.audit` usable, as docs/harness.md writes it."""
    import subprocess
    import sys

    code = ("import cotangent, torch; w = torch.ones(3, requires_grad=True); "
            "r = cotangent.memory.audit(lambda: (w * w).sum(), params=[w]); "
            "print(type(r.summary).__name__, r.summary['saved_references'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "dict 2\n"
