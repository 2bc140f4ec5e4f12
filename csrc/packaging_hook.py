"""Packaging hook shared by the two distributions: ship ``csrc/``'s kernel sources as ``kvpress_critical/_csrc``.

The C++/CUDA extension is compiled from those sources on first use (``kvpress_critical.ops.extension``), for whichever
torch is installed, so every wheel and sdist install carries them. An editable install needs no copy: it compiles
from ``csrc/`` of the checkout. (This file is build tooling; it is not shipped.)
"""

from pathlib import Path

from setuptools.command.build_py import build_py

SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".inc")


def kernel_sources_build_py(csrc: Path) -> type:
    """A ``build_py`` command that copies the kernel sources of ``csrc`` into the built ``kvpress_critical``."""

    class BuildPyWithKernelSources(build_py):
        def run(self):
            super().run()
            if getattr(self, "editable_mode", False):
                return
            target = Path(self.build_lib) / "kvpress_critical" / "_csrc"
            self.mkpath(str(target))
            for source in sorted(Path(csrc).iterdir()):
                if source.suffix in SOURCE_SUFFIXES:
                    self.copy_file(str(source), str(target / source.name))

    return BuildPyWithKernelSources
