"""The plugin's workers: vLLM's CPU and GPU workers, with the plugin's attention backends and per-worker state.

Set as ``parallel_config.worker_cls`` by :func:`kvpress_critical_vllm.engine_config.check_engine_config`; each
rank of a tensor-parallel engine selects its own KV heads with its own shard of ``o_proj``. At start-up the worker
checks what the scheduler takes for granted (every compressed layer runs a plugin backend whose cache the plugin
reads and writes exactly, the attention kernel's block size is the cache's, the projected norm's backend runs on
this device) and refuses to start otherwise. Each step it carries out the scheduler's directives and answers with a
report (:mod:`kvpress_critical_vllm.protocol`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from copy import copy

import torch

from kvpress_critical_vllm.attention import CompressingBuilderMixin, CompressingImplMixin, register_backends
from kvpress_critical_vllm.engine_config import EngineConfigError
from kvpress_critical_vllm.head_wise_attention import softmax_terms
from kvpress_critical_vllm.kv_codes import KVCodes
from kvpress_critical_vllm.kv_spec import compressed_group
from kvpress_critical_vllm.layouts import region_views
from kvpress_critical_vllm.protocol import REPORT_ATTRIBUTE, StepReport
from kvpress_critical_vllm.vllm_compat import (
    attention_groups,
    discarded_rows,
    forward_context,
    generators_of,
    kv_cache_groups,
    kv_scales,
)
from kvpress_critical_vllm.worker_state import WorkerState

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


def with_report(output, report: StepReport):
    """``output`` (a ``ModelRunnerOutput``, or an async one) carrying ``report``, without touching vLLM's shared empty
    output."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput

    if isinstance(output, AsyncModelRunnerOutput):
        return __getattr__("ReportingAsyncOutput")(output, report)
    if isinstance(output, ModelRunnerOutput):
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = copy(output)
        setattr(output, REPORT_ATTRIBUTE, report)
    return output


def head_wise_probe_lengths(group: int) -> list[int]:
    """Query lengths whose head-wise attention covers every kernel variant: one token (decoding), and the fewest
    tokens whose ``group * q`` query rows reach each tile size the kernels choose (16, 32 and 64 rows: a preempted
    request recomputes its outputs in one step of any length)."""
    return sorted({1} | {-(-rows // group) for rows in (17, 33, 65)})


def check_attention_impl(name: str, impl) -> None:
    """Refuse a compressed layer whose attention has a window or bias the plugin does not carry: a sliding window and
    ALiBi follow a slot's index, not the position of the entry a compaction moved there. A logits soft cap and
    attention sinks are served: the backend applies them to the uniform rows, the head-wise attention to its own
    (:func:`~kvpress_critical_vllm.head_wise_attention.softmax_terms`), and the presses score as kvpress's do (their
    window attention without them)."""
    window = getattr(impl, "sliding_window", None)
    variants = {
        "a sliding window (in the full-attention KV-cache group, as when disable_hybrid_kv_cache_manager is set), "
        "which follows a slot's index, not the position of the entry a compaction moved there": (
            window not in (None, -1, (-1, -1))
        ),
        "ALiBi, whose bias follows a slot's index, not the position of the entry a compaction moved there": (
            getattr(impl, "alibi_slopes", None) is not None
        ),
    }
    for variant, used in variants.items():
        if used:
            raise EngineConfigError(
                f"kvpress_critical cannot compress layer {name}: it uses {variant}. Serve a model without it, or vLLM "
                "without the plugin."
            )


@contextmanager
def discarded_cpu_generators_set_aside(runner):
    """
    The seeded requests whose sample of this step is discarded (a partial prefill: vLLM's chunked prefill or one of
    the plugin's compaction stops) sample without their generator, which stays where it was.

    vLLM rewinds such a request's generator after sampling (``set_offset(get_offset() - 4)``, exact for the Philox
    generators of GPUs); a CPU generator has no offset, so the rewind raised ``RuntimeError: CPU Generator does not
    use offset`` and ended the engine. Not drawing from the generator at all is the rewind a CPU generator allows: the
    request's later samples see the same random stream as if the discarded one had not been drawn. The discarded row
    draws from the global generator instead (its token is thrown away). GPU generators are left to vLLM.
    """
    generators = generators_of(runner)
    discarded = discarded_rows(runner) if generators else []  # no seeded request in the batch: nothing to read
    aside = {i: g for i, g in generators.items() if i < len(discarded) and discarded[i] and g.device.type == "cpu"}
    for index in aside:
        del generators[index]  # the sampling metadata holds this same dict
    try:
        yield
    finally:
        if aside:
            generators.update(aside)


def _reporting_async_output():
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class ReportingAsyncOutput(AsyncModelRunnerOutput):
        """An async output whose result carries the plugin's report for its step."""

        def __init__(self, inner, report: StepReport):
            self.inner, self.report = inner, report

        def get_output(self):
            return with_report(self.inner.get_output(), self.report)

    return ReportingAsyncOutput


class CompressingWorkerMixin:
    """Registers the attention backends, binds the model's output projections, checks the paged cache, runs steps."""

    kvpress_state: WorkerState

    def init_device(self, *args, **kwargs):
        register_backends()
        result = super().init_device(*args, **kwargs)
        self.kvpress_state = WorkerState(self.vllm_config, self.model_runner)
        self.kvpress_state.tp_size = self.vllm_config.parallel_config.tensor_parallel_size
        return result

    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        self.kvpress_state.bind_model(self.model_runner.get_model())
        return result

    def determine_available_memory(self, *args, **kwargs) -> int:
        """vLLM's KV budget, less the most a compaction and the window queries hold (on GPUs; on CPUs the pool's size
        is set explicitly)."""
        available = super().determine_available_memory(*args, **kwargs)
        compaction, queries = self._compaction_reserve()
        config = self.vllm_config.model_config
        what = (
            f"a compaction of a {config.max_model_len}-token prompt holds up to {compaction / 2**20:.1f} MiB and the "
            f"window queries of {self.vllm_config.scheduler_config.max_num_seqs} requests up to "
            f"{queries / 2**20:.1f} MiB"
        )
        if self.vllm_config.device_config.device_type == "cpu":
            logger.info(
                "kvpress_critical: %s beside the model and the KV pool; leave that much memory free beside "
                "kv_cache_memory_bytes / VLLM_CPU_KVCACHE_SPACE",
                what,
            )
            return available
        logger.info("kvpress_critical: %s: reserved from the KV budget", what)
        return max(0, available - compaction - queries)

    def _compaction_reserve(self) -> tuple[int, int]:
        """``(compaction, window queries)``: the bytes :func:`~kvpress_critical_vllm.presses.compaction_peak_bytes`
        and :func:`~kvpress_critical_vllm.presses.window_queries_bytes` give for this engine."""
        from kvpress_critical_vllm.presses import compaction_peak_bytes, window_queries_bytes

        model = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        num_kv_heads = model.get_num_kv_heads(parallel)
        num_heads = model.get_num_attention_heads(parallel)
        group = max(1, num_heads // max(1, num_kv_heads))
        options = self.kvpress_state.engine_options
        layers, itemsize = model.get_num_layers(parallel), model.dtype.itemsize
        compaction = compaction_peak_bytes(
            model.max_model_len, num_kv_heads, group, model.get_head_size(), itemsize, options.max_window_size, layers,
        )  # fmt: skip
        queries = window_queries_bytes(
            self.vllm_config.scheduler_config.max_num_seqs, layers, options.max_window_size, num_heads,
            model.get_head_size(), itemsize,
        )  # fmt: skip
        return compaction, queries

    def get_kv_cache_spec(self, *args, **kwargs):
        """vLLM's specs, the full-attention layers declaring the bound of a request compacted after every prompt chunk
        and while decoding (:mod:`kvpress_critical_vllm.kv_spec`): vLLM's start-up check then reads what a request
        really holds. (The compaction reserve above stays sized for ``max_model_len``: a request's own options may
        hold more than the engine's, up to what the pool has.)"""
        from kvpress_critical_vllm.kv_spec import bounded_specs

        options, max_len = self.kvpress_state.engine_options, self.vllm_config.model_config.max_model_len
        return bounded_specs(super().get_kv_cache_spec(*args, **kwargs), options, max_len)

    def initialize_from_config(self, *args, **kwargs):
        result = super().initialize_from_config(*args, **kwargs)
        self._check_attention_layers()
        self._check_projected_norm_backend()
        return result

    def _attention_layers(self) -> dict:
        return forward_context(self.vllm_config)

    def _check_attention_layers(self) -> None:
        """Every compressed layer runs a plugin backend whose cache the plugin reads and writes exactly (probed); the
        kernel's block size is the cache's; every metadata builder is given this worker's state."""
        context = self._attention_layers()
        state = self.kvpress_state
        groups = kv_cache_groups(self.model_runner)
        compressed = compressed_group(groups)
        state.group = compressed
        layers = set(groups[compressed].layer_names)
        # the model's full-attention layers (bind_model) are the compressed group's; the sliding-window and
        # linear-attention groups' layers run as vLLM's, with their whole view
        if set(state.o_proj) != layers:
            raise EngineConfigError(
                f"kvpress_critical cannot compress with this model: the layers whose o_proj it read "
                f"({len(state.o_proj)}, the full-attention ones) are not the full-attention KV-cache group's "
                f"({len(layers)}: {sorted(layers ^ set(state.o_proj))[:4]} differ)"
            )
        for name in state.o_proj:
            layer = context[name]
            if not isinstance(layer.impl, CompressingImplMixin):
                raise EngineConfigError(
                    f"kvpress_critical cannot compress with attention backend {type(layer.impl).__name__} "
                    f"(layer {name}): the plugin extends CPU_ATTN and FLASH_ATTN. Select one with "
                    "attention_config={'backend': 'FLASH_ATTN'} (--attention-backend FLASH_ATTN) on NVIDIA GPUs."
                )
            check_attention_impl(name, layer.impl)
            try:
                region_views(layer.kv_cache)
            except ValueError as error:
                raise EngineConfigError(
                    f"kvpress_critical cannot read layer {name}'s KV cache as head-wise regions: {error}"
                ) from error
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        state.kv_codes = {name: KVCodes(cache_dtype, *kv_scales(context[name])) for name in state.o_proj}
        first_name = next(iter(state.o_proj))
        first = context[first_name]
        dtype = state.o_proj[first_name].dtype
        state.layout = first.impl.paged_layout(first, first.kv_cache, state.kv_codes[first_name], dtype)
        state.block_size = first.kv_cache.shape[2] if first.kv_cache.dim() == 4 else None
        builders = 0
        for index, attention in enumerate(attention_groups(self.model_runner)):
            for group in attention:
                if index != compressed:  # a sliding-window or linear-attention group: vLLM's, no plan
                    for builder in group.metadata_builders:
                        builder.kvpress_passthrough = True
                    continue
                spec_block = group.kv_cache_spec.block_size
                if group.kernel_block_size not in (None, spec_block):
                    raise EngineConfigError(
                        f"kvpress_critical cannot compress with attention kernel blocks of {group.kernel_block_size} "
                        f"tokens inside cache blocks of {spec_block}: the plugin frees and shifts whole cache blocks. "
                        f"Pass block_size={group.kernel_block_size} (--block-size {group.kernel_block_size})."
                    )
                state.block_size = spec_block
                for builder in group.metadata_builders:
                    if not isinstance(builder, CompressingBuilderMixin):
                        raise EngineConfigError(
                            f"kvpress_critical: attention metadata builder {type(builder).__name__} is not the "
                            "plugin's, so compressed requests would not be shifted"
                        )
                    builder.kvpress_state = state
                    builders += 1
        if not builders:
            raise EngineConfigError("kvpress_critical found no attention metadata builder to give its state to")

    def _check_projected_norm_backend(self) -> None:
        """The engine's projected-norm backend runs on this worker's device, or the engine does not start."""
        from kvpress_critical.ops.projected_value_norm import projected_value_norm

        state = self.kvpress_state
        backend = state.engine_options.backend
        weight = next(iter(state.o_proj.values()))
        head_size = self._attention_layers()[next(iter(state.o_proj))].impl.head_size
        values = torch.randn(1, 1, 3, head_size, dtype=weight.dtype, device=weight.device)
        try:
            projected_value_norm(values, weight[:, :head_size], 1, norm="l1", backend=backend)
        except Exception as error:  # noqa: BLE001 - any failure of the named backend refuses the engine
            raise EngineConfigError(
                f"kvpress_critical cannot run the projected norm's backend {backend!r} on {weight.device} "
                f"({error}). Set additional_config['kvpress_critical']['backend'] to 'auto' (or one that runs here)."
            ) from error
        self._probe_head_wise_attention(weight, head_size)

    def _probe_head_wise_attention(self, weight: torch.Tensor, head_size: int) -> None:
        """Every variant of the head-wise attention this engine can serve (its KV heads, GQA group, head size, block
        size and dtype; one query token when decoding, and enough to reach each tile of query rows the kernels pick
        when a preempted request recomputes several) is compiled and checked against the reference now, or the engine
        does not start."""
        from kvpress_critical.ops.paged_ragged_attention import (
            paged_ragged_attention,
            paged_ragged_attention_ref,
            random_paged_layout,
        )

        state = self.kvpress_state
        attention = state.engine_options.head_wise_kernel
        model, parallel = self.vllm_config.model_config, self.vllm_config.parallel_config
        kv_heads = model.get_num_kv_heads(parallel)
        group = max(1, model.get_num_attention_heads(parallel) // kv_heads)
        block = state.block_size or 16
        codes = next(iter(state.kv_codes.values()), None)
        terms = softmax_terms(self._attention_layers()[next(iter(state.o_proj))].impl)  # a soft cap, sinks
        for q_len in head_wise_probe_lengths(group):
            probe = random_paged_layout(
                2, kv_heads, group, q_len, head_size, block, [[3 + h for h in range(kv_heads)], [block + 1] * kv_heads],
                [q_len + 2, q_len + block], dtype=weight.dtype, device=weight.device,
                cache_dtype=codes.code_dtype if codes is not None else None,
            )  # fmt: skip
            try:
                out = paged_ragged_attention(**probe, **terms, backend=attention)
                expected = paged_ragged_attention_ref(**probe, **terms)
                tolerance = 1e-4 if weight.dtype == torch.float32 else 3e-2
                torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
            except Exception as error:  # noqa: BLE001
                raise EngineConfigError(
                    f"kvpress_critical cannot run the head-wise attention's backend {attention!r} on {weight.device} "
                    f"for {q_len} query token(s) of {kv_heads} KV heads in groups of {group} ({error}). Set "
                    "additional_config['kvpress_critical']['head_wise_kernel'] to 'auto' (or one that runs here)."
                ) from error

    def execute_model(self, scheduler_output, *args, **kwargs):
        state = self.kvpress_state
        state.begin_step(scheduler_output)
        output = super().execute_model(scheduler_output, *args, **kwargs)
        state.finish_step(self._attention_layers())
        if output is not None:
            output = with_report(output, state.take_report())
        return output

    def sample_tokens(self, *args, **kwargs):
        with discarded_cpu_generators_set_aside(self.model_runner):
            output = super().sample_tokens(*args, **kwargs)
        return with_report(output, self.kvpress_state.take_report())

    def kvpress_critical_selections(self) -> dict:
        """The kept positions recorded per request and layer (``record_selections``), then forgotten."""
        return self.kvpress_state.take_selections()

    def kvpress_critical_stage_selections(self) -> dict:
        """The kept positions recorded after each compaction of a request (``record_selections``), then forgotten."""
        return self.kvpress_state.take_stage_selections()

    def kvpress_critical_compacted(self) -> int:
        """How many compactions this worker has done (one per request, or one per prompt chunk with
        compression_chunk_size)."""
        return self.kvpress_state.compacted_requests

    def kvpress_critical_kv_codes(self) -> dict[str, tuple[str, float, float]]:
        """Each compressed layer's cache format: ``(kv_cache_dtype, k_scale, v_scale)``."""
        return {name: (c.cache_dtype, c.k_scale, c.v_scale) for name, c in self.kvpress_state.kv_codes.items()}

    def kvpress_critical_tracked(self) -> int:
        """How many requests this worker keeps state for (0 when idle)."""
        return self.kvpress_state.tracked_requests

    def shutdown(self, *args, **kwargs):
        state = getattr(self, "kvpress_state", None)
        if state is not None:
            state.close()
        return super().shutdown(*args, **kwargs)


def _cpu_worker():
    from vllm.v1.worker.cpu_worker import CPUWorker

    return type("CriticalKVCPUWorker", (CompressingWorkerMixin, CPUWorker), {"__module__": __name__})


def _gpu_worker():
    from vllm.v1.worker.gpu_worker import Worker

    return type("CriticalKVGPUWorker", (CompressingWorkerMixin, Worker), {"__module__": __name__})


_CLASSES = {
    "CriticalKVCPUWorker": _cpu_worker,
    "CriticalKVGPUWorker": _gpu_worker,
    "ReportingAsyncOutput": _reporting_async_output,
}


def __getattr__(name: str):
    # each class imports only its own platform's worker (the CPU worker module loads CPU-only ops, and back)
    if name in globals():
        return globals()[name]
    if name in _CLASSES:
        value = _CLASSES[name]()
        globals()[name] = value
        return value
    raise AttributeError(name)
