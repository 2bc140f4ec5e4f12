"""Micro-benchmark of one layer's decoding attention on the compact layout against dense ``F.sdpa``.

Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128), batch 1, one new token, and an average of
4K-32K kept entries per KV head, **unequal across heads** (a head-wise budget: lengths drawn from a log-normal and
rescaled to the average, the longest about 3x the shortest), against ``scaled_dot_product_attention`` (GQA, no
``repeat_kv``) over a dense cache with the same number of entries in total (every head at the average length): the
cost a pruning press with the same budget would pay. Methods run interleaved round-robin on the same inputs, with a
streaming read of as many bytes as the compact layout's keys and values (``torch.sum`` over float32): the bandwidth
limit of a kernel that reads K and V once, measured in the same run. "% of read bandwidth" is the method's rate over
the bytes it reads (its median time) against that read's rate (100 %: the method runs at the machine's read
bandwidth). The same entries stored as codes (``CompactCachePress(quantize=...)``'s formats: ``int8``, ``int4``,
``kivi4``; ``kvpress_critical.ops.ragged_attention.codes``) are read by every backend that takes them (``cpp``,
``torch``, ``triton``), their bytes counted as codes plus scales (and zeros, groups); on CPU, "layer dequantized
first" is the path that dequantizes the layer into a float copy and attends to it (what a step did before the kernels
read codes). "x compact float" compares each method with the fastest float ragged method of its row group.

    python benchmarks/bench_ragged_attention.py                  # CPU: cpp and torch backends, fp32 and bf16
    python benchmarks/bench_ragged_attention.py --device cuda    # GPU: triton, flash when installed, bf16
"""

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    fmt,
    markdown_table,
    output_stem,
    parse_arguments,
    result_header,
    summary,
    time_interleaved,
    write_results,
)

from kvpress_critical.ops.ragged_attention import RAGGED_ATTENTION, ragged_attention  # noqa: E402
from kvpress_critical.ops.ragged_attention.codes import FORMATS, quantize_entries  # noqa: E402

logger = logging.getLogger("bench_ragged_attention")

SHAPE = dict(heads=32, kv_heads=8, head_dim=128)  # Llama-3.1-8B / Mistral-7B
READ = "streaming read (sum over the K+V bytes)"  # the machine's read bandwidth, measured interleaved with the methods


def unequal_lengths(average: int, heads: int, seed: int = 0) -> list[int]:
    """Per-head lengths with the given average, log-normally spread (a head-wise budget's typical imbalance)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.exp(0.45 * torch.randn(heads, generator=gen))
    lengths = (weights / weights.sum() * average * heads).round().long()
    lengths[0] += average * heads - int(lengths.sum())  # exact total
    return lengths.tolist()


def run_case(average: int, dtype: torch.dtype, args, device: torch.device) -> list[dict]:
    heads, kv_heads, d = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    lengths = unequal_lengths(average, kv_heads)
    gen = torch.Generator().manual_seed(1)
    n = sum(lengths)
    query = torch.randn(1, heads, 1, d, generator=gen).to(device, dtype)
    keys = torch.randn(n, d, generator=gen).to(device, dtype)
    values = torch.randn(n, d, generator=gen).to(device, dtype)
    cu = torch.tensor([0] + lengths).cumsum(0)
    tail = torch.randn(1, kv_heads, 64, d, generator=gen).to(device, dtype)
    dense_k = torch.randn(1, kv_heads, average + 1, d, generator=gen).to(device, dtype)
    dense_v = torch.randn(1, kv_heads, average + 1, d, generator=gen).to(device, dtype)
    scale = d**-0.5

    def dense():
        return F.scaled_dot_product_attention(query, dense_k, dense_v, enable_gqa=True)

    bytes_read = 2 * n * d * keys.element_size()
    stream = torch.ones(bytes_read // 4, dtype=torch.float32, device=device)  # the machine's limit, same bytes
    fns = {READ: lambda: stream.sum(), "sdpa (dense, same entries)": dense}
    method_bytes = {READ: bytes_read, "sdpa (dense, same entries)": bytes_read}
    entries = {"": (keys, values)}
    for name, (key_spec, value_spec) in FORMATS.items():
        entries[f" {name}"] = (quantize_entries(keys, key_spec, cu), quantize_entries(values, value_spec, cu))
    for suffix, (k, v) in entries.items():
        for name in RAGGED_ATTENTION.available(device):
            if RAGGED_ATTENTION[name].refusal(query, k) is None:
                fns[f"ragged {name}{suffix}"] = lambda b=name, k=k, v=v: ragged_attention(
                    query, k, v, cu, tail, tail, 1, scale, max_seqlen=max(lengths), backend=b
                )
                method_bytes[f"ragged {name}{suffix}"] = bytes_read if not suffix else k.nbytes + v.nbytes
    if device.type == "cpu" and "cpp" in RAGGED_ATTENTION.available(device):  # the path before in-kernel codes
        for bits in (8, 4):
            k, v = entries[f" int{bits}"]
            fns[f"ragged cpp int{bits}, layer dequantized first"] = lambda k=k, v=v: ragged_attention(
                query, k.dequantize(dtype), v.dequantize(dtype), cu, tail, tail, 1, scale, backend="cpp"
            )
            method_bytes[f"ragged cpp int{bits}, layer dequantized first"] = k.nbytes + v.nbytes
    if args.quick:
        fns = {k: v for k, v in fns.items() if "torch" not in k}
    times = time_interleaved(fns, args.repeats, device)
    base = summary(times["sdpa (dense, same entries)"])[0]
    read = summary(times[READ])[1]  # medians: a single fast read (a quiet moment) would set the limit too high
    read_rate = bytes_read / read
    floats = [summary(times[f"ragged {name}"])[0] for name in RAGGED_ATTENTION.names() if f"ragged {name}" in times]
    compact = min(floats) if floats else float("nan")
    rows = []
    for name, samples in times.items():
        best, median = summary(samples)
        moved = method_bytes[name]
        rows.append(
            dict(
                average_entries=average,
                longest=max(lengths),
                shortest=min(lengths),
                dtype=str(dtype).replace("torch.", ""),
                method=name,
                best_ms=round(best * 1e3, 4),
                median_ms=round(median * 1e3, 4),
                x_sdpa=round(best / base, 3),
                x_compact_float=round(best / compact, 3),
                mib_read=round(moved / 2**20, 1),
                gb_per_s=round(moved / best / 1e9, 1),
                pct_read_bandwidth=round(100 * moved / median / read_rate, 1),  # rates over the bytes each reads
            )
        )
        logger.info(
            "avg %6d %s %-28s %8.3f ms (x sdpa %.2f)", average, rows[-1]["dtype"], name, best * 1e3, rows[-1]["x_sdpa"]
        )
    return rows


def render(rows: list[dict]) -> str:
    header = [
        "entries per head (avg / min / max)",
        "dtype",
        "method",
        "best ms",
        "x dense sdpa",
        "x compact float",
        "MiB read",
        "GB/s",
        "% of read bandwidth",
    ]
    body = [
        [
            f"{r['average_entries']} / {r['shortest']} / {r['longest']}",
            r["dtype"],
            r["method"],
            fmt(r["best_ms"], 3),
            fmt(r["x_sdpa"]),
            fmt(r["x_compact_float"]),
            fmt(r["mib_read"], 1),
            fmt(r["gb_per_s"], 1),
            fmt(r["pct_read_bandwidth"], 0),
        ]
        for r in rows
    ]
    return markdown_table(header, body) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--averages", default="4096,8192,16384,32768", help="average kept entries per KV head")
    parser.add_argument("--dtypes", default=None, help="default: float32,bfloat16 on CPU, bfloat16 on CUDA")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small sizes, no torch backend (gpu_check dry run)")
    args = parse_arguments(parser, argv)
    device = args.device
    dtypes = args.dtypes or ("bfloat16" if device.type == "cuda" else "float32,bfloat16")
    averages = [int(a) for a in ("64,256" if args.quick else args.averages).split(",")]
    stem = output_stem(args, "ragged_attention")
    header = result_header(
        "Ragged attention (one layer, decoding)",
        device,
        f"best of {args.repeats} interleaved calls after a warm-up. Llama-3.1-8B attention (32 query heads, 8 KV "
        "heads, head_dim 128), batch 1, one query; unequal per-head lengths vs a dense cache with the same total",
    )
    rows = []
    for dtype_name in dtypes.split(","):
        for average in averages:
            rows += run_case(average, getattr(torch, dtype_name), args, device)
            write_results(stem, rows, header + render(rows))
    print(header + render(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
