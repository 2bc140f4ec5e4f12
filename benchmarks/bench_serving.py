"""Where freed KV memory turns into throughput: padded batches, a fixed memory budget, long generations with
compression during decoding, quantized entries. Everything through ``model.generate``.

Three parts (``--parts``, default all three):

- ``batch``: one left-padded batch of contexts of mixed lengths (default 8 contexts, 1K to 6K tokens), greedy
  generation of ``--new-tokens`` tokens per row (128, end-of-sequence ignored), for no press, kvpress's pruning of
  ``CriticalKV(SnapKV)``, and ``CriticalAdaKV(SnapKV)`` in the masking and the compact layouts, at each ratio.
  Reported: prefill seconds, milliseconds per decoding step (one token for every row), aggregate decoding tokens/s
  and end-to-end tokens/s (prefill included), the KV bytes held after the prefill and at the end (the compact
  layout's reserved tail room counted), and the process's peak resident memory above its level before the call,
  during the prefill and during decoding (Linux ``VmHWM``).
- ``budget``: a fixed KV memory budget, the KV bytes the batch holds at the end of its generation without a press.
  Each configuration of ``batch`` fits ``floor(budget / its KV bytes per sequence)`` sequences of the same mix (its
  bytes per sequence as measured at the end of the batch); configurations run at that batch size (the mix repeated)
  for ``--budget-ratios`` and report the throughput that follows. The masking layout frees nothing: it fits what
  no press fits.
- ``decoding``: one short prompt and a ``--long-tokens`` generation (4096): no compression, kvpress's
  ``DecodingPress(CriticalKV(Knorm))`` (pruning, dense cache) and ``CompactCachePress(DecodingPress(
  CriticalAdaKV(Knorm)))`` (head-wise budgets, compact layout), both to ``--target-size`` entries per head (512)
  every ``--interval`` steps: the KV bytes and milliseconds per token over the generation, every 256 tokens.
- ``quantized``: one ``--quantized-tokens`` context (4096), 64 generated tokens: the full cache, transformers'
  ``QuantizedCache`` (quanto, int4, full length), and ``CompactCachePress(CriticalAdaKV(SnapKV(0.5)))`` with float32,
  int8, int4 and kivi4 entries, run round-robin ``--quantized-repeats`` times (the median of the per-run
  milliseconds per token): KV bytes, milliseconds per token, the greedy tokens shared with the full cache, and the
  peak memory of one decoding step (torch's allocations during the step above those before it, one thread: the
  temporaries a step makes, such as a dequantized copy of a layer).

    python benchmarks/bench_serving.py                                        # SmolLM2, CPU, fp32, all parts
    python benchmarks/bench_serving.py --parts decoding,quantized
    python benchmarks/bench_serving.py --quick                                # tiny sizes: the logic, not numbers
"""

import argparse
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    _proc_status,
    fmt,
    kv_bytes,
    markdown_table,
    output_stem,
    parse_arguments,
    peak_extra_bytes,
    result_header,
    return_freed_memory_to_the_os,
    single_thread,
    write_results,
)

from kvpress_critical import CompactCachePress, CriticalAdaKVPress, CriticalKVPress  # noqa: E402
from kvpress_critical.cache import CompactLayer  # noqa: E402

logger = logging.getLogger("bench_serving")

PARTS = ("batch", "budget", "decoding", "quantized")
GIB = 2**30


# ------------------------------------------------------------------------------------------------------------ inputs
def prose_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` tokens of prose (deterministic in ``seed``), then a request to continue it."""
    from kvpress_critical.data.text import prose_passage

    rng, text, ids = random.Random(seed), "", []
    request = tokenizer("\n\nSummarise the text above.", add_special_tokens=False).input_ids
    while len(ids) < n_tokens - len(request):
        text += " " + " ".join(prose_passage(rng, 200))
        ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids[: n_tokens - len(request)] + request


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of a left-padded batch."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------------- measurements
def entries_per_head(cache) -> float:
    """Mean entries per (row, KV head) over the layers."""
    counts = []
    for layer in cache.layers:
        if isinstance(layer, CompactLayer):
            counts.append(layer.num_entries / (layer.batch_size * layer.num_kv_heads) + layer.tail_len)
        else:
            counts.append(layer.keys.shape[2])
    return statistics.mean(counts)


def clear_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class Clock(LogitsProcessor):
    """Called by ``generate`` once per step, after the forward: records when, and the cache after the prefill (and
    every ``every`` steps), resetting the resident high-water mark once the prefill is done."""

    def __init__(self, cache, every: int = 0, bar=None):
        self.cache, self.every, self.bar = cache, every, bar
        self.times: list[float] = []
        self.samples: list[tuple[int, int, float]] = []  # (step, KV bytes, entries per head)
        self.prefill_peak = None

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        step = len(self.times)
        if step == 1:
            self.prefill_peak = _proc_status("VmHWM")
            self.after_prefill = kv_bytes(self.cache)
            clear_peak()
        if self.every and step % self.every == 0:
            self.samples.append((step, kv_bytes(self.cache), entries_per_head(self.cache)))
        if self.bar is not None:
            self.bar.update(1)
        return scores


@torch.no_grad()
def run_generate(model, ids, mask, press, new_tokens: int, cache=None, every: int = 0, desc: str = "") -> dict:
    """One ``model.generate`` call (greedy, exactly ``new_tokens`` tokens), inside ``press``; what it measured."""
    import gc

    gc.collect()
    cache = DynamicCache() if cache is None else cache
    base = _proc_status("VmRSS")
    clear_peak()
    with tqdm(total=new_tokens, desc=desc, leave=False, file=sys.stderr) as bar:
        clock = Clock(cache, every, bar)
        start = time.perf_counter()
        scope = press(model) if press is not None else _nothing()
        with scope:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
                pad_token_id=0,
            )
        end = time.perf_counter()
    decode_peak = _proc_status("VmHWM")
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    batch = ids.shape[0]
    mib = lambda x: None if x is None or base is None else round((x - base) / 2**20, 1)  # noqa: E731
    result = dict(
        batch=batch,
        prefill_s=round(clock.times[0] - start, 2),
        ms_per_step=round(1e3 * statistics.mean(steps), 1),
        decode_tok_s=round(batch / statistics.mean(steps), 2),
        e2e_tok_s=round(batch * new_tokens / (end - start), 2),
        kv_prefill_mib=round(clock.after_prefill / 2**20, 1),
        kv_end_mib=round(kv_bytes(cache) / 2**20, 1),
        peak_prefill_mib=mib(clock.prefill_peak),
        peak_decode_mib=mib(decode_peak),
    )
    for module in model.model.layers:  # the masking layout leaves its selection on the modules
        module.self_attn.masked_key_indices = None
    return dict(result, _tokens=out[:, ids.shape[1] :], _times=clock.times, _samples=clock.samples)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def public(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("_")}


# ------------------------------------------------------------------------------------------------------------ parts
def batch_presses(ratio: float) -> dict:
    from kvpress import SnapKVPress

    return {
        "CriticalKV(SnapKV) pruning": lambda: CriticalKVPress(SnapKVPress(ratio)),
        "CriticalAdaKV(SnapKV) masking": lambda: CriticalAdaKVPress(SnapKVPress(ratio)),
        "CriticalAdaKV(SnapKV) compact": lambda: CompactCachePress(CriticalAdaKVPress(SnapKVPress(ratio))),
    }


def part_batch(model, tokenizer, args, write) -> list[dict]:
    lengths = [int(n) for n in args.lengths.split(",")]
    rows_ids = [prose_ids(tokenizer, n, seed) for seed, n in enumerate(lengths)]
    ids, mask = left_padded(rows_ids, tokenizer.pad_token_id or 0)
    configs = [("no press", 0.0, None)]
    for ratio in [float(r) for r in args.ratios.split(",")]:
        configs += [(name, ratio, make) for name, make in batch_presses(ratio).items()]
    # one-time initialisations (thread pools, the kernels' first calls) out of the first measured configuration
    short_ids, short_mask = left_padded([r[:128] for r in rows_ids[:2]], tokenizer.pad_token_id or 0)
    for make in (None, configs[-1][2]):
        run_generate(model, short_ids, short_mask, make() if make else None, 2, desc="warm-up")
    rows = []
    for name, ratio, make in tqdm(configs, desc="batch", file=sys.stderr):
        result = run_generate(model, ids, mask, make() if make else None, args.new_tokens, desc=name)
        row = dict(part="batch", press=name, ratio=ratio, **public(result))
        rows.append(row)
        logger.info("batch %-32s ratio %g: %s", name, ratio, public(row))
        write(rows)
    full = rows[0]
    for row in rows:
        row["x_no_press_decode"] = round(row["decode_tok_s"] / full["decode_tok_s"], 2)
        row["x_no_press_kv"] = round(row["kv_end_mib"] / full["kv_end_mib"], 3)
    return rows


def part_budget(model, tokenizer, args, batch_rows, write) -> list[dict]:
    """Each configuration at the batch size the budget (the no-press batch's KV at its end) lets it hold."""
    lengths = [int(n) for n in args.lengths.split(",")]
    full = next(r for r in batch_rows if r["press"] == "no press")
    budget = full["kv_end_mib"]
    rows = []
    for row in batch_rows:
        per_sequence = row["kv_end_mib"] / row["batch"]
        fits = int(budget // per_sequence)
        entry = dict(part="budget", press=row["press"], ratio=row["ratio"], budget_mib=budget, fits=fits)
        if row["press"] == "no press" or "masking" in row["press"]:  # they fit the measured batch, by definition
            entry.update(batch=row["batch"], decode_tok_s=row["decode_tok_s"], e2e_tok_s=row["e2e_tok_s"])
            entry.update(kv_end_mib=row["kv_end_mib"], measured="batch part")
        rows.append(entry)
    budget_ratios = [float(r) for r in args.budget_ratios.split(",")] if args.budget_ratios else []
    todo = [e for e in rows if "measured" not in e and e["ratio"] in budget_ratios]
    for entry in tqdm(todo, desc="budget", file=sys.stderr):
        n = entry["fits"]
        rows_ids = [prose_ids(tokenizer, lengths[i % len(lengths)], i % len(lengths)) for i in range(n)]
        ids, mask = left_padded(rows_ids, tokenizer.pad_token_id or 0)
        make = batch_presses(entry["ratio"])[entry["press"]]
        result = run_generate(model, ids, mask, make(), args.new_tokens, desc=f"{entry['press']} x{n}")
        entry.update(batch=n, decode_tok_s=result["decode_tok_s"], e2e_tok_s=result["e2e_tok_s"])
        entry.update(kv_end_mib=result["kv_end_mib"], measured="this part")
        logger.info("budget %-32s ratio %g: %s", entry["press"], entry["ratio"], entry)
        write(rows)
    base = next(e for e in rows if e["press"] == "no press")
    for entry in rows:
        if "decode_tok_s" in entry:
            entry["x_no_press_decode"] = round(entry["decode_tok_s"] / base["decode_tok_s"], 2)
            entry["x_no_press_e2e"] = round(entry["e2e_tok_s"] / base["e2e_tok_s"], 2)
    return rows


def part_decoding(model, tokenizer, args, write) -> list[dict]:
    from kvpress import DecodingPress, KnormPress

    prompt = prose_ids(tokenizer, args.prompt_tokens, seed=99)
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    schedule = dict(compression_interval=args.interval, target_size=args.target_size, hidden_states_buffer_size=0)
    configs = {
        "no compression": None,
        "kvpress DecodingPress(CriticalKV(Knorm)) pruning": lambda: DecodingPress(
            base_press=CriticalKVPress(KnormPress()), **schedule
        ),
        "CompactCachePress(DecodingPress(CriticalAdaKV(Knorm)))": lambda: CompactCachePress(
            DecodingPress(base_press=CriticalAdaKVPress(KnormPress()), **schedule)
        ),
    }
    rows = []
    for name, make in tqdm(configs.items(), desc="decoding", file=sys.stderr):
        result = run_generate(model, ids, mask, make() if make else None, args.long_tokens, every=256, desc=name)
        times = result["_times"]
        for step, held, per_head in result["_samples"]:
            window = times[max(1, step - 256) : step]
            ms = 1e3 * statistics.mean(b - a for a, b in zip(window, window[1:]))
            rows.append(
                dict(
                    part="decoding",
                    press=name,
                    generated=step,
                    kv_mib=round(held / 2**20, 2),
                    entries_per_head=round(per_head, 1),
                    ms_per_token=round(ms, 1),
                )
            )
        logger.info("decoding %s: %s", name, public(result))
        write(rows)
    return rows


def part_quantized(model, tokenizer, args, write) -> list[dict]:
    from kvpress import SnapKVPress
    from transformers import QuantizedCache

    prompt = prose_ids(tokenizer, args.quantized_tokens, seed=7)
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    configs = {
        "full cache (float32)": (None, None),
        "QuantizedCache (quanto int4, full length)": (
            None,
            lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4),
        ),
        "compact float32": (lambda: CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5))), None),
        "compact int8": (lambda: CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)), quantize="int8"), None),
        "compact int4": (lambda: CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)), quantize="int4"), None),
        "compact kivi4": (lambda: CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)), quantize="kivi4"), None),
    }
    rows, reference, compact = {}, None, None
    runs = [(r, name) for r in range(args.quantized_repeats) for name in configs]  # round-robin: interleaved
    for repeat, name in tqdm(runs, desc="quantized", file=sys.stderr):
        make, make_cache = configs[name]
        cache = make_cache() if make_cache else DynamicCache()
        result = run_generate(model, ids, mask, make() if make else None, 64, cache=cache, desc=name)
        if repeat:
            rows[name]["_ms"].append(result["ms_per_step"])
            rows[name]["ms_per_token"] = round(statistics.median(rows[name]["_ms"]), 1)
            continue
        tokens = result["_tokens"][0]
        reference = tokens if reference is None else reference
        compact = tokens if name == "compact float32" else compact
        same = lambda other: None if other is None else round(float((tokens == other).float().mean()), 3)  # noqa
        step = lambda: model(input_ids=tokens[-1:].view(1, 1), past_key_values=cache)  # noqa: E731
        with torch.no_grad(), single_thread():
            step_peak = peak_extra_bytes(step, torch.device("cpu"))
        rows[name] = dict(
            part="quantized",
            press=name,
            kv_prefill_mib=result["kv_prefill_mib"],
            ms_per_token=result["ms_per_step"],
            prefill_s=result["prefill_s"],
            step_peak_mib=round(step_peak / 2**20, 2),
            same_tokens_as_full=same(reference),
            same_tokens_as_compact_fp32=same(compact) if "compact" in name else None,
            _ms=[result["ms_per_step"]],
        )
        logger.info("quantized %s: %s", name, rows[name])
        write([{k: v for k, v in r.items() if not k.startswith("_")} for r in rows.values()])
    rows = list(rows.values())
    for row in rows:
        row.pop("_ms")
    for row in rows:
        row["x_full_kv"] = round(row["kv_prefill_mib"] / rows[0]["kv_prefill_mib"], 3)
    return rows


# ---------------------------------------------------------------------------------------------------------- tables
def render(rows: list[dict]) -> str:
    out = []
    batch = [r for r in rows if r["part"] == "batch"]
    if batch:
        out.append("### One padded batch\n")
        header = [
            "press",
            "ratio",
            "prefill s",
            "ms / step",
            "decoding tok/s (x none)",
            "end-to-end tok/s",
            "KV MiB after prefill",
            "KV MiB at end (x none)",
            "peak MiB prefill",
            "peak MiB decoding",
        ]  # noqa
        body = [
            [
                r["press"],
                f"{r['ratio']:g}" if r["ratio"] else "–",
                fmt(r["prefill_s"], 1),
                fmt(r["ms_per_step"], 0),
                f"{fmt(r['decode_tok_s'], 1)} ({fmt(r.get('x_no_press_decode', float('nan')))})",
                fmt(r["e2e_tok_s"], 2),
                fmt(r["kv_prefill_mib"], 0),
                f"{fmt(r['kv_end_mib'], 0)} ({fmt(r.get('x_no_press_kv', float('nan')), 3)})",
                fmt(_num(r["peak_prefill_mib"]), 0),
                fmt(_num(r["peak_decode_mib"]), 0),
            ]  # noqa
            for r in batch
        ]
        out.append(markdown_table(header, body) + "\n")
    budget = [r for r in rows if r["part"] == "budget"]
    if budget:
        out.append(f"### At a fixed KV budget of {fmt(budget[0]['budget_mib'], 0)} MiB\n")
        header = [
            "press",
            "ratio",
            "sequences that fit",
            "batch run",
            "KV MiB at end",
            "decoding tok/s (x none)",
            "end-to-end tok/s (x none)",
        ]  # noqa
        body = [
            [
                r["press"],
                f"{r['ratio']:g}" if r["ratio"] else "–",
                r["fits"],
                r.get("batch", "not run"),
                fmt(_num(r.get("kv_end_mib")), 0),
                f"{fmt(_num(r.get('decode_tok_s')), 1)} ({fmt(_num(r.get('x_no_press_decode')))})",
                f"{fmt(_num(r.get('e2e_tok_s')), 2)} ({fmt(_num(r.get('x_no_press_e2e')))})",
            ]  # noqa
            for r in budget
        ]
        out.append(markdown_table(header, body) + "\n")
    decoding = [r for r in rows if r["part"] == "decoding"]
    if decoding:
        out.append("### A long generation, compressed while decoding\n")
        names = list(dict.fromkeys(r["press"] for r in decoding))
        steps = sorted({r["generated"] for r in decoding})
        at = {(r["press"], r["generated"]): r for r in decoding}
        header = ["generated"] + [f"{n}: KV MiB / ms per token" for n in names]
        body = [
            [s]
            + [
                f"{fmt(at[n, s]['kv_mib'], 1)} / {fmt(at[n, s]['ms_per_token'], 1)}" if (n, s) in at else "–"
                for n in names
            ]  # noqa
            for s in steps
        ]
        out.append(markdown_table(header, body) + "\n")
    quantized = [r for r in rows if r["part"] == "quantized"]
    if quantized:
        out.append("### Quantized entries\n")
        header = [
            "cache",
            "KV MiB after prefill (x full)",
            "ms / token (x compact float32)",
            "step peak MiB",
            "prefill s",
            "greedy tokens = full cache",
            "= compact float32",
        ]  # noqa
        compact_ms = next((r["ms_per_token"] for r in quantized if r["press"] == "compact float32"), float("nan"))
        body = [
            [
                r["press"],
                f"{fmt(r['kv_prefill_mib'], 1)} ({fmt(r.get('x_full_kv', float('nan')), 3)})",
                f"{fmt(r['ms_per_token'], 1)} ({fmt(r['ms_per_token'] / compact_ms)})",
                fmt(_num(r.get("step_peak_mib")), 2),
                fmt(r["prefill_s"], 1),
                fmt(_num(r["same_tokens_as_full"])),
                fmt(_num(r["same_tokens_as_compact_fp32"])),
            ]  # noqa
            for r in quantized
        ]
        out.append(markdown_table(header, body) + "\n")
    return "\n".join(out)


def _num(x) -> float:
    return float("nan") if x is None else float(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
    parser.add_argument("--lengths", default="1024,1536,2048,2560,3072,4096,5120,6144", help="the batch's contexts")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (batch, budget)")
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--budget-ratios", default="0.5", help="ratios whose presses run at the budget's batch size")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt of the long generation")
    parser.add_argument("--long-tokens", type=int, default=4096, help="tokens of the long generation")
    parser.add_argument("--target-size", type=int, default=512, help="entries per head kept while decoding")
    parser.add_argument("--interval", type=int, default=64, help="decoding steps between compressions")
    parser.add_argument("--quantized-tokens", type=int, default=4096, help="context of the quantized part")
    parser.add_argument("--quantized-repeats", type=int, default=3, help="round-robin runs of the quantized part")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the logic, not the numbers)")
    args = parse_arguments(parser, argv)
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    if "budget" in parts and "batch" not in parts:
        parser.error("--parts: budget needs batch (its budget and bytes per sequence come from the batch)")
    if args.device.type != "cpu":
        parser.error("this benchmark measures the embedded model on CPU (resident memory); use --device cpu")
    if args.quick:
        args.lengths, args.new_tokens, args.ratios = "64,96,160", 8, "0.5"
        args.prompt_tokens, args.long_tokens, args.target_size, args.interval = 32, 300, 64, 16
        args.quantized_tokens, args.quantized_repeats = 256, 1
    precise = return_freed_memory_to_the_os()
    from kvpress_critical.default_model import load_default_model

    model, tokenizer = load_default_model()
    # a subset of the parts gets its own files (serving_quantized_cpu.md...), not a numbered copy of the whole table
    stem = output_stem(args, "serving" if set(parts) == set(PARTS) else "serving_" + "_".join(parts))
    header = result_header(
        "Serving: padded batches, a fixed KV budget, decoding compression, quantized entries",
        args.device,
        "greedy model.generate with a fixed number of new tokens; KV bytes from the cache's tensors; peak memory from "
        "the process's resident high-water mark above its level before the call"
        + ("" if precise else " (glibc mallopt unavailable: it includes the allocator cache)"),
        model="SmolLM2-135M-Instruct (embedded), float32, sdpa",
    )
    rows: list[dict] = []
    write = lambda part_rows: write_results(stem, rows + part_rows, header + render(rows + part_rows))  # noqa: E731
    if "batch" in parts:
        batch_rows = part_batch(model, tokenizer, args, write)
        rows += batch_rows
        if "budget" in parts:
            rows += part_budget(model, tokenizer, args, batch_rows, write)
    if "decoding" in parts:
        rows += part_decoding(model, tokenizer, args, write)
    if "quantized" in parts:
        rows += part_quantized(model, tokenizer, args, write)
    write([])
    print(header + render(rows), flush=True)
    logger.info("written: %s.md, %s.csv", stem, stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
