"""``projected_value_norm``: the one op of CriticalKV's scores, and the single place where its backend is chosen.

The folder holds the op whole: :mod:`.naive` (the float64 reference and the error bound backends are tested
within), :mod:`.torch_backend` (plain PyTorch, any device), :mod:`.cpp_backend` (the C++ extension on CPU),
:mod:`.cuda_backend` (its CUDA kernels), :mod:`.triton_backend` with :mod:`.triton_kernel` (Triton), and this
dispatch.

Backends live in :data:`PROJECTED_VALUE_NORM` (an :class:`~kvpress_critical.ops.registry.OpRegistry`) and are picked by
:func:`projected_value_norm`: explicitly by name (an unavailable backend is an error that says how to get it), or
``"auto"``: the first available backend in :data:`AUTO_ORDER` for the tensor's device, with one warning when a
preferred backend is missing. ``$KVPRESS_CRITICAL_PROJECTED_VALUE_NORM_BACKEND`` replaces ``"auto"``.
"""

import torch

from kvpress_critical.ops.extension import cpp_availability, cuda_availability
from kvpress_critical.ops.projected_value_norm.cpp_backend import projected_value_norm_cpp
from kvpress_critical.ops.projected_value_norm.cuda_backend import projected_value_norm_cuda
from kvpress_critical.ops.projected_value_norm.naive import projected_value_norm_error_bound, projected_value_norm_ref
from kvpress_critical.ops.projected_value_norm.torch_backend import projected_value_norm_torch
from kvpress_critical.ops.registry import Backend, OpRegistry
from kvpress_critical.ops.triton_utils import triton_availability, triton_devices

NORMS = ("l1", "l2")

#: Preference order of ``backend="auto"`` per device type; names not registered are skipped silently.
# CUDA: Triton first. Neither GPU kernel has been measured on a GPU yet; a review of the compiled code estimates the
# CUDA extension's WMMA kernel at 15-25% of the bf16 tensor-core peak (generic loads, synchronous projection tiles),
# while Triton's dots compile to the architecture's MMA instructions with pipelined loads. benchmarks/gpu_check.sh
# measures both: revise this order from its numbers.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "cuda", "torch"),
    "cpu": ("cpp", "torch"),
}

PROJECTED_VALUE_NORM = OpRegistry("projected_value_norm", AUTO_ORDER, legacy_env_var="KVPRESS_CRITICAL_BACKEND")


def _check_inputs(values: torch.Tensor, o_proj_weight: torch.Tensor, num_attention_heads: int, norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if values.dim() != 4:
        raise ValueError(f"values must be (batch, kv_heads, tokens, head_dim), got shape {tuple(values.shape)}")
    if o_proj_weight.dim() != 2:
        raise ValueError(f"o_proj_weight must be (hidden, heads * head_dim), got shape {tuple(o_proj_weight.shape)}")
    if not values.is_floating_point() or not o_proj_weight.is_floating_point():
        raise TypeError(
            f"values and o_proj_weight must be floating point, got {values.dtype} and {o_proj_weight.dtype}; "
            "dequantize a quantized o_proj first (kvpress_critical.modeling.dense_linear_weight)"
        )
    num_kv_heads, head_dim = values.shape[1], values.shape[3]
    if num_attention_heads <= 0 or num_kv_heads == 0 or num_attention_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a positive multiple of the number of KV heads "
            f"in values ({num_kv_heads})"
        )
    if o_proj_weight.shape[1] != num_attention_heads * head_dim:
        raise ValueError(
            f"o_proj_weight has {o_proj_weight.shape[1]} input features but num_attention_heads * head_dim = "
            f"{num_attention_heads} * {head_dim} = {num_attention_heads * head_dim}; pass the weight as stored in "
            "nn.Linear, shape (hidden, heads * head_dim)"
        )
    if values.device != o_proj_weight.device:
        raise ValueError(f"values are on {values.device} but o_proj_weight is on {o_proj_weight.device}")


def projected_value_norm(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
    backend: str = "auto",
) -> torch.Tensor:
    """
    Norm of the projected values ``||V_i W_O^h||`` averaged over each KV head's query group.

    This is the ``N_i`` of CriticalKV (arXiv 2502.03805, section 3): with GQA, the score of a KV head is the mean
    over the query heads ``h`` of its group of ``||V_i W_O^h||_p``, where
    ``W_O^h = o_proj.weight[:, h*d:(h+1)*d].T``. Accumulated and returned in float32 whatever the
    input dtype; ``V W_O`` is never materialised beyond one bounded tile.

    Parameters
    ----------
    values : torch.Tensor
        ``(B, H_kv, T, d)`` cached values, any floating dtype, any strides.
    o_proj_weight : torch.Tensor
        ``(D, H * d)`` output-projection weight as stored in ``nn.Linear``.
    num_attention_heads : int
        Number of query heads ``H``.
    norm : {"l1", "l2"}
        ``"l1"`` (the paper's choice) or ``"l2"`` (exact, through cached Gram factors, ``D/d`` times cheaper).
    backend : str
        ``"auto"`` or a name from ``PROJECTED_VALUE_NORM.available()``.

    Returns
    -------
    torch.Tensor
        ``(B, H_kv, T)`` float32.
    """
    _check_inputs(values, o_proj_weight, num_attention_heads, norm)
    name = PROJECTED_VALUE_NORM.resolve(backend, values.device)
    return PROJECTED_VALUE_NORM[name].fn(values, o_proj_weight, num_attention_heads, norm)


PROJECTED_VALUE_NORM.register(
    Backend(name="torch", fn=projected_value_norm_torch, devices=("cpu", "cuda"), availability=lambda: None)
)


def projected_value_norm_triton(values, o_proj_weight, num_attention_heads, norm="l1", out=None):
    """The Triton backend (imports triton on first use: :mod:`.triton_backend`)."""
    from kvpress_critical.ops.projected_value_norm.triton_backend import projected_value_norm_triton as triton_fn

    return triton_fn(values, o_proj_weight, num_attention_heads, norm, out)


PROJECTED_VALUE_NORM.register(
    Backend(name="cpp", fn=projected_value_norm_cpp, devices=("cpu",), availability=cpp_availability)
)
PROJECTED_VALUE_NORM.register(
    Backend(name="cuda", fn=projected_value_norm_cuda, devices=("cuda",), availability=cuda_availability)
)
PROJECTED_VALUE_NORM.register(
    Backend(name="triton", fn=projected_value_norm_triton, devices=triton_devices, availability=triton_availability)
)

__all__ = [
    "AUTO_ORDER",
    "NORMS",
    "PROJECTED_VALUE_NORM",
    "projected_value_norm",
    "projected_value_norm_error_bound",
    "projected_value_norm_ref",
]
