"""
Run one configuration with kvpress's own evaluation runner, in its own process.

``python -m evaluation.worker JOB.json`` (the sweep writes the file). The worker

1. imports kvpress's evaluation code (``evaluation.kvpress_eval``) and registers our presses and local
   datasets into its registry, in place;
2. keeps the attention implementation the user asked for: kvpress's runner switches to
   ``flash_attention_2`` whenever ``flash_attn`` imports, so when ``model_kwargs.attn_implementation`` is set
   to something else, ``flash_attn`` is made unimportable in this process;
3. on datasets with a ``target`` column (the quality benchmark), gives kvpress's runner
   :class:`kvpress_critical.likelihood.LikelihoodPipeline` as the ``"kv-press-text-generation"`` pipeline:
   kvpress's pipeline unchanged, plus the teacher-forced NLL / KL of each target on the same compressed cache,
   written to ``likelihood.csv`` next to kvpress's files (the full-cache reference is computed once per model and
   dataset under ``<output_dir>/reference/``);
4. runs ``EvaluationRunner(config).run_evaluation()`` with a private staging ``output_dir``, then publishes
   the results folder (``predictions.csv``, ``metrics.json``, ``config.yaml``, and ``likelihood.csv`` where
   measured) under the real output directory with an atomic rename that never replaces an existing folder.

Exit status 0 on success; otherwise the traceback is printed (the sweep keeps it in the job's log).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

logger = logging.getLogger(__name__)

RESULT_FILES = ("predictions.csv", "metrics.json", "config.yaml")
LIKELIHOOD_FILE = "likelihood.csv"
# folders of a results directory that are not kvpress results folders
NON_RESULT_DIRS = frozenset(
    {"logs", "failed", "datasets", "summary", "submission", "reference", ".staging", ".incomplete", ".jobs"}
)


def is_finished(folder: Path) -> bool:
    """Whether ``folder`` holds a complete kvpress results folder."""
    return all((folder / name).is_file() for name in RESULT_FILES)


def publish(staged: Path, target: Path) -> None:
    """Move the finished results folder ``staged`` to ``target``; never replaces an existing ``target``."""
    if not is_finished(staged):
        missing = [name for name in RESULT_FILES if not (staged / name).is_file()]
        raise RuntimeError(f"kvpress's runner finished without writing {missing} in {staged}")
    if target.exists():
        raise FileExistsError(f"{target} already exists; refusing to overwrite a result")
    os.rename(staged, target)  # atomic on one filesystem; fails if target appeared meanwhile and is not empty


def block_flash_attn() -> None:
    """Make ``import flash_attn`` fail in this process (kvpress's runner would force flash_attention_2)."""
    sys.modules["flash_attn"] = None  # type: ignore[assignment]


def _quiet_progress_bars() -> None:
    """Weight-loading and dataset progress bars would fill the job log; kvpress's inference bar stays."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _record_output_dir(config_file: Path, output_dir: str) -> None:
    """
    Point ``output_dir`` in kvpress's ``config.yaml`` at the published location instead of the staging folder.

    Written like kvpress's ``EvaluationConfig.save_config`` (same YAML options), every other field unchanged.
    """
    import yaml

    config = yaml.safe_load(config_file.read_text())
    config["output_dir"] = output_dir
    tmp = config_file.with_name(".config.yaml.tmp")
    with open(tmp, "w") as f:
        yaml.dump(config, f, default_flow_style=False, indent=2, sort_keys=False)
    os.replace(tmp, config_file)


def likelihood_pipeline(job: dict, config: dict):
    """
    Register a :class:`~kvpress_critical.likelihood.LikelihoodPipeline` subclass for this job's dataset as kvpress's
    pipeline, if the dataset has targets; returns ``(pipeline class, dataset frame)`` or ``None``.
    """
    import hashlib

    from transformers import AutoModelForCausalLM
    from transformers.pipelines import PIPELINE_REGISTRY

    from kvpress_critical.data import load_ruler_dataset
    from kvpress_critical.likelihood import LikelihoodPipeline, reference_path, sample_key

    folder = (job.get("datasets") or {}).get(config["dataset"])
    if folder is None:
        return None
    df = load_ruler_dataset(folder, config["data_dir"])
    if "target" not in df.columns:
        return None
    if config.get("query_aware"):
        logger.warning("query-aware compression moves the question into the context: no likelihood metrics")
        return None
    targets = {sample_key(r.context, r.question): r.target for r in df.itertuples()}
    samples = [(context, group["question"].tolist()) for context, group in df.groupby("context", sort=False)]
    # the reference depends on the data, the model and how it is loaded (dtype, attention): all in its name
    digest = hashlib.sha1(
        json.dumps([sorted(targets.items()), config["model"], config.get("model_kwargs")], default=str).encode()
    ).hexdigest()[:12]
    name = f"{Path(str(config['model'])).name}__{config['dataset']}__{config['data_dir']}__{digest}"
    path = reference_path(job["output_dir"], name)

    class JobPipeline(LikelihoodPipeline):
        instance = None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.targets = targets
            # the full-cache reference: computed by the first job that needs it, loaded by the others
            self.reference_file, self.reference_samples = path, samples
            JobPipeline.instance = self

    PIPELINE_REGISTRY.register_pipeline(
        "kv-press-text-generation", pipeline_class=JobPipeline, pt_model=AutoModelForCausalLM
    )
    return JobPipeline, df


def write_likelihood(records: list[dict], df, target: Path) -> None:
    """The per-question likelihood records as ``likelihood.csv`` (with the dataset's ids and tasks)."""
    import pandas as pd

    from kvpress_critical.likelihood import sample_key

    ids = {sample_key(r.context, r.question): (r.context_id, r.task) for r in df.itertuples()}
    rows = [{"context_id": ids[r["sample_key"]][0], "task": ids[r["sample_key"]][1], **r} for r in records]
    tmp = target.with_name(f".{target.name}.tmp")
    pd.DataFrame(rows).to_csv(tmp, index=False)
    os.replace(tmp, target)


def run_job(job: dict) -> Path:
    """Run the job described by ``job`` (see ``evaluation.sweep.job_payload``) and publish its results."""
    from evaluation.kvpress_eval import import_kvpress_evaluation
    from evaluation.registry import register

    config = dict(job["config"])
    attn = (config.get("model_kwargs") or {}).get("attn_implementation")
    if attn and attn != "flash_attention_2":
        block_flash_attn()
    if job.get("threads"):
        import torch

        torch.set_num_threads(int(job["threads"]))
    kv = import_kvpress_evaluation(job.get("kvpress_eval_dir"))
    register(kv.registry, job.get("datasets"))
    from evaluation.registry import ensure_press

    ensure_press(kv.registry, config["press_name"])  # a chunked variant is registered on demand
    _quiet_progress_bars()
    scores = (job.get("head_scores") or {}).get(job["config"]["model"])
    if scores is not None:  # HeadKV presses on a model without shipped head scores
        from evaluation.registry import set_head_scores

        set_head_scores(kv.registry.PRESS_REGISTRY[job["config"]["press_name"]], scores)

    output_dir = Path(job["output_dir"]).resolve()
    staging = Path(job["staging_dir"]).resolve()
    staging.mkdir(parents=True, exist_ok=False)
    if job.get("model_cwd"):  # the embedded model is passed to kvpress by folder name (clean result names)
        os.chdir(job["model_cwd"])
    likelihood = likelihood_pipeline(job, config)
    config["output_dir"] = str(staging)
    evaluation_config = kv.evaluate.EvaluationConfig(**config)
    kv.evaluate.EvaluationRunner(evaluation_config).run_evaluation()
    staged = staging / job["name"]
    produced = [p.name for p in staging.iterdir()]
    if produced != [job["name"]]:
        raise RuntimeError(f"kvpress's runner wrote {produced}, expected [{job['name']!r}]")
    if likelihood is not None:
        pipeline_class, df = likelihood
        write_likelihood(pipeline_class.instance.records, df, staged / LIKELIHOOD_FILE)
    _record_output_dir(staged / "config.yaml", job.get("output_dir_label") or str(output_dir))
    target = output_dir / job["name"]
    publish(staged, target)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m evaluation.worker JOB.json", file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s - %(levelname)s - %(name)s - %(message)s"))
    ours = logging.getLogger("evaluation")  # kvpress's runner sets up its own logger
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    job = json.loads(Path(argv[0]).read_text())
    try:
        target = run_job(job)
    except BaseException:  # the sweep reads the traceback from this process's log
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    print(f"published {target}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
