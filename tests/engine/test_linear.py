import torch
from torch import nn

from worker.engine.linear import PackedLinear, pack_linear_layers, packing_works


def test_packed_linear_matches_nn_linear_for_decode_and_prefill_shapes():
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(64, 96, bias=bias)
        packed = PackedLinear(linear)
        for shape in ((1, 64), (16, 64), (1, 300, 64)):
            x = torch.randn(shape)
            assert torch.allclose(packed(x), linear(x), atol=1e-5)


def test_pack_linear_layers_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    before = model(x)
    assert pack_linear_layers(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.allclose(model(x), before, atol=1e-5)


def test_only_float32_is_packed():
    assert packing_works(torch.float32) == torch.backends.mkldnn.is_available()
    assert not packing_works(torch.bfloat16)
