"""The ``vllm.general_plugins`` entry point: loaded by vLLM in every process (API server, engine core, workers).

:func:`register` does two things, and nothing else until an engine asks for the plugin:

- engine configurations built from ``EngineArgs`` pass through
  :func:`kvpress_critical_vllm.engine_config.check_engine_config` (the plugin's options are checked, unsupported
  engine features refused, the plugin's scheduler and worker set) when their ``additional_config`` holds
  ``"kvpress_critical"``;
- ``SamplingParams`` check their ``extra_args["kvpress_critical"]`` overrides when they are built, so that a bad
  request fails in the caller (an HTTP 400 in the server), not in the engine.
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

    EngineArgs.create_engine_config = _checked_engine_config(EngineArgs.create_engine_config)
    SamplingParams._verify_extra_args = _checked_extra_args(SamplingParams._verify_extra_args)


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
            raise VLLMValidationError(str(error), parameter=f"extra_args.{CONFIG_KEY}") from error

    return wrapper
