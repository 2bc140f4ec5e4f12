"""What a user asks the plugin for: engine-wide options, per-request overrides, their validation.

Engine-wide: ``additional_config={"kvpress_critical": {"press": ..., "compression_ratio": ..., ...}}``; per request:
``SamplingParams(extra_args={"kvpress_critical": {...}})`` overrides any of them (``compression_ratio: 0`` leaves
that request uncompressed). The OpenAI-compatible server's ``vllm_xargs`` hold flat values only, so the same overrides
are also read from flat keys: ``{"kvpress_critical.compression_ratio": 0.75}``. This module imports neither vLLM nor
kvpress.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

CONFIG_KEY = "kvpress_critical"

# press name -> (base scorer, with CriticalKV's second stage)
PRESSES: dict[str, tuple[str, bool]] = {
    "critical_snapkv": ("snapkv", True),
    "snapkv": ("snapkv", False),
    "critical_knorm": ("knorm", True),
    "knorm": ("knorm", False),
    "critical_streaming_llm": ("streaming_llm", True),
    "streaming_llm": ("streaming_llm", False),
}

# presses whose budgets differ per head: one block table per request cannot free their memory
HEAD_WISE = ("adakv", "critical_adakv", "headkv", "critical_headkv", "defensivekv", "layer_defensivekv")

ENGINE_ONLY = ("record_selections",)


class OptionsError(ValueError):
    """Options of the plugin that cannot be honoured; the message names the option and the fix."""


@dataclass(frozen=True)
class CompressionOptions:
    """
    How one request's KV cache is compressed after its prefill.

    Parameters
    ----------
    press : str
        One of :data:`PRESSES`: ``critical_snapkv`` (CriticalKV over SnapKV, the paper's main setting), ``snapkv``,
        ``critical_knorm``, ``knorm``, ``critical_streaming_llm``, ``streaming_llm``.
    compression_ratio : float
        Fraction of the prompt's entries to evict, in ``[0, 1)``; 0 leaves the request uncompressed. Each KV head
        keeps ``max(1, int(N * (1 - ratio)))`` entries of an ``N``-token prompt, rounded up to whole KV blocks.
    window_size, kernel_size : int
        SnapKV's observation window (the prompt's last queries) and pooling kernel (odd).
    first_stage_ratio : float
        CriticalKV's stage-1 share of the budget (chosen by the base score alone).
    epsilon : float
        Added to the base score in CriticalKV's stage 2.
    norm : {"l1", "l2"}
        Norm of the projected values ``V W_O``.
    n_sink : int
        StreamingLLM's sink tokens.
    backend : str
        Backend of :func:`kvpress_critical.projected_value_norm` (``auto``, ``torch``, ``cpp``, ``cuda``, ``triton``).
    record_selections : bool
        Engine-wide only: keep the kept positions of every request per (layer, KV head), for tests and analysis
        (``LLM.collective_rpc("kvpress_critical_selections")``).
    """

    press: str = "critical_snapkv"
    compression_ratio: float = 0.0
    window_size: int = 64
    kernel_size: int = 5
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4
    norm: str = "l1"
    n_sink: int = 4
    backend: str = "auto"
    record_selections: bool = False

    @property
    def base(self) -> str:
        """The base scorer: ``snapkv``, ``knorm`` or ``streaming_llm``."""
        return PRESSES[self.press][0]

    @property
    def critical(self) -> bool:
        """Whether CriticalKV's two-stage selection runs over the base scores."""
        return PRESSES[self.press][1]

    @property
    def needs_queries(self) -> bool:
        """Whether the prompt's last ``window_size`` queries are scored (SnapKV)."""
        return self.base == "snapkv"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = {f.name: f for f in fields(CompressionOptions)}


def _check(options: CompressionOptions, where: str) -> CompressionOptions:
    def fail(name: str, what: str) -> OptionsError:
        return OptionsError(f"{where}: {name}={getattr(options, name)!r} {what}")

    if options.press not in PRESSES:
        if options.press in HEAD_WISE or options.press.startswith(("adakv", "critical_adakv")):
            raise OptionsError(
                f"{where}: press={options.press!r} gives each KV head its own budget, and vLLM keeps one block "
                "table per request (all heads of a layer share its slots), so a head-wise budget would free only "
                "what its largest head leaves: no memory. Use a uniform press here "
                f"({', '.join(PRESSES)}), or kvpress_critical.CompactCachePress with this press in transformers, "
                "whose per-head layout frees head-wise budgets."
            )
        raise fail("press", f"is not a press of the plugin; choose one of {', '.join(PRESSES)}")
    if not isinstance(options.compression_ratio, (int, float)) or not 0 <= options.compression_ratio < 1:
        raise fail("compression_ratio", "must be a number in [0, 1) (0: no compression)")
    for name in ("window_size", "kernel_size"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(name, "must be a positive integer")
    if options.kernel_size % 2 == 0:
        raise fail("kernel_size", "must be odd (SnapKV pools with padding kernel_size // 2)")
    if isinstance(options.n_sink, bool) or not isinstance(options.n_sink, int) or options.n_sink < 0:
        raise fail("n_sink", "must be a non-negative integer")
    if not isinstance(options.first_stage_ratio, (int, float)) or not 0 <= options.first_stage_ratio <= 1:
        raise fail("first_stage_ratio", "must be in [0, 1]")
    if not isinstance(options.epsilon, (int, float)) or options.epsilon < 0:
        raise fail("epsilon", "must be a non-negative number")
    if options.norm not in ("l1", "l2"):
        raise fail("norm", "must be 'l1' or 'l2'")
    if options.backend not in ("auto", "torch", "cpp", "cuda", "triton"):
        raise fail("backend", "must be one of auto, torch, cpp, cuda, triton")
    if not isinstance(options.record_selections, bool):
        raise fail("record_selections", "must be true or false")
    return options


def _unknown(values: dict, allowed, where: str) -> None:
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise OptionsError(f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}")


def engine_options(additional_config: Any) -> CompressionOptions | None:
    """
    The engine-wide options from vLLM's ``additional_config``, or None when the plugin is not asked for.

    ``compression_ratio`` is required (0 compresses only the requests that ask for it), so that enabling the plugin
    never leaves the cache uncompressed by default without a word.
    """
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    values = additional_config[CONFIG_KEY]
    where = f"additional_config[{CONFIG_KEY!r}]"
    if not isinstance(values, dict):
        raise OptionsError(f"{where} must be a JSON object of options, got {type(values).__name__}")
    _unknown(values, _FIELDS, where)
    if "compression_ratio" not in values:
        raise OptionsError(
            f"{where} needs compression_ratio (a number in [0, 1); 0 compresses only the requests that set one "
            "in SamplingParams(extra_args={'kvpress_critical': {'compression_ratio': ...}}))"
        )
    return _check(CompressionOptions(**values), where)


def request_overrides(extra_args: Any) -> dict[str, Any]:
    """
    The overrides of one request's ``SamplingParams.extra_args`` (checked for names only): the dict under
    ``"kvpress_critical"`` and the flat ``"kvpress_critical.<option>"`` keys (the server's ``vllm_xargs``).
    """
    if not isinstance(extra_args, dict):
        return {}
    where = f"SamplingParams.extra_args[{CONFIG_KEY!r}]"
    values = extra_args.get(CONFIG_KEY, {})
    if not isinstance(values, dict):
        raise OptionsError(f"{where} must be a dict of options, got {type(values).__name__}")
    prefix = f"{CONFIG_KEY}."
    flat = {key[len(prefix) :]: value for key, value in extra_args.items() if key.startswith(prefix)}
    values = {**values, **flat}
    _unknown(values, set(_FIELDS) - set(ENGINE_ONLY), where)
    return values


def resolve_options(engine: CompressionOptions, extra_args: Any) -> CompressionOptions:
    """One request's options: the engine's, overridden by its ``extra_args`` (validated)."""
    overrides = request_overrides(extra_args)
    if not overrides:
        return engine
    return _check(replace(engine, **overrides), f"SamplingParams.extra_args[{CONFIG_KEY!r}]")


def validate_request_overrides(extra_args: Any) -> None:
    """Check a request's overrides on their own (before the engine's options are known): names and values."""
    overrides = request_overrides(extra_args)
    if overrides:
        _check(replace(CompressionOptions(), **overrides), f"SamplingParams.extra_args[{CONFIG_KEY!r}]")
