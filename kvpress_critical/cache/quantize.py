"""Per-token quantization of the compact layout's packed entries: int8 or int4 codes, one float32 scale per entry.

Each packed key or value ``x`` (a ``d``-vector) is stored as symmetric integer codes ``q = round(x / s)`` with
``s = max|x| / Q`` (``Q = 127`` for int8, ``7`` for int4), so ``|x - q s| <= s / 2`` element by element
(:func:`quantization_error_bound`). int4 codes are stored two per byte. A layer of ``N`` entries then holds
``N (d + 4)`` bytes per tensor in int8 and ``N (d / 2 + 4)`` in int4, against ``N d 2`` in bf16 and ``N d 4`` in
float32. The entries are dequantized for the attention of each step (:attr:`CompactLayer.packed_keys`).
"""

from __future__ import annotations

import torch

#: Bits of a code -> the largest code magnitude.
LEVELS = {8: 127, 4: 7}
#: The names :class:`~kvpress_critical.CompactCachePress` takes.
FORMATS = {"int8": 8, "int4": 4}


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """
    ``(codes, scales)`` of the rows of ``x`` (``(N, d)``, any float dtype).

    ``codes``: int8 ``(N, d)`` for 8 bits; uint8 ``(N, ceil(d / 2))`` for 4 bits (two codes a byte, offset by 8).
    ``scales``: float32 ``(N,)``.
    """
    if bits not in LEVELS:
        raise ValueError(f"bits must be one of {sorted(LEVELS)}, got {bits!r}")
    levels = LEVELS[bits]
    x = x.float()
    scales = x.abs().amax(-1) / levels
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(x / scales.unsqueeze(-1)).clamp_(-levels, levels).to(torch.int8)
    if bits == 8:
        return codes, scales
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    shifted = (codes + 8).to(torch.uint8)  # 1..15
    return shifted[:, 0::2] | (shifted[:, 1::2] << 4), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``(N, dim)`` rows :func:`quantize_rows` encoded, in ``dtype``."""
    if bits == 8:
        values = codes.float()
    else:
        low = (codes & 0x0F).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        values = torch.stack([low, high], dim=-1).reshape(codes.shape[0], -1)[:, :dim].float()
    return (values * scales.unsqueeze(-1)).to(dtype)


def quantization_error_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``(N,)`` the largest ``|x - dequantize(quantize(x))|`` of each row: half its scale (plus float32 rounding)."""
    scales = x.float().abs().amax(-1) / LEVELS[bits]
    return scales / 2 * (1 + 2**-20) + torch.finfo(torch.float32).tiny


def code_bytes(n: int, dim: int, bits: int) -> int:
    """Bytes of the codes and scales of ``n`` rows of ``dim`` elements."""
    per_row = dim if bits == 8 else (dim + 1) // 2
    return n * (per_row + 4)
