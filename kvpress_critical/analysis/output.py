"""Writing a run: everything goes to a temporary folder that is renamed into place at the end, under a
name no earlier run used, so results are never partial and never overwritten."""

import json
import logging
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["RunFolder", "write_json"]


def write_json(path: Path, data) -> None:
    """Write ``data`` as indented JSON."""
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


class RunFolder:
    """
    ``with RunFolder(out, name) as run:`` write files into ``run.tmp``; on success the folder becomes
    ``run.path = out/<name>`` (default name: a timestamp), or ``out/<name>-1``, ``-2``... when taken.
    On error nothing is left behind.
    """

    def __init__(self, out: str | Path, name: str | None = None):
        self.out = Path(out)
        self.name = name or datetime.now().strftime("%Y%m%d-%H%M%S")
        self.tmp: Path | None = None
        self.path: Path | None = None

    def __enter__(self) -> "RunFolder":
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.name}-", dir=self.out))
        return self

    def _reserve(self) -> Path:
        """Create (atomically, so that two runs never share it) and return a free run folder."""
        for i in range(10_000):
            candidate = self.out / (self.name if i == 0 else f"{self.name}-{i}")
            try:
                candidate.mkdir()
                return candidate
            except FileExistsError:
                continue
        raise RuntimeError(f"no free run folder name for {self.name!r} in {self.out}")

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                final = self._reserve()
                os.replace(self.tmp, final)  # onto the empty folder just reserved: atomic on POSIX
                final.chmod(0o755)
                self.path = final
                logger.info("results written to %s", final)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
