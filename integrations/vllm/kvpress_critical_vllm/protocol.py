"""What the plugin's scheduler tells the workers each step, and what the workers answer.

The scheduler is the only place that decides which request is compressed, when, and by how much: with each step it
sends :class:`StepDirectives` (on the ``SchedulerOutput``, which vLLM hands to every worker); the workers carry them
out and answer with a :class:`StepReport` (on the ``ModelRunnerOutput`` the scheduler receives). The scheduler frees
a request's evicted blocks only when the report says its compaction is done, so a worker that could not compact
(a request whose selection failed, say) never leaves the request attending over freed blocks. Both travel with
the objects vLLM already sends (pickled across processes), so this module imports nothing of vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpress_critical_vllm.budget import Eviction
from kvpress_critical_vllm.options import CompressionOptions

# attribute names on vLLM's SchedulerOutput and ModelRunnerOutput
DIRECTIVES_ATTRIBUTE = "kvpress_critical_directives"
REPORT_ATTRIBUTE = "kvpress_critical_report"


class PluginStateError(RuntimeError):
    """The workers and the scheduler disagree about a request: a bug, which stops rather than answers wrongly."""


@dataclass(frozen=True)
class Compact:
    """Compact ``request_id`` after this step, whose scheduled tokens end exactly at ``eviction.seen``."""

    request_id: str
    options: CompressionOptions
    eviction: Eviction
    # (block index, block id): blocks of the request's table the compaction writes into fresh blocks instead, because
    # another request or a kept compressed prefix shares them (the worker's table points at the fresh ones after it)
    redirect: tuple[tuple[int, int], ...] = ()


@dataclass
class StepDirectives:
    """What the workers do for the plugin in one step (empty for most decoding steps)."""

    compact: dict[str, Compact] = field(default_factory=dict)
    save_queries: dict[str, int] = field(default_factory=dict)  # request id -> window: keep this chunk's last queries
    # request id -> E: a new request that starts from a kept compressed prefix (its first E positions evicted)
    restore: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.compact or self.save_queries or self.restore)


@dataclass(frozen=True)
class Compacted:
    """A compaction a worker finished: ``evicted`` positions (whole blocks) are no longer read; each KV head keeps
    ``kept_per_head`` entries on average, from ``kept_min`` to ``kept_max`` (over layers and heads)."""

    evicted: int
    kept_per_head: int
    kept_min: int
    kept_max: int


@dataclass
class StepReport:
    """A worker's answer for one step: what it compacted, what it could not compact (and why), its state's size."""

    compacted: dict[str, Compacted] = field(default_factory=dict)
    uncompressed: dict[str, str] = field(default_factory=dict)  # left whole: nothing of it was changed
    broken: dict[str, str] = field(default_factory=dict)  # changed in part: the request must be aborted
    tracked_requests: int = 0  # requests the worker keeps state for
