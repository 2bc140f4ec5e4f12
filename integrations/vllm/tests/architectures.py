"""Tiny random-weight models of the architectures people serve, saved by transformers from configs (no download), for
the plugin's model coverage (``test_models.py``): what each keeps per layer, and whether the plugin serves it.

Every model has 4 query and 2 KV heads of 64 dimensions, SmolLM2's tokenizer (its vocabulary) and untied embeddings
(tied random embeddings make the next token the last one, whatever the cache holds); the queries and keys are scaled
up as in the tensor-parallel tests' tiny Llama, so that attention is peaky as in trained models.
"""

from __future__ import annotations

from pathlib import Path

COMMON = dict(
    vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    pad_token_id=2,
)  # fmt: skip
WINDOW = 64  # the sliding window of the hybrid architectures' sliding layers


def _alternating(layers: int, every: int) -> list[str]:
    """``every - 1`` sliding-window layers, then a full-attention one."""
    return ["full_attention" if i % every == every - 1 else "sliding_attention" for i in range(layers)]


def configs() -> dict:
    """``{name: (config class name, keyword arguments)}`` of every architecture of the coverage table."""
    return {
        # the tiny Llama of the tensor-parallel tests, the benchmark scripts' quick runs and the small-pool and bounded
        # engines (whose preemption and fail-closed tests compare answers: untied, as every model here)
        "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
        "qwen2": ("Qwen2Config", dict(num_hidden_layers=2)),
        "qwen3": ("Qwen3Config", dict(num_hidden_layers=2)),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
        ),
        "phi3": ("Phi3Config", dict(num_hidden_layers=2)),
        "gemma3": (
            "Gemma3TextConfig",
            dict(num_hidden_layers=6, sliding_window=WINDOW, layer_types=_alternating(6, 3), query_pre_attn_scalar=64),
        ),
        # vLLM's Gemma 2 ties its embeddings; a logits soft cap of 5 (Gemma 2's is 50, for its larger logits) bends
        # this tiny model's scores as Gemma 2's cap bends its own
        "gemma2": (
            "Gemma2Config",
            dict(
                num_hidden_layers=2,
                sliding_window=WINDOW,
                layer_types=_alternating(2, 2),
                query_pre_attn_scalar=64,
                tie_word_embeddings=True,
                attn_logit_softcapping=5.0,
            ),
        ),
        "gpt_oss": (
            "GptOssConfig",
            dict(
                num_hidden_layers=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=WINDOW,
                layer_types=_alternating(2, 2),
            ),
        ),
        # Qwen3-Next: linear attention (Gated DeltaNet) in three layers of four, gated full attention in the fourth,
        # mixture-of-experts MLPs. vLLM's CPU build runs the linear layers in bfloat16 with heads of 128 dimensions
        # only; full-attention heads of 256 dimensions (Qwen3-Next's own) and 4 KV heads make a 32-token block's page
        # cover a linear layer's state, so that vLLM keeps 32-token blocks
        "qwen3_next": (
            "Qwen3NextConfig",
            dict(
                num_hidden_layers=4,
                full_attention_interval=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=256,
                linear_num_key_heads=1,
                linear_num_value_heads=1,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
            ),
        ),
        # attention-free (Mamba): no KV cache, refused
        "mamba": ("MambaConfig", dict(num_hidden_layers=2, state_size=16, expand=2)),
    }


def make_model(name: str, folder: Path, tokenizer_from: Path) -> str:
    """Save the tiny model ``name`` of :func:`configs` in ``folder`` (float32 weights, seeded), with the tokenizer of
    ``tokenizer_from`` and its chat template; its path."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, kwargs = configs()[name]
    config = getattr(transformers, class_name)(**{**COMMON, **kwargs})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if any(part in param_name for part in ("q_proj", "k_proj", "qkv_proj")):
                param.mul_(4.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / file).is_file():  # the template: a file of its own since transformers 5
            (folder / file).write_bytes((tokenizer_from / file).read_bytes())
    return str(folder)
