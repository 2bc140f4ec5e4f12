"""The plugin's counters on the server's ``/metrics``, in vLLM's naming (``vllm:kvpress_critical_*``).

The scheduler runs in the engine-core process, the ``/metrics`` endpoint in the API server's: vLLM carries no
plugin statistics between them. So the scheduler writes its counters, atomically and at most twice a second (and
whenever the engine falls idle), into a small JSON file in a folder the API server process chose at start
(``$KVPRESS_CRITICAL_METRICS_DIR``, a temporary folder removed at exit, inherited by the processes it starts);
:class:`PluginCollector`, registered in the API server's Prometheus registry, reads the files when ``/metrics`` is
scraped. Counters are summed over the engines that wrote them; gauges over the engines still running.

Exposed (labels: ``model_name``):

- ``vllm:kvpress_critical_requests_compressed_total``, ``vllm:kvpress_critical_prompt_tokens_compressed_total``,
  ``vllm:kvpress_critical_entries_kept_total`` (kept entries over all layers and KV heads),
  ``vllm:kvpress_critical_blocks_freed_total``, ``vllm:kvpress_critical_compactions_total`` and, among them,
  ``vllm:kvpress_critical_decoding_compactions_total`` (compression while decoding),
  ``vllm:kvpress_critical_requests_failed_total`` (requests the plugin ended with an error),
  ``vllm:kvpress_critical_blocks_unhashed_total`` (blocks compactions took out of vLLM's prefix cache),
  ``vllm:kvpress_critical_compressed_prefixes_reused_total`` and ``vllm:kvpress_critical_prompt_tokens_reused_total``
  (compressed requests that started from a compressed prefix another request kept, and the prompt tokens they did not
  compute);
- ``vllm:kvpress_critical_requests_uncompressed_total`` (label ``reason``: ``ratio_zero``, ``short_prompt``,
  ``streaming_input``, ``invalid_options``, ``not_compacted``, ``shared_prefix``: a block its compaction would rewrite
  is held by another request through vLLM's prefix cache);
- gauges ``vllm:kvpress_critical_scheduler_tracked_requests`` and ``vllm:kvpress_critical_worker_tracked_requests``:
  the requests the plugin keeps state for (0 once the engine is idle).

With several API server processes (``--api-server-count > 1``) vLLM serves ``/metrics`` from a multiprocess registry
that this collector is not part of: the counters are then in the log lines only.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

METRICS_DIR_ENV = "KVPRESS_CRITICAL_METRICS_DIR"
PREFIX = "vllm:kvpress_critical_"
COUNTERS = {
    "requests_compressed": "Requests whose KV cache the plugin compressed.",
    "prompt_tokens_compressed": "Prompt tokens of the compressed requests.",
    "entries_kept": "KV entries the compressed requests kept, over all layers and KV heads.",
    "blocks_freed": "KV blocks the plugin returned to vLLM's pool.",
    "compactions": "Compactions of a request's KV cache (one per request, or one per prompt chunk with "
    "compression_chunk_size).",
    "decoding_compactions": "Compactions while decoding (compression_interval), among compactions.",
    "blocks_unhashed": "KV blocks compactions took out of vLLM's prefix cache (rewritten, so never served as a hit).",
    "compressed_prefixes_reused": "Compressed requests that started from a compressed prefix another request kept "
    "(compression_chunk_size, vLLM's prefix cache on).",
    "prompt_tokens_reused": "Prompt tokens compressed requests took from a kept compressed prefix instead of "
    "computing them.",
    "requests_failed": "Requests the plugin ended with an error (a compaction broken midway, or, with a max_model_len "
    "longer than the pool, a request held whole that cannot fit it).",
}
GAUGES = {
    "scheduler_tracked_requests": "Requests the plugin's scheduler keeps state for.",
    "worker_tracked_requests": "Requests the plugin's workers keep state for.",
}
UNCOMPRESSED = "requests_uncompressed"
UNCOMPRESSED_REASONS = (
    "ratio_zero", "short_prompt", "streaming_input", "invalid_options", "not_compacted", "shared_prefix"
)  # fmt: skip
FLUSH_SECONDS = 0.5


def ensure_metrics_dir() -> str:
    """The folder of this server's metrics files: inherited, or made now (and removed when this process exits)."""
    folder = os.environ.get(METRICS_DIR_ENV)
    if folder:
        return folder
    folder = tempfile.mkdtemp(prefix="kvpress_critical_metrics-")
    os.environ[METRICS_DIR_ENV] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class MetricsWriter:
    """The scheduler's counters, written to ``$KVPRESS_CRITICAL_METRICS_DIR`` when that folder is set."""

    def __init__(self, vllm_config) -> None:
        model = vllm_config.model_config
        self.model_name = (model.served_model_name if model is not None else None) or "unknown"
        if isinstance(self.model_name, (list, tuple)):
            self.model_name = self.model_name[0]
        folder = os.environ.get(METRICS_DIR_ENV)
        self.path = Path(folder) / f"engine-{os.getpid()}-{id(self):x}.json" if folder else None
        self.counters = {name: 0 for name in COUNTERS}
        self.uncompressed_by_reason = {reason: 0 for reason in UNCOMPRESSED_REASONS}
        self.gauges = {name: 0 for name in GAUGES}
        self._dirty, self._written_at = True, 0.0

    def compressed(
        self,
        prompt_tokens: int,
        entries_kept: int,
        blocks_freed: int,
        request_done: bool = True,
        decoding: bool = False,
    ) -> None:
        """One compaction (``decoding``: while decoding); ``request_done`` for the one a request counts as compressed
        at (its prompt's last, or its first while decoding)."""
        self.counters["compactions"] += 1
        self.counters["decoding_compactions"] += int(decoding)
        self.counters["requests_compressed"] += int(request_done)
        self.counters["prompt_tokens_compressed"] += prompt_tokens
        self.counters["entries_kept"] += entries_kept
        self.counters["blocks_freed"] += blocks_freed
        self._dirty = True

    def unhashed(self, blocks: int) -> None:
        self.counters["blocks_unhashed"] += blocks
        self._dirty = blocks > 0 or self._dirty

    def prefix_reused(self, tokens: int) -> None:
        """A compressed request started from a kept compressed prefix of ``tokens`` tokens."""
        self.counters["compressed_prefixes_reused"] += 1
        self.counters["prompt_tokens_reused"] += tokens
        self._dirty = True

    def failed(self, requests: int) -> None:
        self.counters["requests_failed"] += requests
        self._dirty = requests > 0 or self._dirty

    def uncompressed(self, reason: str) -> None:
        self.uncompressed_by_reason[reason] += 1
        self._dirty = True

    def tracked(self, scheduler: int, worker: int) -> None:
        if (self.gauges["scheduler_tracked_requests"], self.gauges["worker_tracked_requests"]) != (scheduler, worker):
            self.gauges.update(scheduler_tracked_requests=scheduler, worker_tracked_requests=worker)
            self._dirty = True

    def snapshot(self) -> dict:
        return {
            "pid": os.getpid(),
            "model_name": self.model_name,
            "counters": dict(self.counters),
            "uncompressed": dict(self.uncompressed_by_reason),
            "gauges": dict(self.gauges),
        }

    def flush(self, force: bool = False) -> None:
        """Write the snapshot if it changed, at most every :data:`FLUSH_SECONDS` unless ``force``."""
        now = time.monotonic()
        if self.path is None or not self._dirty or (not force and now - self._written_at < FLUSH_SECONDS):
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.snapshot()))
            os.replace(tmp, self.path)
        except OSError:  # the folder went away (the server is exiting): counters stay in the log lines
            return
        self._dirty, self._written_at = False, now

    def close(self) -> None:
        self.gauges = {name: 0 for name in GAUGES}
        self._dirty = True
        self.flush(force=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(folder: str) -> list[dict]:
    snapshots = []
    for path in sorted(Path(folder).glob("engine-*.json")):
        try:
            snapshots.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return snapshots


class PluginCollector:
    """A Prometheus collector reading the engines' snapshots when ``/metrics`` is scraped."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = read_snapshots(self.folder)
        models = sorted({s["model_name"] for s in snapshots})
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            for model in models:
                family.add_metric([model], sum(s["counters"][name] for s in snapshots if s["model_name"] == model))
            yield family
        family = CounterMetricFamily(
            PREFIX + UNCOMPRESSED, "Requests the plugin left uncompressed, by reason.", labels=["model_name", "reason"]
        )
        for model in models:
            for reason in UNCOMPRESSED_REASONS:
                total = sum(s["uncompressed"].get(reason, 0) for s in snapshots if s["model_name"] == model)
                family.add_metric([model, reason], total)
        yield family
        live = [s for s in snapshots if _alive(s["pid"])]
        for name, doc in GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            for model in models:
                family.add_metric([model], sum(s["gauges"][name] for s in live if s["model_name"] == model))
            yield family


_COLLECTOR: PluginCollector | None = None


def register_collector() -> None:
    """Make the metrics folder (inherited by the engine processes started after) and expose it on ``/metrics``."""
    global _COLLECTOR
    if _COLLECTOR is not None:
        return
    folder = ensure_metrics_dir()
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # pragma: no cover - vLLM depends on prometheus_client
        return
    _COLLECTOR = PluginCollector(folder)
    REGISTRY.register(_COLLECTOR)
