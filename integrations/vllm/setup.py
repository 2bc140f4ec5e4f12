"""Packaging of the vLLM plugin: its own package, plus the kvpress-free part of kvpress_critical it selects with.

The plugin runs beside vLLM, whose transformers kvpress cannot share, so this distribution carries no kvpress:
``kvpress_critical``'s package root, its selection rules (``selection/``) and its kernels (``ops/``, with the
C++/CUDA sources of ``csrc/`` as ``kvpress_critical/_csrc``) are built from the repository's own files into the
wheel, never copied in the repository. Installing the plugin and kvpress-critical in one environment is not
supported (they own the same files, and need different transformers).
"""

import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
from packaging_hook import kernel_sources_build_py  # noqa: E402

CORE = ["kvpress_critical", "kvpress_critical.selection", "kvpress_critical.ops"]
# every op folder (one per op), as found in the repository
CORE += sorted(
    f"kvpress_critical.ops.{p.parent.name}" for p in (ROOT / "kvpress_critical" / "ops").glob("*/__init__.py")
)
# of the package root's own modules, only these: the others (presses, pipelines, data, ...) need kvpress
# (default_model: where the embedded model's GGUF file is and where its conversions go, shared with the plugin's)
ROOT_MODULES = {"__init__", "_version", "default_model"}


class BuildPy(kernel_sources_build_py(ROOT / "csrc")):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == "kvpress_critical":
            modules = [(pkg, module, path) for pkg, module, path in modules if module in ROOT_MODULES]
        return modules


setup(
    packages=["kvpress_critical_vllm", *CORE],
    package_dir={name: Path("../..", *name.split(".")).as_posix() for name in CORE},
    cmdclass={"build_py": BuildPy},
)
