"""Head-importance profiling the way HeadKV does it: needle trials, and where each head looks while answering.

HeadKV (Fu et al. 2024, arXiv 2410.19258; its ``retrieval_head_detection_r2.py``, built on Wu et al.'s retrieval-head
detection) plants a needle in haystacks of several lengths and depths, lets the model answer greedily, and at every
generated token inspects each query head's attention from the newest query over the prompt:

- ``method="reasoning"`` (HeadKV's retrieval-reasoning score): the head's top-``k`` attended positions, ``k`` the
  needle's length in tokens; the attention it puts on those that fall inside the needle, ``10 * a / (k * n)`` per
  step (``n`` the number of generated tokens; HeadKV divides by the answer's length, which it also caps the
  generation at), summed over the answer;
- ``method="retrieval"`` (Wu et al.'s retrieval score): +``1 / k`` per step when the head's top-1 position is inside
  the needle and the generated token is the token at that position (copy-paste).

A trial counts only when the answer is right (HeadKV keeps successful trials only; ``require_correct``), and each
head's score list gets one value per counted trial. Here the haystacks are real prose (the Python Language Reference,
:mod:`kvpress_critical.data.text`) with three distractor needles of the same form (other keys, other values), the
needle "The special magic word for <key> is <value>." at each depth, asked "What is the special magic word for
<key>?" through the model's chat template. Attention is read in the attention function (any registered
implementation, e.g. sdpa) from the post-RoPE query and keys: no eager attention is needed.
"""

from __future__ import annotations

import logging
import random
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical.data import words
from kvpress_critical.data.text import prose_sentences
from kvpress_critical.modeling import decoder

logger = logging.getLogger(__name__)

METHODS = ("reasoning", "retrieval")
DEFAULT_LENGTHS = (500, 1000, 2000, 3000, 4000)
DEFAULT_DEPTHS = 10
_VALUES = tuple(
    "violin pelican lantern walnut compass saffron orchid canoe glacier falcon marble cinnamon tractor avocado trumpet "
    "volcano kettle sapphire cactus dolphin".split()
)


@dataclass
class Trial:
    """One needle trial: the prompt ids, where the needle sits in them, and the expected answer."""

    input_ids: torch.Tensor  # (1, L) the whole prompt (context, question, generation prompt)
    needle: tuple[int, int]  # token span [start, end) of the needle sentence in input_ids
    answer: str  # the value the answer must contain
    context_length: int = 0
    depth: float = 0.0
    meta: dict = field(default_factory=dict)


def _prompt(tokenizer, context: str, question: str) -> tuple[str, int]:
    """The prompt text through the chat template (if any), and where the context starts in it."""
    if tokenizer.chat_template is None:
        return context + "\n" + question + "\n", 0
    marker = "\x00CONTEXT\x00"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker + "\n" + question}], add_generation_prompt=True, tokenize=False
    )
    start = text.index(marker)
    return text.replace(marker, context), start


def build_trials(
    tokenizer, lengths=DEFAULT_LENGTHS, depths: int = DEFAULT_DEPTHS, n_needles: int = 2, seed: int = 0
) -> list[Trial]:
    """``len(lengths) * depths * n_needles`` trials (depths evenly spread from 0% to 100%), deterministic."""
    sentences = prose_sentences()
    trials = []
    for needle_index in range(n_needles):
        rng = random.Random(f"kvpress-critical-head-scores/{seed}/{needle_index}")
        keys = [f"{rng.choice(words.ADJECTIVES)} {rng.choice(words.NOUNS)}" for _ in range(4)]
        values = rng.sample(_VALUES, 4)
        needle = f"The special magic word for {keys[0]} is {values[0]}."
        distractors = [f"The special magic word for {k} is {v}." for k, v in zip(keys[1:], values[1:])]
        question = f"What is the special magic word for {keys[0]}?"
        start = rng.randrange(len(sentences))
        for length in lengths:
            filler, n = [], 0
            while n < length:  # consecutive prose sentences up to the length (measured with the tokenizer)
                sentence = sentences[(start + len(filler)) % len(sentences)]
                filler.append(sentence)
                n += len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
            for d in range(depths):
                depth = d / max(1, depths - 1)
                body = list(filler)
                for text in distractors:
                    body.insert(rng.randrange(len(body) + 1), text)
                position = round(depth * len(body))
                body.insert(position, needle)
                context = " ".join(body)
                prompt, offset = _prompt(tokenizer, context, question)
                char_start = offset + context.index(needle)
                encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
                ids = encoded["input_ids"]
                span = [
                    i
                    for i, (a, b) in enumerate(encoded["offset_mapping"])
                    if a < char_start + len(needle) and b > char_start
                ]
                trials.append(
                    Trial(
                        torch.tensor([ids]),
                        (span[0], span[-1] + 1),
                        values[0],
                        context_length=length,
                        depth=depth,
                        meta=dict(needle=needle_index),
                    )
                )
    return trials


@contextmanager
def _attention_probe(model, store: dict):
    """While active, store[layer] = (H, T) float32 attention of each query head's newest query (decoding steps)."""
    impl = model.config._attn_implementation
    if impl not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"head profiling reads attention in a registered attention function; {impl!r} is not one "
            "(load the model with attn_implementation='sdpa')"
        )
    original = ALL_ATTENTION_FUNCTIONS[impl]

    def probe(module, query, key, value, attention_mask, *args, **kwargs):
        if query.shape[2] == 1 and isinstance(key, torch.Tensor):
            scaling = kwargs.get("scaling")
            scaling = module.scaling if scaling is None else scaling
            group = query.shape[1] // key.shape[1]
            q = query[0, :, -1].float()  # (H, d)
            k = key[0].float().repeat_interleave(group, dim=0)  # (H, T, d)
            store[module.layer_idx] = torch.softmax(torch.einsum("hd,htd->ht", q, k) * scaling, dim=-1)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[impl] = probe
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[impl] = original


@torch.no_grad()
def score_trial(model, trial: Trial, method: str = "reasoning", max_new_tokens: int | None = None, tokenizer=None):
    """``(per-head score (n_layers, H), answer text, correct)`` of one trial."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    device = model.device
    ids = trial.input_ids.to(device)
    start, end = trial.needle
    span = end - start
    n_answer = max(1, len(tokenizer(" " + trial.answer, add_special_tokens=False)["input_ids"])) if tokenizer else 3
    budget = max_new_tokens or n_answer + 12  # room for the answer sentence ("The special magic word for ... is")
    layers = len(decoder(model).layers)
    heads = getattr(model.config, "text_config", model.config).num_attention_heads
    scores = torch.zeros(layers, heads, dtype=torch.float64)
    cache = DynamicCache()
    model.model(input_ids=ids[:, :-1], past_key_values=cache)  # HeadKV: prefill all but the last prompt token
    token = ids[:, -1:]
    generated: list[int] = []
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    store: dict = {}
    for step in range(budget):
        position = torch.tensor([[ids.shape[1] - 1 + step]], device=device)
        with _attention_probe(model, store):
            logits = model(input_ids=token, past_key_values=cache, position_ids=position).logits[0, -1]
        new = int(logits.argmax())
        for layer, attention in store.items():  # (H, T) over the prompt and what was generated before
            if method == "reasoning":
                values, positions = attention.topk(min(span, attention.shape[-1]), dim=-1)
                inside = (positions >= start) & (positions < end)
                scores[layer] += (10.0 * (values * inside).sum(-1) / span).double().cpu()
            else:
                top = attention.argmax(-1)  # (H,)
                prompt = torch.cat([ids[0], torch.tensor(generated, device=device, dtype=ids.dtype)])
                hit = (top >= start) & (top < end) & (prompt[top.clamp(max=prompt.numel() - 1)] == new)
                scores[layer] += (hit.double() / span).cpu()
        store.clear()
        if new in eos:
            break
        generated.append(new)
        token = torch.tensor([[new]], device=device)
    if method == "reasoning":
        scores /= step + 1  # per generated token, as HeadKV's 1 / n
    text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer else ""
    correct = trial.answer.lower() in text.lower()
    return scores, text, correct


def profile_head_scores(
    model,
    tokenizer,
    trials: list[Trial],
    method: str = "reasoning",
    require_correct: bool = True,
    progress: bool = True,
) -> tuple[dict[str, list[float]], dict]:
    """
    Run every trial and collect HeadKV-format scores: ``{"layer-head": [score of each counted trial]}``.

    Returns the scores and a summary (trials run, counted, accuracy per context length).
    """
    layers = len(decoder(model).layers)
    heads = getattr(model.config, "text_config", model.config).num_attention_heads
    collected = {f"{layer}-{head}": [] for layer in range(layers) for head in range(heads)}
    counted, by_length = 0, {}
    for trial in tqdm(trials, desc=f"head scores ({method})", disable=not progress):
        scores, _, correct = score_trial(model, trial, method, tokenizer=tokenizer)
        by_length.setdefault(trial.context_length, []).append(correct)
        if correct or not require_correct:
            counted += 1
            for layer in range(layers):
                for head in range(heads):
                    collected[f"{layer}-{head}"].append(float(scores[layer, head]))
    summary = dict(
        trials=len(trials),
        counted=counted,
        accuracy_by_length={str(k): sum(v) / len(v) for k, v in sorted(by_length.items())},
    )
    if counted == 0:
        logger.warning("no trial was answered correctly: every head's score list is empty")
    return collected, summary
