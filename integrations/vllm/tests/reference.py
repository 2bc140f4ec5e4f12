"""A transformers reference for the plugin: prefill a prompt, drop the entries vLLM dropped, decode greedily.

It runs in the plugin's environment (vLLM's transformers, no kvpress): the cache keeps, per layer and KV head,
exactly the positions the engine reports it kept, with their RoPE as computed at prefill, and decoding continues
at position ``N`` as it does in the engine.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def fp8_codes(x: torch.Tensor, code_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The fp8 codes ``CPU_ATTN`` stores for ``x`` (its ``cpu_attn_reshape_and_cache``): ``x / scale`` in float32,
    saturated at the format's largest finite value and rounded toward zero (not to nearest)."""
    finfo = torch.finfo(code_dtype)
    y = (x.float() / scale).clamp(-finfo.max, finfo.max)
    nearest = y.to(code_dtype)
    bits = nearest.view(torch.uint8)
    away = nearest.float().abs() > y.abs()  # rounded away from zero: the next code toward zero
    return torch.where(away, bits - 1, bits).view(code_dtype)


def fp8_round(x: torch.Tensor, code_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as an fp8 cache holds it: its code times ``scale``, in ``x``'s dtype."""
    return (fp8_codes(x, code_dtype, scale).float() * scale).to(x.dtype)


_FORCED: dict = {}  # "tokens": the tokens the greedy functions follow (teacher_forced); "margins": what each cost


def _next_token(logits: torch.Tensor) -> int:
    """The greedy token of ``logits`` (``(vocab,)``), or the one :func:`teacher_forced` dictates, recording how far its
    logit is below the best one."""
    best = int(logits.argmax())
    if "tokens" not in _FORCED:
        return best
    margins = _FORCED["margins"]
    token = _FORCED["tokens"][len(margins)]
    margins.append(float(logits[best] - logits[token]))
    return token


@contextmanager
def teacher_forced(tokens: list[int]):
    """Within it, the greedy functions below follow ``tokens`` (an engine's answer) instead of their own argmax and
    yield, per step, the reference's best logit minus the logit of the token followed (0.0 where the engine chose the
    reference's greedy token): every step of an answer is checked, not only those before a first near-tie flips. The
    tokens followed being known, the functions run those between two compactions in one forward (:func:`_generate`)."""
    _FORCED.update(tokens=list(tokens), margins=[])
    try:
        yield _FORCED["margins"]
    finally:
        _FORCED.clear()


def margins_along(tokens: list[int], greedy, *args) -> list[float]:
    """Per step of ``tokens`` (an engine's answer), how far the reference ``greedy(*args, len(tokens))`` (one of the
    greedy functions below) puts the engine's token below its best one, the reference following the engine's tokens:
    all 0.0 exactly when the reference's own greedy answer is ``tokens``."""
    with teacher_forced(tokens) as margins:
        greedy(*args, len(tokens))
    return list(margins)


def greedy_mismatches(tokens: list[int], greedy, *args, max_new_tokens: int) -> list:
    """What stops ``tokens`` from being the greedy answer of ``max_new_tokens`` tokens of the reference
    ``greedy(*args, max_new_tokens)``: ``[(step, logit margin), ...]`` for each step at which the reference prefers
    another token (a wrong length first, as ``("length", len(tokens))``); empty when they are the same answer. Checked
    step by step with the reference following ``tokens`` (:func:`margins_along`): the same verdict as generating
    freely and comparing, at the cost of one forward over the answer."""
    if len(tokens) != max_new_tokens:
        return [("length", len(tokens))]
    return [(step, round(margin, 4)) for step, margin in enumerate(margins_along(tokens, greedy, *args)) if margin > 0]


def load_reference_model(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def sliding_window(model) -> int | None:
    """The window of a hybrid model's sliding-window layers (``layer_types``), None where every layer is full."""
    types = getattr(model.config, "layer_types", None) or ()
    return model.config.sliding_window if "sliding_attention" in types else None


def new_cache(model) -> DynamicCache:
    """An empty cache: a hybrid model's sliding-window layers hold their window, as vLLM's sliding-window groups do,
    and its linear-attention layers their recurrent state."""
    types = set(getattr(model.config, "layer_types", None) or ())
    return DynamicCache(config=model.config) if types - {"full_attention"} else DynamicCache()


def _held(cache, index: int) -> int:
    keys = getattr(cache.layers[index], "keys", None)
    return 0 if keys is None or keys.dim() < 3 else keys.shape[-2]


def attention_masks(model, cache, first: int, q_len: int) -> dict | None:
    """
    The masks of ``q_len`` tokens at positions ``first ..`` of a hybrid model (None for any other: transformers' own):
    in the full-attention layers, every entry the cache holds (what a compaction kept, whatever its position) and the
    new tokens causally; in the sliding-window layers, the entries whose positions lie within the window.
    Transformers derives one mask from the positions for every layer of a kind, which a compacted cache no longer
    matches.
    """
    window = sliding_window(model)
    if window is None:
        return None
    types = model.config.layer_types
    full_layers = [i for i, kind in enumerate(types) if kind == "full_attention"]
    held = {_held(cache, i) for i in full_layers}
    assert len(held) == 1, f"full-attention layers hold different numbers of entries: {held}"
    past = held.pop()
    rows = torch.arange(q_len)[:, None]
    column = torch.arange(past + q_len)[None]
    full = (column < past) | (column - past <= rows)
    past_window = _held(cache, types.index("sliding_attention"))
    key_positions = first - past_window + torch.arange(past_window + q_len)[None]
    query_positions = first + rows
    sliding = (key_positions <= query_positions) & (query_positions - key_positions < window)

    def additive(visible: torch.Tensor) -> torch.Tensor:
        return torch.zeros(visible.shape, dtype=model.dtype).masked_fill(~visible, float("-inf"))[None, None]

    return {"full_attention": additive(full), "sliding_attention": additive(sliding)}


def layer_index(layer_name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12."""
    parts = layer_name.split(".")
    return int(parts[parts.index("layers") + 1])


def _forward(model, cache, tokens: list[int], first: int):
    """``tokens`` at positions ``first ..`` appended after what ``cache`` holds (which may be fewer entries than
    positions), causally among themselves."""
    cached = cache.get_seq_length()
    return model(
        input_ids=torch.tensor([tokens]),
        past_key_values=cache,
        position_ids=torch.arange(first, first + len(tokens))[None],
        cache_position=torch.arange(cached, cached + len(tokens)),
        attention_mask=attention_masks(model, cache, first, len(tokens)),
        use_cache=True,
    )


def _generate(model, cache, logits: torch.Tensor, n_prompt: int, max_new_tokens: int, compact=None, seen=()):
    """
    Greedy tokens from the prompt's last ``logits`` on, the token at position ``p`` appended after what ``cache``
    holds; ``compact(p)`` runs once the tokens before position ``p`` are in the cache, for each ``p`` in ``seen``.
    Free-running, one token a step. Teacher-forced (:func:`teacher_forced`), the tokens followed are known: those
    between two compactions run in one forward, whose every row gives one step's logits (the same greedy choices,
    computed causally at once; a long answer's reference costs a prefill instead of a step per token).
    """
    tokens = [_next_token(logits[0, -1])]
    position, end = n_prompt, n_prompt + max_new_tokens - 1  # the next input's position; the last one's, plus one
    while position < end:
        if "tokens" in _FORCED:
            stop = min([p for p in seen if position < p < end] + [end])
            out = _forward(model, cache, _FORCED["tokens"][position - n_prompt : stop - n_prompt], position)
            tokens += [_next_token(row) for row in out.logits[0]]
        else:
            stop = position + 1
            out = _forward(model, cache, tokens[-1:], position)
            tokens.append(_next_token(out.logits[0, -1]))
        position = stop
        if position in seen:
            compact(position)
    return tokens


@torch.no_grad()
def greedy_decode(model, cache, logits: torch.Tensor, n_prompt: int, max_new_tokens: int) -> list[int]:
    """Greedy tokens from the prompt's last ``logits`` on, each new token at position ``n_prompt + step`` and appended
    after what ``cache`` holds (which may be fewer entries than positions)."""
    return _generate(model, cache, logits, n_prompt, max_new_tokens)


@torch.no_grad()
def greedy_after_eviction(model, prompt_ids: list[int], kept: dict[str, list[list[int]]] | None, max_new_tokens: int):
    """
    Greedy tokens of ``model`` after prefilling ``prompt_ids`` and keeping, in each layer and KV head, only the
    positions ``kept[layer_name][head]`` (all of them when ``kept`` is None).
    """
    input_ids = torch.tensor([prompt_ids])
    cache = new_cache(model)
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    if kept is not None:
        for name, heads in kept.items():
            layer = cache.layers[layer_index(name)]
            index = torch.tensor(heads)[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index).contiguous()
            layer.values = layer.values.gather(2, index).contiguous()
    return greedy_decode(model, cache, out.logits, len(prompt_ids), max_new_tokens)


@torch.no_grad()
def greedy_with_compactions(model, prompt_ids: list[int], stages: list[dict], max_new_tokens: int):
    """
    Greedy tokens of ``model`` with the engine's compactions replayed: the prompt is prefilled in the chunks the
    engine compacted after, each chunk at its own positions over what the earlier compactions kept, then decoded one
    token at a time; after the chunk or the decoding step that ends at ``stage["seen"]`` tokens, each layer and KV head
    keeps only the positions ``stage["kept"][layer_name][head]`` (the same number in every head). Prompt tokens after
    the prompt's last compaction are prefilled as one more chunk; decoding continues at position ``N``.
    """
    cache = new_cache(model)
    held: dict[int, torch.Tensor] = {}  # layer index -> (H_kv, entries) the positions the cache holds
    by_seen = {stage["seen"]: stage["kept"] for stage in stages}
    done = 0  # tokens seen at the last compaction

    def compact(seen: int) -> None:
        nonlocal done
        for name, heads in by_seen[seen].items():
            index = layer_index(name)
            layer = cache.layers[index]
            fresh = torch.arange(done, seen).expand(len(heads), -1)
            positions = fresh if index not in held else torch.cat([held[index], fresh], dim=1)
            kept = torch.tensor(heads)  # (H_kv, kept), ascending
            rows = torch.searchsorted(positions.contiguous(), kept)
            assert bool((positions.gather(1, rows.clamp(max=positions.shape[1] - 1)) == kept).all()), (
                "a kept position the cache does not hold"
            )
            gather = rows[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather).contiguous()
            layer.values = layer.values.gather(2, gather).contiguous()
            held[index] = kept
        done = seen

    n_prompt = len(prompt_ids)
    out = None
    for seen in sorted(s for s in by_seen if s <= n_prompt):
        out = _forward(model, cache, prompt_ids[done:seen], done)
        compact(seen)
    if done < n_prompt:
        out = _forward(model, cache, prompt_ids[done:], done)
    return _generate(model, cache, out.logits, n_prompt, max_new_tokens, compact, set(by_seen))


def reference_of(result, model) -> tuple:
    """The reference of an engine's answer (``conftest.Result``: its row's kind, prompt, kept entries and stages) over
    ``model``, as ``(greedy function, its arguments)``: the whole cache or the same kept entries (uniform presses,
    uncompressed rows), each head's own entries masked (head-wise presses), the compactions replayed (after every
    chunk, while decoding)."""
    if result.row.kind in ("uniform", "uncompressed"):
        return greedy_after_eviction, model, result.prompt, result.kept
    if result.row.kind == "head_wise":
        return greedy_with_head_masks, model, result.prompt, result.kept
    return greedy_with_compactions, model, result.prompt, result.stages


_DROPPED: dict[int, torch.Tensor] = {}  # layer index -> (H_kv, N) bool: the prompt entries a KV head dropped
_FP8: dict = {}  # "codes": the fp8 dtype the cache rounds keys and values to (fp8_cache), absent for a float cache


def _masked_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention in which each KV head skips the prompt entries it dropped (``_DROPPED``), kvpress's masking;
    over an fp8 cache (:func:`fp8_cache`), every key and value as the cache holds it; a logits soft cap (Gemma 2) and
    attention sinks (gpt-oss) as those models' own eager attention applies them."""
    if "codes" in _FP8:  # rounding is idempotent: the whole cache, rounded again at each call, is what vLLM holds
        key, value = fp8_round(key, _FP8["codes"]), fp8_round(value, _FP8["codes"])
    group = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(group, dim=1)
    values = value.repeat_interleave(group, dim=1)
    weights = torch.matmul(query, keys.transpose(2, 3)) * scaling
    softcap = kwargs.get("softcap")  # Gemma 2's logits soft cap, as its eager attention applies it
    if softcap:
        weights = softcap * torch.tanh(weights / softcap)
    if attention_mask is not None:
        weights = weights + attention_mask
    dropped = _DROPPED.get(module.layer_idx)
    if dropped is not None:
        hidden = torch.zeros(weights.shape[1], weights.shape[-1], dtype=torch.bool)
        hidden[:, : dropped.shape[1]] = dropped.repeat_interleave(group, dim=0)
        weights = weights.masked_fill(hidden[None, :, None, :], float("-inf"))
    sinks = getattr(module, "sinks", None)  # gpt-oss: one more logit per head in the softmax, its weight dropped
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(weights.shape[0], -1, weights.shape[2], 1).to(weights.dtype)
        weights = torch.softmax(torch.cat([weights, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        weights = weights.to(query.dtype)
    else:
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), weights


def _register_masked() -> None:
    """``_masked_eager`` as the attention ``kvpress_critical_masked``, with eager attention's masks (transformers
    builds no mask at all for an attention it does not know: a prefill would not be causal)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("kvpress_critical_masked", _masked_eager)
    AttentionMaskInterface.register("kvpress_critical_masked", eager_mask)


@torch.no_grad()
def greedy_with_head_masks(model, prompt_ids: list[int], kept: dict[str, list[list[int]]], max_new_tokens: int):
    """
    Greedy tokens of ``model`` after prefilling ``prompt_ids`` with every entry, then decoding with each layer's KV
    head attending only to the prompt positions ``kept[layer_name][head]`` (any number per head) and every new token:
    kvpress's masking of head-wise presses, written out.
    """
    _register_masked()
    n_prompt = len(prompt_ids)
    cache = new_cache(model)
    out = model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
    _DROPPED.clear()
    for name, heads in kept.items():
        dropped = torch.ones(len(heads), n_prompt, dtype=torch.bool)
        for head, positions in enumerate(heads):
            dropped[head, positions] = False
        _DROPPED[layer_index(name)] = dropped
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvpress_critical_masked")
    try:
        return _generate(model, cache, out.logits, n_prompt, max_new_tokens)
    finally:
        model.set_attn_implementation(previous)
        _DROPPED.clear()


@contextmanager
def fp8_cache(model, code_dtype: torch.dtype):
    """Within it, ``model`` attends over keys and values rounded as vLLM's fp8 cache stores them (scales of 1.0,
    :func:`fp8_codes`): every entry, the prompt's and each new token's, as the engine's attention reads them."""
    _register_masked()
    previous = model.config._attn_implementation
    _FP8["codes"] = code_dtype
    model.set_attn_implementation("kvpress_critical_masked")
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        _FP8.clear()


_CAPTURED: dict = {}  # layer index -> (query (H, N, d), key (H_kv, N, d), value (H_kv, N, d)) of a prefill


def _capturing_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """:func:`_masked_eager` (the models' eager attention, with nothing dropped), recording the layer's post-RoPE
    queries, keys and values."""
    _CAPTURED[module.layer_idx] = (query[0].detach().clone(), key[0].detach().clone(), value[0].detach().clone())
    return _masked_eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


@torch.no_grad()
def prefill_states(model, prompt_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{layer index: (queries (H, N, d), keys (H_kv, N, d), values (H_kv, N, d))}`` of every attention layer of a
    prefill of ``prompt_ids``, post-RoPE, as the model's eager attention computes them: what a press scores."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("kvpress_critical_capture", _capturing_eager)
    AttentionMaskInterface.register("kvpress_critical_capture", eager_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvpress_critical_capture")
    _CAPTURED.clear()
    try:
        model(input_ids=torch.tensor([prompt_ids]), past_key_values=new_cache(model), use_cache=True)
        return dict(_CAPTURED)
    finally:
        model.set_attn_implementation(previous)
        _CAPTURED.clear()
