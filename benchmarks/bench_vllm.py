"""vLLM with kvpress-critical's plugin: how many requests one KV pool holds at once, and the throughput that follows.

Two engines in one process, with the same fixed KV pool (``--pool-tokens``): stock vLLM, and vLLM with the plugin
(``additional_config={"kvpress_critical": ...}``), whose requests ask for each ``--presses`` and ``--ratios`` value
through ``SamplingParams.extra_args`` (by default the uniform ``critical_snapkv`` and the head-wise
``critical_adakv_snapkv``, whose rows also give their ratios to the uniform press at the same ratio), and for each
nonzero ``--chunk-sizes`` value the uniform presses compressed after every prompt chunk of that many tokens (rows
``<press> <ratio> chunk <size>``, with their ratios to the same press compressed once after the prompt). With
``--compression-interval`` and ``--target-size`` every uniform row gets a twin compressed while decoding too (kvpress's
``DecodingPress``: every interval of generated tokens back to ``target_size`` entries per head; rows ``... decode
I/T``; at ratio 0 the prompt stays whole and only the generation is compressed). Every run
submits the same ``--requests`` requests at once (prompts of ``--min-prompt``..``--max-prompt`` tokens,
``--min-new``..``--max-new`` new tokens, end of sequence ignored, greedy) and steps the engine until all are done;
runs are interleaved (stock, then each ratio and press, ``--repeats`` times) and the
table reports the median over repeats and the ratios to stock vLLM measured in the same repeat. Reported: peak
requests running at once, preemptions, requests/s, output tokens/s, mean and p90 time per output token (per request:
from its first to its last token) and mean time to first token. ``--lone-prompt N`` adds, per configuration, the time
to the first token of one ``N``-token prompt alone in the engine (what compressing after every chunk costs a prefill).
``--workload documents`` asks each of ``--documents`` documents ``--questions`` questions (requests sharing a prefix),
``--workload chats`` runs ``--chats`` conversations of ``--turns`` turns, each turn resending the history when the one
before ends; with ``--prefix-caching`` both engines keep vLLM's prefix cache on, and the table gives the prompt tokens
served from it and the TTFT's median and p90.

Run it in the plugin's environment (``make bench-vllm BENCH_VLLM_ARGS="..."``):

    python benchmarks/bench_vllm.py                                # SmolLM2, CPU, float32, 24 requests
    python benchmarks/bench_vllm.py --quick                        # tiny sizes: the logic, not numbers
    python benchmarks/bench_vllm.py --presses critical_snapkv --ratios 0,0.75 --requests 8 --min-prompt 128 \
        --max-prompt 256 --min-new 512 --max-new 1536 --pool-tokens 1792 --compression-interval 128 --target-size 256
                                                                   # long generations
    python benchmarks/bench_vllm.py --workload documents --prefix-caching --presses critical_snapkv --ratios 0.75 \
        --chunk-sizes 0,512 --min-prompt 2048 --max-prompt 4096 --documents 3 --questions 6 --pool-tokens 8192
                                                                   # a shared document, vLLM's prefix cache on
"""

import argparse
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process: the scheduler is read directly

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import fmt, markdown_table, output_stem, parse_arguments, result_header, write_results  # noqa: E402

logger = logging.getLogger("bench_vllm")
REPO = Path(__file__).resolve().parents[1]


def text_ids(tokenizer) -> list[int]:
    """Token ids of the repository's documentation and licence: English prose for prompts."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "LICENSE"])
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def workload(ids: list[int], args, seed: int = 0) -> list[list[tuple[list[int], int]]]:
    """The conversations of ``--workload``, each a list of turns ``(new user token ids, new tokens)``, deterministic
    in ``seed``: ``random``, one-turn requests of unrelated prompts; ``documents``, ``--documents`` documents of
    ``--min-prompt``..``--max-prompt`` tokens asked ``--questions`` questions each (one-turn requests sharing the
    document as a prefix); ``chats``, ``--chats`` conversations of ``--turns`` turns, each turn resending the history
    (its first message ``--min-prompt``..``--max-prompt`` tokens, the later ones 40-80)."""
    rng = random.Random(seed)

    def span(low: int, high: int) -> list[int]:
        length = rng.randint(low, high)
        start = rng.randrange(0, len(ids) - length)
        return ids[start : start + length]

    def new() -> int:
        return rng.randint(args.min_new, args.max_new)

    if args.workload == "documents":
        documents = [span(args.min_prompt, args.max_prompt) for _ in range(args.documents)]
        return [[(document + span(24, 48), new())] for document in documents for _ in range(args.questions)]
    if args.workload == "chats":
        return [
            [(span(args.min_prompt, args.max_prompt), new())] + [(span(40, 80), new()) for _ in range(args.turns - 1)]
            for _ in range(args.chats)
        ]
    return [[(span(args.min_prompt, args.max_prompt), new())] for _ in range(args.requests)]


def request_options(press: tuple | None) -> dict | None:
    """The plugin's per-request options of a configuration ``(name, ratio, compression_chunk_size, interval, target,
    window)`` (``window`` 0: the press's default observation window)."""
    if press is None:
        return None
    name, ratio, chunk, interval, target, window = press
    options = {"press": name, "compression_ratio": ratio, "compression_chunk_size": chunk}
    if interval:
        options.update(compression_interval=interval, target_size=target)
    if window:
        options.update(window_size=window)
    return {"kvpress_critical": options}


def lone_ttft(llm, prompt: list[int], press: tuple | None, tag: str) -> float:
    """Seconds from submitting one prompt alone to its first token."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, extra_args=request_options(press))
    llm.llm_engine.add_request(tag, {"prompt_token_ids": prompt}, params)
    start = time.perf_counter()
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(llm, conversations, press: tuple | None, tag: str, lone: list[int] | None = None) -> dict:
    """Submit the first turn of every conversation at once, and each next turn (the history, the answer and the new
    message) when the one before ends; step until all are done; what the scheduler and the clock saw. ``press``:
    ``(name, ratio, compression_chunk_size, compression_interval, target_size)`` of the plugin's requests (None: stock
    vLLM). ``lone``: a prompt whose time to first token alone is measured after them."""
    from vllm import SamplingParams

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    extra = request_options(press)
    submitted, prompts, turn = {}, {}, {}

    def submit(c: int, history: list[int]) -> None:
        user, new_tokens = conversations[c][turn.get(c, 0)]
        request_id = f"{tag}-{c}-{turn.get(c, 0)}"
        prompts[request_id] = (c, history + user)
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, extra_args=extra)
        llm.llm_engine.add_request(request_id, {"prompt_token_ids": history + user}, params)
        submitted[request_id] = time.perf_counter()

    start = time.perf_counter()
    for c in range(len(conversations)):
        submit(c, [])
    first, last, produced, reused, peak, preempted = {}, {}, {}, 0, 0, set()
    while llm.llm_engine.has_unfinished_requests():
        outputs = llm.llm_engine.step()
        now = time.perf_counter()
        peak = max(peak, len(scheduler.running))
        preempted.update(r.request_id for r in scheduler.waiting if r.num_preemptions)
        for output in outputs:
            n = len(output.outputs[0].token_ids)
            if n and output.request_id not in first:
                first[output.request_id] = now
            if n:
                last[output.request_id], produced[output.request_id] = now, n
            if output.finished:
                reused += output.num_cached_tokens or 0
                c, prompt = prompts[output.request_id]
                turn[c] = turn.get(c, 0) + 1
                if turn[c] < len(conversations[c]):
                    submit(c, prompt + list(output.outputs[0].token_ids))
    elapsed = time.perf_counter() - start
    tpot = [(last[r] - first[r]) / (produced[r] - 1) for r in produced if produced[r] > 1]
    ttft = [first[r] - submitted[r] for r in first]
    return {
        "peak_running": peak,
        "preempted": len(preempted),
        "seconds": elapsed,
        "requests_per_s": len(submitted) / elapsed,
        "output_tokens_per_s": sum(produced.values()) / elapsed,
        "tpot_ms_mean": 1000 * statistics.fmean(tpot),
        "tpot_ms_p90": 1000 * percentile(tpot, 0.9),
        "ttft_s_mean": statistics.fmean(ttft),
        "ttft_s_p50": percentile(ttft, 0.5),
        "ttft_s_p90": percentile(ttft, 0.9),
        "prompt_tokens_reused": reused,
        "lone_ttft_s": lone_ttft(llm, lone, press, f"{tag}-lone") if lone else float("nan"),
    }


HEADER = ["engine / press ratio", "peak running", "vs vLLM", "preempted", "requests/s", "output tok/s", "vs vLLM",
          "TPOT mean ms", "TPOT p90 ms", "TTFT mean s", "TTFT p50 / p90 s", "prompt tokens reused", "lone TTFT s",
          "vs uniform / prefill-only: peak, tok/s, TPOT, TTFT, lone TTFT"]  # fmt: skip
UNIFORM = "critical_snapkv"  # the head-wise rows are compared with this press at the same ratio
METRICS = ("peak_running", "preempted", "requests_per_s", "output_tokens_per_s", "tpot_ms_mean", "tpot_ms_p90",
           "ttft_s_mean", "ttft_s_p50", "ttft_s_p90", "prompt_tokens_reused", "lone_ttft_s")  # fmt: skip


def ratio_to(measured: dict, name: str, base: str, metric: str) -> float:
    """Median over the repeats of ``metric`` of ``name`` over ``base``'s, each measured in the same repeat."""
    return statistics.median(ours[metric] / theirs[metric] for ours, theirs in zip(measured[name], measured[base]))


def summarise(
    measured: dict, configs: list, goals: bool = True, twins: dict | None = None, cache_gain: dict | None = None
) -> tuple[list[dict], list[list]]:
    """Per configuration: the median of each metric over the repeats so far, its ratios to stock vLLM, (head-wise
    presses) to the uniform press at the same ratio, and (a quantized KV cache: ``twins``) to the same configuration
    over the float cache; ``cache_gain`` multiplies a row's goal (tokens per byte against the float cache)."""
    rows, table = [], []
    twins, cache_gain = twins or {}, cache_gain or {}
    for name, _, press in configs:
        ratio = None if press is None else press[1]
        median = {m: statistics.median(r[m] for r in measured[name]) for m in METRICS}
        pairs = list(zip(measured[name], measured["vLLM"]))
        row = {
            "config": name,
            "press": press[0] if press else "",
            "ratio": ratio or 0.0,
            "compression_chunk_size": press[2] if press else 0,
            "compression_interval": press[3] if press else 0,
            "target_size": press[4] if press else 0,
            "window_size": press[5] if press else 0,
            **median,
            "repeats": len(measured[name]),
            "output_throughput_vs_vllm": statistics.median(
                ours["output_tokens_per_s"] / base["output_tokens_per_s"] for ours, base in pairs
            ),
            "peak_running_vs_vllm": statistics.median(
                ours["peak_running"] / base["peak_running"] for ours, base in pairs
            ),
        }
        # head-wise rows against the uniform press, chunked or decoding rows against their press compressed once
        # after the prompt
        uniform = f"{UNIFORM} {ratio}" if press is None or not (press[2] or press[3]) else f"{press[0]} {ratio}"
        uniform += name[len(twins[name]) :] if name in twins else ""  # over the same KV cache dtype
        versus = ""
        if ratio and name != uniform and uniform in measured:
            row.update(
                peak_running_vs_uniform=ratio_to(measured, name, uniform, "peak_running"),
                output_throughput_vs_uniform=ratio_to(measured, name, uniform, "output_tokens_per_s"),
                tpot_vs_uniform=ratio_to(measured, name, uniform, "tpot_ms_mean"),
                ttft_vs_uniform=ratio_to(measured, name, uniform, "ttft_s_mean"),
                lone_ttft_vs_uniform=ratio_to(measured, name, uniform, "lone_ttft_s"),
            )
            versus = ", ".join(
                f"{fmt(row[key])}x"
                for key in ("peak_running_vs_uniform", "output_throughput_vs_uniform", "tpot_vs_uniform",
                            "ttft_vs_uniform", "lone_ttft_vs_uniform")
                if row[key] == row[key]  # not NaN (no lone prompt)
            )  # fmt: skip
        twin = twins.get(name)
        if twin in measured:
            row.update(
                kv_cache_dtype=name.rsplit(" ", 1)[-1],
                peak_running_vs_float_cache=ratio_to(measured, name, twin, "peak_running"),
                output_throughput_vs_float_cache=ratio_to(measured, name, twin, "output_tokens_per_s"),
            )
            versus = ", ".join(
                filter(None, [versus, f"{fmt(row['peak_running_vs_float_cache'])}x peak, "
                                      f"{fmt(row['output_throughput_vs_float_cache'])}x tok/s vs {twin}"])
            )  # fmt: skip
        rows.append(row)
        gain = cache_gain.get(name, 1)
        goal = "" if not (ratio and goals) else f" (goal {0.9 * gain / (1 - ratio):.2f})"
        table.append(
            [
                name,
                fmt(row["peak_running"], 0),
                f"{fmt(row['peak_running_vs_vllm'])}x{goal}",
                fmt(row["preempted"], 0),
                fmt(row["requests_per_s"], 3),
                fmt(row["output_tokens_per_s"], 1),
                f"{fmt(row['output_throughput_vs_vllm'])}x",
                fmt(row["tpot_ms_mean"], 1),
                fmt(row["tpot_ms_p90"], 1),
                fmt(row["ttft_s_mean"], 1),
                f"{fmt(row['ttft_s_p50'], 1)} / {fmt(row['ttft_s_p90'], 1)}",
                fmt(row["prompt_tokens_reused"], 0),
                fmt(row["lone_ttft_s"], 2) if row["lone_ttft_s"] == row["lone_ttft_s"] else "",
                versus,
            ]
        )
    return rows, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("KVPRESS_CRITICAL_VLLM_MODEL"), help="a folder vLLM loads")
    parser.add_argument("--presses", default="critical_snapkv,critical_adakv_snapkv", help="comma-separated")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument(
        "--chunk-sizes", default="0", help="comma-separated compression_chunk_size values; 0: after the prompt"
    )
    parser.add_argument("--compression-interval", type=int, default=0, help="with --target-size: decoding rows too")
    parser.add_argument("--target-size", type=int, default=0, help="entries per head kept while decoding")
    parser.add_argument(
        "--window-size", type=int, default=0, help="SnapKV's observation window (0: the plugin's default, 64)"
    )
    parser.add_argument("--lone-prompt", type=int, default=0, help="TTFT of one prompt of this many tokens alone")
    parser.add_argument(
        "--workload",
        choices=("random", "documents", "chats"),
        default="random",
        help="random prompts, documents asked several questions, or chats resending their history",
    )
    parser.add_argument("--documents", type=int, default=3, help="documents (--workload documents)")
    parser.add_argument("--questions", type=int, default=6, help="questions per document")
    parser.add_argument("--chats", type=int, default=4, help="conversations (--workload chats)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix cache on in both engines")
    parser.add_argument(
        "--kv-cache-dtypes", default="auto",
        help="comma-separated kv_cache_dtype values (auto, fp8, fp8_e4m3, fp8_e5m2): a stock and a plugin engine each, "
        "in the same pool bytes (the float cache's)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--min-prompt", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--min-new", type=int, default=128)
    parser.add_argument("--max-new", type=int, default=256)
    parser.add_argument("--pool-tokens", type=int, default=8192, help="the KV pool of both engines, in tokens")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the logic, not the numbers)")
    args = parse_arguments(parser, argv)
    if args.quick:
        args.requests, args.min_prompt, args.max_prompt, args.min_new, args.max_new = 4, 200, 300, 8, 16
        args.pool_tokens, args.repeats = 1024, 1
        args.documents, args.questions, args.chats, args.turns = 1, 3, 2, 2
        if args.compression_interval:  # one compaction while decoding
            args.min_new, args.max_new = args.compression_interval + 8, args.compression_interval + 16
    if bool(args.compression_interval) != bool(args.target_size):
        parser.error("--compression-interval and --target-size go together (kvpress's DecodingPress needs both)")
    if not args.model:
        parser.error("--model (or KVPRESS_CRITICAL_VLLM_MODEL): a model folder vLLM loads (make bench-vllm sets it)")
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM

    config = AutoConfig.from_pretrained(args.model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    token_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element
    blocks = args.pool_tokens // args.block_size
    pool_bytes = (blocks + 1) * args.block_size * token_bytes  # and vLLM's null block
    longest = (
        args.max_prompt
        + args.max_new
        + {"documents": 48, "chats": (args.turns - 1) * (80 + args.max_new)}.get(args.workload, 0)
    )
    common = dict(
        model=args.model, dtype=args.dtype, enforce_eager=True, block_size=args.block_size, seed=0,
        max_model_len=max(longest, args.lone_prompt + 1), kv_cache_memory_bytes=pool_bytes,
        enable_prefix_caching=args.prefix_caching,
    )  # fmt: skip
    kv_dtypes = args.kv_cache_dtypes.split(",")
    engines = {}  # kv_cache_dtype -> (stock, plugin), each in the same pool bytes
    for kv in kv_dtypes:
        stock = LLM(**common, kv_cache_dtype=kv)  # first: its layers take vLLM's own attention backend
        plugin = LLM(**common, kv_cache_dtype=kv, additional_config={"kvpress_critical": {"compression_ratio": 0.0}})
        engines[kv] = (stock, plugin)
    ids = text_ids(AutoTokenizer.from_pretrained(args.model))
    conversations = workload(ids, args)
    lone = (ids * (1 + args.lone_prompt // len(ids)))[: args.lone_prompt] if args.lone_prompt else None
    ratios = [float(r) for r in args.ratios.split(",")]
    presses = args.presses.split(",")
    chunks = [int(c) for c in args.chunk_sizes.split(",")]
    decoding = [(0, 0)] + ([(args.compression_interval, args.target_size)] if args.compression_interval else [])
    w = args.window_size

    def label(press: str, r: float, c: int, i: int, t: int) -> str:
        return f"{press} {r}" + (f" chunk {c}" if c else "") + (f" decode {i}/{t}" if i else "")

    def suffix(kv: str) -> str:
        return "" if kv == "auto" else f" {kv}"

    configs, twins, cache_gain = [], {}, {}
    for kv, (stock, plugin) in engines.items():
        rows_of_kv = [("vLLM", stock, None)] + [
            (label(press, r, c, i, t), plugin, (press, r, c, i, t, w))
            for r in ratios
            for press in presses
            for c in chunks
            for i, t in decoding
            if not ((c or i) and "adakv" in press)  # head-wise presses refuse compression_chunk_size and decoding
            and (r or i)  # ratio 0 without decoding compresses nothing
        ]
        for name, llm, press in rows_of_kv:
            configs.append((name + suffix(kv), llm, press))
            if kv != "auto":  # one byte an element: the float cache's element size more tokens per byte
                twins[name + suffix(kv)], cache_gain[name + suffix(kv)] = name, element
    # interleaved: each configuration over the float cache, then over the quantized ones
    bases = list(dict.fromkeys(twins.get(name, name) for name, _, _ in configs))
    configs.sort(key=lambda config: bases.index(twins.get(config[0], config[0])))
    measured = {name: [] for name, _, _ in configs}
    workload_name = "" if args.workload == "random" else f"_{args.workload}"
    # a hybrid model (sliding-window or linear-attention layers beside full-attention ones): the same pool bytes, its
    # own results
    kinds = set(getattr(config, "layer_types", None) or ())
    hybrid = next((kind for kind in ("sliding_attention", "linear_attention") if kind in kinds), "")
    model_name = {"sliding_attention": "_hybrid", "linear_attention": "_linear_hybrid", "": ""}[hybrid]
    quantized = "".join(f"_{kv}" for kv in kv_dtypes if kv != "auto")
    stem = output_stem(
        args, f"vllm{model_name}{workload_name}{'_prefix_cache' if args.prefix_caching else ''}{quantized}"
    )
    with tqdm(total=args.repeats * len(configs), desc="runs") as progress:
        for repeat in range(args.repeats):
            for name, llm, ratio in configs:
                measured[name].append(run(llm, conversations, ratio, f"{repeat}-{name}", lone))
                got = measured[name][-1]  # each run in the log: the table gives medians over the repeats
                logger.info(
                    "repeat %d, %s: peak %d, %.1f output tok/s, TPOT mean %.0f ms, TTFT mean %.1f s", repeat, name,
                    got["peak_running"], got["output_tokens_per_s"], got["tpot_ms_mean"], got["ttft_s_mean"],
                )  # fmt: skip
                progress.update()
            # a hybrid model's sliding-window layers keep their windows: no goal from the ratio alone
            rows, table = summarise(measured, configs, goals=not hybrid, twins=twins, cache_gain=cache_gain)
            what = {
                "random": f"{args.requests} requests submitted at once, prompts of {args.min_prompt}-{args.max_prompt} "
                "tokens",
                "documents": f"{args.documents} documents of {args.min_prompt}-{args.max_prompt} tokens asked "
                f"{args.questions} questions of 24-48 tokens each, all submitted at once",
                "chats": f"{args.chats} chats of {args.turns} turns submitted at once, each turn resending the history "
                f"(a first message of {args.min_prompt}-{args.max_prompt} tokens, then 40-80)",
            }[args.workload]
            details = (
                f"{what}, {args.min_new}-{args.max_new} new tokens (end of sequence ignored, greedy)"
                + (f", then one {args.lone_prompt}-token prompt alone (lone TTFT)" if lone else "")
                + (f"; SnapKV's window {args.window_size} tokens" if args.window_size else "")
                + "; one KV pool of "
                + (
                    f"the bytes of {args.pool_tokens} tokens in every layer ({args.dtype}; the full-attention layers' "
                    + (
                        "blocks and the sliding-window layers' windows share it) for both "
                        if hybrid == "sliding_attention"
                        else "blocks and the linear-attention layers' states share it) for both "
                    )
                    if hybrid
                    else f"{blocks} blocks of {args.block_size} tokens ({args.pool_tokens} tokens, {args.dtype}) "
                    "for both "
                )
                + ("engines" if len(kv_dtypes) == 1 else f"engines of each KV cache dtype ({', '.join(kv_dtypes)})")
                + "; engines in one process, enforce_eager, "
                f"{'prefix caching on' if args.prefix_caching else 'no prefix caching'}; medians of {repeat + 1} "
                "interleaved repeats, ratios to stock vLLM measured in the same repeat"
            )
            title = "kvpress-critical's vLLM plugin: requests at once and throughput in a fixed KV pool"
            markdown = result_header(title, args.device, details, model=Path(args.model).name)
            write_results(stem, rows, markdown + markdown_table(HEADER, table) + "\n")
    logger.info("wrote %s.md", stem)
    print(markdown_table(HEADER, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
