"""Compaction on a worker: the requests whose prompt (or a chunk of it) ended in the step, after its forward pass.

:meth:`Compactor.compact` selects every layer of every such request first (scores read back from the paged cache,
:func:`~kvpress_critical_vllm.presses.layer_scores`, then the press's rule,
:func:`~kvpress_critical_vllm.presses.select`), agrees with the other tensor-parallel ranks on which selections
succeeded (one all-reduce), and only then writes: a request is compacted whole or left exactly as it was. A write
that fails midway breaks that request alone (on every rank). What was compacted, left whole or broken comes back as
an :class:`Outcome`; the worker's state (:mod:`kvpress_critical_vllm.worker_state`) records it and reports it.

A uniform press moves each head's kept entries into the slots of positions ``E .. N-1``; a head-wise press packs
them, head after head, into the whole blocks of positions ``E .. B-1``
(:func:`kvpress_critical_vllm.layouts.region_views`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpress_critical_vllm.kv_codes import KVCodes
from kvpress_critical_vllm.layouts import region_views
from kvpress_critical_vllm.presses import heads_per_chunk, layer_scores, select
from kvpress_critical_vllm.protocol import PluginStateError
from kvpress_critical_vllm.step_plan import Job
from kvpress_critical_vllm.vllm_compat import tp_cpu_group

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


class LayoutError(ValueError):
    """A selection the head-wise layout cannot hold (the request then stays uncompressed)."""


@dataclass
class Outcome:
    """What a step's compactions did: the jobs written here with their kept entries ``{layer: (H_kv, N) bool}``, the
    requests left whole (nothing of them changed) and those broken (written in part, here or on another rank), each
    with its reason."""

    written: list[tuple[Job, dict[str, torch.Tensor]]] = field(default_factory=list)
    uncompressed: dict[str, str] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)


@dataclass
class Compactor:
    """One worker's compactions: reads and writes its paged cache through ``layout`` (set once the cache exists) and
    scores with the layers' dense ``o_proj`` weights, on one of ``tp_size`` ranks. A layer stored as fp8 codes
    (``kv_codes``) is scored on its entries read back with its scales; its codes are moved as they are."""

    layout: Any
    o_proj: dict[str, torch.Tensor]
    tp_size: int = 1
    kv_codes: dict[str, KVCodes] = field(default_factory=dict)

    @torch.no_grad()
    def compact(self, jobs: list[Job], attention_layers: dict) -> Outcome:
        """Compact each job's request whole, or leave it as it was (every layer selected before anything is
        written, and on every rank)."""
        outcome = Outcome()
        selected: list[dict | None] = []  # per job: {layer: (H_kv, N) kept}, or None where its selection failed
        reasons: dict[str, str] = {}
        for job in jobs:
            request_id = job.directive.request_id
            try:
                selected.append(self.select(job, self.score(job, attention_layers)))
            except LayoutError as error:
                logger.info("kvpress_critical: request %s: %s", request_id, error)
                reasons[request_id] = f"its selection does not fit the head-wise layout ({error})"
                selected.append(None)
            except Exception as error:  # noqa: BLE001 - any failure leaves this request whole, never the engine down
                logger.warning(
                    "kvpress_critical: selection failed for request %s; it stays uncompressed: %r", request_id, error
                )
                reasons[request_id] = "its selection failed on this worker"
                selected.append(None)
        failed = self.agree_across_ranks([kept is None for kept in selected])
        broken: dict[int, str] = {}  # job index -> why its write failed here
        for index, (job, kept, fail) in enumerate(zip(jobs, selected, failed)):
            request_id = job.directive.request_id
            if fail:
                outcome.uncompressed[request_id] = reasons.get(request_id, "its selection failed on another rank")
                continue
            try:
                self.write(job, kept, attention_layers)
            except Exception as error:  # noqa: BLE001 - written in part: only this request is lost
                logger.error("kvpress_critical: compaction of request %s failed midway: %r", request_id, error)
                broken[index] = f"its compaction failed midway ({error!r})"
                continue
            outcome.written.append((job, kept))
        # a request whose write broke on one rank is broken on all (the scheduler reads one rank's report)
        flags = self.agree_across_ranks([index in broken for index in range(len(jobs))])
        for index, (job, flag) in enumerate(zip(jobs, flags)):
            if flag:
                outcome.broken[job.directive.request_id] = broken.get(
                    index, "its compaction failed midway on another rank"
                )
        return outcome

    def slots(self, job: Job, block_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``(held,)`` slots of the positions the compaction scores, ``start .. seen - 1`` (in the request's block
        table, or in ``block_ids``)."""
        evict = job.directive.eviction
        block_ids = job.block_ids if block_ids is None else block_ids
        positions = torch.arange(evict.start, evict.seen, device=block_ids.device)
        return block_ids[positions // evict.block_size].long() * evict.block_size + positions % evict.block_size

    def destination(self, job: Job) -> torch.Tensor:
        """The block table the compaction writes through: the request's, with the blocks another request shares (or
        a kept compressed prefix holds) replaced by the fresh blocks the scheduler gave (``redirect``)."""
        if not job.directive.redirect:
            return job.block_ids
        table = job.block_ids.clone()
        for index, block_id in job.directive.redirect:
            if not 0 <= index < table.numel():
                raise PluginStateError(
                    f"kvpress_critical: a fresh block for index {index} of a {table.numel()}-block table"
                )
            table[index] = block_id
        return table

    def score(self, job: Job, attention_layers: dict) -> Iterator[tuple[str, tuple]]:
        """Each layer's scores, ``(layer, (base, norms))`` (:func:`~kvpress_critical_vllm.presses.layer_scores`), one
        layer at a time (:meth:`select` keeps its mask and drops its scores before the next is scored): the part of
        a selection that may fail on one rank alone; nothing is written."""
        options, evict = job.directive.options, job.directive.eviction
        slots = self.slots(job)
        for name in self.o_proj:
            layer = attention_layers[name]
            kv_cache, impl = layer.kv_cache, layer.impl
            num_kv_heads = impl.num_kv_heads
            weight = self.o_proj[name]
            codes = self.kv_codes.get(name, KVCodes())
            chunk = heads_per_chunk(
                options, evict.held, num_kv_heads, impl.num_heads // num_kv_heads, impl.head_size,
                weight.element_size(),
            )  # fmt: skip

            def read(first: int, end: int, kv_cache=kv_cache, codes=codes, dtype=weight.dtype):
                # (held, h, d) entries in the model's dtype: fp8 codes times the layer's scales
                return codes.decode(*self.layout.read(kv_cache, slots, slice(first, end)), dtype)

            yield (
                name,
                layer_scores(
                    options,
                    read,
                    num_kv_heads,
                    evict.kept,
                    queries=job.queries.get(name),
                    o_proj_weight=weight if options.critical else None,
                    chunk=chunk,
                ),
            )

    def select(self, job: Job, scores: Iterable[tuple[str, tuple]]) -> dict[str, torch.Tensor]:
        """The kept entries of every layer, ``{layer: (H_kv, N) bool}``, from its scores, layer after layer (head-wise
        presses run with one rank only: :func:`~kvpress_critical_vllm.options.check_layout`)."""
        options, evict = job.directive.options, job.directive.eviction
        kept = {}
        for name, (base, norms) in scores:
            mask = select(options, base, norms, evict.kept, evict.held)
            del base, norms  # the next layer's scores are made without this one's
            if options.head_wise:
                boundary = evict.boundary
                if not bool(mask[:, boundary:].all()):
                    raise LayoutError(
                        f"layer {name} drops some of the prompt's last {evict.seen - boundary} tokens in a KV "
                        "head, which the head-wise layout keeps in every head"
                    )
            kept[name] = mask
        return kept

    def write(self, job: Job, kept: dict[str, torch.Tensor], attention_layers: dict) -> None:
        """
        Uniform presses: each head's kept entries into its slots of positions ``E .. N-1``, in position order, one head
        at a time (what it holds beside the cache: one head's kept keys and values). Head-wise presses: each head's
        kept entries before the prompt's last block boundary ``B``, packed head after head into the rows of the whole
        blocks of positions ``E .. B-1`` (the layer's kept entries are read first: they move within those blocks).
        """
        slots = self.slots(job)  # read from the request's blocks, written through its destination table
        destination = self.destination(job)
        evict = job.directive.eviction
        if job.directive.options.head_wise:
            boundary = evict.boundary
            region = destination[evict.evicted // evict.block_size : boundary // evict.block_size].long()
            for name, mask in kept.items():
                kv_cache = attention_layers[name].kv_cache
                parts = [
                    self.layout.read(kv_cache, slots[mask[head, :boundary].nonzero().flatten()], slice(head, head + 1))
                    for head in range(mask.shape[0])
                ]
                keys = torch.cat([k[:, 0] for k, _ in parts])  # (region rows, d), head after head
                values = torch.cat([v[:, 0] for _, v in parts])
                region_keys, region_values = region_views(kv_cache)
                rows = region_keys.shape[1]
                if keys.shape[0] != region.numel() * rows:
                    raise PluginStateError(
                        f"kvpress_critical: {keys.shape[0]} kept entries for a region of {region.numel()} blocks"
                    )
                if region.numel():  # E == B: every kept entry is in the pinned tail
                    region_keys[region] = keys.view(region.numel(), rows, keys.shape[-1])
                    region_values[region] = values.view(region.numel(), rows, values.shape[-1])
            return
        target = self.slots(job, destination)[evict.evicted - evict.start :]
        for name, mask in kept.items():
            kv_cache = attention_layers[name].kv_cache
            for head in range(mask.shape[0]):
                heads = slice(head, head + 1)
                keys, values = self.layout.read(kv_cache, slots[mask[head].nonzero().flatten()], heads)
                self.layout.write(kv_cache, target, heads, keys, values)

    def agree_across_ranks(self, failed: list[bool]) -> list[bool]:
        """Under tensor parallelism a request is compacted only if every rank selected it (one all-reduce)."""
        if self.tp_size == 1:
            return failed
        import torch.distributed as dist

        flags = torch.tensor(failed, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=tp_cpu_group())
        return [bool(flag) for flag in flags.tolist()]
