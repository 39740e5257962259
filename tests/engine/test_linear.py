import pytest
import torch
from torch import nn

from worker.engine import kernels
from worker.engine.linear import PackedLinear, ProjectionSlice, fuse_projections, pack_linear_layers, packing_works


def test_packed_linear_matches_nn_linear_for_decode_and_prefill_shapes():
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(64, 96, bias=bias)
        packed = PackedLinear(linear)
        for shape in ((1, 64), (16, 64), (1, 300, 64)):
            x = torch.randn(shape)
            assert torch.allclose(packed(x), linear(x), atol=1e-5)


@pytest.mark.parametrize("in_features,out_features", [(64, 96), (40, 5), (1536, 70)])
def test_native_float32_kernel_matches_nn_linear_for_any_rows_and_columns(in_features, out_features):
    """Every tile height (1 .. 2 x the micro-kernel's rows), a partial last panel of columns
    (5, 70), and with K=1536 more rows than one cached chunk (42): all against F.linear."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    torch.manual_seed(0)
    for bias in (True, False):
        linear = nn.Linear(in_features, out_features, bias=bias)
        packed = PackedLinear(linear)
        assert packed.native
        for rows in [*range(1, 26), 64, 100]:
            x = torch.randn(rows, in_features)
            assert torch.allclose(packed(x), linear(x), atol=1e-5, rtol=1e-5), rows
    wide = torch.randn(3, 7, 2 * in_features)[..., ::2]  # 3-D and not contiguous
    assert torch.allclose(packed(wide), linear(wide), atol=1e-5, rtol=1e-5)


def test_pack_linear_layers_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    before = model(x)
    assert pack_linear_layers(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.allclose(model(x), before, atol=1e-5)


def test_packing_is_used_for_float32_and_for_bfloat16_only_with_native_bf16():
    assert packing_works(torch.float32) == (kernels.native() is not None or torch.backends.mkldnn.is_available())
    native_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packing_works(torch.bfloat16) == native_bf16
    assert not packing_works(torch.float16)


def test_packed_bfloat16_matches_nn_linear():
    if not packing_works(torch.bfloat16):
        pytest.skip("this CPU has no native bf16: the engine leaves bf16 layers unpacked")
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-2)


class _Attention(nn.Module):
    def __init__(self, bias_v: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(16, 16, bias=False), nn.Linear(16, 8, bias=False)
        self.v_proj, self.o_proj = nn.Linear(16, 8, bias=bias_v), nn.Linear(16, 16)

    def forward(self, x):
        return self.o_proj(self.q_proj(x)) + torch.cat([self.k_proj(x), self.v_proj(x)], -1)


def test_fused_projections_give_each_projection_of_its_own_input():
    torch.manual_seed(0)
    model = nn.Sequential(_Attention(bias_v=True), _Attention(bias_v=False))
    x, other = torch.randn(3, 16), torch.randn(3, 16)
    before = model(x)
    q, k, v = (model[0].q_proj(other), model[0].k_proj(x), model[0].v_proj(other))
    assert fuse_projections(model) == 2
    assert type(model[0].q_proj) is ProjectionSlice and type(model[0].o_proj) is nn.Linear
    assert torch.allclose(model(x), before, atol=1e-5)
    # out of order and with different inputs: every slice is still its own projection
    assert torch.allclose(model[0].q_proj(other), q, atol=1e-5)
    assert torch.allclose(model[0].k_proj(x), k, atol=1e-5)
    assert torch.allclose(model[0].v_proj(other), v, atol=1e-5)
    assert torch.allclose(model(x), before, atol=1e-5)
    assert model[0].fused_q_k_v.kept.input is None  # the last slice taken releases the activations
    assert fuse_projections(model) == 0  # idempotent
    assert pack_linear_layers(model) == 4  # the fused GEMMs and o_proj: packing applies on top
    assert torch.allclose(model(x), before, atol=1e-5)
