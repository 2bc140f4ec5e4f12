"""Quality through vLLM: how often each press's greedy answer keeps the uncompressed engine's, uniform vs head-wise.

The project's quality prose (:func:`kvpress_critical.data.quality.generate_quality_dataset`: real prose with planted
facts, five questions per context) is served by one engine with the plugin: every question once uncompressed
(``compression_ratio`` 0) and once per ``--presses`` and ``--ratios`` (per request, ``vllm_xargs``-style
``extra_args``), greedy. Each prompt is the context then the question in the model's chat template; the whole prompt
is compressed once prefilled (SnapKV's window, the prompt's last tokens, holds the question: a served request has no
context-only phase). Reported per press and ratio: the token agreement of the answer with the uncompressed one (the
share of its ``--max-new`` tokens equal position by position) and the share of answers that hold the expected value
(RULER's string match); and, for each head-wise press (``adakv_``), the paired difference with its uniform press at the
same ratio, with a 95 % cluster bootstrap interval over contexts (``evaluation/bootstrap.py``).

Run it in the plugin's environment (``make bench-vllm-quality``, or
``python benchmarks/bench_vllm_quality.py --out-dir results/benchmarks``); ``--quick`` checks the logic on tiny sizes.
"""

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository's kvpress_critical (its data module) and evaluation/
sys.path.insert(0, str(REPO / "benchmarks"))
from common import fmt, markdown_table, output_stem, parse_arguments, result_header, write_results  # noqa: E402

logger = logging.getLogger("bench_vllm_quality")

HEADER = ["press", "ratio", "token agreement", "answers right", "head-wise - uniform agreement [95 % CI]"]


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of the reference answer's tokens the answer repeats position by position."""
    if not reference:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference)) / len(reference)


def right(text: str, answers) -> float:
    """RULER's string match: every expected value appears in the answer (case-insensitive)."""
    return float(all(str(answer).lower() in text.lower() for answer in answers))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("KVPRESS_CRITICAL_VLLM_MODEL"), help="a folder vLLM loads")
    parser.add_argument("--presses", default="critical_snapkv,critical_adakv_snapkv,snapkv,adakv_snapkv")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--contexts", type=int, default=10)
    parser.add_argument("--context-length", type=int, default=768)
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the logic, not the numbers)")
    args = parse_arguments(parser, argv)
    if args.quick:
        args.contexts, args.context_length, args.ratios = 2, 384, "0.5"
    if not args.model:
        parser.error("--model (or KVPRESS_CRITICAL_VLLM_MODEL): a model folder vLLM loads")
    import numpy as np
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from evaluation.bootstrap import mean_difference, paired_bootstrap
    from kvpress_critical.data.quality import generate_quality_dataset

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = generate_quality_dataset(tokenizer, context_length=args.context_length, n_contexts=args.contexts)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{row.context}\n\n{row.question}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for row in data.itertuples()
    ]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    llm = LLM(
        args.model, dtype=args.dtype, enforce_eager=True, block_size=args.block_size, seed=0,
        max_model_len=max(map(len, prompts)) + args.max_new, kv_cache_memory_bytes=512 * 2**20,
        enable_prefix_caching=False, additional_config={"kvpress_critical": {"compression_ratio": 0.0}},
    )  # fmt: skip
    ratios = [float(r) for r in args.ratios.split(",")]
    configs = [("uncompressed", 0.0)] + [(p, r) for r in ratios for p in args.presses.split(",")]
    answers = {}
    for press, ratio in tqdm(configs, desc="configurations"):
        extra = {"kvpress_critical": {"compression_ratio": ratio, **({} if ratio == 0 else {"press": press})}}
        params = SamplingParams(max_tokens=args.max_new, temperature=0, extra_args=extra)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers[(press, ratio)] = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outputs]
    reference = answers[("uncompressed", 0.0)]
    clusters = data["context_id"].to_numpy()
    scores = {}
    for key, results in answers.items():
        scores[key] = (
            np.array([agreement(tokens, ref[0]) for (tokens, _), ref in zip(results, reference)]),
            np.array([right(text, row.answer) for (_, text), row in zip(results, data.itertuples())]),
        )
    rows, table = [], []
    for press, ratio in configs:
        agree, correct = scores[(press, ratio)]
        row = {"press": press, "ratio": ratio, "token_agreement": float(agree.mean()), "right": float(correct.mean())}
        interval = ""
        if "adakv_" in press:
            uniform = press.replace("adakv_", "")
            diff = paired_bootstrap(mean_difference, agree, scores[(uniform, ratio)][0], clusters=clusters)
            row.update(vs_uniform=diff.estimate, vs_uniform_low=diff.low, vs_uniform_high=diff.high)
            interval = f"{diff.format(3)} (vs {uniform})"
        rows.append(row)
        table.append([press, fmt(ratio), fmt(row["token_agreement"], 3), fmt(row["right"], 3), interval])
    details = (
        f"{len(data)} questions over {args.contexts} contexts of {args.context_length} tokens (the quality prose, five "
        f"questions each), greedy, {args.max_new} new tokens, {args.dtype}, blocks of {args.block_size}; agreement "
        "with the uncompressed engine's answer, share of answers holding the expected value; intervals: paired "
        f"cluster bootstrap over contexts. Mean question tokens {statistics.fmean(map(len, prompts)):.0f}"
    )
    title = "kvpress-critical's vLLM plugin: answers kept under uniform and head-wise budgets"
    markdown = result_header(title, args.device, details, model=Path(args.model).name)
    write_results(output_stem(args, "vllm_quality"), rows, markdown + markdown_table(HEADER, table) + "\n")
    print(markdown_table(HEADER, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
