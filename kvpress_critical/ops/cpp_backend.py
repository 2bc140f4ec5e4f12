"""The ``"cpp"`` (CPU) and ``"cuda"`` backends: the ``kvpress_critical::*`` operators of the C++/CUDA extension.

The extension (``csrc/``, built by ``make build``, see :mod:`kvpress_critical.ops.build_extension`) is a shared
library registering, through ``torch.library``:

- ``kvpress_critical::head_projected_norm(Tensor values, Tensor head_proj, str norm) -> Tensor`` and its
  ``.out`` overload (writes into ``out``, returns nothing): the mean over each KV head's query group of
  ``||values @ head_proj[h].T||_p``, with ``head_proj`` of shape ``(H, N, d)``
  (:func:`~kvpress_critical.ops.torch_backend.head_projections`);
- ``kvpress_critical::projected_value_norm(Tensor values, Tensor o_proj_weight, int num_attention_heads,
  str norm='l1') -> Tensor``: the same through a view of the ``o_proj`` weight (L2 is then exact but ``D``-wide;
  the backends below use the cached Gram factors instead).

Loading is lazy (first use or availability check) and never fails the import of the package: a missing, stale
or mismatched library makes the backends unavailable with a message saying how to rebuild it. Fake (meta)
implementations are registered so the operators trace under ``torch.compile``.
"""

import json
import logging
from dataclasses import dataclass

import torch

from kvpress_critical.ops import build_extension as ext
from kvpress_critical.ops.torch_backend import head_projections

logger = logging.getLogger(__name__)

BUILD_HINT = "run `make build` (or `python kvpress_critical/ops/build_extension.py`)"


@dataclass
class _ExtensionState:
    reason: str | None  # None when loaded
    cuda: bool = False  # whether the CUDA kernels were compiled in


_STATE: _ExtensionState | None = None


def _register_fakes() -> None:
    @torch.library.register_fake("kvpress_critical::head_projected_norm")
    def _head_projected_norm_fake(values, head_proj, norm):
        return values.new_empty(values.shape[:3], dtype=torch.float32)

    @torch.library.register_fake("kvpress_critical::head_projected_norm.out")
    def _head_projected_norm_out_fake(values, head_proj, norm, *, out):
        return None


def _load() -> _ExtensionState:
    if not ext.LIB_PATH.exists():
        return _ExtensionState(f"the C++ extension is not built: {BUILD_HINT}")
    try:
        info = json.loads(ext.INFO_PATH.read_text())
    except (OSError, ValueError):
        return _ExtensionState(f"the C++ extension has no readable build_info.json: {BUILD_HINT}")
    if info.get("torch") != torch.__version__:
        return _ExtensionState(
            f"the C++ extension was built for torch {info.get('torch')} but torch {torch.__version__} is installed: "
            f"{BUILD_HINT}"
        )
    current = ext.sources_hash()
    if current is not None and info.get("sources_sha256") != current:
        return _ExtensionState(f"the C++ extension was built from older sources in csrc/: {BUILD_HINT}")
    try:
        torch.ops.load_library(str(ext.LIB_PATH))
    except (OSError, RuntimeError) as e:
        return _ExtensionState(f"the C++ extension failed to load ({e}): {BUILD_HINT}")
    _register_fakes()
    logger.debug("loaded %s (cuda=%s)", ext.LIB_PATH, info.get("cuda"))
    return _ExtensionState(None, cuda=bool(info.get("cuda")))


def extension_state() -> _ExtensionState:
    """Load the extension once per process and remember the outcome."""
    global _STATE
    if _STATE is None:
        _STATE = _load()
    return _STATE


def cpp_availability() -> str | None:
    """None when the CPU operators are loaded, else why not and how to fix it."""
    return extension_state().reason


def cuda_availability() -> str | None:
    """None when the CUDA operators are loaded and a GPU is visible, else why not and how to fix it."""
    state = extension_state()
    if state.reason is not None:
        return state.reason
    if not state.cuda:
        return (
            "the C++ extension was built without CUDA: on a machine with nvcc and a CUDA build of torch, run "
            "`make build KVPRESS_CRITICAL_BUILD_CUDA=1`"
        )
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def projected_value_norm_ext(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    Projected-value norm through the extension's fused kernel (CPU or CUDA, by the tensors' device).

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
