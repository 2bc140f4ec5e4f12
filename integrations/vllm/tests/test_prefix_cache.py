"""vLLM's prefix cache beside compaction (the "prefix_cache" engine; the default engine, with it off, is the reference).

A compressed request takes no hit and its rewritten blocks leave the index; its untouched blocks, freed by the
compaction, serve later uncompressed requests with the same prefix; a compaction whose blocks another request shares
is not done (:mod:`kvpress_critical_vllm.prefix_cache`). Every answer equals the same request's answer with the
prefix cache off.
"""

import pytest
from conftest import scheduler_of
from workload import BLOCK_SIZE

pytestmark = pytest.mark.slow


def params(max_tokens: int, **options):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args={"kvpress_critical": options}
    )


def generate(llm, requests: list) -> list:
    """``(tokens, prompt tokens served from the prefix cache)`` of each ``(prompt, params)``, run together."""
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in requests], [p for _, p in requests])
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outputs]


def counters(llm) -> dict:
    metrics = scheduler_of(llm).kvpress_metrics
    return {**metrics.counters, **metrics.uncompressed_by_reason}


def test_a_document_asked_several_questions_with_the_prefix_cache_on(prefix_cache_engine, engine, prompt_ids):
    """One 640-token document: a question asked uncompressed first (its blocks enter the cache), then four asked
    compressed (CriticalKV over SnapKV at 0.5: no hit, each compacted) beside two other questions uncompressed (hits
    on the first request's blocks of the document), then one more uncompressed after the compactions (the document's
    blocks again: the compressed requests' copies of them, rewritten, left the cache). Every answer equals the same
    request's with the prefix cache off."""
    document = prompt_ids[1000:1640]
    questions = [prompt_ids[1700 + 60 * i : 1700 + 60 * i + 40] for i in range(7)]
    whole, compressed = params(12, compression_ratio=0.0), params(12)
    rounds = [
        [(document + questions[0], whole)],
        [(document + q, compressed) for q in questions[1:5]] + [(document + q, whole) for q in questions[5:7]],
        [(document + questions[1], whole)],
    ]
    before = counters(prefix_cache_engine)
    cached = [generate(prefix_cache_engine, requests) for requests in rounds]
    after = counters(prefix_cache_engine)
    reference = [generate(engine, requests) for requests in rounds]
    assert [[tokens for tokens, _ in r] for r in cached] == [[tokens for tokens, _ in r] for r in reference]
    assert all(hit == 0 for r in reference for _, hit in r)  # the reference engine has no prefix cache
    first, second, third = cached
    assert first[0][1] == 0  # nothing cached yet
    assert all(hit == 0 for _, hit in second[:4])  # compressed requests take no hit
    assert all(hit >= len(document) // BLOCK_SIZE * BLOCK_SIZE for _, hit in second[4:])  # the document's blocks
    # the compressed requests rewrote their blocks from position E on and took them out of the cache: a later request
    # with the same prompt as one of them reuses the document's blocks (the first request's), not that one's question
    assert third[0][1] == len(document) // BLOCK_SIZE * BLOCK_SIZE
    assert after["compactions"] - before["compactions"] == 4 and after["shared_prefix"] == before["shared_prefix"]
    assert after["blocks_unhashed"] > before["blocks_unhashed"]


def test_a_compacted_requests_rewritten_blocks_are_never_a_hit(prefix_cache_engine, engine, prompt_ids):
    """A compressed request alone (its prompt's blocks cached as it is prefilled), then the same prompt uncompressed:
    the hit stops before the first block the compaction rewrote (its first kept position E), and the answer is the
    uncompressed one. A three-turn chat resending its history, each turn uncompressed after a compressed first turn,
    answers as with the prefix cache off."""
    from selections import plan_of

    prompt = prompt_ids[400:1100]
    (plan,) = plan_of({}, len(prompt))
    before = counters(prefix_cache_engine)
    generate(prefix_cache_engine, [(prompt, params(8))])
    # the full blocks of positions E .. N-1 were in the index
    unhashed = counters(prefix_cache_engine)["blocks_unhashed"] - before["blocks_unhashed"]
    assert unhashed == len(prompt) // BLOCK_SIZE - plan.evicted // BLOCK_SIZE > 0
    ((tokens, hit),) = generate(prefix_cache_engine, [(prompt, params(8, compression_ratio=0.0))])
    assert hit == plan.evicted  # every untouched block, no rewritten one
    assert tokens == generate(engine, [(prompt, params(8, compression_ratio=0.0))])[0][0]
    # a chat: a compressed first turn, then the history resent uncompressed twice
    history, answers = prompt_ids[1200:1500], {}
    for name, llm in (("cached", prefix_cache_engine), ("reference", engine)):
        turn, turns = history, []
        for i, options in enumerate(({}, {"compression_ratio": 0.0}, {"compression_ratio": 0.0})):
            ((answer, hit),) = generate(llm, [(turn, params(10, **options))])
            turns.append((answer, hit))
            turn = turn + answer + prompt_ids[1600 + 40 * i : 1600 + 40 * i + 30]
        answers[name] = turns
    assert [a for a, _ in answers["cached"]] == [a for a, _ in answers["reference"]]
    assert answers["cached"][2][1] > 0  # the third turn reuses the second's blocks


def test_identical_prompts_at_once_never_share_a_block_a_compaction_writes(prefix_cache_engine, engine, prompt_ids):
    """A compressed and an uncompressed request with the same prompt in one batch: the uncompressed one may hit the
    compressed one's blocks as they are prefilled; a compaction whose blocks are shared is then not done (the request
    stays uncompressed, counted as ``shared_prefix``), never written into the other's blocks. Each answer is the
    answer of what happened, as with the prefix cache off."""
    prompt = prompt_ids[1300:1900]
    before = counters(prefix_cache_engine)
    (compressed, _), (whole, hit) = generate(
        prefix_cache_engine, [(prompt, params(12)), (prompt, params(12, compression_ratio=0.0))]
    )
    after = counters(prefix_cache_engine)
    uncompressed = generate(engine, [(prompt, params(12, compression_ratio=0.0))])[0][0]
    assert whole == uncompressed
    if after["shared_prefix"] > before["shared_prefix"]:  # the hit came first: the compaction was not done
        assert hit > 0 and compressed == uncompressed and after["compactions"] == before["compactions"]
    else:
        assert after["compactions"] == before["compactions"] + 1
        assert compressed == generate(engine, [(prompt, params(12))])[0][0]
