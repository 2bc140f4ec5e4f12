"""Run this project's transformers presses on prompts and write the entries they keep (a script, for kvpress's venv).

The plugin's environment has vLLM's transformers and no kvpress, so its selection test asks kvpress's environment,
through this script: ``press_reference.py JOB.json OUT.json`` reads ``{"model": path, "requests": [{"prompt_ids",
"press", "n_kept", options}]}`` and writes per request, per layer, the kept positions of each KV head, ascending. Each
layer keeps exactly ``n_kept`` entries per head (on average over the heads for the head-wise presses, AdaKV's budgets):
the plugin's block-aligned count, so that both select for the same budget. A request with ``compression_chunk_size``
runs ``ChunkedPrefillPress(press, chunk_size)`` instead, keeping after each chunk the count the plugin kept for the
tokens seen (``"kept_after": {seen: n_kept}``; everything after a chunk the plugin did not compact), and reports the
prompt positions each head keeps after the last chunk. A request with ``compression_interval`` is compressed while
decoding the engine's own tokens (``"tokens"``, fed one at a time after the prompt) by this project's
``DecodingCompressor`` on kvpress's ``DecodingPress`` schedule, keeping the plugin's counts (``"kept_at": {seen:
n_kept}``), after its prompt was compressed as above (``"kept_after"``, empty when the plugin left the prompt whole); it
reports the positions each head keeps after every compaction while decoding (``{seen: {layer: heads}}``)."""

import json
import os
import sys

import torch
from kvpress import AdaKVPress, BasePress, DecodingPress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import AutoModelForCausalLM, DynamicCache

from kvpress_critical import ChunkedPrefillPress, CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.decoding_compression import DecodingCompressor, decoding_compression
from kvpress_critical.presses.layer_input import LayerInput

BASES = {"snapkv": SnapKVPress, "knorm": KnormPress, "streaming_llm": StreamingLLMPress}


class KeepCapture(BasePress):
    """Records, at every layer's prefill, the positions ``press`` keeps for a budget of ``n_kept`` (cache untouched)."""

    def __init__(self, press, n_kept: int, prune: bool = False):
        self.press, self.n_kept, self.prune, self.kept = press, n_kept, prune, {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        # the one path by which this project's presses select for an explicit budget (kvpress's ScorerPress: its
        # scores and a per-head top-k; kvpress's AdaKVPress: its scorer's scores and AdaKV's budgets)
        layer = LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs)
        mask = keep_mask(self.press, layer, self.n_kept)
        self.kept[module.layer_idx] = [row.nonzero().flatten().tolist() for row in mask[0]]
        if self.prune:  # the same count in every head: the kept entries, in order
            shape = (*keys.shape[:2], self.n_kept, keys.shape[-1])
            return keys[mask].view(shape), values[mask].view(shape)
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


class ScheduledDecoding(DecodingPress):
    """kvpress's ``DecodingPress`` whose target after ``seen`` tokens is the plugin's block-aligned count there (an
    interval the plugin did not compact gets a target no layer exceeds)."""

    def __init__(self, press, interval: int, kept_at: dict[int, int]):
        super().__init__(
            base_press=press, compression_interval=interval, target_size=1, hidden_states_buffer_size=interval
        )
        self.kept_at = kept_at

    def _resolve_target_size(self, kwargs) -> int:
        return self.kept_at.get(int(kwargs["position_ids"][0, -1]) + 1, 2**31)


class RecordingDecoder(DecodingCompressor):
    """The decoding compressor, recording after every compaction the positions each layer's KV heads keep."""

    def __init__(self, schedule, model, positions: dict[int, torch.Tensor], n_prompt: int):
        super().__init__(schedule, model)
        self.positions = positions  # layer -> (H_kv, held) the positions the cache holds, ascending
        self.last = dict.fromkeys(positions, n_prompt)  # layer -> tokens seen at its last compaction (or the prompt)
        self.stages: dict[int, dict[int, list]] = {}

    def kept(self, module, kwargs, keep):
        idx, seen = module.layer_idx, int(kwargs["position_ids"][0, -1]) + 1
        fresh = torch.arange(self.last[idx], seen).expand(keep.shape[1], -1)
        held = torch.cat([self.positions[idx], fresh], dim=1)
        self.positions[idx] = held[keep[0]].view(keep.shape[1], -1)
        self.last[idx] = seen
        self.stages.setdefault(seen, {})[idx] = self.positions[idx].tolist()


def compressed_while_decoding(model, press, base, request) -> dict:
    """The positions each head keeps after every compaction while decoding the engine's tokens (module docstring)."""
    prompt = request["prompt_ids"]
    cache = DynamicCache()
    kept_after = {int(seen): kept for seen, kept in request["kept_after"].items()}
    if kept_after and request["compression_chunk_size"]:
        base.compression_ratio = request["compression_ratio"]
        chunked = ScheduledChunks(press, request["compression_chunk_size"], kept_after)
        with torch.no_grad(), chunked(model):
            model.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        positions = chunked.positions  # every chunk's, a last one that freed no block whole
    elif kept_after:
        (n_kept,) = kept_after.values()
        base.compression_ratio = 1 - (n_kept + 0.5) / len(prompt)  # as in main(): only StreamingLLM reads it
        capture = KeepCapture(press, n_kept, prune=True)
        with torch.no_grad(), capture(model):
            model.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        positions = {i: torch.tensor(heads) for i, heads in capture.kept.items()}
    else:
        with torch.no_grad():
            model.model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        heads = model.config.num_key_value_heads
        positions = {i: torch.arange(len(prompt)).expand(heads, -1) for i in range(model.config.num_hidden_layers)}
    assert all(positions[i].shape[1] == cache.layers[i].keys.shape[2] for i in positions), "positions out of step"
    kept_at = {int(seen): kept for seen, kept in request["kept_at"].items()}
    schedule = ScheduledDecoding(press, request["compression_interval"], kept_at)
    recorder = RecordingDecoder(schedule, model, positions, len(prompt))
    with torch.no_grad(), decoding_compression(model, schedule, recorder):
        for step, token in enumerate(request["tokens"]):
            position = len(prompt) + step
            model.model(
                input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=torch.tensor([[position]]),
                cache_position=torch.tensor([cache.get_seq_length()]), use_cache=True,
            )  # fmt: skip
    return recorder.stages


def base_press(name: str, options: dict):
    if name == "snapkv":
        return SnapKVPress(window_size=options["window_size"], kernel_size=options["kernel_size"])
    if name == "streaming_llm":
        return StreamingLLMPress(n_sink=options["n_sink"])
    return KnormPress()


def main():
    with open(sys.argv[1]) as handle:
        job = json.load(handle)
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
        if request.get("compression_interval"):
            results.append(compressed_while_decoding(model, press, base, request))
            continue
        if request.get("compression_chunk_size"):
            kept_after = {int(seen): kept for seen, kept in request["kept_after"].items()}
            chunked = ScheduledChunks(press, request["compression_chunk_size"], kept_after)
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
    with open(sys.argv[2] + ".tmp", "w") as handle:
        json.dump(results, handle)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])


if __name__ == "__main__":
    main()
