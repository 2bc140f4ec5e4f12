"""evaluation/aggregate.py on hand-made results folders: loss arithmetic, pairing, domains, missing cells."""

import json
import math

import pandas as pd
import pytest
import yaml

from evaluation.aggregate import aggregate, loss, read_runs, scores_frame, summarize
from evaluation.paired import sample_matches
from evaluation.tasks import LONGBENCH_DOMAINS

MODEL = "org/Model-7B"


def make_run(root, dataset, data_dir, press, ratio, metrics, predictions=None, model=MODEL):
    name = f"{dataset}__{data_dir}__{model.replace('/', '--')}__{press}__{ratio:.2f}"
    folder = root / name
    folder.mkdir(parents=True)
    config = {"dataset": dataset, "data_dir": data_dir, "model": model, "press_name": press, "compression_ratio": ratio}
    config["press_init_command"] = f"{press}()"
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.json").write_text(json.dumps(metrics))
    if predictions is None:
        predictions = pd.DataFrame({"predicted_answer": ["x"], "answer": ["['x']"], "task": ["a"], "question": ["q"]})
    predictions.to_csv(folder / "predictions.csv", index=False)
    return name


def ruler(a, b):
    return {"a_task": {"string_match": a}, "b_task": {"string_match": b}}


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    make_run(root, "ruler", "4096", "no_press", 0.0, ruler(100.0, 60.0))  # full = 80
    make_run(root, "ruler", "4096", "snapkv", 0.5, ruler(50.0, 50.0))  # 50 -> loss 37.5 %
    make_run(root, "ruler", "4096", "critical_snapkv", 0.5, ruler(80.0, 60.0))  # 70 -> loss 12.5 %
    make_run(root, "ruler", "4096", "snapkv", 0.75, ruler(40.0, 20.0))  # critical_snapkv 0.75 never ran
    make_run(root, "ruler", "4096", "adakv_snapkv", 0.5, {"a_task": {"string_match": 90.0}})  # b_task missing
    return root


def test_loss_arithmetic():
    assert loss(80.0, 50.0) == pytest.approx(37.5)
    assert loss(80.0, 88.0) == pytest.approx(-10.0)  # better than the full cache: negative loss
    assert math.isnan(loss(0.0, 10.0)) and math.isnan(loss(math.nan, 10.0)) and math.isnan(loss(50.0, math.nan))


def test_summary_losses_and_critical_vs_base(results):
    out = aggregate(results)
    summary = pd.read_csv(out / "summary.csv").set_index(["press", "compression_ratio"])
    assert summary.loc[("no_press", 0.0), "average"] == pytest.approx(80.0)
    assert summary.loc[("snapkv", 0.5), "loss"] == pytest.approx(37.5)
    assert summary.loc[("critical_snapkv", 0.5), "loss"] == pytest.approx(12.5)
    assert summary.loc[("critical_snapkv", 0.5), "cache_size"] == pytest.approx(50.0)
    assert summary.loc[("snapkv", 0.75), "a_task"] == pytest.approx(40.0)
    comparison = pd.read_csv(out / "critical_vs_base.csv")
    assert len(comparison) == 1  # only the ratio where both exist
    row = comparison.iloc[0]
    assert (row["base"], row["critical"], row["compression_ratio"]) == ("snapkv", "critical_snapkv", 0.5)
    assert row["loss_reduction_pp"] == pytest.approx(25.0)
    assert row["relative_loss_reduction"] == pytest.approx(100 * 25.0 / 37.5)


def test_missing_cells_are_reported_not_dropped(results):
    out = aggregate(results)
    missing = pd.read_csv(out / "missing.csv", keep_default_na=False)
    reasons = {(r.press, r.compression_ratio, r.task): r.reason for r in missing.itertuples()}
    assert reasons[("critical_snapkv", 0.75, "")] == "configuration not run"
    assert reasons[("adakv_snapkv", 0.5, "b_task")] == "task missing"
    assert ("adakv_snapkv", 0.75, "") in reasons  # inferred grid: every press seen x every ratio seen
    summary = pd.read_csv(out / "summary.csv").set_index(["press", "compression_ratio"])
    incomplete = summary.loc[("adakv_snapkv", 0.5)]
    assert math.isnan(incomplete["average"]) and math.isnan(incomplete["loss"])  # not averaged over a subset
    assert incomplete["average_available"] == pytest.approx(90.0) and incomplete["n_tasks"] == 1
    tables = (out / "tables.md").read_text()
    assert "| 50% | adakv_snapkv | 90.00 | — | — | — |" in tables
    assert "configuration not run" in tables and "task missing" in tables


def test_missing_baseline_and_expected_configurations(tmp_path):
    root = tmp_path / "results"
    make_run(root, "ruler", "4096", "snapkv", 0.5, ruler(50.0, 50.0))
    (root / "failed").mkdir()
    (root / "failed" / "ruler__4096__org--Model-7B__critical_snapkv__0.50.txt").write_text("Traceback ...")
    expected = [
        (
            "ruler__4096__org--Model-7B__snapkv__0.50",
            {"dataset": "ruler", "data_dir": "4096", "model": MODEL, "press_name": "snapkv", "compression_ratio": 0.5},
        ),
        (
            "ruler__4096__org--Model-7B__critical_snapkv__0.50",
            {
                "dataset": "ruler",
                "data_dir": "4096",
                "model": MODEL,
                "press_name": "critical_snapkv",
                "compression_ratio": 0.5,
            },
        ),
        (
            "ruler__4096__org--Model-7B__no_press__0.00",
            {
                "dataset": "ruler",
                "data_dir": "4096",
                "model": MODEL,
                "press_name": "no_press",
                "compression_ratio": 0.0,
            },
        ),
    ]
    out = aggregate(root, expected=expected)
    missing = pd.read_csv(out / "missing.csv", keep_default_na=False).set_index("press")
    assert missing.loc["critical_snapkv", "reason"].startswith("configuration failed")
    assert missing.loc["no_press", "reason"] == "configuration not run"
    assert "snapkv" not in missing.index
    summary = pd.read_csv(out / "summary.csv")
    assert math.isnan(summary["loss"].item())  # no baseline: no loss, rather than a made-up one
    # without the sweep's plan, the absent baseline is still reported
    inferred = pd.read_csv(aggregate(root, out=tmp_path / "inferred") / "missing.csv")
    assert "no full-cache (no_press) baseline" in set(inferred["reason"])


def test_longbench_domains_and_per_task_runs(tmp_path):
    root = tmp_path / "results"
    tasks = [task for tasks in LONGBENCH_DOMAINS.values() for task in tasks]
    for i, task in enumerate(tasks):
        make_run(root, "longbench", task, "no_press", 0.0, 40.0 + i)
        make_run(root, "longbench", task, "snapkv", 0.8, 20.0 + i)
    runs = read_runs(root)
    assert {run["benchmark"] for run in runs} == {"longbench"}  # one benchmark, a task per data_dir
    summary = summarize(scores_frame(runs)).set_index("press")
    assert summary.loc["no_press", "Single-Doc QA"] == pytest.approx(41.0)  # tasks 0, 1, 2
    assert summary.loc["no_press", "Code"] == pytest.approx((54.0 + 55.0) / 2)
    assert summary.loc["no_press", "average"] == pytest.approx(40.0 + 7.5)
    assert summary.loc["snapkv", "loss"] == pytest.approx(100 * 20.0 / 47.5)
    tables = (aggregate(root) / "tables.md").read_text()
    header = next(line for line in tables.splitlines() if line.startswith("| Cache"))
    assert header.index("narrativeqa") < header.index("repobench-p") < header.index("Single-Doc QA")


def test_paired_samples_from_predictions(tmp_path):
    root = tmp_path / "results"
    questions = ["q1", "q2", "q3", "q4"]

    def predictions(answers):
        return pd.DataFrame(
            {
                "predicted_answer": answers,
                "answer": ["['11']", "['22' '23']", "['33']", "['44']"],  # numpy arrays as pandas writes them
                "task": ["t"] * 4,
                "question": questions,
            }
        )

    def metrics(score):
        return {"t": {"string_match": score}}

    make_run(root, "ruler", "4096", "no_press", 0.0, metrics(100.0), predictions(["11", "22 23", "33", "44"]))
    make_run(root, "ruler", "4096", "snapkv", 0.5, metrics(62.5), predictions(["11", "22", "no", "44"]))
    make_run(root, "ruler", "4096", "critical_snapkv", 0.5, metrics(75.0), predictions(["no", "22\n23", "33", "44"]))
    row = pd.read_csv(aggregate(root) / "critical_vs_base.csv").iloc[0]
    assert row["n_samples"] == 4
    # per-sample string match: q1 base 1 > 0, q2 critical 1 > 0.5, q3 critical 1 > 0, q4 tie
    assert (row["critical_better"], row["base_better"], row["ties"]) == (2, 1, 1)
    # per-sample matches that do not reproduce metrics.json are not paired
    make_run(root, "ruler", "4096", "snapkv", 0.25, metrics(10.0), predictions(["11", "22", "no", "44"]))
    make_run(root, "ruler", "4096", "critical_snapkv", 0.25, metrics(75.0), predictions(["no", "22 23", "33", "44"]))
    comparison = pd.read_csv(aggregate(root) / "critical_vs_base.csv").set_index("compression_ratio")
    assert comparison.loc[0.5, "n_samples"] == 4 and math.isnan(comparison.loc[0.25, "n_samples"])


def test_sample_matches_follow_kvpress_ruler_metrics():
    frame = pd.DataFrame(
        {
            "predicted_answer": [" A b ", None, "x\ny", "only y"],
            "answer": ["['a' 'B' 'c']", "['x']", "['xy']", "['z' 'y']"],
            "task": ["niah_multivalue", "vt", "niah_single_1", "qa_1"],
        }
    )
    # all answers count (fraction), control characters removed before matching; qa: any answer
    assert sample_matches(frame).tolist() == pytest.approx([2 / 3, 0.0, 1.0, 1.0])


def test_longbench_task_run_missing_is_one_cell(tmp_path):
    root = tmp_path / "results"
    expected = []
    for task in ("lcc", "repobench-p"):
        for press, ratio in (("no_press", 0.0), ("snapkv", 0.8)):
            config = {"dataset": "longbench", "data_dir": task, "model": MODEL, "press_name": press}
            config["compression_ratio"] = ratio
            name = f"longbench__{task}__org--Model-7B__{press}__{ratio:.2f}"
            expected.append((name, config))
            if (task, press) != ("lcc", "snapkv"):
                make_run(root, "longbench", task, press, ratio, 50.0)
    out = aggregate(root, expected=expected)
    missing = pd.read_csv(out / "missing.csv", keep_default_na=False)
    assert missing[["benchmark", "press", "task", "reason"]].values.tolist() == [
        ["longbench", "snapkv", "lcc", "configuration not run"]
    ]
    summary = pd.read_csv(out / "summary.csv").set_index("press")
    assert math.isnan(summary.loc["snapkv", "Code"]) and summary.loc["no_press", "Code"] == pytest.approx(50.0)
