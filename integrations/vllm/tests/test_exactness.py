"""The engine's greedy output equals transformers' after dropping the same entries, for every uniform press of the
plugin, in a batch beside head-wise, chunked, decoding and uncompressed requests (the mixed batch).

This checks the whole mechanism (reading the prompt back from the paged cache, writing each head's kept entries
into the slots of positions ``E .. N-1``, the shifted attention view, positions continuing from ``N``) against a
plain transformers cache holding exactly the positions the engine reports it kept; the uncompressed request beside
them must answer as the full cache does.
"""

import pytest
import torch
from conftest import results_of
from reference import greedy_after_eviction, greedy_mismatches, greedy_with_head_masks, margins_along
from workload import NEW_TOKENS, rows_of

UNIFORM = [row.name for row in rows_of("uniform")]


@pytest.mark.parametrize("name", UNIFORM)
def test_greedy_output_equals_transformers_with_the_same_entries_dropped(mixed_batch, reference_model, name):
    result = mixed_batch[name]
    prompt = result.prompt
    assert len(result.kept) == 30  # every layer of SmolLM2
    n_kept = {len(heads[0]) for heads in result.kept.values()}
    assert n_kept == {len(prompt) - (len(prompt) - int(len(prompt) * 0.5)) // 32 * 32}
    assert not greedy_mismatches(
        result.tokens, greedy_after_eviction, reference_model, prompt, result.kept, max_new_tokens=NEW_TOKENS
    )


def test_an_uncompressed_request_in_the_batch_answers_as_the_full_cache(mixed_batch, reference_model):
    (result,) = results_of(mixed_batch, "uncompressed")
    assert result.kept is None  # never compacted
    assert not greedy_mismatches(
        result.tokens, greedy_after_eviction, reference_model, result.prompt, None, max_new_tokens=NEW_TOKENS
    )


def test_compression_changes_the_cache(mixed_batch, reference_model):
    """The reference is sensitive to what is dropped: the full cache gives other tokens for some prompt."""
    results = results_of(mixed_batch, "uniform")[:3]
    assert any(
        greedy_mismatches(r.tokens, greedy_after_eviction, reference_model, r.prompt, None, max_new_tokens=NEW_TOKENS)
        for r in results
    )


def test_the_masked_reference_is_the_evicting_one_for_uniform_budgets(mixed_batch, reference_model):
    """``greedy_with_head_masks`` (the head-wise presses' reference) agrees with ``greedy_after_eviction`` where both
    apply: along the engine's answer, every step's logits margins are the same."""
    result = results_of(mixed_batch, "uniform")[0]
    masked = margins_along(result.tokens, greedy_with_head_masks, reference_model, result.prompt, result.kept)
    evicting = margins_along(result.tokens, greedy_after_eviction, reference_model, result.prompt, result.kept)
    torch.testing.assert_close(torch.tensor(masked), torch.tensor(evicting), atol=1e-3, rtol=0)
