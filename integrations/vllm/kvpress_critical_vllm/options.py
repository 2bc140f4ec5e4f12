"""What a user asks the plugin for: engine-wide options, per-request overrides, and their validation.

Engine-wide: ``additional_config={"kvpress_critical": {"press": ..., "compression_ratio": ..., ...}}``; per request:
``SamplingParams(extra_args={"kvpress_critical": {...}})`` overrides the options of :data:`REQUEST_OPTIONS`
(``compression_ratio: 0`` leaves that request uncompressed). The OpenAI-compatible server's ``vllm_xargs`` hold flat
values only, so the same overrides are also read from flat keys: ``{"kvpress_critical.compression_ratio": 0.75}``.

Who may set what:

- a request: the press, the ratio and the press's parameters (:data:`REQUEST_OPTIONS`), each within the bounds of
  :func:`check_options`; ``window_size`` and ``kernel_size`` within the engine's ``max_window_size`` and
  ``max_kernel_size``;
- the engine only (:data:`ENGINE_ONLY`): the kernel backend of the projected norm (checked on the engine's device at
  start-up), the bounds above, and ``record_selections`` (tests and analysis).

A request's options are checked where vLLM checks sampling parameters, so a bad value fails in the caller (an HTTP
400 that names the option and its allowed range) and never reaches the engine. This module imports neither vLLM nor
kvpress.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_KEY = "kvpress_critical"


@dataclass(frozen=True)
class PressSpec:
    """How a press of the plugin selects: its base scorer, whether CriticalKV's second stage runs over it, and whether
    its KV heads share the layer's budget (AdaKV) or each keep the same count."""

    base: str  # "snapkv", "knorm" or "streaming_llm"
    critical: bool
    head_wise: bool = False


# press name -> how it selects
PRESSES: dict[str, PressSpec] = {
    "critical_snapkv": PressSpec("snapkv", True),
    "snapkv": PressSpec("snapkv", False),
    "critical_knorm": PressSpec("knorm", True),
    "knorm": PressSpec("knorm", False),
    "critical_streaming_llm": PressSpec("streaming_llm", True),
    "streaming_llm": PressSpec("streaming_llm", False),
    "critical_adakv_snapkv": PressSpec("snapkv", True, head_wise=True),
    "adakv_snapkv": PressSpec("snapkv", False, head_wise=True),
}

# presses of this project the plugin does not run, and why
REFUSED_PRESSES = {
    "adakv_knorm": "the head-wise layout keeps a prompt's last (N mod block_size) tokens in every KV head, which key "
    "norms do not select; use critical_knorm or knorm (uniform budgets)",
    "critical_adakv_knorm": "the head-wise layout keeps a prompt's last (N mod block_size) tokens in every KV head, "
    "which key norms do not select; use critical_knorm or knorm (uniform budgets)",
    "adakv_streaming_llm": "StreamingLLM scores every kept entry alike, so AdaKV's budgets would only order ties; use "
    "streaming_llm or critical_streaming_llm",
    "critical_adakv_streaming_llm": "StreamingLLM scores every kept entry alike, so AdaKV's budgets would only order "
    "ties; use streaming_llm or critical_streaming_llm",
    "headkv_snapkv": "HeadKV's budgets come from offline head scores the plugin does not load; use "
    "kvpress_critical.HeadKVPress in transformers",
    "critical_headkv_snapkv": "HeadKV's budgets come from offline head scores the plugin does not load; use "
    "kvpress_critical.CriticalHeadKVPress in transformers",
    "headkv_expected_attention_no_vnorm": "HeadKV's budgets come from offline head scores the plugin does not load; "
    "use kvpress_critical.HeadKVPress in transformers",
    "critical_headkv_expected_attention": "HeadKV's budgets come from offline head scores the plugin does not load; "
    "use kvpress_critical.CriticalHeadKVPress in transformers",
    **dict.fromkeys(
        (
            "expected_attention_no_vnorm",
            "critical_expected_attention",
            "adakv_expected_attention_no_vnorm",
            "critical_adakv_expected_attention",
        ),
        "ExpectedAttention's scores (from the statistics of the queries to come) are not in the plugin; use it in "
        "transformers (kvpress's ExpectedAttentionPress, inside kvpress_critical.CriticalKVPress)",
    ),
    "defensivekv": "DefensiveKV's worst-case scores are not in the plugin; use kvpress_critical.DefensiveKVPress in "
    "transformers",
    "layer_defensivekv": "Layer-DefensiveKV selects across all layers at once, after the last one; use "
    "kvpress_critical.LayerDefensiveKVPress in transformers",
}

BACKENDS = ("auto", "torch", "cpp", "cuda", "triton")

# what a request may override; the rest of CompressionOptions is the engine's
REQUEST_OPTIONS = (
    "press",
    "compression_ratio",
    "window_size",
    "kernel_size",
    "first_stage_ratio",
    "epsilon",
    "norm",
    "n_sink",
    "alpha_safeguard",
    "compression_chunk_size",
    "compression_interval",
    "target_size",
    "min_kept",
)
# options renamed so that they cannot be mistaken for vLLM's own (chunked prefill, --attention-backend): the old name
# is refused with the new one in the message, never read silently
RENAMED = {"chunk_size": "compression_chunk_size", "attention_backend": "head_wise_kernel"}
ENGINE_ONLY = ("backend", "head_wise_kernel", "record_selections", "max_window_size", "max_kernel_size")
ATTENTION_BACKENDS = ("auto", "torch", "cpp", "triton")

# the largest bounds an engine may set: SnapKV's window is scored as a (heads, window, prompt) float32 softmax
WINDOW_LIMIT = 4096
KERNEL_LIMIT = 255
N_SINK_LIMIT = 4096
CHUNK_LIMIT = 2**24


class OptionsError(ValueError):
    """Options of the plugin that cannot be honoured; the message names the option, its allowed range and the fix."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class CompressionOptions:
    """
    How one request's KV cache is compressed after its prefill.

    Parameters
    ----------
    press : str
        One of :data:`PRESSES`: ``critical_snapkv`` (CriticalKV over SnapKV, the paper's main setting), ``snapkv``,
        ``critical_knorm``, ``knorm``, ``critical_streaming_llm``, ``streaming_llm`` (every KV head keeps the same
        count), ``critical_adakv_snapkv`` (CriticalAdaKV, the paper's best setting) and ``adakv_snapkv`` (AdaKV's
        head-wise budgets: a layer's heads share its budget).
    compression_ratio : float
        Fraction of the prompt's entries to evict, in ``[0, 1)``; 0 leaves the request uncompressed. Each KV head
        keeps ``max(1, int(N * (1 - ratio)))`` entries of an ``N``-token prompt, rounded up to whole KV blocks.
    window_size, kernel_size : int
        SnapKV's observation window (the prompt's last queries) and pooling kernel (odd); at most the engine's
        ``max_window_size`` and ``max_kernel_size``.
    first_stage_ratio : float
        CriticalKV's stage-1 share of the budget (chosen by the base score alone), in ``[0, 1]``.
    epsilon : float
        Added to the base score in CriticalKV's stage 2, in ``[0, 1]``.
    norm : {"l1", "l2"}
        Norm of the projected values ``V W_O``.
    n_sink : int
        StreamingLLM's sink tokens.
    alpha_safeguard : float
        AdaKV's safeguard: every head first keeps its top ``alpha_safeguard * n_kept`` entries, in ``[0, 1]``.
    compression_chunk_size : int
        0 (the default): compress once, after the whole prompt. Otherwise prefill the prompt in chunks of
        ``compression_chunk_size`` tokens and compress after each one, to what ``ChunkedPrefillPress`` keeps for the
        tokens seen so far (rounded up to whole blocks), so that a request never holds more than its budget, one chunk
        and a block per KV head; must exceed ``window_size`` for SnapKV-based presses; uniform presses only.
    compression_interval, target_size : int
        Compression while decoding (kvpress's ``DecodingPress``): every ``compression_interval`` generated tokens,
        each KV head goes back to ``target_size`` entries (rounded up to whole blocks), scored with the last
        ``window_size`` generated tokens' queries for SnapKV-based presses (``compression_interval`` must exceed
        ``window_size``). Both 0 (the default): no compression while decoding. Alone (``compression_ratio`` 0) or
        after the prompt's compression; uniform presses only.
    min_kept : int
        Entries per KV head that no compaction goes below (default 0: none): a prompt of at most ``min_kept`` tokens
        is not compressed, a longer one keeps ``max(min_kept, int(N * (1 - ratio)))`` entries, and compression while
        decoding goes back to ``max(target_size, min_kept)``. With the high ratio a prompt longer than the pool needs,
        it keeps short prompts whole (and fluent) while long ones are still bounded.
    backend : str
        Engine-wide only: backend of :func:`kvpress_critical.projected_value_norm` (``auto``, ``torch``, ``cpp``,
        ``cuda``, ``triton``), checked on the engine's device at start-up.
    head_wise_kernel : str
        Engine-wide only: backend of :func:`kvpress_critical.paged_ragged_attention`, the head-wise rows' attention
        (``auto``: ``cpp`` on CPUs, ``triton`` on GPUs; ``torch``), checked on the engine's device at start-up.
    record_selections : bool
        Engine-wide only: keep the kept positions of every request per (layer, KV head), for tests and analysis
        (``LLM.collective_rpc("kvpress_critical_selections")``, which hands them over and forgets them).
    max_window_size, max_kernel_size : int
        Engine-wide only: the largest ``window_size`` and ``kernel_size`` a request may ask for (default 256 and 31).
    """

    press: str = "critical_snapkv"
    compression_ratio: float = 0.0
    window_size: int = 64
    kernel_size: int = 5
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4
    norm: str = "l1"
    n_sink: int = 4
    alpha_safeguard: float = 0.20
    compression_chunk_size: int = 0
    compression_interval: int = 0
    target_size: int = 0
    min_kept: int = 0
    backend: str = "auto"
    head_wise_kernel: str = "auto"
    record_selections: bool = False
    max_window_size: int = 256
    max_kernel_size: int = 31

    @property
    def spec(self) -> PressSpec:
        return PRESSES[self.press]

    @property
    def base(self) -> str:
        """The base scorer: ``snapkv``, ``knorm`` or ``streaming_llm``."""
        return self.spec.base

    @property
    def critical(self) -> bool:
        """Whether CriticalKV's two-stage selection runs over the base scores."""
        return self.spec.critical

    @property
    def head_wise(self) -> bool:
        """Whether a layer's KV heads share its budget (AdaKV), each keeping its own number of entries."""
        return self.spec.head_wise

    @property
    def decoding(self) -> bool:
        """Whether the cache is compressed while decoding (``compression_interval`` and ``target_size`` set)."""
        return self.compression_interval > 0

    @property
    def compresses(self) -> bool:
        """Whether the request is compressed at all (its prompt, or while decoding)."""
        return self.compression_ratio > 0 or self.decoding

    @property
    def needs_queries(self) -> bool:
        """Whether the prompt's last ``window_size`` queries are scored (SnapKV)."""
        return self.base == "snapkv"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = {f.name: f for f in fields(CompressionOptions)}
_UNBOUNDED = 2**62  # the bounds of window_size and kernel_size before the engine is known
_DEFAULTS = CompressionOptions()


SHOWN_CHARS = 80  # the most characters of a bad value an error message repeats


def _cut(text: str) -> str:
    """``text`` cut to about :data:`SHOWN_CHARS` characters: a client's 100 KB value is not echoed whole."""
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 30]}... ({len(text)} characters)"


def _shown(value: Any) -> str:
    """``repr(value)``, cut (:func:`_cut`)."""
    return _cut(repr(value))


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN is not


def check_options(
    options: CompressionOptions, where: str, engine: CompressionOptions | None = None, relations: bool = True
) -> None:
    """
    Raise :class:`OptionsError` naming the first option of ``options`` that is out of its range, then (``relations``)
    the first that does not go with another (:func:`check_relations`).

    ``engine`` gives the bounds of ``window_size`` and ``kernel_size`` (the engine's ``max_window_size`` and
    ``max_kernel_size``); ``options`` itself when None (the engine's own options).
    """
    limits = engine if engine is not None else options

    def fail(name: str, allowed: str) -> OptionsError:
        value = getattr(options, name)
        hint = ""
        if isinstance(value, bool):
            hint = " (a boolean, not a number)"
        elif isinstance(value, float) and value.is_integer() and "integer" in allowed:
            hint = f" (a float: pass {int(value)})"
        return OptionsError(f"{where}: {name}={_shown(value)} is not allowed{hint}: {allowed}", option=name)

    if not isinstance(options.press, str) or options.press not in PRESSES:
        if isinstance(options.press, str) and options.press in REFUSED_PRESSES:
            raise OptionsError(
                f"{where}: press={options.press!r} is not run by the plugin: {REFUSED_PRESSES[options.press]}",
                option="press",
            )
        raise fail("press", f"choose one of {', '.join(PRESSES)}")
    if not _is_number(options.compression_ratio) or not 0 <= options.compression_ratio < 1:
        raise fail("compression_ratio", "a number in [0, 1) (0: no compression)")
    if limits is options:  # the engine's own options (a request's bounds were checked when the engine started)
        for name, limit in (("max_window_size", WINDOW_LIMIT), ("max_kernel_size", KERNEL_LIMIT)):
            value = getattr(options, name)
            if not _is_integer(value) or not 1 <= value <= limit:
                raise fail(name, f"an integer in [1, {limit}]")
    for name, bound in (("window_size", "max_window_size"), ("kernel_size", "max_kernel_size")):
        value, limit = getattr(options, name), getattr(limits, bound)
        if not _is_integer(value) or not 1 <= value <= limit:
            odd = "an odd" if name == "kernel_size" else "an"
            span = f"in [1, {limit}]" if limit < _UNBOUNDED else "from 1"
            raise fail(name, f"{odd} integer {span} (up to the engine's {bound})")
    if options.kernel_size % 2 == 0:
        raise fail("kernel_size", "an odd integer (SnapKV pools with padding kernel_size // 2)")
    if not _is_integer(options.n_sink) or not 0 <= options.n_sink <= N_SINK_LIMIT:
        raise fail("n_sink", f"an integer in [0, {N_SINK_LIMIT}]")
    if not _is_number(options.first_stage_ratio) or not 0 <= options.first_stage_ratio <= 1:
        raise fail("first_stage_ratio", "a number in [0, 1]")
    if not _is_number(options.epsilon) or not 0 <= options.epsilon <= 1:
        raise fail("epsilon", "a number in [0, 1]")
    if not _is_number(options.alpha_safeguard) or not 0 <= options.alpha_safeguard <= 1:
        raise fail("alpha_safeguard", "a number in [0, 1]")
    if not _is_integer(options.compression_chunk_size) or not 0 <= options.compression_chunk_size <= CHUNK_LIMIT:
        raise fail(
            "compression_chunk_size", f"an integer in [0, {CHUNK_LIMIT}] (0: compress once, after the whole prompt)"
        )
    for name in ("compression_interval", "target_size"):
        if not _is_integer(getattr(options, name)) or not 0 <= getattr(options, name) <= CHUNK_LIMIT:
            raise fail(name, f"an integer in [0, {CHUNK_LIMIT}] (0 with the other: no compression while decoding)")
    if not _is_integer(options.min_kept) or not 0 <= options.min_kept <= CHUNK_LIMIT:
        raise fail("min_kept", f"an integer in [0, {CHUNK_LIMIT}] (0: no floor)")
    if options.norm not in ("l1", "l2"):
        raise fail("norm", "'l1' or 'l2'")
    if options.backend not in BACKENDS:
        raise fail("backend", f"one of {', '.join(BACKENDS)}")
    if options.head_wise_kernel not in ATTENTION_BACKENDS:
        raise fail("head_wise_kernel", f"one of {', '.join(ATTENTION_BACKENDS)}")
    if not isinstance(options.record_selections, bool):
        raise fail("record_selections", "true or false")
    if relations:
        check_relations(options, where)


def check_relations(options: CompressionOptions, where: str) -> None:
    """Raise :class:`OptionsError` where two options of ``options`` (each in its range) do not go together."""

    def fail(name: str, allowed: str) -> OptionsError:
        return OptionsError(f"{where}: {name}={_shown(getattr(options, name))} is not allowed: {allowed}", option=name)

    if (
        options.compression_chunk_size
        and options.needs_queries
        and options.compression_chunk_size <= options.window_size
    ):
        raise fail(
            "compression_chunk_size",
            f"more than window_size={options.window_size} (each chunk's last tokens are SnapKV's observation window)",
        )
    if options.head_wise and options.compression_chunk_size:
        raise OptionsError(
            f"{where}: press={options.press!r} with compression_chunk_size={options.compression_chunk_size} is not "
            "supported: the head-wise layout packs a request's kept entries once, after its whole prompt. Use a "
            "uniform press (critical_snapkv, snapkv...) with compression_chunk_size, or compression_chunk_size=0",
            option="compression_chunk_size",
        )
    if bool(options.compression_interval) != bool(options.target_size):
        missing = "target_size" if options.compression_interval else "compression_interval"
        raise OptionsError(
            f"{where}: compression while decoding needs both compression_interval and target_size; {missing} is "
            f"not set. Set {missing} too (or both to 0 for no compression while decoding)",
            option=missing,
        )
    if options.decoding and options.needs_queries and options.compression_interval <= options.window_size:
        raise fail(
            "compression_interval",
            f"more than window_size={options.window_size} (the last generated tokens of each interval are SnapKV's "
            "observation window)",
        )
    if options.decoding and options.base == "streaming_llm" and options.target_size <= options.n_sink:
        raise fail("target_size", f"more than n_sink={options.n_sink} (StreamingLLM keeps its sinks and recent tokens)")
    if options.head_wise and options.decoding:
        raise OptionsError(
            f"{where}: press={options.press!r} with compression_interval={options.compression_interval} is not "
            "supported: the head-wise layout packs a request's kept entries once, after its whole prompt. Use a "
            "uniform press (critical_snapkv, snapkv...) to compress while decoding, or compression_interval=0",
            option="compression_interval",
        )


def check_layout(
    options: CompressionOptions, block_size: int | None, where: str, tensor_parallel_size: int = 1
) -> None:
    """
    What the engine asks of a head-wise press. Its layout keeps a prompt's last ``N mod block_size`` tokens in every KV
    head (they share a block with the first new tokens), which SnapKV does for the tokens of its window, so
    ``window_size >= block_size - 1``; and it packs a layer's heads into the blocks of one worker, while tensor
    parallelism splits the heads (and each block) over ranks whose shares of a shared budget differ.
    """
    if options.head_wise and tensor_parallel_size > 1:
        raise OptionsError(
            f"{where}: press={options.press!r} shares a layer's budget among its KV heads, which tensor parallelism "
            f"splits over {tensor_parallel_size} ranks that each hold a fixed share of every block: use a uniform "
            "press with tensor_parallel_size > 1, or tensor_parallel_size=1",
            option="press",
        )
    if options.head_wise and block_size is not None and options.window_size < block_size - 1:
        fits = 16
        while fits * 2 - 1 <= options.window_size:
            fits *= 2  # the largest power-of-two block (vLLM's CPU default is 128) this window covers
        raise OptionsError(
            f"{where}: press={options.press!r} keeps a prompt's last (N mod block_size) tokens in every KV head, which "
            f"SnapKV does for its window: window_size={options.window_size} must be at least block_size - 1 = "
            f"{block_size - 1}. Start the engine with block_size={fits} (--block-size {fits}), or raise window_size "
            f"to {block_size - 1}",
            option="window_size",
        )


def _unknown(values: dict, allowed, where: str) -> None:
    unknown = sorted(_cut(str(name)) for name in set(values) - set(allowed))
    if not unknown:
        return
    renamed = [name for name in unknown if name in RENAMED]
    if renamed:
        raise OptionsError(
            f"{where}: {', '.join(f'{name} is now {RENAMED[name]}' for name in renamed)} (not to be mistaken for "
            f"vLLM's own chunked prefill or attention backend): pass {', '.join(RENAMED[name] for name in renamed)}",
            option=renamed[0],
        )
    engine_only = [name for name in unknown if name in ENGINE_ONLY]
    if engine_only and len(engine_only) == len(unknown):
        raise OptionsError(
            f"{where}: {', '.join(engine_only)} can only be set for the whole engine "
            f"(additional_config[{CONFIG_KEY!r}]); a request may set {', '.join(sorted(allowed))}",
            option=engine_only[0],
        )
    raise OptionsError(
        f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}", option=unknown[0]
    )


def engine_options(additional_config: Any) -> CompressionOptions | None:
    """
    The engine-wide options from vLLM's ``additional_config``, or None when the plugin is not asked for.

    ``compression_ratio`` is required (0 compresses only the requests that ask for it), so that enabling the plugin
    never leaves the cache uncompressed by default without a word.
    """
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        if isinstance(additional_config, dict):
            warn_misspelt(additional_config, "additional_config")
        return None
    values = additional_config[CONFIG_KEY]
    where = f"additional_config[{CONFIG_KEY!r}]"
    if not isinstance(values, dict):
        raise OptionsError(f"{where} must be a JSON object of options, got {type(values).__name__}")
    _unknown(values, _FIELDS, where)
    if "compression_ratio" not in values:
        raise OptionsError(
            f"{where} needs compression_ratio (a number in [0, 1); 0 compresses only the requests that set one "
            "in SamplingParams(extra_args={'kvpress_critical': {'compression_ratio': ...}}))",
            option="compression_ratio",
        )
    options = CompressionOptions(**values)
    check_options(options, where)
    return options


REQUEST_WHERE = f"SamplingParams.extra_args[{CONFIG_KEY!r}]"
_WARNED: set[str] = set()  # the misspelt keys already warned about (once each: a client may send one per request)


def warn_misspelt(mapping: dict, where: str) -> None:
    """One warning per key of ``mapping`` whose prefix (before a ``.``) is close to ``kvpress_critical`` but not it
    (``kvpress_critcal.compression_ratio``, ``kvpress-critical``): vLLM passes unknown keys on without a word, so the
    option would be ignored silently."""
    for key in mapping:
        if not isinstance(key, str) or key in _WARNED or len(_WARNED) >= 1000:
            continue
        prefix = key.split(".", 1)[0]
        if prefix != CONFIG_KEY and difflib.SequenceMatcher(None, prefix.lower(), CONFIG_KEY).ratio() >= 0.85:
            _WARNED.add(key)
            logger.warning(
                "%s has the key %s, close to %r: the plugin reads only %r and %r keys, so it is ignored",
                where, _cut(repr(key)), CONFIG_KEY, CONFIG_KEY, f"{CONFIG_KEY}.<option>",
            )  # fmt: skip


def request_overrides(extra_args: Any) -> dict[str, Any]:
    """
    The overrides of one request's ``SamplingParams.extra_args`` (checked for names only): the dict under
    ``"kvpress_critical"`` and the flat ``"kvpress_critical.<option>"`` keys (the server's ``vllm_xargs``).
    """
    if not isinstance(extra_args, dict):
        return {}
    warn_misspelt(extra_args, "SamplingParams.extra_args")
    values = extra_args.get(CONFIG_KEY, {})
    if not isinstance(values, dict):
        raise OptionsError(f"{REQUEST_WHERE} must be a dict of options, got {type(values).__name__}")
    prefix = f"{CONFIG_KEY}."
    flat = {key[len(prefix) :]: value for key, value in extra_args.items() if key.startswith(prefix)}
    values = {**values, **flat}
    _unknown(values, REQUEST_OPTIONS, REQUEST_WHERE)
    return values


def resolve_options(
    engine: CompressionOptions, extra_args: Any, block_size: int | None = None, tensor_parallel_size: int = 1
) -> CompressionOptions:
    """One request's options: the engine's, overridden by its ``extra_args``, checked against the engine's bounds (and
    its block size and tensor parallelism, :func:`check_layout`)."""
    overrides = request_overrides(extra_args)
    if not overrides:
        return engine
    options = replace(engine, **overrides)
    check_options(options, REQUEST_WHERE, engine)
    check_layout(options, block_size, REQUEST_WHERE, tensor_parallel_size)
    return options


def validate_request_overrides(extra_args: Any) -> None:
    """
    Check a request's overrides before the engine is known: names, types and ranges, but neither the engine's bounds
    on ``window_size`` and ``kernel_size`` nor how the overrides go with the options they do not set (a
    ``compression_interval`` against the engine's ``window_size``...), which :func:`resolve_options` checks where
    the engine's options are at hand (the request's input processor), so that the message gives the engine's own.
    """
    overrides = request_overrides(extra_args)
    if overrides:
        unbounded = replace(_DEFAULTS, max_window_size=_UNBOUNDED, max_kernel_size=_UNBOUNDED)
        check_options(replace(unbounded, **overrides), REQUEST_WHERE, unbounded, relations=False)
