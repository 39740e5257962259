"""csrc/layer_ops.cpp and triton_layer_ops.py (under Triton's interpreter here, tests/conftest.py)
against the transformers modules they stand in for (layer_ops.py)."""

import pytest
import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaConfig, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2Config

from worker.engine import kernels, triton_layer_ops
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.layer_ops import ATTENTIONS, GATED_MLPS, NORMS, NativeAttention, NativeGatedMLP, NativeRMSNorm
from worker.engine.linear import fuse_projections


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, kv_heads, head_dim", [(1, 9, 3, 64), (37, 4, 2, 16), (300, 2, 1, 128)])
def test_rotary_is_apply_rotary_pos_emb(tokens, heads, kv_heads, head_dim, dtype, ops):
    """Bit for bit in both dtypes: each product rounded, then their sum (no multiply-add in float32)."""
    generator = torch.Generator().manual_seed(tokens)
    qkv = (3 * torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)).to(dtype)
    cos, sin = (torch.randn(1, tokens, head_dim, generator=generator).to(dtype) for _ in range(2))
    q_heads = qkv[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    k_heads = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary_pos_emb(q_heads, k_heads.transpose(1, 2), cos, sin)
    q, k = ops.rotary(qkv, cos[0], sin[0], heads, kv_heads)
    assert q.shape == (tokens, heads, head_dim) and k.shape == (tokens, kv_heads, head_dim) and q.dtype == dtype
    torch.testing.assert_close(q, expected_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(k, expected_k[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "rotary"])
def test_float32_in_bf16_out_is_the_float32_output_rounded(op, ops):
    """What a bf16 model on the CPU feeds its GEMMs and attention from its float32 activations
    (use_native_layer_ops' gemm_inputs): the float32 output rounded once, bit for bit."""
    generator = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(37, 576, generator=generator)
    arguments = {"rms_norm": (x, torch.randn(576, generator=generator), 1e-5), "silu_and_mul": (x,),
                 "rotary": (x, torch.randn(37, 64, generator=generator), torch.randn(37, 64, generator=generator), 3, 3)}
    exact, narrow = (getattr(ops, op)(*arguments[op], out_dtype) for out_dtype in (None, torch.bfloat16))
    for exact_part, narrow_part in zip(*((out,) if op != "rotary" else out for out in (exact, narrow)), strict=True):
        assert exact_part.dtype == torch.float32 and narrow_part.dtype == torch.bfloat16
        assert torch.equal(narrow_part, exact_part.bfloat16())


FAMILIES = {  # the attention module, and a config with GQA (Qwen2: q/k/v biases; Mistral: a sliding window)
    LlamaAttention: LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    Qwen2Attention: Qwen2Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    MistralAttention: MistralConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, sliding_window=8),
}


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES), ids=lambda family: family.__name__)
def test_native_attention_is_the_modules_forward(family, dtype, implementation):
    """The same attention function given what each forward computes, a prompt then a token on a
    transformers Cache (HF generate on the engine's model: ops/bench_gpu.py): the same outputs, bit for
    bit, from the fused q/k/v GEMM and the one-pass rotary."""
    assert set(FAMILIES) == set(ATTENTIONS)
    config = FAMILIES[family]
    config._attn_implementation = implementation
    torch.manual_seed(0)
    layer = nn.Module()
    layer.self_attn = family(config, layer_idx=0).to(dtype).eval()
    assert (layer.self_attn.q_proj.bias is not None) == (family is Qwen2Attention)
    hidden = torch.randn(1, 22, config.hidden_size).to(dtype)
    rotary = LlamaRotaryEmbedding(config)

    def prompt_then_token(attention):
        cache, outputs = DynamicCache(config=config), []
        for start, end in ((0, 21), (21, 22)):
            position_embeddings = rotary(hidden, torch.arange(start, end)[None])
            out, _ = attention(hidden[:, start:end], position_embeddings=position_embeddings, attention_mask=None,
                               cache=cache)
            outputs.append(out)
        return outputs

    with torch.inference_mode():
        expected = prompt_then_token(layer.self_attn)
        fuse_projections(layer)
        native = NativeAttention(layer.self_attn, layer.self_attn.q_proj.group, kernels)
        got = prompt_then_token(native)
    assert (native.num_heads, native.num_kv_heads) == (6, 2)
    assert native.sliding_window == (8 if family is MistralAttention else None)
    for got_out, expected_out in zip(got, expected, strict=True):
        torch.testing.assert_close(got_out, expected_out, atol=0, rtol=0)


def test_refusals_are_clear_errors():  # the native kernels'; Triton's take what the engine hands them
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        kernels.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernels.rms_norm(torch.randn(3, 8), torch.randn(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="rotary"):
        kernels.rotary(torch.randn(3, 5 * 8), torch.randn(3, 4), torch.randn(3, 4), 3, 1)  # cos/sin not [3, 8]
    with pytest.raises(RuntimeError, match="bfloat16 for float32 input"):
        kernels.silu_and_mul(torch.randn(3, 8), torch.float16)


@pytest.mark.parametrize("name", ["random:llama", "random:qwen2", "random:mistral"])
def test_engine_swaps_every_norm_mlp_and_attention_in_eager_mode(name):
    engine = Engine(EngineConfig.from_options(name, num_blocks=16))
    modules = list(engine.model.modules())
    layers = engine.model.config.num_hidden_layers
    assert sum(isinstance(m, NativeRMSNorm) for m in modules) == 2 * layers + 1
    assert sum(isinstance(m, NativeGatedMLP) for m in modules) == layers
    attentions = [m for m in modules if isinstance(m, NativeAttention)]
    assert len(attentions) == layers and [m.layer_idx for m in attentions] == list(range(layers))
    assert {m.sliding_window for m in attentions} == {engine.info.sliding_window}
    assert not any(type(m) in NORMS + GATED_MLPS + tuple(ATTENTIONS) for m in modules)
