"""How a layer's paged cache stores keys and values: as the model's floats, or as fp8 codes over per-tensor scales.

vLLM's fp8 KV caches (``kv_cache_dtype`` ``fp8`` = ``fp8_e4m3``, ``fp8_e5m2``) hold one byte per element: the code of
``key / k_scale`` (``value / v_scale``), with the layer's scales (1.0 in every engine the plugin serves: vLLM sets
others for quantized checkpoints only, which the plugin refuses; the unit tests cover other scales). The plugin
never re-quantizes: a compaction moves codes (a kept entry's bytes are unchanged), scoring reads them back as
``code * scale`` (:meth:`KVCodes.decode`, what vLLM's attention reads), and the head-wise attention reads the codes in
place with the same scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's fp8 cache dtypes -> the torch dtype of their codes ("fp8" is e4m3, vLLM's default)
FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class KVCodes:
    """One layer's cache format: ``cache_dtype`` as vLLM names it (``auto``: the model's floats) and its scales."""

    cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def code_dtype(self) -> torch.dtype | None:
        """The torch dtype of the codes (None: the cache holds the entries themselves)."""
        return FP8_FORMATS.get(self.cache_dtype)

    def codes(self, stored: torch.Tensor) -> torch.Tensor:
        """``stored`` (the cache's bytes, or a view of them) as codes of :attr:`code_dtype`; unchanged for floats."""
        code = self.code_dtype
        if code is None or stored.dtype == code:
            return stored
        if stored.dtype != torch.uint8:
            raise ValueError(f"a {self.cache_dtype} cache stores bytes (uint8), not {stored.dtype}")
        return stored.view(code)

    def decode(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values read from the cache (its own dtype) as entries of ``dtype``: ``code * scale`` in float32,
        then ``dtype``; a float cache's entries as they are."""
        if self.code_dtype is None:
            return keys, values
        keys = self.codes(keys).float().mul_(self.k_scale).to(dtype)
        values = self.codes(values).float().mul_(self.v_scale).to(dtype)
        return keys, values
