"""How many entries a compressed request keeps and how many whole KV blocks it frees.

Both the scheduler (which frees the blocks) and the workers (which compact the entries and shift the attention
view) compute these from the prompt length, the options and the block size alone, so they agree without talking.
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
    every head keeps ``kept = N - evicted`` entries: between ``budget`` and ``budget + bs - 1``.
    """

    n_prompt: int
    budget: int
    evicted: int
    block_size: int

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
    """The :class:`Eviction` of a request; inactive when no whole block can be freed or the press cannot score."""
    budget = compute_n_kept(n_prompt, options.compression_ratio) if options.compression_ratio > 0 else n_prompt
    scorable = not (
        (options.base == "snapkv" and n_prompt <= options.window_size)
        or (options.base == "streaming_llm" and (n_prompt <= options.n_sink or budget < options.n_sink))
    )
    evicted = (n_prompt - budget) // block_size * block_size if scorable else 0
    return Eviction(n_prompt=n_prompt, budget=budget, evicted=evicted, block_size=block_size)
