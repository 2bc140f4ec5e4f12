"""
DuoAttention for the sweeps: kvpress's ``DuoAttentionPress``, its published head patterns found under the current Hub
name of Llama-3.1-8B-Instruct too, and read from a local folder on nodes without network access.

kvpress's press downloads a model's head pattern (``config.json``, ``full_attention_heads.tsv``) from the
DuoAttention repository on GitHub, looked up by ``model.config.name_or_path`` in its ``PATTERNS_DICT``, where
Llama-3.1-8B-Instruct is listed under its former name ``meta-llama/Meta-Llama-3.1-8B-Instruct``.
:class:`DuoAttentionPatternPress` (registered as ``duo_attention``; kvpress's own stays ``kvpress_duo_attention``)
accepts both names and, with ``$KVPRESS_DUO_PATTERNS`` set, reads ``<folder>/<pattern>/config.json`` and
``full_attention_heads.tsv`` (the repository's ``attn_patterns`` layout) instead of downloading them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote

import numpy as np
from kvpress import DuoAttentionPress
from kvpress.presses.duo_attention_press import PATTERNS_DICT

PATTERNS_ENV = "KVPRESS_DUO_PATTERNS"
ALIASES = {"meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Meta-Llama-3.1-8B-Instruct"}


@dataclass
class DuoAttentionPatternPress(DuoAttentionPress):
    """kvpress's ``DuoAttentionPress`` with model-name aliases and a local pattern folder (module docstring).

    Based on DuoAttention (https://arxiv.org/abs/2410.10819).
    """

    def load_attention_pattern(self, model):
        name = ALIASES.get(model.config.name_or_path, model.config.name_or_path)
        if name not in PATTERNS_DICT:
            raise ValueError(
                f"DuoAttention publishes head patterns for {sorted(PATTERNS_DICT)} (and {sorted(ALIASES)}), not "
                f"{model.config.name_or_path!r}: use duo_attention_on_the_fly, which calibrates on the model"
            )
        folder = os.environ.get(PATTERNS_ENV)
        if not folder:  # kvpress's download, under the name it knows
            return DuoAttentionPress.load_attention_pattern(SimpleNamespace(config=SimpleNamespace(name_or_path=name)))
        pattern = Path(folder).expanduser() / unquote(PATTERNS_DICT[name])
        files = [pattern / "config.json", pattern / "full_attention_heads.tsv"]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"${PATTERNS_ENV} is set but {missing} are missing: copy the DuoAttention repository's attn_patterns/"
                f"{unquote(PATTERNS_DICT[name])} folder there"
            )
        config = json.loads(files[0].read_text())
        scores = np.clip(np.loadtxt(files[1], dtype=float, delimiter="\t"), 0, 1)
        return config["sink_size"], config["recent_size"], scores
