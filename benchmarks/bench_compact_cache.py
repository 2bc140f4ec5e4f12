"""What the compact layout saves: KV bytes, decoding memory and speed of head-wise compression, end to end.

For each context length and compression ratio, on the same context:

- ``no press``: the full cache;
- ``CriticalKV(SnapKV)``: a pruning press (uniform budgets, kvpress prunes the cache);
- ``CriticalAdaKV(SnapKV) masking``: head-wise budgets in kvpress's layout (the full cache, masked keys);
- ``CriticalAdaKV(SnapKV) compact``: the same selection with :class:`~kvpress_critical.CompactCachePress`;
- ``CriticalAdaKV(SnapKV) compact int8`` / ``int4`` / ``kivi4`` (``--layouts compact-int8,...``): the same with the
  kept entries quantized (``CompactCachePress(..., quantize=...)``).

Reported: the prefill time (the press's compression included) and, for the compact layout, the time spent converting
layers (part of it); the KV bytes held after the prefill (the compact layout's reserved tail room counted); the peak
memory of the prefill and of decoding (the process's peak resident memory during 8 decoding steps, above what was
resident before the prefill: the KV cache plus every transient, e.g. the copy of a layer that a growing dense cache
makes at each step; Linux ``VmHWM``); the peak memory of one decoding step ("step peak": what torch allocates during
the step above what it held before it, with one thread on CPU: the temporaries of a step, such as a dequantized copy
of a layer); and milliseconds per decoded token over 64 greedy steps. Configurations run one after the other on the
same context; ratios measured in the same run.

    python benchmarks/bench_compact_cache.py                                   # SmolLM2, CPU, fp32: 4K, 8K, 16K
    python benchmarks/bench_compact_cache.py --tokens 4096 --ratios 0.5 --decode-steps 16
    python benchmarks/bench_compact_cache.py --device cuda --model config:llama-3.1-8b   # GPU, random weights
"""

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PeakResident,
    fmt,
    kv_bytes,
    markdown_table,
    model_stem,
    parse_arguments,
    peak_extra_bytes,
    result_header,
    return_freed_memory_to_the_os,
    single_thread,
    synchronize,
    write_results,
)

import kvpress_critical.presses.compact_cache_press as compact_module  # noqa: E402
from kvpress_critical import CompactCachePress, CriticalAdaKVPress, CriticalKVPress  # noqa: E402

logger = logging.getLogger("bench_compact_cache")

IMPRECISE = " (glibc mallopt unavailable: it includes the allocator cache)"

CONFIG_MODELS = {  # config-built models with random weights (no download): shapes only matter here
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
    ),
    "tiny": dict(  # Llama's layout at a size a CPU builds in a second (gpu_check dry run: the logic, not the numbers)
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
    ),
}


def load_model(name: str, device: torch.device, layers: int | None):
    if name == "default":
        from kvpress_critical.default_model import load_default_model

        model, tokenizer = load_default_model(device=str(device))
        return model, tokenizer, "SmolLM2-135M-Instruct (embedded), float32, sdpa"
    if name.startswith("config:"):
        import transformers as tf

        shape = CONFIG_MODELS[name.split(":", 1)[1]]
        n_layers = layers or 8
        config = tf.LlamaConfig(
            **shape, num_hidden_layers=n_layers, max_position_embeddings=131072, attn_implementation="sdpa"
        )
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        with torch.device(device):
            model = tf.LlamaForCausalLM(config).to(dtype).eval()
        return model, None, f"{name} ({n_layers} layers, random weights, {str(dtype).replace('torch.', '')}, sdpa)"
    raise ValueError(f"--model: 'default' or one of {[f'config:{k}' for k in CONFIG_MODELS]}")


def context_ids(tokenizer, n_tokens: int, vocab: int, device) -> torch.Tensor:
    if tokenizer is None:
        return torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(n_tokens)).to(device)
    from kvpress_critical.data.text import prose_passage

    rng, text, ids = random.Random(0), "", []
    while len(ids) < n_tokens:
        text += " " + " ".join(prose_passage(rng, 200))
        ids = tokenizer(text, add_special_tokens=False).input_ids
    return torch.tensor([ids[:n_tokens]], device=device)


@torch.no_grad()
def prefill(model, ids, press):
    from transformers import DynamicCache

    cache = DynamicCache()
    converting = [0.0]
    real = compact_module.compact_layer

    def timed(*args, **kwargs):  # time spent converting layers to the compact layout (inside the prefill)
        start = time.perf_counter()
        out = real(*args, **kwargs)
        converting[0] += time.perf_counter() - start
        return out

    compact_module.compact_layer = timed
    try:
        synchronize(ids.device)
        start = time.perf_counter()
        if press is None:
            model.model(input_ids=ids, past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
        synchronize(ids.device)
        seconds = time.perf_counter() - start
    finally:
        compact_module.compact_layer = real
    return cache, seconds, converting[0]


@torch.no_grad()
def decode(model, cache, context_length: int, steps: int, device) -> list[float]:
    token = torch.tensor([[42]], device=device)
    times = []
    for i in range(steps):
        position = torch.tensor([[context_length + i]], device=device)
        synchronize(device)
        start = time.perf_counter()
        logits = model(input_ids=token, past_key_values=cache, position_ids=position).logits
        token = logits[:, -1:].argmax(-1)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def crop(cache, length_per_layer: list[int]) -> None:
    for layer, length in zip(cache.layers, length_per_layer):
        layer.crop(length)


LAYOUTS = ("pruning", "masking", "compact")
QUANTIZED = ("compact-int8", "compact-int4", "compact-kivi4")


def presses(ratio: float, layouts=LAYOUTS) -> dict:
    from kvpress import SnapKVPress

    every = {
        "pruning": ("CriticalKV(SnapKV) pruning", lambda: CriticalKVPress(SnapKVPress(ratio))),
        "masking": ("CriticalAdaKV(SnapKV) masking", lambda: CriticalAdaKVPress(SnapKVPress(ratio))),
        "compact": ("CriticalAdaKV(SnapKV) compact", lambda: CompactCachePress(CriticalAdaKVPress(SnapKVPress(ratio)))),
    }
    for layout in QUANTIZED:
        fmt_ = layout.split("-")[1]
        every[layout] = (
            f"CriticalAdaKV(SnapKV) compact {fmt_}",
            lambda q=fmt_: CompactCachePress(CriticalAdaKVPress(SnapKVPress(ratio)), quantize=q),
        )
    unknown = sorted(set(layouts) - set(every))
    if unknown:
        raise ValueError(f"--layouts: unknown {unknown}; choose from {list(every)}")
    return {every[layout][0]: every[layout][1]() for layout in layouts}


def measure(model, ids, name, press, args, device) -> dict:
    with PeakResident() as prefill_memory:
        cache, prefill_s, convert_s = prefill(model, ids, press)
    base = prefill_memory.base
    held = kv_bytes(cache)
    lengths = [cache.get_seq_length(i) for i in range(len(cache.layers))]
    if device.type == "cuda":
        peak = held + peak_extra_bytes(lambda: decode(model, cache, ids.shape[1], 8, device), device)
        prefill_peak = None
    else:
        with PeakResident() as decode_memory:
            decode(model, cache, ids.shape[1], 8, device)
        # relative to what was resident before the prefill: the cache and every transient on top of it
        peak = None if decode_memory.extra is None else decode_memory.base + decode_memory.extra - base
        prefill_peak = prefill_memory.extra
    crop(cache, lengths)  # back to the state after the prefill
    with single_thread():  # one decoding step's own allocations (one thread: the profiler sees them all on CPU)
        step_peak = peak_extra_bytes(lambda: decode(model, cache, ids.shape[1], 1, device), device)
    crop(cache, lengths)
    times = decode(model, cache, ids.shape[1], args.decode_steps, device)
    steady = times[1:] if len(times) > 1 else times
    for module in model.model.layers:
        module.self_attn.masked_key_indices = None
    mib = lambda x: float("nan") if x is None else round(x / 2**20, 2)  # noqa: E731
    return dict(
        tokens=ids.shape[1],
        press=name,
        prefill_s=round(prefill_s, 3),
        convert_ms=round(convert_s * 1e3, 2),
        convert_pct=round(100 * convert_s / prefill_s, 2),
        kv_mib=mib(held),
        peak_prefill_mib=mib(prefill_peak),
        peak_decode_mib=mib(peak),
        step_peak_mib=mib(step_peak),
        ms_per_token=round(1e3 * statistics.mean(steady), 2),
        ms_per_token_median=round(1e3 * statistics.median(steady), 2),
    )


def render(rows: list[dict]) -> str:
    header = [
        "tokens",
        "ratio",
        "press",
        "KV MiB (x full)",
        "peak prefill MiB",
        "peak decoding MiB",
        "step peak MiB",
        "ms / token (x pruning)",
        "prefill s (x masking)",
        "conversion ms (% of prefill)",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r["tokens"],
                f"{r['ratio']:g}" if r["ratio"] else "–",
                r["press"],
                f"{fmt(r['kv_mib'], 1)} ({fmt(r['kv_x_full'])})",
                fmt(r["peak_prefill_mib"], 0),
                fmt(r["peak_decode_mib"], 1),
                fmt(r.get("step_peak_mib", float("nan")), 2),
                f"{fmt(r['ms_per_token'], 1)} ({fmt(r['x_pruning'])})",
                f"{fmt(r['prefill_s'], 2)} ({fmt(r['x_masking_prefill'])})",
                f"{fmt(r['convert_ms'], 1)} ({fmt(r['convert_pct'], 2)}%)" if r["convert_ms"] else "–",
            ]
        )
    return markdown_table(header, body) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2) or config:llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=None, help="layers of a config-built model (default 8)")
    parser.add_argument("--tokens", default="4096,8192,16384")
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of CriticalKV: {', '.join(LAYOUTS + QUANTIZED)}")
    parser.add_argument("--repeats", type=int, default=1, help="(accepted for gpu_check.sh; one pass per config)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (gpu_check dry run)")
    args = parse_arguments(parser, argv)
    device = args.device
    precise = return_freed_memory_to_the_os()  # resident memory then follows the live tensors
    if args.quick:
        args.tokens, args.ratios, args.decode_steps, args.layers = "256", "0.5", 4, args.layers or 2
    model, tokenizer, label = load_model(args.model, device, args.layers)
    stem = model_stem(args, "compact_cache")
    header = result_header(
        "Compact cache vs masking vs pruning",
        device,
        f"{args.decode_steps} decoding steps (mean of all but the first), one prefill per configuration; peak "
        f"memory from the process's resident high-water mark{'' if precise else IMPRECISE}",
        model=label,
    )
    rows = []
    for n_tokens in [int(t) for t in args.tokens.split(",")]:
        ids = context_ids(tokenizer, n_tokens, model.config.vocab_size, device)
        measure(model, ids, "warm-up", None, argparse.Namespace(decode_steps=2), device)  # one-time initialisations
        full = measure(model, ids, "no press", None, args, device)
        full["ratio"] = 0.0
        group = [full]
        for ratio in [float(r) for r in args.ratios.split(",")]:
            for name, press in presses(ratio, args.layouts.split(",")).items():
                row = measure(model, ids, name, press, args, device)
                row["ratio"] = ratio
                group.append(row)
                logger.info(
                    "%d tokens, ratio %g, %-32s KV %.1f MiB, %.1f ms/token, prefill %.2f s",
                    n_tokens,
                    ratio,
                    name,
                    row["kv_mib"],
                    row["ms_per_token"],
                    row["prefill_s"],
                )
        for row in group:
            row["kv_x_full"] = round(row["kv_mib"] / full["kv_mib"], 3)
            same = [r for r in group if r["ratio"] == row["ratio"]]
            pruning = next((r for r in same if "pruning" in r["press"]), row)
            masking = next((r for r in same if "masking" in r["press"]), row)
            row["x_pruning"] = round(row["ms_per_token"] / pruning["ms_per_token"], 3)
            row["x_masking_prefill"] = round(row["prefill_s"] / masking["prefill_s"], 3)
        rows += group
        write_results(stem, rows, header + render(rows))
    print(header + render(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
