"""Shared fixtures of the vLLM plugin's tests: the embedded SmolLM2 as vLLM loads it, shared engines, the mixed batch.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that tests can read the scheduler's block
pool and the worker's state directly. Each engine configuration is started once per session (:data:`ENGINES`, in
the order of cost: a new configuration must say why the others cannot serve its test) and exercised by requests that
carry their own options; after every test that used it, and after every batch fixture, it must be idle
(:func:`assert_idle`: every block back in the pool, no request state left in the scheduler or the workers), so that
sharing an engine cannot hide a leak. The server, the engine-process tests (async scheduling, tensor parallelism)
and the first run in a fresh venv start their own processes, once each.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import itertools  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from workload import BLOCK_SIZE, ENGINE_OPTIONS, FP8_ROWS, HYBRID_ROWS, ROWS, Row, sampling_params  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
sys.path.append(str(REPO / "tests"))  # the main suite's background jobs (after this folder: its conftest is ours)
import background  # noqa: E402
from engine_process import IDLE_POOL, pool_state  # noqa: E402

POOL_BYTES = 256 * 2**20  # the server's pool: about 5.8K tokens of SmolLM2 in float32
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2's K and V per token in float32
TINY_TOKEN_BYTES = 2 * 2 * 2 * 64 * 4  # the tiny Llama's (tiny_llama: 2 layers, 2 KV heads of 64)


def pool_of(blocks: int, token_bytes: int = TOKEN_BYTES) -> int:
    """``kv_cache_memory_bytes`` of a pool of ``blocks`` usable blocks (vLLM keeps one more as its null block)."""
    return (blocks + 1) * BLOCK_SIZE * token_bytes


def cpu_attention_impl(monkeypatch, dtype, cache_dtype: str, num_kv_heads: int, head_size: int, group: int = 2):
    """vLLM's ``CPU_ATTN`` implementation of one layer, built outside an engine (it reads the engine's model dtype when
    built, for encoder attention: given here)."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: engine)
    return CPUAttentionBackendImpl(
        num_heads=group * num_kv_heads, head_size=head_size, scale=head_size**-0.5, num_kv_heads=num_kv_heads,
        alibi_slopes=None, sliding_window=None, kv_cache_dtype=cache_dtype,
    )  # fmt: skip


def fp8_on_this_cpu() -> str | None:
    """None where vLLM's CPU attention stores fp8 KV caches on this machine, else why not (its tests then skip)."""
    import torch

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        return "vLLM's CPU attention stores fp8 KV caches on x86 with AVX-512 or AMX only; this CPU has neither"
    return None


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


# The engine configurations of the suite, each started at most once per session. "default" serves the mixed batch
# and every test that needs no particular pool; the others exist because their tests need what "default" cannot be.
ENGINES = {
    # the mixed batch (19 requests, 7K prompt tokens) without preemption: a pool of 10K tokens
    "default": dict(plugin={**ENGINE_OPTIONS, "record_selections": True}, kv_cache_memory_bytes=pool_of(320)),
    # vLLM's chunked prefill in 128-token steps: a request's window queries come from several steps
    "chunked_prefill": dict(
        plugin={**ENGINE_OPTIONS, "record_selections": True}, max_num_batched_tokens=128, max_num_seqs=8
    ),
    # a small pool: more requests at once in the same blocks, long prompts and generations held to their bounds. Its
    # tests count blocks and requests, not tokens: the tiny Llama serves them (its three tests 102 s on SmolLM2 in the
    # 2-core EPYC's CI run, 3 s on it by hand)
    "small_pool": dict(
        plugin=ENGINE_OPTIONS, model=lambda: tiny_llama(), kv_cache_memory_bytes=pool_of(64, TINY_TOKEN_BYTES)
    ),
    # longer than the pool: max_model_len 2048 in 16 blocks, every request bounded by the engine's schedules. On the
    # tiny Llama, as its reference "tiny" (below): its tests compare the answers of requests served in different
    # pools, preempted or not, failing or not; they took 90 s of SmolLM2's forwards in the plugin suite
    "bounded": dict(
        plugin={
            **ENGINE_OPTIONS,
            "compression_ratio": 0.95,
            "compression_chunk_size": 128,
            "compression_interval": 64,
            "target_size": 64,
            "window_size": 32,
        },
        model=lambda: tiny_llama(),
        kv_cache_memory_bytes=pool_of(16, TINY_TOKEN_BYTES),
    ),  # fmt: skip
    # the tiny Llama in a pool that holds every request of the bounded engine's tests at once: their reference, and
    # the one-rank run the TP=2 engine process is compared with
    "tiny": dict(
        plugin={**ENGINE_OPTIONS, "record_selections": True},
        model=lambda: tiny_llama(),
        kv_cache_memory_bytes=pool_of(160, TINY_TOKEN_BYTES),
    ),
    # a hybrid model (SmolLM2 with two sliding-window layers beside each full-attention one): three KV-cache groups,
    # of which the plugin compresses one; no other engine serves this model. With vLLM's prefix cache on (its
    # batch's prompts share no prefix; a later request reuses a compressed one's untouched blocks)
    "hybrid": dict(
        plugin={**ENGINE_OPTIONS, "record_selections": True},
        model=lambda: hybrid_smollm2()[0],
        kv_cache_memory_bytes=pool_of(160),
        enable_prefix_caching=True,
    ),
    # an fp8 KV cache (e4m3 codes, one byte an element): the cache's format is the engine's, so no other engine can
    # serve these requests; the same bytes as the default engine's pool, four times its blocks
    "fp8": dict(
        plugin={**ENGINE_OPTIONS, "record_selections": True},
        kv_cache_dtype="fp8",
        kv_cache_memory_bytes=pool_of(320),
    ),
    # vLLM's prefix cache on: every uncompressed request may take hits, which the other engines' exactness tests
    # (answers computed from scratch) assume away; the default engine, with it off, is this one's reference. Without
    # record_selections, whose records start at a request's first compaction: compressed prefixes are shared here
    "prefix_cache": dict(
        plugin=ENGINE_OPTIONS,
        kv_cache_memory_bytes=pool_of(160),
        enable_prefix_caching=True,
    ),  # fmt: skip
}

# in-process engines share the process's distributed state, which shutting one down (or collecting it) tears down for
# all: every engine the tests make lives until the session ends
_ENGINES: dict = {}
_KEPT: list = []


def make_llm(plugin: dict | None = None, **overrides):
    """An in-process engine of the tests' arguments with ``overrides`` (the plugin's options: ``plugin``), kept alive
    until the session ends."""
    from vllm import LLM

    kwargs = engine_kwargs(**overrides)
    if plugin is not None:
        kwargs["additional_config"] = {"kvpress_critical": plugin}
    _KEPT.append(LLM(**kwargs))
    return _KEPT[-1]


def shared_engine(name: str):
    """The session's engine of configuration ``name`` (:data:`ENGINES`), started on first use."""
    if name not in _ENGINES:
        config = dict(ENGINES[name])
        if callable(config.get("model")):  # a model folder the tests make
            config["model"] = config["model"]()
        _ENGINES[name] = make_llm(config.pop("plugin"), **config)
    return _ENGINES[name]


def scheduler_of(llm):
    """The engine core's scheduler of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def worker_of(llm):
    """The in-process engine's worker."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


_PROBES = iter(range(10**9))


def assert_idle(llm) -> None:
    """
    The engine is idle: no request left, every block back in the pool (vLLM's null block aside), no request state in
    the plugin's scheduler or workers. Workers learn which requests finished with the next step, so one uncompressed
    one-token request runs first. A request left running (a test that failed midway) is aborted, so that the next
    test finds the engine clean, and the check fails.
    """
    from vllm import SamplingParams

    engine, scheduler = llm.llm_engine, scheduler_of(llm)
    leftover = sorted(scheduler.requests)
    if leftover:
        engine.engine_core.engine_core.abort_requests(leftover)
    # the engine's own options: a 3-token prompt is never compacted, and fits any pool whole
    engine.add_request(f"idle-probe-{next(_PROBES)}", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1))
    for _ in stepped(llm):
        pass
    workers = llm.collective_rpc("kvpress_critical_tracked")
    state = {"requests left running": leftover, **pool_state(scheduler), "requests the workers track": workers}
    idle = {"requests left running": [], **IDLE_POOL, "requests the workers track": [0] * len(workers)}
    assert state == idle, f"the engine is not idle after the test: {state}"


def _checked_engine(name: str):
    @pytest.fixture
    def fixture():
        llm = shared_engine(name)
        assert_idle(llm)  # a test starts from an idle engine
        yield llm
        assert_idle(llm)

    fixture.__doc__ = f"The session's {name!r} engine (conftest.ENGINES), checked idle before and after the test."
    return fixture


engine = _checked_engine("default")
chunked_prefill_engine = _checked_engine("chunked_prefill")
small_pool_engine = _checked_engine("small_pool")
bounded_engine = _checked_engine("bounded")
tiny_engine = _checked_engine("tiny")
prefix_cache_engine = _checked_engine("prefix_cache")
hybrid_engine = _checked_engine("hybrid")
fp8_engine = _checked_engine("fp8")


def step_limit(scheduler) -> int:
    """Steps an engine may take to finish the requests it holds: three times their tokens (a step computes at least
    one token of a request; preempted ones recompute theirs), so that a request that can never be admitted, or is
    preempted and recomputed forever, fails its test instead of stalling the suite."""
    return 100 + 3 * sum(r.num_prompt_tokens + r.max_tokens for r in scheduler.requests.values())


def stepped(llm):
    """The outputs of each step of an in-process engine until it holds no request (the requests are counted at the
    first step); past :func:`step_limit` steps the test fails with the scheduler's state."""
    scheduler = scheduler_of(llm)
    limit = step_limit(scheduler)
    for step in itertools.count(1):
        if not llm.llm_engine.has_unfinished_requests():
            return
        if step > limit:
            state = {
                r.request_id: (r.status.name, r.num_computed_tokens, r.num_preemptions)
                for r in scheduler.requests.values()
            }
            pytest.fail(
                f"the engine took {step} steps for requests worth at most {limit}: it makes no progress {state}"
            )
        yield llm.llm_engine.step()


@dataclass
class Served:
    """Requests an engine ran to the end (by the names they were added with): tokens, finish reasons, the plugin's
    latest record of each compressed one, vLLM's internal ids, and the most requests that ran at once."""

    tokens: dict
    finish: dict
    records: dict
    ids: dict
    peak: int


def serve(llm, requests: dict, on_step=None) -> Served:
    """Add ``requests`` (``{name: (prompt ids, SamplingParams)}``, names unique in the session) to ``llm`` and step it
    until every request ends; ``on_step(scheduler, ids)`` is called after every step (a trace)."""
    scheduler = scheduler_of(llm)
    for name, (prompt, params) in requests.items():
        llm.llm_engine.add_request(name, {"prompt_token_ids": prompt}, params)
    ids = {rid.rpartition("-")[0]: rid for rid in scheduler.requests if rid.rpartition("-")[0] in requests}
    tokens, finish, peak = {}, {}, 0
    for outputs in stepped(llm):
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
                finish[output.request_id] = output.outputs[0].finish_reason
        peak = max(peak, len(scheduler.running))
        if on_step is not None:
            on_step(scheduler, ids)
    records = {name: scheduler.kvpress_records[rid] for name, rid in ids.items() if rid in scheduler.kvpress_records}
    return Served(tokens, finish, records, ids, peak)


def internal_id(selections: dict, request_id: str) -> str:
    """vLLM's internal id of a request (``<request_id>-<suffix>``), as the worker and scheduler know it."""
    matches = [key for key in selections if key.rpartition("-")[0] == request_id]
    assert len(matches) == 1, (request_id, list(selections))
    return matches[0]


def real_blocks(scheduler, request_id: str) -> int:
    """Blocks a request holds in the pool (its null placeholders aside): the plugin's own count."""
    from kvpress_critical_vllm.vllm_compat import real_blocks_held

    return real_blocks_held(scheduler, request_id)


@pytest.fixture(scope="session")
def prompt_ids():
    """Token ids of an English text (the repository's licence), long enough for 2K-token prompts."""
    return token_ids()


@dataclass
class Result:
    """A row of a batch as the engine ran it: its prompt, greedy tokens, and the entries it kept (``record_selections``:
    after its last compaction, and after each one)."""

    row: Row
    prompt: list[int]
    tokens: list[int]
    kept: dict | None
    stages: list[dict]


def job_results(job: dict, rows, prompt_ids) -> list[Result]:
    """``rows`` as an engine process ran them (``engine_process.py``'s result ``job``, rank 0's selections)."""
    (selections,), (stages,) = job["selections"][:1], job["stages"][:1]
    return [
        Result(row, row.prompt(prompt_ids), job["tokens"][i], selections[i], stages[i]) for i, row in enumerate(rows)
    ]


def run_batch(llm, rows, prompt_ids) -> list[Result]:
    """``rows`` run together by ``llm`` (its engine-wide options under each row's own), then the engine checked idle."""
    prompts = [row.prompt(prompt_ids) for row in rows]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [sampling_params(row) for row in rows])
    selections = llm.collective_rpc("kvpress_critical_selections")[0]
    stages = llm.collective_rpc("kvpress_critical_stage_selections")[0]
    results = []
    for row, prompt, output in zip(rows, prompts, outputs):
        matches = [key for key in selections if key.rpartition("-")[0] == output.request_id]
        kept = selections[matches[0]] if matches else None
        steps = [value for key, value in stages.items() if key.rpartition("-")[0] == output.request_id]
        results.append(Result(row, prompt, list(output.outputs[0].token_ids), kept, steps[0] if steps else []))
    assert_idle(llm)
    return results


# whether the session's tests compare selections with the transformers presses (set at collection): the mixed batch
# then starts that comparison's reference run in the background as soon as the engine is done with it
_REFERENCE_SELECTIONS = {"wanted": False, "run": None}


_BACKGROUND: list[str] = []  # the background jobs of the selected tests (tests/background.py)


@pytest.hookimpl(trylast=True)  # after -m and -k deselected: only the jobs of the tests that run
def pytest_collection_modifyitems(config, items):
    """Tests that compare with the transformers presses' selections run after the other in-process tests (the
    reference run, in kvpress's environment on one core, overlaps them), and the tests that read a background job
    (engine processes, the fresh venv, the benchmark scripts) last, their jobs having run beside everything else."""
    wanted = [item for item in items if "reference_selections" in getattr(item, "fixturenames", ())]
    _REFERENCE_SELECTIONS["wanted"] = bool(wanted)
    items[:] = [item for item in items if item not in wanted] + wanted
    background.move_to_end(items)
    _BACKGROUND[:] = background.selected(items)
    _SERVER["wanted"] = any("server" in getattr(item, "fixturenames", ()) for item in items)


_SERVER: dict = {"wanted": False, "server": None}


@pytest.fixture(scope="session", autouse=True)
def background_jobs(tmp_path_factory):
    """The selected tests' background jobs, started with the session's first test (and the server, if a selected
    test uses it, launched then too: it starts while the first tests run); at the session's end, the jobs still
    running, the server and the transformers presses' reference run are stopped."""
    if _SERVER["wanted"]:
        _SERVER["server"] = launch_server(tmp_path_factory.mktemp("server"), dict(ENGINE_OPTIONS))
    jobs = background.start_session(_BACKGROUND, tmp_path_factory)
    yield jobs
    jobs.stop()
    if _SERVER["server"] is not None and _SERVER["server"].process.poll() is None:
        stop_server(_SERVER["server"])
    if _REFERENCE_SELECTIONS["run"] is not None and _REFERENCE_SELECTIONS["run"][1].process.poll() is None:
        _REFERENCE_SELECTIONS["run"][1].process.kill()


def pytest_terminal_summary(terminalreporter):
    background.report(terminalreporter)


@pytest.fixture
def background_job(request, background_jobs) -> background.Job:
    """The background job of the test's ``background`` marker, once it has ended."""
    return background_jobs.finished(request.node.get_closest_marker(background.MARKER).args[0])


@pytest.fixture(scope="session")
def mixed_batch(prompt_ids, tmp_path_factory) -> dict[str, Result]:
    """Every row of ``workload.ROWS`` run together by the default engine: ``{row name: Result}``."""
    from selections import PressSelections, reference_request

    llm = shared_engine("default")
    assert_idle(llm)
    before = llm.collective_rpc("kvpress_critical_compacted")[0]
    results = run_batch(llm, ROWS, prompt_ids)
    batch = {result.row.name: result for result in results}
    batch["compactions"] = llm.collective_rpc("kvpress_critical_compacted")[0] - before
    if _REFERENCE_SELECTIONS["wanted"]:
        compressed = [r for r in results if r.row.kind != "uncompressed"]
        run = PressSelections([reference_request(r) for r in compressed], tmp_path_factory.mktemp("press-reference"))
        _REFERENCE_SELECTIONS["run"] = ([r.row.name for r in compressed], run)
    return batch


@pytest.fixture(scope="session")
def fp8_batch(prompt_ids) -> dict[str, Result]:
    """The fp8 engine's batch (``workload.FP8_ROWS``: every schedule over an fp8 KV cache), then idle."""
    return {result.row.name: result for result in run_batch(shared_engine("fp8"), FP8_ROWS, prompt_ids)}


@pytest.fixture(scope="session")
def hybrid_batch(prompt_ids) -> dict[str, Result]:
    """The hybrid engine's batch (``workload.HYBRID_ROWS``: every schedule on the hybrid SmolLM2), then idle."""
    return {result.row.name: result for result in run_batch(shared_engine("hybrid"), HYBRID_ROWS, prompt_ids)}


@pytest.fixture(scope="session")
def reference_selections(mixed_batch) -> dict:
    """What the transformers presses keep for each compressed row of the mixed batch (kvpress's environment, run in
    the background since the batch ended): ``{row name: what press_reference.py returned for it}``."""
    names, run = _REFERENCE_SELECTIONS["run"]
    return dict(zip(names, run.result(), strict=True))


def first_fast(names: list[str]) -> list:
    """Parameters of a test over rows: the first row in the fast tier, the others marked slow (a transformers
    reference that generates with compactions takes seconds per row)."""
    return [names[0], *(pytest.param(name, marks=pytest.mark.slow) for name in names[1:])]


def results_of(batch: dict, kind: str) -> list[Result]:
    return [result for name, result in batch.items() if isinstance(result, Result) and result.row.kind == kind]


@pytest.fixture(scope="session")
def reference_model():
    """The embedded model in transformers (vLLM's environment), for the greedy references."""
    from reference import load_reference_model

    return load_reference_model(model_path())


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


def launch_server(folder: Path, plugin: dict, *flags: str) -> Server:
    """``python -m vllm.entrypoints.openai.api_server`` with the plugin, run outside the checkout (so that the
    installed wheel, not the repository's sources, is imported), float32, eager, 32-token blocks, a 256 MiB pool;
    :func:`wait_until_ready` waits for it."""
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
    return Server(f"http://127.0.0.1:{port}", log, process)


def wait_until_ready(server: Server, timeout: float = 300) -> Server:
    """Wait for ``/health`` to answer 200 (the test fails with the server's log if it exits or does not start)."""
    deadline = time.time() + timeout
    while True:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n{server.log_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
                if response.status == 200:
                    return server
        except OSError:
            pass
        if time.time() > deadline:
            server.process.kill()
            pytest.fail(f"the server did not start in {timeout} s:\n{server.log_text()[-4000:]}")
        time.sleep(1)


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()


@pytest.fixture(scope="session")
def server(background_jobs):
    """The session's server: CriticalKV(SnapKV) at ratio 0.5 (launched with the session's first test)."""
    running = wait_until_ready(_SERVER["server"])
    yield running
    stop_server(running)


def make_tiny_llama(folder: Path) -> str:
    """A two-layer Llama with 4 query and 2 KV heads (random weights, SmolLM2's tokenizer) saved in ``folder``:
    ``architectures.py``'s ``llama``. For tensor parallelism (TP=2 needs an even number of KV heads; SmolLM2 has 3),
    the engines whose tests count blocks or compare answers across pools (``small_pool``, ``bounded``, ``tiny``) and
    the benchmark scripts' quick runs: a forward pass costs a small part of SmolLM2's."""
    from architectures import make_model

    return make_model("llama", folder, Path(model_path()))


_TINY_LLAMA: dict = {}


def session_folder(prefix: str) -> Path:
    """A new temporary folder, removed when the session's process exits (for model folders that engine
    configurations name before any fixture runs)."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def tiny_llama() -> str:
    """The session's tiny Llama folder (:func:`make_tiny_llama`), made once."""
    if "path" not in _TINY_LLAMA:
        _TINY_LLAMA["path"] = make_tiny_llama(session_folder("tiny-llama-") / "model")
    return _TINY_LLAMA["path"]


HYBRID_WINDOW = 128  # the sliding window of the hybrid SmolLM2's sliding layers


def hybrid_layer_types(num_layers: int) -> list[str]:
    """Two sliding-window layers, then one full-attention layer (as Gemma 3 and gpt-oss alternate them)."""
    return ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(num_layers)]


def make_hybrid_smollm2(folder: Path) -> tuple[str, str]:
    """
    SmolLM2's trained weights as a hybrid model: two sliding-window layers of :data:`HYBRID_WINDOW` tokens beside each
    full-attention one (``layer_types``), in two folders sharing the weights: ``(vLLM's, transformers')``. vLLM reads
    ``layer_types`` in its Llama; transformers' Llama has no sliding window, its Ministral (Llama's layers with
    ``layer_types``) serves as the reference.
    """
    source = Path(model_path())
    config = json.loads((source / "config.json").read_text())
    config.update(sliding_window=HYBRID_WINDOW, layer_types=hybrid_layer_types(config["num_hidden_layers"]))
    paths = []
    kinds = (("vllm", "LlamaForCausalLM", "llama"), ("reference", "MinistralForCausalLM", "ministral"))
    for kind, architecture, model_type in kinds:
        target = folder / kind
        target.mkdir(parents=True)
        (target / "config.json").write_text(
            json.dumps({**config, "architectures": [architecture], "model_type": model_type}, indent=1)
        )
        for item in source.iterdir():
            if item.name != "config.json":
                (target / item.name).symlink_to(item.resolve())
        paths.append(str(target))
    return paths[0], paths[1]


_HYBRID: dict = {}


def hybrid_smollm2() -> tuple[str, str]:
    """The session's hybrid SmolLM2 folders (:func:`make_hybrid_smollm2`), made once."""
    if "paths" not in _HYBRID:
        _HYBRID["paths"] = make_hybrid_smollm2(session_folder("hybrid-smollm2-"))
    return _HYBRID["paths"]


def token_ids() -> list[int]:
    """Token ids of the repository's licence (the ``prompt_ids`` fixture's, for background jobs)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())((REPO / "LICENSE").read_text())["input_ids"]
