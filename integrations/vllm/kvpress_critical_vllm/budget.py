"""How many entries a compressed request keeps and how many whole KV blocks it frees.

The scheduler computes this from the prompt length, the request's options and the block size, and sends it to the
workers with the step that compresses the request (:mod:`kvpress_critical_vllm.protocol`): workers never work out
an eviction of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpress_critical.selection import compute_n_kept
from kvpress_critical_vllm.options import CompressionOptions


@dataclass(frozen=True)
class Eviction:
    """
    The eviction of one request with an ``n_prompt``-token prompt.

    ``budget`` is what the transformers press keeps (kvpress's ``max(1, int(N * (1 - ratio)))``); the plugin evicts
    the largest whole number of blocks that leaves at least that, ``evicted = floor((N - budget) / bs) * bs``, so
    every head keeps ``kept = N - evicted`` entries: between ``budget`` and ``budget + bs - 1``. ``reason`` says why
    nothing is evicted when ``evicted`` is 0.
    """

    n_prompt: int
    budget: int
    evicted: int
    block_size: int
    reason: str = ""

    @property
    def kept(self) -> int:
        return self.n_prompt - self.evicted

    @property
    def blocks_freed(self) -> int:
        return self.evicted // self.block_size

    @property
    def active(self) -> bool:
        """Whether anything is evicted (at least one whole block)."""
        return self.evicted > 0


def eviction(options: CompressionOptions, n_prompt: int, block_size: int) -> Eviction:
    """The :class:`Eviction` of a request; inactive (with its reason) when no whole block can be freed."""
    ratio = options.compression_ratio
    budget = compute_n_kept(n_prompt, ratio) if ratio > 0 else n_prompt
    reason = ""
    if ratio == 0:
        reason = "compression_ratio is 0"
    elif options.base == "snapkv" and n_prompt <= options.window_size:
        reason = f"its {n_prompt}-token prompt is not longer than SnapKV's window ({options.window_size})"
    elif options.base == "streaming_llm" and (n_prompt <= options.n_sink or budget < options.n_sink):
        reason = f"its {n_prompt}-token prompt leaves no room after StreamingLLM's {options.n_sink} sinks"
    elif n_prompt - budget < block_size:
        reason = (
            f"at compression_ratio {ratio:g} its {n_prompt}-token prompt would evict {n_prompt - budget} entries "
            f"per head, less than one {block_size}-token block (the plugin frees whole blocks; a smaller "
            "block_size frees more)"
        )
    evicted = 0 if reason else (n_prompt - budget) // block_size * block_size
    return Eviction(n_prompt=n_prompt, budget=budget, evicted=evicted, block_size=block_size, reason=reason)
