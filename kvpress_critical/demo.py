"""The main job: CriticalKV on the embedded default model, next to the full cache and the base press.

``python -m kvpress_critical.demo`` (or ``make demo``) builds a long needle-in-a-haystack context, then
answers a question about it with the full cache, with the base press and with its CriticalKV variant,
printing each answer, the fraction of the KV cache evicted, and the prefill and end-to-end times.
"""

import argparse
import random
import time

import torch
from kvpress import AdaKVPress, ExpectedAttentionPress, KnormPress, SnapKVPress
from transformers import DynamicCache

from kvpress_critical.default_model import DEFAULT_MODEL_NAME, load_default_model
from kvpress_critical.modeling import attention_modules
from kvpress_critical.ops import resolve_backend
from kvpress_critical.presses import CriticalAdaKVPress, CriticalKVPress

BASE_PRESSES = {
    "snapkv": lambda ratio: SnapKVPress(ratio),
    "expected_attention": lambda ratio: ExpectedAttentionPress(ratio, use_vnorm=False),
    "knorm": lambda ratio: KnormPress(ratio),
}

_SUBJECTS = [
    "The old lighthouse",
    "A quiet river",
    "The village baker",
    "Our science teacher",
    "The night train",
    "A curious fox",
    "The mountain road",
    "The city library",
    "An autumn storm",
    "The market square",
]
_VERBS = [
    "watched over",
    "wound slowly past",
    "talked about",
    "was known for",
    "rattled through",
    "wandered near",
    "climbed toward",
    "kept records of",
    "swept across",
    "filled up with",
]
_OBJECTS = [
    "the sleeping harbour",
    "fields of golden wheat",
    "stories of distant travellers",
    "warm bread at dawn",
    "the valley before sunrise",
    "the edge of the forest",
    "forgotten maps",
    "every rooftop in town",
    "merchants and musicians",
    "the first snow of the year",
]


def haystack_context(tokenizer, n_tokens: int, needle: str, depth: float = 0.5, seed: int = 0) -> str:
    """About ``n_tokens`` tokens of varied filler sentences with ``needle`` inserted at ``depth``."""
    rng = random.Random(seed)
    sentences = []
    while len(tokenizer(" ".join(sentences)).input_ids) < n_tokens:
        sentences.extend(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}." for _ in range(20))
    sentences.insert(int(len(sentences) * depth), needle)
    return " ".join(sentences)


@torch.no_grad()
def prefill_stats(model, tokenizer, context: str, press) -> tuple[float, float]:
    """(seconds to prefill ``context`` with ``press``, fraction of KV entries evicted or masked)."""
    ids = tokenizer(context, return_tensors="pt").input_ids.to(model.device)
    cache = DynamicCache()
    start = time.perf_counter()
    if press is None:
        model.model(input_ids=ids, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=ids, past_key_values=cache)
    seconds = time.perf_counter() - start
    total = evicted = 0
    for layer, attn in zip(cache.layers, attention_modules(model)):
        bsz, heads, kept, _ = layer.keys.shape
        total += bsz * heads * ids.shape[1]
        evicted += bsz * heads * (ids.shape[1] - kept)
        masked = getattr(attn, "masked_key_indices", None)
        if masked is not None and press is not None:
            evicted += masked[0].numel()
    return seconds, evicted / total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio (fraction evicted)")
    parser.add_argument("--context-tokens", type=int, default=2000)
    parser.add_argument("--base", choices=sorted(BASE_PRESSES), default="snapkv")
    parser.add_argument("--norm", choices=("l1", "l2"), default="l1")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_default_model()
    from transformers import pipeline

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    needle = "The secret passphrase for the archive is violet-harbor-42."
    context = haystack_context(tokenizer, args.context_tokens, needle)
    question = "What is the secret passphrase for the archive?"
    n_tokens = len(tokenizer(context).input_ids)

    base = BASE_PRESSES[args.base]
    presses = {
        "full cache": None,
        f"{args.base}": base(args.ratio),
        f"CriticalKV({args.base})": CriticalKVPress(base(args.ratio), norm=args.norm, backend=args.backend),
        f"AdaKV({args.base})": AdaKVPress(base(args.ratio)),
        f"CriticalAdaKV({args.base})": CriticalAdaKVPress(base(args.ratio), norm=args.norm, backend=args.backend),
    }
    print(
        f"kvpress-critical demo: {DEFAULT_MODEL_NAME} (embedded), {model.device}, {model.dtype}, "
        f"attention={model.config._attn_implementation}, threads={torch.get_num_threads()}"
    )
    print(f"context: {n_tokens} tokens, needle at 50% depth; question: {question!r}; expected: 'violet-harbor-42'")
    backend = resolve_backend(args.backend, model.device)
    print(f"compression ratio {args.ratio}, norm {args.norm}, projected-norm backend {backend!r} ({args.backend})\n")
    header = f"{'press':<26} {'evicted':>8} {'prefill s':>10} {'total s':>8}  answer"
    print(header)
    print("-" * len(header))
    for name, press in presses.items():
        prefill_s, evicted = prefill_stats(model, tokenizer, context, press)
        start = time.perf_counter()
        answer = pipe(context, question=question, press=press, max_new_tokens=args.max_new_tokens)["answer"]
        total_s = time.perf_counter() - start
        found = "ok " if "violet-harbor-42" in answer else "   "
        print(f"{name:<26} {evicted:>8.1%} {prefill_s:>10.2f} {total_s:>8.2f}  {found}{answer.strip()!r}")
    print("\n'evicted' counts pruned entries (CriticalKV, SnapKV...) and masked ones (AdaKV family, which keeps")
    print("the cache size and masks keys during decoding). 'total' is the pipeline call: prefill + greedy decoding.")


if __name__ == "__main__":
    main()
