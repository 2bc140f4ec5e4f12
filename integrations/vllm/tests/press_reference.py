"""Run this project's transformers presses on prompts and print the entries they keep (a script, for kvpress's venv).

The plugin's environment has vLLM's transformers and no kvpress, so its selection test asks kvpress's environment,
through this script: JSON on stdin (``{"model": path, "requests": [{"prompt_ids", "press", "n_kept", options}]}``),
JSON on stdout (per request, per layer, the kept positions of each KV head, ascending). Each layer keeps exactly
``n_kept`` entries per head (on average over the heads for the head-wise presses, AdaKV's budgets): the plugin's
block-aligned count, so that both select for the same budget. A request with ``chunk_size`` runs
``ChunkedPrefillPress(press, chunk_size)`` instead, keeping after each chunk the count the plugin kept for the tokens
seen (``"kept_after": {seen: n_kept}``; everything after a chunk the plugin did not compact), and reports the prompt
positions each head keeps after the last chunk.
"""

import json
import sys

import torch
from kvpress import AdaKVPress, BasePress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM

from kvpress_critical import ChunkedPrefillPress, CriticalAdaKVPress, CriticalKVPress
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


class ScheduledChunks(ChunkedPrefillPress):
    """``ChunkedPrefillPress`` keeping the plugin's block-aligned counts, recording the prompt positions it keeps."""

    def __init__(self, press, chunk_size: int, kept_after: dict[int, int]):
        super().__init__(press=press, chunk_size=chunk_size)
        self.kept_after, self.positions = kept_after, {}

    def budget(self, seen: int) -> int:
        return self.kept_after.get(seen, seen)  # a count not smaller than what the layer holds keeps everything

    def _after_layer(self, module, args, kwargs, output):
        output = super()._after_layer(module, args, kwargs, output)
        if self.chunk is not None:
            start, seen = self.chunk
            idx = module.layer_idx
            keep = self._norms[idx].keep[0]  # (H_kv, held): what this chunk's compression kept of what was held
            fresh = torch.arange(start, seen).expand(keep.shape[0], -1)
            held = torch.cat([self.positions[idx], fresh], dim=1) if idx in self.positions else fresh
            self.positions[idx] = held[keep].view(keep.shape[0], -1)
        return output


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
        if request.get("chunk_size"):
            kept_after = {int(seen): kept for seen, kept in request["kept_after"].items()}
            chunked = ScheduledChunks(press, request["chunk_size"], kept_after)
            base.compression_ratio = request["compression_ratio"]
            with torch.no_grad(), chunked(model):
                model.model(input_ids=torch.tensor([request["prompt_ids"]]))
            results.append({idx: rows.tolist() for idx, rows in chunked.positions.items()})
            continue
        # only StreamingLLM reads its ratio (for its pruned count): int(N * (1 - ratio)) == n_kept exactly
        base.compression_ratio = 1 - (request["n_kept"] + 0.5) / n_prompt
        capture = KeepCapture(press, request["n_kept"])
        with torch.no_grad(), capture(model):
            model.model(input_ids=torch.tensor([request["prompt_ids"]]))
        results.append(capture.kept)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
