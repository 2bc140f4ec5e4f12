"""Quantized context entries of ``ragged_attention``: integer codes and float32 scales, read as they are by kernels.

Two ways of grouping the elements that share a scale:

- **per entry** (``groups is None``): each packed key or value ``x`` (a ``d``-vector) has its own scale ``s``
  (``scales``: ``(N,)``);
- **per channel** (``groups``: ``(N,)`` int32): the entries of a group (consecutive entries of one segment, KIVI's
  key grouping) share one scale per channel (``scales``: ``(G, d)``, row ``groups[i]`` for entry ``i``).

and two kinds of code:

- **symmetric** (``zeros is None``): ``x ~ q s`` with ``q = round(x / s)``, ``s = max|x| / Q`` (``Q = 127`` for 8
  bits, ``7`` for 4), so ``|x - q s| <= s / 2``; int8 codes, or int4 codes stored offset by 8;
- **asymmetric** (``zeros``, the same shape as ``scales``): ``x ~ z + q s`` with ``z = min x``,
  ``s = (max x - min x) / (2^b - 1)``, ``q = round((x - z) / s)`` in ``0 .. 2^b - 1`` (unsigned codes), so
  ``|x - (z + q s)| <= s / 2``.

4-bit codes are stored two per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high one). The formats of
:class:`~kvpress_critical.CompactCachePress` (:data:`FORMATS`):

- ``"int8"`` / ``"int4"``: keys and values symmetric, per entry: ``N (d + 4)`` bytes per tensor in int8,
  ``N (ceil(d / 2) + 4)`` in int4, against ``2 N d`` in bf16 and ``4 N d`` in float32;
- ``"kivi4"``: KIVI's layout (arXiv 2402.02750) at 4 bits: keys asymmetric per channel over groups of
  :data:`KIVI_GROUP` consecutive entries of a head (keys have outlier channels, which a per-entry scale spreads over
  every element), values asymmetric per entry; the recent tokens (the compact layout's tail) stay in the model's
  dtype. ``N (ceil(d / 2) + 4) + 8 d G`` bytes for the keys (``G`` groups), ``N (ceil(d / 2) + 8)`` for the values.

The kernels dequantize an entry in registers, ``float(q) * s (+ z)`` in float32, exactly the value
:meth:`QuantizedEntries.dequantize` gives, so the float64 reference over the dequantized entries is the
specification of the quantized attention too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Bits of a symmetric code -> the largest code magnitude.
LEVELS = {8: 127, 4: 7}
#: Entries of a head sharing one scale per channel in KIVI's key layout.
KIVI_GROUP = 32


@dataclass(frozen=True)
class CodeSpec:
    """How one tensor (keys or values) of a format is quantized."""

    bits: int
    symmetric: bool = True
    per_channel: bool = False  # groups of KIVI_GROUP consecutive entries of a segment share a scale per channel


#: Names of the formats (``CompactCachePress(quantize=...)``) -> (keys, values).
FORMATS = {
    "int8": (CodeSpec(8), CodeSpec(8)),
    "int4": (CodeSpec(4), CodeSpec(4)),
    "kivi4": (CodeSpec(4, symmetric=False, per_channel=True), CodeSpec(4, symmetric=False)),
}


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, d) values in 0..15 -> (N, ceil(d / 2)) uint8, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack(codes: torch.Tensor, bits: int, dim: int, symmetric: bool) -> torch.Tensor:
    """The integer codes as float32 ``(N, dim)`` (offset removed for symmetric 4-bit codes)."""
    if bits == 8:
        return codes.float()
    low, high = (codes & 0x0F).to(torch.int16), (codes >> 4).to(torch.int16)
    values = torch.stack([low, high], dim=-1).reshape(codes.shape[0], 2 * codes.shape[1])[:, :dim]
    return (values - 8 if symmetric else values).float()


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """
    ``(codes, scales)`` of the rows of ``x`` (``(N, d)``, any float dtype), symmetric, one scale per row.

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
    return (codes, scales) if bits == 8 else (_pack_nibbles(codes + 8), scales)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, bits: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``(N, dim)`` rows :func:`quantize_rows` encoded: ``float(code) * scale`` in float32, then ``dtype``."""
    return (_unpack(codes, bits, dim, True) * scales.unsqueeze(-1)).to(dtype)


def quantization_error_bound(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``(N,)`` the largest ``|x - dequantize(quantize(x))|`` of each row (symmetric, per row): half its scale, plus
    float32 rounding."""
    scales = x.float().abs().amax(-1) / LEVELS[bits]
    return scales / 2 * (1 + 2**-20) + torch.finfo(torch.float32).tiny


def _asymmetric(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsigned codes, scales and zeros of ``x`` reduced over ``dim`` (keepdim)."""
    top = 2**bits - 1
    zeros = x.amin(dim, keepdim=True)
    scales = (x.amax(dim, keepdim=True) - zeros) / top
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round((x - zeros) / scales).clamp_(0, top)
    return codes, scales, zeros


def channel_groups(cu_seqlens: torch.Tensor, group: int = KIVI_GROUP) -> torch.Tensor:
    """``(N,)`` int32: the group of every packed entry, groups of ``group`` consecutive entries of a segment (the
    last one of a segment shorter)."""
    offsets = [int(x) for x in cu_seqlens.tolist()]
    parts, first = [], 0
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        parts.append(first + torch.arange(hi - lo, dtype=torch.int32) // group)
        first += -(-(hi - lo) // group)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


@dataclass(frozen=True)
class QuantizedEntries:
    """
    ``N`` packed entries of ``head_dim`` elements as codes and scales (module docstring); what ``ragged_attention``
    takes in place of a float ``(N, d)`` tensor.

    Attributes
    ----------
    codes : torch.Tensor
        int8 ``(N, d)`` (8 bits, symmetric), uint8 ``(N, d)`` (8 bits, asymmetric) or uint8 ``(N, ceil(d / 2))``
        (4 bits), rows contiguous.
    scales : torch.Tensor
        float32 ``(N,)`` per entry, or ``(G, d)`` per channel of each group.
    bits : int
        8 or 4.
    head_dim : int
        ``d``.
    zeros : torch.Tensor, optional
        float32, the shape of ``scales``: asymmetric codes (``x ~ zero + code * scale``); None: symmetric.
    groups : torch.Tensor, optional
        int32 ``(N,)``: the row of ``scales`` (and ``zeros``) of every entry, for per-channel scales.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    head_dim: int
    zeros: torch.Tensor | None = None
    groups: torch.Tensor | None = None

    def __post_init__(self):
        if self.bits not in LEVELS:
            raise ValueError(f"bits must be one of {sorted(LEVELS)}, got {self.bits!r}")
        width = self.head_dim if self.bits == 8 else (self.head_dim + 1) // 2
        dtype = torch.int8 if self.bits == 8 and self.symmetric else torch.uint8
        if self.codes.dim() != 2 or self.codes.shape[1] != width or self.codes.dtype != dtype:
            raise ValueError(
                f"{self.bits}-bit codes of {self.head_dim} elements must be {dtype} (N, {width}), got "
                f"{self.codes.dtype} {tuple(self.codes.shape)}"
            )
        n = self.codes.shape[0]
        expected = (n,) if self.groups is None else (self.scales.shape[0], self.head_dim)
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != expected:
            raise ValueError(f"scales must be float32 {expected}, got {self.scales.dtype} {tuple(self.scales.shape)}")
        if self.zeros is not None and (self.zeros.shape != self.scales.shape or self.zeros.dtype != torch.float32):
            raise ValueError(f"zeros must be float32 of the scales' shape {tuple(self.scales.shape)}")
        if self.groups is not None and (self.groups.shape != (n,) or self.groups.dtype != torch.int32):
            raise ValueError(f"groups must be int32 ({n},), got {self.groups.dtype} {tuple(self.groups.shape)}")
        tensors = [t for t in (self.codes, self.scales, self.zeros, self.groups) if t is not None]
        if len({t.device for t in tensors}) != 1:
            raise ValueError(f"codes, scales, zeros and groups on different devices: {[t.device for t in tensors]}")

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def per_channel(self) -> bool:
        return self.groups is not None

    @property
    def spec(self) -> CodeSpec:
        """How these entries are quantized."""
        return CodeSpec(self.bits, self.symmetric, self.per_channel)

    @classmethod
    def quantize(
        cls, x: torch.Tensor, bits: int, symmetric: bool = True, cu_seqlens: torch.Tensor | None = None
    ) -> QuantizedEntries:
        """
        The codes of the rows of ``x`` (``(N, d)``): per entry, or, with ``cu_seqlens`` (the segments of the packed
        layout), per channel over groups of :data:`KIVI_GROUP` consecutive entries of a segment.
        """
        if bits not in LEVELS:
            raise ValueError(f"bits must be one of {sorted(LEVELS)}, got {bits!r}")
        x = x.float()
        if cu_seqlens is None and symmetric:
            codes, scales = quantize_rows(x, bits)
            return cls(codes.contiguous(), scales.contiguous(), bits, x.shape[-1])
        if cu_seqlens is None:  # asymmetric, per entry
            codes, scales, zeros = _asymmetric(x, bits, -1)
            scales, zeros, groups = scales.squeeze(-1), zeros.squeeze(-1), None
        else:  # per channel over groups of consecutive entries of a segment
            if symmetric:
                raise ValueError("per-channel scales are asymmetric (KIVI's key layout)")
            groups = channel_groups(cu_seqlens).to(x.device)
            n_groups = int(groups.max()) + 1 if groups.numel() else 0
            index = groups.long().unsqueeze(-1).expand_as(x)
            high = torch.full((n_groups, x.shape[1]), -torch.inf, device=x.device).scatter_reduce(0, index, x, "amax")
            zeros = torch.full((n_groups, x.shape[1]), torch.inf, device=x.device).scatter_reduce(0, index, x, "amin")
            scales = (high - zeros) / (2**bits - 1)
            scales = torch.where(scales > 0, scales, torch.ones_like(scales))
            codes = torch.round((x - zeros[groups.long()]) / scales[groups.long()]).clamp_(0, 2**bits - 1)
        codes = codes.to(torch.uint8) if bits == 8 else _pack_nibbles(codes)
        return cls(codes.contiguous(), scales.contiguous(), bits, x.shape[-1], zeros.contiguous(), groups)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(N, d)``: ``float(code) * scale (+ zero)`` in float32, then ``dtype``."""
        values = _unpack(self.codes, self.bits, self.head_dim, self.symmetric)
        if self.groups is None:
            out = values * self.scales.unsqueeze(-1)
            zeros = None if self.zeros is None else self.zeros.unsqueeze(-1)
        else:
            rows = self.groups.long()
            out = values * self.scales[rows]
            zeros = None if self.zeros is None else self.zeros[rows]
        return (out if zeros is None else out + zeros).to(dtype)

    def error_bound(self) -> torch.Tensor:
        """``(N, d)`` the largest ``|x - dequantize()|`` of every element of the entries this encodes: half its scale
        (plus float32 rounding of the dequantization)."""
        scales = self.scales.unsqueeze(-1) if self.groups is None else self.scales[self.groups.long()]
        scales = scales.expand(self.codes.shape[0], self.head_dim)
        return scales / 2 * (1 + 2**-20) + 2**-23 * self.dequantize().abs() + torch.finfo(torch.float32).tiny

    def __getitem__(self, rows: slice) -> QuantizedEntries:
        """The entries ``rows`` (a slice: views, nothing copied; per-channel scales are shared, not sliced)."""
        if not isinstance(rows, slice):
            raise TypeError("QuantizedEntries are sliced by rows only (entries[lo:hi])")
        if self.groups is not None:
            return QuantizedEntries(
                self.codes[rows], self.scales, self.bits, self.head_dim, self.zeros, self.groups[rows]
            )
        zeros = None if self.zeros is None else self.zeros[rows]
        return QuantizedEntries(self.codes[rows], self.scales[rows], self.bits, self.head_dim, zeros)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.head_dim

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.zeros, self.groups)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to(self, device) -> QuantizedEntries:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedEntries(
            move(self.codes), move(self.scales), self.bits, self.head_dim, move(self.zeros), move(self.groups)
        )


def quantize_entries(x: torch.Tensor, spec: CodeSpec, cu_seqlens: torch.Tensor) -> QuantizedEntries:
    """The packed entries ``x`` (``(N, d)``, segments ``cu_seqlens``) quantized as ``spec`` says."""
    return QuantizedEntries.quantize(x, spec.bits, spec.symmetric, cu_seqlens if spec.per_channel else None)
