"""Perturbation analysis and fidelity of KV-cache presses (``python -m kvpress_critical.analysis``).

Measures, per layer and head, the attention-output perturbation ``||o - ô||_1`` a press causes for the
queries that follow a compressed context, CriticalKV's bound ``theta`` and the attention-only bound
``theta_prev`` of the kept set, Assumption 3.4 (``s >= 1/2`` after the first stage), and the end-to-end
next-token KL divergence and answer log-likelihood gap; then compares each base press with its CriticalKV
variant. See :mod:`kvpress_critical.analysis.runner` for the exact definitions.
"""

from kvpress_critical.analysis.presses import PressPair, press_pairs
from kvpress_critical.analysis.runner import PressResult, SampleResult, analyze, analyze_sample
from kvpress_critical.analysis.samples import Sample, load_rows, samples_from_rows

__all__ = [
    "PressPair",
    "PressResult",
    "Sample",
    "SampleResult",
    "analyze",
    "analyze_sample",
    "load_rows",
    "press_pairs",
    "samples_from_rows",
]
