"""The ``vllm.general_plugins`` entry point: loaded by vLLM in every process (API server, engine core, workers).

:func:`register` does three things, and nothing else until an engine asks for the plugin:

- engine configurations built from ``EngineArgs`` pass through
  :func:`kvpress_critical_vllm.engine_config.check_engine_config` (the plugin's options are checked, unsupported
  engine features refused, the plugin's scheduler and worker set) when their ``additional_config`` holds
  ``"kvpress_critical"``;
- a request's ``extra_args["kvpress_critical"]`` overrides are checked where vLLM checks sampling parameters: their
  names, types and ranges when ``SamplingParams`` are built, and against the engine's bounds when the engine's input
  processor validates the request; with a ``max_model_len`` longer than the KV pool, a request whose prompt and
  ``max_tokens`` do not fit the pool whole must be bounded by its options (it could otherwise hold more blocks than
  the pool has), so that a bad request fails in the caller (an HTTP 400 naming the option and its allowed range in
  the server), never in the engine;
- the plugin's counters are exposed on the server's ``/metrics`` (:mod:`kvpress_critical_vllm.metrics`).
"""

from __future__ import annotations

import functools

_REGISTERED = False


def register() -> None:
    """Install the plugin's two hooks into this process's vLLM (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    from kvpress_critical_vllm.metrics import register_collector

    EngineArgs.create_engine_config = _checked_engine_config(EngineArgs.create_engine_config)
    SamplingParams._verify_extra_args = _checked_extra_args(SamplingParams._verify_extra_args)
    InputProcessor._validate_params = _checked_for_the_engine(InputProcessor._validate_params)
    InputProcessor.process_inputs = _checked_footprint(InputProcessor.process_inputs)
    register_collector()


def _checked_engine_config(create_engine_config):
    @functools.wraps(create_engine_config)
    def wrapper(self, *args, **kwargs):
        from kvpress_critical_vllm.engine_config import check_engine_config

        vllm_config = create_engine_config(self, *args, **kwargs)
        check_engine_config(vllm_config)
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


def _checked_for_the_engine(validate_params):
    @functools.wraps(validate_params)
    def wrapper(self, params, *args, **kwargs):
        result = validate_params(self, params, *args, **kwargs)
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import SamplingParams

        from kvpress_critical_vllm.options import CONFIG_KEY, OptionsError, engine_options, resolve_options

        if isinstance(params, SamplingParams) and params.extra_args:
            engine = engine_options(self.vllm_config.additional_config)
            if engine is not None:
                try:
                    config = self.vllm_config
                    resolve_options(
                        engine,
                        params.extra_args,
                        config.cache_config.block_size,
                        config.parallel_config.tensor_parallel_size,
                    )
                except OptionsError as error:
                    raise VLLMValidationError(str(error), parameter=f"{CONFIG_KEY}.{error.option}") from error
        return result

    return wrapper


def _checked_footprint(process_inputs):
    """A request whose own length (its prompt and ``max_tokens``) does not fit the KV pool whole must be bounded by its
    options (an engine whose ``max_model_len`` is longer than its pool), or it is refused in the caller."""

    @functools.wraps(process_inputs)
    def wrapper(self, *args, **kwargs):
        request = process_inputs(self, *args, **kwargs)
        params = request.sampling_params
        engine = None if params is None else engine_options_of(self.vllm_config)
        if engine is None:
            return request
        from vllm.exceptions import VLLMValidationError

        from kvpress_critical_vllm.budget import check_hold
        from kvpress_critical_vllm.options import CONFIG_KEY, REQUEST_WHERE, OptionsError, resolve_options

        config = self.vllm_config
        pool_blocks = (config.cache_config.num_gpu_blocks or 0) - 1  # less vLLM's null block
        if pool_blocks <= 0:
            return request
        block_size = config.cache_config.block_size
        prompt = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt_embeds
        length = min(config.model_config.max_model_len, len(prompt) + (params.max_tokens or 0))
        try:
            tensor_parallel = config.parallel_config.tensor_parallel_size
            options = resolve_options(engine, params.extra_args, block_size, tensor_parallel)
            check_hold(options, length, block_size, pool_blocks, REQUEST_WHERE)
        except OptionsError as error:
            raise VLLMValidationError(str(error), parameter=f"{CONFIG_KEY}.{error.option}") from error
        return request

    return wrapper


def engine_options_of(vllm_config):
    from kvpress_critical_vllm.options import engine_options

    return engine_options(vllm_config.additional_config)
