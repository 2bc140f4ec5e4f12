"""What quantizing the kept entries costs in answer likelihood, on the quality benchmark's prose.

The quality benchmark's prose source (facts planted in ~1K tokens of the Python Language Reference, five questions
per context; :func:`kvpress_critical.data.generate_quality_dataset`) on the embedded SmolLM2-135M-Instruct: for each
question, the reference answer's teacher-forced negative log-likelihood on the cache, and its loss against the full
float32 cache (the same tokens), with per-token KL ``KL(p_full || p)`` over the full cache's top-512 tokens
(:mod:`kvpress_critical.likelihood`). Caches compared:

- ``CompactCachePress(CriticalAdaKVPress(SnapKVPress(ratio)))`` with float32 entries and with ``quantize="int8"``,
  ``"int4"`` (one symmetric scale per entry) and ``"kivi4"`` (KIVI's layout: keys per channel over groups of 32
  entries of a head, values per entry, asymmetric), at ``--ratios`` (0: nothing evicted, the quantization alone);
- transformers' ``QuantizedCache`` (optimum-quanto, 4 and 2 bits, its defaults: groups of 64, the 128 most recent
  tokens unquantized) on the full cache.

Intervals: 95 % paired cluster bootstrap over contexts (the questions of a context share its cache), of the mean
loss and of the loss each quantized cache adds to the float32 compact cache at the same ratio.

    python benchmarks/bench_quantized_quality.py                       # 12 contexts, ratios 0 and 0.5
    python benchmarks/bench_quantized_quality.py --quick               # 2 contexts (the logic, not the numbers)
"""

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import fmt, markdown_table, output_stem, parse_arguments, result_header, write_results  # noqa: E402

from evaluation.bootstrap import mean_difference, paired_bootstrap  # noqa: E402

logger = logging.getLogger("bench_quantized_quality")

FORMATS = (None, "int8", "int4", "kivi4")
QUANTO_BITS = (4, 2)


def compact_press(ratio: float, quantize):
    from kvpress import SnapKVPress

    from kvpress_critical import CompactCachePress, CriticalAdaKVPress

    return CompactCachePress(CriticalAdaKVPress(SnapKVPress(ratio)), quantize=quantize)


def score_compact(pipe, groups, press) -> dict:
    """Per question: the likelihood record of the pipeline (the compressed cache scored, no greedy answer)."""
    pipe.records, pipe.scores = [], {}
    for context, questions in groups:
        pipe(context, questions=questions, press=press, max_new_tokens=1)
    return {r["sample_key"]: r for r in pipe.records}


def score_quanto(pipe, groups, bits: int) -> dict:
    """Per question: a full ``QuantizedCache`` of the context, then the teacher-forced target (kvpress's pipeline
    cannot remove tokens from a ``QuantizedCache``: one cache per question)."""
    from transformers import QuantizedCache

    from kvpress_critical.likelihood import coarse_kl, sample_key, teacher_forced_scores

    records = {}
    for context, questions in groups:
        for question in questions:
            key = sample_key(context, question)
            inputs = pipe.preprocess(context, [question], "", 10**9)
            context_ids = inputs["context_ids"]
            cache = QuantizedCache("quanto", pipe.model.config, nbits=bits)
            with torch.no_grad():
                pipe.model(input_ids=context_ids, past_key_values=cache)
                target_ids, scored = pipe.target_ids(pipe.targets[key])
                scores, logp = teacher_forced_scores(
                    pipe.model, cache, inputs["questions_ids"][0], target_ids, context_ids.shape[1], scored
                )
            reference = pipe.reference[key]
            kl = coarse_kl(reference.top_ids, reference.top_logp, logp)
            nll, nll_full = float(scores.nll.mean()), float(reference.nll.mean())
            records[key] = dict(nll=nll, nll_full=nll_full, kl_topk=float(kl.mean()))
    return records


def summarise(name, ratio, records, clusters, keys, base=None) -> dict:
    loss = np.array([records[k]["nll"] - records[k]["nll_full"] for k in keys])
    kl = np.array([records[k]["kl_topk"] for k in keys])
    interval = paired_bootstrap(lambda a: float(np.mean(a)), loss, clusters=clusters)
    row = dict(
        cache=name,
        ratio=ratio,
        questions=len(keys),
        contexts=len(set(clusters)),
        nll_loss=round(interval.estimate, 4),
        nll_loss_low=round(interval.low, 4),
        nll_loss_high=round(interval.high, 4),
        kl_topk=round(float(np.mean(kl)), 4),
    )
    if base is not None:
        base_loss = np.array([base[k]["nll"] - base[k]["nll_full"] for k in keys])
        added = paired_bootstrap(mean_difference, loss, base_loss, clusters=clusters)
        row.update(added=round(added.estimate, 4), added_low=round(added.low, 4), added_high=round(added.high, 4))
    logger.info("%s (ratio %s): %s", name, ratio, row)
    return row


def render(rows: list[dict]) -> str:
    header = [
        "cache",
        "ratio",
        "answer NLL loss vs full [95% CI]",
        "added by quantization [95% CI]",
        "KL vs full",
        "questions (contexts)",
    ]
    body = [
        [
            r["cache"],
            f"{r['ratio']:g}" if r["ratio"] is not None else "–",
            f"{fmt(r['nll_loss'], 3)} [{fmt(r['nll_loss_low'], 3)}, {fmt(r['nll_loss_high'], 3)}]",
            f"{fmt(r['added'], 3)} [{fmt(r['added_low'], 3)}, {fmt(r['added_high'], 3)}]" if "added" in r else "–",
            fmt(r["kl_topk"], 3),
            f"{r['questions']} ({r['contexts']})",
        ]
        for r in rows
    ]
    return markdown_table(header, body) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, default=12, help="prose contexts (five questions each)")
    parser.add_argument("--ratios", default="0,0.5", help="compression ratios of the compact caches")
    parser.add_argument("--quick", action="store_true", help="2 contexts, ratio 0.5 (the logic, not the numbers)")
    args = parse_arguments(parser, argv)
    if args.device.type != "cpu":
        parser.error("this benchmark runs the embedded model on CPU; use --device cpu")
    if args.quick:
        args.contexts, args.ratios = 2, "0.5"
    import kvpress  # noqa: F401  (registers kvpress's pipeline)

    from kvpress_critical.data import generate_quality_dataset
    from kvpress_critical.default_model import load_default_model
    from kvpress_critical.likelihood import LikelihoodPipeline, sample_key

    model, tokenizer = load_default_model()
    data = generate_quality_dataset(tokenizer, 1024, n_contexts=args.contexts, haystack="prose", seed=0)
    pipe = LikelihoodPipeline(model=model, tokenizer=tokenizer)
    pipe.targets = {sample_key(r.context, r.question): r.target for r in data.itertuples()}
    groups = [(context, group["question"].tolist()) for context, group in data.groupby("context", sort=False)]
    keys = [sample_key(context, q) for context, questions in groups for q in questions]
    clusters = np.array([i for i, (_, questions) in enumerate(groups) for _ in questions])

    pipe.score_only = True  # the reference: the full float32 cache
    score_compact(pipe, groups, None)
    pipe.reference = dict(pipe.scores)

    stem = output_stem(args, "quantized_quality")
    header = result_header(
        "Answer likelihood of quantized caches (the quality benchmark's prose)",
        args.device,
        f"{args.contexts} contexts of ~1K tokens, five questions each; the reference answers' teacher-forced NLL "
        "and KL against the full float32 cache; 95 % paired cluster-bootstrap intervals over contexts",
        model="SmolLM2-135M-Instruct (embedded), float32, sdpa",
    )
    rows = []
    configs = [(f"compact {fmt_ or 'float32'}", float(r), fmt_) for r in args.ratios.split(",") for fmt_ in FORMATS]
    configs += [(f"QuantizedCache (quanto int{bits}, full length)", None, bits) for bits in QUANTO_BITS]
    base = None
    for name, ratio, option in tqdm(configs, desc="caches", file=sys.stderr):
        if ratio is None:
            records = score_quanto(pipe, groups, option)
        else:
            records = score_compact(pipe, groups, compact_press(ratio, option))
            base = records if option is None else base
        rows.append(summarise(name, ratio, records, clusters, keys, base if ratio is not None and option else None))
        write_results(stem, rows, header + render(rows))
    print(header + render(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
