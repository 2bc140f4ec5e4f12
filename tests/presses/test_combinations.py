"""Every cell of the combinations table (docs/presses.md, from kvpress_critical.presses.combinations) is what running
the combination does: a "yes" runs (prefill and decoding, finite logits) and, where a layout changes, gives the logits
of the same selection in kvpress's layout; a "no" raises its reason, when built, entered or run."""

import contextlib

import pytest
import torch
from helpers import head_scores, tiny_model
from kvpress import DecodingPress
from transformers import DynamicCache

from kvpress_critical import ChunkedPrefillPress, CompactCachePress, CriticalKVPress
from kvpress_critical.cache import CompactLayer
from kvpress_critical.capabilities import capabilities, nested_presses
from kvpress_critical.presses.combinations import CHUNK, COLUMNS, ROWS, answer
from kvpress_critical.presses.decoding_compression import decoding_compression

K_LEN = 60


def run_prefill_and_decoding(model, press, padded: bool = False) -> tuple[DynamicCache, torch.Tensor]:
    """
    Prefill ``K_LEN`` tokens (two rows, the second left-padded when ``padded``) with ``press``, then decode 3: the
    cache and the last logits. Token ids are distinct, so no two keys tie on their norm.
    """
    generator = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(255, generator=generator)[:K_LEN] + 1 for _ in range(2)])
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
    return cache, out.logits


def held(cache) -> int:
    """Entries the first layer holds (compact: its packed context; dense: its length per head)."""
    layer = cache.layers[0]
    return layer.num_entries // (layer.batch_size * layer.num_kv_heads) if isinstance(layer, CompactLayer) else -1


def same_logits(got: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


def positions_matter_only_in_the_compact_layout(press) -> bool:
    """
    A pruning press that pools its scores over neighbouring positions (SnapKV's ``kernel_size``): after an earlier
    compression, the dense layout holds only the kept entries, so it pools over them, while the compact layout (as
    the masking one) pools over positions: their selections differ by design (docs/presses.md).
    """
    pooled = any(getattr(p, "kernel_size", 1) > 1 for p in nested_presses(press))
    return pooled and capabilities(press).selection == "pruning"


def run_cell(row: str, column: str, model) -> None:
    """Build, enter and run the combination, against its reference where the layout changes: raises what it raises."""
    make = lambda: ROWS[row](head_scores=head_scores(model))  # noqa: E731
    if column == "CompactCachePress(p)":
        cache, logits = run_prefill_and_decoding(model, CompactCachePress(make()))
        assert isinstance(cache.layers[0], CompactLayer)
        same_logits(logits, run_prefill_and_decoding(model, make())[1])  # the press alone: masking or pruning
    elif column == "padded batch, CompactCachePress(p)":
        run_prefill_and_decoding(model, CompactCachePress(make()), padded=True)  # rows alone: tests/serving
    elif column == "ChunkedPrefillPress(p)":
        run_prefill_and_decoding(model, ChunkedPrefillPress(make(), chunk_size=CHUNK))
    elif column == "CompactCachePress(ChunkedPrefillPress(p))":
        cache, logits = run_prefill_and_decoding(
            model, CompactCachePress(ChunkedPrefillPress(make(), chunk_size=CHUNK))
        )
        assert held(cache) < K_LEN
        if not positions_matter_only_in_the_compact_layout(make()):
            reference = ChunkedPrefillPress(make(), chunk_size=CHUNK)  # the masking layout, or pruning
            same_logits(logits, run_prefill_and_decoding(model, reference)[1])
    elif column == "CompactCachePress(DecodingPress(base_press=p))":

        def schedule():
            return DecodingPress(base_press=make(), compression_interval=2, target_size=40)

        cache, logits = run_prefill_and_decoding(model, CompactCachePress(schedule()))
        assert held(cache) <= 40 + 2
        if not positions_matter_only_in_the_compact_layout(make()):
            # the same schedule in the dense layout (masking for a head-wise base press, pruning otherwise); kvpress's
            # own hook differs for SnapKV-style scorers by design: it rotates the buffered window with the current
            # token's position (presses/decoding_compression.py)
            reference = lambda m: decoding_compression(m, schedule())  # noqa: E731
            same_logits(logits, run_prefill_and_decoding(model, reference)[1])
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
