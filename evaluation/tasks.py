"""Task lists of the benchmarks the aggregation lays out like the paper (RULER, LongBench by domain)."""

from kvpress_critical.data.ruler import RULER_TASKS

LONGBENCH_DOMAINS = {
    "Single-Doc QA": ["narrativeqa", "qasper", "multifieldqa_en"],
    "Multi-Doc QA": ["hotpotqa", "2wikimqa", "musique"],
    "Summarization": ["gov_report", "qmsum", "multi_news"],
    "Few-shot": ["trec", "triviaqa", "samsum"],
    "Synthetic": ["passage_count", "passage_retrieval_en"],
    "Code": ["lcc", "repobench-p"],
}
LONGBENCH_TASKS = [task for tasks in LONGBENCH_DOMAINS.values() for task in tasks]
RULER_ORDER = list(RULER_TASKS)  # kvpress's RULER tasks, in the paper's order
KEYS = ["model", "benchmark", "press", "compression_ratio"]  # what identifies a row of summary.csv


def task_order(tasks) -> list[str]:
    """Known task orders first (RULER, LongBench by domain), then the others alphabetically."""
    tasks = set(tasks)
    known = [t for t in RULER_ORDER + LONGBENCH_TASKS if t in tasks]
    return known + sorted(tasks - set(known))
