"""The main job: CriticalKV on the embedded default model, next to the full cache and the base presses.

``kvpress-critical-demo`` (or ``make demo``, ``python -m kvpress_critical.demo``) builds two contexts of ~768 tokens
of real prose (the Python Language Reference) with planted facts and five questions each (the quality benchmark's data,
:mod:`kvpress_critical.data.quality`), compresses each context once per press (context-only: the questions are not
seen) and answers every question from that one compressed cache. Per press it prints the fraction of the cache
evicted, the accuracy of the greedy answers (kvpress's string match of the first expected answer, each answer
continuing its answer prefix, e.g. "The special magic word for proud diamond is"), and the likelihood of the
reference answers under the compressed cache: the mean answer NLL, its loss vs the full cache and the per-token KL
from the full-cache distribution (:mod:`kvpress_critical.likelihood`; the full-cache run is the reference). The
likelihood moves long before the 0/1 answers of a 135M model do: it is what shows the difference. About a minute on
two CPU cores; the quality preset (``make eval-quality``) is the full sweep.
"""

import argparse
import time

import torch
from kvpress import AdaKVPress
from transformers import DynamicCache

from kvpress_critical.default_model import DEFAULT_MODEL_NAME, load_default_model
from kvpress_critical.modeling import attention_modules
from kvpress_critical.ops import PROJECTED_VALUE_NORM
from kvpress_critical.presses import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.presses.catalogue import BASE_PRESSES


def evicted_fraction(model, cache, context_length: int) -> float:
    """Fraction of the KV entries of a ``context_length``-token prefill that ``cache`` no longer holds or masks."""
    total = evicted = 0
    for layer, attn in zip(cache.layers, attention_modules(model)):
        bsz, heads, kept, _ = layer.keys.shape
        total += bsz * heads * context_length
        evicted += bsz * heads * (context_length - kept)
        masked = getattr(attn, "masked_key_indices", None)
        if masked is not None:
            evicted += masked[0].numel()
    return evicted / total


def split_target(target: str) -> tuple[str, str]:
    """``"The word is [[x]]."`` -> ``("The word is", "[[x]].")``: the answer prefix and what continues it."""
    cut = target.find("[[")
    if cut <= 0:
        return "", target
    return target[:cut].rstrip(), target[cut:] if target[cut - 1] != " " else " " + target[cut:]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio (fraction evicted)")
    parser.add_argument("--contexts", type=int, default=2, help="contexts (five questions each)")
    parser.add_argument("--context-tokens", type=int, default=768)
    parser.add_argument("--base", choices=sorted(BASE_PRESSES), default="snapkv")
    parser.add_argument("--norm", choices=("l1", "l2"), default="l1")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=6, help="greedy tokens after each answer prefix")
    args = parser.parse_args(argv)

    import transformers

    from kvpress_critical.data.quality import generate_quality_dataset
    from kvpress_critical.likelihood import LikelihoodPipeline, sample_key

    transformers.utils.logging.disable_progress_bar()  # no per-tensor "Loading weights" bars
    torch.manual_seed(0)
    model, tokenizer = load_default_model()
    pipe = LikelihoodPipeline(model=model, tokenizer=tokenizer)
    df = generate_quality_dataset(tokenizer, context_length=args.context_tokens, n_contexts=args.contexts)
    for r in df.itertuples():
        key = sample_key(r.context, r.question)
        pipe.answer_prefixes[key], pipe.targets[key] = split_target(r.target)
    groups = [(context, group) for context, group in df.groupby("context", sort=False)]

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
    print(
        f"{len(groups)} contexts of ~{args.context_tokens} tokens of real prose (the Python Language Reference) with "
        f"planted facts, {len(df)} questions; compression ratio {args.ratio} (context-only), norm {args.norm}, "
        f"projected-norm backend {PROJECTED_VALUE_NORM.resolve(args.backend, model.device)!r}"
    )
    first = df.iloc[0]
    print(f"example: {first['question']!r} -> {split_target(first['target'])[0]!r} ... {first['answer'][0]!r}\n")
    header = (
        f"{'press':<24} {'evicted':>8} {'accuracy':>9} {'answer NLL':>11} {'NLL loss':>9} {'KL vs full':>11} {'s':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, press in presses.items():
        start = time.perf_counter()
        pipe.records, pipe.scores = [], {}
        correct, evicted = [], None
        for context, group in groups:
            cache = DynamicCache()
            questions = group["question"].tolist()
            out = pipe(context, questions=questions, press=press, max_new_tokens=args.max_new_tokens, cache=cache)
            if evicted is None:  # the cache of the first context, as the press left it
                context_ids = pipe.preprocess(context, [], "", max_context_length=int(1e10))["context_ids"]
                evicted = evicted_fraction(model, cache, context_ids.shape[1])
            for answer, expected in zip(out["answers"], group["answer"]):
                correct.append(expected[0].lower() in answer.lower())
        if press is None:  # the full-cache run is the reference of the others
            pipe.reference = dict(pipe.scores)
            for record in pipe.records:
                record.update(kl_topk=0.0, nll_full=record["nll"])
        seconds = time.perf_counter() - start
        nll = sum(r["nll"] for r in pipe.records) / len(pipe.records)
        loss = sum(r["nll"] - r["nll_full"] for r in pipe.records) / len(pipe.records)
        kl = sum(r["kl_topk"] for r in pipe.records) / len(pipe.records)
        accuracy = sum(correct) / len(correct)
        print(f"{name:<24} {evicted:>8.1%} {accuracy:>9.1%} {nll:>11.3f} {loss:>+9.3f} {kl:>11.3f} {seconds:>6.1f}")
    print(
        "\n'evicted' counts pruned entries (CriticalKV, SnapKV) and masked ones (AdaKV family, which keeps the cache"
        "\nsize and masks keys during decoding; CompactCachePress frees them). 'accuracy': the greedy continuation of"
        "\neach answer prefix contains the answer; 'answer NLL': the reference answers' teacher-forced negative"
        "\nlog-likelihood (nats per answer token) on the same compressed cache; 'NLL loss' and 'KL vs full' compare it"
        "\nwith the full cache. Ten questions barely move the accuracy of a 135M model; the likelihood shows the"
        "\ndifference (docs: the quality benchmark, for the full sweep)."
    )


if __name__ == "__main__":
    main()
