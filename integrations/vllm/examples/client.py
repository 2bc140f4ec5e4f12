"""Ask a running server with kvpress-critical's vLLM plugin (docs/vllm.md, "First run"): one chat completion at the
server's ratio, one that asks for 0.75 through ``vllm_xargs``, and the plugin's counters from ``/metrics``.

    python integrations/vllm/examples/client.py [--url http://127.0.0.1:8000] [--model smollm2]
"""

import argparse
import time
import urllib.request
from pathlib import Path

from openai import OpenAI

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--wait", type=float, default=600, help="seconds to wait for the server to start")
    args = parser.parse_args()
    deadline = time.time() + args.wait
    while True:  # the server loads the model first (about a minute on two cores)
        try:
            urllib.request.urlopen(f"{args.url}/health", timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise SystemExit(f"no server answered at {args.url}")
            time.sleep(2)
    client = OpenAI(base_url=f"{args.url}/v1", api_key="none")
    document = (Path(__file__).resolve().parents[1] / "README.md").read_text() * 4
    for xargs in (None, {"kvpress_critical.compression_ratio": 0.75}):
        reply = client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": f"{document}\n\nIn one sentence, what does this plugin do?"}],
            max_tokens=32,
            temperature=0,
            extra_body={"vllm_xargs": xargs} if xargs else None,
        )
        answer = reply.choices[0].message.content
        print(f"{xargs or 'server default'}: {reply.usage.prompt_tokens} prompt tokens -> {answer!r}")
    with urllib.request.urlopen(f"{args.url}/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith("vllm:kvpress_critical_requests_compressed_total"):
                print(line)
