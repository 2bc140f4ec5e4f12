"""``python -m kvpress_critical.analysis`` end to end on the embedded SmolLM2 with a few short contexts."""

import json

import pandas as pd
import pytest

from kvpress_critical.analysis.cli import main
from kvpress_critical.analysis.samples import load_rows, samples_from_rows
from kvpress_critical.data.text import haystack_context

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_file(smollm2, tmp_path_factory):
    _, tokenizer = smollm2
    rows = [
        {
            "context": haystack_context(tokenizer, 120, "The code of the red gate is 4417.", seed=1),
            "question": "What is the code of the red gate?",
            "answer_prefix": "Answer:",
            "answer": ["4417"],
            "task": "needle",
        },
        {  # no reference answer: the full-cache greedy answer is teacher-forced instead
            "context": haystack_context(tokenizer, 100, "The cat is called Miso.", seed=2),
            "question": "What is the cat called?",
            "task": "needle",
        },
    ]
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    pd.DataFrame(rows).to_json(path, orient="records", lines=True)
    return path


def test_samples_are_tokenized_like_the_pipeline(smollm2, data_file):
    _, tokenizer = smollm2
    samples = samples_from_rows(load_rows(str(data_file), tokenizer, n_samples=5), tokenizer, max_answer_tokens=3)
    assert [s.name for s in samples] == ["needle/0", "needle/1"]
    assert samples[1].answer_ids is None
    assert tokenizer.decode(samples[0].answer_ids[0]).strip().startswith("44")
    # the chat template's user turn ends the context; the question is not part of it
    assert "red gate?" not in tokenizer.decode(samples[0].context_ids[0])
    assert "red gate?" in tokenizer.decode(samples[0].question_ids[0])
    aware = samples_from_rows(load_rows(str(data_file), tokenizer), tokenizer, query_aware=True)[0]
    assert "red gate?" in tokenizer.decode(aware.context_ids[0])  # compressed with the context
    assert "red gate?" not in tokenizer.decode(aware.question_ids[0])
    assert tokenizer.decode(aware.question_ids[0]).endswith("Answer:")


def test_smoke_data_is_the_ruler_generator(smollm2):
    pytest.importorskip("kvpress_critical.data.ruler")
    _, tokenizer = smollm2
    rows = load_rows("smoke", tokenizer, context_length=256, n_samples=1, tasks=["niah_single_1", "vt"])
    samples = samples_from_rows(rows, tokenizer)
    assert [s.name for s in samples] == ["niah_single_1/0", "vt/1"]
    assert all(s.answer_ids is not None and s.context_ids.shape[1] > 64 for s in samples)


def test_cli_writes_summary_table_and_plots_without_overwriting(data_file, tmp_path):
    common = ["--data", str(data_file), "--n-samples", "2", "--out", str(tmp_path), "--name", "run", "--quiet"]
    first = main(common + ["--ratios", "0.5", "--max-answer-tokens", "3", "--threads", "1"]).path
    assert first == tmp_path / "run"
    files = {p.name for p in first.iterdir()}
    pngs = {"fig4_reduction_map.png", "fig5_layer_perturbation.png", "fig6_reduction_vs_cache.png"}
    assert files == {"summary.json", "table.json", "table.md", "per_head.json"} | pngs
    for name in pngs:
        assert (first / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((first / "summary.json").read_text())
    assert len(summary["samples"]) == 2
    assert set(summary["presses"]) == {
        "SnapKV@0.5",
        "CriticalKV(SnapKV)@0.5",
        "AdaKV(SnapKV)@0.5",
        "CriticalAdaKV(SnapKV)@0.5",
    }
    for press in summary["presses"].values():
        assert press["bound_check"]["actual_above_theta"] == 0
        assert len(press["per_layer_first_token"]["actual"]) == 30
        assert press["fidelity"]["kl"] > 0
    assert len(json.loads((first / "table.json").read_text())) == 4
    assert (first / "table.md").read_text().count("\n") == 6
    per_head = json.loads((first / "per_head.json").read_text())
    assert len(per_head["presses"]["SnapKV@0.5"]["actual"]) == 30
    assert len(per_head["presses"]["SnapKV@0.5"]["actual"][0]) == 9

    second = main(
        common + ["--ratios", "0.8", "--modes", "kv", "--max-answer-tokens", "2", "--no-plots", "--threads", "1"]
    ).path
    assert second == tmp_path / "run-1"
    assert json.loads((first / "summary.json").read_text()) == summary  # the first run is untouched
    assert set(json.loads((second / "summary.json").read_text())["presses"]) == {"SnapKV@0.8", "CriticalKV(SnapKV)@0.8"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
