"""The plugin suite's mixed batch: one set of requests, each with its own options, run together by the shared engine.

Every way the plugin compresses a request is in it at once: the uniform presses after the prompt, the head-wise
presses, compression after every prompt chunk, compression while decoding (alone, after the prompt, after every
chunk), and an uncompressed request beside them. The exactness, selection and engine-feature tests all read their
rows of the same run (``conftest.mixed_batch``); the engine-process tests (async scheduling) run the same requests
through ``engine_process.py`` and must give the same tokens. It imports no vLLM, so that the job of an engine process
can be written from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

BLOCK_SIZE = 32
NEW_TOKENS = 32
DECODE_TOKENS = 160
CHUNK = 128
# the engine-wide options of the shared engine: rows that name no press or ratio get these
ENGINE_OPTIONS = {"press": "critical_snapkv", "compression_ratio": 0.5}

UNIFORM = ("critical_snapkv", "snapkv", "critical_knorm", "knorm", "critical_streaming_llm", "streaming_llm")
HEAD_WISE = ("critical_adakv_snapkv", "adakv_snapkv", "critical_adakv_snapkv", "adakv_snapkv")
CHUNKED = ("critical_snapkv", "snapkv", "critical_knorm", "streaming_llm")


@dataclass(frozen=True)
class Row:
    """One request of the batch: its prompt is ``length`` tokens of the licence text from token ``start``."""

    name: str
    kind: str  # "uniform", "head_wise", "chunked", "decoding" or "uncompressed"
    start: int
    length: int
    options: dict = field(default_factory=dict)
    max_tokens: int = NEW_TOKENS
    ignore_eos: bool = False

    def prompt(self, token_ids: list[int]) -> list[int]:
        prompt = token_ids[self.start : self.start + self.length]
        assert len(prompt) == self.length, f"{self.name}: the text has too few tokens"
        return prompt

    @property
    def press(self) -> str:
        return self.options.get("press", ENGINE_OPTIONS["press"])


def _rows() -> tuple[Row, ...]:
    rows = []
    # prompt lengths of every residue mod the block size, longer and shorter than SnapKV's window times a few
    for i, (press, n) in enumerate(zip(UNIFORM, (150, 263, 389, 202, 333, 548))):
        rows.append(Row(f"uniform/{press}-{n}", "uniform", 37 * i, n, {"press": press}))
    for i, (press, n) in enumerate(zip(HEAD_WISE, (202, 389, 325, 550))):
        rows.append(Row(f"head_wise/{press}-{n}", "head_wise", 53 * i, n, {"press": press}))
    for i, (press, n) in enumerate(zip(CHUNKED, (550, 450, 650, 389))):
        rows.append(
            Row(f"chunked/{press}-{n}", "chunked", 41 * i, n, {"press": press, "compression_chunk_size": CHUNK})
        )
    decoding = (
        (250, {"press": "critical_snapkv", "compression_ratio": 0.0, "window_size": 32, "compression_interval": 48,
               "target_size": 160}),
        (400, {"press": "snapkv", "compression_ratio": 0.5, "window_size": 32, "compression_interval": 48,
               "target_size": 160}),
        (450, {"press": "critical_knorm", "compression_ratio": 0.5, "compression_chunk_size": CHUNK,
               "compression_interval": 40, "target_size": 200}),
        (300, {"press": "streaming_llm", "compression_ratio": 0.0, "compression_interval": 40, "target_size": 128}),
    )  # fmt: skip
    for i, (n, options) in enumerate(decoding):
        rows.append(Row(f"decoding/{options['press']}-{n}", "decoding", 53 * i, n, options, DECODE_TOKENS, True))
    rows.append(Row("uncompressed-325", "uncompressed", 106, 325, {"compression_ratio": 0.0}))
    return tuple(rows)


ROWS = _rows()


# the hybrid engine's batch (conftest.hybrid_batch, and the async-scheduling engine process): every schedule
HYBRID_ROWS = (
    Row("hybrid/critical_snapkv-389", "uniform", 0, 389, {"press": "critical_snapkv"}),
    Row("hybrid/knorm-263", "uniform", 37, 263, {"press": "knorm", "compression_ratio": 0.75}),
    Row("hybrid/critical_streaming_llm-333", "uniform", 74, 333, {"press": "critical_streaming_llm"}),
    Row("hybrid/critical_adakv_snapkv-389", "head_wise", 53, 389, {"press": "critical_adakv_snapkv"}),
    Row("hybrid/chunked-critical_snapkv-550", "chunked", 41, 550, {"compression_chunk_size": CHUNK}),
    Row(
        "hybrid/decoding-snapkv-400",
        "decoding",
        106,
        400,
        {"press": "snapkv", "window_size": 32, "compression_interval": 48, "target_size": 160},
        DECODE_TOKENS,
        True,
    ),
    Row("hybrid/uncompressed-325", "uncompressed", 159, 325, {"compression_ratio": 0.0}),
)


# the fp8 engine's batch (conftest.fp8_batch): every schedule, uniform and head-wise, over an fp8 KV cache
FP8_ROWS = tuple(replace(row, name=row.name.replace("hybrid/", "fp8/")) for row in HYBRID_ROWS) + (
    Row("fp8/adakv_snapkv-450", "head_wise", 211, 450, {"press": "adakv_snapkv", "compression_ratio": 0.75}),
)


# the linear-attention hybrid's batch (test_linear_attention.py): the hybrid batch on Qwen3-Next
LINEAR_ROWS = tuple(replace(row, name=row.name.replace("hybrid/", "linear/")) for row in HYBRID_ROWS)


def rows_of(kind: str) -> list[Row]:
    return [row for row in ROWS if row.kind == kind]


def sampling_params(row: Row):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=row.max_tokens,
        temperature=0,
        ignore_eos=row.ignore_eos,
        extra_args={"kvpress_critical": dict(row.options)},
    )
