"""kvpress-critical for vLLM: CriticalKV eviction after prefill, inside vLLM's paged KV cache.

Installed beside vLLM, this package registers a ``vllm.general_plugins`` entry point. An engine started with
``additional_config={"kvpress_critical": {...}}`` compresses each request's KV cache once its prompt is prefilled:
every KV head keeps the same number of entries, chosen by this project's selection rules
(:mod:`kvpress_critical.selection`) and kernels (:mod:`kvpress_critical.ops`); the freed blocks go back to vLLM's
pool at once, so the scheduler admits more requests. Engine options the plugin cannot honour refuse at start-up.

Modules: :mod:`.options` (what a user asks for), :mod:`.budget` (how many entries and blocks),
:mod:`.presses` (which entries), :mod:`.engine_config` (what the engine must be), :mod:`.scheduler` (freeing
blocks), :mod:`.attention` (the attention view and the compaction), :mod:`.worker` (per-step plans),
:mod:`.plugin` (the entry point). See docs/vllm.md.
"""

from kvpress_critical._version import __version__
from kvpress_critical_vllm.options import CONFIG_KEY, PRESSES, CompressionOptions, resolve_options

SUPPORTED_VLLM = "0.32"  # the vLLM minor whose internals the plugin subclasses

__all__ = ["CONFIG_KEY", "PRESSES", "SUPPORTED_VLLM", "CompressionOptions", "__version__", "resolve_options"]
