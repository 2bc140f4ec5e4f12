"""The first run of docs/vllm.md as a script: its blocks marked ``<!-- first-run: install -->`` and
``<!-- first-run -->``, for a venv of your choosing.

``make vllm-venv`` builds the plugin's test venv with the install block (so a clean clone installs exactly what the
docs tell a newcomer to install, from the package index), and the plugin's tests run the other blocks in that venv::

    python3 integrations/vllm/first_run.py install .venv-vllm | bash -euxo pipefail
    python3 integrations/vllm/first_run.py run .venv-vllm      # conversion, offline example, server and client

Standard library only: it runs before the venv exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
VENV = "vllm-env"  # the docs' venv folder
BLOCK = re.compile(r"<!-- first-run(?P<install>: install)? -->\n```bash\n(?P<code>.*?)\n```", re.S)


def blocks(kind: str, doc: Path = DOC) -> list[str]:
    """The documented blocks of ``kind`` ("install" or "run"), as written."""
    if kind not in ("install", "run"):
        raise ValueError(f"kind must be 'install' or 'run', not {kind!r}")
    return [m["code"] for m in BLOCK.finditer(doc.read_text()) if bool(m["install"]) == (kind == "install")]


def script(kind: str, venv: str = VENV, doc: Path = DOC) -> str:
    """The blocks of ``kind`` joined, with the docs' ``vllm-env/`` replaced by ``venv``."""
    return "\n".join(re.sub(rf"(?<![\w.-]){VENV}(?![\w-])", venv, code) for code in blocks(kind, doc))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: first_run.py install|run VENV")
    print(script(sys.argv[1], sys.argv[2]))
