"""kvpress-critical for vLLM: CriticalKV eviction inside vLLM's paged KV cache.

Installed beside vLLM, this package registers a ``vllm.general_plugins`` entry point, inert until an engine is
started with ``additional_config={"kvpress_critical": {...}}``. Such an engine compresses each request's KV cache
after its prompt, after every prompt chunk (``compression_chunk_size``) and while decoding (``compression_interval``),
with every KV head keeping the same number of entries (uniform presses) or a layer's budget shared among its heads
(head-wise presses), chosen by this project's selection rules (:mod:`kvpress_critical.selection`) and kernels
(:mod:`kvpress_critical.ops`); the freed blocks go back to vLLM's pool at once, so the scheduler admits more requests,
and a ``max_model_len`` longer than the pool is served where the schedules bound what a request holds. In hybrid
models (sliding-window layers beside full-attention ones, as in Gemma 3) the full-attention layers are compressed and
the sliding-window ones left to vLLM. Engine options the plugin cannot honour refuse at start-up; a request's bad
options fail in the caller; a failure while serving ends the request it concerns, never the engine.

Modules: :mod:`.options` (what a user asks for), :mod:`.budget` (how many entries and blocks, and when),
:mod:`.presses` (which entries), :mod:`.engine_config` (what the engine must be), :mod:`.kv_spec` (what a request
holds at most, and which KV-cache group is compressed), :mod:`.scheduler` (directing compactions, freeing blocks),
:mod:`.tracking` (each request's progress and records), :mod:`.pool_guard` (admission by what a request holds at
most, requests that can never fit), :mod:`.prefix_cache` (vLLM's prefix cache beside compaction), :mod:`.attention`
and :mod:`.layouts` (the attention view and the paged layouts), :mod:`.worker` and :mod:`.worker_state` (the requests
a worker compressed), :mod:`.step_plan` (each step's rows), :mod:`.compaction` (selections and writes),
:mod:`.head_wise_attention`, :mod:`.records` (recorded selections), :mod:`.model_weights` (``W_O``), :mod:`.protocol`
(directives and reports), :mod:`.metrics` (counters), :mod:`.vllm_compat` (vLLM's internals), :mod:`.plugin` (the
entry point). See docs/vllm.md.
"""

from kvpress_critical._version import __version__
from kvpress_critical_vllm.options import CONFIG_KEY, PRESSES, CompressionOptions, resolve_options

SUPPORTED_VLLM = "0.32"  # the vLLM minor whose internals the plugin subclasses

__all__ = ["CONFIG_KEY", "PRESSES", "SUPPORTED_VLLM", "CompressionOptions", "__version__", "resolve_options"]
