import pytest
import torch

from bitwise import assert_same_bits

from cotangent.harness.model import build_model


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
