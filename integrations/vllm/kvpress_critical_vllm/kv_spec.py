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

from dataclasses import dataclass, fields, replace

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec

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


def _fields(spec: FullAttentionSpec) -> dict:
    return {field.name: getattr(spec, field.name) for field in fields(spec) if field.init}
