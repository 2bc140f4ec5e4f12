"""The plugin keeps the entries this project's transformers presses keep, on the same prompt and parameters.

The presses run in kvpress's environment (``KVPRESS_CRITICAL_PYTHON``, set by ``make test-vllm``) through
``press_reference.py``, for the plugin's block-aligned budget ``N - E`` (the one documented difference: the plugin
keeps up to ``block_size - 1`` entries more than ``int(N * (1 - ratio))``, since it frees whole blocks). The engine
computes its keys, values and queries with vLLM's kernels and transformers with its own, so float32 rounding may
swap near-tied entries (key norms tie more often than attention scores): the test requires at least 99.9 % of the
kept entries to be the same for every press and prints how many (layer, head) selections are identical (the
selection functions themselves equal kvpress's presses bitwise on the same tensors:
tests/selection/test_scorers.py in the main suite).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import PRESSES, internal_id, model_path

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def press_selections(requests: list[dict]) -> list[dict]:
    python = os.environ.get("KVPRESS_CRITICAL_PYTHON")
    if not python:
        pytest.fail("KVPRESS_CRITICAL_PYTHON (kvpress's venv python) is not set: run these tests with make test-vllm")
    transformers_model = str((Path(model_path()) / "config.json").resolve().parent)  # the folder kvpress converted
    job = json.dumps({"model": transformers_model, "requests": requests})
    run = subprocess.run(
        [python, str(HERE / "press_reference.py")], input=job, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def compare_selections(presses, plugin: list[dict], reference: list[dict]) -> tuple[list[str], dict[str, float]]:
    """Per press: a line of identical (layer, head) selections and shared entries, and the fraction of the plugin's
    kept entries the reference keeps too (``plugin``: ``{layer_name: heads}``; ``reference``: ``{layer_index:
    heads}``)."""
    report, agreement = [], {}
    for press, kept, expected in zip(presses, plugin, reference):
        identical = heads_total = common = entries = 0
        for name, heads in kept.items():
            layer = name.split(".")[2]
            for head, positions in enumerate(heads):
                heads_total += 1
                identical += positions == expected[layer][head]
                common += len(set(positions) & set(expected[layer][head]))
                entries += len(positions)
        agreement[press] = common / entries
        report.append(f"{press}: {identical}/{heads_total} identical heads, {common}/{entries} entries")
    return report, agreement


def test_plugin_keeps_what_the_transformers_presses_keep(batch):
    from kvpress_critical_vllm.options import CompressionOptions

    prompts, outputs, selections = batch
    defaults = CompressionOptions().as_dict()
    requests, plugin = [], []
    for press, prompt, output in zip(PRESSES, prompts, outputs):
        kept = selections[internal_id(selections, output.request_id)]
        plugin.append(kept)
        n_kept = len(next(iter(kept.values()))[0])
        requests.append({**defaults, "press": press, "prompt_ids": prompt, "n_kept": n_kept})
    reference = press_selections(requests)
    report, agreement = compare_selections(PRESSES, plugin, reference)
    print("plugin vs transformers presses:", "; ".join(report))
    assert all(value >= 0.999 for value in agreement.values()), report
