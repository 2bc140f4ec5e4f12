"""Admission and the pool's limits on the scheduler side: a request compacted after every prompt chunk or while
decoding is admitted by the blocks it holds at most, not its whole sequence; and, in an engine whose
``max_model_len`` is longer than the pool, a request that would be held whole past the pool ends with an error of its
own instead of stalling vLLM's waiting queue (vLLM admits a whole sequence, and its waiting loop stops at the first
request it cannot admit)."""

from __future__ import annotations

from collections.abc import Callable

from kvpress_critical_vllm.budget import blocks_for, blocks_held_at_most, next_step_blocks
from kvpress_critical_vllm.tracking import Tracked


class PoolGuard:
    """One scheduler's admission rule and its requests that can never fit the pool (``pool_blocks`` usable blocks of
    ``block_size`` tokens; ``longer_than_pool`` when ``max_model_len`` exceeds them; ``companion_blocks(tokens)``: the
    blocks a request of ``tokens`` tokens holds at most in the groups the plugin does not compress, sliding-window
    layers beside the compressed ones)."""

    def __init__(
        self,
        block_size: int,
        pool_blocks: int,
        longer_than_pool: bool,
        reserve_full_isl: bool,
        companion_blocks: Callable[[int], int] = lambda tokens: 0,
    ) -> None:
        self.block_size = block_size
        self.companion_blocks = companion_blocks
        self.pool_blocks = pool_blocks
        self.longer_than_pool = longer_than_pool
        self.reserve_full_isl = reserve_full_isl  # vLLM's admission of whole sequences, as the engine configured it
        self.unservable: dict[str, str] = {}  # request id -> why it ends with an error at the next output

    def admit(self, request, tracked: Tracked | None, free_blocks: int, with_async: bool) -> tuple[bool, bool]:
        """
        ``(admitted, whole_sequence_check)`` for a waiting (or preempted) request about to get its first blocks: a
        request compacted after every prompt chunk, or while decoding (a preempted one recomputes its outputs with the
        same compactions), is admitted when what it holds at most fits the free blocks
        (:func:`~kvpress_critical_vllm.budget.blocks_held_at_most`; with async scheduling, and the next step's chunk
        allocated before a compaction's blocks are back), and vLLM's whole-sequence check is skipped for it alone.
        """
        bounded = tracked is not None and (tracked.options.compression_chunk_size > 0 or tracked.options.decoding)
        if not bounded or not self.reserve_full_isl:
            return True, self.reserve_full_isl and not bounded
        stages = tracked.schedule.upto(request.num_tokens)
        needed = blocks_held_at_most(stages, request.num_tokens, self.block_size)
        needed += self.companion_blocks(request.num_tokens)
        if with_async:  # as hold_bound counts
            needed += next_step_blocks(tracked.options, self.block_size)
        return needed <= free_blocks, False

    def check_whole(self, request) -> None:
        """
        Longer than the pool, a request held whole whose prompt and ``max_tokens`` do not fit the pool could grow past
        it, be preempted and never be admitted again: it is marked to end with an error at the next step's output
        (``finish_reason`` error, its blocks back), and the engine goes on admitting the others.
        """
        if not self.longer_than_pool:
            return
        whole = blocks_for(request.num_prompt_tokens + request.max_tokens, self.block_size)
        if whole > self.pool_blocks:
            self.unservable[request.request_id] = (
                f"it runs uncompressed, and its {request.num_prompt_tokens} prompt tokens and max_tokens "
                f"{request.max_tokens} ({whole} blocks) do not fit the KV pool's {self.pool_blocks} blocks"
            )

    def take_unservable(self, waiting, tracked: dict) -> dict[str, str]:
        """The requests :meth:`check_whole` marked and any waiting request held whole (not in ``tracked``) whose
        tokens so far are more than the pool holds, each with why; then forgotten."""
        for request in waiting:
            if request.request_id not in tracked and request.request_id not in self.unservable:
                held = blocks_for(request.num_tokens, self.block_size)
                if held > self.pool_blocks:
                    self.unservable[request.request_id] = (
                        f"it is held whole, and its {request.num_tokens} tokens ({held} blocks) are more than the KV "
                        f"pool's {self.pool_blocks} blocks"
                    )
        unservable, self.unservable = self.unservable, {}
        return unservable
