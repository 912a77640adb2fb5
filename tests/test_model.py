"""The harness models, including the recurrent one.



The recurrent model family (untied / shared / replicated core) and the occurrence-aggregation
study arms of `cotangent train` (U, S, P, A, AP, PA). Bitwise comparisons are byte comparisons
(tests/bitwise.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from cotangent.harness import cli
from cotangent.harness.model import build_model, model_config, MODEL_CONFIGS, SHARINGS
from cotangent.harness.train import (
    Arm, DataParallel, format_comparison, OCCURRENCE_KEYS, OccurrenceSyncError, run_train,
    schedule_sha256, STUDY_ARMS, train_config, validate_config,
)

from bitwise import assert_same_bits, same_bits
from corpora import synthetic_corpus


@pytest.mark.parametrize("name,count,tensors", [
    ("transformer-small", 3_346_944, 37),
    ("transformer-medium", 19_280_896, 53),
    ("gated-gqa", 9_737_088, 52),
    ("causal-conv", 3_746_816, 53),
])
def test_research_models_have_the_specified_parameters(name, count, tensors):
    model = build_model(name, 0)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == count
    assert len(params) == tensors
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Conv1d))


def test_init_is_seeded_and_residual_projections_are_scaled():
    a, b = build_model("transformer-small", 1), build_model("transformer-small", 1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_same_bits(pa, pb, "seeded init")
    std_out = a.blocks[0].mixer.out.weight.std().item()
    std_qkv = a.blocks[0].mixer.qkv.weight.std().item()
    assert abs(std_qkv - 0.02) < 0.001
    assert abs(std_out - 0.02 / (2 * 4) ** 0.5) < 0.0005


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-gated-gqa", "tiny-causal-conv",
                                  "tiny-transformer-medium"])
def test_forward_shape_and_causality(name):
    model = build_model(name, 0)
    x = torch.randint(0, 256, (2, 32))
    y = model(x)
    assert y.shape == (2, 32, 256)
    x2 = x.clone()
    x2[:, 20:] = (x2[:, 20:] + 1) % 256  # changing the future must not change the past
    assert torch.equal(model(x2)[:, :20], y[:, :20])


def test_every_research_model_has_a_tiny_variant_of_its_family():
    from cotangent.harness.model import MODEL_CONFIGS, TINY
    from cotangent.harness.verify_suite import VERIFY_MODELS, suite_model

    assert sorted(TINY) == sorted(VERIFY_MODELS)
    for name, tiny in TINY.items():
        assert tiny.startswith("tiny-") and tiny in MODEL_CONFIGS
        full, small = MODEL_CONFIGS[name], MODEL_CONFIGS[tiny]
        assert small.family == full.family
        assert small.width < full.width and small.context < full.context
        n_full = sum(p.numel() for p in build_model(name, 0).parameters())
        n_tiny = sum(p.numel() for p in build_model(tiny, 0).parameters())
        assert n_tiny < n_full / 25
        # `cotangent verify` runs exactly the tiny model `cotangent train --model` builds
        for a, b in zip(suite_model(name, full_width=False, seed=3).parameters(),
                        build_model(tiny, 3).parameters(), strict=True):
            assert_same_bits(a, b, f"{name} -> {tiny}")


def test_tiny_transformer_medium_shape():
    model = build_model("tiny-transformer-medium", 0)
    params = list(model.parameters())
    # 2 embeddings + 3 blocks x 8 tensors + final norm (2) + head, like transformer-medium's
    # 2 + 6 x 8 + 2 + 1 = 53 with half the blocks
    assert len(params) == 29 and sum(p.numel() for p in params) == 109_728


MINI = "recurrent-mini"


# (parameters, tensors) of recurrent-mini: embedding 256x64 + head 256x64 + blocks of
# qkv 192x64, out 64x64, up 256x64, down 64x256 (12 * 64^2 = 49,152 each): 8 blocks untied or
# replicated (1 prelude, 2 core x 3 occurrences, 1 coda), 4 shared.
COUNTS = {"untied": (425_984, 34), "shared": (229_376, 18), "replicated": (425_984, 34)}


BLOCK_SHAPES = [(192, 64), (64, 64), (256, 64), (64, 256)]  # attn.qkv, attn.out, mlp.up, down


def test_recurrent_configs_are_registered():
    for name, width, context in ((MINI, 64, 64), ("recurrent-small", 128, 128)):
        cfg = MODEL_CONFIGS[name]
        assert cfg.family == "recurrent" and cfg.vocab_size == 256 and cfg.n_head == 4
        assert (cfg.width, cfg.context) == (width, context)
        assert (cfg.n_prelude, cfg.n_core, cfg.n_repeat, cfg.n_coda, cfg.n_layer) == (1, 2, 3, 1, 8)
    with pytest.raises(ValueError, match="effective depth"):
        model_config(MINI, n_layer=7)
    with pytest.raises(ValueError, match="for the recurrent family"):
        model_config("tiny", n_core=2)
    with pytest.raises(ValueError, match="unknown sharing"):
        build_model(MINI, 0, sharing="tied")
    with pytest.raises(ValueError, match="sharing 'shared' needs a recurrent model"):
        build_model("tiny", 0, sharing="shared")


@pytest.mark.parametrize("sharing", SHARINGS)
def test_shapes_and_parameter_counts(sharing):
    model = build_model(MINI, 0, sharing)
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params)) == COUNTS[sharing]
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "tok_emb.weight" and names[-1] == "head.weight"
    assert model.tok_emb.weight.shape == model.head.weight.shape == (256, 64)
    matrices = model.matrix_parameters()
    assert len(matrices) == len(params) - 2 and all(p.ndim == 2 for p in matrices)
    assert [tuple(p.shape) for p in matrices] == BLOCK_SHAPES * (len(matrices) // 4)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert not any(isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) for m in model.modules())
    assert list(model.state_dict()) == names  # rotary tables are not state
    x = torch.randint(0, 256, (2, 64))
    y = model(x)
    assert y.shape == (2, 64, 256) and y.dtype == torch.float32
    x2 = x.clone()
    x2[:, 40:] = (x2[:, 40:] + 1) % 256  # changing the future must not change the past
    assert_same_bits(model(x2)[:, :40], y[:, :40], "causal")
    assert model(x[:, :17]).shape == (2, 17, 256)
    with pytest.raises(ValueError, match="exceeds context"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_occurrence_groups_list_the_replicas_of_each_core_parameter():
    model = build_model(MINI, 0, "replicated")
    groups = model.occurrence_groups()
    assert len(groups) == 8 and all(len(g) == 3 for g in groups)
    assert [tuple(g[0].shape) for g in groups] == BLOCK_SHAPES * 2
    named = dict(model.named_parameters())
    for i, group in enumerate(groups):
        j, k = divmod(i, 4)  # core block j, its k-th parameter
        suffix = ["attn.qkv.weight", "attn.out.weight", "mlp.up.weight", "mlp.down.weight"][k]
        assert [id(p) for p in group] == [id(named[f"core.{r}.{j}.{suffix}"]) for r in range(3)]
        for replica in group[1:]:  # separate leaves with the same bytes
            assert replica.is_leaf and replica.data_ptr() != group[0].data_ptr()
            assert_same_bits(replica, group[0], f"group {i} replica")
    assert len({id(p) for g in groups for p in g}) == 24
    for sharing in ("untied", "shared"):
        with pytest.raises(ValueError, match="needs a replicated core"):
            build_model(MINI, 0, sharing).occurrence_groups()


def test_same_seed_gives_the_same_values_wherever_the_variants_share_meaning():
    untied, shared, replicated = (build_model(MINI, 5, s) for s in SHARINGS)
    canonical = [m.canonical_state() for m in (untied, shared, replicated)]
    assert list(canonical[0]) == list(canonical[1]) == list(canonical[2])
    assert len(canonical[0]) == 2 + 4 * 4  # embedding, head, prelude + 2 core + coda blocks
    for name in canonical[0]:
        for other in canonical[1:]:
            assert_same_bits(other[name], canonical[0][name], name)
    # shared and replicated: every parameter of the shared core equals every replica
    for r in range(3):
        for a, b in zip(shared.core[0].parameters(), replicated.core[r].parameters(),
                        strict=True):
            assert_same_bits(b, a, f"replica {r}")
    # untied: occurrences 1 and 2 are drawn afresh (after the head), not copies
    for r in (1, 2):
        for a, b in zip(untied.core[0].parameters(), untied.core[r].parameters(), strict=True):
            assert not same_bits(a, b)
    again = build_model(MINI, 5, "untied")
    for a, b in zip(untied.parameters(), again.parameters(), strict=True):
        assert_same_bits(a, b, "seeded init")
    other_seed = build_model(MINI, 6, "untied")
    assert not same_bits(untied.tok_emb.weight, other_seed.tok_emb.weight)
    std = untied.prelude[0].attn.qkv.weight.std().item()
    residual_std = untied.prelude[0].attn.out.weight.std().item()
    assert abs(std - 0.02) < 0.002 and abs(residual_std - 0.02 / 4) < 0.0005  # 1/sqrt(2 * 8)


def test_shared_and_replicated_forward_are_bitwise_equal_at_init():
    shared, replicated = build_model(MINI, 2, "shared"), build_model(MINI, 2, "replicated")
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    assert_same_bits(replicated(x), shared(x), "logits")
    untied = build_model(MINI, 2, "untied")
    assert not same_bits(untied(x), shared(x))  # untied occurrences 1, 2 differ


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "curve.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss_bpb" in r]


@pytest.mark.e2e
def test_every_study_arm_trains_with_replicas_in_sync(tmp_path):
    arms = ("native", "cotangent", *STUDY_ARMS)  # bitwise arms train the untied variant
    cfg = train_config(model=MINI, steps=4, seed=1, batch_size=4, val_bytes=2048,
                      out=str(tmp_path), arms=arms)
    validate_config(cfg)
    result = run_train(cfg, synthetic_corpus(), log=lambda *a: None)
    assert result["study_arms"] == list(STUDY_ARMS)
    # only the bitwise arms must agree; they do
    assert result["identical_final_hash"] is True
    assert result["native"]["final_model_sha256"] == result["cotangent"]["final_model_sha256"]
    text = format_comparison(result)
    assert "identical final model SHA-256 (native, cotangent): yes" in text
    assert "study arms U, S, P, A, AP, PA: final hashes recorded, not required to agree" in text
    canonical = set()
    for name in arms:
        run_dir = Path(result[name]["run_dir"])
        meta = json.loads((run_dir / "metadata.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = _steps(run_dir)
        assert len(steps) == 4 and not (run_dir / "INCOMPLETE").exists()
        canonical.add(meta["init_canonical_sha256"])
        assert meta["init_model_sha256"] != summary["final_model_sha256"]
        assert summary["peak_rss_kib"] > 0
        # the curve's lr column is the schedule metadata hashes (what `cotangent audit` checks)
        lrs = [r["lr"] for r in steps]
        assert hashlib.sha256(repr(lrs).encode()).hexdigest() == meta["schedule_sha256"]
        assert meta["schedule_sha256"] == schedule_sha256(cfg, name)
        if name not in STUDY_ARMS:
            assert "study" not in meta and not (OCCURRENCE_KEYS[0] in steps[0])
            continue
        sharing, mode = STUDY_ARMS[name]
        assert meta["study"]["sharing"] == sharing and meta["study"]["occurrence_mode"] == mode
        assert (meta["parameters"], meta["tensors"]) == COUNTS[sharing]
        assert meta["native_path"] is None and meta["study"]["gradient_clipping"] is None
        assert meta["study"]["pooled_leaves"] == (8 if mode in ("ap", "pa") else 0)
        assert lrs[0] == cfg.muon.lr * (1 / 20)  # warmup over 20 updates
        assert all(r["grad_norm"] > 0 for r in steps)
        if mode is None:
            assert not any(key in r for r in steps for key in OCCURRENCE_KEYS)
            assert "max_sync_error" not in summary
            continue
        for r in steps:
            assert set(OCCURRENCE_KEYS) <= r.keys()
            assert r["sync_error"] == 0.0
            assert r["realized_norm"] > 0 and r["relative_norm_mismatch"] < 1e-3
        assert summary["max_sync_error"] == 0.0
        assert summary["max_relative_norm_mismatch"] == max(
            r["relative_norm_mismatch"] for r in steps)
        assert f"{name}: replicas in sync after every step (max sync_error 0.0)" in text
    assert len(canonical) == 1  # one initial model, whatever the sharing
    finals = {result[name]["final_model_sha256"] for name in STUDY_ARMS}
    assert len(finals) == len(STUDY_ARMS)  # a study: six different outcomes, all recorded


@pytest.mark.e2e
def test_replicas_out_of_sync_stop_the_run(tmp_path, monkeypatch, capsys):
    from cotangent.occurrence import OccurrenceAggregator

    after_step = OccurrenceAggregator.after_step

    def desync_after_step(self):
        diag = after_step(self)
        with torch.no_grad():
            self.occurrences[3][2].view(-1)[5] += 1e-3  # one element of one replica moves
        return {**diag, "sync_error": self.sync_error()}

    monkeypatch.setattr(OccurrenceAggregator, "after_step", desync_after_step)
    cfg = train_config(model=MINI, steps=3, batch_size=2, val_bytes=2048, out=str(tmp_path),
                      arms=("S", "P"))
    with pytest.raises(OccurrenceSyncError, match=r"arm P: the replicas of the recurrent core "
                       r"differ after update 0 \(sync_error 0\.00"):
        run_train(cfg, synthetic_corpus(), log=lambda *a: None)
    (run_dir,) = tmp_path.glob("*/P")
    assert (run_dir / "INCOMPLETE").exists() and not (run_dir / "summary.json").exists()
    rows = [json.loads(line) for line in (run_dir / "curve.partial.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 1 and rows[0]["sync_error"] > 0  # the failing step is on record
    # through the CLI: exit status 1 and a one-line error (a tiny --data-dir)
    data = tmp_path / "data"
    data.mkdir()
    for split, content in synthetic_corpus().splits.items():
        (data / f"{split}.txt").write_bytes(content)
    with pytest.warns(UserWarning, match="not a known WikiText-2"):
        code = cli.main(["train", "--model", MINI, "--arms", "PA", "--steps", "2",
                         "--val-bytes", "2048", "--batch-size", "2", "--data-dir", str(data),
                         "--out", str(tmp_path / "cli")])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cotangent: error: arm PA: the replicas of the recurrent core "
                              "differ after update 0")


@pytest.mark.parametrize("arms", ["U", "native,S", "P,AP"])
def test_study_arms_with_a_model_that_is_not_recurrent_are_one_line_errors(arms, tmp_path,
                                                                           capsys):
    assert cli.main(["train", "--model", "tiny", "--arms", arms, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    study = ", ".join(a for a in arms.split(",") if a in STUDY_ARMS)
    assert (f"arm(s) {study} train a recurrent model (recurrent-mini or recurrent-small), "
            "not tiny") in err
    assert len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # refused before any run directory exists


def test_study_arm_refusals_at_construction():
    cfg = train_config(model="tiny", arms=("A",))
    with pytest.raises(ValueError, match=r"arm\(s\) A train a recurrent model"):
        Arm("A", cfg, torch.device("cpu"))
    dp = DataParallel(rank=0, world_size=2, local_rank=0, local_world_size=2, backend="gloo",
                      threads=1, threads_from="cores // local ranks")
    with pytest.raises(ValueError, match="study arms .* run in one process, not data-parallel"):
        Arm("S", train_config(model=MINI, arms=("S",)), torch.device("cpu"), dp)


def test_a_campaign_protocol_of_the_six_study_arms_parses():
    from cotangent.harness.campaign import parse_protocol

    text = """name = "occurrence-mini"
models = ["recurrent-mini"]
arms = ["U", "S", "P", "A", "AP", "PA"]
seeds = [0, 1, 2, 3, 4, 5]
steps = 300
eval_every = 25
target_bpb = 3.6
level = 0.95
margin_bpb = 0.01

[train]
batch_size = 8
muon_lr = 0.02
"""
    protocol = parse_protocol(text)
    assert protocol.arms == tuple(STUDY_ARMS) and protocol.train["muon_lr"] == 0.02
    with pytest.raises(ValueError, match=r"arm\(s\) U train a recurrent model"):
        parse_protocol(text.replace('"recurrent-mini"', '"transformer-quick"'))


def test_compiled_muon_steps_of_several_arms_get_room_under_the_recompile_limit():
    """MuonAdamW's compiled step functions are shared by all arms of a run; three
    replicated arms need 15 variants: the run raises Dynamo's limit for the loop, then restores it."""
    import torch._dynamo.config as config

    from cotangent.muon_adamw import recompile_room

    before = config.recompile_limit
    arms = [Arm(name, train_config(model=MINI, arms=(name,), muon_compile=True),
                torch.device("cpu")) for name in ("P", "AP", "PA")]
    for arm in arms:
        assert arm.optimizer.compile
    assert [a.optimizer.compiled_variants() for a in arms] == [5, 5, 5]  # 4 Muon + 1 AdamW
    with recompile_room(*(a.optimizer for a in arms)):
        assert config.recompile_limit == max(before, 15)
    assert config.recompile_limit == before
    with recompile_room(arms[0].optimizer):  # never lowered
        assert config.recompile_limit == before
