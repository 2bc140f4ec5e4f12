"""``python -m kvpress_critical.analysis``: perturbation analysis and fidelity of a press and its CriticalKV
variant.

With no arguments: the embedded SmolLM2-135M-Instruct, the offline RULER-style smoke contexts, SnapKV vs
CriticalKV(SnapKV) and AdaKV(SnapKV) vs CriticalAdaKV(SnapKV) at compression ratios 0.5 and 0.8. Writes
``summary.json``, ``table.md`` / ``table.json`` (mean actual perturbation / theta / theta_prev per cache
size, the paper's table 9), ``per_head.json`` and three figures into a new folder under ``--out``.
"""

import argparse
import logging
import platform
import sys
import time

import kvpress
import torch
import transformers

from kvpress_critical.analysis.output import RunFolder, write_json
from kvpress_critical.analysis.plots import plot_all
from kvpress_critical.analysis.presses import MODES, label, press_pairs
from kvpress_critical.analysis.runner import analyze
from kvpress_critical.analysis.samples import load_rows, samples_from_rows
from kvpress_critical.analysis.summary import head_means, markdown_table, reduction_map, summarize, table_rows
from kvpress_critical.presses.catalogue import BASE_PRESSES

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpress-critical-analysis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a model folder"
    )
    parser.add_argument(
        "--data", default="smoke", help="'smoke' (offline RULER-style generator) or a .jsonl/.json/.csv/.parquet file"
    )
    parser.add_argument(
        "--n-samples", type=int, default=1, help="samples per task (smoke) or per task column value (file)"
    )
    parser.add_argument("--context-length", type=int, default=1024, help="smoke context length in tokens")
    parser.add_argument("--tasks", type=_names, default=None, help="comma-separated task names (default: all)")
    parser.add_argument("--press", choices=sorted(BASE_PRESSES), default="snapkv", help="base press")
    parser.add_argument("--modes", type=_names, default=["kv", "adakv"], help=f"comma-separated, from {sorted(MODES)}")
    parser.add_argument("--ratios", type=_floats, default=[0.5, 0.8], help="comma-separated compression ratios")
    parser.add_argument(
        "--query-aware",
        action="store_true",
        help="compress the question with the context (the paper's setting) instead of context-only (kvpress's)",
    )
    parser.add_argument("--max-answer-tokens", type=int, default=16, help="teacher-forced answer tokens per sample")
    parser.add_argument(
        "--out", default="outputs/analysis", help="parent folder of the run folder (committed runs: results/analysis)"
    )
    parser.add_argument("--name", default=None, help="run folder name (default: a timestamp; never overwritten)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--no-plots", action="store_true", help="skip the figures")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def load_model(model: str, dtype: torch.dtype, device: str):
    """``(model, tokenizer, name)`` for ``--model``."""
    if model == "default":
        from kvpress_critical.default_model import DEFAULT_MODEL_NAME, load_default_model

        return (*load_default_model(dtype=dtype, device=device), DEFAULT_MODEL_NAME)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
    return loaded.to(device).eval(), AutoTokenizer.from_pretrained(model), model


def _rounded(rows: list) -> list:
    return [[float(f"{x:.5g}") for x in row] for row in rows]


def per_head(results, pairs) -> dict:
    """Per-head means over samples (first decoded token), for every press and every pair's reduction."""
    presses = {}
    for pair in pairs:
        for name in (pair.base_name, pair.critical_name):
            key = label(name, pair.ratio)
            presses[key] = {
                metric: _rounded(head_means(results, key, metric, "first_token").mean(0).tolist())
                for metric in ("actual", "theta", "theta_prev", "end_to_end")
            }
    reductions = {
        f"{label(p.critical_name, p.ratio)} vs {p.base_name}": _rounded(reduction_map(results, p).tolist())
        for p in pairs
    }
    return {"layout": "[layer][query head]", "presses": presses, "reduction": reductions}


def main(argv=None) -> "RunFolder":
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def cli(argv=None) -> int:
    """``kvpress-critical-analysis`` (console script): :func:`main`, with an exit status."""
    main(argv)
    return 0


def _run(args, argv) -> RunFolder:
    started = time.time()

    model, tokenizer, model_name = load_model(args.model, _DTYPES[args.dtype], args.device)
    rows = load_rows(
        args.data,
        tokenizer,
        context_length=args.context_length,
        n_samples=args.n_samples,
        tasks=args.tasks,
        seed=args.seed,
    )
    samples = samples_from_rows(rows, tokenizer, max_answer_tokens=args.max_answer_tokens, query_aware=args.query_aware)
    if not samples:
        raise SystemExit(f"no samples in {args.data!r}")
    pairs = press_pairs(args.press, args.ratios, modes=args.modes)
    logger.info(
        "%s: %d samples (%s), %d presses x %d ratios",
        model_name,
        len(samples),
        args.data,
        2 * len(args.modes),
        len(args.ratios),
    )
    results = analyze(model, samples, pairs, max_new_tokens=args.max_answer_tokens, progress=not args.quiet)

    config = {
        "model": model_name,
        "data": args.data,
        "n_samples": len(samples),
        "context_length": args.context_length if args.data == "smoke" else None,
        "tasks": args.tasks,
        "press": args.press,
        "modes": args.modes,
        "ratios": args.ratios,
        "max_answer_tokens": args.max_answer_tokens,
        "compression": "query-aware (question compressed with the context)" if args.query_aware else "context-only",
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "seconds": round(time.time() - started, 1),
        "command": "python -m kvpress_critical.analysis " + " ".join(sys.argv[1:] if argv is None else argv),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "kvpress": getattr(kvpress, "__version__", None),
        },
    }
    summary = summarize(results, pairs, config)
    with RunFolder(args.out, args.name) as run:
        write_json(run.tmp / "summary.json", summary)
        write_json(run.tmp / "table.json", table_rows(summary))
        (run.tmp / "table.md").write_text(markdown_table(summary))
        write_json(run.tmp / "per_head.json", per_head(results, pairs))
        if not args.no_plots:
            plot_all(results, pairs, summary, run.tmp)
    print(markdown_table(summary))
    for pair in summary["pairs"]:
        first = pair["first_token"]
        print(
            f"{pair['critical']} vs {pair['base']}: heads improved {first['heads_improved']:.1%}, "
            f"mean perturbation {first['mean_base']:.3f} -> {first['mean_critical']:.3f}, "
            f"KL {pair['kl']['base']:.4f} -> {pair['kl']['critical']:.4f}"
        )
    print(f"heads improved overall: {summary['overall_heads_improved_first_token']['all']:.1%}")
    print(f"results: {run.path}")
    return run
