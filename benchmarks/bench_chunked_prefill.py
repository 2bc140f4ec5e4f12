"""Compression during chunked prefill: time to first token, peak memory, KV bytes and answers, end to end.

The paper's appendix B.6 protocol (DuoAttention's): the context is prefilled in chunks and the cache is compressed
back to its budget after every chunk, so later chunks attend over a smaller cache. For each context length and chunk
size (and one shot, no chunking), on one needle-in-a-haystack context, through kvpress's pipeline:

- ``full cache``: chunked prefill without compression (the baseline the paper's speed-ups are relative to);
- ``CriticalKV(SnapKV)``: pruning after every chunk;
- ``AdaKV(SnapKV) compact`` / ``CriticalAdaKV(SnapKV) compact``: head-wise budgets, the evicted entries freed after
  every chunk (``CompactCachePress(ChunkedPrefillPress(...))``).

Reported: TTFT (the pipeline call up to the logits of the first answer token: prefill, compression, the question),
the peak resident memory of the call above what was resident before it (Linux ``VmHWM``), the KV bytes held after
it, and the greedy answer (16 tokens): whether it contains the needle, and whether it equals the same method's
one-shot answer. Configurations of one context run back to back, methods interleaved within each chunk size.

    python benchmarks/bench_chunked_prefill.py                          # SmolLM2, CPU: 8K and 16K, ratio 0.5
    python benchmarks/bench_chunked_prefill.py --tokens 8192 --chunks 1024,2048 --ratio 0.75
"""

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compact_cache import kv_bytes, load_model  # noqa: E402
from common import (  # noqa: E402
    PeakResident,
    fmt,
    markdown_table,
    model_stem,
    parse_arguments,
    result_header,
    return_freed_memory_to_the_os,
    write_results,
)

from kvpress_critical import ChunkedPrefillPress, CompactCachePress, CriticalAdaKVPress, CriticalKVPress  # noqa: E402

logger = logging.getLogger("bench_chunked_prefill")

NEEDLE, VALUE = "The secret passphrase for the archive is violet-harbor-42.", "violet"
QUESTION = "What is the secret passphrase for the archive?"


def methods(ratio: float) -> dict:
    from kvpress import AdaKVPress, KnormPress, SnapKVPress

    return {
        "full cache": lambda: KnormPress(0.0),  # compresses nothing: the chunked prefill alone
        "CriticalKV(SnapKV)": lambda: CriticalKVPress(SnapKVPress(ratio)),
        "AdaKV(SnapKV) compact": lambda: AdaKVPress(SnapKVPress(ratio)),
        "CriticalAdaKV(SnapKV) compact": lambda: CriticalAdaKVPress(SnapKVPress(ratio)),
    }


def build(name: str, make, chunk: int | None):
    press = make()
    if chunk is not None:
        press = ChunkedPrefillPress(press, chunk_size=chunk)
    return CompactCachePress(press) if name.endswith("compact") else press


@torch.no_grad()
def run(pipe, context: str, press) -> dict:
    from transformers import DynamicCache

    first_token = []
    forward = pipe.model.forward

    def timed_forward(*args, **kwargs):  # the question's forward gives the first answer token's logits
        out = forward(*args, **kwargs)
        if not first_token:
            first_token.append(time.perf_counter())
        return out

    pipe.model.forward = timed_forward
    cache = DynamicCache()
    try:
        with PeakResident() as memory:
            start = time.perf_counter()
            answer = pipe(context, question=QUESTION, press=press, max_new_tokens=16, cache=cache)["answer"]
    finally:
        del pipe.model.forward
    for module in pipe.model.model.layers:
        module.self_attn.masked_key_indices = None
    return dict(
        ttft_s=round(first_token[0] - start, 3),
        peak_mib=None if memory.extra is None else round(memory.extra / 2**20, 1),
        kv_mib=round(kv_bytes(cache) / 2**20, 2),
        answer=answer.strip(),
    )


def render(rows: list[dict]) -> str:
    header = [
        "tokens",
        "chunk",
        "method",
        "TTFT s (speed-up vs full cache)",
        "peak MiB (x full cache)",
        "KV MiB",
        "needle found",
        "answer = one-shot",
    ]
    body = [
        [
            r["tokens"],
            r["chunk"] or "one shot",
            r["method"],
            f"{fmt(r['ttft_s'], 2)} ({fmt(r['ttft_x'])})",
            f"{fmt(r['peak_mib'], 0)} ({fmt(r['peak_x'])})",
            fmt(r["kv_mib"], 1),
            "yes" if r["found"] else "no",
            "–" if r["chunk"] is None else ("yes" if r["same_as_one_shot"] else "no"),
        ]
        for r in rows
    ]
    return markdown_table(header, body) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2) or config:llama-3.1-8b")
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--chunks", default="1024,2048,4096", help="chunk sizes (one shot is always added)")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio (the paper: 50%% cache)")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the method names")
    parser.add_argument("--repeats", type=int, default=1, help="(accepted for gpu_check.sh; one pass per config)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (gpu_check dry run)")
    args = parse_arguments(parser, argv)
    device = args.device
    precise = return_freed_memory_to_the_os()
    if args.quick:
        args.tokens, args.chunks = "600", "256"
    from kvpress import KVPressTextGenerationPipeline  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from kvpress_critical.data.text import haystack_context

    model, tokenizer, label = load_model(args.model, device, None)
    if tokenizer is None:
        raise SystemExit("bench_chunked_prefill needs a model with a tokenizer (--model default)")
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=device)
    chunks = [int(c) for c in args.chunks.split(",")] + [None]
    chosen = methods(args.ratio)
    if args.methods:
        chosen = {k: v for k, v in chosen.items() if k in args.methods.split(",")}
    stem = model_stem(args, "chunked_prefill")
    header = result_header(
        "Compression during chunked prefill",
        device,
        f"compression ratio {args.ratio:g}; one needle-in-a-haystack context per length, greedy answers of 16 "
        "tokens; one run per configuration; peak memory from the process's resident high-water mark"
        f"{'' if precise else ' (allocator cache included)'}",
        model=label,
    )
    rows = []
    for n_tokens in [int(t) for t in args.tokens.split(",")]:
        context = haystack_context(tokenizer, n_tokens, NEEDLE, depth=0.4, seed=n_tokens)
        run(pipe, context[: len(context) // 8], None)  # warm-up: one-time initialisations
        group = []
        for chunk in chunks:
            if chunk is not None and chunk >= n_tokens:
                continue
            for name, make in chosen.items():
                row = dict(tokens=n_tokens, chunk=chunk, method=name, **run(pipe, context, build(name, make, chunk)))
                row["found"] = VALUE in row["answer"]
                group.append(row)
                logger.info(
                    "%d tokens, chunk %s, %-30s TTFT %.2f s, peak %s MiB, KV %.1f MiB: %r",
                    n_tokens,
                    chunk or "one shot",
                    name,
                    row["ttft_s"],
                    row["peak_mib"],
                    row["kv_mib"],
                    row["answer"],
                )
        for row in group:
            full = next(r for r in group if r["chunk"] == row["chunk"] and r["method"] == "full cache")
            one_shot = next((r for r in group if r["chunk"] is None and r["method"] == row["method"]), row)
            row["ttft_x"] = round(full["ttft_s"] / row["ttft_s"], 3)  # > 1: faster than the full cache
            row["peak_x"] = (
                None
                if not full["peak_mib"] or row["peak_mib"] is None
                else round(row["peak_mib"] / full["peak_mib"], 3)
            )
            row["same_as_one_shot"] = row["answer"] == one_shot["answer"]
        rows += group
        write_results(stem, rows, header + render(rows))
    print(header + render(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
