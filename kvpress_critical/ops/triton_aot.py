"""Ahead-of-time compilation of the Triton kernels for a GPU architecture, without a GPU: resource usage.

Triton compiles for any target (``GPUTarget("cuda", 90, 32)``) on a machine without a GPU, and ships ``ptxas``.
:func:`resource_usage` compiles a kernel configuration to PTX and assembles it with ``ptxas -v``, which reports
registers, stack frame and spill bytes: the test suite checks that the tile configurations of the launchers do
not spill on Hopper (sm_90) and Ampere (sm_80), and ``benchmarks/gpu_check.sh`` records the same numbers.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@dataclass(frozen=True)
class ResourceUsage:
    """What ``ptxas -v`` reports for one kernel."""

    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


_TL_NAMES = {tl.float32: "fp32", tl.float16: "fp16", tl.bfloat16: "bf16"}


def _ptxas() -> str:
    """The newest ptxas Triton ships (it must accept the PTX version Triton emits)."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which("ptxas")
    if found is None:
        raise FileNotFoundError("no ptxas found (Triton's nvidia backend ships one)")
    return found


def compile_kernel(fn, signature: dict, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    """``triton.compile`` of the jitted ``fn`` for ``cuda`` compute capability ``arch`` (e.g. 90)."""
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def ptxas_usage(ptx: str, arch: int) -> ResourceUsage:
    """Assemble ``ptx`` with ``ptxas -v`` for ``sm_<arch>`` and parse its report."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run(
            [_ptxas(), "-v", "--gpu-name", gpu, str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
        )
    report = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{report}")

    def number(pattern: str) -> int:
        match = re.search(pattern, report)
        return int(match.group(1)) if match else 0

    return ResourceUsage(
        registers=number(r"Used (\d+) registers"),
        stack_bytes=number(r"(\d+) bytes stack frame"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        shared_bytes=number(r"(\d+) bytes smem"),
    )


def projected_norm_usage(
    arch: int,
    compute_dtype,
    block_t: int,
    block_n: int,
    block_d: int,
    num_warps: int,
    num_stages: int,
    block_k: int | None = None,
    l1: bool = True,
) -> ResourceUsage:
    """Resource usage of the projected-norm kernel for one tile configuration (fp32 accumulators)."""
    from kvpress_critical.ops.projected_value_norm.triton_kernel import _head_projected_norm

    operand = _TL_NAMES[compute_dtype]
    signature = {"values_ptr": f"*{operand}", "proj_ptr": f"*{operand}", "out_ptr": "*fp32"}
    ints = "num_kv_heads tokens head_dim features group sv_b sv_h sv_t sv_d sp_h sp_n sp_d so_b so_h so_t".split()
    signature.update({name: "i32" for name in ints})
    precision = "ieee" if compute_dtype == tl.float32 else "tf32"
    constexprs = dict(
        L1=l1,
        BLOCK_T=block_t,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_K=block_k or block_d,
        COMPUTE_DTYPE=compute_dtype,
        INPUT_PRECISION=precision,
    )
    compiled = compile_kernel(triton.jit(_head_projected_norm), signature, constexprs, arch, num_warps, num_stages)
    return ptxas_usage(compiled.asm["ptx"], arch)


def launcher_usage(arch: int, operand_dtype, head_dim: int, norm: str = "l1") -> tuple:
    """``(TileConfig, ResourceUsage)`` of the configuration the launcher picks on ``sm_<arch>`` for these operands."""
    from kvpress_critical.ops.projected_value_norm.triton_backend import block_d, gpu_tile_config

    sixteen_bit = operand_dtype != tl.float32
    cfg = gpu_tile_config((arch // 10, arch % 10), sixteen_bit, head_dim)
    width = block_d(head_dim)
    usage = projected_norm_usage(
        arch,
        operand_dtype,
        cfg.block_t,
        cfg.block_n,
        width,
        cfg.num_warps,
        cfg.num_stages,
        block_k=min(width, cfg.block_k or width),
        l1=norm == "l1",
    )
    return cfg, usage


# (operand dtype, head_dim, norm): every dtype path, the head sizes of the supported models, both norms for fp32
# (L2 always runs on the fp32 Gram factors)
CASES = [("float32", d, norm) for d in (64, 128, 256) for norm in ("l1", "l2")]
CASES += [("bfloat16", d, "l1") for d in (64, 128, 256)] + [("float16", 128, "l1")]


def ragged_attention_usage(
    arch: int, query_dtype: str, fmt: str, head_dim: int, rows: int
) -> tuple[dict, ResourceUsage]:
    """``(constexprs, ResourceUsage)`` of the ragged-attention kernel as the launcher configures it on ``sm_<arch>``
    for a ``query_dtype`` query over ``fmt`` entries (``"float"``: entries of the query's dtype; or a name of
    :data:`~kvpress_critical.ops.ragged_attention.codes.FORMATS`), ``rows`` query rows per segment."""
    import torch

    from kvpress_critical.ops.ragged_attention.codes import FORMATS
    from kvpress_critical.ops.ragged_attention.triton_backend import kernel_constants
    from kvpress_critical.ops.ragged_attention.triton_kernel import get_attention_kernel

    dtype = getattr(torch, query_dtype)
    operand = _TL_NAMES[getattr(tl, query_dtype)]
    key_spec, value_spec = FORMATS[fmt] if fmt != "float" else (None, None)
    constants, warps, stages = kernel_constants(
        dtype, dtype if key_spec is None else None, key_spec, value_spec, rows, head_dim
    )

    def entries(spec) -> str:  # int8 symmetric 8-bit codes, uint8 otherwise (codes.py)
        return operand if spec is None else ("i8" if spec.bits == 8 and spec.symmetric else "u8")

    def code_args(spec) -> list[str]:  # scales, zeros, groups (absent ones: the int64 offsets stand in)
        if spec is None:
            return ["*i64"] * 3
        return ["*fp32", "*fp32", "*i32" if spec.per_channel else "*i64"]

    signature = {"q_ptr": f"*{operand}", "k_ptr": f"*{entries(key_spec)}", "v_ptr": f"*{entries(value_spec)}"}
    signature.update(zip(("ks_ptr", "kz_ptr", "kg_ptr"), code_args(key_spec)))
    signature.update(zip(("vs_ptr", "vz_ptr", "vg_ptr"), code_args(value_spec)))
    signature.update(cu_ptr="*i64", tk_ptr=f"*{operand}", tv_ptr=f"*{operand}", o_ptr="*fp32", ml_ptr="*fp32")
    ints = "sq_b sq_h sq_i sq_d sk_n sk_d sv_n sv_d st_b st_h st_t st_d su_b su_h su_t su_d"
    ints += " num_kv_heads group q_len head_dim tail_len"
    signature.update({name: "i32" for name in ints.split()})
    signature.update(scale="fp32", chunk="i32", n_splits="i32", rows_pad="i32")
    compiled = compile_kernel(get_attention_kernel(), signature, constants, arch, warps, stages)
    return constants, ptxas_usage(compiled.asm["ptx"], arch)


# (query dtype, entries, head_dim, rows, archs): every entry format under every query dtype at head_dim 128 in
# decoding (a GQA group of 4 rows), the other head sizes and a prefill chunk (64 rows) with 16-bit operands
RAGGED_CASES = [
    (q, f, 128, 4, (90,)) for q in ("float32", "bfloat16", "float16") for f in ("float", "int8", "int4", "kivi4")
]
RAGGED_CASES += [("bfloat16", f, d, 4, (90,)) for f in ("float", "kivi4") for d in (64, 256)]
RAGGED_CASES += [("bfloat16", f, 128, rows, (80,)) for f in ("float", "kivi4") for rows in (4, 64)]
RAGGED_CASES += [("bfloat16", f, 128, 64, (90,)) for f in ("float", "kivi4")]


def ragged_attention_table() -> list[dict]:
    """Resource usage of the ragged-attention kernel for every case of :data:`RAGGED_CASES`."""
    rows = []
    for query_dtype, fmt, head_dim, n_rows, archs in RAGGED_CASES:
        for arch in archs:
            constants, usage = ragged_attention_usage(arch, query_dtype, fmt, head_dim, n_rows)
            sixteen = constants["COMPUTE_DTYPE"] != tl.float32
            config = {k: v for k, v in constants.items() if k.startswith("BLOCK")}
            rows.append(
                dict(arch=arch, query=query_dtype, entries=fmt, head_dim=head_dim, rows=n_rows, sixteen_bit=sixteen,
                     config=config, **asdict(usage))
            )  # fmt: skip
    return rows


def paged_ragged_attention_usage(
    arch: int, dtype: str, head_dim: int, rows: int, cache: str | None = None, soft_cap: bool = False
) -> tuple[dict, ResourceUsage]:
    """``(constexprs, ResourceUsage)`` of the paged ragged-attention kernel as its launcher configures it on
    ``sm_<arch>`` for a ``dtype`` query and a cache of the same dtype or of ``cache`` fp8 codes (``"float8_e4m3fn"``,
    ``"float8_e5m2"``: read as bytes), ``rows`` query rows per segment, with or without a logits ``soft_cap``."""
    import torch

    from kvpress_critical.ops.paged_ragged_attention.triton_backend import paged_constants
    from kvpress_critical.ops.paged_ragged_attention.triton_kernel import get_paged_kernel

    torch_dtype = getattr(torch, dtype)
    operand = _TL_NAMES[getattr(tl, dtype)]
    entries = "u8" if cache else operand
    constants, warps, stages = paged_constants(torch_dtype, getattr(torch, cache or dtype), rows, head_dim)
    constants = {**constants, "SOFT_CAP": soft_cap}
    signature = {"q_ptr": f"*{operand}", "rk_ptr": f"*{entries}", "rv_ptr": f"*{entries}", "rt_ptr": "*i32",
                 "ss_ptr": "*i64", "sl_ptr": "*i64", "tk_ptr": f"*{entries}", "tv_ptr": f"*{entries}", "tt_ptr": "*i32",
                 "tl_ptr": "*i64", "ko_ptr": "*i64", "vo_ptr": "*i64", "o_ptr": "*fp32", "ml_ptr": "*fp32"}  # fmt: skip
    ints = "sq_b sq_h sq_i sq_d srk_b srk_r srv_b srv_r srt_b stk stv stt_b num_kv_heads group q_len head_dim"
    ints += " rows_per_block block_size"
    signature.update({name: "i32" for name in ints.split()})
    signature.update(scale="fp32", v_factor="fp32", soft_cap="fp32", chunk="i32", n_splits="i32", rows_pad="i32")
    compiled = compile_kernel(get_paged_kernel(), signature, constants, arch, warps, stages)
    return constants, ptxas_usage(compiled.asm["ptx"], arch)


# (dtype, head_dim, rows, archs, fp8 cache or None, soft cap): decoding (a GQA group of 4 rows) in every dtype at
# head_dim 128 on sm_90 and sm_80, the other head sizes in bf16, a prefill chunk (64 rows), decoding over fp8 codes of
# either format, decoding with a logits soft cap (Gemma 2's head size)
PAGED_CASES = [(dtype, 128, 4, (80, 90), None, False) for dtype in ("float32", "bfloat16", "float16")]
PAGED_CASES += [("bfloat16", d, 4, (90,), None, False) for d in (64, 256)]
PAGED_CASES += [("bfloat16", 128, 64, (80, 90), None, False)]
PAGED_CASES += [("bfloat16", 128, 4, (80, 90), cache, False) for cache in ("float8_e4m3fn", "float8_e5m2")]
PAGED_CASES += [("bfloat16", 256, 4, (80, 90), None, True)]


def paged_ragged_attention_table() -> list[dict]:
    """Resource usage of the paged ragged-attention kernel for every case of :data:`PAGED_CASES`."""
    rows = []
    for dtype, head_dim, n_rows, archs, cache, soft_cap in PAGED_CASES:
        for arch in archs:
            constants, usage = paged_ragged_attention_usage(arch, dtype, head_dim, n_rows, cache, soft_cap)
            config = {k: v for k, v in constants.items() if k.startswith("BLOCK")}
            case = dict(arch=arch, dtype=dtype, cache=cache or dtype, head_dim=head_dim, rows=n_rows, config=config)
            case["soft_cap"] = soft_cap
            rows.append({**case, **asdict(usage)})
    return rows


def usage_table(archs=(80, 90)) -> list[dict]:
    """Resource usage of every launcher configuration in :data:`CASES` for each architecture."""
    rows = []
    for arch in archs:
        for operand, head_dim, norm in CASES:
            cfg, usage = launcher_usage(arch, getattr(tl, operand), head_dim, norm)
            rows.append(
                dict(arch=arch, operand=operand, head_dim=head_dim, norm=norm, config=asdict(cfg), **asdict(usage))
            )
    return rows


def main(argv=None) -> int:
    """``python -m kvpress_critical.ops.triton_aot [--arch 80,90]``: the table as JSON lines.

    Run it without ``TRITON_INTERPRET=1`` (the interpreter replaces the functions the compiler needs).
    """
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated compute capabilities, e.g. 80,90")
    parser.add_argument(
        "--op",
        default="projected_value_norm",
        choices=("projected_value_norm", "ragged_attention", "paged_ragged_attention"),
        help="the kernel (ragged_attention, paged_ragged_attention: the cases of RAGGED_CASES / PAGED_CASES, each "
        "on its own architectures)",
    )
    args = parser.parse_args(argv)
    if args.op == "ragged_attention":
        table = ragged_attention_table()
    elif args.op == "paged_ragged_attention":
        table = paged_ragged_attention_table()
    else:
        table = usage_table(tuple(int(a) for a in args.arch.split(",")))
    for row in table:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
