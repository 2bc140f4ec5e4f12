"""What the scheduler knows of each compressed request: its schedule and progress (:class:`Tracked`), and what its
compactions did (:class:`CompressionRecord`: kept in a bounded window, ``scheduler.kvpress_records``, and said in one
log line per compaction, :func:`compaction_line`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvpress_critical_vllm.budget import Eviction, Schedule
from kvpress_critical_vllm.options import CompressionOptions

RECORDS_KEPT = 1024  # the latest compressed requests kept in scheduler.kvpress_records


@dataclass
class CompressionRecord:
    """What happened to one compressed request (``scheduler.kvpress_records`` in-process, or the log line)."""

    request_id: str
    press: str
    compression_ratio: float
    prompt_tokens: int  # tokens seen when it was last compacted (the prompt's, its chunks' so far, or while decoding)
    kept_per_head: int  # on average over the KV heads (every head's count with a uniform press)
    kept_min: int  # the fewest entries a KV head of some layer keeps
    kept_max: int  # the most
    blocks_freed: int  # by all its compactions so far
    blocks_before: int  # blocks it held before the latest one
    preemptions: int
    compaction: int = 1  # the latest compaction of the request ...
    # ... of this many (one per prompt chunk with compression_chunk_size); 0 while decoding (open-ended)
    compactions: int = 1
    phase: str = "prompt"  # of the latest compaction: "prompt" or "decoding"


class BoundedRecords(OrderedDict):
    """The latest ``maxlen`` records by request id (older ones are dropped: counters keep the totals)."""

    def __init__(self, maxlen: int):
        super().__init__()
        self.maxlen = maxlen

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxlen:
            self.popitem(last=False)


@dataclass
class Tracked:
    """The plugin's view of one request, from its arrival to its end."""

    options: CompressionOptions
    schedule: Schedule  # its compactions, in order: its prompt's, then (compression while decoding) its decoding ones
    life: int = 0  # the request's num_preemptions the two counts below are for (a preempted request starts over)
    directed: int = 0  # compactions sent to the workers in this life
    confirmed: int = 0  # ... and confirmed by them
    counted: bool = False  # in requests_compressed_total already
    # (index, compaction, key) of its prompt compactions on a block boundary: the compressed prefixes it may keep or
    # start from, with vLLM's prefix cache on (prefix_cache.CompressedPrefixes.stage_keys)
    prefix_keys: list | None = None
    # prompt compactions (by tokens seen) of this life whose state is not kept: a later compaction, directed before
    # they were confirmed, writes into their blocks
    unkept: set = field(default_factory=set)

    def live(self, preemptions: int) -> "Tracked":
        """Start the counts over when the request was preempted since they were last set."""
        if preemptions != self.life:
            self.life, self.directed, self.confirmed = preemptions, 0, 0
            self.unkept = set()
        return self

    def next_end(self, computed: int, limit: int) -> int | None:
        """The first compaction position after ``computed`` tokens, up to ``limit`` (where a step's tokens of the
        request stop)."""
        stage = self.schedule.after(computed, limit)
        return stage.seen if stage is not None else None


def compaction_line(record: CompressionRecord, plan: Eviction, options: CompressionOptions) -> str:
    """The log line of a confirmed compaction (after ``kvpress_critical: request <id>: ``)."""
    decoding = plan.phase == "decoding"
    spread = f" (head-wise: {record.kept_min} to {record.kept_max})" if options.head_wise else ""
    where = f"prompt {plan.seen} tokens"
    if plan.count > 1:
        where = f"compaction {plan.index} of {plan.count} (prompt chunks to {plan.seen} tokens)"
    elif decoding:
        where = f"decoding compaction {plan.index} (at {plan.seen} tokens, every {options.compression_interval})"
    what = f"target_size {options.target_size}" if decoding else f"compression_ratio {options.compression_ratio:.3g}"
    preempted = f" (after {record.preemptions} preemption(s))" if record.preemptions else ""
    return (
        f"{where}, {plan.kept} entries kept per KV head{spread} ({options.press}, {what}, budget {plan.budget}), "
        f"{plan.blocks_freed} of {record.blocks_before} blocks freed{preempted}"
    )
