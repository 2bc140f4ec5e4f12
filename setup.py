"""Packaging hook: ship the top-level ``csrc/`` sources inside the package, as ``kvpress_critical/_csrc``.

The C++/CUDA extension is compiled from those sources on first use (``kvpress_critical.ops.extension``), for whichever
torch is installed, so every wheel and sdist install carries them. An editable install (``pip install -e .``) needs
no copy: it compiles from ``csrc/`` of the checkout. Everything else is declared in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".inc")


class BuildPyWithKernelSources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "kvpress_critical" / "_csrc"
        self.mkpath(str(target))
        for source in sorted(Path("csrc").iterdir()):
            if source.suffix in SOURCE_SUFFIXES:
                self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithKernelSources})
