"""How the plugin reads and writes a backend's paged KV cache, and the head-wise layout's own blocks.

A backend stores ``[blocks, ..., block_size, ..., head_dim]`` in its own in-block order: :class:`SplitLayout` reads
flash-attn's split of keys and values, :class:`LearnedBlockLayout` learns ``CPU_ATTN``'s (keys dimension-major for
its vector kernels) from the backend's own writes; both read and write a KV head's entries by slot, and give the
element offsets of every key and value inside a block (the tail of a head-wise request is read through them).
:func:`check_round_trip` verifies a layout at start-up. A compacted head-wise request's region is whole blocks read
as rows of keys then values (:func:`region_views`): blocks only the plugin's kernel reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpress_critical_vllm.kv_codes import KVCodes


def block_memory(kv_cache: torch.Tensor) -> torch.Tensor:
    """
    ``(blocks, block elements)``: each block of a ``[blocks, ...]`` paged cache as the run of memory it occupies, in
    memory order (a backend may order a block's dimensions in memory unlike its logical view, as flash-attn's
    ``NHD`` layout does). Element offsets inside a block (:func:`strided_offsets`) index this view.
    """
    sizes, strides = kv_cache.shape[1:], kv_cache.stride()[1:]
    expected = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda pair: pair[1]):
        if size > 1 and stride != expected:
            raise ValueError(
                f"the head-wise layout needs each KV block dense in memory; this cache's blocks have shape "
                f"{tuple(sizes)} and strides {tuple(strides)}"
            )
        expected *= size
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) != expected:
        raise ValueError(
            f"the head-wise layout needs KV blocks one after another; the block stride is {kv_cache.stride(0)}"
        )
    return kv_cache.as_strided((kv_cache.shape[0], expected), (expected, 1), kv_cache.storage_offset())


def region_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """
    ``(blocks, R, d)`` key and value rows of every block of a ``[blocks, H_kv, block_size, 2 d]`` cache,
    ``R = block_size * H_kv``: a block's memory read as keys then values, the head-wise layout's own order
    (:mod:`kvpress_critical.ops.paged_ragged_attention`). Only blocks that hold a compacted region are read this way;
    every other block keeps the backend's order.
    """
    memory = block_memory(kv_cache)
    num_kv_heads, block_size, width = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    rows = num_kv_heads * block_size
    halves = memory.view(memory.shape[0], 2, rows, width // 2)
    return halves[:, 0], halves[:, 1]


def strided_offsets(view: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``(H_kv, block_size, d)`` element offsets, from the start of a block of ``base``, of the ``[block, slot, head,
    dim]`` view ``view`` (a split of ``base``)."""
    _, block_size, num_kv_heads, head_size = view.shape
    heads = torch.arange(num_kv_heads)[:, None, None] * view.stride(2)
    slots = torch.arange(block_size)[None, :, None] * view.stride(1)
    dims = torch.arange(head_size)[None, None, :] * view.stride(3)
    return heads + slots + dims + (view.storage_offset() - base.storage_offset())


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

    def tail_offsets(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(H_kv, block_size, d)`` element offsets of each key and value inside a block, from the split's strides."""
        key_cache, value_cache = self.split(kv_cache, self.head_size)
        return strided_offsets(key_cache, kv_cache), strided_offsets(value_cache, kv_cache)

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
    def probe(
        cls, impl, layer, kv_cache: torch.Tensor, codes: KVCodes | None = None, dtype: torch.dtype | None = None
    ) -> "LearnedBlockLayout":
        """Write slot and dim numbers through ``impl.do_kv_cache_update`` into a scratch block; see where they land.

        Numbers go in base-8 digits written as 1 .. 8 (exact in every dtype the cache may hold, fp8 codes included,
        with the layer's fp8 scales seen as 1.0: :class:`~kvpress_critical_vllm.vllm_compat.UnitScales`); 0 marks a
        storage offset the backend left unwritten. ``dtype``: the entries' dtype as the model hands them to the
        backend (the cache's own by default)."""
        from kvpress_critical_vllm.vllm_compat import UnitScales

        codes = codes or KVCodes()
        _, num_kv_heads, block_size, width = kv_cache.shape
        head_size = width // 2
        if max(block_size, head_size) > 512:
            raise ValueError("layout probe: block_size and head_size must be <= 512 (three base-8 digits)")
        dtype = dtype or kv_cache.dtype
        slots = torch.arange(block_size, device=kv_cache.device)
        seen = []
        for code in ("slot", "dim"):
            numbers = torch.arange(block_size if code == "slot" else head_size, device=kv_cache.device)
            found = torch.zeros(block_size * width, dtype=torch.long, device=kv_cache.device)
            for place in (1, 8, 64):
                digits = (numbers // place) % 8 + 1
                shape = (block_size, num_kv_heads, head_size)
                entries = (digits[:, None, None] if code == "slot" else digits[None, None, :]).expand(shape)
                entries = entries.to(dtype).contiguous()
                scratch = torch.zeros((1, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
                writer = UnitScales(layer) if codes.code_dtype is not None else layer
                impl.do_kv_cache_update(writer, entries, entries, scratch, slots)
                stored = codes.codes(scratch[0, 0].reshape(-1)).float().round().long()  # one block-head's storage
                if bool((stored < 1).any()):
                    raise ValueError("layout probe: the backend left part of a block-head unwritten")
                found += (stored - 1) * place
            seen.append(found)
        slot_of, dim_of = seen
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

    def tail_offsets(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(H_kv, block_size, d)`` element offsets of each key and value inside a block (the learned ones)."""
        _, num_kv_heads, block_size, width = kv_cache.shape
        heads = torch.arange(num_kv_heads, device=kv_cache.device)[:, None, None] * block_size * width
        return heads + self.key_offsets[None], heads + self.value_offsets[None]

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice = slice(None)):
        """``(n, h, d)`` keys and values of KV heads ``heads`` at the flat ``slots`` (``block * bs + offset``)."""
        flat, index, key_offsets, value_offsets = self._index(kv_cache, slots, heads)
        return flat[(*index, key_offsets)], flat[(*index, value_offsets)]

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, heads: slice, keys, values) -> None:
        """Store ``(n, h, d)`` keys and values of KV heads ``heads`` at the flat ``slots`` (other heads untouched)."""
        flat, index, key_offsets, value_offsets = self._index(kv_cache, slots, heads)
        flat[(*index, key_offsets)] = keys.to(flat.dtype)
        flat[(*index, value_offsets)] = values.to(flat.dtype)


def _read_back(stored: torch.Tensor, written: torch.Tensor, codes: KVCodes, scale: float) -> bool:
    """Whether ``stored`` (read from the cache) is ``written``: equal for a float cache; for fp8 codes, their entries
    within one step of the format's mantissa of what was written (the backend rounds; a misplaced entry is another
    random number, which fails the bound with near certainty over hundreds of elements)."""
    if codes.code_dtype is None:
        return torch.equal(stored, written)
    decoded = codes.codes(stored).float() * scale
    mantissa = torch.finfo(codes.code_dtype).eps  # 2^-3 (e4m3), 2^-2 (e5m2)
    bound = written.float().abs() * mantissa + torch.finfo(codes.code_dtype).smallest_normal * scale
    return bool(((decoded - written.float()).abs() <= bound).all())


@torch.no_grad()
def check_round_trip(
    impl, layer, kv_cache: torch.Tensor, layout, codes: KVCodes | None = None, dtype: torch.dtype | None = None
) -> None:
    """Random entries (of ``dtype``, the model's) written by the backend into two scratch blocks shaped like
    ``kv_cache`` read back by slot (fp8 codes: within their rounding, with the layer's scales ``codes``), and the
    stored bytes written again by the plugin one head at a time at other slots, read back unchanged."""
    from kvpress_critical_vllm.engine_config import EngineConfigError

    codes = codes or KVCodes()
    dtype = dtype or kv_cache.dtype
    scratch = torch.zeros((2, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    block_size = kv_cache.shape[2]
    num_kv_heads = impl.num_kv_heads
    slots = torch.arange(2 * block_size, device=kv_cache.device).flip(0)
    generator = torch.Generator(device=kv_cache.device).manual_seed(0)
    shape = (slots.shape[0], num_kv_heads, impl.head_size)
    keys = (torch.randn(shape, generator=generator, device=kv_cache.device) * codes.k_scale).to(dtype)
    values = (torch.randn(shape, generator=generator, device=kv_cache.device) * codes.v_scale).to(dtype)
    impl.do_kv_cache_update(layer, keys, values, scratch, slots)
    stored_keys, stored_values = layout.read(scratch, slots)
    readable = _read_back(stored_keys, keys, codes, codes.k_scale) and _read_back(
        stored_values, values, codes, codes.v_scale
    )
    # the plugin's own writes (one head at a time) land where the backend's writes land, bytes unchanged
    moved = slots.roll(1)
    for head in range(num_kv_heads):
        heads = slice(head, head + 1)
        layout.write(scratch, moved, heads, stored_keys[:, heads], stored_values[:, heads])
    got_keys, got_values = layout.read(scratch, moved)
    writable = torch.equal(got_keys.view(torch.uint8), stored_keys.view(torch.uint8)) and torch.equal(
        got_values.view(torch.uint8), stored_values.view(torch.uint8)
    )
    if not (readable and writable):
        raise EngineConfigError(
            f"kvpress_critical cannot read this engine's paged KV cache back ({type(impl).__name__}, "
            f"{kv_cache.dtype}{'' if codes.code_dtype is None else ' holding ' + codes.cache_dtype + ' codes'}, "
            f"shape {tuple(kv_cache.shape)}): entries the backend writes are not where the plugin reads them, so the "
            "plugin refuses to compress rather than select from wrong entries."
        )
