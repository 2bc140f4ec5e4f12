"""The engine's greedy output equals transformers' after dropping the same entries, for every press of the plugin.

This checks the whole mechanism (reading the prompt back from the paged cache, writing each head's kept entries
into the slots of positions ``E .. N-1``, the shifted attention view, positions continuing from ``N``) against a
plain transformers cache holding exactly the positions the engine reports it kept.
"""

import pytest
from conftest import NEW_TOKENS, PRESSES, internal_id, model_path
from reference import greedy_after_eviction, load_reference_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_model():
    return load_reference_model(model_path())


@pytest.mark.parametrize("index", range(len(PRESSES)), ids=PRESSES)
def test_greedy_output_equals_transformers_with_the_same_entries_dropped(batch, reference_model, index):
    prompts, outputs, selections = batch
    prompt, output = prompts[index], outputs[index]
    kept = selections[internal_id(selections, output.request_id)]
    assert len(kept) == 30  # every layer of SmolLM2
    n_kept = {len(heads[0]) for heads in kept.values()}
    assert n_kept == {len(prompt) - (len(prompt) - int(len(prompt) * 0.5)) // 32 * 32}
    got = list(output.outputs[0].token_ids)
    assert got == greedy_after_eviction(reference_model, prompt, kept, NEW_TOKENS)


def test_compression_changes_the_cache(batch, reference_model):
    """The reference is sensitive to what is dropped: the full cache gives other tokens for some prompt."""
    prompts, outputs, _ = batch
    full = [greedy_after_eviction(reference_model, p, None, NEW_TOKENS) for p in prompts[:3]]
    assert any(list(o.outputs[0].token_ids) != f for o, f in zip(outputs[:3], full))
