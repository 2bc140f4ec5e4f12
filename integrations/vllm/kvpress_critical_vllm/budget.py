"""How many entries a compressed request keeps and how many whole KV blocks it frees, at each of its compactions.

The scheduler computes this from the prompt length, the request's options and the block size, and sends it to the
workers with the step that compresses the request (:mod:`kvpress_critical_vllm.protocol`): workers never work out
an eviction of their own.

Without ``compression_chunk_size`` a request is compacted once, after its prompt (:func:`eviction`). With
``compression_chunk_size`` its prompt is prefilled in chunks and compacted after each one (:func:`schedule`): after the
chunk that ends at position ``P``, what it holds (positions ``S .. P-1``: the entries kept so far and the chunk) is
compacted to what ``ChunkedPrefillPress`` keeps for ``P`` tokens seen, ``max(1, int(P * (1 - ratio)))``, rounded up to
whole blocks.

With ``compression_interval`` and ``target_size`` a request is also compacted while decoding (kvpress's
``DecodingPress``): after every ``compression_interval`` generated tokens, at ``T = P + k * interval`` tokens seen,
what it holds goes back to ``target_size`` entries per head, rounded up to whole blocks (:func:`decoding_eviction`);
an interval that frees no whole block is not compacted. These compactions depend only on the prompt's length and the
options, so :class:`Schedule` lists them as far as a request goes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpress_critical.selection import compute_n_kept
from kvpress_critical_vllm.options import CompressionOptions, OptionsError


@dataclass(frozen=True)
class Eviction:
    """
    One compaction of a request, after the step whose tokens end at position ``seen`` (the prompt's end, a chunk's end
    with ``compression_chunk_size``, or the end of a decoding interval: ``phase`` is ``"prompt"`` or ``"decoding"``).

    Before it, the request holds positions ``start .. seen - 1`` (``start`` positions were evicted by its earlier
    compactions: 0 for the first). ``budget`` is what the transformers press keeps for ``seen`` tokens (kvpress's
    ``max(1, int(N * (1 - ratio)))`` for a prompt, ``target_size`` while decoding); the plugin evicts the largest whole
    number of blocks that leaves at least that, ``evicted = start + floor((N - start - budget) / bs) * bs`` (counted
    from position 0), so every head keeps ``kept = N - evicted`` entries: between ``budget`` and ``budget + bs - 1``.
    ``reason`` says why nothing is evicted when ``evicted`` is ``start``. ``index`` and ``count`` number the request's
    prompt compactions (1 of 1 without ``compression_chunk_size``), ``index`` alone its decoding ones (``count`` 0).
    """

    seen: int
    budget: int
    evicted: int
    block_size: int
    reason: str = ""
    start: int = 0
    index: int = 1
    count: int = 1
    phase: str = "prompt"

    @property
    def kept(self) -> int:
        return self.seen - self.evicted

    @property
    def boundary(self) -> int:
        """The last block boundary at or before ``seen``: positions from here share a block with the next tokens."""
        return self.seen // self.block_size * self.block_size

    @property
    def held(self) -> int:
        """Entries per head before this compaction (the ones it scores)."""
        return self.seen - self.start

    @property
    def blocks_freed(self) -> int:
        """Blocks this compaction frees."""
        return (self.evicted - self.start) // self.block_size

    @property
    def active(self) -> bool:
        """Whether anything is evicted (at least one whole block)."""
        return self.evicted > self.start


def blocks_for(n_tokens: int, block_size: int) -> int:
    """The blocks ``n_tokens`` positions from a block boundary take: ``ceil(n_tokens / block_size)``."""
    return -(-n_tokens // block_size)


def whole_blocks_over(seen: int, start: int, budget: int, block_size: int) -> int:
    """Positions a request holding ``start .. seen - 1`` can evict in whole blocks and keep at least ``budget``
    entries per head: ``floor((seen - start - budget) / block_size) * block_size``, 0 when not one block."""
    return max(0, (seen - start - budget) // block_size * block_size)


def prompt_budget(options: CompressionOptions, n_prompt: int) -> int:
    """Entries per head a prompt compaction keeps after ``n_prompt`` tokens: ``ChunkedPrefillPress``'s
    ``max(1, int(N * (1 - ratio)))``, at least ``min_kept`` (never more than the prompt); all of them at ratio 0."""
    ratio = options.compression_ratio
    if ratio <= 0:
        return n_prompt
    return max(compute_n_kept(n_prompt, ratio), min(options.min_kept, n_prompt))


def eviction(options: CompressionOptions, n_prompt: int, block_size: int, start: int = 0) -> Eviction:
    """The :class:`Eviction` after ``n_prompt`` tokens of a request that holds positions ``start ..``; inactive (with
    its reason) when no whole block can be freed."""
    ratio = options.compression_ratio
    budget = prompt_budget(options, n_prompt)
    free = whole_blocks_over(n_prompt, start, budget, block_size)
    reason = ""
    if ratio == 0:
        reason = "compression_ratio is 0"
    elif n_prompt <= options.min_kept:
        reason = f"its {n_prompt}-token prompt is not longer than min_kept ({options.min_kept})"
    elif options.base == "snapkv" and n_prompt <= options.window_size:
        reason = f"its {n_prompt}-token prompt is not longer than SnapKV's window ({options.window_size})"
    elif options.base == "streaming_llm" and (n_prompt <= options.n_sink or budget < options.n_sink):
        reason = f"its {n_prompt}-token prompt leaves no room after StreamingLLM's {options.n_sink} sinks"
    elif not free:
        reason = (
            f"at compression_ratio {ratio:g} its {n_prompt}-token prompt would evict {n_prompt - budget} entries "
            f"per head, less than one {block_size}-token block (the plugin frees whole blocks; a smaller "
            "block_size frees more)"
        )
    evicted = start if reason else start + free
    return Eviction(seen=n_prompt, budget=budget, evicted=evicted, block_size=block_size, reason=reason, start=start)


def decoding_eviction(options: CompressionOptions, seen: int, block_size: int, start: int, index: int) -> Eviction:
    """
    The :class:`Eviction` of a decoding interval that ends at ``seen`` tokens of a request holding positions
    ``start ..``: back to ``target_size`` entries per head (at least ``min_kept``), rounded up to whole blocks;
    inactive when that frees no
    whole block (kvpress's ``DecodingPress`` leaves a layer at or under its target as it is).
    """
    budget = max(options.target_size, options.min_kept)
    free = whole_blocks_over(seen, start, budget, block_size)
    reason = "" if free else f"it holds {seen - start} entries per head, less than one block over its {budget} entries"
    return Eviction(
        seen=seen, budget=budget, evicted=start + free, block_size=block_size, reason=reason, start=start,
        index=index, count=0, phase="decoding",
    )  # fmt: skip


def chunk_ends(options: CompressionOptions, n_prompt: int) -> list[int]:
    """
    Where a prompt's chunks end (``ChunkedPrefillPress.chunk_bounds``): every ``compression_chunk_size`` tokens, the
    last chunk merged into the one before when it is not longer than SnapKV's window (it could not fill it);
    ``[n_prompt]`` without ``compression_chunk_size``.
    """
    size = options.compression_chunk_size
    if not size or size >= n_prompt:
        return [n_prompt]
    window = options.window_size if options.needs_queries else 0
    ends = list(range(size, n_prompt, size)) + [n_prompt]
    if len(ends) > 1 and ends[-1] - ends[-2] <= window:
        del ends[-2]
    return ends


def schedule(options: CompressionOptions, n_prompt: int, block_size: int) -> tuple[tuple[Eviction, ...], str]:
    """
    A request's compactions, in order, and why it has none (``""`` when it has some).

    Without ``compression_chunk_size``: the one :func:`eviction` after the prompt. With it: one after every chunk that
    frees at least one whole block (a chunk that frees none is not compacted; the next one scores what it left). In the
    end a request has evicted exactly as many positions as one compaction of the whole prompt evicts (the rounding of
    every earlier chunk is absorbed), so chunking changes which entries are kept, never how many.
    """
    ends = chunk_ends(options, n_prompt)
    if len(ends) == 1:
        plan = eviction(options, n_prompt, block_size)
        return ((plan,) if plan.active else ()), plan.reason
    stages, start = [], 0
    for end in ends:
        plan = eviction(options, end, block_size, start)
        if plan.active:
            stages.append(plan)
            start = plan.evicted
    if not stages:
        return (), eviction(options, n_prompt, block_size).reason
    count = len(stages)
    return tuple(replace(plan, index=i + 1, count=count) for i, plan in enumerate(stages)), ""


def blocks_held_at_most(stages: tuple[Eviction, ...], n_tokens: int, block_size: int) -> int:
    """
    The most blocks a request with these compactions holds until its first ``n_tokens`` tokens are computed (its
    prompt, and the outputs a preempted request recomputes): while the chunk that ends at ``P`` runs, the blocks of
    positions ``E .. P-1``, ``E`` what the compactions before it evicted; after the last one, those of
    ``E .. n_tokens-1``.
    """
    peak, evicted = 0, 0
    for stage in stages:
        peak = max(peak, blocks_for(stage.seen, block_size) - evicted // block_size)
        evicted = stage.evicted
    return max(peak, blocks_for(n_tokens, block_size) - evicted // block_size)


class Schedule:
    """
    Every compaction of one request, in order: its prompt's (:func:`schedule`) and, with ``compression_interval``,
    its decoding ones (:func:`decoding_eviction`), listed as far as the request goes (:meth:`upto`).
    """

    def __init__(self, options: CompressionOptions, n_prompt: int, block_size: int):
        self.options, self.n_prompt, self.block_size = options, n_prompt, block_size
        prompt, self.reason = schedule(options, n_prompt, block_size)
        self.prompt_stages = len(prompt)
        self.stages: list[Eviction] = list(prompt)
        self._next_point = n_prompt + options.compression_interval  # the next decoding interval's end
        self._evicted = prompt[-1].evicted if prompt else 0

    @property
    def empty(self) -> bool:
        """Whether the request is never compacted (no prompt compaction, no compression while decoding)."""
        return not self.stages and not self.options.decoding

    def stage(self, index: int, limit: int) -> Eviction | None:
        """The ``index``-th compaction (from 0), if it comes after at most ``limit`` tokens seen."""
        self._extend(limit)
        return self.stages[index] if index < len(self.stages) and self.stages[index].seen <= limit else None

    def upto(self, seen: int) -> list[Eviction]:
        """The compactions after at most ``seen`` tokens (decoding ones listed up to there)."""
        self._extend(seen)
        return [stage for stage in self.stages if stage.seen <= seen]

    def after(self, computed: int, limit: int) -> Eviction | None:
        """The first compaction after ``computed`` tokens, looking no further than ``limit`` tokens seen."""
        self._extend(limit)
        return next((stage for stage in self.stages if stage.seen > computed), None)

    def _extend(self, seen: int) -> None:
        interval = self.options.compression_interval
        while interval and self._next_point <= seen:
            plan = decoding_eviction(
                self.options,
                self._next_point,
                self.block_size,
                self._evicted,
                len(self.stages) - self.prompt_stages + 1,
            )
            if plan.active:
                self.stages.append(plan)
                self._evicted = plan.evicted
            self._next_point += interval


def next_step_blocks(options: CompressionOptions, block_size: int) -> int:
    """Blocks of a request's next step allocated (with async scheduling) before the blocks a compaction frees are
    back: its next chunk (``compression_chunk_size``, the last one up to SnapKV's window longer; at least one token) and
    one block of rounding."""
    chunk = options.compression_chunk_size + (options.window_size if options.needs_queries else 0)
    return blocks_for(chunk or 1, block_size) + 1


def hold_bound(options: CompressionOptions, max_len: int, block_size: int) -> int | None:
    """
    The most KV blocks a request with these options holds, whatever its prompt and generation up to ``max_len``
    tokens, or ``None`` when that is not less than holding ``max_len`` tokens whole.

    Only a request compacted after every prompt chunk *and* while decoding is bounded. What it holds is counted from
    a block boundary (compactions evict whole blocks), with at most one block of rounding over a budget:

    - while a chunk of ``c`` tokens runs (``compression_chunk_size``, the last one up to SnapKV's window longer), the
      entries kept for the ``P - c`` tokens before it and the chunk: at most ``b(max_len - c) + bs - 1 + c``, where
      ``b(N) = max(1, int(N * (1 - ratio)), min_kept)`` is ``ChunkedPrefillPress``'s budget with the floor;
    - while decoding, what the prompt's or the last decoding compaction kept and one ``compression_interval`` of new
      tokens: at most ``max(b(max_len - interval), target_size) + bs - 1 + interval``;

    plus ``ceil(c / bs) + 1`` blocks for the next step's allocation, made (with async scheduling) before the blocks a
    compaction frees are back.
    """
    if not (options.compression_ratio > 0 and options.compression_chunk_size and options.decoding):
        return None
    ratio, interval = options.compression_ratio, options.compression_interval
    chunk = options.compression_chunk_size + (options.window_size if options.needs_queries else 0)

    def blocks(entries: int) -> int:  # entries kept after a compaction, with at most one block of rounding
        return blocks_for(entries + block_size - 1, block_size)

    floor = options.min_kept
    prefill = blocks(max(compute_n_kept(max(1, max_len - chunk), ratio), floor) + chunk)
    decoding = blocks(max(compute_n_kept(max(1, max_len - interval), ratio), options.target_size, floor) + interval)
    bound = max(prefill, decoding) + next_step_blocks(options, block_size)
    return bound if bound < blocks_for(max_len, block_size) else None


def check_hold(options: CompressionOptions, max_len: int, block_size: int, pool_blocks: int, where: str) -> None:
    """
    Refuse options under which a request could hold more blocks than the pool has (``pool_blocks``) before it
    reaches ``max_len`` tokens: it could then never be scheduled. Nothing to check when ``max_len`` tokens fit in the
    pool; otherwise the message names the option to set or lower.
    """
    whole = blocks_for(max_len, block_size)
    if whole <= pool_blocks:
        return
    bound = hold_bound(options, max_len, block_size)
    if bound is not None and bound <= pool_blocks:
        return
    if options.compression_ratio <= 0:
        option, fix = (
            "compression_ratio",
            "a compression_ratio above 0 (with compression_chunk_size and compression_interval)",
        )
    elif not options.compression_chunk_size:
        option, fix = (
            "compression_chunk_size",
            "compression_chunk_size (the prompt is otherwise held whole until its prefill ends)",
        )
    elif not options.decoding:
        option = "compression_interval"
        fix = "compression_interval and target_size (generated tokens are otherwise kept)"
    else:
        sizes = {  # what each option adds to the bound, in entries per head
            "compression_ratio": compute_n_kept(max_len, options.compression_ratio),
            "compression_chunk_size": options.compression_chunk_size,
            "compression_interval": options.compression_interval,
            "target_size": options.target_size,
            "min_kept": options.min_kept,
        }
        option = max(sizes, key=sizes.get)
        fix = "a larger compression_ratio" if option == "compression_ratio" else f"a smaller {option}"
    held = f"up to {bound} blocks" if bound is not None else f"its whole {max_len} tokens ({whole} blocks)"
    raise OptionsError(
        f"{where}: a request of up to {max_len} tokens (max_model_len) could hold {held} under these options, more "
        f"than the KV pool's {pool_blocks} blocks of {block_size} tokens, and could never be scheduled. Set {fix}, "
        "or serve a smaller max_model_len.",
        option,
    )
