"""The attention side: a shifted view for compressed requests, the queries a compaction needs, the paged layouts.

The plugin's backends subclass vLLM's (``CPU_ATTN``; ``FLASH_ATTN`` on NVIDIA GPUs) and change two things:

- the metadata builder gives each compressed request a view that starts after its evicted blocks: ``seq_len - E``
  and its block-table row shifted by ``E / block_size`` (positions, RoPE and the slot mapping of new tokens are
  untouched: new entries go where vLLM puts them);
- the implementation, after a layer's attention, hands the worker's state the queries of the rows that end a
  prompt (or an earlier chunk of one) in this step: SnapKV scores the prompt's last queries. The compaction itself
  runs after the forward pass (:meth:`kvpress_critical_vllm.worker_state.WorkerState.finish_step`, in
  :mod:`kvpress_critical_vllm.compaction`), which reads and writes the paged cache through the layouts below: the
  paged layout may hold a different position in each KV head at the same slot, since attention reads each head's
  own keys and values and RoPE is already applied.

Both behave as vLLM's own unless the engine was started with the plugin's ``additional_config``; with it, a
builder that was not given the worker's state refuses to build (the plugin never skips a row silently).
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from kvpress_critical_vllm.layouts import LearnedBlockLayout, SplitLayout, check_round_trip, split_flash_attn
from kvpress_critical_vllm.options import engine_options
from kvpress_critical_vllm.protocol import PluginStateError
from kvpress_critical_vllm.vllm_compat import shifted_view
from kvpress_critical_vllm.worker_state import WorkerState

PLAN_ATTRIBUTE = "kvpress_critical_plan"


class CompressingBuilderMixin:
    """Plans the step for the plugin and gives compressed requests their shifted view."""

    kvpress_state: WorkerState | None = None  # set by the plugin's worker once the builders exist
    kvpress_passthrough = False  # a group the plugin leaves to vLLM (sliding-window layers beside compressed ones)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, *args, **kwargs):
        if self.kvpress_passthrough:
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        state = self.kvpress_state
        if state is None:
            if engine_options(self.vllm_config.additional_config) is not None:
                raise PluginStateError(
                    f"kvpress_critical: attention metadata builder {type(self).__name__} was not given the worker's "
                    "state, so it could neither shift nor compact compressed requests; the plugin refuses rather "
                    "than attend over freed blocks (was the worker class replaced?)"
                )
            return super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        block_size = self.kv_cache_spec.block_size
        plan = state.plan_step(common_attn_metadata, block_size)
        if plan.shift is not None:
            common_attn_metadata = shifted_view(common_attn_metadata, plan.shift, block_size)
        metadata = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)
        if plan.captures:
            setattr(metadata, PLAN_ATTRIBUTE, (state, plan))
        return metadata


class CompressingImplMixin:
    """Runs the backend's attention, then the head-wise rows' own attention, and hands the worker's state the queries
    the step's plan needs."""

    layout_kind: str  # "learned" (probe the backend's in-block order) or "split" (SplitLayout of split_flash_attn)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        captured = getattr(attn_metadata, PLAN_ATTRIBUTE, None)
        if captured is not None:
            state, plan = captured
            if plan.head_wise:  # the head-wise rows: their own attention replaces the backend's
                state.attend_head_wise(layer, query, kv_cache, output, plan)
            state.capture(layer.layer_name, query, plan)  # (tokens, H, d)
        return result

    def paged_layout(self, layer, kv_cache: torch.Tensor, codes=None, dtype: torch.dtype | None = None):
        """How to read this backend's cache by slot (probed or split), checked by a round trip on scratch blocks;
        ``codes`` (:class:`~kvpress_critical_vllm.kv_codes.KVCodes`) and ``dtype`` (the model's) for an fp8 cache."""
        if self.layout_kind == "learned":
            layout = LearnedBlockLayout.probe(self, layer, kv_cache, codes, dtype)
        else:
            layout = SplitLayout(split_flash_attn, self.head_size)
        check_round_trip(self, layer, kv_cache, layout, codes, dtype)
        return layout


def _compressing_backend(module: str, base_name: str, layout_kind: str, name: str) -> type:
    """A subclass of the backend ``module.base_name`` whose builder and implementation compress."""
    import importlib

    base = getattr(importlib.import_module(module), base_name)
    builder = type(
        f"{name}MetadataBuilder", (CompressingBuilderMixin, base.get_builder_cls()), {"__module__": __name__}
    )
    impl = type(
        f"{name}Impl",
        (CompressingImplMixin, base.get_impl_cls()),
        {"layout_kind": layout_kind, "__module__": __name__},
    )
    return type(
        name,
        (base,),
        {
            "__module__": __name__,
            "__doc__": f"vLLM's {base.get_name()} with the plugin's shifted view and compaction.",
            "get_impl_cls": staticmethod(lambda: impl),
            "get_builder_cls": staticmethod(lambda: builder),
        },
    )


# the plugin's backends, each built when first resolved (each base imports platform-specific modules)
_BACKENDS = {
    "CriticalCPUAttentionBackend": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend", "learned"),
    "CriticalFlashAttentionBackend": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend", "split"),
}


def __getattr__(name: str):
    if name in _BACKENDS:
        backend = _compressing_backend(*_BACKENDS[name], name)
        globals()[name] = backend
        return backend
    raise AttributeError(name)


# vLLM backend name -> the plugin's class path (vllm.v1.attention.backends.registry.register_backend)
BACKENDS = {
    "CPU_ATTN": f"{__name__}.CriticalCPUAttentionBackend",
    "FLASH_ATTN": f"{__name__}.CriticalFlashAttentionBackend",
}


def register_backends() -> None:
    """Point vLLM's ``CPU_ATTN`` and ``FLASH_ATTN`` at the plugin's subclasses in this process (idempotent); the
    subclasses behave as vLLM's own in an engine that does not enable the plugin."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    for name, path in BACKENDS.items():
        register_backend(AttentionBackendEnum[name], path)
    _cached_get_attn_backend.cache_clear()
