"""The attention side: a shifted view for compressed requests, the queries a compaction needs, the paged layouts.

The plugin's backends subclass vLLM's (``CPU_ATTN``; ``FLASH_ATTN`` on NVIDIA GPUs) and change two things:

- the metadata builder gives each compressed request a view that starts after its evicted blocks: ``seq_len - E``
  and its block-table row shifted by ``E / block_size`` (positions, RoPE and the slot mapping of new tokens are
  untouched: new entries go where vLLM puts them);
- the implementation, after a layer's attention, hands the worker's state the queries of the rows that end a
  prompt (or an earlier chunk of one) in this step: SnapKV scores the prompt's last queries. The compaction itself
  runs after the forward pass (:meth:`kvpress_critical_vllm.worker_state.WorkerState.finish_step`), which reads and
  writes the paged cache through the layouts below: the paged layout may hold a different position in each KV head
  at the same slot, since attention reads each head's own keys and values and RoPE is already applied.

Both behave as vLLM's own unless the engine was started with the plugin's ``additional_config``; with it, a
builder that was not given the worker's state refuses to build (the plugin never skips a row silently).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from kvpress_critical_vllm.options import engine_options
from kvpress_critical_vllm.worker_state import PluginStateError, WorkerState

PLAN_ATTRIBUTE = "kvpress_critical_plan"


class SplitLayout:
    """A backend whose cache splits into keys and values indexed ``[block, slot in block, kv head, dim]``."""

    def __init__(self, split: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]], head_size: int):
        self.split, self.head_size = split, head_size

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice = slice(None)):
        """``(n, h, d)`` keys and values of KV heads ``heads`` at the flat ``slots`` (``block * bs + offset``)."""
        key_cache, value_cache = self.split(kv_cache, self.head_size)
        block_size = key_cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        return key_cache[blocks, offsets, heads], value_cache[blocks, offsets, heads]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice, keys, values) -> None:
        """Store ``(n, h, d)`` keys and values of KV heads ``heads`` at the flat ``slots`` (other heads untouched)."""
        key_cache, value_cache = self.split(kv_cache, self.head_size)
        block_size = key_cache.shape[1]
        blocks, offsets = slots // block_size, slots % block_size
        key_cache[blocks, offsets, heads] = keys.to(key_cache.dtype)
        value_cache[blocks, offsets, heads] = values.to(value_cache.dtype)


def split_flash_attn(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``FLASH_ATTN``'s ``[blocks, kv_heads, block_size, 2 * head_size]`` cache (its ``do_kv_cache_update``'s view)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


class LearnedBlockLayout:
    """
    ``CPU_ATTN``'s cache, ``[blocks, kv_heads, block_size, 2 * head_size]``, whose in-block order depends on the
    kernel's instruction set (keys are stored dim-major for the vector kernels): the position of every (slot, dim)
    of the keys and of the values inside one (block, head) is learned from the backend's own writes.
    """

    def __init__(self, key_offsets: torch.Tensor, value_offsets: torch.Tensor):
        self.key_offsets, self.value_offsets = key_offsets, value_offsets  # (block_size, d) into a block-head

    @classmethod
    @torch.no_grad()
    def probe(cls, impl, layer, kv_cache: torch.Tensor) -> "LearnedBlockLayout":
        """Write slot and dim numbers through ``impl.do_kv_cache_update`` into a scratch block; see where they land."""
        _, num_kv_heads, block_size, width = kv_cache.shape
        head_size = width // 2
        if max(block_size, head_size) > 256:
            raise ValueError("layout probe: block_size and head_size must be <= 256 (exact in bf16)")
        seen = []
        for code in ("slot", "dim"):
            scratch = torch.full((1, *kv_cache.shape[1:]), -1.0, dtype=kv_cache.dtype, device=kv_cache.device)
            numbers = torch.arange(block_size if code == "slot" else head_size, device=kv_cache.device)
            shape = (block_size, num_kv_heads, head_size)
            entries = (numbers[:, None, None] if code == "slot" else numbers[None, None, :]).expand(shape)
            entries = entries.to(kv_cache.dtype).contiguous()
            impl.do_kv_cache_update(layer, entries, entries, scratch, torch.arange(block_size, device=kv_cache.device))
            seen.append(scratch[0, 0].reshape(-1).long())  # what each storage offset of one block-head holds
        slot_of, dim_of = seen
        if bool((slot_of < 0).any()) or bool((dim_of < 0).any()):
            raise ValueError("layout probe: the backend left part of a block-head unwritten")
        half = block_size * head_size
        offsets = []
        for part in (slice(0, half), slice(half, 2 * half)):  # keys first, then values (CPU_ATTN's chunk)
            where = torch.full((block_size, head_size), -1, dtype=torch.long, device=kv_cache.device)
            storage = torch.arange(part.start, part.stop, device=kv_cache.device)
            where[slot_of[part], dim_of[part]] = storage
            offsets.append(where)
        if any(bool((where < 0).any()) for where in offsets):
            raise ValueError("layout probe: some (slot, dim) of the cache was not found")
        return cls(*offsets)

    def _index(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice):
        num_blocks, num_kv_heads, block_size, width = kv_cache.shape
        flat = kv_cache.view(num_blocks, num_kv_heads, block_size * width)
        head_ids = torch.arange(num_kv_heads, device=kv_cache.device)[heads]
        blocks, offsets = slots // block_size, slots % block_size
        index = (blocks[:, None, None], head_ids[None, :, None])  # (n, h, d) with the offsets below
        return flat, index, self.key_offsets[offsets][:, None, :], self.value_offsets[offsets][:, None, :]

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice = slice(None)):
        """``(n, h, d)`` keys and values of KV heads ``heads`` at the flat ``slots`` (``block * bs + offset``)."""
        flat, index, key_offsets, value_offsets = self._index(kv_cache, slots, heads)
        return flat[(*index, key_offsets)], flat[(*index, value_offsets)]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice, keys, values) -> None:
        """Store ``(n, h, d)`` keys and values of KV heads ``heads`` at the flat ``slots`` (other heads untouched)."""
        flat, index, key_offsets, value_offsets = self._index(kv_cache, slots, heads)
        flat[(*index, key_offsets)] = keys.to(flat.dtype)
        flat[(*index, value_offsets)] = values.to(flat.dtype)


def shifted_view(cm: CommonAttentionMetadata, shift: torch.Tensor, block_size: int) -> CommonAttentionMetadata:
    """
    ``cm`` with each row's first ``shift[row]`` positions (whole blocks) out of its attention view.

    ``shift`` is an int tensor over the real rows (padding rows shift by 0).
    """
    num_rows = cm.seq_lens.shape[0]
    shift_rows = torch.zeros(num_rows, dtype=torch.int64)
    shift_rows[: shift.shape[0]] = shift
    seq_lens = cm.seq_lens - shift_rows.to(device=cm.seq_lens.device, dtype=cm.seq_lens.dtype)
    upper = cm.seq_lens_cpu_upper_bound
    if upper is not None:
        upper = upper - shift_rows[: upper.shape[0]].to(upper.dtype)
    table = cm.block_table_tensor
    columns = torch.arange(table.shape[1], device=table.device)
    index = (columns[None, :] + (shift_rows // block_size).to(table.device)[:, None]).clamp_(max=table.shape[1] - 1)
    table = table.gather(1, index[: table.shape[0]])
    reference = upper if upper is not None else seq_lens.cpu()
    max_seq_len = int(reference[: shift.shape[0]].max()) if shift.shape[0] else cm.max_seq_len
    return cm.replace(
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=upper,
        block_table_tensor=table,
        max_seq_len=max_seq_len,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


class CompressingBuilderMixin:
    """Plans the step for the plugin and gives compressed requests their shifted view."""

    kvpress_state: WorkerState | None = None  # set by the plugin's worker once the builders exist

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, *args, **kwargs):
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
    """Runs the backend's attention, then hands the worker's state the queries the step's plan needs."""

    layout_kind: str  # "learned" (probe the backend's in-block order) or "split" (SplitLayout of split_flash_attn)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        captured = getattr(attn_metadata, PLAN_ATTRIBUTE, None)
        if captured is not None:
            state, plan = captured
            state.capture(layer.layer_name, query, plan)  # (tokens, H, d)
        return result

    def paged_layout(self, layer, kv_cache: torch.Tensor):
        """How to read this backend's cache by slot (probed or split), checked by a round trip on scratch blocks."""
        if self.layout_kind == "learned":
            layout = LearnedBlockLayout.probe(self, layer, kv_cache)
        else:
            layout = SplitLayout(split_flash_attn, self.head_size)
        check_round_trip(self, layer, kv_cache, layout)
        return layout


@torch.no_grad()
def check_round_trip(impl, layer, kv_cache: torch.Tensor, layout) -> None:
    """Random entries written by the backend into two scratch blocks shaped like ``kv_cache`` read back by slot, and
    written again by the plugin one head at a time at other slots, read back the same."""
    from kvpress_critical_vllm.engine_config import EngineConfigError

    scratch = torch.zeros((2, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    block_size = kv_cache.shape[2]
    num_kv_heads = impl.num_kv_heads
    slots = torch.arange(2 * block_size, device=kv_cache.device).flip(0)
    generator = torch.Generator(device=kv_cache.device).manual_seed(0)
    shape = (slots.shape[0], num_kv_heads, impl.head_size)
    keys = torch.randn(shape, generator=generator, device=kv_cache.device).to(kv_cache.dtype)
    values = torch.randn(shape, generator=generator, device=kv_cache.device).to(kv_cache.dtype)
    impl.do_kv_cache_update(layer, keys, values, scratch, slots)
    got_keys, got_values = layout.read(scratch, slots)
    readable = torch.equal(got_keys, keys) and torch.equal(got_values, values)
    # the plugin's own writes (one head at a time) land where the backend's writes land
    moved = slots.roll(1)
    for head in range(num_kv_heads):
        layout.write(scratch, moved, slice(head, head + 1), keys[:, head : head + 1], values[:, head : head + 1])
    got_keys, got_values = layout.read(scratch, moved)
    writable = torch.equal(got_keys, keys) and torch.equal(got_values, values)
    if not (readable and writable):
        raise EngineConfigError(
            f"kvpress_critical cannot read this engine's paged KV cache back ({type(impl).__name__}, "
            f"{kv_cache.dtype}, shape {tuple(kv_cache.shape)}): entries the backend writes are not where the plugin "
            "reads them, so the plugin refuses to compress rather than select from wrong entries."
        )


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
