"""evaluation/leaderboard.py: completeness check and packaging of a leaderboard results folder (no upload)."""

import json
from pathlib import Path

import pandas as pd
import yaml

from evaluation import leaderboard
from kvpress_critical.data import RULER_TASKS

MODEL = "Qwen/Qwen3-8B"
RATIOS = (0.25, 0.5, 0.75, 0.875)


def make_folder(root: Path, press: str, ratio: float, repr_: str) -> Path:
    folder = root / f"ruler__4096__Qwen--Qwen3-8B__{press}__{ratio:.2f}"  # kvpress's naming
    folder.mkdir(parents=True)
    config = {"dataset": "ruler", "data_dir": "4096", "model": MODEL, "press_name": press, "compression_ratio": ratio}
    config.update(query_aware=False, fraction=1.0, press_init_command=repr_)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "metrics.json").write_text(json.dumps({task: {"string_match": 50.0} for task in RULER_TASKS}))
    pd.DataFrame({"predicted_answer": ["a"], "task": ["vt"]}).to_csv(folder / "predictions.csv", index=False)
    return folder


def check(results: Path, capsys) -> tuple[int, str]:
    """The leaderboard command, in this process (kvpress's evaluation code is imported once per session)."""
    code = leaderboard.main([str(results), "--presses", "critical_snapkv"])
    return code, capsys.readouterr().out


def test_leaderboard_check_and_package(tmp_path, capsys):
    results = tmp_path / "results_lb"
    make_folder(results, "no_press", 0.0, "None")
    for ratio in RATIOS[:3]:
        make_folder(
            results, "critical_snapkv", ratio, f"CriticalKVPress(compression_ratio={ratio}, press=SnapKVPress())"
        )
    broken = make_folder(results, "critical_snapkv", 0.875, "<kvpress.CriticalKVPress object at 0x7f>")
    (broken / "metrics.json").write_text(json.dumps({"vt": {"string_match": 1.0}}))

    missing_predictions = results / "ruler__4096__Qwen--Qwen3-8B__critical_snapkv__0.25" / "predictions.csv"
    missing_predictions.rename(tmp_path / "predictions.csv")

    code, out = check(results, capsys)
    assert code == 1, out
    assert "5 configurations expected" in out
    problems = [line for line in out.splitlines() if "INCOMPLETE" in line]
    assert len(problems) == 2
    assert "__critical_snapkv__0.25: predictions.csv missing" in problems[0]
    assert "__critical_snapkv__0.88" in problems[1]  # kvpress names ratio 0.875 with two decimals
    assert "incomplete press repr" in problems[1] and "lacks RULER tasks" in problems[1]
    assert not (results / "submission").exists()

    (tmp_path / "predictions.csv").rename(missing_predictions)
    (broken / "metrics.json").write_text(json.dumps({task: {"string_match": 9.0} for task in RULER_TASKS}))
    config = (broken / "config.yaml").read_text()
    (broken / "config.yaml").write_text(config.replace("<kvpress.CriticalKVPress object at 0x7f>", "CriticalKVPress()"))
    code, out = check(results, capsys)
    assert code == 0, out
    assert "dry run" in out and "--upload" in out
    packaged = sorted(p.relative_to(results / "submission") for p in (results / "submission").rglob("*") if p.is_file())
    assert len(packaged) == 15 and all(p.parts[0] == "benchmark" for p in packaged)
    assert Path("benchmark/ruler__4096__Qwen--Qwen3-8B__no_press__0.00/metrics.json") in packaged
