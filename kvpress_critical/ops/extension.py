"""The C++/CUDA extension (``csrc/``): compiled from the shipped sources on first use, cached, shared by processes.

The extension is a shared library that registers the ``kvpress_critical::*`` operators through ``torch.library``
(the ``cpp`` and ``cuda`` backends of the ops). It is not built when the package is installed: its sources travel
inside the package (``kvpress_critical/_csrc/`` in a wheel or an sdist install; ``csrc/`` of a source checkout and of
``pip install -e .``), and the first use compiles them with ``torch.utils.cpp_extension`` for the torch that is
installed. Why, and not a compiled wheel: one pure wheel serves every torch version and every CUDA build (a compiled
extension is tied to the exact torch it was built against), and installing needs no torch in pip's isolated build
environment (which would download a multi-GB CUDA build of torch on a CPU machine).

The library is cached under ``$KVPRESS_CRITICAL_HOME/extensions/<tag>/`` (default ``~/.cache/kvpress_critical``),
one folder per (torch version, CPU or CUDA version, Python version, hash of the sources): upgrading torch or the
package builds a new one and never loads a stale library. The build runs in a child process under a file lock, so
parallel workers (evaluation sweeps, pytest-xdist) compile once, and the library is published with an atomic rename.
``kvpress-critical-build`` compiles it ahead of time (container images, offline GPU nodes).

Environment: ``KVPRESS_CRITICAL_COMPILE=0`` never compiles (only a library built before is loaded);
``KVPRESS_CRITICAL_BUILD_CUDA=1`` insists on the CUDA kernels (a missing toolchain is an error), ``0`` builds the CPU
part only, unset builds CUDA when torch is a CUDA build and nvcc is found; ``TORCH_CUDA_ARCH_LIST`` selects the GPU
architectures (default: the visible GPUs'; the kernels need sm_80 or newer for bf16); ``CXX`` the C++ compiler.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]
LIB_NAME = "kvpress_critical_ops"
CPU_SOURCES = ("projected_norm.cpp", "ragged_attention.cpp")
CUDA_SOURCES = ("projected_norm_cuda.cpp", "projected_norm_kernel.cu")
HEADERS = (
    "checks.h",
    "projected_norm_kernel.h",
    "cpu_tile_kernel.inc",
    "cpu_tile_bf16_kernel.inc",
    "cpu_attention_kernel.inc",
)
SOURCES = CPU_SOURCES + CUDA_SOURCES + HEADERS
BUILD_HINT = "run `kvpress-critical-build` to see the compiler's output"


def sources_dir() -> Path:
    """Where the sources are: ``kvpress_critical/_csrc`` (installed package) or ``csrc/`` beside it (checkout)."""
    for folder in (PACKAGE_DIR / "_csrc", PACKAGE_DIR.parent / "csrc"):
        if all((folder / name).is_file() for name in SOURCES):
            return folder
    raise FileNotFoundError(
        f"the C++/CUDA sources of kvpress-critical are missing (looked in {PACKAGE_DIR / '_csrc'} and "
        f"{PACKAGE_DIR.parent / 'csrc'}): reinstall the package (`pip install --force-reinstall kvpress-critical`)"
    )


def sources_hash(folder: Path | None = None) -> str:
    """sha256 over every source and header of the extension."""
    folder = sources_dir() if folder is None else folder
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def cache_root() -> Path:
    """Folder of the compiled libraries (``$KVPRESS_CRITICAL_HOME/extensions``)."""
    home = os.environ.get("KVPRESS_CRITICAL_HOME", Path.home() / ".cache" / "kvpress_critical")
    return Path(home) / "extensions"


def build_tag(cuda: bool, digest: str | None = None) -> str:
    """The cache folder name of a build: torch version, CPU or CUDA version, Python version, sources hash."""
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    torch_version = torch.__version__.replace("+", "_")
    return f"torch{torch_version}-{accelerator}-{python}-{(digest or sources_hash())[:16]}"


def library_path(cuda: bool, digest: str | None = None) -> Path:
    """Path of the compiled library of this environment (it may not exist yet)."""
    return cache_root() / build_tag(cuda, digest) / f"{LIB_NAME}.so"


def _tool_path() -> str:
    """PATH with this interpreter's bin folder first (a virtual environment's ``ninja`` package lives there)."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def cuda_toolchain() -> str | None:
    """None when CUDA code can be compiled against this torch, else why not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc was not found: install the CUDA toolkit matching torch.version.cuda, or set CUDA_HOME"
    return None


def cpp_toolchain() -> str | None:
    """None when the C++ part can be compiled here, else what is missing and how to get it."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (
            f"no C++ compiler ({compiler!r} is not on PATH): install one (e.g. `apt install g++`, `conda install "
            "gxx`) or point $CXX at it"
        )
    if shutil.which("ninja", path=_tool_path()) is None:
        return "ninja is not installed: `pip install ninja`"
    return None


def want_cuda() -> bool:
    """Whether to compile the CUDA kernels, from ``KVPRESS_CRITICAL_BUILD_CUDA`` and the toolchain."""
    flag = os.environ.get("KVPRESS_CRITICAL_BUILD_CUDA", "").strip().lower()
    reason = cuda_toolchain()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        if reason is not None:
            raise RuntimeError(f"KVPRESS_CRITICAL_BUILD_CUDA=1 but CUDA cannot be compiled: {reason}")
        return True
    return reason is None


def _compile(source_dir: Path, cuda: bool, build_dir: Path, verbose: bool) -> Path:
    """Compile the library into ``build_dir`` (in this process: the child of :func:`build`)."""
    from torch.utils.cpp_extension import load

    os.environ["PATH"] = _tool_path()
    # -fopenmp: at::parallel_for is an inline template that runs serially unless _OPENMP is defined where it is
    # compiled. The library links libgomp.so.1 by soname, which resolves to the copy torch has already loaded.
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
    names = CPU_SOURCES + (CUDA_SOURCES if cuda else ())
    name = LIB_NAME + ("_cuda" if cuda else "_cpu")
    built = load(
        name=name,
        sources=[str(source_dir / n) for n in names],
        extra_cflags=["-O3", *openmp],
        extra_ldflags=openmp,
        extra_cuda_cflags=["-O3", "-std=c++17"],
        extra_include_paths=[str(source_dir)],
        build_directory=str(build_dir),
        with_cuda=cuda,
        is_python_module=False,
        verbose=verbose,
    )
    return Path(built) if isinstance(built, (str, os.PathLike)) else build_dir / f"{name}.so"


def build(cuda: bool | None = None, verbose: bool = False, force: bool = False) -> Path:
    """
    Compile the extension for this environment (once; under a file lock) and return the library's path.

    Parameters
    ----------
    cuda : bool, optional
        Compile the CUDA kernels too (default: :func:`want_cuda`).
    verbose : bool
        Show the compiler's commands and output.
    force : bool
        Compile even if the library exists.

    Raises
    ------
    RuntimeError
        When the compilation fails (the compiler's output is in the message).
    """
    cuda = want_cuda() if cuda is None else cuda
    source_dir = sources_dir()
    digest = sources_hash(source_dir)
    target = library_path(cuda, digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent) + ".lock"):
        if target.is_file() and (target.parent / "build_info.json").is_file() and not force:
            return target
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent.parent) as tmp:
            # a child process running this file as a script (torch only, not the package): the library torch's
            # builder loads stays out of this process, which loads the published copy
            command = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--compile-into",
                tmp,
                "--sources",
                str(source_dir),
            ]
            command += ["--cuda" if cuda else "--cpu"] + (["--verbose"] if verbose else [])
            env = {**os.environ, "PATH": _tool_path()}
            run = subprocess.run(command, env=env, capture_output=not verbose, text=True)
            if run.returncode != 0:
                output = "" if verbose else (run.stdout + run.stderr)[-4000:]
                raise RuntimeError(f"compiling the kvpress-critical extension failed:\n{output}")
            built = next(Path(tmp).glob("*.so"))
            staged = target.with_suffix(".so.tmp")
            shutil.copy2(built, staged)
            os.replace(staged, target)  # atomic: a process loading an older copy keeps its mapping
        info = {
            "torch": torch.__version__,
            "cuda": cuda,
            "torch_cuda": torch.version.cuda,
            "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
            "python": sys.version.split()[0],
            "sources": str(source_dir),
            "sources_sha256": digest,
            "seconds": round(time.perf_counter() - start, 1),
        }
        staged_info = target.parent / "build_info.json.tmp"
        staged_info.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(staged_info, target.parent / "build_info.json")  # its presence marks a finished build
        logger.info("compiled %s (%s) in %.0f s", target, "CPU + CUDA" if cuda else "CPU", info["seconds"])
    return target


@dataclass
class ExtensionState:
    """Outcome of loading the extension in this process."""

    reason: str | None  # None when loaded
    cuda: bool = False  # whether the CUDA kernels are compiled in
    path: Path | None = None


_STATE: ExtensionState | None = None


def _compile_allowed() -> bool:
    return os.environ.get("KVPRESS_CRITICAL_COMPILE", "auto").strip().lower() not in ("0", "false", "no", "off")


def _register_fakes() -> None:
    @torch.library.register_fake("kvpress_critical::head_projected_norm")
    def _head_projected_norm_fake(values, head_proj, norm):
        return values.new_empty(values.shape[:3], dtype=torch.float32)

    @torch.library.register_fake("kvpress_critical::head_projected_norm.out")
    def _head_projected_norm_out_fake(values, head_proj, norm, *, out):
        return None

    @torch.library.register_fake("kvpress_critical::ragged_attention")
    def _ragged_attention_fake(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale):
        bsz, heads, q_len, head_dim = query.shape
        return query.new_empty((bsz, q_len, heads, head_dim))  # (B, q, H, d), the query's dtype

    @torch.library.register_fake("kvpress_critical::ragged_attention_quantized")
    def _ragged_attention_quantized_fake(query, *_):
        bsz, heads, q_len, head_dim = query.shape
        return query.new_empty((bsz, q_len, heads, head_dim))

    @torch.library.register_fake("kvpress_critical::paged_ragged_attention")
    def _paged_ragged_attention_fake(query, *_, **__):
        bsz, heads, q_len, head_dim = query.shape
        return query.new_empty((bsz, q_len, heads, head_dim))


def _find_or_build() -> tuple[Path | None, bool, str | None]:
    """``(library, cuda, reason)``: the library to load (building it when allowed), or why there is none."""
    try:
        digest = sources_hash()
    except FileNotFoundError as error:
        return None, False, str(error)
    variants = [True, False] if torch.version.cuda is not None else [False]
    for cuda in variants:  # a library built before is used as it is
        path = library_path(cuda, digest)
        if path.is_file() and (path.parent / "build_info.json").is_file():
            return path, cuda, None
    if not _compile_allowed():
        return (
            None,
            False,
            (
                "the C++ extension is not compiled for this environment and KVPRESS_CRITICAL_COMPILE=0 forbids "
                "compiling it on first use: run `kvpress-critical-build` once"
            ),
        )
    missing = cpp_toolchain()
    if missing is not None:
        return None, False, f"the C++ extension cannot be compiled here: {missing}"
    try:
        cuda = want_cuda()
    except RuntimeError as error:
        return None, False, str(error)
    logger.warning(
        "kvpress-critical: compiling the C++%s extension for torch %s (once per environment, about %s; cached in %s)",
        "/CUDA" if cuda else "",
        torch.__version__,
        "a few minutes" if cuda else "10-30 s",
        cache_root(),
    )
    try:
        return build(cuda=cuda), cuda, None
    except RuntimeError as error:
        if not cuda:
            return None, False, f"{error}\n{BUILD_HINT}"
        logger.warning("the CUDA kernels failed to compile; building the CPU kernels only:\n%s", error)
    try:
        return build(cuda=False), False, None
    except RuntimeError as error:
        return None, False, f"{error}\n{BUILD_HINT}"


def _load() -> ExtensionState:
    path, cuda, reason = _find_or_build()
    if path is None:
        return ExtensionState(reason)
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        return ExtensionState(f"the C++ extension {path} failed to load ({error}): delete it and {BUILD_HINT}")
    _register_fakes()
    logger.debug("loaded %s (cuda=%s)", path, cuda)
    return ExtensionState(None, cuda=cuda, path=path)


def extension_state() -> ExtensionState:
    """Load the extension once per process (compiling it on first use) and remember the outcome."""
    global _STATE
    if _STATE is None:
        _STATE = _load()
    return _STATE


def cpp_availability() -> str | None:
    """None when the CPU operators are loaded, else why not and how to fix it."""
    return extension_state().reason


def cuda_availability() -> str | None:
    """None when the CUDA operators are loaded and a GPU is visible, else why not and how to fix it."""
    state = extension_state()
    if state.reason is not None:
        return state.reason
    if not state.cuda:
        return (
            "the C++ extension was compiled without CUDA: on a machine with nvcc and a CUDA build of torch, run "
            "`KVPRESS_CRITICAL_BUILD_CUDA=1 kvpress-critical-build`"
        )
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def main(argv: list[str] | None = None) -> int:
    """``kvpress-critical-build``: compile the extension for this environment ahead of its first use."""
    parser = argparse.ArgumentParser(prog="kvpress-critical-build", description=main.__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cuda", action="store_true", help="compile the CUDA kernels too (fails without nvcc)")
    group.add_argument("--cpu", action="store_true", help="compile the CPU kernels only")
    parser.add_argument("--force", action="store_true", help="compile even if the library exists")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands and output")
    parser.add_argument("--compile-into", help=argparse.SUPPRESS)  # the child process of build()
    parser.add_argument("--sources", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_into:
        print(_compile(Path(args.sources), args.cuda, Path(args.compile_into), args.verbose))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = True if args.cuda else False if args.cpu else None
    if cuda:
        reason = cuda_toolchain()
        if reason is not None:
            parser.error(f"--cuda: {reason}")
    start = time.perf_counter()
    path = build(cuda=cuda, verbose=args.verbose, force=args.force)
    info = json.loads((path.parent / "build_info.json").read_text())
    kind = "CPU + CUDA" if info["cuda"] else "CPU"
    print(f"kvpress-critical extension ({kind}, torch {info['torch']}): {path} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
