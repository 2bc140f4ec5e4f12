"""Preemption: a request vLLM preempts is recomputed from its first token and compacted again at the same points, so
it resumes over the cache it had and gives the tokens it gives unpreempted.

For each kind of request (a uniform and a head-wise press after the prompt, compression after every prompt chunk,
compression while decoding) a few requests that together outgrow the bounded engine (16 blocks) once they
generate: vLLM preempts the latest-admitted ones. The same requests, every kind at once, run by the tiny engine (the
bounded engine's model, the tiny Llama, in a pool that holds them all), are the reference.
"""

import pytest
from conftest import serve
from selections import plan_of
from workload import BLOCK_SIZE

pytestmark = pytest.mark.slow

NEW_TOKENS = 40
# the bounded engine's schedules are engine-wide: each kind sets all of its own (window 32, as the bounded engine's)
PLAIN = {"window_size": 32, "compression_chunk_size": 0, "compression_interval": 0, "target_size": 0}
# kind -> (requests, prompt length, options), in the bounded engine's 16 free blocks. vLLM admits
# a request when its prompt fits in the free blocks, so once the pool is full less than a prompt's blocks are free, and
# the running requests outgrow that within 32 tokens: a 128-token prompt compacted at ratio 0.5 holds 2 blocks and
# takes 2 more for its 40 tokens; a chunked 256-token prompt holds 4; a decoding request holds its 4-block prompt
# and grows to 6 before its compaction
KINDS = {
    "uniform": (6, 128, {**PLAIN, "press": "critical_snapkv", "compression_ratio": 0.5}),
    "head_wise": (6, 128, {**PLAIN, "press": "critical_adakv_snapkv", "compression_ratio": 0.5}),
    "chunked": (4, 256, {**PLAIN, "press": "critical_snapkv", "compression_ratio": 0.5, "compression_chunk_size": 128}),
    "decoding": (4, 128, {**PLAIN, "press": "critical_snapkv", "compression_ratio": 0.0, "compression_interval": 36,
                          "target_size": 64}),
}  # fmt: skip


def requests(prompt_ids, prefix: str, kinds) -> dict:
    from vllm import SamplingParams

    batch = {}
    for kind in kinds:
        count, length, options = KINDS[kind]
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, extra_args={"kvpress_critical": options}
        )
        for i in range(count):
            batch[f"{prefix}-{kind}-{i}"] = (prompt_ids[61 * i : 61 * i + length], params)
    return batch


def test_preempted_requests_of_every_kind_are_compacted_again_and_give_the_same_tokens(
    tiny_engine, bounded_engine, prompt_ids
):
    whole = serve(tiny_engine, requests(prompt_ids, "whole", KINDS))
    assert all(r.preemptions == 0 for r in whole.records.values())
    for kind, (count, length, options) in KINDS.items():
        before = bounded_engine.collective_rpc("kvpress_critical_compacted")[0]
        preempted = serve(bounded_engine, requests(prompt_ids, "preempted", [kind]))
        compactions = bounded_engine.collective_rpc("kvpress_critical_compacted")[0] - before
        records = [preempted.records[f"preempted-{kind}-{i}"] for i in range(count)]
        assert any(r.preemptions > 0 for r in records), f"no {kind} request was preempted: the pool was meant to"
        plan = plan_of(options, length, length + NEW_TOKENS - 1)
        # the last life of a request reaches every compaction point of its schedule, and frees what one life frees
        last = (plan[-1].index, plan[-1].evicted // BLOCK_SIZE)
        assert all((r.compaction, r.blocks_freed) == last for r in records), (kind, records)
        # each life compacts the request again at every point it reaches (a life cut short reaches fewer)
        lives = sum(1 + r.preemptions for r in records)
        assert len(plan) * count <= compactions <= len(plan) * lives, (kind, compactions, lives)
        for i in range(count):
            assert preempted.tokens[f"preempted-{kind}-{i}"] == whole.tokens[f"whole-{kind}-{i}"], (kind, i)
