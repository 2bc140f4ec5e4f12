"""Prefill time (time to first token, without the decoding step) of SmolLM2-135M with SnapKV and its critical variants.

Presses, all at compression ratio 0.5 with SnapKV as the base scorer:

- ``SnapKV`` and ``AdaKV(SnapKV)``: the baselines;
- ``CriticalKV(SnapKV)`` (overhead against SnapKV) and ``CriticalAdaKV(SnapKV)`` (overhead against AdaKV(SnapKV)),
  for every CPU/GPU backend of kvpress-critical and both norms;
- ``kvpress CriticalKV(SnapKV)``: kvpress's built-in press, for reference (L1).

The context is prefilled through ``model.model(input_ids, past_key_values=DynamicCache())`` under the press, which
is where kvpress compresses; every press runs on the same random token ids, interleaved round-robin. Two overheads
are reported: end to end (best prefill time against the baseline's), and from the time spent inside the press's
``compress`` (summed over layers; its difference to the baseline's, divided by the baseline's prefill time), which
does not carry the run-to-run noise of the model's forward pass. Results go to
``outputs/benchmarks/prefill_<device>.csv`` and ``.md`` (``--out-dir results/benchmarks`` for the committed tables).

    python benchmarks/bench_prefill.py                       # 1K, 2K and 4K tokens
    python benchmarks/bench_prefill.py --tokens 2048 --repeats 5
"""

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    fmt,
    markdown_table,
    output_stem,
    parse_arguments,
    result_header,
    summary,
    synchronize,
    time_interleaved,
    write_csv,
    write_text,
)

logger = logging.getLogger("bench_prefill")

BACKENDS = {"cpu": ("torch", "cpp"), "cuda": ("torch", "cuda", "triton")}


def presses(device: torch.device, ratio: float) -> dict:
    """name -> (press factory, baseline name)."""
    import kvpress
    from kvpress import AdaKVPress, SnapKVPress

    from kvpress_critical import CriticalAdaKVPress, CriticalKVPress, available_backends

    found = {
        "SnapKV": (lambda: SnapKVPress(compression_ratio=ratio), None),
        "AdaKV(SnapKV)": (lambda: AdaKVPress(SnapKVPress(compression_ratio=ratio)), None),
        "kvpress CriticalKV(SnapKV)": (lambda: kvpress.CriticalKVPress(SnapKVPress(compression_ratio=ratio)), "SnapKV"),
    }
    usable = set(available_backends(device))
    for norm in ("l1", "l2"):
        for backend in BACKENDS[device.type]:
            if backend not in usable:
                continue
            found[f"CriticalKV(SnapKV) {backend} {norm}"] = (
                lambda b=backend, n=norm: CriticalKVPress(SnapKVPress(compression_ratio=ratio), norm=n, backend=b),
                "SnapKV",
            )
            found[f"CriticalAdaKV(SnapKV) {backend} {norm}"] = (
                lambda b=backend, n=norm: CriticalAdaKVPress(SnapKVPress(compression_ratio=ratio), norm=n, backend=b),
                "AdaKV(SnapKV)",
            )
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,2048,4096", help="comma-separated context lengths")
    parser.add_argument("--ratio", type=float, default=0.5, help="compression ratio of every press")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per press (after one warm-up)")
    args = parse_arguments(parser, argv)
    device = args.device

    import transformers
    from transformers import DynamicCache

    from kvpress_critical.default_model import load_default_model

    transformers.utils.logging.disable_progress_bar()

    model, tokenizer = load_default_model()
    model = model.to(device).eval()
    found = presses(device, args.ratio)

    rows = []
    for i, k_len in enumerate(int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(k_len)
        input_ids = torch.randint(0, tokenizer.vocab_size, (1, k_len), generator=gen).to(device)
        compress_times: dict[str, list[float]] = {name: [] for name in found}

        def prefill(name, press):
            inner, spent = press.compress, []

            def timed_compress(*a, **k):  # kvpress's hook calls press.compress once per layer
                synchronize(device)
                start = time.perf_counter()
                out = inner(*a, **k)
                synchronize(device)
                spent.append(time.perf_counter() - start)
                return out

            press.compress = timed_compress

            @torch.no_grad()
            def run():
                spent.clear()
                with press(model):
                    model.model(input_ids=input_ids, past_key_values=DynamicCache())
                compress_times[name].append(sum(spent))

            return run

        # one warm-up per press (extension loading, Gram factors per layer), at the first length only
        runs = {name: prefill(name, make()) for name, (make, _) in found.items()}
        times = time_interleaved(runs, args.repeats, device, warmup=i == 0)
        best = {name: summary(t)[0] for name, t in times.items()}
        compress = {name: min(t) for name, t in compress_times.items()}
        for name, (_, base) in found.items():
            low, median = summary(times[name])
            overhead = 100 * (low / best[base] - 1) if base else float("nan")
            in_compress = 100 * (compress[name] - compress[base]) / best[base] if base else float("nan")
            rows.append(
                dict(
                    tokens=k_len,
                    press=name,
                    baseline=base or "",
                    best_ms=round(low * 1e3, 1),
                    median_ms=round(median * 1e3, 1),
                    overhead_pct=round(overhead, 2),
                    compress_ms=round(compress[name] * 1e3, 1),
                    compress_overhead_pct=round(in_compress, 2),
                )
            )
            logger.info(
                "T=%d %-34s %9.1f ms  overhead %s%%  compress %s ms (%s%%)",
                k_len,
                name,
                low * 1e3,
                fmt(overhead, 1),
                fmt(compress[name] * 1e3, 1),
                fmt(in_compress, 1),
            )

    stem = output_stem(args, "prefill")
    write_csv(stem.with_suffix(".csv"), rows)
    lengths = sorted({r["tokens"] for r in rows})
    header = ["press"] + [f"{t} tokens: ms (overhead %; in compress %)" for t in lengths]
    table = []
    for name in found:
        cells = [name]
        for t in lengths:
            r = next(r for r in rows if r["tokens"] == t and r["press"] == name)
            extra = f" ({fmt(r['overhead_pct'], 1)}; {fmt(r['compress_overhead_pct'], 1)})" if r["baseline"] else ""
            cells.append(fmt(r["best_ms"], 0) + extra)
        table.append(cells)
    text = (
        result_header(
            f"Prefill of SmolLM2-135M-Instruct ({str(model.dtype).replace('torch.', '')}, "
            f"{model.config._attn_implementation})",
            device,
            f"best of {args.repeats} interleaved prefills after a warm-up; compression ratio {args.ratio}. Overheads: "
            "CriticalKV against SnapKV, CriticalAdaKV against AdaKV(SnapKV); end to end, and from the time inside "
            "the press's compress (summed over layers) over the baseline's prefill time",
        )
        + markdown_table(header, table)
        + "\n"
    )
    write_text(stem.with_suffix(".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
