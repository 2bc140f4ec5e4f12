"""Perturbation analysis on tiny config-built models: exactness at ratio 0, the bounds, fidelity, and that
the shared-prefill selections are those of kvpress's own ``with press(model)`` flow."""

import pytest
import torch
from helpers import kept_masks, prefill_keys, tiny_model
from kvpress import KnormPress, SnapKVPress

from kvpress_critical.analysis import Sample, analyze, press_pairs
from kvpress_critical.analysis.bounds import layer_reference, measure_selection, theta_bound, theta_prev_bound
from kvpress_critical.analysis.capture import prefill_with_presses
from kvpress_critical.analysis.presses import label
from kvpress_critical.analysis.summary import BOUND_RTOL, markdown_table, summarize, table_rows
from kvpress_critical.selection import compute_n_kept, first_stage_budget


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead, which several threads only increase."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def snapkv(ratio):
    return SnapKVPress(ratio, window_size=8)


def make_samples(n=2, context=96, question=6, answer=4, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            context_ids=torch.randint(0, vocab, (1, context), generator=g),
            question_ids=torch.randint(0, vocab, (1, question), generator=g),
            answer_ids=torch.randint(0, vocab, (1, answer), generator=g),
            name=f"random/{i}",
        )
        for i in range(n)
    ]


_RUNS = {}


def run(family="llama", ratios=(0.5,), base=snapkv, n=2, **model_kwargs):
    key = (family, tuple(ratios), base, n, tuple(sorted(model_kwargs.items())))
    if key not in _RUNS:
        pairs = press_pairs(base, ratios)
        _RUNS[key] = (analyze(tiny_model(family, **model_kwargs), make_samples(n), pairs, progress=False), pairs)
    return _RUNS[key]


def test_ratio_zero_is_exactly_unperturbed():
    results, pairs = run(ratios=(0.0,))
    assert len(results[0].presses) == 4
    for result in results:
        for name, press in result.presses.items():
            assert press.kept_fraction == 1.0, name
            assert torch.equal(press.actual, torch.zeros_like(press.actual)), name
            assert torch.equal(press.end_to_end, torch.zeros_like(press.end_to_end)), name
            assert torch.equal(press.fidelity.kl, torch.zeros_like(press.fidelity.kl)), name
            assert press.fidelity.loglik_gap == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma3"])
def test_actual_perturbation_is_bounded_by_theta_for_every_head(family):
    results, _ = run(family, ratios=(0.5, 0.8))
    n_half = 0
    for result in results:
        assert result.reference_error < 1e-5  # the recomputed full-cache head outputs are the model's
        for name, press in result.presses.items():
            assert press.actual.shape == (2, 4, 10)  # layers, query heads, post-context tokens
            assert press.actual.max() > 0, name
            assert bool((press.actual <= press.theta * (1 + BOUND_RTOL) + 1e-9).all()), name
            half = press.retained >= 0.5
            n_half += int(half.sum())
            assert bool((press.theta[half] <= press.theta_prev[half] * (1 + BOUND_RTOL) + 1e-9).all()), name
    assert n_half > 0  # the implication was exercised


def test_kl_grows_with_the_ratio_on_average():
    ratios = (0.2, 0.5, 0.8)
    results, pairs = run(ratios=ratios, n=3)
    mean_kl = []
    for ratio in ratios:
        names = [name for p in pairs if p.ratio == ratio for name in p.labelled()]
        kl = torch.cat([r.presses[name].fidelity.kl for r in results for name in names])
        assert bool((kl >= 0).all())
        mean_kl.append(float(kl.mean()))
    assert mean_kl[0] > 0
    assert mean_kl == sorted(mean_kl) and len(set(mean_kl)) == 3, mean_kl


def test_local_and_end_to_end_agree_where_inputs_coincide():
    """Layer 0 sees the same inputs with and without compression: local == end-to-end perturbation."""
    results, _ = run(ratios=(0.5, 0.8))
    for result in results:
        for name, press in result.presses.items():
            torch.testing.assert_close(press.actual[0], press.end_to_end[0], rtol=1e-4, atol=1e-6, msg=name)
            assert not torch.allclose(press.actual[1:], press.end_to_end[1:]), name  # errors propagate later


def test_shared_prefill_selects_what_kvpress_keeps():
    model = tiny_model("llama")
    ids = make_samples(1, context=80)[0].context_ids
    pairs = press_pairs(snapkv, [0.6]) + press_pairs(lambda r: KnormPress(r), [0.3], modes=("kv",))
    presses = {name: press for pair in pairs for name, press in pair.labelled().items()}
    _, selections = prefill_with_presses(model, ids, presses)
    for name, press in presses.items():
        expected = kept_masks(model, ids, press)
        cache_keys = prefill_keys(model, ids, press)
        for layer, (selection, mask, keys) in enumerate(zip(selections[name].layers, expected, cache_keys)):
            assert torch.equal(selection.keep, mask[0]), (name, layer)
            assert torch.equal(selection.keys, keys), (name, layer)  # same compressed cache as kvpress's flow


def test_first_stage_sets():
    model = tiny_model("llama")
    ids = make_samples(1, context=80)[0].context_ids
    presses = {name: press for pair in press_pairs(snapkv, [0.6]) for name, press in pair.labelled().items()}
    _, selections = prefill_with_presses(model, ids, presses)
    n_first = first_stage_budget(compute_n_kept(80, 0.6), 0.5)
    for layer in selections[label("CriticalKV(SnapKV)", 0.6)].layers:
        assert bool((layer.stage1 <= layer.keep).all())
        assert layer.stage1.sum(-1).tolist() == [n_first] * layer.keep.shape[0]
    for layer in selections[label("CriticalAdaKV(SnapKV)", 0.6)].layers:
        assert layer.stage1 is not None and bool((layer.stage1 <= layer.keep).all())
        assert 0 < int(layer.stage1.sum()) < int(layer.keep.sum())
    assert all(layer.stage1 is None for layer in selections[label("SnapKV", 0.6)].layers)


def test_measures_match_a_direct_computation():
    """Against an independent per-head computation: gather the kept entries, softmax, project."""
    torch.manual_seed(0)
    num_heads, num_kv, d, hidden, n_context, n_queries = 4, 2, 8, 12, 20, 3
    query = torch.randn(num_heads, n_queries, d)
    keys, values = torch.randn(num_kv, n_context + n_queries, d), torch.randn(num_kv, n_context + n_queries, d)
    weight = torch.randn(hidden, num_heads * d)
    keep = torch.rand(num_kv, n_context) < 0.5
    ref = layer_reference(query, keys, values, weight, n_context, scaling=d**-0.5)
    measure = measure_selection(ref, keep)
    for h in range(num_heads):
        g = h // (num_heads // num_kv)
        w = weight[:, h * d : (h + 1) * d].T.double()
        proj = values[g].double() @ w  # (T, D)
        norms = proj.abs().sum(-1)
        for q in range(n_queries):
            n_seen = n_context + q + 1
            logits = (keys[g, :n_seen].double() @ query[h, q].double()) * d**-0.5
            attention = logits.softmax(-1)
            kept = torch.cat([keep[g], torch.ones(n_queries, dtype=torch.bool)])[:n_seen]
            compressed = logits[kept].softmax(-1)
            actual = (attention @ proj[:n_seen] - compressed @ proj[:n_seen][kept]).abs().sum()
            s = attention[kept].sum()
            c, x = (attention * norms[:n_seen]).sum(), (attention * norms[:n_seen])[~kept].sum()
            torch.testing.assert_close(measure.actual[h, q], actual, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(measure.retained[h, q], s)
            torch.testing.assert_close(measure.theta[h, q], theta_bound(s, c, x), rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(
                measure.theta_prev[h, q], theta_prev_bound(s, norms[:n_seen].max()), rtol=1e-5, atol=1e-9
            )


def test_summary_table_and_comparisons():
    results, pairs = run(ratios=(0.5, 0.8))
    summary = summarize(results, pairs, {"model": "tiny"})
    assert set(summary["presses"]) == {name for p in pairs for name in p.labelled()}
    for press in summary["presses"].values():
        assert press["bound_check"]["actual_above_theta"] == 0
        assert press["bound_check"]["theta_above_theta_prev_when_s_at_least_half"] == 0
        assert len(press["per_layer_first_token"]["actual"]) == 2
        assert (press["assumption_3_4"] is not None) == (press["role"] == "critical")
    for pair in summary["pairs"]:
        first = pair["first_token"]
        assert 0 <= first["heads_improved"] + first["heads_worse"] <= 1
        assert len(first["per_layer_heads_improved"]) == 2
    assert 0 <= summary["overall_heads_improved_first_token"]["all"] <= 1
    rows = table_rows(summary)
    assert [r["cache_size"] for r in rows] == [0.2] * 4 + [0.5] * 4
    assert all(r["actual"] <= r["theta"] for r in rows)
    assert markdown_table(summary).count("\n") == 2 + len(rows)


def test_run_folder_is_atomic_and_never_overwrites(tmp_path):
    from kvpress_critical.analysis.output import RunFolder

    with RunFolder(tmp_path, "run") as run:
        (run.tmp / "a.txt").write_text("1")
        assert not (tmp_path / "run").exists()  # nothing visible before the end
    assert run.path == tmp_path / "run" and (run.path / "a.txt").read_text() == "1"
    with RunFolder(tmp_path, "run") as again:
        (again.tmp / "a.txt").write_text("2")
    assert again.path == tmp_path / "run-1" and (run.path / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError):
        with RunFolder(tmp_path, "run") as failed:
            (failed.tmp / "a.txt").write_text("3")
            raise RuntimeError("interrupted")
    assert failed.path is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-1"]
