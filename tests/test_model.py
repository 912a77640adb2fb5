import torch

from bitwise import assert_same_bits

from cotangent.harness.model import build_model


def test_transformer_small_has_the_specified_parameters():
    model = build_model("transformer-small", 0)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 3_346_944
    assert len(params) == 37
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_init_is_seeded_and_residual_projections_are_scaled():
    a, b = build_model("transformer-small", 1), build_model("transformer-small", 1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert_same_bits(pa, pb, "seeded init")
    std_out = a.blocks[0].attn.out.weight.std().item()
    std_qkv = a.blocks[0].attn.qkv.weight.std().item()
    assert abs(std_qkv - 0.02) < 0.001
    assert abs(std_out - 0.02 / (2 * 4) ** 0.5) < 0.0005


def test_forward_shape_and_causality():
    model = build_model("tiny", 0)
    x = torch.randint(0, 256, (2, 32))
    y = model(x)
    assert y.shape == (2, 32, 256)
    x2 = x.clone()
    x2[:, 20:] = (x2[:, 20:] + 1) % 256  # changing the future must not change the past
    assert torch.equal(model(x2)[:, :20], y[:, :20])
