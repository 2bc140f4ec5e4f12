"""The ``"flash"`` backend of the ragged attention: flash-attn 2's kernels over the compact layout, no copy of it.

- The packed context is exactly flash-attn's varlen layout: each (batch row, KV head) segment is one sequence with a
  single KV head, and its ``G`` query heads times ``q`` new tokens are that sequence's queries
  (``flash_attn_varlen_func``, ``cu_seqlens_k`` = the layout's offsets, non-causal: every context entry precedes the
  new tokens).
- The dense tail is an ordinary batch (``flash_attn_func``, causal, bottom-right aligned as flash-attn >= 2.1 does:
  query ``i`` sees tail positions ``<= tail_len - q + i``).
- The two softmax parts are merged with the log-sum-exp flash-attn returns (``return_attn_probs=True``).

flash-attn computes in fp16 / bf16 only (:func:`flash_supports`); ``auto`` falls back to Triton for fp32. Installed
with the ``flash`` extra (``pip install 'kvpress-critical[flash]'``, a CUDA GPU and a matching torch build needed).
"""

from __future__ import annotations

import torch

from kvpress_critical.ops.ragged_attention.layout import offsets_on

MIN_FLASH_VERSION = (2, 6)  # unpadded varlen log-sum-exp (nheads, total_q)


def flash_availability() -> str | None:
    """None when flash-attn is importable and a GPU is visible, else why not."""
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401
    except ImportError as e:
        return f"flash-attn is not installed ({e}): pip install 'kvpress-critical[flash]' on a machine with a CUDA GPU"
    if not torch.cuda.is_available():
        return "flash-attn needs a CUDA device and none is visible"
    if torch.cuda.get_device_capability() < (8, 0):
        capability = torch.cuda.get_device_capability()
        return f"flash-attn 2 needs an Ampere or newer GPU (compute capability >= 8.0), got {capability}"
    import flash_attn

    version = tuple(int(p) for p in flash_attn.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_FLASH_VERSION:
        # older releases return the varlen log-sum-exp padded to (batch, heads, max_seqlen_q)
        return f"flash-attn {flash_attn.__version__} is older than {'.'.join(map(str, MIN_FLASH_VERSION))}"
    return None


def flash_supports(query: torch.Tensor, keys: torch.Tensor) -> str | None:
    """flash-attn's input constraints: fp16 / bf16, one dtype, head_dim <= 256 and a multiple of 8, float entries."""
    if not isinstance(keys, torch.Tensor):
        return "flash-attn reads float entries, not quantized codes (the triton backend reads them)"
    if query.dtype not in (torch.float16, torch.bfloat16) or keys.dtype != query.dtype:
        return f"flash-attn computes in float16 / bfloat16 only (query {query.dtype}, cache {keys.dtype})"
    if query.shape[-1] > 256 or query.shape[-1] % 8:
        return f"flash-attn needs head_dim <= 256 and a multiple of 8, got {query.shape[-1]}"
    return None


def _lse_varlen(lse: torch.Tensor, heads: int, total: int) -> torch.Tensor:
    """flash-attn's varlen log-sum-exp as ``(total_q, heads)`` (2.x returns ``(heads, total_q)``)."""
    if lse.shape == (heads, total):
        return lse.transpose(0, 1)
    if lse.shape == (total, heads):
        return lse
    raise RuntimeError(f"unexpected softmax_lse shape {tuple(lse.shape)} from flash_attn_varlen_func")


def ragged_attention_flash(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale, max_seqlen=None):
    """See :func:`kvpress_critical.ops.ragged_attention`."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = tail_keys.shape[1]
    group = heads // num_kv_heads
    segments = bsz * num_kv_heads
    device = query.device
    parts = []  # (output (B, q, H, d) float32, lse (B, q, H) float32)
    cu = offsets_on(cu_seqlens, device, torch.int32)
    lengths = cu[1:] - cu[:-1]
    if keys.shape[0] > 0:
        # queries per segment: (S * q, G, d), sequence s = b * H_kv + h, its G heads, its q tokens
        q_var = query.view(bsz, num_kv_heads, group, q_len, head_dim).permute(0, 1, 3, 2, 4)
        q_var = q_var.reshape(segments * q_len, group, head_dim)
        cu_q = torch.arange(0, segments + 1, device=device, dtype=torch.int32) * q_len
        max_k = int(lengths.max()) if max_seqlen is None else int(max_seqlen)
        out, lse, _ = flash_attn_varlen_func(
            q_var,
            keys.unsqueeze(1),
            values.unsqueeze(1),
            cu_q,
            cu,
            q_len,
            max_k,
            softmax_scale=scale,
            causal=False,
            return_attn_probs=True,
        )
        lse = _lse_varlen(lse, group, segments * q_len).float()  # (S * q, G)
        empty = (lengths == 0).repeat_interleave(q_len).unsqueeze(-1)  # segments without context entries
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.float().masked_fill(empty.unsqueeze(-1), 0.0)
        out = (
            out.view(bsz, num_kv_heads, q_len, group, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(bsz, q_len, heads, head_dim)
        )
        lse = lse.view(bsz, num_kv_heads, q_len, group).permute(0, 2, 1, 3).reshape(bsz, q_len, heads)
        parts.append((out, lse))
    if tail_len:
        out, lse, _ = flash_attn_func(
            query.transpose(1, 2),
            tail_keys[:, :, :tail_len].transpose(1, 2),
            tail_values[:, :, :tail_len].transpose(1, 2),
            softmax_scale=scale,
            causal=True,
            return_attn_probs=True,
        )
        lse = lse.float().transpose(1, 2)  # (B, H, q) -> (B, q, H)
        # a query that sees no tail position (tail_len < q) has an empty causal row
        visible = (tail_len - q_len + torch.arange(q_len, device=device)) >= 0
        lse = lse.masked_fill(~visible.view(1, q_len, 1), float("-inf"))
        parts.append((out.float().masked_fill(~visible.view(1, q_len, 1, 1), 0.0), lse))
    if not parts:
        return torch.zeros(bsz, q_len, heads, head_dim, dtype=query.dtype, device=device)
    peak = torch.stack([lse for _, lse in parts]).amax(0)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weights = [torch.exp(lse - peak) for _, lse in parts]
    total = sum(weights)
    result = sum(w.unsqueeze(-1) * out for w, (out, _) in zip(weights, parts)) / total.clamp_min(1e-30).unsqueeze(-1)
    return torch.where(total.unsqueeze(-1) > 0, result, torch.zeros_like(result)).to(query.dtype)
