"""The analysis loop: for every context, one full-cache run and one run per press, then the measures.

Definitions (see also :mod:`kvpress_critical.analysis.bounds`):

- The context is prefilled once; every press compresses that same prefill (context-only compression,
  the question is never seen). The post-context tokens (question, template suffix, answer prefix, then
  the teacher-forced answer) are run once on the full cache and once on each compressed cache.
- **Local perturbation** (``actual``, with ``theta``, ``theta_prev``, ``retained``, ``retained_stage1``):
  per layer, query head and post-context token, the queries, keys and values are those of the
  *full-cache* run, and ``ô`` is the attention of that same query over the entries the press kept. It
  isolates each layer's selection (no error carried from earlier layers) and is the quantity the
  paper's bound is about: ``actual <= theta`` holds exactly.
- **End-to-end perturbation** (``end_to_end``): the same head outputs (after the head's slice of
  ``o_proj``) taken from the compressed run itself, where earlier layers' errors propagate.
- **Fidelity**: next-token KL and answer log-likelihood over the teacher-forced answer tokens.
- The *first decoded token* is the first answer token fed to the model (its query attends to the whole
  cache, like the first decoding step of kvpress's pipeline).
"""

from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from kvpress_critical.analysis.bounds import layer_reference, measure_selection, project_heads
from kvpress_critical.analysis.capture import (
    cache_from_layers,
    capture_attention,
    forward_with_cache,
    prefill_with_presses,
)
from kvpress_critical.analysis.fidelity import Fidelity, next_token_fidelity
from kvpress_critical.analysis.presses import PressPair
from kvpress_critical.analysis.samples import Sample
from kvpress_critical.modeling import attention_modules, dense_linear_weight, get_o_proj

__all__ = ["PressResult", "SampleResult", "analyze", "analyze_sample"]


@dataclass
class PressResult:
    """
    One press on one sample. Measures are ``(n_layers, H, L)`` float64 over layers, query heads and
    post-context tokens (``L = Q + A``).
    """

    actual: torch.Tensor
    theta: torch.Tensor
    theta_prev: torch.Tensor
    retained: torch.Tensor
    retained_stage1: torch.Tensor | None
    end_to_end: torch.Tensor
    fidelity: Fidelity
    kept_fraction: float


@dataclass
class SampleResult:
    """All presses on one sample."""

    name: str
    n_context: int
    first: int  # index of the first decoded (first answer) token among the post-context tokens
    presses: dict[str, PressResult] = field(default_factory=dict)
    reference_error: float = 0.0  # max |model head output - recomputed full-cache head output|


@torch.no_grad()
def _greedy_answer(model, context_layers, question_ids, n_context: int, max_new_tokens: int) -> torch.Tensor:
    """Greedy full-cache answer (used when a sample has no reference answer)."""
    cache = cache_from_layers(context_layers)
    ids, generated = question_ids, []
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    position = n_context
    for _ in range(max_new_tokens):
        logits = forward_with_cache(model, ids, cache, position)
        position += ids.shape[1]
        token = int(logits[-1].argmax())
        generated.append(token)
        if token in eos:
            break
        ids = torch.tensor([[token]], device=question_ids.device)
    return torch.tensor([generated], device=question_ids.device)


@torch.no_grad()
def analyze_sample(
    model: nn.Module,
    sample: Sample,
    presses: dict,
    max_new_tokens: int = 16,
    progress: tqdm | None = None,
) -> SampleResult:
    """
    Measure every press of ``presses`` (``label -> press``) on one sample.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM with a non-eager attention implementation (kvpress masks keys through it).
    sample : Sample
        Context, question and (optional) reference answer.
    presses : dict
        ``label -> kvpress press``.
    max_new_tokens : int
        Length of the greedy full-cache answer used when the sample has none.
    progress : tqdm, optional
        Advanced by one after the prefill and after each press.
    """
    device = model.device
    context_ids = sample.context_ids.to(device)
    n_context = context_ids.shape[1]
    full_cache, selections = prefill_with_presses(model, context_ids, presses)
    context_layers = [(layer.keys, layer.values) for layer in full_cache.layers]
    answer_ids = sample.answer_ids
    if answer_ids is None or answer_ids.numel() == 0:
        answer_ids = _greedy_answer(model, context_layers, sample.question_ids.to(device), n_context, max_new_tokens)
    answer_ids = answer_ids.to(device)
    post_ids = torch.cat([sample.question_ids.to(device), answer_ids], dim=1)
    first = sample.question_ids.shape[1]
    with capture_attention(model, inputs=True) as full_records:
        full_logits = forward_with_cache(model, post_ids, full_cache, n_context)
    if progress is not None:
        progress.update()

    compressed = {}
    for name, selection in selections.items():
        masked = [layer.masked_key_indices for layer in selection.layers]
        with capture_attention(model, inputs=False) as records:
            logits = forward_with_cache(model, post_ids, selection.cache(), n_context, masked)
        compressed[name] = (logits, records)
        if progress is not None:
            progress.update()

    result = SampleResult(name=sample.name, n_context=n_context, first=first)
    per_press = {
        name: {k: [] for k in ("actual", "theta", "theta_prev", "retained", "stage1", "e2e")} for name in presses
    }
    for idx, module in enumerate(attention_modules(model)):
        record = full_records[idx]
        weight = dense_linear_weight(get_o_proj(module), owner=module).float()
        ref = layer_reference(
            record.query, record.keys, record.values, weight, n_context, record.scaling, record.softcap
        )
        model_output = record.output.transpose(0, 1).double()  # (H, L, d)
        result.reference_error = max(result.reference_error, float((ref.output - model_output).abs().max()))
        for name, selection in selections.items():
            layer = selection.layers[idx]
            measure = measure_selection(ref, layer.keep, layer.stage1)
            out = per_press[name]
            out["actual"].append(measure.actual)
            out["theta"].append(measure.theta)
            out["theta_prev"].append(measure.theta_prev)
            out["retained"].append(measure.retained)
            out["stage1"].append(measure.retained_stage1)
            comp_output = compressed[name][1][idx].output.transpose(0, 1)
            out["e2e"].append(project_heads(ref, model_output - comp_output.double()))

    for name, selection in selections.items():
        out = per_press[name]
        stage1 = out["stage1"]
        kept = sum(int(layer.keep.sum()) for layer in selection.layers)
        total = sum(layer.keep.numel() for layer in selection.layers)
        fidelity = next_token_fidelity(full_logits, compressed[name][0], answer_ids[0], first)
        result.presses[name] = PressResult(
            actual=torch.stack(out["actual"]).cpu(),
            theta=torch.stack(out["theta"]).cpu(),
            theta_prev=torch.stack(out["theta_prev"]).cpu(),
            retained=torch.stack(out["retained"]).cpu(),
            retained_stage1=None if any(s is None for s in stage1) else torch.stack(stage1).cpu(),
            end_to_end=torch.stack(out["e2e"]).cpu(),
            fidelity=Fidelity(**{k: v.cpu() for k, v in vars(fidelity).items()}),
            kept_fraction=kept / total,
        )
    return result


def analyze(
    model: nn.Module,
    samples: list[Sample],
    pairs: list[PressPair],
    max_new_tokens: int = 16,
    progress: bool = True,
) -> list[SampleResult]:
    """
    Run :func:`analyze_sample` for every sample on every press of ``pairs``, with a progress bar.

    Returns one :class:`SampleResult` per sample; press results are keyed by
    :meth:`PressPair.labelled` labels (``"<press name>@<ratio>"``).
    """
    presses = {}
    for pair in pairs:
        presses.update(pair.labelled())
    results = []
    with tqdm(total=len(samples) * (len(presses) + 1), desc="perturbation analysis", disable=not progress) as bar:
        for sample in samples:
            bar.set_postfix_str(sample.name)
            results.append(analyze_sample(model, sample, presses, max_new_tokens=max_new_tokens, progress=bar))
    return results
