"""How many entries a compressed request keeps and how many whole KV blocks it frees, at each of its compactions.

The scheduler computes this from the prompt length, the request's options and the block size, and sends it to the
workers with the step that compresses the request (:mod:`kvpress_critical_vllm.protocol`): workers never work out
an eviction of their own.

Without ``chunk_size`` a request is compacted once, after its prompt (:func:`eviction`). With ``chunk_size`` its
prompt is prefilled in chunks and compacted after each one (:func:`schedule`): after the chunk that ends at position
``P``, what it holds (positions ``S .. P-1``: the entries kept so far and the chunk) is compacted to what
``ChunkedPrefillPress`` keeps for ``P`` tokens seen, ``max(1, int(P * (1 - ratio)))``, rounded up to whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpress_critical.selection import compute_n_kept
from kvpress_critical_vllm.options import CompressionOptions


@dataclass(frozen=True)
class Eviction:
    """
    One compaction of a request, after the step whose tokens end at position ``n_prompt`` (the prompt's end, or a
    chunk's end with ``chunk_size``).

    Before it, the request holds positions ``start .. n_prompt - 1`` (``start`` positions were evicted by its earlier
    compactions: 0 for the first). ``budget`` is what the transformers press keeps for ``n_prompt`` tokens seen
    (kvpress's ``max(1, int(N * (1 - ratio)))``); the plugin evicts the largest whole number of blocks that leaves at
    least that, ``evicted = start + floor((N - start - budget) / bs) * bs`` (counted from position 0), so every head
    keeps ``kept = N - evicted`` entries: between ``budget`` and ``budget + bs - 1``. ``reason`` says why nothing is
    evicted when ``evicted`` is ``start``. ``index`` and ``count`` number the request's compactions (1 of 1 without
    ``chunk_size``).
    """

    n_prompt: int
    budget: int
    evicted: int
    block_size: int
    reason: str = ""
    start: int = 0
    index: int = 1
    count: int = 1

    @property
    def kept(self) -> int:
        return self.n_prompt - self.evicted

    @property
    def held(self) -> int:
        """Entries per head before this compaction (the ones it scores)."""
        return self.n_prompt - self.start

    @property
    def blocks_freed(self) -> int:
        """Blocks this compaction frees."""
        return (self.evicted - self.start) // self.block_size

    @property
    def active(self) -> bool:
        """Whether anything is evicted (at least one whole block)."""
        return self.evicted > self.start


def eviction(options: CompressionOptions, n_prompt: int, block_size: int, start: int = 0) -> Eviction:
    """The :class:`Eviction` after ``n_prompt`` tokens of a request that holds positions ``start ..``; inactive (with
    its reason) when no whole block can be freed."""
    ratio = options.compression_ratio
    budget = compute_n_kept(n_prompt, ratio) if ratio > 0 else n_prompt
    reason = ""
    if ratio == 0:
        reason = "compression_ratio is 0"
    elif options.base == "snapkv" and n_prompt <= options.window_size:
        reason = f"its {n_prompt}-token prompt is not longer than SnapKV's window ({options.window_size})"
    elif options.base == "streaming_llm" and (n_prompt <= options.n_sink or budget < options.n_sink):
        reason = f"its {n_prompt}-token prompt leaves no room after StreamingLLM's {options.n_sink} sinks"
    elif n_prompt - start - budget < block_size:
        reason = (
            f"at compression_ratio {ratio:g} its {n_prompt}-token prompt would evict {n_prompt - budget} entries "
            f"per head, less than one {block_size}-token block (the plugin frees whole blocks; a smaller "
            "block_size frees more)"
        )
    evicted = start if reason else start + (n_prompt - start - budget) // block_size * block_size
    return Eviction(
        n_prompt=n_prompt, budget=budget, evicted=evicted, block_size=block_size, reason=reason, start=start
    )


def chunk_ends(options: CompressionOptions, n_prompt: int) -> list[int]:
    """
    Where a prompt's chunks end (``ChunkedPrefillPress.chunk_bounds``): every ``chunk_size`` tokens, the last chunk
    merged into the one before when it is not longer than SnapKV's window (it could not fill it); ``[n_prompt]``
    without ``chunk_size``.
    """
    size = options.chunk_size
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

    Without ``chunk_size``: the one :func:`eviction` after the prompt. With it: one after every chunk that frees at
    least one whole block (a chunk that frees none is not compacted; the next one scores what it left). In the end a
    request has evicted exactly as many positions as one compaction of the whole prompt evicts (the rounding of every
    earlier chunk is absorbed), so chunking changes which entries are kept, never how many.
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
        peak = max(peak, -(-stage.n_prompt // block_size) - evicted // block_size)
        evicted = stage.evicted
    return max(peak, -(-n_tokens // block_size) - evicted // block_size)
