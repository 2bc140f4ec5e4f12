"""Build the C++/CUDA extension of kvpress-critical: ``make build``.

Same as ``python kvpress_critical/ops/build_extension.py`` (run as a script it imports only torch, not the package).

The extension is a shared library that registers the ``kvpress_critical::*`` operators through ``torch.library``
(see ``csrc/``); it is not a Python module. It is compiled with ``torch.utils.cpp_extension`` (ninja) into
``build/ext`` and copied to ``kvpress_critical/_ext/`` with a ``build_info.json`` recording the torch version,
whether CUDA was compiled in, and a hash of the sources, so that a stale or mismatched library is reported
instead of loaded (:mod:`kvpress_critical.ops.cpp_backend`).

CUDA is compiled in when torch is a CUDA build and nvcc is found; ``KVPRESS_CRITICAL_BUILD_CUDA=1`` makes a
missing CUDA toolchain an error, ``KVPRESS_CRITICAL_BUILD_CUDA=0`` skips CUDA. ``TORCH_CUDA_ARCH_LIST`` selects
the GPU architectures (default: those of the visible GPUs; the kernels need sm_80 or newer for bf16).
"""

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_DIR.parent
CSRC_DIR = REPO_ROOT / "csrc"
EXT_DIR = PACKAGE_DIR / "_ext"
BUILD_DIR = REPO_ROOT / "build" / "ext"
LIB_NAME = "kvpress_critical_ops"
LIB_PATH = EXT_DIR / f"{LIB_NAME}.so"
INFO_PATH = EXT_DIR / "build_info.json"

CPU_SOURCES = ("projected_norm.cpp", "ragged_attention.cpp")
CUDA_SOURCES = ("projected_norm_cuda.cpp", "projected_norm_kernel.cu")
HEADERS = ("checks.h", "projected_norm_kernel.h", "cpu_tile_kernel.inc", "cpu_attention_kernel.inc")


def sources_hash(csrc_dir: Path = CSRC_DIR) -> str | None:
    """sha256 over every source and header of the extension, or None when ``csrc/`` is not shipped."""
    digest = hashlib.sha256()
    for name in CPU_SOURCES + CUDA_SOURCES + HEADERS:
        path = csrc_dir / name
        if not path.exists():
            return None
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cuda_toolchain() -> str | None:
    """None when CUDA code can be compiled against this torch, else why not."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc was not found (set CUDA_HOME)"
    return None


def want_cuda() -> bool:
    """Whether to compile the CUDA kernels, from ``KVPRESS_CRITICAL_BUILD_CUDA`` and the toolchain."""
    flag = os.environ.get("KVPRESS_CRITICAL_BUILD_CUDA", "").strip().lower()
    reason = _cuda_toolchain()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        if reason is not None:
            raise RuntimeError(f"KVPRESS_CRITICAL_BUILD_CUDA=1 but CUDA cannot be compiled: {reason}")
        return True
    if reason is not None:
        logger.info("building the CPU extension only: %s", reason)
    return reason is None


def build(verbose: bool = False) -> Path:
    """Compile the extension and install it into ``kvpress_critical/_ext/``; returns the library path."""
    import torch
    from torch.utils.cpp_extension import load

    if not CSRC_DIR.is_dir():
        raise FileNotFoundError(
            f"{CSRC_DIR} not found: the extension is built from a source checkout of kvpress-critical "
            "(git clone, then `pip install -e .` and `make build`)"
        )
    # torch's builder runs `ninja` from PATH: put this interpreter's bin (a venv with the `ninja` package) first
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    with_cuda = want_cuda()
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # the CPU-only and the CUDA builds are different libraries: never mix their object files
    name = LIB_NAME + ("_cuda" if with_cuda else "_cpu")
    # -fopenmp: at::parallel_for is an inline template that runs serially unless _OPENMP is defined where it is
    # compiled. The library links libgomp.so.1 by soname, which resolves to the copy torch has already loaded.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
    lib = load(
        name=name,
        sources=[str(CSRC_DIR / n) for n in names],
        extra_cflags=["-O3", *openmp],
        extra_ldflags=openmp,
        extra_cuda_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(CSRC_DIR)],
        build_directory=str(BUILD_DIR),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )
    built = Path(lib) if isinstance(lib, (str, os.PathLike)) else BUILD_DIR / f"{name}.so"
    EXT_DIR.mkdir(parents=True, exist_ok=True)
    tmp = LIB_PATH.with_suffix(".so.tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, LIB_PATH)  # atomic: a process loading the old library keeps its mapping
    info = {
        "torch": torch.__version__,
        "cuda": with_cuda,
        "torch_cuda": torch.version.cuda,
        "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
        "sources_sha256": sources_hash(),
    }
    tmp_info = INFO_PATH.with_suffix(".json.tmp")
    tmp_info.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp_info, INFO_PATH)  # atomic too: a process starting now reads the old or the new record
    logger.info("built %s (%s) in %.0f s", LIB_PATH, "CPU + CUDA" if with_cuda else "CPU", time.perf_counter() - start)
    return LIB_PATH


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build(verbose=args.verbose)
    print(f"kvpress-critical extension: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
