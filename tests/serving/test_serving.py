"""The compact cache where memory turns into throughput: padded batches, compression during decoding, quantized
entries, conversations over a compressed context, and the combinations that stay refused."""

import copy
import math

import pytest
import torch
from helpers import tiny_model
from kvpress import AdaKVPress, DecodingPress, DMSPress, KnormPress, PrefillDecodingPress, SnapKVPress
from transformers import DynamicCache

from kvpress_critical import CompactCachePress, CriticalAdaKVPress, CriticalKVPress, LayerDefensiveKVPress
from kvpress_critical.cache import CompactLayer, keep_mask_from_indices
from kvpress_critical.conversation import Conversation
from kvpress_critical.likelihood import target_tokens
from kvpress_critical.modeling import attention_modules
from kvpress_critical.ops.ragged_attention import ragged_attention, random_layout
from kvpress_critical.ops.ragged_attention.codes import (
    FORMATS,
    dequantize_rows,
    quantization_error_bound,
    quantize_entries,
    quantize_rows,
)
from kvpress_critical.presses.decoding_compression import decoding_compression

NEEDLES = [
    "The secret passphrase for the archive is violet-harbor-42.",
    "The lighthouse keeper is named Oskar.",
    "The code of the red gate is 4417.",
]
QUESTIONS = [
    "What is the secret passphrase for the archive?",
    "What is the name of the lighthouse keeper?",
    "What is the code of the red gate?",
]


def prompts(tokenizer, lengths):
    from kvpress_critical.data.text import haystack_context

    texts = []
    for i, n in enumerate(lengths):
        context = haystack_context(tokenizer, n, NEEDLES[i % 3], depth=0.4, seed=i)
        messages = [{"role": "user", "content": context + "\n" + QUESTIONS[i % 3]}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return texts


def generate(model, tokenizer, texts, press, max_new_tokens=5):
    tokenizer = copy.copy(tokenizer)  # left padding, with a pad token (SmolLM2's tokenizer has none)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with press(model):
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out.sequences[:, batch.input_ids.shape[1] :]
    return new, torch.stack(out.scores, dim=1)  # (B, T) tokens, (B, T, V) logits


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: CriticalAdaKVPress(SnapKVPress(0.5, window_size=16)),
        lambda: CriticalKVPress(SnapKVPress(0.5, window_size=16)),
        lambda: AdaKVPress(SnapKVPress(0.5, window_size=16)),
    ],
    ids=["CriticalAdaKV", "CriticalKV", "AdaKV"],
)
def test_a_padded_batch_answers_as_its_rows_alone(smollm2, make):
    """Left-padded rows of very different lengths: each row's logits and greedy answer are those of the row alone."""
    model, tokenizer = smollm2
    texts = prompts(tokenizer, [40, 240, 110])
    batched, batched_logits = generate(model, tokenizer, texts, CompactCachePress(make()))
    for row, text in enumerate(texts):
        alone, alone_logits = generate(model, tokenizer, [text], CompactCachePress(make()))
        assert torch.equal(batched[row], alone[0]), (row, tokenizer.decode(batched[row]), tokenizer.decode(alone[0]))
        torch.testing.assert_close(batched_logits[row], alone_logits[0], rtol=1e-4, atol=2e-3)


def test_padding_is_never_kept_and_each_row_keeps_its_own_budget():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[0, :25], mask[2, :8] = 0, 0  # rows of 15, 40 and 32 tokens
    cache = DynamicCache()
    press = CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=4)))
    with press(model):
        model.model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    for layer in cache.layers:
        kept = layer.segment_lengths().sum(-1)  # (B,) entries of each row over its KV heads
        assert kept.tolist() == [2 * int(n * 0.5) for n in (15, 40, 32)]
        for row, start in enumerate((25, 0, 8)):
            for head in range(2):
                assert int(layer.segments(row, head)[2].min()) >= start  # positions of real tokens only


def positions_kept(cache, model) -> list[list[list[set]]]:
    """Per layer, row and KV head, the positions of the entries held (compact) or not masked (masking layout)."""
    held = []
    for layer, module in zip(cache.layers, attention_modules(model)):
        if isinstance(layer, CompactLayer):
            per_head = layer.segment_lengths()
            rows = [
                [
                    set(layer.segments(b, h)[2].tolist()) | set(range(layer.context_length, layer.get_seq_length()))
                    for h in range(per_head.shape[1])
                ]
                for b in range(per_head.shape[0])
            ]
        else:
            keep = keep_mask_from_indices(module.masked_key_indices, layer.keys.shape[:3], "cpu")
            rows = [
                [set(keep[b, h].nonzero().flatten().tolist()) for h in range(keep.shape[1])]
                for b in range(keep.shape[0])
            ]
        held.append(rows)
    return held


def test_decoding_compression_keeps_the_budget_and_matches_the_masking_layout():
    """Every interval, each (row, KV head) is compressed back to the target size: the compact layout selects exactly
    the entries the masking layout keeps unmasked, step after step (SnapKV without pooling: its scores depend on
    each entry alone, not on which neighbours a layout packs next to it)."""
    model = tiny_model("llama")
    torch.manual_seed(0)
    context = torch.randint(0, 256, (2, 30))
    steps = torch.randint(0, 256, (2, 40))

    def schedule():
        return DecodingPress(
            base_press=CriticalAdaKVPress(SnapKVPress(window_size=4, kernel_size=1)),
            compression_interval=6,
            target_size=20,
            hidden_states_buffer_size=8,
        )

    histories = {}
    for layout in ("compact", "masking"):
        cache, history = DynamicCache(), []
        press = CompactCachePress(schedule()) if layout == "compact" else None
        scope = press(model) if press is not None else decoding_compression(model, schedule())
        with scope, torch.no_grad():
            model.model(input_ids=context, past_key_values=cache)
            for t in range(steps.shape[1]):
                position = torch.full((2, 1), 30 + t)
                model.model(input_ids=steps[:, t : t + 1], past_key_values=cache, position_ids=position)
                if (t + 1) % 6 == 0:  # just compressed: 20 entries per KV head on average, in every row
                    history.append(positions_kept(cache, model))
                    for layer in cache.layers:
                        if layout == "compact":
                            assert layer.tail_len == 0 and layer.segment_lengths().sum(-1).tolist() == [40, 40]
        histories[layout] = history
        for m in attention_modules(model):
            m.masked_key_indices = None
    assert len(histories["compact"]) == 6
    for step, (compact, masking) in enumerate(zip(histories["compact"], histories["masking"])):
        assert compact == masking, f"compression {step}"


def test_a_long_generation_holds_the_target_plus_one_interval():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(1))
    press = CompactCachePress(
        DecodingPress(base_press=CriticalKVPress(KnormPress()), compression_interval=8, target_size=16)
    )
    cache = DynamicCache()
    with press(model):
        model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=60, min_new_tokens=60, do_sample=False)
    for layer in cache.layers:
        lengths = layer.segment_lengths()
        assert bool((lengths == 16).all())  # a pruning base press: exactly the target in every head
        assert layer.tail_len < 8 and layer.get_seq_length() == 50 + 59  # the last token is generated, not fed
        assert layer.compressed_while_decoding


@pytest.mark.slow
def test_prefill_and_decoding_compression_through_kvpress_pipeline(smollm2_pipeline):
    pipe = smollm2_pipeline
    from kvpress_critical.data.text import haystack_context

    context = haystack_context(pipe.tokenizer, 300, NEEDLES[0])
    make = lambda: CompactCachePress(  # noqa: E731
        PrefillDecodingPress(
            prefilling_press=CriticalAdaKVPress(SnapKVPress(0.5)),
            decoding_press=DecodingPress(
                base_press=CriticalAdaKVPress(SnapKVPress()),
                compression_interval=4,
                target_size=100,
                hidden_states_buffer_size=16,
            ),
        )
    )
    cache = DynamicCache()
    answer = pipe(context, question=QUESTIONS[0], press=make(), max_new_tokens=12, cache=cache)["answer"]
    assert answer.strip()
    for layer in cache.layers:  # compressed back to 100 per head while the answer was generated
        assert isinstance(layer, CompactLayer) and layer.num_entries <= 3 * 100 + 3 * 4
    with pytest.raises(ValueError, match="multiple questions"):  # kvpress's rule for presses compressing answers
        pipe(context, questions=QUESTIONS[:2], press=make(), max_new_tokens=4)


def test_quantized_entries_are_within_half_a_scale():
    gen = torch.Generator().manual_seed(0)
    for bits in (8, 4):
        for dim in (64, 80, 7):
            x = torch.randn(33, dim, generator=gen) * torch.rand(33, 1, generator=gen) * 10
            x[3] = 0  # an all-zero row
            codes, scales = quantize_rows(x, bits)
            back = dequantize_rows(codes, scales, bits, dim, torch.float32)
            assert back.shape == x.shape
            assert bool(((back - x).abs().amax(-1) <= quantization_error_bound(x, bits)).all())
            assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
            assert codes.shape[1] == (dim if bits == 8 else math.ceil(dim / 2))


@pytest.mark.parametrize("quantize", ["int8", "int4", "kivi4"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_quantized_compact_attention_is_within_the_derived_bound(quantize, backend):
    """Attention over a quantized compact layer (the codes, as the model's steps read them) vs the same entries
    unquantized: within the bound the scales give (keys move every logit by at most scale * ||q||_1 * e_k, values the
    output by at most e_v, e the largest element error: half a scale)."""
    query, keys, values, cu, tail_k, tail_v = random_layout(2, 2, 3, 1, 64, [50, 0, 7, 120], tail_len=3)
    keys = keys + torch.randn(64, generator=torch.Generator().manual_seed(3)) * 3  # channels with their own offsets
    exact = ragged_attention(query, keys, values, cu, tail_k, tail_v, 3, 0.125, backend="torch")
    layer = CompactLayer(keys, values, cu, torch.zeros(keys.shape[0], dtype=torch.int32), 2, 2, 130, quantize=quantize)
    k, v = layer.context_keys, layer.context_values
    got = ragged_attention(query, k, v, cu, tail_k, tail_v, 3, 0.125, backend=backend)
    e_k, e_v = float(k.error_bound().max()), float(v.error_bound().max())
    assert bool(((k.dequantize() - keys).abs() <= k.error_bound()).all())
    assert bool(((v.dequantize() - values).abs() <= v.error_bound()).all())
    delta = 0.125 * query.abs().sum(-1).max() * e_k  # the largest change of a logit
    bound = values.abs().max() * (math.exp(2 * delta) - 1) + e_v
    assert 0 < float((got - exact).abs().max()) <= float(bound)  # within the bound, and really quantized
    codes = 177 * {"int8": 64, "int4": 32, "kivi4": 32}[quantize]
    per_entry = {"int8": 4, "int4": 4, "kivi4": 8}[quantize]  # scales (and zeros) of the values
    key_scales = 177 * 4 if quantize != "kivi4" else 7 * 64 * 8 + 177 * 4  # per entry, or per channel of 7 groups
    assert layer.nbytes(reserved=False) == 2 * codes + key_scales + 177 * per_entry + 5 * 8 + 177 * 4


def test_kivi4_keys_lose_less_than_per_entry_int4_where_channels_have_offsets():
    """The reason for KIVI's key layout: keys whose channels carry their own offsets (as RoPE'd keys do) lose less
    with a scale and zero per channel of a group than with one symmetric scale per entry."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(256, 64, generator=gen) + torch.randn(64, generator=gen) * 8
    cu = torch.tensor([0, 100, 256])
    per_entry = quantize_entries(keys, FORMATS["int4"][0], cu)
    per_channel = quantize_entries(keys, FORMATS["kivi4"][0], cu)
    error = lambda q: float((q.dequantize() - keys).pow(2).mean())  # noqa: E731
    assert error(per_channel) < 0.25 * error(per_entry)


@pytest.mark.slow
def test_quantized_compact_answers_like_the_unquantized_one(smollm2_pipeline):
    pipe = smollm2_pipeline
    from kvpress_critical.data.text import haystack_context

    context = haystack_context(pipe.tokenizer, 300, NEEDLES[1], depth=0.3)
    answers, sizes = {}, {}
    for quantize in (None, "int8", "int4", "kivi4"):
        cache = DynamicCache()
        press = CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)), quantize=quantize)
        answers[quantize] = pipe(context, question=QUESTIONS[1], press=press, max_new_tokens=8, cache=cache)["answer"]
        sizes[quantize] = sum(layer.nbytes(reserved=False) for layer in cache.layers)
    assert answers["int8"] == answers[None]  # int8 keeps the greedy answer
    assert sizes["int8"] < 0.3 * sizes[None] and sizes["int4"] < 0.17 * sizes[None]  # float32 model: 4 bytes each
    assert sizes["int4"] < sizes["kivi4"] < 0.2 * sizes[None]  # per-channel key scales and value zeros cost bytes


@pytest.mark.slow
def test_a_conversation_gives_the_same_answers_in_both_layouts(smollm2_pipeline):
    pipe = smollm2_pipeline
    from kvpress_critical.data.text import haystack_context

    context = haystack_context(pipe.tokenizer, 300, NEEDLES[0], depth=0.3)
    questions = [QUESTIONS[0], "Say it again, in capital letters.", "Which archive was it for?"]
    turns = {}
    for layout, press in [
        ("masking", CriticalAdaKVPress(SnapKVPress(0.5))),
        ("compact", CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)))),
    ]:
        chat = Conversation(pipe, context, press=press)
        turns[layout] = [chat.ask(q, max_new_tokens=8) for q in questions]
        held = chat.cache.layers[0]
        assert chat.position > chat.context_tokens + 3 * 8  # every turn's question and answer stayed
        if layout == "compact":
            assert held.tail_len == chat.position - chat.context_tokens  # the turns, in the tail
        for m in attention_modules(pipe.model):
            m.masked_key_indices = None
    assert turns["masking"] == turns["compact"]


@pytest.mark.slow
@pytest.mark.parametrize("golden", [False, True], ids=["own-answer", "reference-answer"])
def test_a_conversation_on_the_full_cache_is_the_whole_history_recomputed(smollm2_pipeline, golden):
    """Turn 2 on the full cache equals greedy decoding over the whole history recomputed from scratch: with the
    model's own first answer, or with a reference answer fed in its place (SCBench's golden history), whose
    teacher-forced NLL is then the one the recomputation gives."""
    pipe = smollm2_pipeline
    model, tokenizer = pipe.model, pipe.tokenizer
    context = "The old lighthouse on Gull Point was built in 1872. Its keeper, Mara Venn, kept a logbook."
    reference = "Mara Venn kept it." if golden else None  # unmarked: every token scored, the first one included
    chat = Conversation(pipe, context)
    first = chat.ask("Who kept a logbook?", max_new_tokens=6, reference_answer=reference)
    held = chat.turns[0][1]
    assert held == (reference if golden else first) and chat.answers == [first]
    second_ids = chat._turn_ids("When was the lighthouse built?")
    second = chat.ask("When was the lighthouse built?", max_new_tokens=6)
    history = pipe.preprocess(context, ["Who kept a logbook?"], "", 10**9)
    held_ids = tokenizer.encode(held, return_tensors="pt", add_special_tokens=False)
    prefix = torch.cat([history["context_ids"], history["questions_ids"][0]], dim=1)
    sequence = torch.cat([prefix, held_ids, second_ids], dim=1)
    generated = []
    with torch.no_grad():
        if golden:  # the reference's tokens, predicted from the recomputed history (not from the model's answer)
            logp = torch.log_softmax(model(input_ids=torch.cat([prefix, held_ids], dim=1)).logits[0].float(), -1)
            start = prefix.shape[1] - 1
            ids, scored = target_tokens(tokenizer, reference)
            positions = start + scored.nonzero().squeeze(-1)
            nll = -logp[positions].gather(-1, ids[0][scored].unsqueeze(-1)).squeeze(-1)
            torch.testing.assert_close(chat.reference_scores.nll, nll, rtol=1e-4, atol=1e-4)
        for _ in range(6):
            token = int(model(input_ids=sequence).logits[0, -1].argmax())
            if token == model.generation_config.eos_token_id:
                break
            generated.append(token)
            sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
    assert tokenizer.decode(generated, skip_special_tokens=True) == second


def test_unsupported_combinations_say_why():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    right_padded = torch.ones(2, 30, dtype=torch.long)
    right_padded[0, 20:] = 0
    with pytest.raises(NotImplementedError, match="pad on the left"):
        with CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=4)))(model):
            model.model(input_ids=ids, attention_mask=right_padded, past_key_values=DynamicCache())
    left_padded = right_padded.flip(-1)
    with pytest.raises(NotImplementedError, match="selects every layer at once"):
        with CompactCachePress(LayerDefensiveKVPress(0.5, window_size=4))(model):
            model.model(input_ids=ids, attention_mask=left_padded, past_key_values=DynamicCache())
    with pytest.raises(TypeError, match="DMSPress: its decoding compression needs the dense layout"):
        CompactCachePress(DMSPress(KnormPress(0.5), decoding=True))
    with pytest.raises(ValueError, match="quantize must be"):
        CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)), quantize="int3")
    with pytest.raises(ValueError, match="compresses while decoding"):  # it would compress the conversation's turns
        Conversation(None, "context", press=CompactCachePress(DecodingPress(base_press=KnormPress(), target_size=16)))
    with pytest.raises(ValueError, match="target_size sets the budget"):
        CompactCachePress(DecodingPress(base_press=KnormPress(), target_size=16)).compression_ratio = 0.5


def test_transformers_quantized_cache_is_refused_not_silently_kept_dense():
    pytest.importorskip("optimum.quanto", reason="optimum-quanto is in the quantized extra")
    from transformers import QuantizedCache

    model = tiny_model("llama")
    cache = QuantizedCache(backend="quanto", config=model.config, nbits=4)
    with pytest.raises(TypeError, match="quantize='int8', 'int4' or 'kivi4'"):
        with CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=4)))(model):
            model.model(input_ids=torch.randint(0, 256, (1, 30)), past_key_values=cache)
