"""csrc/layer_ops.cpp and triton_layer_ops.py (under Triton's interpreter here, tests/conftest.py)
against the transformers modules they stand in for (layer_ops.py)."""

import pytest
import torch
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from worker.engine import kernels, triton_layer_ops
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.layer_ops import GATED_MLPS, NORMS, NativeGatedMLP, NativeRMSNorm


@pytest.fixture(params=["native", "triton"])
def ops(request):
    """The CPU's native kernels (they must have built), or the GPU's Triton ones."""
    if request.param == "triton":
        return triton_layer_ops
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 64), (7, 576), (300, 100), (3, 33)])
def test_rms_norm_is_llama_rms_norm(rows, width, dtype, ops):
    """bf16: bit for bit (the module rounds twice, the kernel the same twice); float32: but for the
    order in which the squares add up."""
    generator = torch.Generator().manual_seed(rows)
    norm = LlamaRMSNorm(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator))
    x = (3 * torch.randn(1, rows, width, generator=generator)).to(dtype)
    expected, got = norm(x), NativeRMSNorm(norm, ops)(x)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        # one float32 rounding of the scale can move a value across a bf16 rounding boundary
        assert (got != expected).float().mean() < 0.01
        torch.testing.assert_close(got, expected, atol=0, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 128), (5, 1536), (200, 40), (2, 7)])
def test_silu_and_mul_is_the_gated_mlps_activation(rows, width, dtype, ops):
    """bf16: bit for bit, rounding where the module's ops round."""
    generator = torch.Generator().manual_seed(width)
    x = (4 * torch.randn(rows, 2 * width, generator=generator)).to(dtype)
    gate, up = x.split(width, dim=-1)
    expected = SiLUActivation()(gate) * up
    # float32: torch's own silu takes a scalar exp for a row's last partial vector (a last-bit difference)
    tolerance = 0 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ops.silu_and_mul(x), expected, atol=0, rtol=tolerance)


def test_refusals_are_clear_errors():  # the native kernels'; Triton's take what the engine hands them
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        kernels.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernels.rms_norm(torch.randn(3, 8), torch.randn(8, dtype=torch.bfloat16), 1e-5)


@pytest.mark.parametrize("name", ["random:llama", "random:qwen2", "random:mistral"])
def test_engine_swaps_every_norm_and_mlp_in_eager_mode(name):
    engine = Engine(EngineConfig.from_options(name, num_blocks=16))
    modules = list(engine.model.modules())
    layers = engine.model.config.num_hidden_layers
    assert sum(isinstance(m, NativeRMSNorm) for m in modules) == 2 * layers + 1
    assert sum(isinstance(m, NativeGatedMLP) for m in modules) == layers
    assert not any(type(m) in NORMS + GATED_MLPS for m in modules)
