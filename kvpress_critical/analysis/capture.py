"""Running a model with and without compression, and recording what the analysis needs.

- :func:`prefill_with_presses` prefills the context once, without compression, and lets every press
  compress that same prefill, layer by layer, exactly as kvpress's ``BasePress.forward_hook`` does
  (the hook only rewrites the cache; the forward itself, hence every later layer's input, is the same
  as without a press). Each press gets its own compressed cache, and we record which context entries it
  kept per KV head (and, for CriticalKV presses, which ones its first stage chose).
- :func:`capture_attention` records, per layer, the queries / keys / values the attention function
  received and its output (the head outputs before ``o_proj``) during a forward pass.
- :func:`forward_with_cache` runs the post-context tokens on a cache, with kvpress's pipeline
  conventions (positions continue after the original context length).
"""

import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from kvpress import BasePress, ScorerPress
from kvpress.utils import extract_keys_and_values
from torch import nn
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical.capabilities import capabilities
from kvpress_critical.modeling import attention_modules, module_projected_norm
from kvpress_critical.presses import CriticalAdaKVPress, CriticalHeadKVPress, CriticalKVPress
from kvpress_critical.selection import compute_n_kept, critical_adakv_keep_mask, two_stage_keep_mask

logger = logging.getLogger(__name__)

_MAX = torch.finfo(torch.float32).max


@dataclass
class LayerSelection:
    """
    What one press did to one layer's cache (batch size 1).

    Attributes
    ----------
    keep : torch.Tensor
        ``(H_kv, T)`` bool, the context entries kept (pruned presses) or not masked (head-wise presses).
    stage1 : torch.Tensor or None
        ``(H_kv, T)`` bool, CriticalKV's first-stage entries (None for other presses or when nothing
        was compressed).
    keys, values : torch.Tensor
        The layer's cache after compression.
    masked_key_indices : tuple or None
        What a head-wise press left on the module for kvpress's attention patch.
    """

    keep: torch.Tensor
    stage1: torch.Tensor | None
    keys: torch.Tensor
    values: torch.Tensor
    masked_key_indices: tuple | None = None


@dataclass
class PressSelection:
    """The :class:`LayerSelection` of every layer for one press."""

    layers: list[LayerSelection] = field(default_factory=list)

    def cache(self) -> DynamicCache:
        """A fresh cache holding this press's compressed context."""
        return cache_from_layers([(layer.keys, layer.values) for layer in self.layers])


def cache_from_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A fresh ``DynamicCache`` holding ``(keys, values)`` per layer (later updates do not modify them)."""
    cache = DynamicCache()
    for idx, (keys, values) in enumerate(layers):
        cache.update(keys, values, idx)
    return cache


@contextmanager
def _spy(obj, name: str, store: dict, key: str):
    """Record (a copy of) the return value of ``obj.name(...)`` into ``store[key]`` while active."""
    own = name in vars(obj)
    original = getattr(obj, name)

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        store[key] = out.detach().clone()
        return out

    setattr(obj, name, spy)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _pruned_keep_mask(scores: torch.Tensor, keys, new_keys, values, new_values, n_kept: int) -> torch.Tensor:
    """Keep mask of a ScorerPress, from its scores, checked against the cache it produced."""
    indices = scores.topk(n_kept, dim=-1).indices
    gather = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    if not (torch.equal(keys.gather(2, gather), new_keys) and torch.equal(values.gather(2, gather), new_values)):
        raise RuntimeError("could not identify the entries the press kept: its cache is not the top-k of its scores")
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, indices, True)


def _select(press: BasePress, module, hidden_states, keys, values, attentions, kwargs) -> LayerSelection:
    """Run ``press.compress`` on one layer's full prefill and record its selection."""
    if keys.shape[0] != 1:
        raise ValueError("the perturbation analysis runs one context at a time (batch size 1)")
    n_context = keys.shape[2]
    scores: dict = {}
    module.masked_key_indices = None
    with _spy(press, "score", scores, "outer") if isinstance(press, ScorerPress) else nullcontext():
        inner = getattr(press, "press", None)
        with _spy(inner, "score", scores, "inner") if isinstance(inner, ScorerPress) else nullcontext():
            new_keys, new_values = press.compress(module, hidden_states, keys, values, attentions, kwargs)
    masked = getattr(module, "masked_key_indices", None)
    module.masked_key_indices = None
    stage1 = None
    if masked is not None:
        keep = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        keep[masked] = False
    elif new_keys.shape[2] == n_context:
        keep = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
    elif "outer" in scores:
        keep = _pruned_keep_mask(scores["outer"], keys, new_keys, values, new_values, new_keys.shape[2])
    else:
        raise NotImplementedError(
            f"{type(press).__name__} pruned the cache without scores: the analysis supports ScorerPress "
            "subclasses (pruning) and AdaKVPress-style presses (masking)"
        )
    if isinstance(press, CriticalKVPress) and "outer" in scores:
        stage1 = scores["outer"] >= _MAX  # critical_scores gives stage-1 entries finfo(float32).max
    elif isinstance(press, CriticalAdaKVPress) and masked is not None and "inner" in scores:
        n_kept = compute_n_kept(n_context, press.compression_ratio)
        norms = module_projected_norm(module, values, press.norm, press.backend)
        expected, stage1, _ = critical_adakv_keep_mask(
            scores["inner"].float(), norms, n_kept, press.alpha_safeguard, press.first_stage_ratio, press.epsilon
        )
        if not torch.equal(expected, keep):
            logger.warning("layer %s: could not reproduce %s's selection; no stage-1 set", module.layer_idx, press)
            stage1 = None
    elif isinstance(press, CriticalHeadKVPress) and masked is not None and "inner" in scores:
        budgets = press.layer_budgets(module, n_context).to(keys.device).unsqueeze(0)  # (1, H_kv)
        n_first = torch.where(budgets > 0, (budgets * press.first_stage_ratio).long().clamp(min=1), 0)
        norms = module_projected_norm(module, values, press.norm, press.backend)
        expected, stage1 = two_stage_keep_mask(scores["inner"].float(), norms, budgets, n_first, press.epsilon)
        if not torch.equal(expected, keep):
            logger.warning("layer %s: could not reproduce %s's selection; no stage-1 set", module.layer_idx, press)
            stage1 = None
    return LayerSelection(
        keep=keep[0],
        stage1=None if stage1 is None else stage1[0],
        keys=new_keys,
        values=new_values,
        masked_key_indices=masked,
    )


@torch.no_grad()
def prefill_with_presses(
    model: nn.Module, context_ids: torch.Tensor, presses: dict[str, BasePress]
) -> tuple[DynamicCache, dict[str, PressSelection]]:
    """
    Prefill ``context_ids`` once (no compression) and let every press compress that prefill.

    Returns
    -------
    cache : DynamicCache
        The full-cache prefill.
    selections : dict
        Per press name, its :class:`PressSelection` (its compressed cache and kept entries per layer).
    """
    for press in presses.values():
        press.post_init_from_model(model)
    selections = {name: PressSelection() for name in presses}

    def hook(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        keys, values = extract_keys_and_values(cache, module.layer_idx)
        for name, press in presses.items():
            selections[name].layers.append(
                _select(press, module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            )
        return output

    modules = attention_modules(model)
    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    cache = DynamicCache()
    try:
        model.model(input_ids=context_ids, past_key_values=cache)
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            module.masked_key_indices = None
    for name, press in presses.items():  # presses that select every layer at the end (Layer-DefensiveKV)
        chosen = getattr(press, "last_selection", None)
        if capabilities(press).selects_after_last_layer and chosen:
            for module, layer in zip(modules, selections[name].layers):
                keep = chosen[module.layer_idx]
                layer.keep = keep[0]
                layer.masked_key_indices = tuple((~keep).nonzero(as_tuple=True))
    return cache, selections


@dataclass
class AttentionRecord:
    """Inputs and output of one attention call (batch row 0)."""

    output: torch.Tensor  # (L, H, d) head outputs before o_proj
    query: torch.Tensor | None = None  # (H, L, d) post-RoPE
    keys: torch.Tensor | None = None  # (H_kv, T, d)
    values: torch.Tensor | None = None  # (H_kv, T, d)
    scaling: float | None = None
    softcap: float | None = None


@contextmanager
def capture_attention(model: nn.Module, inputs: bool = True):
    """
    Record every layer's attention call during the forward passes run inside the block.

    Yields a dict ``layer_idx -> AttentionRecord``. The attention function of the model's implementation
    is wrapped (outside kvpress's masking patch), so the recorded query is exactly what the model used.
    """
    impl = model.config._attn_implementation
    if impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"the perturbation analysis records attention through transformers' attention functions, which "
            f"attn_implementation={impl!r} does not use; load the model with attn_implementation='sdpa'"
        )
    original = ALL_ATTENTION_FUNCTIONS[impl]
    records: dict[int, AttentionRecord] = {}

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        window = kwargs.get("sliding_window")
        if window is not None and key.shape[2] > window:
            raise NotImplementedError(
                f"layer {module.layer_idx} uses a sliding window ({window}) shorter than the input"
            )
        record = None
        if inputs:
            scaling = kwargs.get("scaling")
            record = dict(
                query=query[0].detach().clone(),
                keys=key[0].detach().clone(),
                values=value[0].detach().clone(),
                scaling=float(module.scaling if scaling is None else scaling),
                softcap=kwargs.get("softcap"),
            )
        output, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
        records[module.layer_idx] = AttentionRecord(output=output[0].detach().clone(), **(record or {}))
        return output, weights

    ALL_ATTENTION_FUNCTIONS[impl] = wrapper
    try:
        yield records
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = original


@torch.no_grad()
def forward_with_cache(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    context_length: int,
    masked_key_indices: list | None = None,
) -> torch.Tensor:
    """
    Logits ``(L, V)`` of ``input_ids`` run after a (possibly compressed) context cache.

    Positions continue at ``context_length`` whatever the cache length (kvpress pipeline convention);
    ``masked_key_indices`` (one entry per layer) are set on the attention modules for head-wise presses.
    """
    modules = attention_modules(model)
    for idx, module in enumerate(modules):
        module.masked_key_indices = masked_key_indices[idx] if masked_key_indices else None
    position_ids = torch.arange(context_length, context_length + input_ids.shape[1], device=input_ids.device)
    try:
        out = model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids.unsqueeze(0))
    finally:
        for module in modules:
            module.masked_key_indices = None
    return out.logits[0].float()


__all__ = [
    "AttentionRecord",
    "LayerSelection",
    "PressSelection",
    "cache_from_layers",
    "capture_attention",
    "forward_with_cache",
    "prefill_with_presses",
]
