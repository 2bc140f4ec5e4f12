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

A compressed prefix is shared too (:class:`CompressedPrefixes`), with ``compression_chunk_size``: what a request holds
after the compaction at a chunk end ``P`` (the kept entries in the blocks of positions ``E .. P-1``) depends only on
its first ``P`` tokens and its options, since each chunk is scored before any later token is read. So after that
compaction is confirmed (``P`` on a block boundary), its blocks enter the index under the plugin's own hashes, keyed
by vLLM's chained hash of the ``P`` tokens (LoRA, multimodal inputs and ``cache_salt`` included) and the options that
shape the prompt's compactions; vLLM keeps them when they are freed and reuses them least recently used first, as its
own cached blocks. A later request with the same prefix and options starts from the longest such prefix its own
schedule compacts at (the same ``P`` and ``E``): its table holds null placeholders for positions ``0 .. E-1`` and
those blocks after them, it computes from ``P`` on, and its workers attend from ``E`` as the first request's did.
A compaction never writes a block another request holds or a kept prefix's block: it writes the kept entries into
fresh blocks instead (the workers' tables follow), and the shared blocks are left as they were; with too few free
blocks for that, a kept prefix's block leaves the index and is written in place, and a block another request holds
leaves the request uncompressed, as above.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, fields

from kvpress_critical_vllm.budget import Eviction, blocks_for
from kvpress_critical_vllm.options import CompressionOptions
from kvpress_critical_vllm.vllm_compat import (
    adopt_blocks,
    block_at,
    block_digest,
    cached_blocks,
    free_blocks,
    give_back_blocks,
    hash_block_size,
    hash_blocks,
    hold_blocks,
    prefix_caching,
    prefix_hash,
    real_blocks,
    skip_prefix_cache_reads,
    stop_caching,
    take_free_blocks,
    unhash_blocks,
)

logger = logging.getLogger(f"vllm.{__name__}")

PREFIXES_KEPT = 4096  # compressed prefixes remembered (their blocks are vLLM's to keep or reuse)
# options that do not shape a prompt's compactions (compression while decoding, engine-only settings)
NOT_IN_KEY = {
    "compression_interval", "target_size", "record_selections", "max_window_size", "max_kernel_size",
    "head_wise_kernel",
}  # fmt: skip


def options_key(options: CompressionOptions) -> bytes:
    """The options that shape a prompt's compactions, as bytes (part of a compressed prefix's key)."""
    return repr([(f.name, getattr(options, f.name)) for f in fields(options) if f.name not in NOT_IN_KEY]).encode()


@dataclass(frozen=True)
class KeptPrefix:
    """A compressed prefix in the index: the state after a compaction at ``seen`` tokens that evicted ``evicted``
    positions, its blocks (positions ``evicted .. seen - 1``) under the plugin's hashes ``digests``."""

    seen: int
    evicted: int
    digests: tuple[bytes, ...]


@dataclass(frozen=True)
class PrefixHit:
    """A request that starts from a kept compressed prefix: its first ``compactions`` prompt compactions are done."""

    prefix: KeptPrefix
    compactions: int


class CompressedPrefixes:
    """The compressed prefixes one scheduler kept (the most recent :data:`PREFIXES_KEPT`; a prefix whose blocks vLLM
    reused is forgotten when next looked up)."""

    def __init__(self, block_size: int, group: int) -> None:
        self.block_size, self.group = block_size, group
        self.kept: OrderedDict[bytes, KeptPrefix] = OrderedDict()
        self._digests: set[bytes] = set()  # every kept prefix's block hashes

    def holds(self, block) -> bool:
        """Whether ``block`` is in the index as a kept prefix's block."""
        digest = block_digest(block)
        return digest is not None and digest in self._digests

    def forget(self, key: bytes) -> None:
        self._digests.difference_update(self.kept.pop(key).digests)

    def blocks_of(self, scheduler, key: bytes) -> list | None:
        """The blocks of the kept prefix ``key``, or ``None`` (not kept, or some of its blocks were reused by vLLM:
        then forgotten)."""
        prefix = self.kept.get(key)
        if prefix is None:
            return None
        blocks = cached_blocks(scheduler, list(prefix.digests), self.group)
        if blocks is None:
            self.forget(key)
        return blocks

    def key(self, scheduler, request, options: CompressionOptions, seen: int) -> bytes | None:
        tokens = prefix_hash(request, seen, hash_block_size(scheduler))
        if tokens is None:
            return None
        return hashlib.sha256(b"kvpress_critical prefix\0" + options_key(options) + b"\0" + tokens).digest()

    def digests(self, key: bytes, first: int, end: int) -> tuple[bytes, ...]:
        """The plugin's hash of each block ``first .. end - 1`` of a prefix (never a hash of tokens)."""
        return tuple(hashlib.sha256(key + index.to_bytes(4, "little")).digest() for index in range(first, end))

    def stage_keys(self, scheduler, request, tracked) -> list[tuple[int, Eviction, bytes]]:
        """``(index, compaction, key)`` of each prompt compaction of a request on a block boundary, in order: the
        prefixes it may keep or start from (computed once per request)."""
        if tracked.prefix_keys is None:
            stages = tracked.schedule.stages[: tracked.schedule.prompt_stages]
            keys = []
            for index, stage in enumerate(stages):
                key = self.key(scheduler, request, tracked.options, stage.seen)  # None off a block boundary
                if key is not None:
                    keys.append((index, stage, key))
            tracked.prefix_keys = keys
        return tracked.prefix_keys

    def lookup(self, scheduler, request, tracked) -> PrefixHit | None:
        """The longest kept prefix of ``request`` (at a prompt compaction of its own schedule, before its last
        token), its blocks adopted into the request's table; ``None`` when there is none."""
        for index, stage, key in reversed(self.stage_keys(scheduler, request, tracked)):
            prefix = self.kept.get(key)
            if stage.seen >= request.num_tokens or prefix is None:
                continue
            if (prefix.seen, prefix.evicted) != (stage.seen, stage.evicted):
                continue
            blocks = self.blocks_of(scheduler, key)
            if blocks is None:  # vLLM reused some of its blocks
                continue
            self.kept.move_to_end(key)
            adopt_blocks(scheduler, request.request_id, self.group, stage.evicted // self.block_size, blocks)
            return PrefixHit(prefix, index + 1)
        return None

    def keep(self, scheduler, request, options: CompressionOptions, plan: Eviction) -> bool:
        """After a confirmed prompt compaction at a block boundary (:meth:`PrefixCacheGuard.keepable`): its blocks
        enter the index under the plugin's hashes. Whether a new prefix was kept."""
        key = self.key(scheduler, request, options, plan.seen)
        if key is None or self.blocks_of(scheduler, key) is not None:  # kept already (by a request at once)
            return False
        first, end = plan.evicted // self.block_size, plan.seen // self.block_size
        blocks = real_blocks(scheduler, request.request_id, first, end, self.group)
        if len(blocks) != end - first or any(block.block_hash is not None for block in blocks):
            return False  # never expected: a compaction's blocks are the request's own and out of the index
        digests = self.digests(key, first, end)
        hash_blocks(scheduler, blocks, list(digests), self.group)
        self.kept[key] = KeptPrefix(plan.seen, plan.evicted, digests)
        self._digests.update(digests)
        while len(self.kept) > PREFIXES_KEPT:
            self.forget(next(iter(self.kept)))
        return True


@dataclass
class Redirect:
    """Fresh blocks a directed compaction writes instead of the request's blocks at their indices:
    ``(index, fresh)``."""

    blocks: list[tuple[int, object]]

    @property
    def fresh(self) -> list:
        return [block for _, block in self.blocks]

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return tuple((index, block.block_id) for index, block in self.blocks)


class PrefixCacheGuard:
    """One scheduler's prefix-cache rules (inert when the engine's prefix cache is off), and its kept compressed
    prefixes (``share``: one KV-cache group, block hashes of one block each, a pool that holds ``max_model_len``)."""

    def __init__(self, scheduler, metrics, share_reason: str = "") -> None:
        self.enabled = prefix_caching(scheduler)
        self.metrics = metrics  # the scheduler's MetricsWriter: blocks_unhashed, prefixes reused
        group, block_size = scheduler.kvpress_group, scheduler.kvpress_block_size
        if self.enabled and not share_reason and hash_block_size(scheduler) != block_size:
            share_reason = f"vLLM hashes blocks of {hash_block_size(scheduler)} tokens, not the pool's {block_size}"
        self.share = self.enabled and not share_reason
        if self.enabled and share_reason:
            logger.info("kvpress_critical: compressed prefixes are not shared in this engine: %s", share_reason)
        self.prefixes = CompressedPrefixes(block_size, group)
        self.pinned: dict[bytes, list] = {}  # kept prefixes a waiting request will start from: one reference held

    def pin(self, scheduler, waiting) -> None:
        """Hold one reference on the blocks of each kept prefix that a waiting compressed request (``waiting``:
        ``(request, tracked)`` pairs) will start from, so that vLLM does not reuse them before it is admitted; give
        back the references of the others."""
        wanted: dict[bytes, list] = {}
        for request, tracked in waiting if self.share else ():
            if request.num_computed_tokens or not self.shares(tracked.options):
                continue
            for _, stage, key in reversed(self.prefixes.stage_keys(scheduler, request, tracked)):
                if stage.seen >= request.num_tokens:
                    continue
                blocks = self.pinned.get(key) or wanted.get(key) or self.prefixes.blocks_of(scheduler, key)
                if blocks is not None:
                    wanted[key] = blocks
                    break
        for key, blocks in self.pinned.items():
            if key not in wanted:
                give_back_blocks(scheduler, blocks)
        hold_blocks(scheduler, [block for key, blocks in wanted.items() if key not in self.pinned for block in blocks])
        self.pinned = wanted

    def track(self, request) -> None:
        """A request the plugin compresses: it takes no hit of vLLM's (a kept compressed prefix, :meth:`adopt`)."""
        if self.enabled:
            skip_prefix_cache_reads(request)

    def shares(self, options: CompressionOptions) -> bool:
        """Whether requests with ``options`` keep and reuse compressed prefixes (chunked schedules; not with
        ``record_selections``, whose records start at a request's first compaction)."""
        return self.share and options.compression_chunk_size > 0 and not options.record_selections

    def adopt(self, scheduler, request, tracked) -> PrefixHit | None:
        """A waiting compressed request's kept prefix, its blocks adopted (:meth:`CompressedPrefixes.lookup`)."""
        if tracked is None or not self.shares(tracked.options):
            return None
        return self.prefixes.lookup(scheduler, request, tracked)

    def keep(self, scheduler, request, options: CompressionOptions, plan: Eviction) -> None:
        """A confirmed compaction: keep its state as a compressed prefix when it may be shared."""
        if self.keepable(options, plan):
            self.prefixes.keep(scheduler, request, options, plan)

    def waits(self, scheduler, request, tracked, producers: dict) -> bool:
        """Whether a waiting compressed request waits a step: a running or preempted request (``producers``: request
        id -> its :class:`~kvpress_critical_vllm.tracking.Tracked` and the index of its first compaction not
        confirmed yet) is about to keep a longer prefix of it than any kept now, which it then starts from instead of
        computing the same entries (a document's questions sent at once)."""
        if tracked is None or not self.shares(tracked.options) or request.num_computed_tokens:
            return False
        keys = [
            key for _, stage, key in self.prefixes.stage_keys(scheduler, request, tracked)
            if stage.seen < request.num_tokens
        ]  # fmt: skip
        if not keys:
            return False
        coming = set()
        for other_id, (other, first) in producers.items():
            if other_id != request.request_id and self.shares(other.options):
                for index, _, key in self.prefixes.stage_keys(scheduler, scheduler.requests[other_id], other):
                    if index >= first:
                        coming.add(key)
        for key in reversed(keys):
            if self.prefixes.blocks_of(scheduler, key) is not None:
                return False
            if key in coming:
                return True
        return False

    def keepable(self, options: CompressionOptions, plan: Eviction) -> bool:
        """Whether the state after compaction ``plan`` of a request with ``options`` is kept once confirmed."""
        return self.shares(options) and plan.phase == "prompt" and plan.seen % plan.block_size == 0

    def before_compaction(
        self, scheduler, request_id: str, plan: Eviction, protect: int = 0
    ) -> tuple[str, Redirect | None, bool]:
        """
        Before directing the compaction ``plan``: ``("", redirect, protected)`` when it may write (its blocks then
        leave the index; where compressed prefixes are shared, the blocks another request holds and kept prefixes'
        blocks are written into the fresh blocks of ``redirect`` instead, when the pool has them), or why it may not
        (a block it would write is held by another request). ``protect``: the end of a prefix of this request to be
        kept once an earlier compaction is confirmed (async scheduling directs this one first): its blocks get fresh
        ones too, and ``protected`` says whether they all did.
        """
        if not self.enabled:
            return "", None, True
        first, end = plan.evicted // plan.block_size, blocks_for(plan.seen, plan.block_size)
        group = scheduler.kvpress_group  # the compressed group: the others' blocks are not rewritten
        protected_end = min(end, protect // plan.block_size)
        held = [(index, block_at(scheduler, request_id, index, group)) for index in range(first, end)]
        held = [(index, block) for index, block in held if not block.is_null]
        redirect = None
        if self.share:
            # every block another request holds is among these: with a redirect, none is written
            indices = [
                index
                for index, block in held
                if index < protected_end or block.ref_cnt > 1 or self.prefixes.holds(block)
            ]
            if indices and len(indices) <= free_blocks(scheduler):
                redirect = Redirect(list(zip(indices, take_free_blocks(scheduler, len(indices)))))
        skip = {index for index, _ in redirect.blocks} if redirect else set()
        shared = sum(block.ref_cnt > 1 for index, block in held if index not in skip)
        if shared:
            return (
                f"{shared} of the blocks its compaction would rewrite are shared with another request through vLLM's "
                "prefix cache",
                None,
                False,
            )
        self.metrics.unhashed(unhash_blocks(scheduler, request_id, first, end, group, skip=skip))
        stop_caching(scheduler, request_id)  # every group: later tokens attend over the compressed cache
        return "", redirect, all(index in skip for index in range(first, protected_end))
