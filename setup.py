"""Packaging hook: ship the top-level ``csrc/`` sources inside the package, as ``kvpress_critical/_csrc``
(``csrc/packaging_hook.py``, shared with the vLLM plugin's distribution). Everything else is declared in
pyproject.toml.
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
from packaging_hook import kernel_sources_build_py  # noqa: E402

setup(cmdclass={"build_py": kernel_sources_build_py(Path("csrc"))})
