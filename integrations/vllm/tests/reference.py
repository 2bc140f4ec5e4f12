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
def greedy_decode(model, cache, logits: torch.Tensor, n_prompt: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens from the prompt's last ``logits`` on, each new token at position ``n_prompt + step`` and appended
    after what ``cache`` holds (which may be fewer entries than positions)."""
    tokens = [int(logits[0, -1].argmax())]
    for step in range(max_new_tokens - 1):
        cached = cache.get_seq_length()
        out = model(
            input_ids=torch.tensor([[tokens[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[n_prompt + step]]),
            cache_position=torch.tensor([cached]),
            use_cache=True,
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


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
    return greedy_decode(model, cache, out.logits, len(prompt_ids), max_new_tokens)


@torch.no_grad()
def greedy_after_chunked_eviction(model, prompt_ids: list[int], stages: list[dict], max_new_tokens: int):
    """
    Greedy tokens of ``model`` after prefilling ``prompt_ids`` in the chunks the engine compacted after, each chunk at
    its own positions over what the earlier compactions kept: after the chunk that ends at ``stage["seen"]`` tokens,
    each layer and KV head keeps only the prompt positions ``stage["kept"][layer_name][head]`` (the same number in
    every head). The tokens after the last compaction are prefilled as one more chunk, then decoding continues at
    position ``N``.
    """
    cache = DynamicCache()
    held: dict[int, torch.Tensor] = {}  # layer index -> (H_kv, entries) the prompt positions the cache holds
    done = 0

    def run(first: int, end: int):
        cached = cache.get_seq_length()
        return model(
            input_ids=torch.tensor([prompt_ids[first:end]]),
            past_key_values=cache,
            position_ids=torch.arange(first, end)[None],
            cache_position=torch.arange(cached, cached + end - first),
            use_cache=True,
        )

    out = None
    for stage in stages:
        seen = stage["seen"]
        out = run(done, seen)
        for name, heads in stage["kept"].items():
            index = layer_index(name)
            layer = cache.layers[index]
            fresh = torch.arange(done, seen).expand(len(heads), -1)
            positions = fresh if index not in held else torch.cat([held[index], fresh], dim=1)
            kept = torch.tensor(heads)  # (H_kv, kept), ascending
            rows = torch.searchsorted(positions, kept)
            assert bool((positions.gather(1, rows) == kept).all()), "a kept position the cache does not hold"
            gather = rows[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather).contiguous()
            layer.values = layer.values.gather(2, gather).contiguous()
            held[index] = kept
        done = seen
    n_prompt = len(prompt_ids)
    if done < n_prompt:
        out = run(done, n_prompt)
    return greedy_decode(model, cache, out.logits, n_prompt, max_new_tokens)


_DROPPED: dict[int, torch.Tensor] = {}  # layer index -> (H_kv, N) bool: the prompt entries a KV head dropped


def _masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention in which each KV head skips the prompt entries it dropped (``_DROPPED``), kvpress's masking."""
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1)
    values = value.repeat_interleave(group, dim=1)
    weights = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    dropped = _DROPPED.get(module.layer_idx)
    if dropped is not None:
        hidden = torch.zeros(weights.shape[1], weights.shape[-1], dtype=torch.bool)
        hidden[:, : dropped.shape[1]] = dropped.repeat_interleave(group, dim=0)
        weights = weights.masked_fill(hidden[None, :, None, :], float("-inf"))
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


@torch.no_grad()
def greedy_with_head_masks(model, prompt_ids: list[int], kept: dict[str, list[list[int]]], max_new_tokens: int):
    """
    Greedy tokens of ``model`` after prefilling ``prompt_ids`` with every entry, then decoding with each layer's KV
    head attending only to the prompt positions ``kept[layer_name][head]`` (any number per head) and every new token:
    kvpress's masking of head-wise presses, written out.
    """
    from transformers import AttentionInterface

    AttentionInterface.register("kvpress_critical_masked", _masked_eager)
    n_prompt = len(prompt_ids)
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    _DROPPED.clear()
    for name, heads in kept.items():
        dropped = torch.ones(len(heads), n_prompt, dtype=torch.bool)
        for head, positions in enumerate(heads):
            dropped[head, positions] = False
        _DROPPED[layer_index(name)] = dropped
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvpress_critical_masked")
    try:
        for _ in range(max_new_tokens - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    finally:
        model.set_attn_implementation(previous)
        _DROPPED.clear()
    return tokens
