"""Real bitsandbytes layers (CPU here, CUDA in benchmarks/gpu_check.sh): 4-bit (nf4, fp4) and LLM.int8() o_proj.

bitsandbytes >= 0.45 quantizes on CPU, so these run in CI: the dense weight CriticalKV reads must be exactly the
weight the quantized layer multiplies with, and the pipeline must run both presses on SmolLM2 loaded quantized.
"""

import pytest
import torch
from kvpress import SnapKVPress
from transformers import DynamicCache

from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.modeling import dense_linear_weight, module_projected_norm
from kvpress_critical.ops.projected_value_norm import projected_value_norm_ref

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is in the dev extra: pip install -e '.[dev]'")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def linear4bit(dense: torch.Tensor, quant_type: str, device: str):
    layer = bnb.nn.Linear4bit(*reversed(dense.shape), bias=False, compute_dtype=torch.float32, quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit(dense.clone(), requires_grad=False, quant_type=quant_type)
    return layer.to(device)  # quantizes on the move to the device


def linear8bit(dense: torch.Tensor, device: str):
    layer = bnb.nn.Linear8bitLt(*reversed(dense.shape), bias=False, has_fp16_weights=False)
    layer.weight = bnb.nn.Int8Params(dense.clone(), requires_grad=False, has_fp16_weights=False)
    return layer.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_dense_weight_is_the_weight_the_layer_uses(kind, device):
    dense = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    layer = linear8bit(dense, device) if kind == "int8" else linear4bit(dense, kind, device)
    assert layer.weight.dtype in (torch.uint8, torch.int8), "the layer was not quantized"
    weight = dense_linear_weight(layer)
    assert weight.shape == dense.shape and weight.is_floating_point()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(device)
    expected = layer(x).float()
    # int8 matmuls round their inputs to fp16; the 4-bit layers multiply exactly with the dequantized weight
    tol = 2e-2 if kind == "int8" else 1e-5
    torch.testing.assert_close(x @ weight.float().T, expected, rtol=tol, atol=tol)
    # quantization error is bounded (the dense weight is not something else that happens to match)
    assert (weight.float().cpu() - dense).abs().max() < 0.5 * dense.abs().max()
    assert dense_linear_weight(layer) is weight  # dequantized once, cached


@pytest.fixture(scope="module", params=["4bit", "8bit"])
def quantized_smollm2(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from kvpress_critical.default_model import default_model_path

    path = default_model_path()
    config = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
        if request.param == "4bit"
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.float32, device_map="cpu", attn_implementation="sdpa"
    )
    return model.eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
def test_pipeline_on_quantized_smollm2(quantized_smollm2):
    from transformers import pipeline

    from kvpress_critical.data.text import haystack_context

    model, tokenizer = quantized_smollm2
    attn = model.model.layers[0].self_attn
    assert type(attn.o_proj).__module__.startswith("bitsandbytes")
    values = torch.randn(1, model.config.num_key_value_heads, 40, attn.head_dim)
    reference = projected_value_norm_ref(values, dense_linear_weight(attn.o_proj), model.config.num_attention_heads)
    torch.testing.assert_close(module_projected_norm(attn, values, "l1", "auto"), reference, rtol=1e-4, atol=1e-4)

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = haystack_context(tokenizer, 200, "The secret passphrase for the archive is violet-harbor-42.")
    question = "What is the secret passphrase for the archive?"
    n_ctx = pipe.preprocess(context, [question], "", max_context_length=10**6)["context_ids"].shape[1]
    n_layers = model.config.num_hidden_layers
    for press in (CriticalKVPress(SnapKVPress(0.5)), CriticalAdaKVPress(SnapKVPress(0.5))):
        cache = DynamicCache()
        answer = pipe(context, question=question, press=press, max_new_tokens=4, cache=cache)["answer"]
        assert isinstance(answer, str) and answer.strip()
        lengths = [cache.get_seq_length(i) for i in range(n_layers)]
        if isinstance(press, CriticalKVPress):
            assert lengths == [n_ctx // 2] * n_layers
        else:
            masked = {int(layer.self_attn.masked_key_indices[0].numel()) for layer in model.model.layers}
            assert masked == {model.config.num_key_value_heads * (n_ctx - n_ctx // 2)}
