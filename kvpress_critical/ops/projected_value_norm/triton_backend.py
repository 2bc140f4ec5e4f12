"""The ``"triton"`` backend of ``projected_value_norm`` (layer 2 of 2): tile configuration, grid, launch.

Runs on CUDA tensors; with ``TRITON_INTERPRET=1`` also on CPU tensors through Triton's interpreter (slow: for tests and
debugging).

Tile configurations are a table keyed on the device (and on the operand width, since float32 ``ieee`` dots
need smaller tiles), rather than autotuning, so the first call does not benchmark and results are
deterministic. Under the Triton interpreter the largest tiles are fastest (numpy per block).
"""

import contextlib
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kvpress_critical.ops.projected_value_norm.torch_backend import head_projections
from kvpress_critical.ops.projected_value_norm.triton_kernel import get_kernel
from kvpress_critical.ops.triton_utils import interpreter_enabled


@dataclass(frozen=True)
class TileConfig:
    block_t: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int | None = None  # head_dim slice per dot; None: the whole (padded) head_dim at once


# (compute capability major, 16-bit operands) -> config; head_dim > 128 halves block_n (shared memory).
# Every GPU entry compiles without register spills (ptxas -v, sm_80 and sm_90, head_dim 64..256): checked by
# tests/ops/test_projected_value_norm.py::test_gpu_tiles_do_not_spill without a GPU. fp32 (and mixed) operands use
# FMA dots, whose operand tiles live in registers: they take the head dimension in slices of 8 (block_k); a whole
# 128-wide value tile spilled ~10 KB per thread on Hopper.
_GPU_CONFIGS = {
    (9, True): TileConfig(128, 128, 8, 3),  # Hopper: 228 KiB shared memory per SM
    (8, True): TileConfig(64, 128, 4, 3, block_k=64),  # Ampere / Ada (the whole 128-wide tile spilled 112 bytes)
    (9, False): TileConfig(64, 64, 8, 2, block_k=8),
    (8, False): TileConfig(64, 64, 8, 2, block_k=8),
}
_FALLBACK = {True: TileConfig(64, 64, 4, 2, block_k=64), False: TileConfig(64, 64, 8, 2, block_k=8)}
_INTERPRETER = TileConfig(64, 128, 1, 1)

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def gpu_tile_config(capability: tuple[int, int], sixteen_bit: bool, head_dim: int) -> TileConfig:
    """The tile configuration for a GPU of compute ``capability`` (table above), without needing the GPU."""
    major = capability[0]
    cfg = _GPU_CONFIGS.get((min(major, 9), sixteen_bit), _FALLBACK[sixteen_bit]) if major >= 8 else _FALLBACK[False]
    if head_dim > 128:
        cfg = replace(cfg, block_n=max(32, cfg.block_n // 2))
    return cfg


def pick_config(device: torch.device, sixteen_bit: bool, head_dim: int, tokens: int, features: int) -> TileConfig:
    """Tile configuration for ``device`` (table keyed on compute capability)."""
    if interpreter_enabled() or device.type != "cuda":
        # numpy does the work per block: no larger than the problem (padding is paid in full)
        return TileConfig(
            min(_INTERPRETER.block_t, max(16, triton.next_power_of_2(tokens))),
            min(_INTERPRETER.block_n, max(16, triton.next_power_of_2(features))),
            _INTERPRETER.num_warps,
            _INTERPRETER.num_stages,
        )
    return gpu_tile_config(torch.cuda.get_device_capability(device), sixteen_bit, head_dim)


def block_d(head_dim: int) -> int:
    """head_dim rounded up to a power of two (at least 16: the smallest dot)."""
    return max(16, triton.next_power_of_2(head_dim))


def _operands(values: torch.Tensor, proj: torch.Tensor) -> tuple:
    """(compute dtype, input precision) of the kernel's dot products."""
    if interpreter_enabled():
        # the interpreter multiplies the raw bits of bfloat16 dot operands (triton-lang/triton#11584): use fp32
        return tl.float32, "ieee"
    if values.dtype == proj.dtype and values.dtype in (torch.float16, torch.bfloat16):
        # tensor cores with fp32 accumulation (input_precision only matters for fp32 operands: Triton's default)
        return _TL_DTYPES[values.dtype], "tf32"
    # mixed or float32 operands (the fp32 Gram factors of L2 included): exact fp32 products, not tf32
    return tl.float32, "ieee"


def launch_head_projected_norm(
    values: torch.Tensor, proj: torch.Tensor, norm: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """
    ``out[b, kv, t] = mean over the group of ||values[b, kv, t] @ proj[h].T||_p`` with the Triton kernel.

    Parameters
    ----------
    values : torch.Tensor
        ``(B, H_kv, T, d)``, float16 / bfloat16 / float32, any strides.
    proj : torch.Tensor
        ``(H, N, d)`` per-head projections, any strides.
    norm : {"l1", "l2"}
    out : torch.Tensor, optional
        ``(B, H_kv, T)`` float32 to write into; allocated when None.
    """
    bsz, num_kv_heads, k_len, head_dim = values.shape
    heads, features, _ = proj.shape
    if out is None:
        out = torch.empty(bsz, num_kv_heads, k_len, dtype=torch.float32, device=values.device)
    if out.numel() == 0:
        return out
    if features == 0 or head_dim == 0:
        return out.zero_()
    compute_dtype, precision = _operands(values, proj)
    cfg = pick_config(values.device, compute_dtype != tl.float32, head_dim, k_len, features)
    grid = (triton.cdiv(k_len, cfg.block_t), bsz * num_kv_heads)
    width = block_d(head_dim)
    # Triton launches on the current device: make it the tensors' (values on cuda:1 would run on cuda:0)
    guard = torch.cuda.device(values.device) if values.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        get_kernel()[grid](
            values,
            proj,
            out,
            num_kv_heads,
            k_len,
            head_dim,
            features,
            heads // num_kv_heads,
            *values.stride(),
            *proj.stride(),
            *out.stride(),
            L1=norm == "l1",
            BLOCK_T=cfg.block_t,
            BLOCK_N=cfg.block_n,
            BLOCK_D=width,
            BLOCK_K=min(width, cfg.block_k or width),
            COMPUTE_DTYPE=compute_dtype,
            INPUT_PRECISION=precision,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out


def projected_value_norm_triton(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused Triton implementation; see :func:`kvpress_critical.projected_value_norm`. ``out``: optional buffer."""
    proj = head_projections(o_proj_weight, num_attention_heads, norm)
    return launch_head_projected_norm(values, proj, norm, out)
