"""The ``"cpp"`` backend of ``projected_value_norm``: the C++ extension's fused CPU kernel.

The extension (``csrc/``, compiled on first use, see :mod:`kvpress_critical.ops.extension`) is a shared library
registering, through ``torch.library``:

- ``kvpress_critical::head_projected_norm(Tensor values, Tensor head_proj, str norm) -> Tensor`` and its
  ``.out`` overload (writes into ``out``, returns nothing): the mean over each KV head's query group of
  ``||values @ head_proj[h].T||_p``, with ``head_proj`` of shape ``(H, N, d)``
  (:func:`~kvpress_critical.ops.projected_value_norm.torch_backend.head_projections`);
- ``kvpress_critical::projected_value_norm(Tensor values, Tensor o_proj_weight, int num_attention_heads,
  str norm='l1') -> Tensor``: the same through a view of the ``o_proj`` weight (L2 is then exact but ``D``-wide;
  this backend uses the cached Gram factors instead).

The same operators run the CUDA kernels on CUDA tensors when the extension was compiled with them
(:mod:`.cuda_backend`).

Loading is lazy (first use or availability check) and never fails the import of the package: an extension that
cannot be compiled makes the backends unavailable with a message saying what is missing. Fake (meta)
implementations are registered so the operators trace under ``torch.compile``.
"""

import torch

from kvpress_critical.ops.extension import extension_state
from kvpress_critical.ops.projected_value_norm.torch_backend import head_projections


def projected_value_norm_cpp(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    Projected-value norm through the extension's fused kernel (CPU; the CUDA kernel for CUDA tensors).

    L1 reads ``o_proj_weight`` in place; L2 goes through the cached Gram factors (``d x d`` per head).

    Parameters
    ----------
    out : torch.Tensor, optional
        ``(B, H_kv, T)`` float32 tensor to write into (any strides); a new one is returned otherwise.
    """
    reason = extension_state().reason
    if reason is not None:
        raise RuntimeError(reason)
    proj = head_projections(o_proj_weight, num_attention_heads, norm)
    if out is None:
        return torch.ops.kvpress_critical.head_projected_norm(values, proj, norm)
    torch.ops.kvpress_critical.head_projected_norm.out(values, proj, norm, out=out)
    return out
