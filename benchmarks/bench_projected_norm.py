"""Benchmark the projected-value-norm backends against kvpress's ``vwl1norm`` and the bare-matmul floor.

For the attention layer shapes of Llama-3.1-8B (= Mistral-7B), Qwen2.5-32B and SmolLM2-135M, and several context
lengths, every method runs on the same inputs, interleaved round-robin (see ``common.time_interleaved``):

- ``floor``: the bare matmuls ``V_kvhead @ W_O^h`` for every query head into a preallocated output — the GEMM an L1
  kernel cannot avoid (2*T*H*d*D FLOPs), without even reading its result;
- ``kvpress``: ``kvpress.CriticalKVPress.vwl1norm`` (repeat_kv, one materialised (B, T, D) product per head);
- ``<backend>-l1`` / ``<backend>-l2``: :func:`kvpress_critical.projected_value_norm` with that backend
  (L2 through the cached Gram factors, 2*T*H*d^2 FLOPs; the factors are computed in the warm-up call).

On CPU, the arithmetic peak is measured before each case (``cpu_limits.arithmetic_peak``: register-only FMA loops on
every thread, or AVX512-BF16 dot products for bfloat16 where the CPU has them) and each row reports its best fused
L1 method's fraction of it. Peak extra memory is measured in a separate untimed call (``common.peak_extra_bytes``).
Results go to ``outputs/benchmarks/projected_norm_<device>.csv`` and ``.md`` (``--out-dir results/benchmarks``: the
committed tables).

    python benchmarks/bench_projected_norm.py                       # defaults below
    python benchmarks/bench_projected_norm.py --models llama --tokens 4096 --repeats 5
"""

import argparse
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    fmt,
    markdown_table,
    output_stem,
    parse_arguments,
    peak_extra_bytes,
    result_header,
    single_thread,
    summary,
    time_interleaved,
    write_results,
)

from kvpress_critical.ops.projected_value_norm import PROJECTED_VALUE_NORM, projected_value_norm  # noqa: E402
from kvpress_critical.ops.projected_value_norm.torch_backend import gram_factors  # noqa: E402

logger = logging.getLogger("bench_projected_norm")

MODELS = {
    "llama": ("Llama-3.1-8B / Mistral-7B", dict(heads=32, kv_heads=8, head_dim=128, hidden=4096)),
    "qwen": ("Qwen2.5-32B", dict(heads=40, kv_heads=8, head_dim=128, hidden=5120)),
    "smollm": ("SmolLM2-135M", dict(heads=9, kv_heads=3, head_dim=64, hidden=576)),
}
DEFAULT_TOKENS = {"llama": [1024, 2048, 4096, 8192], "qwen": [1024, 4096], "smollm": [1024, 4096, 16384, 32768]}
FUSED = {"cpu": ("torch", "cpp"), "cuda": ("torch", "cuda", "triton")}
# dense bf16 tensor-core peak, TFLOP/s, by device-name substring (vendor data sheets); --peak-tflops overrides
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0}


def bf16_peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


def kvpress_module(weight: torch.Tensor, shape: dict):
    """The attributes ``CriticalKVPress.vwl1norm`` reads from an attention layer."""
    config = SimpleNamespace(
        num_attention_heads=shape["heads"], head_dim=shape["head_dim"], hidden_size=shape["hidden"]
    )
    return SimpleNamespace(
        config=config, o_proj=SimpleNamespace(weight=weight), num_key_value_groups=shape["heads"] // shape["kv_heads"]
    )


def methods(values: torch.Tensor, weight: torch.Tensor, shape: dict, device: torch.device) -> dict:
    """name -> (callable, FLOPs, norm). The floor's callable allocates its output (for the memory measurement)."""
    try:
        from kvpress import CriticalKVPress
    except ImportError:  # e.g. a GPU machine without kvpress: the comparison column stays empty
        CriticalKVPress = None

    heads, head_dim, group = shape["heads"], shape["head_dim"], shape["heads"] // shape["kv_heads"]
    bsz, _, k_len, _ = values.shape
    l1_flop = 2 * bsz * k_len * heads * head_dim * shape["hidden"]
    l2_flop = 2 * bsz * k_len * heads * head_dim * min(head_dim, shape["hidden"])
    w_heads = [weight[:, h * head_dim : (h + 1) * head_dim].T for h in range(heads)]  # (d, D) views

    def floor(out=None):
        out = torch.empty(bsz, k_len, shape["hidden"], dtype=values.dtype, device=device) if out is None else out
        for h in range(heads):
            torch.matmul(values[:, h // group], w_heads[h], out=out)

    module = kvpress_module(weight, shape)
    found = {"floor": (floor, l1_flop, "l1")}
    if CriticalKVPress is not None:
        found["kvpress"] = (lambda: CriticalKVPress.vwl1norm(values, module), l1_flop, "l1")
    usable = set(PROJECTED_VALUE_NORM.available(device))
    for norm, flop in (("l1", l1_flop), ("l2", l2_flop)):
        for backend in FUSED[device.type]:
            if backend in usable:
                found[f"{backend}-{norm}"] = (
                    lambda b=backend, n=norm: projected_value_norm(values, weight, heads, norm=n, backend=b),
                    flop,
                    norm,
                )
    return found


def run_case(model: str, k_len: int, dtype: torch.dtype, args, device: torch.device) -> list[dict]:
    label, shape = MODELS[model]
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(args.batch, shape["kv_heads"], k_len, shape["head_dim"], generator=gen).to(device, dtype)
    weight = (torch.randn(shape["hidden"], shape["heads"] * shape["head_dim"], generator=gen) / 64).to(device, dtype)
    gram_factors(weight, shape["heads"])  # cached once per layer in real use: not part of the timed calls
    found = methods(values, weight, shape, device)
    floor_out = torch.empty(args.batch, k_len, shape["hidden"], dtype=dtype, device=device)
    timed = {name: fn for name, (fn, _, _) in found.items()}
    timed["floor"] = lambda: found["floor"][0](floor_out)  # the tightest floor: output preallocated
    limit = None
    # the arithmetic limit, measured now: register-only multiply-adds on every thread
    if device.type == "cpu" and not args.no_cpu_peak:
        from cpu_limits import arithmetic_peak

        kind = "bf16" if dtype == torch.bfloat16 and arithmetic_peak("bf16") else "fp32"
        limit = (kind, arithmetic_peak(kind))
    times = time_interleaved(timed, args.repeats, device)
    floor_out = None

    peaks = {}
    if k_len <= args.memory_max_tokens:
        with single_thread():
            for name, (fn, _, _) in found.items():
                peaks[name] = peak_extra_bytes(fn, device)

    best = {name: summary(t)[0] for name, t in times.items()}
    rows = []
    for name, (_, flop, norm) in found.items():
        low, median = summary(times[name])
        peak = peaks.get(name, float("nan"))
        rows.append(
            dict(
                model=label,
                tokens=k_len,
                batch=args.batch,
                dtype=str(dtype).replace("torch.", ""),
                method=name,
                norm=norm,
                best_ms=round(low * 1e3, 3),
                median_ms=round(median * 1e3, 3),
                gflop=round(flop / 1e9, 3),
                gflops=round(flop / low / 1e9, 1),
                x_floor=round(low / best["floor"], 3),
                speedup_vs_kvpress=round(best["kvpress"] / low, 3) if "kvpress" in best else float("nan"),
                peak_extra_mib=round(peak / 2**20, 3),
                mem_vs_kvpress=round(peak / peaks["kvpress"], 5) if "kvpress" in peaks else float("nan"),
                pct_bf16_peak=round(100 * flop / low / 1e12 / args.peak, 1) if args.peak else float("nan"),
                cpu_peak=limit[0] if limit else "",
                cpu_peak_gflops=round(limit[1] / 1e9, 1) if limit else float("nan"),
                pct_cpu_peak=round(100 * flop / low / limit[1], 1) if limit else float("nan"),
            )
        )
        logger.info(
            "%s T=%d %s %-10s %9.2f ms  x_floor %.2f",
            label,
            k_len,
            rows[-1]["dtype"],
            name,
            low * 1e3,
            rows[-1]["x_floor"],
        )
    return rows


def best_fused(rows: list[dict], norm: str) -> dict | None:
    fused = [r for r in rows if r["norm"] == norm and r["method"].endswith(f"-{norm}")]
    return min(fused, key=lambda r: r["best_ms"]) if fused else None


def render(all_rows: list[dict], device: torch.device) -> str:
    groups: dict = {}
    for r in all_rows:
        groups.setdefault((r["model"], r["tokens"], r["dtype"]), []).append(r)
    fused_names = [b for b in FUSED[device.type] if any(r["method"] == f"{b}-l1" for r in all_rows)]

    l1_header = ["model", "T", "dtype", "floor ms", "kvpress ms (x floor)"]
    l1_header += [f"{b} ms (x floor)" for b in fused_names]
    l1_header += ["best GFLOP/s", "best vs kvpress", "peak MiB kvpress", "peak MiB best (fraction)"]
    with_peak = any(r["pct_bf16_peak"] == r["pct_bf16_peak"] for r in all_rows)
    if with_peak:
        l1_header.append("best % of bf16 peak")
    with_cpu_peak = any(r["pct_cpu_peak"] == r["pct_cpu_peak"] for r in all_rows)
    if with_cpu_peak:
        l1_header += ["measured peak GFLOP/s", "best % of peak"]
    l1_rows, l2_rows = [], []
    for (model, k_len, dtype), rows in groups.items():
        by = {r["method"]: r for r in rows}
        best = best_fused(rows, "l1")
        row = [model, k_len, dtype, fmt(by["floor"]["best_ms"], 1)]
        kv = by.get("kvpress")
        row.append(f"{fmt(kv['best_ms'], 1)} ({fmt(kv['x_floor'])})" if kv else "–")
        for b in fused_names:
            r = by.get(f"{b}-l1")
            row.append(f"{fmt(r['best_ms'], 1)} ({fmt(r['x_floor'])})" if r else "–")
        row += [
            f"{fmt(best['gflops'], 0)} ({best['method']})",
            f"{fmt(best['speedup_vs_kvpress'])}x",
            fmt(kv["peak_extra_mib"], 1) if kv else "–",
            f"{fmt(best['peak_extra_mib'])} ({best['mem_vs_kvpress']:.4f})",
        ]
        if with_peak:
            row.append(fmt(best["pct_bf16_peak"], 1))
        if with_cpu_peak:
            row += [f"{fmt(best['cpu_peak_gflops'], 0)} ({best['cpu_peak']})", fmt(best["pct_cpu_peak"], 1)]
        l1_rows.append(row)
        best2 = best_fused(rows, "l2")
        if best2 is not None:
            l2 = [model, k_len, dtype]
            l2 += [fmt(by[f"{b}-l2"]["best_ms"], 2) if f"{b}-l2" in by else "–" for b in fused_names]
            l2 += [fmt(best["best_ms"], 1), f"{fmt(best['best_ms'] / best2['best_ms'], 1)}x"]
            l2_rows.append(l2)
    l2_header = ["model", "T", "dtype"] + [f"{b}-l2 ms" for b in fused_names] + ["best L1 ms", "L1 / L2 (best)"]
    return (
        "### L1: fused backends vs kvpress `vwl1norm` and the bare-matmul floor\n\n"
        + markdown_table(l1_header, l1_rows)
        + "\n\n### L2 through the Gram factors vs the best L1\n\n"
        + markdown_table(l2_header, l2_rows)
        + "\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen,smollm", help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--tokens", default=None, help="comma-separated context lengths (default: per model)")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per method (after one warm-up)")
    parser.add_argument("--memory-max-tokens", type=int, default=8192, help="skip the memory pass above this")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 tensor-core peak for the %% column")
    parser.add_argument(
        "--no-cpu-peak", action="store_true", help="skip the CPU's measured peak (its loop is compiled on first use)"
    )
    args = parse_arguments(parser, argv)
    device = args.device
    args.peak = bf16_peak_tflops(device, args.peak_tflops)

    dtypes = args.dtypes.split(",")
    stem = output_stem(args, "projected_norm" + ("" if dtypes == ["float32"] else "_" + "-".join(dtypes)))
    header = result_header(
        "projected_value_norm",
        device,
        f"best of {args.repeats} interleaved calls after a warm-up; batch {args.batch}",
    )
    all_rows = []
    for model in args.models.split(","):
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else DEFAULT_TOKENS[model]
        for dtype_name in dtypes:
            for k_len in tokens:
                all_rows += run_case(model, k_len, getattr(torch, dtype_name), args, device)
                # tables rewritten after every case: a run cut short keeps every case it finished
                write_results(stem, all_rows, header + render(all_rows, device))
    print(header + render(all_rows, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
