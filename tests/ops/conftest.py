"""Fixtures shared by the op tests."""

import pytest
import torch

from kvpress_critical.ops.extension import cpp_availability


@pytest.fixture(scope="module")
def ops():
    """``torch.ops.kvpress_critical`` (the C++ extension's operators); the test is skipped, with the reason, where the
    extension cannot be built."""
    reason = cpp_availability()
    if reason is not None:
        pytest.skip(reason)
    return torch.ops.kvpress_critical
