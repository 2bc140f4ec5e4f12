"""The quality benchmark: its prose source, its planted facts, the likelihood metrics, the bootstrap, and a tiny
sweep through kvpress's runner that writes likelihood.csv and the quality tables."""

import math
import os
import sys
from pathlib import Path

import background
import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from evaluation.bootstrap import mean_difference, paired_bootstrap, relative_reduction
from kvpress_critical.data.quality import QUALITY_TASKS, generate_quality_dataset
from kvpress_critical.data.text import SOURCE, prose_passage, prose_sentences
from kvpress_critical.likelihood import coarse_kl, target_tokens

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def test_prose_source_loads_offline():
    sentences = prose_sentences()
    assert "pydoc_data" in SOURCE
    assert len(sentences) > 1500 and sum(len(s) for s in sentences) > 150_000
    assert all(s[-1] in ".!?" and len(s.split()) >= 4 for s in sentences)
    assert not any(">>>" in s or "::=" in s for s in sentences)  # no code, no grammar productions
    import random

    assert prose_passage(random.Random(0), 5) == prose_passage(random.Random(0), 5)


@pytest.mark.parametrize("haystack", ["prose", "synthetic"])
def test_planted_facts(tokenizer, haystack):
    df = generate_quality_dataset(tokenizer, context_length=512, n_contexts=3, haystack=haystack, seed=1)
    assert len(df) == 3 * len(QUALITY_TASKS) and df["context_id"].nunique() == 3
    for context, group in df.groupby("context"):
        assert set(group["task"]) == set(QUALITY_TASKS)
        assert group["answer_prefix"].nunique() == 1  # kvpress's runner asks all questions of a context at once
        n_tokens = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        assert 0.85 * 512 <= n_tokens <= 512
        decoded = tokenizer.decode(tokenizer(context, add_special_tokens=False)["input_ids"])
        for row in group.itertuples():
            for answer in row.answer:
                assert answer in context and answer in decoded  # verbatim, and survives tokenization
            ids, scored = target_tokens(tokenizer, row.target)
            assert scored.any()
            scored_text = tokenizer.decode(ids[0][scored]).strip()
            for answer in row.answer:  # the scored tokens are the answer words
                assert answer in scored_text
    # the same arguments give the same rows; another seed other rows
    again = generate_quality_dataset(tokenizer, context_length=512, n_contexts=3, haystack=haystack, seed=1)
    assert again.equals(df)
    other = generate_quality_dataset(tokenizer, context_length=512, n_contexts=3, haystack=haystack, seed=2)
    assert not other["context"].equals(df["context"])


def test_multi_value_answers_are_distinct_and_absent_from_the_filler(tokenizer):
    df = generate_quality_dataset(tokenizer, context_length=512, n_contexts=4, seed=3)
    for row in df[df["task"] == "niah_multivalue"].itertuples():
        assert len(set(row.answer)) == 3
        for answer in row.answer:  # once per needle: the value appears nowhere else
            assert row.context.count(answer) == 1


def test_target_markup():
    class Chars:  # a character-level tokenizer with offsets
        def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
            return {"input_ids": [ord(c) for c in text], "offset_mapping": [(i, i + 1) for i in range(len(text))]}

    ids, scored = target_tokens(Chars(), "ab [[cd]] e[[f]]")
    assert "".join(map(chr, ids[0].tolist())) == "ab cd ef"
    assert scored.tolist() == [False, False, False, True, True, False, False, True]
    with pytest.raises(ValueError, match="unbalanced"):
        target_tokens(Chars(), "a [[b")


def test_coarse_kl_is_zero_against_itself_and_matches_the_full_kl():
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 50, generator=gen) * 3, -1)
    top = logp.topk(50, -1)  # k = V: the coarse KL is the exact KL
    assert torch.allclose(coarse_kl(top.indices, top.values, logp), torch.zeros(3), atol=1e-6)
    other = torch.log_softmax(torch.randn(3, 50, generator=gen), -1)
    exact = (logp.exp() * (logp - other)).sum(-1)
    torch.testing.assert_close(coarse_kl(top.indices, top.values, other), exact, rtol=1e-5, atol=1e-6)
    top5 = logp.topk(5, -1)  # coarsening never increases the divergence (data processing inequality)
    assert bool((coarse_kl(top5.indices, top5.values, other) <= exact + 1e-6).all())


@pytest.mark.slow
def test_likelihood_pipeline_full_cache_is_the_reference_and_matches_a_direct_computation(smollm2, tmp_path):
    from kvpress import SnapKVPress

    from kvpress_critical.likelihood import LikelihoodPipeline, ensure_reference, sample_key

    model, tokenizer = smollm2
    df = generate_quality_dataset(tokenizer, context_length=384, n_contexts=1, seed=0)
    pipe = LikelihoodPipeline(model=model, tokenizer=tokenizer)
    pipe.targets = {sample_key(r.context, r.question): r.target for r in df.itertuples()}
    context, questions = df["context"].iloc[0], df["question"].tolist()
    reference = ensure_reference(pipe, tmp_path / "ref.pt", [(context, questions)])
    assert (tmp_path / "ref.pt").is_file() and len(reference) == len(questions)
    assert ensure_reference(pipe, tmp_path / "ref.pt", []).keys() == reference.keys()  # loaded, not recomputed
    pipe.reference = reference
    pipe(context, questions=questions, press=None, max_new_tokens=4)
    for record in pipe.records:  # the full cache against itself: no loss at all
        assert record["kl_topk"] == pytest.approx(0.0, abs=1e-6)
        assert record["nll"] == pytest.approx(record["nll_full"], abs=1e-5)

    # direct computation: the whole conversation in one forward pass, no cache, same scored tokens
    row = df.iloc[0]
    inputs = pipe.preprocess(context, [row.question], "", max_context_length=10**6)
    ids, scored = target_tokens(tokenizer, row.target)
    full = torch.cat([inputs["context_ids"], inputs["questions_ids"][0], ids], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    start = full.shape[1] - ids.shape[1]
    positions = start - 1 + scored.nonzero().squeeze(-1)
    direct = -torch.log_softmax(logits[positions], -1).gather(-1, ids[0][scored].unsqueeze(-1)).mean()
    assert pipe.records[0]["nll"] == pytest.approx(float(direct), rel=1e-4)

    pipe.records = []  # a compressed cache loses likelihood
    pipe(context, questions=questions, press=SnapKVPress(0.75), max_new_tokens=4)
    assert sum(r["kl_topk"] for r in pipe.records) > 0


def test_bootstrap_covers_a_known_difference():
    rng = np.random.default_rng(0)
    n_clusters, per_cluster, true_diff = 40, 5, 0.3
    clusters = np.repeat(np.arange(n_clusters), per_cluster)
    shared = rng.normal(0, 1, n_clusters)[clusters]  # questions of one context move together
    base = 1.0 + shared + rng.normal(0, 0.5, len(clusters))
    other = base - true_diff + rng.normal(0, 0.3, len(clusters))
    interval = paired_bootstrap(mean_difference, base, other, clusters=clusters, n_resamples=1000)
    assert interval.low < true_diff < interval.high
    assert interval.excludes_zero() and interval.n_clusters == n_clusters
    # coverage over repeated experiments is close to the nominal 95%
    covered = 0
    for seed in range(60):
        r = np.random.default_rng(seed + 1)
        s = r.normal(0, 1, n_clusters)[clusters]
        b = 1.0 + s + r.normal(0, 0.5, len(clusters))
        o = b - true_diff + r.normal(0, 0.3, len(clusters))
        iv = paired_bootstrap(mean_difference, b, o, clusters=clusters, n_resamples=400, seed=seed)
        covered += iv.low <= true_diff <= iv.high
    assert covered >= 51  # >= 85% of 60 (nominal 95%)
    # no difference: the interval contains zero
    same = paired_bootstrap(mean_difference, base, base + rng.normal(0, 0.3, len(base)), clusters=clusters)
    assert same.low < 0 < same.high
    assert relative_reduction(np.array([2.0, 2.0]), np.array([1.0, 1.0])) == 0.5
    assert math.isnan(relative_reduction(np.array([0.0]), np.array([1.0])))


QUALITY_PRESET = {
    "models": ["embedded"],
    "datasets": [
        {
            "dataset": "quality_prose",
            "data_dir": "256",
            "generate": {"generator": "quality", "context_length": 256, "n_contexts": 2, "haystack": "prose"},
        },
    ],
    "presses": ["no_press", "snapkv", "critical_snapkv"],
    "compression_ratios": [0.5],
    "device": "cpu",
    "max_new_tokens": 4,
    "model_kwargs": {"attn_implementation": "sdpa", "dtype": "float32"},
}


@background.job("quality-sweep")
def quality_sweep_job(tmp_path_factory) -> background.Job:
    folder = tmp_path_factory.mktemp("quality-sweep")
    preset = folder / "quality.yaml"
    preset.write_text(yaml.safe_dump(QUALITY_PRESET))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHON=sys.executable)
    command = ["bash", str(REPO / "evaluation" / "evaluate.sh"), "--preset", str(preset), "--output-dir"]
    command += [str(folder / "results"), "--workers", "2", "--threads", "1"]
    return background.Job(command, cwd=REPO, env=env, timeout=900)


@pytest.mark.slow
@pytest.mark.background("quality-sweep")
def test_quality_sweep_through_kvpress_runner(background_job):
    assert background_job.returncode == 0, (background_job.error, background_job.stderr[-3000:])
    out = Path(background_job.command[background_job.command.index("--output-dir") + 1])
    runs = sorted(p for p in out.iterdir() if p.name.startswith("quality_prose__"))
    assert len(runs) == 3
    for run in runs:  # kvpress's three files, plus ours
        assert {"predictions.csv", "metrics.json", "config.yaml", "likelihood.csv"} <= {p.name for p in run.iterdir()}
        likelihood = pd.read_csv(run / "likelihood.csv")
        assert len(likelihood) == 2 * len(QUALITY_TASKS)
        assert likelihood[["nll", "kl_topk", "nll_full"]].notna().all().all()
    full = pd.read_csv(next(r for r in runs if "no_press" in r.name) / "likelihood.csv")
    assert full["kl_topk"].abs().max() < 1e-6
    comparisons = pd.read_csv(out / "summary" / "quality_comparisons.csv")
    row = comparisons[(comparisons["press"] == "critical_snapkv") & (comparisons["base"] == "snapkv")].iloc[0]
    assert row["n_samples"] == 2 * len(QUALITY_TASKS) and row["n_contexts"] == 2
    assert "critical_snapkv vs snapkv" in (out / "summary" / "quality.md").read_text()
    assert len(list((out / "reference").glob("*.pt"))) == 1  # one full-cache reference, shared by every job


@pytest.mark.slow
def test_multiturn_source_through_kvpress_runner(tmp_path, smollm2_pipeline):
    """The quality benchmark's multi-turn source: each context's questions asked as one conversation over the
    compressed context (kvpress's runner, its inference step replaced), each turn after the earlier targets; the
    likelihood per turn (the full-cache conversation is the reference) and the per-turn tables of the aggregation."""
    from evaluation.aggregate import aggregate
    from evaluation.kvpress_eval import import_kvpress_evaluation
    from evaluation.multiturn import multiturn_runner
    from evaluation.registry import register
    from evaluation.worker import LIKELIHOOD_FILE, likelihood_targets, write_likelihood
    from kvpress_critical.data import save_ruler_dataset
    from kvpress_critical.likelihood import reference_path

    kv = import_kvpress_evaluation()
    df = generate_quality_dataset(smollm2_pipeline.tokenizer, context_length=256, n_contexts=2, turns=True)
    assert list(df["turn_idx"]) == list(range(5)) * 2
    save_ruler_dataset(df, tmp_path / "data", "256")
    register(kv.registry, {"quality_turns": str(tmp_path / "data")})
    out = tmp_path / "results"
    config = dict(dataset="quality_turns", data_dir="256", model="SmolLM2-135M-Instruct", max_new_tokens=4)
    targets = likelihood_targets(df, config)
    reference = reference_path(out, "turns")

    class Runner(multiturn_runner(kv.evaluate, targets, reference)):
        def _setup_model_pipeline(self):  # the session's embedded model, instead of loading it again
            self.pipeline = smollm2_pipeline

    for press in ("no_press", "snapkv", "critical_snapkv"):
        runner = Runner(
            kv.evaluate.EvaluationConfig(
                **config, press_name=press, compression_ratio=0.5, output_dir=str(out), log_level="WARNING"
            )
        )
        runner.run_evaluation()
        folder = out / f"quality_turns__256__SmolLM2-135M-Instruct__{press}__{0.0 if press == 'no_press' else 0.5:.2f}"
        write_likelihood(runner.records, df, folder / LIKELIHOOD_FILE)
        likelihood = pd.read_csv(folder / LIKELIHOOD_FILE)
        assert sorted(likelihood["turn"]) == sorted(list(range(5)) * 2)
        assert likelihood[["nll", "kl_topk", "nll_full"]].notna().all().all()
        if press == "no_press":  # the full-cache conversation is the reference, turn after turn
            assert likelihood["kl_topk"].abs().max() < 1e-6
            assert np.allclose(likelihood["nll"], likelihood["nll_full"], atol=1e-5)
    summary = aggregate(out)
    by_turn = pd.read_csv(summary / "quality_turn_comparisons.csv")
    assert sorted(by_turn["turn"].unique()) == [0, 1, 2, 3, 4] and set(by_turn["press"]) == {"critical_snapkv"}
    assert "## Per turn" in (summary / "quality.md").read_text()
