"""The architectures people serve, as tiny random-weight models (``architectures.py``): each is served by the plugin,
its answers equal to transformers' keeping the same entries in its full-attention layers, or refused with the reason.

Served: Qwen2, Qwen3, Phi-3 (fused QKV), Gemma 3 (five sliding-window layers per full-attention one in Gemma 3
itself; two here) and Gemma 2 (sliding-window and full layers, a logits soft cap), each with a uniform and a head-wise
press in one batch; Qwen3-MoE and gpt-oss (attention sinks) the same in an engine process of their own. Refused: an
attention-free model (Mamba) when the engine's configuration is built. Qwen3-Next (linear attention beside full
attention) is served in test_linear_attention.py. Llama is the rest of the suite's model; Mistral with a sliding
window in every layer is refused in test_refusals.py. Each served model is one more in-process engine (a few seconds
each): the complete tier.
"""

from pathlib import Path

import background
import pytest
from architectures import configs, make_model
from conftest import engine_kwargs, job_results, make_llm, model_path, run_batch, scheduler_of, token_ids
from reference import greedy_mismatches, load_reference_model, reference_of
from selections import press_selection, same_entries
from test_engine_features import engine_process_job, job_requests, result_of
from workload import Row

SERVED = ["qwen2", "qwen3", "phi3", "gemma3", "gemma2"]
# in an engine process (a background job): vLLM creates a mixture-of-experts model's expert-parallel group with a
# process's first engine, which in the suite's process is a dense model
OWN_PROCESS = ["qwen3_moe", "gpt_oss"]
NEW_TOKENS = 12
ROWS = (
    Row("models/critical_snapkv-300", "uniform", 0, 300, {"press": "critical_snapkv"}, NEW_TOKENS),
    Row("models/critical_adakv_snapkv-389", "head_wise", 61, 389, {"press": "critical_adakv_snapkv"}, NEW_TOKENS),
)


def tiny_model(name: str, tmp_path_factory) -> str:
    return make_model(name, tmp_path_factory.mktemp(name), Path(model_path()))


@pytest.mark.slow
@pytest.mark.parametrize("name", SERVED)
def test_the_architecture_is_served_exactly(name, tmp_path_factory, prompt_ids):
    """A uniform and a head-wise request: selections in every full-attention layer and only there, the press's
    selection on transformers' prefill (measured: identical), greedy tokens equal to transformers keeping the same
    entries."""
    path = tiny_model(name, tmp_path_factory)
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.5, "record_selections": True},
        model=path, max_model_len=1024, kv_cache_memory_bytes=24 * 2**20,
    )  # fmt: skip
    scheduler = scheduler_of(llm)
    groups = scheduler.kv_cache_config.kv_cache_groups
    compressed = set(groups[scheduler.kvpress_group].layer_names)
    types = configs()[name][1].get("layer_types")
    assert len(groups) == (
        1 if types is None else 1 + types.count("sliding_attention") // types.count("full_attention")
    )
    uniform, head_wise = run_batch(llm, ROWS, prompt_ids)
    reference = load_reference_model(path)
    for result in (uniform, head_wise):
        assert set(result.kept) == compressed, result.row.name  # the full-attention layers, every one of them
    n = len(uniform.prompt)
    assert {len(heads[0]) for heads in uniform.kept.values()} == {n - (n - int(n * 0.5)) // 32 * 32}
    for result in (uniform, head_wise):
        args = reference_of(result, reference)
        assert not greedy_mismatches(result.tokens, *args, max_new_tokens=NEW_TOKENS), result.row.name
        expected = press_selection(reference, result.prompt, result.kept, result.row.options)
        assert same_entries(result.kept, expected) >= 0.99, result.row.name  # near-ties of two float32 sums aside


_OWN_PROCESS_PATHS: dict = {}  # model name -> its folder, made by the job


@background.job("mixture-of-experts", lane="models")
def mixture_of_experts_job(tmp_path_factory) -> background.Job:
    """The two rows on each model of :data:`OWN_PROCESS`, one engine after the other in an engine process (each
    engine core in a process of its own: vLLM makes its expert-parallel group there)."""
    ids = token_ids()
    plugin = {"press": "critical_snapkv", "compression_ratio": 0.5, "record_selections": True}
    jobs = []
    for name in OWN_PROCESS:
        _OWN_PROCESS_PATHS[name] = tiny_model(name, tmp_path_factory)
        engine = engine_kwargs(model=_OWN_PROCESS_PATHS[name], max_model_len=1024, kv_cache_memory_bytes=24 * 2**20)
        prompts = [row.prompt(ids) for row in ROWS]
        jobs.append(dict(engine=engine, plugin=plugin, prompts=prompts, requests=job_requests(ROWS)))
    for first, then in zip(jobs, jobs[1:]):
        first["then"] = then
    return engine_process_job(tmp_path_factory.mktemp("mixture-of-experts"), **jobs[0])


@pytest.mark.slow
@pytest.mark.background("mixture-of-experts")
def test_mixture_of_experts_models_are_served_exactly(background_job, prompt_ids):
    """In an engine process of their own: Qwen3-MoE, and gpt-oss (sliding-window and full-attention layers, attention
    sinks), each with a uniform and a head-wise request, keep the press's selection on transformers' prefill and
    answer as transformers keeping the same entries (gpt-oss's head-wise attention with the sinks in its softmax)."""
    job = result_of(background_job)
    for name in OWN_PROCESS:
        reference = load_reference_model(_OWN_PROCESS_PATHS[name])
        for result in job_results(job, ROWS, prompt_ids):
            args = reference_of(result, reference)
            assert not greedy_mismatches(result.tokens, *args, max_new_tokens=NEW_TOKENS), (name, result.row.name)
            expected = press_selection(reference, result.prompt, result.kept, result.row.options)
            assert same_entries(result.kept, expected) >= 0.99, (name, result.row.name)
        job = job.get("then")


def test_attention_free_models_refuse_when_the_configuration_is_built(tmp_path_factory):
    from kvpress_critical_vllm.engine_config import EngineConfigError
    from vllm.engine.arg_utils import EngineArgs

    path = tiny_model("mamba", tmp_path_factory)
    args = EngineArgs(
        model=path, dtype="float32", enforce_eager=True, max_model_len=1024, block_size=32,
        additional_config={"kvpress_critical": {"compression_ratio": 0.5}},
    )  # fmt: skip
    with pytest.raises(EngineConfigError, match="the model has no attention layer"):
        args.create_engine_config()
