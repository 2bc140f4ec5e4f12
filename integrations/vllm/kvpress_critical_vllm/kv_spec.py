"""The KV cache spec of a bounded compressed request: what vLLM's start-up check and concurrency figures read.

vLLM refuses to start when one request of ``max_model_len`` tokens does not fit in the KV pool, reading each layer's
:meth:`~vllm.v1.kv_cache_interface.KVCacheSpec.max_memory_usage_bytes`. A request compacted after every prompt chunk
and while decoding (engine-wide ``compression_chunk_size``, ``compression_interval`` and ``target_size``) never holds
more than :func:`kvpress_critical_vllm.budget.hold_bound` blocks, whatever its length: the workers declare that bound on
their full-attention layers' specs (:class:`CompressedFullAttentionSpec`), so that the engine starts with a
``max_model_len`` longer than the pool and reports the concurrency the bound gives. Nothing else about the layers
changes: vLLM's registry finds the full-attention manager through the subclass, block tables keep
``max_model_len`` positions (the evicted ones point at the null block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

from kvpress_critical_vllm.budget import hold_bound
from kvpress_critical_vllm.options import CompressionOptions


@dataclass(frozen=True, kw_only=True)
class CompressedFullAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose requests hold at most ``max_blocks_held`` blocks (``None``: no bound)."""

    max_blocks_held: int | None = None

    def max_memory_usage_bytes(self, vllm_config) -> int:
        whole = super().max_memory_usage_bytes(vllm_config)
        if self.max_blocks_held is None:
            return whole
        return min(whole, self.max_blocks_held * self.page_size_bytes)

    @classmethod
    def merge(cls, specs: list[FullAttentionSpec]) -> "CompressedFullAttentionSpec":
        bounds = {getattr(spec, "max_blocks_held", None) for spec in specs}
        if len(bounds) != 1:
            raise AssertionError(f"layers of one KV cache group declare different bounds: {sorted(map(str, bounds))}")
        return replace(super().merge(specs), max_blocks_held=bounds.pop())


def bounded_specs(specs: dict[str, KVCacheSpec], options: CompressionOptions, max_len: int) -> dict[str, KVCacheSpec]:
    """``specs`` with each plain full-attention layer declaring the :func:`~kvpress_critical_vllm.budget.hold_bound`
    of ``options`` for its block size (unchanged where there is none)."""
    bounded = {}
    for name, spec in specs.items():
        bound = hold_bound(options, max_len, spec.block_size) if type(spec) is FullAttentionSpec else None
        bounded[name] = spec if bound is None else CompressedFullAttentionSpec(**_fields(spec), max_blocks_held=bound)
    return bounded


# the kinds of recurrent state beside full attention the plugin's tests serve (vLLM's MambaAttentionBackendEnum names):
# Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5)
SERVED_STATE_KINDS = ("GDN_ATTN",)


def compressed_group(groups: list, longer_than_pool: bool = False, tensor_parallel_size: int = 1) -> int:
    """
    The index of the KV-cache group the plugin compresses among vLLM's ``kv_cache_groups``: the one group of
    full-attention layers. Beside it, groups of sliding-window layers (Gemma 3, gpt-oss-style alternation, Llama or
    Mistral with ``layer_types``) are left to vLLM's sliding-window manager, which already frees what leaves their
    window, and groups of linear-attention layers (Gated DeltaNet: Qwen3-Next, Qwen3.5) to vLLM's Mamba manager, which
    keeps one recurrent state per request; they hold a window or a state per request, the full-attention group the
    rest. Any other layout is an :class:`~kvpress_critical_vllm.engine_config.EngineConfigError` naming it, as is a
    ``max_model_len`` longer than the pool (``longer_than_pool``) beside other groups, whose blocks the bound of a
    request does not count, and tensor parallelism beside them (not yet run together).
    """
    from kvpress_critical_vllm.engine_config import EngineConfigError

    kinds = [type(group.kv_cache_spec) for group in groups]
    names = ", ".join(kind.__name__ for kind in kinds) or "none"
    full = [index for index, kind in enumerate(kinds) if kind in (FullAttentionSpec, CompressedFullAttentionSpec)]
    others = [kind.__name__ for kind in kinds if kind not in (FullAttentionSpec, CompressedFullAttentionSpec)]
    unsupported = sorted({name for name in others if name not in (SlidingWindowSpec.__name__, MambaSpec.__name__)})
    if unsupported:
        raise EngineConfigError(
            f"kvpress_critical cannot compress with this engine: the model's KV cache has groups of {names}, and the "
            "plugin compresses full-attention layers beside sliding-window and linear-attention ones only "
            f"({', '.join(unsupported)} keep another kind of state, which no eviction of entries applies to). Serve "
            "a model whose layers are full, sliding-window or Gated DeltaNet attention, or vLLM without the plugin."
        )
    states = sorted(
        {_state_kind(group.kv_cache_spec) for group in groups if isinstance(group.kv_cache_spec, MambaSpec)}
        - set(SERVED_STATE_KINDS)
    )
    if states:
        raise EngineConfigError(
            f"kvpress_critical does not compress a model with {', '.join(states)} layers yet: the plugin leaves "
            "recurrent layers to vLLM and compresses the full-attention ones, which its tests run beside Gated "
            "DeltaNet linear attention (GDN_ATTN: Qwen3-Next, Qwen3.5) only. Serve it with vLLM without the plugin."
        )
    if not full and SlidingWindowSpec.__name__ in others:
        raise EngineConfigError(
            f"kvpress_critical cannot compress with this engine: every attention layer is sliding-window ({names}), "
            "so each request already holds at most its window; there is no full-attention layer to compress. Serve "
            "the model without the plugin, or as full attention with disable_sliding_window=True "
            "(--disable-sliding-window)."
        )
    if not full:
        raise EngineConfigError(
            f"kvpress_critical cannot compress with this engine: no layer is full attention ({names}), so a request "
            "holds a fixed state and no entries to evict. Serve the model with vLLM without the plugin."
        )
    windowed = [index for index in full if getattr(groups[index].kv_cache_spec, "sliding_window", None) is not None]
    if windowed:
        raise EngineConfigError(
            "kvpress_critical cannot compress with this engine: vLLM put sliding-window layers in a group of "
            "full-attention layers (the hybrid KV-cache manager is off), and the plugin compresses full-attention "
            "layers only. Unset disable_hybrid_kv_cache_manager (--disable-hybrid-kv-cache-manager)."
        )
    if len(full) > 1:
        raise EngineConfigError(
            f"kvpress_critical cannot compress with this engine: vLLM split the full-attention layers into "
            f"{len(full)} KV-cache groups ({names}: vLLM makes groups of equal size, and this model has fewer "
            "sliding-window layers than full-attention ones), and the plugin compresses one group. Serve it without "
            "the plugin."
        )
    if longer_than_pool and len(groups) > 1:
        raise EngineConfigError(
            "kvpress_critical cannot serve a max_model_len longer than the KV pool with this model: its "
            "sliding-window or linear-attention layers hold blocks beside the compressed full-attention ones, which "
            "the bound a compressed request holds does not count yet. Set max_model_len within the pool (or a larger "
            "pool), or drop the engine-wide compression_chunk_size / compression_interval that bound requests."
        )
    if tensor_parallel_size > 1 and len(groups) > 1:
        raise EngineConfigError(
            "kvpress_critical does not compress a model with sliding-window or linear-attention layers over "
            f"{tensor_parallel_size} tensor-parallel ranks yet (not tested together). Serve it with "
            "tensor_parallel_size=1, or vLLM without the plugin."
        )
    return full[0]


def companion_blocks(groups: list, compressed: int, vllm_config) -> Callable[[int], int]:
    """``blocks(tokens)``: the blocks a request of ``tokens`` tokens holds at most in the groups other than
    ``compressed`` (sliding-window groups: vLLM's own admission cap of a window, which frees what leaves it;
    linear-attention groups: the blocks of a request's recurrent state), for admission by what a compressed request
    holds at most."""
    from kvpress_critical_vllm.vllm_compat import companion_admission_blocks

    caps = [
        (companion_admission_blocks(group.kv_cache_spec, vllm_config), group.kv_cache_spec.block_size)
        for index, group in enumerate(groups)
        if index != compressed
    ]

    def blocks(tokens: int) -> int:
        return sum(min(-(-tokens // size), cap) for cap, size in caps)

    return blocks


def _state_kind(spec: MambaSpec) -> str:
    kind = spec.mamba_type
    return getattr(kind, "name", str(kind))


def _fields(spec: FullAttentionSpec) -> dict:
    return {field.name: getattr(spec, field.name) for field in fields(spec) if field.init}
