"""Quality through vLLM: how often each press's greedy answer keeps the uncompressed engine's, uniform vs head-wise.

The project's quality prose (:func:`kvpress_critical.data.quality.generate_quality_dataset`: real prose with planted
facts, five questions per context) is served by one engine with the plugin: every question once uncompressed
(``compression_ratio`` 0) and once per ``--presses`` and ``--ratios`` (per request, ``vllm_xargs``-style
``extra_args``), greedy, all of them submitted at once (the engine batches requests whatever their options). Each prompt
is the context then the question in the model's chat template; the whole prompt is compressed once prefilled (SnapKV's
window, the prompt's last tokens, holds the question: a served request has no context-only phase). Reported per press
and ratio: the token agreement of the answer with the uncompressed one (the share of its ``--max-new`` tokens equal
position by position) and the share of answers that hold the expected value (RULER's string match); and, for each
head-wise press (``adakv_``), the paired difference with its uniform press at the same ratio, with a 95 % cluster
bootstrap interval over contexts (``evaluation/bootstrap.py``).

The schedules (docs/vllm.md, "Prompts and generations longer than the pool"): ``--chunk-size`` adds, for every
uniform press and ratio, a row compressed after every prompt chunk (``chunk C``); ``--compression-interval`` and
``--target-size`` add one compressed while decoding too (``decode I/T``, after the whole prompt or, with
``--chunk-size``, after every chunk), and at ratio 0 one where only the generation is compressed. Each schedule row is
compared with the same press compressed once after the prompt (at ratio 0: with the uncompressed engine). Decoding
compactions only happen in answers longer than the interval: ``--ignore-eos`` makes every answer ``--max-new`` tokens
long. The head-wise presses compress once after the prompt (they refuse the schedules).

``--kv-cache-dtype fp8`` (or ``fp8_e5m2``) serves every configuration a second time on an engine with that quantized KV
cache (rows ``... fp8``): the uncompressed one is the quantized cache alone, the others quantization and eviction
together, all compared with the float engine's uncompressed answers, and each with the same configuration on the float
cache in the last column.

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

HEADER = ["press", "ratio", "token agreement", "answers right", "agreement minus the baseline's [95 % CI]"]


def agreement(tokens: list[int], reference: list[int]) -> float:
    """Share of the reference answer's tokens the answer repeats position by position."""
    if not reference:
        return 1.0
    return sum(a == b for a, b in zip(tokens, reference)) / len(reference)


def right(text: str, answers) -> float:
    """RULER's string match: every expected value appears in the answer (case-insensitive)."""
    return float(all(str(answer).lower() in text.lower() for answer in answers))


def configurations(presses: list[str], ratios: list[float], chunk: int, interval: int, target: int) -> list[tuple]:
    """
    Every configuration as ``(label, press, ratio, options, baseline label)``: the uncompressed engine, each press and
    ratio compressed after the prompt, and each uniform press's schedules (chunks, decoding) beside it.
    """
    decode = {"compression_interval": interval, "target_size": target} if interval else None
    configs = [("uncompressed", "uncompressed", 0.0, {}, None)]
    if decode:  # only the generation is compressed
        configs += [(f"{p} decode {interval}/{target}", p, 0.0, {"press": p, **decode}, "uncompressed")
                    for p in presses if "adakv_" not in p]  # fmt: skip
    for ratio in ratios:
        for press in presses:
            head_wise = "adakv_" in press
            baseline = press.replace("adakv_", "") if head_wise else None
            configs.append((press, press, ratio, {"press": press}, baseline))
            if head_wise:
                continue
            schedules = []
            if chunk:
                schedules.append((f"{press} chunk {chunk}", {"compression_chunk_size": chunk}))
            if decode:
                schedules.append((f"{press} decode {interval}/{target}", dict(decode)))
            if chunk and decode:
                schedules.append(
                    (f"{press} chunk {chunk} decode {interval}/{target}", {"compression_chunk_size": chunk, **decode})
                )
            configs += [(label, press, ratio, {"press": press, **extra}, press) for label, extra in schedules]
    return configs


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
    parser.add_argument("--chunk-size", type=int, default=0, help="add rows compressed after every chunk of this size")
    parser.add_argument("--compression-interval", type=int, default=0, help="add rows compressed while decoding too")
    parser.add_argument("--target-size", type=int, default=0, help="entries per head kept while decoding")
    parser.add_argument(
        "--window-size", type=int, default=0, help="SnapKV's observation window (0: the plugin's default, 64)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="every answer --max-new tokens long")
    parser.add_argument("--kv-cache-dtype", default="auto", help="fp8, fp8_e5m2: every row again over that KV cache")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the logic, not the numbers)")
    args = parse_arguments(parser, argv)
    if args.quick:
        args.contexts, args.context_length, args.ratios = 2, 256, "0.5"
    if not args.model:
        parser.error("--model (or KVPRESS_CRITICAL_VLLM_MODEL): a model folder vLLM loads")
    if bool(args.compression_interval) != bool(args.target_size):
        parser.error("--compression-interval and --target-size go together (compression while decoding needs both)")
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams

    from evaluation.bootstrap import mean_difference, paired_bootstrap
    from kvpress_critical.data.quality import generate_quality_dataset

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = generate_quality_dataset(tokenizer, context_length=args.context_length, n_contexts=args.contexts)
    if args.quick:  # two questions of each context: every configuration still runs, with its bootstrap over contexts
        data = data.groupby("context_id", sort=False).head(2).reset_index(drop=True)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{row.context}\n\n{row.question}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for row in data.itertuples()
    ]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    ratios = [float(r) for r in args.ratios.split(",")]
    configs = configurations(
        args.presses.split(","), ratios, args.chunk_size, args.compression_interval, args.target_size
    )
    # a pool for every request at once, uncompressed (between 512 MiB and 4 GiB): fewer preemptions, whose recomputed
    # prompts change no answer but cost time
    config = AutoConfig.from_pretrained(args.model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element
    tokens = len(configs) * sum(len(p) + args.max_new + args.block_size for p in prompts)
    engines = {"auto": None} if args.kv_cache_dtype == "auto" else {"auto": None, args.kv_cache_dtype: None}
    for kv in engines:  # the quantized engine in the float one's bytes
        engines[kv] = LLM(
            args.model, dtype=args.dtype, enforce_eager=True, block_size=args.block_size, seed=0,
            max_model_len=max(map(len, prompts)) + args.max_new, kv_cache_dtype=kv,
            kv_cache_memory_bytes=min(4 * 2**30, max(512 * 2**20, tokens * token_bytes)),
            enable_prefix_caching=False, additional_config={"kvpress_critical": {"compression_ratio": 0.0}},
        )  # fmt: skip
    # every configuration's requests in one call (each request carries its options): the engine batches them
    requests, params = [], []
    for label, _, ratio, options, _ in configs:
        window = {"window_size": args.window_size} if args.window_size and options else {}
        extra = {"kvpress_critical": {"compression_ratio": ratio, **options, **window}}
        sampling = SamplingParams(max_tokens=args.max_new, temperature=0, ignore_eos=args.ignore_eos, extra_args=extra)
        requests += [{"prompt_token_ids": p} for p in prompts]
        params += [sampling] * len(prompts)
    answers = {}
    float_configs = list(configs)
    for kv, llm in engines.items():
        outputs = llm.generate(requests, params, use_tqdm=True)  # progress: answers done
        suffix = "" if kv == "auto" else f" {kv}"
        for i, (label, press, ratio, options, _) in enumerate(float_configs):
            chunk = outputs[i * len(prompts) : (i + 1) * len(prompts)]
            answers[(label + suffix, ratio)] = [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in chunk]
            if suffix:  # compared with the same configuration on the float cache
                configs.append((label + suffix, press, ratio, options, label))
    reference = answers[("uncompressed", 0.0)]
    clusters = data["context_id"].to_numpy()
    scores = {}
    for key, results in answers.items():
        scores[key] = (
            np.array([agreement(tokens, ref[0]) for (tokens, _), ref in zip(results, reference)]),
            np.array([right(text, row.answer) for (_, text), row in zip(results, data.itertuples())]),
        )
    rows, table = [], []
    for label, press, ratio, options, baseline in configs:
        agree, correct = scores[(label, ratio)]
        row = {"configuration": label, "press": press, "ratio": ratio,
               "compression_chunk_size": options.get("compression_chunk_size", 0),
               "compression_interval": options.get("compression_interval", 0),
               "target_size": options.get("target_size", 0), "token_agreement": float(agree.mean()),
               "right": float(correct.mean())}  # fmt: skip
        interval = ""
        if baseline is not None:
            base_ratio = 0.0 if baseline == "uncompressed" else ratio
            diff = paired_bootstrap(mean_difference, agree, scores[(baseline, base_ratio)][0], clusters=clusters)
            row.update(baseline=baseline, vs_baseline=diff.estimate, vs_baseline_low=diff.low,
                       vs_baseline_high=diff.high)  # fmt: skip
            if label.startswith(baseline + " fp8"):
                named = f"{baseline} on the float cache"
            elif baseline == "uncompressed" or "adakv_" in press:
                named = baseline
            else:
                named = f"{baseline} after the prompt"
            interval = f"{diff.format(3)} (vs {named})"
        rows.append(row)
        table.append([label, fmt(ratio), fmt(row["token_agreement"], 3), fmt(row["right"], 3), interval])
    schedules = ""
    if args.chunk_size or args.compression_interval:
        schedules = (
            "; schedules: `chunk C` compressed after every C-token prompt chunk, `decode I/T` every I generated tokens "
            "back to T entries per head, compared with the same press compressed once after the prompt"
        )
    details = (
        f"{len(data)} questions over {args.contexts} contexts of {args.context_length} tokens (the quality prose, five "
        f"questions each), greedy, {args.max_new} new tokens{' (end of sequence ignored)' if args.ignore_eos else ''}, "
        f"{args.dtype}, blocks of {args.block_size}; agreement with the uncompressed engine's answer, share of answers "
        "holding the expected value; last column: agreement minus the baseline's on the same questions (head-wise vs "
        f"uniform{schedules}), paired cluster bootstrap over contexts. Mean question tokens "
        f"{statistics.fmean(map(len, prompts)):.0f}"
    )
    title = "kvpress-critical's vLLM plugin: answers kept under uniform and head-wise budgets"
    name = "vllm_quality"
    if schedules:
        title = "kvpress-critical's vLLM plugin: answers kept by each compression schedule"
        name = "vllm_quality_schedules"
    if args.kv_cache_dtype != "auto":
        title = (
            f"kvpress-critical's vLLM plugin: answers kept with an {args.kv_cache_dtype} KV cache, eviction, and both"
        )
        name += f"_{args.kv_cache_dtype}"
        details += (
            f"; rows `... {args.kv_cache_dtype}` served by a second engine with kv_cache_dtype={args.kv_cache_dtype!r} "
            "in the same pool bytes, agreement still with the float engine's uncompressed answers"
        )
    markdown = result_header(title, args.device, details, model=Path(args.model).name)
    write_results(output_stem(args, name), rows, markdown + markdown_table(HEADER, table) + "\n")
    print(markdown_table(HEADER, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
