"""The ``vllm.general_plugins`` entry point: loaded by vLLM in every process (API server, engine core, workers).

:func:`register` wraps one vLLM method, ``EngineArgs.create_engine_config``, and does nothing else: in a process
whose engines do not ask for the plugin (no ``"kvpress_critical"`` in their ``additional_config``) the wrapper only
looks for that key, and nothing of the plugin is installed. When an engine configuration asks for it:

- the configuration passes through :func:`kvpress_critical_vllm.engine_config.check_engine_config` (the plugin's
  options are checked, unsupported engine features refused, the plugin's scheduler and worker set);
- then, once per process (:func:`enable`), a request's ``extra_args["kvpress_critical"]`` overrides are checked
  where vLLM checks sampling parameters: their names, types and ranges when ``SamplingParams`` are built, and against
  the engine's bounds once the engine's input processor has built the request; with a ``max_model_len`` longer than
  the KV pool, a request whose prompt and ``max_tokens`` do not fit the pool whole must be bounded by its options (it
  could otherwise hold more blocks than the pool has), so that a bad request fails in the caller (an HTTP 400 naming
  the option and its allowed range in the server), never in the engine;
- and the plugin's counters are exposed on the server's ``/metrics`` (:mod:`kvpress_critical_vllm.metrics`: a
  folder the engine processes started after inherit).
"""

from __future__ import annotations

import functools

_REGISTERED = False
_ENABLED = False


def register() -> None:
    """Wrap ``EngineArgs.create_engine_config``: a configuration asking for the plugin enables it (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from vllm.engine.arg_utils import EngineArgs

    EngineArgs.create_engine_config = _checked_engine_config(EngineArgs.create_engine_config)


def enable() -> None:
    """Install the request checks and the metrics collector in this process (idempotent): an engine configuration
    built here asked for the plugin."""
    global _ENABLED
    if _ENABLED:
        return
    _ENABLED = True
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from kvpress_critical_vllm.metrics import register_collector

    SamplingParams._verify_extra_args = _checked_extra_args(SamplingParams._verify_extra_args)
    InputProcessor.process_inputs = _checked_for_the_engine(InputProcessor.process_inputs)
    register_collector()


def _checked_engine_config(create_engine_config):
    @functools.wraps(create_engine_config)
    def wrapper(self, *args, **kwargs):
        from kvpress_critical_vllm.engine_config import check_engine_config

        vllm_config = create_engine_config(self, *args, **kwargs)
        compilation = getattr(self, "compilation_config", None)
        requested = getattr(compilation, "cudagraph_mode", None) is not None
        if check_engine_config(vllm_config, cudagraph_requested=requested) is not None:
            enable()
        return vllm_config

    return wrapper


def _checked_extra_args(verify_extra_args):
    @functools.wraps(verify_extra_args)
    def wrapper(self):
        verify_extra_args(self)
        from vllm.exceptions import VLLMValidationError

        from kvpress_critical_vllm.options import CONFIG_KEY, OptionsError, validate_request_overrides

        try:
            validate_request_overrides(self.extra_args)
        except OptionsError as error:
            raise VLLMValidationError(str(error), parameter=f"{CONFIG_KEY}.{error.option}") from error

    return wrapper


def _checked_for_the_engine(process_inputs):
    """A request's overrides checked against the engine's bounds once its input processor has built it, and, in an
    engine whose ``max_model_len`` is longer than its pool, a request whose own length (its prompt and ``max_tokens``)
    does not fit the pool whole bounded by its options; either failure is refused in the caller."""

    @functools.wraps(process_inputs)
    def wrapper(self, *args, **kwargs):
        request = process_inputs(self, *args, **kwargs)
        params = request.sampling_params
        if params is None:
            return request
        from kvpress_critical_vllm.options import engine_options

        config = self.vllm_config
        engine = engine_options(config.additional_config)
        if engine is None:
            return request
        from vllm.exceptions import VLLMValidationError

        from kvpress_critical_vllm.budget import check_hold
        from kvpress_critical_vllm.options import CONFIG_KEY, REQUEST_WHERE, OptionsError, resolve_options

        block_size = config.cache_config.block_size
        pool_blocks = (config.cache_config.num_gpu_blocks or 0) - 1  # less vLLM's null block
        try:
            tensor_parallel = config.parallel_config.tensor_parallel_size
            options = resolve_options(engine, params.extra_args, block_size, tensor_parallel)
            if pool_blocks > 0:
                prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt_embeds
                length = min(config.model_config.max_model_len, len(prompt) + (params.max_tokens or 0))
                check_hold(options, length, block_size, pool_blocks, REQUEST_WHERE)
        except OptionsError as error:
            raise VLLMValidationError(str(error), parameter=f"{CONFIG_KEY}.{error.option}") from error
        return request

    return wrapper
