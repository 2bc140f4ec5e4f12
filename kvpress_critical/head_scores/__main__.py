"""Profile HeadKV head scores: ``kvpress-critical-head-scores --model <dir|default> --out <file>``.

The same as ``python -m kvpress_critical.head_scores``.
"""

import argparse
import logging
import platform
import sys
import time

import torch


def main(argv=None) -> int:
    from kvpress_critical.head_scores import METHODS, build_trials, profile_head_scores, save_head_scores
    from kvpress_critical.head_scores.profiler import DEFAULT_DEPTHS, DEFAULT_LENGTHS

    parser = argparse.ArgumentParser(prog="kvpress-critical-head-scores", description=__doc__)
    parser.add_argument("--model", default="default", help="'default' (the embedded SmolLM2), a folder or a hub id")
    parser.add_argument("--out", required=True, help="JSON file to write (HeadKV's format; metadata in .meta.json)")
    parser.add_argument("--method", choices=METHODS, default="reasoning")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="context lengths in tokens")
    parser.add_argument("--depths", type=int, default=DEFAULT_DEPTHS, help="needle depths per length")
    parser.add_argument("--needles", type=int, default=2, help="different needles (each tried at every length/depth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--keep-failed", action="store_true", help="also count trials answered wrongly")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    if args.model == "default":
        from kvpress_critical.default_model import DEFAULT_MODEL_NAME, load_default_model

        model, tokenizer = load_default_model(dtype=dtype, device=args.device)
        name = DEFAULT_MODEL_NAME
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
        model = model.to(args.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        name = args.model
    lengths = [int(x) for x in args.lengths.split(",")]
    trials = build_trials(tokenizer, lengths, args.depths, args.needles, args.seed)
    start = time.perf_counter()
    scores, summary = profile_head_scores(model, tokenizer, trials, args.method, require_correct=not args.keep_failed)
    seconds = time.perf_counter() - start
    metadata = dict(
        model=name,
        method=args.method,
        command="python -m kvpress_critical.head_scores " + " ".join(argv if argv is not None else sys.argv[1:]),
        lengths=lengths,
        depths=args.depths,
        needles=args.needles,
        seed=args.seed,
        haystack="kvpress_critical.data.text (the Python Language Reference), 3 distractor needles",
        device=args.device,
        dtype=args.dtype,
        torch=torch.__version__,
        python=platform.python_version(),
        seconds=round(seconds, 1),
        **summary,
    )
    path = save_head_scores(scores, args.out, metadata)
    print(f"wrote {path} ({summary['counted']} of {summary['trials']} trials counted, {seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
