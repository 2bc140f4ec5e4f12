"""
Obtain and import kvpress's own evaluation code.

kvpress ships its evaluation runner (``evaluation/evaluate.py``, ``evaluate_registry.py`` and the
``benchmarks`` scorers) in its source distribution on PyPI, not in its wheel. This module finds that folder,
in this order:

1. a path given explicitly (``--kvpress-eval-dir``) or through ``$KVPRESS_EVAL_DIR``;
2. the cache ``<cache_home>/kvpress-sdist/kvpress-<version>/evaluation`` for the *installed* kvpress version;
3. otherwise it downloads that version's sdist once with ``pip download --no-binary :all:`` and unpacks it
   into the cache (under a file lock, published with an atomic rename).

It then imports ``evaluate.py`` by file path under the unique module name ``kvpress_evaluate`` (the plain
name ``evaluate`` is Hugging Face's ``evaluate`` package) and ``evaluate_registry`` from the same folder, so
that both share the same registry dictionaries.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace

from filelock import FileLock

from kvpress_critical.default_model import cache_home

logger = logging.getLogger(__name__)

ENV_VAR = "KVPRESS_EVAL_DIR"
EVALUATE_MODULE = "kvpress_evaluate"
REQUIRED_FILES = ("evaluate.py", "evaluate_registry.py", "benchmarks/ruler/calculate_metrics.py")


def kvpress_version() -> str:
    """Version of the installed kvpress distribution."""
    return importlib.metadata.version("kvpress")


def _check(folder: Path) -> Path:
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} is not kvpress's evaluation folder (missing {', '.join(missing)})")
    return folder


def sdist_cache(version: str | None = None) -> Path:
    """Folder where the sdist of kvpress ``version`` (default: installed) is unpacked."""
    return cache_home() / "kvpress-sdist" / f"kvpress-{version or kvpress_version()}"


def _download_sdist(version: str, target: Path) -> None:
    """Download kvpress ``version``'s sdist with pip and unpack it atomically into ``target``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        logger.info("downloading the kvpress %s sdist from PyPI (once) for its evaluation code", version)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q"]
        command += ["--dest", str(work), f"kvpress=={version}"]
        result = subprocess.run(command, capture_output=True, text=True)
        archives = sorted(work.glob("kvpress-*.tar.gz"))
        if result.returncode != 0 or not archives:
            raise RuntimeError(
                f"could not download the kvpress {version} sdist (`{' '.join(command)}` failed):\n{result.stderr}\n"
                f"Without network access, unpack it by hand and point ${ENV_VAR} at its evaluation/ folder."
            )
        unpacked = work / "unpacked"
        with tarfile.open(archives[0]) as archive:
            if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
                archive.extractall(unpacked, filter="data")
            else:
                for member in archive.getmembers():
                    if member.name.startswith(("/", "..")) or ".." in Path(member.name).parts:
                        raise RuntimeError(f"unsafe path {member.name!r} in {archives[0].name}")
                archive.extractall(unpacked)
        roots = [p for p in unpacked.iterdir() if p.is_dir()]
        if len(roots) != 1:
            raise RuntimeError(f"unexpected layout of {archives[0].name}: {[p.name for p in roots]}")
        _check(roots[0] / "evaluation")
        os.replace(roots[0], target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def evaluation_dir(path: str | os.PathLike | None = None) -> Path:
    """
    kvpress's ``evaluation/`` folder for the installed kvpress version, downloading it once if needed.

    Parameters
    ----------
    path : path-like, optional
        Use this folder instead (default: ``$KVPRESS_EVAL_DIR`` if set, else the cached sdist).
    """
    explicit = path or os.environ.get(ENV_VAR)
    if explicit:
        return _check(Path(explicit).expanduser().resolve())
    version = kvpress_version()
    root = sdist_cache(version)
    if not (root / "evaluation" / "evaluate.py").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root) + ".lock"):
            if not (root / "evaluation" / "evaluate.py").is_file():
                if root.exists():  # left over by an interrupted older layout
                    shutil.rmtree(root)
                _download_sdist(version, root)
    return _check(root / "evaluation")


def _import_from(folder: Path, name: str) -> ModuleType:
    """Import top-level module ``name`` from ``folder`` (on ``sys.path``), refusing a same-named impostor."""
    module = sys.modules.get(name)
    if module is None:
        module = importlib.import_module(name)
    origin = Path(getattr(module, "__file__", "") or "").resolve()
    if folder not in origin.parents:
        raise ImportError(
            f"module {name!r} is already imported from {origin}, not from kvpress's evaluation folder {folder}; "
            "run the evaluation in a fresh process"
        )
    return module


@contextmanager
def _quiet_import():
    """kvpress's registry instantiates every press at import, several of which log warnings; mute them."""
    kvpress_logger = logging.getLogger("kvpress")
    level = kvpress_logger.level
    kvpress_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # fuzzywuzzy's "slow pure-python SequenceMatcher"
            yield
    finally:
        kvpress_logger.setLevel(level)


def import_kvpress_evaluation(path: str | os.PathLike | None = None) -> SimpleNamespace:
    """
    Import kvpress's evaluation runner and registry.

    Returns
    -------
    types.SimpleNamespace
        ``evaluate`` (kvpress's ``evaluate.py``, imported as ``kvpress_evaluate``), ``registry``
        (``evaluate_registry``; mutate its dicts in place, ``evaluate`` sees the same objects) and ``folder``.
    """
    folder = evaluation_dir(path)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))  # evaluate.py imports `benchmarks` and `evaluate_registry` top-level
    with _quiet_import():
        _import_from(folder, "benchmarks")
        registry = _import_from(folder, "evaluate_registry")
        evaluate = sys.modules.get(EVALUATE_MODULE)
        if evaluate is None:
            spec = importlib.util.spec_from_file_location(EVALUATE_MODULE, folder / "evaluate.py")
            evaluate = importlib.util.module_from_spec(spec)
            sys.modules[EVALUATE_MODULE] = evaluate
            try:
                spec.loader.exec_module(evaluate)
            except BaseException:
                del sys.modules[EVALUATE_MODULE]
                raise
    if evaluate.PRESS_REGISTRY is not registry.PRESS_REGISTRY:
        raise ImportError("kvpress's evaluate.py and evaluate_registry.py do not share their registries")
    return SimpleNamespace(evaluate=evaluate, registry=registry, folder=folder)


if __name__ == "__main__":  # `python -m evaluation.kvpress_eval`: fetch kvpress's evaluation code now (make install)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"kvpress's evaluation code: {evaluation_dir()}")
