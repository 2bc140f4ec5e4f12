"""Run this project's transformers presses on prompts and print the entries they keep (a script, for kvpress's venv).

The plugin's environment has vLLM's transformers and no kvpress, so its selection test asks kvpress's environment,
through this script: JSON on stdin (``{"model": path, "requests": [{"prompt_ids", "press", "n_kept", options}]}``),
JSON on stdout (per request, per layer, the kept positions of each KV head, ascending). Each layer keeps exactly
``n_kept`` entries per head (on average over the heads for the head-wise presses, AdaKV's budgets): the plugin's
block-aligned count, so that both select for the same budget.
"""

import json
import sys

import torch
from kvpress import AdaKVPress, BasePress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM

from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.layer_input import LayerInput

BASES = {"snapkv": SnapKVPress, "knorm": KnormPress, "streaming_llm": StreamingLLMPress}


class KeepCapture(BasePress):
    """Records, at every layer's prefill, the positions ``press`` keeps for a budget of ``n_kept`` (cache untouched)."""

    def __init__(self, press, n_kept: int):
        self.press, self.n_kept, self.kept = press, n_kept, {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        # the one path by which this project's presses select for an explicit budget (kvpress's ScorerPress: its
        # scores and a per-head top-k; kvpress's AdaKVPress: its scorer's scores and AdaKV's budgets)
        layer = LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs)
        mask = keep_mask(self.press, layer, self.n_kept)
        self.kept[module.layer_idx] = [row.nonzero().flatten().tolist() for row in mask[0]]
        return keys, values


def base_press(name: str, options: dict):
    if name == "snapkv":
        return SnapKVPress(window_size=options["window_size"], kernel_size=options["kernel_size"])
    if name == "streaming_llm":
        return StreamingLLMPress(n_sink=options["n_sink"])
    return KnormPress()


def main():
    job = json.load(sys.stdin)
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa").eval()
    results = []
    for request in job["requests"]:
        name = request["press"]
        critical, head_wise = name.startswith("critical_"), "adakv_" in name
        base = base_press(name.removeprefix("critical_").removeprefix("adakv_"), request)
        stages = dict(first_stage_ratio=request["first_stage_ratio"], epsilon=request["epsilon"])
        if head_wise and critical:
            press = CriticalAdaKVPress(base, alpha_safeguard=request["alpha_safeguard"], **stages)
        elif head_wise:
            press = AdaKVPress(base, alpha_safeguard=request["alpha_safeguard"])
        else:
            press = CriticalKVPress(base, **stages) if critical else base
        n_prompt = len(request["prompt_ids"])
        # only StreamingLLM reads its ratio (for its pruned count): int(N * (1 - ratio)) == n_kept exactly
        base.compression_ratio = 1 - (request["n_kept"] + 0.5) / n_prompt
        capture = KeepCapture(press, request["n_kept"])
        with torch.no_grad(), capture(model):
            model.model(input_ids=torch.tensor([request["prompt_ids"]]))
        results.append(capture.kept)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
