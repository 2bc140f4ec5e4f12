"""vLLM's prefix cache beside compaction (the "prefix_cache" engine; the default engine, with it off, is the reference).

A compressed request takes no hit of vLLM's and its rewritten blocks leave the index; its untouched blocks, freed by
the compaction, serve later uncompressed requests with the same prefix; no compaction writes a block another request
shares. With ``compression_chunk_size`` the state after each chunk end is kept, and a later compressed request with
the same prefix and options starts from it (:mod:`kvpress_critical_vllm.prefix_cache`). Every answer equals the same
request's answer with the prefix cache off.
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
    """A compressed and an uncompressed request with the same prompt in one batch: the uncompressed one hits the
    compressed one's blocks as they are prefilled; the compaction then writes its kept entries into fresh blocks,
    never into the shared ones (it is done, not left undone as ``shared_prefix``). Each answer is the reference's."""
    prompt = prompt_ids[1300:1900]
    before = counters(prefix_cache_engine)
    (compressed, _), (whole, hit) = generate(
        prefix_cache_engine, [(prompt, params(12)), (prompt, params(12, compression_ratio=0.0))]
    )
    after = counters(prefix_cache_engine)
    assert whole == generate(engine, [(prompt, params(12, compression_ratio=0.0))])[0][0]
    assert compressed == generate(engine, [(prompt, params(12))])[0][0]
    assert hit > 0  # the compressed request's blocks, shared while it was prefilled
    assert after["compactions"] == before["compactions"] + 1 and after["shared_prefix"] == before["shared_prefix"]


def test_a_document_compressed_once_serves_every_question(prefix_cache_engine, engine, prompt_ids):
    """With ``compression_chunk_size``: a first question on a 640-token document compacts it after every 128-token
    chunk and keeps each state (each chunk end is on a block boundary); four questions asked at once then start from
    the state after the whole document (640 tokens not computed, 40% of its entries per head held once for all), each
    compacting its own question into fresh blocks, never into the shared ones; a fifth, asked after, starts from the
    same blocks, unchanged. Every answer equals the same request's with the prefix cache off."""
    document = prompt_ids[100:740]
    questions = [prompt_ids[800 + 100 * i : 880 + 100 * i] for i in range(6)]  # longer than SnapKV's window
    chunked = params(12, compression_chunk_size=128)
    rounds = [
        [(document + questions[0], chunked)],
        [(document + q, chunked) for q in questions[1:5]],
        [(document + questions[5], chunked), (document + questions[1], params(12, compression_chunk_size=256))],
    ]
    before = counters(prefix_cache_engine)
    cached = [generate(prefix_cache_engine, requests) for requests in rounds]
    after = counters(prefix_cache_engine)
    reference = [generate(engine, requests) for requests in rounds]
    assert [[tokens for tokens, _ in r] for r in cached] == [[tokens for tokens, _ in r] for r in reference]
    first, second, third = cached
    assert first[0][1] == 0
    assert [hit for _, hit in second] == [len(document)] * 4  # the whole document, compressed
    assert third[0][1] == len(document)  # the kept blocks were not written by the four compactions
    assert third[1][1] == 0  # other options (another chunk size): another prefix, none kept
    assert after["compressed_prefixes_reused"] - before["compressed_prefixes_reused"] == 5
    assert after["prompt_tokens_reused"] - before["prompt_tokens_reused"] == 5 * len(document)
    assert after["shared_prefix"] == before["shared_prefix"]


def test_a_chat_resending_its_history_reuses_its_compressed_turns(prefix_cache_engine, engine, prompt_ids):
    """A three-turn chat, each turn compressed with ``compression_chunk_size`` and resending the history: each turn
    starts from the longest compressed prefix the turns before kept (a chunk end its own schedule compacts at), and
    answers as with the prefix cache off."""
    history, answers = prompt_ids[1200:1800], {}
    options = params(10, compression_chunk_size=128)
    for name, llm in (("cached", prefix_cache_engine), ("reference", engine)):
        before = counters(llm)
        turn, turns = history, []
        for i in range(3):
            ((answer, hit),) = generate(llm, [(turn, options)])
            turns.append((answer, hit, len(turn)))
            turn = turn + answer + prompt_ids[1900 + 100 * i : 2000 + 100 * i]
        answers[name] = turns
        reused = counters(llm)["compressed_prefixes_reused"] - before["compressed_prefixes_reused"]
        assert reused == (2 if name == "cached" else 0)
    assert [a for a, _, _ in answers["cached"]] == [a for a, _, _ in answers["reference"]]
    hits = [hit for _, hit, _ in answers["cached"]]
    lengths = [length for _, _, length in answers["cached"]]
    # the first turn's chunk ends (128 .. 512; its last chunk is merged); the second turn's run to 640
    assert hits == [0, 512, 640] and lengths[1] > 640


def test_identical_compressed_prompts_at_once_share_the_first_ones_prefix(prefix_cache_engine, engine, prompt_ids):
    """Two compressed requests with one 500-token prompt sent at once, and an uncompressed one with it: the second
    compressed request waits while the first keeps its chunks' states, then starts from the longest (384 tokens);
    the uncompressed one hits the blocks the first prefills, which its compactions then write into fresh blocks
    instead; a later, longer request starts from the same kept prefix. Every answer is the reference's."""
    prompt, longer = prompt_ids[1500:2000], prompt_ids[1500:2100]
    chunked = params(12, compression_chunk_size=128)
    batch = [(prompt, chunked), (prompt, chunked), (prompt, params(12, compression_ratio=0.0))]
    before = counters(prefix_cache_engine)
    together = generate(prefix_cache_engine, batch)
    (later,) = generate(prefix_cache_engine, [(longer, chunked)])
    after = counters(prefix_cache_engine)
    assert [t for t, _ in together] == [t for t, _ in generate(engine, batch)]
    assert later[0] == generate(engine, [(longer, chunked)])[0][0]
    # chunk ends 128, 256, 384 on block boundaries before the prompt's end (500)
    assert together[0][1] == 0 and together[1][1] == 384 and together[2][1] > 0
    assert later[1] == 384
    assert after["compressed_prefixes_reused"] - before["compressed_prefixes_reused"] == 2
    assert after["shared_prefix"] == before["shared_prefix"]  # no compaction left undone


def test_a_kept_prefix_whose_blocks_left_the_cache_is_computed_and_kept_again(prefix_cache_engine, engine, prompt_ids):
    """A kept compressed prefix whose blocks left vLLM's index (reused for other requests; here the prefix cache is
    reset) is no hit: the next request computes it and keeps it again, and the one after starts from it."""
    prompt, chunked = prompt_ids[200:800], params(8, compression_chunk_size=128)
    generate(prefix_cache_engine, [(prompt, chunked)])
    assert prefix_cache_engine.reset_prefix_cache()
    ((first, first_hit),) = generate(prefix_cache_engine, [(prompt, chunked)])
    ((again, hit),) = generate(prefix_cache_engine, [(prompt, chunked)])
    assert first_hit == 0 and hit == 512  # chunk ends 128 .. 512 on block boundaries before the prompt's end (600)
    assert first == again == generate(engine, [(prompt, chunked)])[0][0]
