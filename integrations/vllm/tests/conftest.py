"""Shared fixtures of the vLLM plugin's tests: the embedded SmolLM2 as vLLM loads it, engines, prompts.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that tests can read the scheduler's block
pool and the worker's state directly; the server and async-scheduling tests start their own processes.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
BLOCK_SIZE = 32
POOL_BYTES = 256 * 2**20  # about 5.8K tokens of SmolLM2 in float32


def model_path() -> str:
    """The embedded SmolLM2 folder vLLM loads (``kvpress_critical.default_model.vllm_model_path``, made by `make`)."""
    path = os.environ.get("KVPRESS_CRITICAL_VLLM_MODEL") or str(
        Path.home() / ".cache" / "kvpress_critical" / "SmolLM2-135M-Instruct-vllm"
    )
    if not (Path(path) / "config.json").is_file():
        pytest.fail(
            f"no SmolLM2 folder for vLLM at {path}: run the tests with `make test-vllm`, which converts the embedded "
            "model and sets KVPRESS_CRITICAL_VLLM_MODEL"
        )
    return path


def engine_kwargs(**overrides) -> dict:
    """``LLM`` arguments of the tests: float32, eager, 32-token blocks, a fixed KV pool, no prefix caching."""
    kwargs = dict(
        model=model_path(),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=POOL_BYTES,
        enable_prefix_caching=False,
        seed=0,
    )
    kwargs.update(overrides)
    return kwargs


# in-process engines share the process's distributed state, which shutting one down tears down for all: every engine
# the tests make lives until the session ends
_ENGINES: list = []


def make_llm(plugin: dict | None = None, **overrides):
    from vllm import LLM

    kwargs = engine_kwargs(**overrides)
    if plugin is not None:
        kwargs["additional_config"] = {"kvpress_critical": plugin}
    llm = LLM(**kwargs)
    _ENGINES.append(llm)
    return llm


def scheduler_of(llm):
    """The engine core's scheduler of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def run_to_end(llm) -> tuple[dict[str, list[int]], int]:
    """Step an in-process engine until its requests finish: the tokens of each (by request id), and the most requests
    that ran at once."""
    scheduler = scheduler_of(llm)
    tokens, peak = {}, 0
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
    return tokens, peak


def internal_id(selections: dict, request_id: str) -> str:
    """vLLM's internal id of a request (``<request_id>-<suffix>``), as the worker and scheduler know it."""
    matches = [key for key in selections if key.rpartition("-")[0] == request_id]
    assert len(matches) == 1, (request_id, list(selections))
    return matches[0]


@pytest.fixture(scope="session")
def prompt_ids():
    """Token ids of an English text (the repository's licence), long enough for 2K-token prompts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    return tokenizer((REPO / "LICENSE").read_text())["input_ids"]


@pytest.fixture(scope="session")
def engine():
    """The session's compressing engine: CriticalKV(SnapKV) at ratio 0.5, selections recorded."""
    return make_llm({"press": "critical_snapkv", "compression_ratio": 0.5, "record_selections": True})


NEW_TOKENS = 32
PRESSES = ("critical_snapkv", "snapkv", "critical_knorm", "knorm", "critical_streaming_llm", "streaming_llm")


@pytest.fixture(scope="session")
def batch(engine, prompt_ids):
    """One batch of the session's engine: six prompts of different lengths, each with its own press (per request)."""
    from vllm import SamplingParams

    lengths = (300, 521, 777, 404, 650, 1100)
    prompts = [prompt_ids[37 * i : 37 * i + length] for i, length in enumerate(lengths)]
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, extra_args={"kvpress_critical": {"press": press}})
        for press in PRESSES
    ]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    selections = engine.collective_rpc("kvpress_critical_selections")[0]
    return prompts, outputs, selections


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """An OpenAI-compatible server with the plugin, on a loopback port, and its log."""

    url: str
    log: Path
    process: subprocess.Popen

    def log_text(self) -> str:
        return self.log.read_text()

    def engine_pids(self) -> set[int]:
        import psutil

        return {child.pid for child in psutil.Process(self.process.pid).children(recursive=True)}


def start_server(folder: Path, plugin: dict, *flags: str, timeout: float = 300) -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin, run outside the checkout (so that the
    installed wheel, not the repository's sources, is imported), float32, eager, 32-token blocks, a 256 MiB pool."""
    port = free_port()
    log = folder / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path(), "--served-model-name", "smollm2",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", str(POOL_BYTES), "--no-enable-prefix-caching",
        "--additional-config", json.dumps({"kvpress_critical": plugin}), *flags,
    ]  # fmt: skip
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")  # the server's default: engine in its own process
    env.pop("KVPRESS_CRITICAL_METRICS_DIR", None)  # the server makes its own
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=folder)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return Server(url, log, process)
        except OSError:
            pass
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"the server did not start in {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(2)


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The session's server: CriticalKV(SnapKV) at ratio 0.5."""
    running = start_server(tmp_path_factory.mktemp("server"), {"press": "critical_snapkv", "compression_ratio": 0.5})
    yield running
    stop_server(running)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A two-layer Llama with 4 query and 2 KV heads (random weights, SmolLM2's tokenizer), for tensor parallelism."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                param.mul_(4.0)  # peaky attention, as in trained models
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((Path(model_path()) / name).read_bytes())
    return str(folder)
