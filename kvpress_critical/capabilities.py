"""Which press runs inside which wrapper and cache layout, answered in one place from declared capabilities.

Every press of this package declares what it does in a class attribute ``capabilities``
(:class:`Capabilities`); kvpress's presses, which declare nothing, are described here by class
(:data:`KVPRESS_CAPABILITIES`), the one place that knows them. The questions the wrappers ask are the functions
below, each returning ``None`` (it can) or the reason it cannot, which the wrappers raise as their error message:

- :func:`critical_inner_refusal`: can a critical press (``CriticalKVPress(press)``...) take ``press`` as its base;
- :func:`chunked_prefill_refusal`: can ``ChunkedPrefillPress(press)`` compress ``press`` after every chunk;
- :func:`compact_refusal`: can ``CompactCachePress(press)`` keep ``press``'s selection in the compact layout;
- :func:`conversation_refusal`: can a :class:`~kvpress_critical.Conversation` keep every turn over ``press``'s cache;

asked when the wrapper is built, and, for what depends on the model or the inputs, when the press is entered
(:func:`chunked_prefill_model_refusal`, :func:`compact_model_refusal`) or when a batch comes
(:func:`padded_batch_refusal`). The evaluation registry asks :func:`supports_compact` to know which presses have a
compact variant; ``docs/presses.md``'s table of combinations is generated from these functions
(:mod:`kvpress_critical.presses.combinations`).
"""

from __future__ import annotations

from dataclasses import dataclass

import kvpress

__all__ = [
    "Capabilities",
    "KVPRESS_CAPABILITIES",
    "capabilities",
    "chunked_prefill_model_refusal",
    "chunked_prefill_refusal",
    "compact_model_refusal",
    "compact_refusal",
    "conversation_refusal",
    "critical_inner_refusal",
    "decoding_schedule_refusal",
    "nested_presses",
    "padded_batch_refusal",
    "supports_compact",
]

# the attributes through which a press holds other presses (kvpress's wrappers and ours)
WRAPPED = ("press", "base_press", "prefilling_press", "decoding_press", "presses")


@dataclass(frozen=True)
class Capabilities:
    """
    What a press does, as far as the wrappers and layouts need to know.

    Parameters
    ----------
    selection : {"pruning", "head-wise", "wrapper", "other"}
        ``"pruning"``: it drops entries (a kvpress ``ScorerPress``: scores, then a per-head top-k);
        ``"head-wise"``: it keeps different numbers of entries per head and records the others in
        ``module.masked_key_indices`` (kvpress's masking layout); ``"wrapper"``: it delegates to the press it holds;
        ``"other"``: anything else (channel pruning, merging, its own ``compress``).
    budgeted : bool
        It selects with an explicit budget (``keep_mask(..., n_kept)``, or a kvpress ``ScorerPress`` / ``AdaKVPress``
        whose scores this package turns into one): what a chunked prefill needs after every chunk.
    applies_criticalkv : bool
        It already applies CriticalKV's two-stage selection (a critical press must not wrap it).
    selects_after_last_layer : bool
        It selects every layer at once after the last one (Layer-DefensiveKV).
    normalises_across_heads : bool
        Its scores normalise each entry across the layer's heads (DefensiveKV): it needs the aligned dense layout.
    scores_exclusions : bool
        It gives entries excluded by a chunked prefill (evicted, padding) the lowest scores.
    compresses_while_decoding : bool
        It compresses during decoding (kvpress's ``DecodingPress``...).
    drives_model : bool
        It runs the model itself (its own ``__call__``: compression after the prefill, a replaced forward...).
    rerotates_keys : bool
        It moves kept keys to new positions.
    changes_layout : bool
        It replaces the cache's layout (``CompactCachePress``).
    chunked : bool
        It compresses the cache again after every chunk of a chunked prefill (``ChunkedPrefillPress``).
    whole_context : str, optional
        Why it needs the whole context at once (a chunked prefill cannot give it), or None.
    """

    selection: str = "other"
    budgeted: bool = False
    applies_criticalkv: bool = False
    selects_after_last_layer: bool = False
    normalises_across_heads: bool = False
    scores_exclusions: bool = False
    compresses_while_decoding: bool = False
    drives_model: bool = False
    rerotates_keys: bool = False
    changes_layout: bool = False
    chunked: bool = False
    whole_context: str | None = None


def _kvpress_table() -> list[tuple[type, Capabilities]]:
    """kvpress's presses by class, most specific first (a subclass is matched before its base class)."""
    builtin_critical = Capabilities(selection="pruning", applies_criticalkv=True)
    table = [
        (kvpress.CriticalKVPress, builtin_critical),
        (kvpress.CriticalAdaKVPress, Capabilities(selection="head-wise", applies_criticalkv=True)),
        # their own __call__ only resets their state or dispatches to their presses: they do not drive the model
        (kvpress.DecodingPress, Capabilities(selection="wrapper", compresses_while_decoding=True)),
        (kvpress.PrefillDecodingPress, Capabilities(selection="wrapper")),  # its __call__ dispatches to its presses
        (
            kvpress.KeyRerotationPress,
            Capabilities(
                selection="wrapper",
                rerotates_keys=True,
                whole_context="it re-rotates the kept keys, while chunks are prefilled at their original positions",
            ),
        ),
        (
            kvpress.FinchPress,
            Capabilities(
                drives_model=True,
                whole_context="it locates the question in the context by "
                "a delimiter, which only the whole context contains",
            ),
        ),
        (
            kvpress.PyramidKVPress,
            Capabilities(
                selection="pruning",
                whole_context="its per-layer budgets are derived from the context length it is called with",
            ),
        ),
        (
            kvpress.ExpectedAttentionPress,
            Capabilities(
                selection="pruning",
                budgeted=True,
                whole_context="it rotates "
                "its expected future queries from the chunk's length, not the "
                "position reached",
            ),
        ),
        (
            kvpress.CapPress,
            Capabilities(
                selection="pruning",
                budgeted=True,
                whole_context="it rotates its future queries from the chunk's length, not the position reached",
            ),
        ),
        (
            kvpress.PerLayerCompressionPress,
            Capabilities(
                selection="wrapper",
                whole_context="it sets each layer's compression ratio itself, replacing the chunk's budget",
            ),
        ),
        (
            kvpress.ComposedPress,
            Capabilities(
                selection="wrapper",
                whole_context="it compresses with each of its presses in turn, through their own hooks only",
            ),
        ),
        (
            kvpress.DMSPress,
            Capabilities(
                selection="wrapper",
                whole_context="it sets its threshold, not a compression "
                "ratio, which the chunks need to follow the budget",
            ),
        ),
        (kvpress.ThinKPress, Capabilities(whole_context="it compresses channels, not entries")),
        (kvpress.AdaKVPress, Capabilities(selection="head-wise", budgeted=True, scores_exclusions=True)),
        (kvpress.ScorerPress, Capabilities(selection="pruning", budgeted=True, scores_exclusions=True)),
    ]
    return [(cls, caps) for cls, caps in table if isinstance(cls, type)]


KVPRESS_CAPABILITIES: list[tuple[type, Capabilities]] = _kvpress_table()


def capabilities(press) -> Capabilities:
    """
    The capabilities of ``press``: declared by its class (this package's presses), or kvpress's from
    :data:`KVPRESS_CAPABILITIES`. A kvpress press with its own ``__call__`` drives the model; one with its own
    ``compress`` selects in its own way (``"other"``, no explicit budget).
    """
    declared = getattr(type(press), "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared
    caps = next((c for cls, c in KVPRESS_CAPABILITIES if isinstance(press, cls)), Capabilities())
    own_call = type(press).__call__ is not kvpress.BasePress.__call__
    if own_call and not isinstance(press, (kvpress.PrefillDecodingPress, kvpress.DecodingPress)):
        caps = Capabilities(**{**caps.__dict__, "drives_model": True})
    if isinstance(press, kvpress.PrefillDecodingPress) and press.decoding_press is not None:
        caps = Capabilities(**{**caps.__dict__, "compresses_while_decoding": True})
    if getattr(press, "decoding", False) is True:  # DMSPress(decoding=True)
        caps = Capabilities(**{**caps.__dict__, "compresses_while_decoding": True})
    if getattr(press, "rerotate_keys", False) is True:  # FinchPress(rerotate_keys=True)
        caps = Capabilities(**{**caps.__dict__, "rerotates_keys": True})
    scorer_compress = isinstance(press, kvpress.ScorerPress) and type(press).compress is kvpress.ScorerPress.compress
    if caps.selection == "pruning" and caps.budgeted and not scorer_compress:
        caps = Capabilities(**{**caps.__dict__, "budgeted": False, "selection": "other"})
    return caps


def nested_presses(press) -> list:
    """``press`` and every press inside it (``press``, ``base_press``, ``presses``, ``prefilling_press``...)."""
    found, seen, stack = [], set(), [press]
    while stack:
        p = stack.pop()
        if p is None or id(p) in seen or not hasattr(p, "compress"):
            continue
        seen.add(id(p))
        found.append(p)
        for name in WRAPPED:
            child = getattr(p, name, None)
            stack.extend(child if isinstance(child, (list, tuple)) else [child])
    return found


def _name(press) -> str:
    return f"{type(press).__module__}.{type(press).__name__}"


def critical_inner_refusal(press, owner: str) -> str | None:
    """Why a critical press (``owner``) cannot take ``press`` as its base press (None: it can)."""
    if not isinstance(press, kvpress.ScorerPress):
        hint = ""
        if capabilities(press).selection == "head-wise":
            hint = (
                " For head-wise budgets use CriticalAdaKVPress(SnapKVPress(...)) instead of wrapping a head-wise press."
            )
        return (
            f"{owner} wraps a kvpress ScorerPress (a press with a score() method, e.g. SnapKVPress(0.5), "
            f"KnormPress(0.5), ExpectedAttentionPress(0.5, use_vnorm=False)); got {type(press).__name__}.{hint}"
        )
    if capabilities(press).applies_criticalkv:
        return (
            f"{owner} got {_name(press)} as its inner press, which already applies CriticalKV; CriticalKV is applied "
            f"once. Pass the base press directly, e.g. {owner}(SnapKVPress(0.5))."
        )
    return None


def chunked_prefill_refusal(press) -> str | None:
    """Why ``ChunkedPrefillPress`` cannot compress with ``press`` after every chunk (None: it can)."""
    for inner in nested_presses(press):
        caps = capabilities(inner)
        name = type(inner).__name__
        if caps.selects_after_last_layer:
            return (
                f"{name}: it selects every layer at once after the last one, so it cannot compress each layer after "
                "each chunk; use DefensiveKVPress (per-layer budgets) with ChunkedPrefillPress"
            )
        if caps.changes_layout:
            return (
                f"{name}: put the compact layout outside: CompactCachePress(ChunkedPrefillPress(press, "
                "chunk_size=...)) (ChunkedPrefillPress compresses with the inner press after every chunk, then the "
                "layer is compacted)"
            )
        if caps.compresses_while_decoding:
            return f"{name}: ChunkedPrefillPress compresses the prefill: wrap a prefill press, not a decoding press"
        if caps.whole_context:
            return f"{name}: {caps.whole_context}"
        if caps.applies_criticalkv and not caps.scores_exclusions:
            return (
                f"{name}: kvpress's built-in CriticalKV presses rank an excluded entry (score -inf, norm 0) first; use "
                "kvpress_critical.CriticalKVPress / CriticalAdaKVPress, which select the same entries otherwise"
            )
        if caps.drives_model:
            return f"{name}: it drives the model with its own __call__, which cannot be repeated per chunk"
    caps = capabilities(press)
    if not caps.budgeted:
        return (
            f"{type(press).__name__}: it selects with its own compress(), while ChunkedPrefillPress gives the press an "
            "explicit budget after every chunk: wrap a kvpress ScorerPress, AdaKVPress(ScorerPress) or a press of "
            "this package"
        )
    return None


def decoding_schedule_refusal(press) -> str | None:
    """
    Why the compact layout cannot compress while decoding on the schedule of ``press`` (a kvpress ``DecodingPress``)
    (None: it can). It follows kvpress's ``DecodingPress`` contract: the schedule (``compression_interval``,
    ``hidden_states_buffer_size``) and the target size (``_resolve_target_size``, which subclasses may derive from
    what was seen, as ``CompressionRatioDecodingPress``); a subclass that changes how the cache is compressed (its
    own ``compress`` or ``forward_hook``: ``CAMPress`` merges the evicted values into their neighbours) cannot be
    followed by an explicit keep mask.
    """
    changed = [
        name
        for name in ("compress", "forward_hook")
        if getattr(type(press), name) is not getattr(kvpress.DecodingPress, name)
    ]
    name = type(press).__name__
    if changed:
        return (
            f"{name}: it changes how a DecodingPress compresses ({', '.join(changed)}), which the compact layout's "
            "decoding compression (a keep mask on kvpress's schedule) cannot do; use it without CompactCachePress"
        )
    if not capabilities(press.base_press).budgeted:
        return (
            f"{name}({type(press.base_press).__name__}(...)): the compact layout compresses while decoding with "
            "an explicit budget per head, which this base press cannot be given; use a kvpress ScorerPress, "
            "AdaKVPress or a press of this package (CriticalKVPress, CriticalAdaKVPress)"
        )
    return None


def compact_refusal(press) -> str | None:
    """Why ``CompactCachePress`` cannot keep ``press``'s selection in the compact layout (None: it can)."""
    nested = nested_presses(press)
    chunked = next((p for p in nested if capabilities(p).chunked), None)
    decoding = next((p for p in nested if isinstance(p, kvpress.DecodingPress)), None)
    if chunked is not None and decoding is not None:
        return (
            f"{type(chunked).__name__} with {type(decoding).__name__} in one CompactCachePress: kvpress marks only "
            "a chunked prefill's first chunk as a prefill, so the decoding schedule would count the other chunks "
            "as decoding steps; compress a chunked prefill, or compress while decoding, not both"
        )
    for inner in nested:
        caps = capabilities(inner)
        name = type(inner).__name__
        if caps.changes_layout:
            return "CompactCachePress wraps a press once: pass its inner press directly"
        if caps.compresses_while_decoding and getattr(inner, "decoding", False) is True:  # DMSPress(decoding=True)
            return (
                f"{name}: its decoding compression needs the dense layout; use decoding=False or no CompactCachePress"
            )
        if isinstance(inner, kvpress.DecodingPress) and decoding_schedule_refusal(inner) is not None:
            return decoding_schedule_refusal(inner)
        decoding_wrapper = isinstance(inner, (kvpress.DecodingPress, kvpress.PrefillDecodingPress))
        if caps.compresses_while_decoding and not decoding_wrapper:
            return (
                f"{name}: it compresses during decoding in its own way; the compact layout compresses while decoding "
                "on kvpress's DecodingPress schedule: use CompactCachePress(DecodingPress(base_press=...))"
            )
        if caps.rerotates_keys:
            return (
                f"{name}: kvpress's pipeline re-positions the question after re-rotated keys only when the outermost "
                "press re-rotates; use it without CompactCachePress"
            )
        if caps.drives_model:
            return (
                f"{name}: it drives the model with its own __call__ (e.g. compresses after the prefill, as KVzip, or "
                "replaces the model's forward), while CompactCachePress compacts each layer as soon as the per-layer "
                "hooks compressed it; use it without CompactCachePress"
            )
    nested = nested_presses(press)
    chunked = next((p for p in nested if capabilities(p).chunked), None)
    normalising = next((p for p in nested if capabilities(p).normalises_across_heads), None)
    if chunked is not None and normalising is not None:
        inner = f"{type(chunked).__name__}({type(normalising).__name__}(...))"
        return (
            f"CompactCachePress({inner}): {type(normalising).__name__} normalises projected norms across heads entry "
            f"by entry, which needs the aligned dense layout between chunks; use {inner} without CompactCachePress"
        )
    return None


def supports_compact(press) -> bool:
    """Whether ``CompactCachePress(press)`` frees memory the press alone does not: a head-wise press it accepts."""
    return compact_refusal(press) is None and any(
        capabilities(p).selection == "head-wise" for p in nested_presses(press)
    )


def chunked_prefill_model_refusal(press, model) -> str | None:
    """Why ``ChunkedPrefillPress(press)`` cannot run on ``model`` (None: it can): asked when the press is entered."""
    from kvpress_critical.cache.windows import is_sliding_layer
    from kvpress_critical.modeling import attention_modules, hooked_attention_modules

    hooked = hooked_attention_modules(model)
    pruning = capabilities(press).selection == "pruning"
    if pruning and len(hooked) != len(attention_modules(model)):
        return (
            f"{type(model).__name__}: kvpress compresses only some layers of this model, and a pruning press would "
            "leave the layers with different lengths, which the chunks' causal masks cannot follow; use a head-wise "
            "press (e.g. CriticalAdaKVPress) with ChunkedPrefillPress on it"
        )
    sliding = [m.layer_idx for m in hooked if is_sliding_layer(m)]
    if sliding and not pruning:
        return (
            f"layers {sliding} attend through a sliding window, which the exact masked attention of the chunks does "
            "not implement (kvpress's fake keys can leak); use a pruning press or a one-shot prefill"
        )
    return None


def compact_model_refusal(model) -> str | None:
    """Why the compact layout cannot serve ``model`` (None: it can): asked when ``CompactCachePress`` is entered."""
    configs = [model.config, getattr(model.config, "text_config", None)]
    if any(getattr(c, "_attn_implementation", None) == "eager" for c in configs if c is not None):
        return (
            "CompactCachePress needs a registered attention function (sdpa, flash_attention_2...): eager attention "
            "calls the model's own function, which cannot read the compact layout. Load the model with "
            "attn_implementation='sdpa'."
        )
    return None


def padded_batch_refusal(press) -> str | None:
    """
    Why a left-padded batch cannot be compressed row by row with ``press``, the press that compresses the prefill
    (None: it can, or there is none): asked when a padded batch comes.
    """
    if press is None:
        return None
    if any(capabilities(p).chunked for p in nested_presses(press)):
        return "ChunkedPrefillPress does not support padded batches: prefill rows one by one"
    caps = capabilities(press)
    if caps.selects_after_last_layer:
        return (
            f"CompactCachePress compresses a padded batch row by row, with each row's own budget, but "
            f"{type(press).__name__} selects every layer at once after the last one; run the rows one at a time"
        )
    if not caps.budgeted:
        return (
            f"CompactCachePress compresses a padded batch row by row, with each row's own budget, which "
            f"{type(press).__name__} cannot be given (it selects with its own compress()); run the rows one at a "
            "time, or use a press of this package, a kvpress ScorerPress or AdaKVPress"
        )
    return None


def conversation_refusal(press) -> str | None:
    """Why a :class:`~kvpress_critical.Conversation` cannot keep every turn over ``press``'s cache (None: it can)."""
    if any(capabilities(p).compresses_while_decoding for p in nested_presses(press)):
        return (
            f"{type(press).__name__} compresses while decoding; a Conversation compresses the context once, before "
            "the first question, and cannot keep every turn in the cache across such compressions: use a press that "
            "compresses the prefill only"
        )
    return None
