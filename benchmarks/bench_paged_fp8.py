"""Micro-benchmark of the vLLM plugin's head-wise decoding attention over an fp8 KV cache against a float one.

``paged_ragged_attention`` (the head-wise rows' attention inside vLLM's paged cache) for one layer and one new token per
row: Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128), ``--rows`` rows of ``--averages``
kept entries per KV head on average (unequal across heads, as a head-wise budget leaves them) plus a tail of 40
tokens, 32-token blocks; the same entries stored as float32, bfloat16 and fp8 codes (``float8_e4m3fn``,
``float8_e5m2`` with per-tensor scales: what vLLM's ``kv_cache_dtype="fp8"`` holds), each read by every CPU backend.
Methods run interleaved round-robin on the same layout; the table gives the median time, the bytes of keys and values
the step reads, and each method's time over the float32 and bfloat16 caches' (same backend, same run).

    python benchmarks/bench_paged_fp8.py                 # 2 rows, 4K and 16K entries per head
    python benchmarks/bench_paged_fp8.py --quick         # tiny sizes: the logic, not the numbers
"""

import argparse
import logging
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    fmt,
    markdown_table,
    output_stem,
    parse_arguments,
    result_header,
    time_interleaved,
    write_results,
)

logger = logging.getLogger("bench_paged_fp8")
HEADER = ["entries / head", "cache", "backend", "KV bytes read", "median ms", "vs float32", "vs bfloat16"]
CACHES = {
    "float32": (torch.float32, None),
    "bfloat16": (torch.bfloat16, None),
    "fp8 e4m3": (torch.float32, torch.float8_e4m3fn),
    "fp8 e5m2": (torch.float32, torch.float8_e5m2),
}


def unequal_lengths(rows: int, kv_heads: int, average: int, seed: int = 0) -> list[list[int]]:
    """Per (row, KV head) kept entries: log-normal around ``average``, rescaled so that their mean is ``average``."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(rows, kv_heads, generator=gen) * 0.4)
    lengths = (draws / draws.mean() * average).round().long().clamp(min=1)
    return lengths.tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--averages", default="4096,16384", help="average kept entries per KV head")
    parser.add_argument("--rows", type=int, default=2, help="head-wise rows decoding together")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="tiny sizes")
    args = parse_arguments(parser, argv)
    from kvpress_critical.ops.paged_ragged_attention import (
        PAGED_RAGGED_ATTENTION,
        paged_ragged_attention,
        random_paged_layout,
    )

    averages = [64, 256] if args.quick else [int(a) for a in args.averages.split(",")]
    repeats = 3 if args.quick else args.repeats
    backends = [name for name in ("cpp", "torch") if PAGED_RAGGED_ATTENTION[name].availability() is None]
    kv_heads, group, head_dim, block, tail = 8, 4, 128, 32, 40
    stem = output_stem(args, "paged_fp8")
    header = result_header(
        "Head-wise decoding attention over fp8 and float KV caches (paged_ragged_attention)",
        args.device,
        f"median of {repeats} interleaved calls after a warm-up; Llama-3.1-8B attention (32 query heads, 8 KV heads, "
        f"head_dim 128), {args.rows} rows of one new token, unequal per-head lengths, a {tail}-token tail, "
        f"{block}-token blocks; the same layout stored in each cache format",
    )
    rows, table = [], []
    for average in averages:
        lengths = unequal_lengths(args.rows, kv_heads, average)
        inputs = {
            name: random_paged_layout(
                args.rows,
                kv_heads,
                group,
                1,
                head_dim,
                block,
                lengths,
                [tail] * args.rows,
                dtype=dtype,
                cache_dtype=codes,
                spare_blocks=0,
            )  # fmt: skip
            for name, (dtype, codes) in CACHES.items()
        }
        methods = {
            (name, backend): (lambda i=inputs[name], b=backend: paged_ragged_attention(**i, backend=b))
            for name in CACHES
            for backend in backends
        }
        logger.info("%d entries per head: %d methods", average, len(methods))
        times = time_interleaved(methods, repeats, args.device)
        entries = sum(map(sum, lengths)) + args.rows * kv_heads * tail
        for (name, backend), samples in times.items():
            median = statistics.median(samples)
            element = inputs[name]["region_keys"].element_size()
            row = {
                "entries_per_head": average, "cache": name, "backend": backend,
                "kv_bytes": 2 * entries * head_dim * element, "median_ms": median * 1e3,
                "vs_float32": median / statistics.median(times[("float32", backend)]),
                "vs_bfloat16": median / statistics.median(times[("bfloat16", backend)]),
            }  # fmt: skip
            rows.append(row)
            table.append([average, name, backend, f"{row['kv_bytes'] / 2**20:.1f} MiB", fmt(row["median_ms"], 3),
                          f"{fmt(row['vs_float32'])}x", f"{fmt(row['vs_bfloat16'])}x"])  # fmt: skip
        write_results(stem, rows, header + markdown_table(HEADER, table) + "\n")
    print(header + markdown_table(HEADER, table), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
