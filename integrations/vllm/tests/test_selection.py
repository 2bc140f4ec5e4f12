"""The plugin keeps the entries this project's transformers presses keep, on the same prompt and parameters.

The uniform rows of the mixed batch, against the presses run in kvpress's environment for the plugin's block-aligned
budget (``selections.py``). The engine computes its keys, values and queries with vLLM's kernels and transformers
with its own, so float32 rounding may swap near-tied entries (key norms tie more often than attention scores): the
test requires at least 99.9 % of the kept entries to be the same for every press and prints how many (layer, head)
selections are identical (the selection functions themselves equal kvpress's presses bitwise on the same tensors:
tests/selection/test_scorers.py in the main suite).
"""

import pytest
from conftest import results_of
from selections import compare_results


@pytest.mark.slow  # the transformers presses run in kvpress's environment: the complete tier
def test_plugin_keeps_what_the_transformers_presses_keep(mixed_batch, reference_selections):
    report, agreement = compare_results(results_of(mixed_batch, "uniform"), reference_selections)
    print("plugin vs transformers presses:", "; ".join(report))
    assert all(value >= 0.999 for value in agreement.values()), report
