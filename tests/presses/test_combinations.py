"""Every cell of the combinations table (docs/presses.md, from kvpress_critical.presses.combinations) is what running
the combination does: a "yes" runs (prefill and decoding, finite logits, entries evicted where the press evicts), a
"no" raises its reason, when built, entered or run."""

import contextlib

import pytest
import torch
from helpers import head_scores, tiny_model
from kvpress import DecodingPress
from transformers import DynamicCache

from kvpress_critical import ChunkedPrefillPress, CompactCachePress, CriticalKVPress
from kvpress_critical.cache import CompactLayer
from kvpress_critical.presses.combinations import CHUNK, COLUMNS, ROWS, answer

K_LEN = 60


def run_prefill_and_decoding(model, press, padded: bool = False) -> DynamicCache:
    """Prefill ``K_LEN`` tokens (two rows, the second left-padded when ``padded``) with ``press``, then decode 3."""
    ids = torch.randint(1, 256, (2, K_LEN), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, K_LEN, dtype=torch.long)
    if padded:
        mask[1, :20] = 0
    cache = DynamicCache()
    with press(model), torch.no_grad():
        model.model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        for t in range(3):
            position = torch.full((2, 1), K_LEN + t)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            out = model(input_ids=ids[:, t : t + 1], attention_mask=mask, past_key_values=cache, position_ids=position)
            assert torch.isfinite(out.logits).all()
    return cache


def held(cache) -> int:
    """Entries the first layer holds (compact: its packed context; dense: its length per head)."""
    layer = cache.layers[0]
    return layer.num_entries // (layer.batch_size * layer.num_kv_heads) if isinstance(layer, CompactLayer) else -1


def run_cell(row: str, column: str, model) -> None:
    """Build, enter and run the combination: raises what it raises."""
    make = lambda: ROWS[row](head_scores=head_scores(model))  # noqa: E731
    if column == "CompactCachePress(p)":
        cache = run_prefill_and_decoding(model, CompactCachePress(make()))
        assert isinstance(cache.layers[0], CompactLayer)
    elif column == "padded batch, CompactCachePress(p)":
        run_prefill_and_decoding(model, CompactCachePress(make()), padded=True)
    elif column == "ChunkedPrefillPress(p)":
        run_prefill_and_decoding(model, ChunkedPrefillPress(make(), chunk_size=CHUNK))
    elif column == "CompactCachePress(ChunkedPrefillPress(p))":
        cache = run_prefill_and_decoding(model, CompactCachePress(ChunkedPrefillPress(make(), chunk_size=CHUNK)))
        assert held(cache) < K_LEN
    elif column == "CompactCachePress(DecodingPress(base_press=p))":
        press = CompactCachePress(DecodingPress(base_press=make(), compression_interval=2, target_size=40))
        cache = run_prefill_and_decoding(model, press)
        assert held(cache) <= 40 + 2
    elif column == "Conversation(press=p)":
        from kvpress_critical.capabilities import conversation_refusal

        # a Conversation refuses before it touches the model (its pipeline needs a tokenizer): the same check
        refusal = conversation_refusal(make())
        if refusal is not None:
            raise ValueError(refusal)
        run_prefill_and_decoding(model, make())
    elif column == "CriticalKVPress(p)":
        run_prefill_and_decoding(model, CriticalKVPress(make()))
    else:
        raise AssertionError(column)


@pytest.mark.parametrize("column", list(COLUMNS))
@pytest.mark.parametrize("row", list(ROWS))
def test_each_cell_does_what_the_table_says(row, column):
    model = tiny_model("llama")
    reason = answer(row, column)
    if reason is None:
        run_cell(row, column, model)
        return
    with pytest.raises((TypeError, ValueError, NotImplementedError, AssertionError)) as error:
        with contextlib.ExitStack():
            run_cell(row, column, model)
    assert reason in str(error.value) or "DecodingPress requires a ScorerPress" in str(error.value), str(error.value)
