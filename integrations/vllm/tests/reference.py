"""A transformers reference for the plugin: prefill a prompt, drop the entries vLLM dropped, decode greedily.

It runs in the plugin's environment (vLLM's transformers, no kvpress): the cache keeps, per layer and KV head,
exactly the positions the engine reports it kept, with their RoPE as computed at prefill, and decoding continues
at position ``N`` as it does in the engine.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def load_reference_model(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def layer_index(layer_name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12."""
    parts = layer_name.split(".")
    return int(parts[parts.index("layers") + 1])


@torch.no_grad()
def greedy_after_eviction(model, prompt_ids: list[int], kept: dict[str, list[list[int]]] | None, max_new_tokens: int):
    """
    Greedy tokens of ``model`` after prefilling ``prompt_ids`` and keeping, in each layer and KV head, only the
    positions ``kept[layer_name][head]`` (all of them when ``kept`` is None).
    """
    input_ids = torch.tensor([prompt_ids])
    cache = DynamicCache()
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    if kept is not None:
        for name, heads in kept.items():
            layer = cache.layers[layer_index(name)]
            index = torch.tensor(heads)[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index).contiguous()
            layer.values = layer.values.gather(2, index).contiguous()
    tokens = [int(out.logits[0, -1].argmax())]
    n_prompt = len(prompt_ids)
    for step in range(max_new_tokens - 1):
        cached = cache.layers[0].keys.shape[2]
        out = model(
            input_ids=torch.tensor([[tokens[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[n_prompt + step]]),
            cache_position=torch.tensor([cached]),
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens
