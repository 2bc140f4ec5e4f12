"""The ``"triton"`` backend of :func:`kvpress_critical.projected_value_norm` (layer 3 of 3: the wrapper).

Runs on CUDA tensors; with ``TRITON_INTERPRET=1`` also on CPU tensors through Triton's interpreter (slow:
for tests and debugging). Triton itself is imported only when the backend is used or checked.
"""

import torch

from kvpress_critical.ops.torch_backend import head_projections


def _interpreter_enabled() -> bool:
    from kvpress_critical.ops.triton_backend.kernel import interpreter_enabled

    return interpreter_enabled()


def triton_availability() -> str | None:
    """None when the Triton backend can run here, else why not and how to fix it."""
    try:
        import triton  # noqa: F401

        from kvpress_critical.ops.triton_backend.kernel import interpreter_mismatch
    except ImportError:
        return "triton is not installed: pip install 'kvpress-critical[triton]' (or `pip install triton`)"
    if interpreter_mismatch():
        return (
            "TRITON_INTERPRET=1 was set after triton was imported, so Triton's own functions are not interpreted; "
            "set it in the environment before starting Python"
        )
    if _interpreter_enabled() or torch.cuda.is_available():
        return None
    return (
        "Triton kernels need a CUDA GPU and none is visible; set TRITON_INTERPRET=1 to run them on CPU tensors "
        "with the Triton interpreter (slow, for tests)"
    )


def triton_devices() -> tuple[str, ...]:
    """Device types the backend accepts now: CUDA, plus CPU while the interpreter is on."""
    try:
        return ("cuda", "cpu") if _interpreter_enabled() else ("cuda",)
    except ImportError:
        return ("cuda",)


def projected_value_norm_triton(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused Triton implementation; see :func:`kvpress_critical.projected_value_norm`. ``out``: optional buffer."""
    from kvpress_critical.ops.triton_backend.launcher import launch_head_projected_norm

    proj = head_projections(o_proj_weight, num_attention_heads, norm)
    return launch_head_projected_norm(values, proj, norm, out)
