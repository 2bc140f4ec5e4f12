"""The plugin's workers: vLLM's CPU and GPU workers, with the plugin's attention backends and per-worker state.

Set as ``parallel_config.worker_cls`` by :func:`kvpress_critical_vllm.engine_config.check_engine_config`; each
rank of a tensor-parallel engine selects its own KV heads with its own shard of ``o_proj``.
"""

from __future__ import annotations

from kvpress_critical_vllm.attention import CompressingImplMixin, register_backends
from kvpress_critical_vllm.engine_config import EngineConfigError
from kvpress_critical_vllm.worker_state import WorkerState


class CompressingWorkerMixin:
    """Registers the attention backends, binds the model's output projections, checks the paged cache."""

    kvpress_state: WorkerState

    def init_device(self, *args, **kwargs):
        register_backends()
        result = super().init_device(*args, **kwargs)
        self.kvpress_state = WorkerState(self.vllm_config, self.model_runner)
        return result

    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        self.kvpress_state.bind_model(self.model_runner.get_model())
        return result

    def initialize_from_config(self, *args, **kwargs):
        result = super().initialize_from_config(*args, **kwargs)
        self._check_attention_layers()
        return result

    def _check_attention_layers(self) -> None:
        """Every compressed layer runs a plugin backend, whose cache the plugin reads back exactly (probed)."""
        context = self.vllm_config.compilation_config.static_forward_context
        for name in self.kvpress_state.o_proj:
            layer = context[name]
            if not isinstance(layer.impl, CompressingImplMixin):
                raise EngineConfigError(
                    f"kvpress_critical cannot compress with attention backend {type(layer.impl).__name__} "
                    f"(layer {name}): the plugin extends CPU_ATTN and FLASH_ATTN. Select one with "
                    "attention_config={'backend': 'FLASH_ATTN'} (--attention-backend FLASH_ATTN) on NVIDIA GPUs."
                )
        first = context[next(iter(self.kvpress_state.o_proj))]
        self.kvpress_state.layout = first.impl.paged_layout(first, first.kv_cache)

    def kvpress_critical_selections(self) -> dict:
        """The kept positions recorded per request and layer (``record_selections``), then forgotten."""
        return self.kvpress_state.take_selections()

    def kvpress_critical_compacted(self) -> int:
        """How many requests this worker has compacted."""
        return self.kvpress_state.compacted_requests

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


_WORKERS = {"CriticalKVCPUWorker": _cpu_worker, "CriticalKVGPUWorker": _gpu_worker}


def __getattr__(name: str):
    # each class imports only its own platform's worker (the CPU worker module loads CPU-only ops, and back)
    if name in _WORKERS:
        worker = _WORKERS[name]()
        globals()[name] = worker
        return worker
    raise AttributeError(name)
