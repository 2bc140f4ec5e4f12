"""What both Triton backends share: whether Triton can run here (a GPU, or its interpreter on CPU tensors).

Triton itself is imported only when a backend is used or checked. Triton reads ``TRITON_INTERPRET`` when it is
imported (its standard library, ``tl.sum`` included, is decorated then): the interpreter works only when
``TRITON_INTERPRET=1`` is set before triton is imported, which :func:`interpreter_mismatch` detects.
"""

import os

import torch


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), read now (imports triton)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_mismatch() -> bool:
    """True when the interpreter is on but triton was imported before it was: kernels would fail to run."""
    if not interpreter_enabled():
        return False
    import triton.language as tl

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return not isinstance(tl.sum, InterpretedFunction)


def triton_availability() -> str | None:
    """None when the Triton backend can run here, else why not and how to fix it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: pip install 'kvpress-critical[triton]' (or `pip install triton`)"
    if interpreter_mismatch():
        return (
            "TRITON_INTERPRET=1 was set after triton was imported, so Triton's own functions are not interpreted; "
            "set it in the environment before starting Python"
        )
    if interpreter_enabled() or torch.cuda.is_available():
        return None
    return (
        "Triton kernels need a CUDA GPU and none is visible; set TRITON_INTERPRET=1 to run them on CPU tensors "
        "with the Triton interpreter (slow, for tests)"
    )


def triton_devices() -> tuple[str, ...]:
    """Device types the backend accepts now: CUDA, plus CPU while the interpreter is on."""
    try:
        return ("cuda", "cpu") if interpreter_enabled() else ("cuda",)
    except ImportError:
        return ("cuda",)
