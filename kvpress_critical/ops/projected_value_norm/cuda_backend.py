"""The ``"cuda"`` backend of ``projected_value_norm``: the C++ extension's CUDA kernels.

The extension compiled with its CUDA kernels (``csrc/projected_norm_kernel.cu``: fp16 / bf16 operands on tensor
cores through WMMA with float32 accumulators, float32 and mixed dtypes on an FMA kernel, tiles chosen by compute
capability) registers them for the same ``kvpress_critical::head_projected_norm`` operator as the CPU kernel:
``torch.library`` dispatches on the tensors' device, so the call is :func:`.cpp_backend.projected_value_norm_cpp`.
It is available when torch is a CUDA build, ``nvcc`` compiled the kernels and a GPU is visible
(:func:`kvpress_critical.ops.extension.cuda_availability`).
"""

from kvpress_critical.ops.projected_value_norm.cpp_backend import projected_value_norm_cpp as projected_value_norm_cuda

__all__ = ["projected_value_norm_cuda"]
