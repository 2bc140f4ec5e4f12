"""The scheduler side: decide which requests are compressed, direct the workers, free blocks the workers confirm.

For each request, from its options and prompt length (:func:`kvpress_critical_vllm.budget.schedule`): either its
compactions (one after the prompt, or one after every ``compression_chunk_size``-token chunk of it), each evicting whole
blocks, or a reason to leave it uncompressed, said once in vLLM's log. The scheduler ends a step's tokens of the request
at each compaction's position ``P`` (vLLM's chunked prefill never runs past it), and with the step that reaches ``P``
sends the workers a compaction directive (:mod:`kvpress_critical_vllm.protocol`); the workers move every KV head's
kept entries into the slots of positions ``E .. P-1`` and report back. Only then are the blocks of positions
``S .. E-1`` freed (``S`` what earlier compactions freed; replaced by the null block in the request's block table, as
vLLM's sliding-window manager does): a request the workers did not compact keeps every block it holds and is not
compressed further. The request's positions keep counting as vLLM's. A preempted request is recomputed from its
first token, its chunks stopping at the same positions, and compressed again, so it resumes over the same cache it
had. Requests whose prompt can still grow (streaming input) are left uncompressed.

What it did is reported three ways: one log line per request, a bounded window of records
(``scheduler.kvpress_records``, in-process engines), and counters for the server's ``/metrics``
(:mod:`kvpress_critical_vllm.metrics`).
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvpress_critical_vllm.budget import Eviction, Schedule, blocks_for
from kvpress_critical_vllm.kv_spec import companion_blocks, compressed_group
from kvpress_critical_vllm.metrics import MetricsWriter
from kvpress_critical_vllm.options import CompressionOptions, OptionsError, engine_options, resolve_options
from kvpress_critical_vllm.pool_guard import PoolGuard
from kvpress_critical_vllm.prefix_cache import PrefixCacheGuard, PrefixHit, Redirect
from kvpress_critical_vllm.protocol import DIRECTIVES_ATTRIBUTE, REPORT_ATTRIBUTE, Compact, StepDirectives
from kvpress_critical_vllm.tracking import RECORDS_KEPT, BoundedRecords, CompressionRecord, Tracked, compaction_line
from kvpress_critical_vllm.vllm_compat import (
    discard_sampled_tokens,
    empty_blocks,
    free_blocks,
    give_back_blocks,
    real_blocks_held,
    release_request_blocks,
    remove_blocks,
    swap_block,
)

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


class CompressingSchedulerMixin:
    """Plans each request's compression, sends the workers their directives, frees the blocks they confirm."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvpress_options: CompressionOptions = engine_options(self.vllm_config.additional_config)
        groups = self.kv_cache_config.kv_cache_groups
        bounded = any(getattr(group.kv_cache_spec, "max_blocks_held", None) is not None for group in groups)
        # the full-attention layers; sliding-window and linear-attention groups are vLLM's
        tp_size = self.vllm_config.parallel_config.tensor_parallel_size
        self.kvpress_group = compressed_group(groups, longer_than_pool=bounded, tensor_parallel_size=tp_size)
        spec = groups[self.kvpress_group].kv_cache_spec
        self.kvpress_block_size = spec.block_size
        self._kvpress_tp_size = self.vllm_config.parallel_config.tensor_parallel_size
        self._kvpress_layers = len(groups[self.kvpress_group].layer_names)
        if len(groups) > 1:
            logger.info(
                "kvpress_critical: compressing the %d full-attention layers of KV-cache group %d; the %d other groups "
                "(sliding-window or linear-attention layers) keep their windows or recurrent states, as vLLM manages "
                "them",
                self._kvpress_layers, self.kvpress_group, len(groups) - 1,
            )  # fmt: skip
        self._kvpress_kv_heads = spec.num_kv_heads
        self._kvpress: dict[str, Tracked] = {}
        self.kvpress_records: BoundedRecords = BoundedRecords(RECORDS_KEPT)
        self.kvpress_metrics = MetricsWriter(self.vllm_config)
        self._kvpress_worker_tracked = 0
        logger.info(
            "kvpress_critical: blocks of %d tokens: a compressed request keeps up to %d entries per KV head over its "
            "budget, and a prompt that would evict less than one block stays uncompressed; a request with "
            "compression_chunk_size is admitted when the blocks it holds at most are free, not its whole prompt's",
            self.kvpress_block_size,
            self.kvpress_block_size - 1,
        )
        share_reason = ""
        if len(groups) > 1:
            share_reason = "the model has several KV-cache groups"
        elif bounded:
            share_reason = "max_model_len is longer than the pool (a request's blocks are bounded there)"
        self._kvpress_prefix = PrefixCacheGuard(self, self.kvpress_metrics, share_reason)
        self._kvpress_adopted: dict[str, PrefixHit] = {}  # waiting requests given a kept prefix in this schedule
        # (request id, tokens seen) -> a directed compaction's fresh blocks, until the workers report it
        self._kvpress_redirects: dict[tuple[str, int], Redirect] = {}
        bound = getattr(spec, "max_blocks_held", None)
        # longer than the pool (max_model_len over the pool's tokens): a request held whole may never fit again
        self._kvpress_pool = PoolGuard(
            self.kvpress_block_size,
            self.kv_cache_config.num_blocks - 1,  # less vLLM's null block
            longer_than_pool=bound is not None,
            reserve_full_isl=self.scheduler_reserve_full_isl,  # vLLM's admission of whole sequences
            companion_blocks=companion_blocks(groups, self.kvpress_group, self.vllm_config),
        )

        if bound is not None:
            options, max_model_len = self.kvpress_options, self.vllm_config.model_config.max_model_len
            logger.info(
                "kvpress_critical: a request holds at most %d blocks (compression_chunk_size %d, compression_interval "
                "%d, target_size %d, min_kept %d at compression_ratio %g), not the %d of a whole %d-token request: "
                "vLLM's start-up "
                "check and concurrency figures read that bound, and a request whose own options could hold more than "
                "the pool's %d blocks is refused",
                bound, options.compression_chunk_size, options.compression_interval, options.target_size,
                options.min_kept, options.compression_ratio, blocks_for(max_model_len, spec.block_size), max_model_len,
                self._kvpress_pool.pool_blocks,
            )  # fmt: skip

    # ------------------------------------------------------------------------------------------------- requests
    @property
    def kvpress_tracked_requests(self) -> int:
        """Requests the plugin keeps state for in the scheduler (0 when idle): tracked, or to end with an error."""
        return len(self._kvpress.keys() | self._kvpress_pool.unservable.keys())

    def _leave_uncompressed(self, request_id: str, why: str, kind: str = "not_compacted") -> None:
        """Say once, in the log and the counters (``kind``), why a request keeps its whole cache."""
        self.kvpress_metrics.uncompressed(kind)
        log = logger.debug if kind == "ratio_zero" else logger.info  # a request asking for no compression: quiet
        log("kvpress_critical: request %s stays uncompressed: %s", request_id, why)

    def _fall_back(self, request: Request, why: str, kind: str = "not_compacted") -> None:
        """A request the plugin stops compressing: it keeps its whole cache from here on (:meth:`_leave_uncompressed`),
        and, longer than the pool, ends with an error where its whole sequence cannot fit
        (:meth:`~kvpress_critical_vllm.pool_guard.PoolGuard.check_whole`)."""
        self._forget(request.request_id)
        self._leave_uncompressed(request.request_id, why, kind)
        self._kvpress_pool.check_whole(request)

    def add_request(self, request: Request) -> None:
        request_id = request.request_id
        if request_id not in self.requests and request.sampling_params is not None:
            self._plan_request(request)
        super().add_request(request)

    def _plan_request(self, request: Request) -> None:
        request_id = request.request_id
        try:
            options = resolve_options(
                self.kvpress_options, request.sampling_params.extra_args, self.kvpress_block_size, self._kvpress_tp_size
            )
        except OptionsError as error:  # checked in the caller already; a client that skipped it gets no compression
            self._fall_back(request, f"its options are invalid ({error})", "invalid_options")
            return
        if request.resumable:
            if options.compresses:
                why = "its prompt can still grow (streaming input), and the plugin compresses a whole prompt"
                self._leave_uncompressed(request_id, why, "streaming_input")
            self._kvpress_pool.check_whole(request)
            return
        plan = Schedule(options, request.num_prompt_tokens, self.kvpress_block_size)
        if plan.empty:
            kind = "ratio_zero" if not options.compresses else "short_prompt"
            self._fall_back(request, plan.reason, kind)
            return
        if plan.reason and options.compression_ratio > 0:  # compressed while decoding only
            logger.info(
                "kvpress_critical: request %s: its prompt stays whole (%s); it is compressed while decoding",
                request_id, plan.reason,
            )  # fmt: skip
        self._kvpress[request_id] = Tracked(options, plan)
        self._kvpress_prefix.track(request)
        self.kvpress_metrics.tracked(len(self._kvpress), self._kvpress_worker_tracked)

    def _forget(self, request_id: str) -> None:
        if self._kvpress.pop(request_id, None) is not None:
            self.kvpress_metrics.tracked(len(self._kvpress), self._kvpress_worker_tracked)

    def _free_request(self, request: Request, *args, **kwargs):
        self._forget(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    # -------------------------------------------------------------------------------------------------- schedule
    def schedule(self, *args, **kwargs):
        if self._kvpress_prefix.share:
            waiting = [(r, self._kvpress[r.request_id]) for r in self.waiting if r.request_id in self._kvpress]
            self._kvpress_prefix.pin(self, waiting)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            adopted = self._release_unadmitted()
        if self._kvpress:
            directives = self._directives(output, adopted)
            if directives:
                setattr(output, DIRECTIVES_ATTRIBUTE, directives)
        return output

    def _get_local_prefix_cache_hit(self, request: Request):
        """vLLM's local prefix-cache lookup; a compressed request that shares a kept compressed prefix starts from it
        (:meth:`~kvpress_critical_vllm.prefix_cache.PrefixCacheGuard.adopt`: its blocks are in its table already,
        so vLLM allocates only those of its next tokens)."""
        request_id = request.request_id
        hit = self._kvpress_adopted.get(request_id)
        if hit is None:
            hit = self._kvpress_prefix.adopt(self, request, self._kvpress.get(request_id))
        if hit is None:
            return super()._get_local_prefix_cache_hit(request)
        self._kvpress_adopted[request_id] = hit
        return empty_blocks(self), hit.prefix.seen, 0, False

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        """vLLM's check that a waiting request may be scheduled now; a compressed request also waits while a running
        one is about to keep a longer compressed prefix of it (:meth:`~kvpress_critical_vllm.prefix_cache
        .PrefixCacheGuard.waits`): vLLM skips it for the step and schedules the requests behind it."""
        if not super()._handle_blocked_waiting_request(request):
            return False
        tracked = self._kvpress.get(request.request_id)
        if tracked is None or request.num_computed_tokens or not self._kvpress_prefix.shares(tracked.options):
            return True
        # running requests, and preempted ones (rescheduled first, from their own kept prefixes): the index of the
        # first compaction each has not confirmed in its current life
        producers = {}
        for other in self.running:
            other_tracked = self._kvpress.get(other.request_id)
            if other_tracked is not None:
                live = other_tracked.life == other.num_preemptions
                producers[other.request_id] = (other_tracked, other_tracked.confirmed if live else 0)
        for other in self.waiting:
            other_tracked = self._kvpress.get(other.request_id)
            if other_tracked is not None and other.status is RequestStatus.PREEMPTED:
                producers[other.request_id] = (other_tracked, 0)
        return not self._kvpress_prefix.waits(self, request, tracked, producers)

    def _release_unadmitted(self) -> dict[str, PrefixHit]:
        """The requests that started from a kept prefix in this schedule; the blocks of those vLLM did not admit go
        back (they look the prefix up again when next scheduled)."""
        adopted, self._kvpress_adopted = self._kvpress_adopted, {}
        for request_id in list(adopted):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                if request is not None:
                    release_request_blocks(self, request)
                del adopted[request_id]
        return adopted

    def _directives(self, output, adopted: dict[str, PrefixHit]) -> StepDirectives:
        directives = StepDirectives()
        for request_id, scheduled in output.num_scheduled_tokens.items():
            tracked = self._kvpress.get(request_id)
            if tracked is None:
                continue
            request = self.requests[request_id]
            tracked.live(request.num_preemptions)
            hit = adopted.get(request_id)
            if hit is not None:  # its first compactions are the kept prefix's: its workers start from its state
                tracked.directed = tracked.confirmed = hit.compactions
                directives.restore[request_id] = hit.prefix.evicted
                self.kvpress_metrics.prefix_reused(hit.prefix.seen)
                logger.info(
                    "kvpress_critical: request %s starts from a compressed prefix of %d tokens (%d entries kept per "
                    "KV head, compaction %d of its prompt)",
                    request_id, hit.prefix.seen, hit.prefix.seen - hit.prefix.evicted, hit.compactions,
                )  # fmt: skip
            end = request.num_computed_tokens  # already advanced past this step's tokens
            start = end - scheduled
            window = tracked.options.window_size if tracked.options.needs_queries else 0
            plan = tracked.schedule.stage(tracked.directed, end + window)
            if plan is None:
                continue  # compacted in this life of the request as far as it goes, or about to be
            if end == plan.seen:
                # with async scheduling the compaction before this one may not be confirmed yet: a prefix it is to
                # keep must not be written in place by this one
                pending = (
                    tracked.schedule.stages[tracked.directed - 1] if tracked.directed > tracked.confirmed else None
                )
                keeps = pending is not None and pending.seen not in tracked.unkept
                protect = pending.seen if keeps and self._kvpress_prefix.keepable(tracked.options, pending) else 0
                shared, redirect, protected = self._kvpress_prefix.before_compaction(self, request_id, plan, protect)
                if shared:
                    self._fall_back(request, shared, "shared_prefix")
                    continue
                if protect and not protected:
                    tracked.unkept.add(protect)
                tracked.directed += 1
                pairs = ()
                if redirect is not None:
                    self._kvpress_redirects[request_id, plan.seen] = redirect
                    pairs = redirect.pairs
                directives.compact[request_id] = Compact(request_id, tracked.options, plan, pairs)
            elif start < plan.seen < end:  # the scheduler's chunks stop at each compaction: never expected
                self._fall_back(request, f"a step ran past its compaction at {plan.seen} ({start}..{end - 1})")
            elif tracked.options.needs_queries and plan.seen - tracked.options.window_size < end < plan.seen:
                directives.save_queries[request_id] = tracked.options.window_size
        return directives

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        tracked = self._kvpress.get(request.request_id)
        first = num_computed_tokens == 0 or request.request_id in self._kvpress_adopted
        if first and request.status is not RequestStatus.RUNNING:
            num_new_tokens = self._admit(request, tracked, num_new_tokens)
        stop = tracked.next_end(num_computed_tokens, request.num_tokens) if tracked is not None else None
        if stop is not None and stop < num_computed_tokens + num_new_tokens:
            # the step stops where the next compaction is (after a prompt chunk with compression_chunk_size; a resumed
            # request, which recomputes prompt + output, after its prompt and each decoding compaction, to attend over
            # the compressed cache for the outputs as it did before it was preempted)
            num_new_tokens = stop - num_computed_tokens
        return num_new_tokens

    def _admit(self, request: Request, tracked: Tracked | None, num_new_tokens: int) -> int:
        """Admission of a waiting (or preempted) request, just before vLLM allocates its first blocks
        (:meth:`~kvpress_critical_vllm.pool_guard.PoolGuard.admit`): 0 tokens when what it holds at most does not fit
        (vLLM then stops admitting, as when a request's blocks cannot be allocated); vLLM's whole-sequence check is set
        for the allocation that follows this call."""
        admitted, self.scheduler_reserve_full_isl = self._kvpress_pool.admit(
            request, tracked, free_blocks(self), isinstance(self, AsyncScheduler)
        )
        return num_new_tokens if admitted else 0

    # ---------------------------------------------------------------------------------------------------- output
    def update_from_output(self, scheduler_output, model_runner_output):
        directives = getattr(scheduler_output, DIRECTIVES_ATTRIBUTE, None)
        report = getattr(model_runner_output, REPORT_ATTRIBUTE, None)
        if report is not None:
            self._kvpress_worker_tracked = report.tracked_requests
        # requests a worker broke (a compaction written in part, a failed head-wise attention): their token of this
        # step is thrown away, and they end with an error below
        broken = [rid for rid in report.broken if rid in self.requests] if report is not None else []
        for request_id in broken:
            self._forget(request_id)
            self._leave_uncompressed(request_id, f"{report.broken[request_id]}; it ends with an error")
        if broken:
            discard_sampled_tokens(model_runner_output, broken)
        if directives is not None and directives.compact:
            self._apply_report(directives, report)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if broken:
            self._end_with_error(broken, outputs)
        if self._kvpress_pool.longer_than_pool:
            self._end_unservable(outputs)
        self.kvpress_metrics.tracked(len(self._kvpress), self._kvpress_worker_tracked)
        self.kvpress_metrics.flush(force=not self.has_unfinished_requests())
        return outputs

    def finish_requests(self, *args, **kwargs):
        result = super().finish_requests(*args, **kwargs)
        self.kvpress_metrics.tracked(len(self._kvpress), self._kvpress_worker_tracked)
        self.kvpress_metrics.flush(force=not self.has_unfinished_requests())
        return result

    def _apply_report(self, directives: StepDirectives, report) -> None:
        """Free the blocks of each compaction the workers confirm and leave the others whole (the requests a worker
        changed in part were forgotten by :meth:`update_from_output`, which ends them)."""
        for request_id, directive in directives.compact.items():
            redirect = self._kvpress_redirects.pop((request_id, directive.eviction.seen), None)
            fresh = redirect.fresh if redirect is not None else []
            request = self.requests.get(request_id)
            tracked = self._kvpress.get(request_id)
            if request is None or tracked is None or request.is_finished():
                give_back_blocks(self, fresh)
                continue  # finished meanwhile (its blocks went back with it), or broken (forgotten, to be ended)
            if report is None:
                give_back_blocks(self, fresh)
                self._fall_back(request, "the workers sent no report for its compaction step")
                continue
            done = report.compacted.get(request_id)
            if done is None:
                give_back_blocks(self, fresh)
                self._fall_back(request, report.uncompressed.get(request_id, "the workers did not compact it"))
                continue
            if tracked.life != request.num_preemptions or done.evicted != directive.eviction.evicted:
                give_back_blocks(self, fresh)
                continue  # preempted since the directive was sent: its blocks were all freed, it is redone later
            if redirect is not None:  # the workers wrote the fresh blocks: the shared ones go back as they were
                group = self.kvpress_group
                give_back_blocks(self, [swap_block(self, request_id, i, new, group) for i, new in redirect.blocks])
            self._free_evicted(request, tracked, directive.eviction, done)
            if directive.eviction.seen not in tracked.unkept:  # not written in place by a later compaction
                self._kvpress_prefix.keep(self, request, tracked.options, directive.eviction)

    def _end_unservable(self, outputs: dict) -> None:
        """End with an error the requests that can never fit the pool
        (:meth:`~kvpress_critical_vllm.pool_guard.PoolGuard.take_unservable`)."""
        unservable = self._kvpress_pool.take_unservable(self.waiting, self._kvpress)
        for request_id, why in unservable.items():
            logger.warning("kvpress_critical: request %s ends with an error: %s", request_id, why)
        if unservable:
            self._end_with_error(list(unservable), outputs)

    def _end_with_error(self, request_ids: list[str], outputs: dict) -> None:
        """End requests with an error their client receives (a compaction that changed their cache in part, or a
        request that cannot fit the pool)."""
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

        live = [rid for rid in request_ids if rid in self.requests and not self.requests[rid].is_finished()]
        self.kvpress_metrics.failed(len(live))
        for request in self.finish_requests(live, RequestStatus.FINISHED_ERROR):
            ended = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(ended)

    def _free_evicted(self, request: Request, tracked: Tracked, plan: Eviction, done) -> None:
        blocks_before = real_blocks_held(self, request.request_id, self.kvpress_group)
        remove_blocks(self, request.request_id, plan.start, plan.evicted, self.kvpress_group)
        tracked.confirmed += 1
        options = tracked.options
        record = CompressionRecord(
            request_id=request.request_id,
            press=options.press,
            compression_ratio=options.compression_ratio,
            prompt_tokens=plan.seen,
            kept_per_head=plan.kept,
            kept_min=done.kept_min,
            kept_max=done.kept_max,
            blocks_freed=plan.evicted // plan.block_size,
            blocks_before=blocks_before,
            preemptions=request.num_preemptions,
            compaction=plan.index,
            compactions=plan.count,
            phase=plan.phase,
        )
        self.kvpress_records[request.request_id] = record
        decoding = plan.phase == "decoding"
        last = plan.index == plan.count  # the prompt's last compaction
        first = not tracked.counted  # a request is counted once: at its prompt's last compaction, or its first
        tracked.counted = tracked.counted or last or decoding
        self.kvpress_metrics.compressed(
            prompt_tokens=plan.seen if last else 0,
            entries_kept=plan.kept * self._kvpress_kv_heads * self._kvpress_layers if last else 0,
            blocks_freed=plan.blocks_freed,
            request_done=first and (last or decoding),
            decoding=decoding,
        )
        logger.info("kvpress_critical: request %s: %s", request.request_id, compaction_line(record, plan, options))

    def shutdown(self) -> None:
        self.kvpress_metrics.close()
        super().shutdown()


class CriticalKVScheduler(CompressingSchedulerMixin, Scheduler):
    """vLLM's scheduler with the plugin's compression (``async_scheduling=False``)."""


class CriticalKVAsyncScheduler(CompressingSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler with the plugin's compression (the default)."""
