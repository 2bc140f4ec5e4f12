"""evaluation/: presets, registry, result publishing, GPU slots, kvpress's evaluation code import (no model runs)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from evaluation import kvpress_eval
from evaluation.presets import expand, load_preset
from evaluation.registry import CRITICAL_BASES, critical_base, register
from evaluation.sweep import gpu_ids
from evaluation.worker import is_finished, publish

REPO = Path(__file__).resolve().parents[2]


def test_presets_expand_to_the_protocols():
    smoke = load_preset("smoke")
    assert [m.name for m in smoke.models] == ["embedded"] and smoke.datasets[0].generate
    assert smoke.presses[:5] == ["no_press", "snapkv", "critical_snapkv", "adakv_snapkv", "critical_adakv_snapkv"]
    assert {"headkv_snapkv", "critical_headkv_snapkv", "defensivekv", "layer_defensivekv"} <= set(smoke.presses)
    assert len(expand(smoke)) == 1 + (len(smoke.presses) - 1) * 3  # no_press once + each press x 3 ratios
    paper = load_preset("paper")
    assert paper.compression_ratios == [0.9, 0.8, 0.6, 0.4]  # cache sizes 10/20/40/60 %
    assert [m.name for m in paper.models] == [
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistralai/Mistral-7B-Instruct-v0.3",
        "Qwen/Qwen2.5-32B-Instruct",
    ]
    longbench = [d.data_dir for d in paper.datasets if d.dataset == "longbench"]
    assert len(longbench) == 16 and "multifieldqa_en" in longbench and "multifieldqa_zh" not in longbench
    paper_presses = ["snapkv", "critical_snapkv", "adakv_snapkv", "critical_adakv_snapkv"]
    paper_presses += ["headkv_snapkv", "critical_headkv_snapkv"]  # the paper's third base method
    assert [p for p in paper.presses if p != "no_press"] == paper_presses
    jobs = expand(paper)
    assert len(jobs) == 3 * len(paper.datasets) * (1 + len(paper_presses) * 4)  # no_press once per dataset
    assert all(not j.config.get("query_aware") for j in jobs)  # context-only compression
    board = load_preset("leaderboard")
    assert [m.name for m in board.models] == ["Qwen/Qwen3-8B"]
    assert [(d.dataset, d.data_dir) for d in board.datasets] == [("ruler", "4096")]
    assert board.compression_ratios == [0.25, 0.5, 0.75, 0.875] and "no_press" in board.presses
    no_press = [j for j in expand(board) if j.press == "no_press"]
    assert len(no_press) == 1 and no_press[0].compression_ratio == 0.0


def test_preset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="known presets"):
        load_preset("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "models: [m]\ndatasets: [{dataset: ruler}]\npresses: [snapkv]\ncompression_ratios: [0.5]\nbogus: 1\n"
    )
    with pytest.raises(ValueError, match="unknown keys"):
        load_preset(str(bad))


def fake_registry():
    builtin = object()
    return SimpleNamespace(
        PRESS_REGISTRY={"critical_snapkv": builtin, "snapkv": object(), "knorm": object()},
        DATASET_REGISTRY={"ruler": "simonjegou/ruler"},
        SCORER_REGISTRY={"ruler": lambda df: {}},
    ), builtin


def test_register_mutates_kvpress_registries_in_place(tmp_path):
    from kvpress_critical import CriticalAdaKVPress, CriticalKVPress

    registry, builtin = fake_registry()
    presses, datasets, scorers = registry.PRESS_REGISTRY, registry.DATASET_REGISTRY, registry.SCORER_REGISTRY
    register(registry, {"ruler_offline": tmp_path})
    assert registry.PRESS_REGISTRY is presses and registry.DATASET_REGISTRY is datasets  # same objects
    assert registry.SCORER_REGISTRY is scorers
    assert isinstance(presses["critical_snapkv"], CriticalKVPress)  # ours replaces kvpress's...
    assert presses["kvpress_critical_snapkv"] is builtin  # ...which stays reachable
    assert isinstance(presses["critical_adakv_expected_attention"], CriticalAdaKVPress)
    assert presses["critical_adakv_snapkv_l2"].norm == "l2" and presses["critical_snapkv"].norm == "l1"
    assert "knorm" in presses
    for critical, base in CRITICAL_BASES.items():  # every pairing used by the aggregation exists
        assert base in presses and critical in presses
    for name in presses:  # and every variant (L2, compact, kvpress's own) is compared with a registered press
        base = critical_base(name)
        assert base is None or base in presses, name
    assert critical_base("critical_adakv_snapkv_l2_compact_chunk512") == "adakv_snapkv_compact_chunk512"
    assert critical_base("kvpress_critical_snapkv") == "snapkv" and critical_base("snapkv") is None
    assert datasets["ruler_offline"] == str(tmp_path) and scorers["ruler_offline"] is scorers["ruler"]
    with pytest.raises(ValueError, match="kvpress's own"):
        register(registry, {"ruler": tmp_path})


def test_publish_never_overwrites(tmp_path):
    staged = tmp_path / "stage" / "run"
    staged.mkdir(parents=True)
    for name in ("predictions.csv", "metrics.json"):
        (staged / name).write_text("x")
    with pytest.raises(RuntimeError, match="config.yaml"):
        publish(staged, tmp_path / "run")
    (staged / "config.yaml").write_text("x")
    target = tmp_path / "out" / "run"
    target.mkdir(parents=True)
    (target / "metrics.json").write_text("finished earlier")
    with pytest.raises(FileExistsError):
        publish(staged, target)
    assert (target / "metrics.json").read_text() == "finished earlier"
    publish(staged, tmp_path / "out" / "other")
    assert is_finished(tmp_path / "out" / "other") and not staged.exists()


def test_gpu_slots_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_ids() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpu_ids() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    import torch

    assert gpu_ids() == [str(i) for i in range(torch.cuda.device_count())]


def test_flash_attn_blocked_when_another_attention_is_asked(tmp_path):
    """kvpress's runner switches to flash_attention_2 whenever `import flash_attn` works; the worker prevents it."""
    fake = tmp_path / "flash_attn"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    code = textwrap.dedent(
        """
        import importlib.util
        import flash_attn  # importable before
        del __import__("sys").modules["flash_attn"]
        from evaluation.worker import block_flash_attn
        block_flash_attn()
        try:
            import flash_attn
        except ImportError:
            print("blocked", importlib.util.find_spec("flash_attn"))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "blocked None", result.stderr


def test_kvpress_evaluation_code_imports_under_a_unique_name():
    """kvpress's sdist is fetched once (cached) and its evaluate.py imported as kvpress_evaluate."""
    kv = kvpress_eval.import_kvpress_evaluation()
    assert kv.evaluate.__name__ == "kvpress_evaluate" and sys.modules["kvpress_evaluate"] is kv.evaluate
    assert "evaluate" not in sys.modules or "kvpress" not in str(sys.modules["evaluate"])
    assert kv.evaluate.PRESS_REGISTRY is kv.registry.PRESS_REGISTRY
    assert kv.evaluate.DATASET_REGISTRY is kv.registry.DATASET_REGISTRY
    assert f"kvpress-{kvpress_eval.kvpress_version()}" in str(kv.folder)
    assert kvpress_eval.import_kvpress_evaluation().evaluate is kv.evaluate  # imported once
    assert callable(kv.evaluate.EvaluationRunner.run_evaluation)


def test_explicit_evaluation_dir_is_checked(tmp_path, monkeypatch):
    monkeypatch.setenv(kvpress_eval.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not kvpress's evaluation folder"):
        kvpress_eval.evaluation_dir()
    real = kvpress_eval.sdist_cache() / "evaluation"
    if real.is_dir():
        assert kvpress_eval.evaluation_dir(real) == real.resolve()


def test_incomplete_results_folder_is_set_aside_not_overwritten(tmp_path):
    from evaluation.sweep import _set_aside_incomplete

    partial = tmp_path / "run"
    partial.mkdir()
    (partial / "predictions.csv").write_text("left by a crash")
    _set_aside_incomplete(tmp_path, "run")
    assert not partial.exists()
    (aside,) = (tmp_path / ".incomplete").iterdir()
    assert aside.name.startswith("run.") and (aside / "predictions.csv").read_text() == "left by a crash"
    finished = tmp_path / "done"
    finished.mkdir()
    for name in ("predictions.csv", "metrics.json", "config.yaml"):
        (finished / name).write_text("x")
    _set_aside_incomplete(tmp_path, "done")
    assert is_finished(finished)


def test_default_preset_is_smoke_without_gpu_or_network(monkeypatch):
    import evaluation.run as run

    monkeypatch.setattr(run, "gpu_ids", lambda: [])
    assert run.default_preset() == ("smoke", "no GPU")
    monkeypatch.setattr(run, "gpu_ids", lambda: ["0"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run.default_preset()[0] == "smoke" and not run.network_available()
    monkeypatch.setattr(run, "network_available", lambda: True)
    assert run.default_preset()[0] == "paper"


def test_one_sweep_at_a_time_per_output_folder(tmp_path):
    from filelock import FileLock

    from evaluation.sweep import run_sweep

    assert run_sweep([], tmp_path).ok  # nothing to do
    with FileLock(str(tmp_path / ".sweep.lock")):
        with pytest.raises(RuntimeError, match="another sweep is running"):
            run_sweep([], tmp_path)
