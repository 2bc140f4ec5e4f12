"""The paper's appendix from presets: press variants named by their parameters, DuoAttention's ratio and patterns,
query-aware runs, SCBench's multi-turn tasks (loader, scoring, conversations through kvpress's runner), and the
paper's numbers beside ours."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers import scbench_sample, tiny_model

from evaluation.paper import paper_comparison, paper_markdown
from evaluation.presets import expand, load_preset
from evaluation.registry import critical_base, ensure_press, our_presses, variant_name
from kvpress_critical.data.scbench import calculate_metrics, load_scbench, score, turn_scores

PAPER_PRESETS = {
    # preset: (configurations, presses that must appear among the results folders)
    "paper_b1_baselines": (
        2 * 16 * (1 + 7 * 2),
        ["pyramidkv__0.80", "duo_attention__0.60", "snapkv_window256_kernel1"],
    ),
    "paper_b2_10_percent": (2 * 16 * (1 + 5), ["critical_adakv_snapkv_alpha0__0.90", "alpha0.25__0.90"]),
    "paper_b3_query_aware": (2 * 16 * (1 + 4 * 2), ["critical_snapkv__0.80__query_aware"]),
    "paper_c1_first_stage_ratio": (2 * 16 * (1 + 8), ["critical_adakv_snapkv_alpha1__0.80", "alpha0.1__0.80"]),
    "paper_c3_norm": (2 * 16 * (1 + 6 * 2), ["critical_adakv_snapkv_l2__0.60"]),
    "paper_b5_multiturn": (3 * (1 + 4 * 3), ["scbench__scbench_mf__", "critical_adakv_snapkv_compact__0.60"]),
}


def test_press_variants_are_named_built_and_paired():
    from kvpress import PyramidKVPress, SnapKVPress

    assert variant_name("snapkv", window_size=256, kernel_size=1) == "snapkv_window256_kernel1"
    assert variant_name("critical_adakv_snapkv", first_stage_ratio=0.0, norm="l2") == "critical_adakv_snapkv_l2_alpha0"
    assert variant_name("critical_adakv_snapkv_compact", norm="l2") == "critical_adakv_snapkv_l2_compact"
    with pytest.raises(ValueError, match="unknown press parameter"):
        variant_name("snapkv", beta=2)
    registry = SimpleNamespace(PRESS_REGISTRY={**our_presses(), "pyramidkv": PyramidKVPress()})
    presses = registry.PRESS_REGISTRY
    assert ensure_press(registry, "critical_adakv_snapkv_alpha0.25")
    variant = presses["critical_adakv_snapkv_alpha0.25"]
    assert variant.first_stage_ratio == 0.25 and presses["critical_adakv_snapkv"].first_stage_ratio == 0.5
    assert "first_stage_ratio=0.25" in repr(variant)  # what config.yaml records
    assert ensure_press(registry, "snapkv_window256_kernel1")
    h2o = presses["snapkv_window256_kernel1"]
    assert isinstance(h2o, SnapKVPress) and (h2o.window_size, h2o.kernel_size) == (256, 1)
    assert ensure_press(registry, "critical_adakv_snapkv_compact_alpha0_chunk128")  # variants compose
    chunked = presses["critical_adakv_snapkv_compact_alpha0_chunk128"]
    assert chunked.press.chunk_size == 128 and chunked.press.press.first_stage_ratio == 0.0
    assert not ensure_press(registry, "nonexistent_alpha0.2")
    with pytest.raises(ValueError, match="has no first_stage_ratio"):
        ensure_press(registry, "pyramidkv_alpha0.2")
    # the critical press's own parameter disappears from its base's name; the scorer's stays
    assert critical_base("critical_adakv_snapkv_alpha0.25") == "adakv_snapkv"
    assert critical_base("critical_snapkv_window256_alpha0") == "snapkv_window256"


def test_paper_presets_expand_to_the_appendix_configurations(tmp_path):
    from evaluation.kvpress_eval import import_kvpress_evaluation
    from evaluation.registry import register
    from evaluation.run import _planned_datasets, check_presses, dataset_scorers, name_jobs

    kv = import_kvpress_evaluation()
    for name, (count, expected) in PAPER_PRESETS.items():
        preset = load_preset(name)
        register(kv.registry, _planned_datasets(preset, tmp_path), dataset_scorers(preset))  # as a dry run does
        check_presses(preset, kv.registry)
        jobs = name_jobs(expand(preset), kv)
        assert len(jobs) == count, name
        names = [job.name for job in jobs]
        for part in expected:
            assert any(part in n for n in names), (name, part)
        for job in jobs:
            if job.press == "duo_attention":  # kvpress's runner sizes DuoAttention by its head ratio
                assert job.config["head_compression_ratio"] == job.compression_ratio
            if name == "paper_b3_query_aware":
                assert job.config["query_aware"] and job.name.endswith("__query_aware")
    assert dataset_scorers(load_preset("paper_b5_multiturn")) == {"scbench": "scbench"}


# --------------------------------------------------------------------------------------------------------- SCBench
def test_scbench_loader_reads_the_public_format_into_kvpress_columns(tmp_path):
    scbench_sample(tmp_path)
    kv = load_scbench("scbench_kv", source=str(tmp_path))
    assert len(kv) == 4 and list(kv["turn_idx"]) == [0, 1, 0, 1] and set(kv["n_turns"]) == {2}
    assert kv["context"].iloc[0].startswith("Extract the value corresponding to the specified key")
    assert kv["context"].iloc[0] == kv["context"].iloc[1]  # one context per example, compressed once
    assert kv["question"].iloc[0].startswith('Key: "') and kv["answer"].iloc[0] in kv["context"].iloc[0]
    assert set(kv["max_new_tokens"]) == {150} and set(kv["answer_prefix"]) == {""}
    mf = load_scbench("scbench_mf", source=str(tmp_path / "data" / "scbench_mf.jsonl"), max_turns=1)
    assert len(mf) == 2 and mf["context"].iloc[0].startswith("[") and mf["answer"].dtype.kind == "i"
    assert mf["question"].iloc[0] == "What is the largest number of the list?\n\nThe largest number of the list is"
    qa = load_scbench("scbench_qa_eng", source=str(tmp_path), n_samples=1)
    assert len(qa) == 2 and qa["question"].iloc[1] == "Question: What did she keep?\nAnswer:"
    assert qa["answer"].iloc[0] == ["Mara 0"]
    with pytest.raises(ValueError, match="unknown SCBench task"):
        load_scbench("scbench_choice_eng", source=str(tmp_path))


def test_scbench_scoring_follows_its_rules():
    assert score("scbench_kv", 'The value is "abc-1".', "abc-1") == 1.0
    assert score("scbench_kv", "ABC-1", "abc-1") == 0.0  # case-sensitive substring
    assert score("scbench_mf", "The largest number is 981.", 981) == 1.0
    assert score("scbench_mf", "It is 98.6, then 981", 98) == 1.0  # the first number, int(float(...))
    assert score("scbench_mf", "no number", 3) == 0.0 and score("scbench_mf", None, 3) == 0.0
    assert score("scbench_qa_eng", "  mara 0 kept it", ["Mara 0"]) == 1.0  # case-insensitive
    assert score("scbench_qa_eng", "Oskar", np.array(["Mara 0"])) == 0.0
    assert score("scbench_mf", "It is 7", np.array([7])) == 1.0 and score("scbench_mf", "7", np.int64(7)) == 1.0
    df = pd.DataFrame(
        {"task": ["scbench_kv", "scbench_kv"], "predicted_answer": ["x abc", "y"], "answer": ["abc", "abc"]}
    )
    assert list(turn_scores(df)) == [1.0, 0.0] and calculate_metrics(df) == 50.0


def test_duo_attention_finds_llama_31_under_its_current_name_and_reads_local_patterns(tmp_path, monkeypatch):
    from kvpress.presses.duo_attention_press import PATTERNS_DICT

    from evaluation.duo_attention import PATTERNS_ENV, DuoAttentionPatternPress

    model = tiny_model("llama", num_layers=2)
    pattern = tmp_path / "Meta-Llama-3.1-8B-Instruct"
    folder = tmp_path / PATTERNS_DICT["meta-llama/Meta-Llama-3.1-8B-Instruct"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 8}))
    np.savetxt(folder / "full_attention_heads.tsv", np.array([[0.9, 0.1], [0.2, 0.8]]), delimiter="\t")
    monkeypatch.setenv(PATTERNS_ENV, str(tmp_path))
    press = DuoAttentionPatternPress(head_compression_ratio=0.5)
    monkeypatch.setattr(model.config, "name_or_path", "meta-llama/Llama-3.1-8B-Instruct")
    press.post_init_from_model(model)
    assert (press.sink_size, press.recent_size) == (4, 8)
    assert press.streaming_mask.tolist() == [[False, True], [True, False]]  # the two lowest-scoring heads
    monkeypatch.setattr(model.config, "name_or_path", "some/other-model")
    with pytest.raises(ValueError, match="duo_attention_on_the_fly"):
        press.post_init_from_model(model)
    assert pattern.exists()


def test_the_papers_numbers_are_laid_out_beside_ours():
    experiments = {
        "b1": {
            "title": "B.1",
            "benchmark": "longbench",
            "presses": ["adakv_snapkv"],
            "entries": [
                {"model": "m", "press": "critical_adakv_snapkv", "cache": 20, "score": 43.77},
                {"model": "m", "press": "pyramidkv", "cache": 20, "score": 40.22},
            ],
        }
    }
    summary = pd.DataFrame(
        [
            {
                "model": "m",
                "benchmark": "longbench",
                "press": "critical_adakv_snapkv",
                "cache_size": 20.0,
                "average": 43.0,
            },
            {"model": "m", "benchmark": "longbench", "press": "adakv_snapkv", "cache_size": 20.0, "average": 42.0},
            {"model": "x", "benchmark": "longbench", "press": "adakv_snapkv", "cache_size": 20.0, "average": 1.0},
            {"model": "m", "benchmark": "ruler/4096", "press": "pyramidkv", "cache_size": 20.0, "average": 9.0},
        ]
    )
    table = paper_comparison(summary, experiments).set_index("press")
    assert set(table.index) == {"critical_adakv_snapkv", "pyramidkv", "adakv_snapkv"}  # model m, LongBench only
    assert math.isclose(table.loc["critical_adakv_snapkv", "difference"], 43.0 - 43.77)
    assert math.isnan(table.loc["pyramidkv", "ours"]) and math.isnan(table.loc["adakv_snapkv", "paper"])
    text = paper_markdown(table.reset_index(), experiments)
    assert "| critical_adakv_snapkv | 43.00 (43.77, -0.77) |" in text
    assert "| pyramidkv | – (40.22) |" in text and "| adakv_snapkv | 42.00 |" in text
    shipped = paper_comparison(pd.DataFrame(columns=summary.columns))  # the shipped numbers load and lay out
    assert len(shipped) == 40 and shipped["ours"].isna().all()


@pytest.mark.slow
def test_scbench_conversations_through_kvpress_runner_in_both_layouts(tmp_path, smollm2_pipeline):
    """kvpress's runner with its inference step replaced (evaluation/multiturn.py), on SCBench-format data: one
    conversation per example, SCBench's scorer, and the same answers in the masking and the compact layouts."""
    from evaluation.kvpress_eval import import_kvpress_evaluation
    from evaluation.multiturn import multiturn_runner
    from evaluation.registry import register
    from kvpress_critical.data import save_ruler_dataset

    kv = import_kvpress_evaluation()
    scbench_sample(tmp_path / "source")
    save_ruler_dataset(load_scbench("scbench_kv", source=str(tmp_path / "source")), tmp_path / "data", "scbench_kv")
    register(kv.registry, {"scbench": str(tmp_path / "data")}, {"scbench": "scbench"})

    class Runner(multiturn_runner(kv.evaluate)):
        def _setup_model_pipeline(self):  # the session's embedded model, instead of loading it again
            self.pipeline = smollm2_pipeline

    answers = {}
    for press in ("critical_adakv_snapkv", "critical_adakv_snapkv_compact"):
        config = kv.evaluate.EvaluationConfig(
            dataset="scbench",
            data_dir="scbench_kv",
            model="SmolLM2-135M-Instruct",
            press_name=press,
            compression_ratio=0.5,
            max_new_tokens=6,
            max_context_length=2000,
            output_dir=str(tmp_path / "results"),
            log_level="WARNING",
        )
        Runner(config).run_evaluation()
        folder = tmp_path / "results" / f"scbench__scbench_kv__SmolLM2-135M-Instruct__{press}__0.50__max_context2000"
        predictions = pd.read_csv(folder / "predictions.csv").sort_values(["context_id", "turn_idx"])
        assert len(predictions) == 4 and predictions["predicted_answer"].notna().all()
        metrics = json.loads((folder / "metrics.json").read_text())
        assert isinstance(metrics, float) and 0 <= metrics <= 100  # SCBench's scorer: one number per task
        answers[press] = predictions["predicted_answer"].tolist()
    assert answers["critical_adakv_snapkv"] == answers["critical_adakv_snapkv_compact"]
