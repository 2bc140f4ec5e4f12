"""vLLM's prefix cache beside compaction: what a compressed request may share, and what it takes out of the index.

vLLM's prefix cache indexes full KV blocks by the hash of their tokens (chained from the first block) and lets a later
request with the same tokens hold the same blocks instead of computing them. A compaction rewrites a request's blocks
from its first kept position ``E`` on (the kept entries move into the slots of positions ``E .. N-1``), and every
token it computes after a compaction attends over the compressed cache: neither is the KV of those tokens that an
uncompressed request would compute. So, with the prefix cache on:

- a compressed request takes no hit (it computes its whole prompt): its blocks are its own when it writes them;
- before a compaction is directed, the blocks it writes (``E / bs`` to the last) must be held by this request alone:
  where another request took a hit on one of them (an uncompressed request with the same prefix, in the steps before),
  the request is left uncompressed rather than write into a shared block;
- those blocks leave the index (no later request can hit them), and none of the request's blocks enters it
  afterwards; the index reaches a block only through all the blocks before it, so the request's later blocks are out
  of reach too;
- the blocks of positions ``0 .. E-1``, freed by the compaction untouched, keep their hashes: a later uncompressed
  request with the same prefix (the next turn of a chat, another question on a document) reuses them.
"""

from __future__ import annotations

from kvpress_critical_vllm.budget import Eviction, blocks_for
from kvpress_critical_vllm.vllm_compat import (
    prefix_caching,
    shared_blocks,
    skip_prefix_cache_reads,
    stop_caching,
    unhash_blocks,
)


class PrefixCacheGuard:
    """One scheduler's prefix-cache rules (inert when the engine's prefix cache is off)."""

    def __init__(self, scheduler, metrics) -> None:
        self.enabled = prefix_caching(scheduler)
        self.metrics = metrics  # the scheduler's MetricsWriter: blocks_unhashed

    def track(self, request) -> None:
        """A request the plugin compresses: it takes no prefix-cache hit."""
        if self.enabled:
            skip_prefix_cache_reads(request)

    def before_compaction(self, scheduler, request_id: str, plan: Eviction) -> str:
        """Before directing the compaction ``plan``: ``""`` when it may write (its blocks then leave the index), or why
        it may not (a block it writes is shared with another request)."""
        if not self.enabled:
            return ""
        first, end = plan.evicted // plan.block_size, blocks_for(plan.seen, plan.block_size)
        group = scheduler.kvpress_group  # the compressed group: the others' blocks are not rewritten
        shared = shared_blocks(scheduler, request_id, first, end, group)
        if shared:
            return (
                f"{shared} of the blocks its compaction would rewrite are shared with another request through vLLM's "
                "prefix cache"
            )
        self.metrics.unhashed(unhash_blocks(scheduler, request_id, first, end, group))
        stop_caching(scheduler, request_id)  # every group: later tokens attend over the compressed cache
        return ""
