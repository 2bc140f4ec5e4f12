"""The plugin's kept entries against this project's transformers presses, and the schedules the engine follows.

The presses run in kvpress's environment (``KVPRESS_CRITICAL_PYTHON``, set by ``make test-vllm``) through
``press_reference.py`` (on SmolLM2; on the other architectures, :func:`press_selection` scores transformers' prefill
with the plugin's own rule, in this environment), for the plugin's block-aligned budget ``N - E`` (the one
documented difference: the plugin keeps up to ``block_size - 1`` entries more than ``int(N * (1 - ratio))``, since it
frees whole blocks). The engine
computes its keys, values and queries with vLLM's kernels and transformers with its own, so float32 rounding may
swap near-tied entries: the tests compare the fraction of kept entries both keep.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from workload import BLOCK_SIZE, ENGINE_OPTIONS

HERE = Path(__file__).resolve().parent


def plan_options(options: dict):
    """The plugin's options of a request with ``options`` over the shared engine's (``workload.ENGINE_OPTIONS``)."""
    from kvpress_critical_vllm.options import CompressionOptions

    return replace(CompressionOptions(), **{**ENGINE_OPTIONS, **options})


def plan_of(options: dict, n_prompt: int, n_tokens: int | None = None):
    """The request's compactions up to ``n_tokens`` tokens seen (its prompt's alone by default), as the budget module
    lists them for the engine."""
    from kvpress_critical_vllm.budget import Schedule

    return Schedule(plan_options(options), n_prompt, BLOCK_SIZE).upto(n_prompt if n_tokens is None else n_tokens)


class PressSelections:
    """``press_reference.py`` run in kvpress's environment on ``requests`` (its module docstring), in the background:
    :meth:`result` waits for what each request keeps. One torch thread, so that it shares the machine with the tests
    that run meanwhile."""

    def __init__(self, requests: list[dict], folder: Path):
        from conftest import model_path

        python = os.environ.get("KVPRESS_CRITICAL_PYTHON")
        if not python:
            pytest.fail("KVPRESS_CRITICAL_PYTHON (kvpress's venv python) is not set: run the tests with make test-vllm")
        transformers_model = str((Path(model_path()) / "config.json").resolve().parent)  # the folder kvpress converted
        folder.mkdir(parents=True, exist_ok=True)
        self.job, self.out = folder / "press_reference.json", folder / "press_reference.out.json"
        self.job.write_text(json.dumps({"model": transformers_model, "requests": requests}))
        env = dict(os.environ, OMP_NUM_THREADS="1")
        command = [python, str(HERE / "press_reference.py"), str(self.job), str(self.out)]
        self.log = folder / "press_reference.log"
        with open(self.log, "w") as log:  # a file, not a pipe: nobody reads it until the end
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> list:
        self.process.wait(timeout=900)
        assert self.process.returncode == 0, self.log.read_text()[-3000:]
        return json.loads(self.out.read_text())


def reference_request(result) -> dict:
    """The ``press_reference.py`` request that selects what the engine kept for ``result`` (a ``conftest.Result``)."""
    from kvpress_critical_vllm.options import CompressionOptions

    row, prompt = result.row, result.prompt
    request = {**CompressionOptions().as_dict(), **ENGINE_OPTIONS, **row.options, "prompt_ids": prompt}
    if row.kind in ("uniform", "head_wise"):
        layer = next(iter(result.kept.values()))
        request["n_kept"] = sum(len(p) for p in layer) // len(layer)  # every head's, or their mean (head-wise)
    elif row.kind == "chunked":
        request["kept_after"] = {str(stage.seen): stage.kept for stage in plan_of(row.options, len(prompt))}
    elif row.kind == "decoding":
        # the last generated token is sampled, never computed: the last compaction is at most one token before it
        plan = plan_of(row.options, len(prompt), len(prompt) + len(result.tokens) - 1)
        request["tokens"] = result.tokens[:-1]
        request["kept_after"] = {str(s.seen): s.kept for s in plan if s.phase == "prompt"}
        request["kept_at"] = {str(s.seen): s.kept for s in plan if s.phase == "decoding"}
    else:
        raise ValueError(f"no reference selection for a {row.kind} row")
    return request


def compare_results(results: list, reference_selections: dict) -> tuple[list[str], dict]:
    """:func:`compare_selections` of mixed-batch rows (``conftest.Result``) whose ``kept`` is their final selection,
    against the transformers presses' for the same rows."""
    names = [result.row.name for result in results]
    return compare_selections(names, [r.kept for r in results], [reference_selections[name] for name in names])


def compare_selections(names, plugin: list[dict], reference: list[dict]) -> tuple[list[str], dict[str, float]]:
    """Per request: a line of identical (layer, head) selections and shared entries, and the fraction of the plugin's
    kept entries the reference keeps too (``plugin``: ``{layer_name: heads}``; ``reference``: ``{layer_index:
    heads}``)."""
    report, agreement = [], {}
    for name, kept, expected in zip(names, plugin, reference):
        identical = heads_total = common = entries = 0
        for layer_name, heads in kept.items():
            layer = layer_name.split(".")[2]
            for head, positions in enumerate(heads):
                heads_total += 1
                identical += positions == expected[layer][head]
                common += len(set(positions) & set(expected[layer][head]))
                entries += len(positions)
        agreement[name] = common / entries
        report.append(f"{name}: {identical}/{heads_total} identical heads, {common}/{entries} entries")
    return report, agreement


def press_selection(model, prompt: list[int], kept: dict, options: dict) -> dict:
    """The entries the press of ``options`` keeps in each layer of ``kept`` (the engine's selection, for its counts),
    scored on transformers' prefill of ``prompt``: the plugin's selection rule (``presses.keep_mask``) on the
    reference's post-RoPE queries, keys and values and its ``o_proj``."""
    from kvpress_critical_vllm.options import CompressionOptions
    from kvpress_critical_vllm.presses import keep_mask
    from reference import layer_index, prefill_states

    press = CompressionOptions(**{"compression_ratio": 0.5, **options})
    states = prefill_states(model, prompt)
    selection = {}
    for name, heads in kept.items():
        index = layer_index(name)
        queries, keys, values = states[index]
        n_keep = sum(len(positions) for positions in heads) // len(heads)  # per head, on average over the heads

        def read(first: int, end: int, keys=keys, values=values):
            return keys[first:end].transpose(0, 1), values[first:end].transpose(0, 1)  # (N, h, d)

        o_proj = model.model.layers[index].self_attn.o_proj.weight
        window = queries.transpose(0, 1)[-press.window_size :]  # (W, H, d)
        mask = keep_mask(press, read, keys.shape[0], n_keep, queries=window, o_proj_weight=o_proj)
        selection[name] = [row.nonzero().flatten().tolist() for row in mask]
    return selection


def same_entries(a: dict, b: dict) -> float:
    """Fraction of kept entries two selections (``{layer: [[positions] per head]}``) share."""
    common = total = 0
    for name, heads in a.items():
        for x, y in zip(heads, b[name]):
            common += len(set(x) & set(y))
            total += len(x)
    return common / total
