import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker.engine import kernels
from worker.engine.attention import AttentionMetadata, model_logits
from worker.engine.linear import (PackedLinear, pack_linear_layers,
                                  packing_backend, packing_works)
from worker.engine.models import ModelInfo, load_model, random_model
from worker.engine.runner import ModelRunner


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


@pytest.mark.parametrize("pairs", [False, True], ids=["bf16 weights", "bf16 by bf16"])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (13, 5), (1536, 70)])
def test_native_bfloat16_kernel_sums_in_float32_for_any_rows_and_columns(in_features, out_features, pairs):
    """bf16 weights, float32 input: widened to float32 in registers, or (pairs, with avx512_bf16) the
    input rounded to bf16 and multiplied two k at a time by vdpbf16ps. Either way float32 sums of
    the same products as F.linear in float32: every tile height, an odd K (a zero k padded on), a
    partial last panel of columns, more rows than one cached chunk."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    if pairs and not kernels.bf16_dot_products():
        pytest.skip("this CPU has no avx512_bf16")
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features).bfloat16(), torch.randn(out_features)
    packed = kernels.pack_linear_weight(weight, pairs)
    for rows in [*range(1, 26), 64, 100]:
        x = torch.randn(rows, in_features)
        expected = torch.nn.functional.linear(x.bfloat16().float() if pairs else x, weight.float(), bias)
        torch.testing.assert_close(kernels.packed_linear(x, packed, bias, out_features), expected,
                                   atol=1e-4, rtol=1e-5, msg=f"{rows} rows")


def test_weights_in_pairs_of_k_need_bfloat16_and_avx512_bf16():
    with pytest.raises(RuntimeError, match="pairs of k"):
        kernels.pack_linear_weight(torch.randn(4, 8), True)
    if not kernels.bf16_dot_products():
        with pytest.raises(RuntimeError, match="avx512_bf16"):
            kernels.pack_linear_weight(torch.randn(4, 8).bfloat16(), True)


def test_pack_linear_layers_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    before = model(x)
    assert pack_linear_layers(model) == 2
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert torch.allclose(model(x), before, atol=1e-5)


def test_packing_backend_per_dtype():
    native = kernels.native() is not None
    amx_bf16 = (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                and torch.cpu._is_amx_tile_supported())
    assert packing_backend(torch.float32) == ("native" if native else "onednn")
    # oneDNN's bf16 only where ours did not build, and only with AMX: avx512_bf16 alone is slower than ours
    assert packing_backend(torch.bfloat16) == ("native" if native else "onednn" if amx_bf16 else None)
    assert packing_backend(torch.float16) is None
    assert packing_works(torch.float32) and packing_works(torch.bfloat16) == (native or amx_bf16)
    assert not packing_works(torch.float16)


@pytest.mark.parametrize("bias", [True, False])
def test_packed_bfloat16_matches_nn_linear(bias):
    """Whichever backend serves bf16 here (oneDNN with native bf16, else ours in float32 arithmetic)."""
    if not packing_works(torch.bfloat16):
        pytest.fail("no bf16 packing backend: the native kernels did not build")
    torch.manual_seed(0)
    linear = nn.Linear(64, 70, bias=bias, dtype=torch.bfloat16)
    for rows in (1, 16, 37):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        out = PackedLinear(linear)(x)
        # ours gives its float32 sums as they are; oneDNN's, where it serves bf16, rounds them to bf16
        exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
        if packing_backend(torch.bfloat16) == "native":
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, exact, atol=1e-4, rtol=1e-5)
        else:
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.float(), exact, atol=1e-2, rtol=2 ** -7)


def test_a_bf16_model_on_the_cpu_keeps_its_activations_in_float32():
    """Only its linear layers' weights and the KV cache are bf16: the residual stream, the norms' weights and
    the logits stay float32 (how much closer to float32's logits that keeps SmolLM2's: test_models.py).
    head_dim 32, K of 128 and 256: whole AMX tiles where the CPU has them."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    spec = "random:llama:hidden_size=128,intermediate_size=256"
    model, _ = load_model(spec, "bfloat16")
    runner = ModelRunner(model, ModelInfo.from_model(model), 8, 16)
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    layers = [module for module in model.modules() if isinstance(module, PackedLinear)]
    assert len(layers) == 2 * 4 + 1 and all(layer.packed_weight.dtype == torch.bfloat16 for layer in layers)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the embeddings and norms
    residuals = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda _, args, out: residuals.append(out[0] if isinstance(out, tuple) else out))
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    with torch.inference_mode():
        meta = AttentionMetadata.build([0], [len(ids)], [[0, 1]], 16, kv_caches=runner.kv_caches)
        logits = model_logits(model, torch.tensor([ids]), meta.positions[None], torch.arange(len(ids)),
                              attn_metadata=meta)
        exact = random_model(spec)(input_ids=torch.tensor([ids])).logits[0]
    assert [x.dtype for x in residuals] == [torch.float32] * 2 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, exact, atol=0.1, rtol=0)  # bf16 weights' error, not a wrong forward's
