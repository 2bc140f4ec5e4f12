"""Head-wise budgets inside vLLM: CriticalAdaKV and AdaKV over SnapKV, with the blocks a uniform press frees.

One batch of the session's engine, every request with a head-wise press (per request): prompts of different lengths
(their last ``N mod 32`` tokens share a block with the new tokens), 32 greedy tokens each. Checked:

- exactness: the engine's tokens equal transformers' with each layer's KV heads attending only to the entries the
  engine reports they kept (kvpress's masking of head-wise presses, written out in ``reference.py``);
- selection: the kept entries equal this project's transformers presses (``CriticalAdaKVPress(SnapKVPress(...))``,
  kvpress's ``AdaKVPress(SnapKVPress(...))``) for the same budget, run in kvpress's environment;
- budgets are uneven across heads (a test that fails if every head kept the same count);
- blocks: a head-wise request frees exactly the blocks the uniform press frees at the same ratio, and a fixed pool
  runs as many head-wise requests at once as uniform ones (within one).
"""

import pytest
from conftest import NEW_TOKENS, internal_id, make_llm, model_path, run_to_end, scheduler_of
from reference import greedy_after_eviction, greedy_with_head_masks, load_reference_model
from test_selection import press_selections

pytestmark = pytest.mark.slow

HEAD_WISE = ("critical_adakv_snapkv", "adakv_snapkv", "critical_adakv_snapkv", "adakv_snapkv")
LENGTHS = (404, 777, 650, 1100)


@pytest.fixture(scope="module")
def head_wise_batch(engine, prompt_ids):
    from vllm import SamplingParams

    prompts = [prompt_ids[53 * i : 53 * i + length] for i, length in enumerate(LENGTHS)]
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, extra_args={"kvpress_critical": {"press": press}})
        for press in HEAD_WISE
    ]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    selections = engine.collective_rpc("kvpress_critical_selections")[0]
    kept = [selections[internal_id(selections, output.request_id)] for output in outputs]
    return prompts, outputs, kept


@pytest.fixture(scope="module")
def reference_model():
    return load_reference_model(model_path())


def test_the_masked_reference_is_the_evicting_one_for_uniform_budgets(batch, reference_model):
    """``greedy_with_head_masks`` (used below) agrees with ``greedy_after_eviction`` where both apply."""
    prompts, outputs, selections = batch
    kept = selections[internal_id(selections, outputs[0].request_id)]
    masked = greedy_with_head_masks(reference_model, prompts[0], kept, NEW_TOKENS)
    assert masked == greedy_after_eviction(reference_model, prompts[0], kept, NEW_TOKENS)


@pytest.mark.parametrize("index", range(len(HEAD_WISE)), ids=[f"{p}-{n}" for p, n in zip(HEAD_WISE, LENGTHS)])
def test_greedy_output_equals_transformers_with_each_heads_entries(head_wise_batch, reference_model, index):
    prompts, outputs, kept = head_wise_batch
    layers = kept[index]
    assert len(layers) == 30
    n_prompt = len(prompts[index])
    budget = n_prompt - (n_prompt - int(n_prompt * 0.5)) // 32 * 32  # the uniform press's block-aligned count
    for heads in layers.values():
        assert sum(len(positions) for positions in heads) == budget * len(heads)  # the layer's total, shared
        last = set(range(n_prompt // 32 * 32, n_prompt))
        assert all(last <= set(positions) for positions in heads)  # the last partial block: kept by every head
    got = list(outputs[index].outputs[0].token_ids)
    assert got == greedy_with_head_masks(reference_model, prompts[index], layers, NEW_TOKENS)


def test_budgets_are_uneven_across_heads(head_wise_batch):
    _, _, kept = head_wise_batch
    spreads = [max(map(len, heads)) - min(map(len, heads)) for layers in kept for heads in layers.values()]
    assert sum(spread > 0 for spread in spreads) > 0.5 * len(spreads), spreads


def test_head_wise_selection_equals_the_transformers_presses(head_wise_batch):
    from kvpress_critical_vllm.options import CompressionOptions

    prompts, _, kept = head_wise_batch
    defaults = CompressionOptions().as_dict()
    requests = []
    for press, prompt, layers in zip(HEAD_WISE, prompts, kept):
        n_kept = sum(len(p) for p in next(iter(layers.values()))) // len(next(iter(layers.values())))
        requests.append({**defaults, "press": press, "prompt_ids": prompt, "n_kept": n_kept})
    reference = press_selections(requests)
    report, agreement = [], []
    for press, layers, expected in zip(HEAD_WISE, kept, reference):
        common = total = 0
        for name, heads in layers.items():
            layer = name.split(".")[2]
            for head, positions in enumerate(heads):
                common += len(set(positions) & set(expected[layer][head]))
                total += len(positions)
        agreement.append(common / total)
        report.append(f"{press}: {common}/{total} entries")
    print("plugin vs transformers head-wise presses:", "; ".join(report))
    assert all(value >= 0.999 for value in agreement), report


def test_a_head_wise_request_frees_the_uniform_press_blocks(engine, prompt_ids):
    from vllm import SamplingParams

    scheduler = scheduler_of(engine)
    prompt = prompt_ids[:777]
    freed = {}
    for press in ("critical_snapkv", "critical_adakv_snapkv"):
        params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"kvpress_critical": {"press": press}})
        engine.llm_engine.add_request(press, {"prompt_token_ids": prompt}, params)
        while engine.llm_engine.has_unfinished_requests():
            engine.llm_engine.step()
        (record,) = [r for rid, r in scheduler.kvpress_records.items() if rid.startswith(f"{press}-")]
        freed[press] = (record.blocks_freed, record.kept_per_head)
        if press == "critical_adakv_snapkv":
            assert record.kept_min < record.kept_per_head < record.kept_max
    assert freed["critical_snapkv"] == freed["critical_adakv_snapkv"] == (12, 393)


def test_a_pool_holds_as_many_head_wise_requests_as_uniform_ones():
    """96 blocks, 16 requests of 512 prompt tokens and 32 new ones at ratio 0.75: peak concurrency per press."""
    from conftest import BLOCK_SIZE, REPO
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    token_bytes = 30 * 2 * 3 * 64 * 4
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.75},
        kv_cache_memory_bytes=97 * BLOCK_SIZE * token_bytes,
        max_model_len=1024,
    )
    ids = AutoTokenizer.from_pretrained(model_path())((REPO / "LICENSE").read_text())["input_ids"]
    peaks = {}
    for press in ("critical_snapkv", "critical_adakv_snapkv"):
        params = SamplingParams(max_tokens=32, ignore_eos=True, extra_args={"kvpress_critical": {"press": press}})
        for i in range(16):
            llm.llm_engine.add_request(f"{press}-{i}", {"prompt_token_ids": ids[11 * i : 11 * i + 512]}, params)
        _, peak = run_to_end(llm)
        peaks[press] = peak
    print("peak requests at once:", peaks)
    assert abs(peaks["critical_adakv_snapkv"] - peaks["critical_snapkv"]) <= 1, peaks


def test_a_mixed_batch_attends_each_row_as_alone(engine, head_wise_batch, reference_model):
    """Head-wise, uniform and uncompressed rows decode in the same steps: each gives its own reference's tokens."""
    from vllm import SamplingParams

    prompts, outputs, _ = head_wise_batch
    presses = [{"press": HEAD_WISE[0]}, {"press": "critical_snapkv"}, {"compression_ratio": 0.0}]
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, extra_args={"kvpress_critical": extra})
        for extra in presses
    ]
    mixed = engine.generate([{"prompt_token_ids": p} for p in prompts[:3]], params)
    selections = engine.collective_rpc("kvpress_critical_selections")[0]
    tokens = [list(o.outputs[0].token_ids) for o in mixed]
    assert tokens[0] == list(outputs[0].outputs[0].token_ids)
    uniform = selections[internal_id(selections, mixed[1].request_id)]
    assert tokens[1] == greedy_after_eviction(reference_model, prompts[1], uniform, NEW_TOKENS)
    assert tokens[2] == greedy_after_eviction(reference_model, prompts[2], None, NEW_TOKENS)


def test_chunked_prefill_keeps_the_same_head_wise_entries(head_wise_batch):
    """128-token chunks: the window queries of a last chunk shorter than the window come from earlier chunks."""
    from test_engine_features import same_entries
    from vllm import SamplingParams

    prompts, outputs, kept = head_wise_batch
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.5, "record_selections": True},
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, extra_args={"kvpress_critical": {"press": press}})
        for press in HEAD_WISE
    ]
    chunked = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    selections = llm.collective_rpc("kvpress_critical_selections")[0]
    for one, several, layers in zip(outputs, chunked, kept):
        assert same_entries(layers, selections[internal_id(selections, several.request_id)]) >= 0.999
        assert list(one.outputs[0].token_ids) == list(several.outputs[0].token_ids)


def test_async_scheduling_in_an_engine_process(head_wise_batch, tmp_path):
    from conftest import engine_kwargs
    from test_engine_features import engine_process

    prompts, outputs, _ = head_wise_batch
    plugin = {"press": "critical_snapkv", "compression_ratio": 0.5}
    result = engine_process(tmp_path, engine=engine_kwargs(), plugin=plugin, prompts=prompts, presses=list(HEAD_WISE),
                            async_scheduling=True)  # fmt: skip
    assert "CriticalKVAsyncScheduler" in result["scheduler"]
    assert result["tokens"] == [list(o.outputs[0].token_ids) for o in outputs]


def test_a_preempted_head_wise_request_is_compressed_again(engine, prompt_ids):
    """A pool of 36 blocks for three requests that grow to 15 blocks each: one is preempted and recomputed."""
    from vllm import SamplingParams

    prompts = [prompt_ids[100 * i : 100 * i + 320] for i in range(3)]
    params = SamplingParams(
        max_tokens=320, temperature=0, ignore_eos=True, extra_args={"kvpress_critical": {"press": HEAD_WISE[0]}}
    )
    expected = [
        list(o.outputs[0].token_ids) for o in engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.5},
        kv_cache_memory_bytes=37 * 32 * 46080,
        max_model_len=1024,
    )
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    tokens, _ = run_to_end(llm)
    records = scheduler_of(llm).kvpress_records
    assert any(r.preemptions > 0 for r in records.values()), "the pool was meant to force a preemption"
    assert [tokens[f"p{i}"] for i in range(3)] == expected


def test_head_wise_presses_refuse_tensor_parallelism():
    """Tensor parallelism splits a layer's heads (and each block) over ranks whose shares of a shared budget differ:
    head-wise presses refuse it, engine-wide at start-up and per request in the caller."""
    from kvpress_critical_vllm.options import CompressionOptions, OptionsError, check_layout, resolve_options

    with pytest.raises(OptionsError, match="tensor parallelism"):
        check_layout(CompressionOptions(press="critical_adakv_snapkv"), 32, "engine", tensor_parallel_size=2)
    engine = CompressionOptions(compression_ratio=0.5)
    with pytest.raises(OptionsError, match="tensor_parallel_size=1"):
        resolve_options(engine, {"kvpress_critical.press": "adakv_snapkv"}, 32, tensor_parallel_size=2)
    assert resolve_options(engine, {"kvpress_critical.press": "critical_snapkv"}, 32, tensor_parallel_size=2)
    with pytest.raises(OptionsError, match="window_size=16 must be at least block_size - 1 = 31"):
        resolve_options(engine, {"kvpress_critical": {"press": "adakv_snapkv", "window_size": 16}}, 32)
