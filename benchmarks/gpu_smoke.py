"""Correctness smoke of the GPU backends against the float64 references, in seconds (first step of gpu_check.sh).

Projected-value norm: ``cuda`` and ``triton`` on bf16 / fp16, batch 3, GQA group 4, head_dim 80 and 128, 1000 tokens,
strided values and a strided output, plus one L2 case; each output is compared elementwise with the derived
worst-case accumulation error (``projected_value_norm_error_bound``; tensor-core unit roundoff for 16-bit operands).
Ragged attention (the compact cache's op): every GPU backend against ``ragged_attention_ref`` when the op exists.

Writes one JSON line per case to ``--out`` as soon as it is measured, so a run cut short keeps what it did.

    python benchmarks/gpu_smoke.py --out smoke.jsonl                 # on the GPU machine
    python benchmarks/gpu_smoke.py --device cpu --tokens 64 --out x  # dry run: cpp + Triton interpreter on CPU
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from kvpress_critical.ops.projected_value_norm import (
    PROJECTED_VALUE_NORM,
    projected_value_norm,
    projected_value_norm_ref,
)
from kvpress_critical.ops.projected_value_norm.naive import UNIT_ROUNDOFF, projected_value_norm_error_bound
from kvpress_critical.ops.ragged_attention import (
    ATTENTION_TOLERANCE,
    RAGGED_ATTENTION,
    QuantizedEntries,
    ragged_attention,
    ragged_attention_ref,
    random_layout,
)

HIDDEN = 203 * 16  # not a multiple of any tile size


def norm_cases(tokens: int):
    """(dtype, head_dim, norm) of the smoke: both 16-bit dtypes, both head sizes, and one L2 case."""
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (80, 128):
            yield dtype, head_dim, "l1"
    yield torch.bfloat16, 128, "l2"


def strided_values(bsz, kv_heads, tokens, head_dim, dtype, gen):
    """(B, H_kv, T, d) view of (B, T, H_kv, 2d) storage, every other element: strided in every dimension."""
    storage = torch.randn(bsz, tokens, kv_heads, 2 * head_dim, generator=gen)
    return storage.transpose(1, 2)[..., ::2].to(dtype)


def check_norm(backend, device, dtype, head_dim, norm, tokens, bsz=3, kv_heads=2, group=4) -> dict:
    gen = torch.Generator().manual_seed(head_dim)
    heads = kv_heads * group
    values = strided_values(bsz, kv_heads, tokens, head_dim, dtype, gen)
    weight = (torch.randn(HIDDEN // 16, heads * head_dim, generator=gen) / head_dim**0.5).to(dtype)
    out = torch.full((bsz, tokens, kv_heads), float("nan"), device=device).transpose(1, 2)  # strided output
    start = time.perf_counter()
    result = projected_value_norm(values.to(device), weight.to(device), heads, norm=norm, backend=backend)
    out.copy_(result)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tensor_cores = device.type == "cuda" and dtype != torch.float32
    bound = projected_value_norm_error_bound(
        values, weight, heads, norm, UNIT_ROUNDOFF["tensor_core" if tensor_cores else "ieee"]
    )
    ref = projected_value_norm_ref(values, weight, heads, norm).double()
    error = (out.cpu().double() - ref).abs()
    ratio = float((error / bound.clamp_min(1e-30)).max())
    return dict(
        op="projected_value_norm",
        backend=backend,
        dtype=str(dtype).replace("torch.", ""),
        head_dim=head_dim,
        norm=norm,
        tokens=tokens,
        batch=bsz,
        group=group,
        nan=bool(torch.isnan(out).any()),
        worst_error_over_bound=round(ratio, 4),
        ok=bool(ratio <= 1.0 and not torch.isnan(out).any()),
        seconds=round(seconds, 4),
    )


def attention_cases(device: torch.device, tokens: int) -> list[dict]:
    """The ragged attention of the compact cache: every backend of ``device`` against the reference, unequal heads."""
    rows = []
    names = [n for n in RAGGED_ATTENTION.available(device) if n != "torch"] + ["torch"]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for q_len in (1, 7):
            lengths = [tokens, 0, 1, tokens // 3, 2 * tokens, 17]  # batch 3 x 2 KV heads, very unequal
            layout = random_layout(3, 2, 4, q_len, 128, lengths, tail_len=q_len + 5, capacity=q_len + 9, dtype=dtype)
            for entries in ("float", "int8", "int4"):  # the context entries as stored: float, or codes and scales
                inputs = list(layout)
                if entries != "float":
                    bits = int(entries[3:])
                    inputs[1], inputs[2] = (QuantizedEntries.quantize(x, bits) for x in layout[1:3])
                rows += _attention_rows(device, names, inputs, q_len, dtype, entries)
    return rows


def _attention_rows(device, names, inputs, q_len, dtype, entries) -> list[dict]:
    rows = []
    ref = ragged_attention_ref(*inputs, tail_len=q_len + 5, scale=128**-0.5).double()
    for name in names:
        backend = RAGGED_ATTENTION[name]
        if backend.refusal(inputs[0], inputs[1]) is not None:
            continue
        moved = [t.to(device) for t in inputs]
        start = time.perf_counter()
        out = ragged_attention(*moved, tail_len=q_len + 5, scale=128**-0.5, backend=name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        error = float((out.cpu().double() - ref).abs().max())
        tol = ATTENTION_TOLERANCE[dtype]
        rows.append(
            dict(
                op="ragged_attention",
                backend=name,
                dtype=str(dtype).replace("torch.", ""),
                entries=entries,
                q_len=q_len,
                max_abs_error=error,
                ok=bool(error <= tol[1] + tol[0] * float(ref.abs().max()) and not torch.isnan(out).any()),
                seconds=round(time.perf_counter() - start, 4),
            )
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file (appended to as cases finish)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    candidates = ("cuda", "triton") if device.type == "cuda" else ("cpp", "triton")
    backends = [b for b in candidates if b in PROJECTED_VALUE_NORM.available(device)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failures = 0
    with args.out.open("a") as f:

        def emit(row):
            nonlocal failures
            failures += row.get("ok") is False
            line = json.dumps(row)
            f.write(line + "\n")
            f.flush()
            print(line, flush=True)

        emit(dict(device=str(device), backends=backends, torch=torch.__version__))
        for backend in backends:
            for dtype, head_dim, norm in norm_cases(args.tokens):
                try:
                    emit(check_norm(backend, device, dtype, head_dim, norm, args.tokens))
                except Exception as e:  # one failing case must not hide the others
                    emit(
                        dict(
                            op="projected_value_norm",
                            backend=backend,
                            dtype=str(dtype),
                            head_dim=head_dim,
                            norm=norm,
                            ok=False,
                            error=repr(e),
                            traceback=traceback.format_exc(limit=3),
                        )
                    )
        for row in attention_cases(device, args.tokens):
            emit(row)
    print(f"smoke: {failures} failing case(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
