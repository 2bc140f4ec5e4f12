"""The prompt positions each KV head keeps, recorded for requests that ask for it (``record_selections``): after a
request's last compaction (what the exactness tests compare with kvpress's presses) and after each of its
compactions (what the chunked schedules are checked against). Read once by the engine's caller, then forgotten."""

from __future__ import annotations

from typing import Any

import torch

from kvpress_critical_vllm.budget import Eviction


class SelectionRecords:
    """One worker's recorded selections, ``{request_id: {layer_name: [kept positions of each KV head]}}``."""

    def __init__(self) -> None:
        self.selections: dict[str, dict[str, list[torch.Tensor]]] = {}  # after the request's last compaction
        self.stage_selections: dict[str, list[tuple[int, dict]]] = {}  # after each one: (tokens seen, kept)

    def record(self, request_id: str, evict: Eviction, kept: dict[str, torch.Tensor]) -> None:
        """A compaction of ``request_id`` keeping ``kept`` (``{layer: (H_kv, held) bool}`` over the positions it held):
        the prompt positions each head keeps are what it held (the earlier compactions' kept positions, then the
        positions after them) filtered by this compaction's mask."""
        earlier = self.selections.get(request_id, {}) if evict.start else {}
        stages = self.stage_selections.setdefault(request_id, []) if evict.start else []
        self.stage_selections[request_id] = stages
        chosen = {}
        for name, mask in kept.items():
            heads = []
            for h in range(mask.shape[0]):
                before = earlier[name][h] if name in earlier else torch.arange(0)
                held = torch.cat([before, torch.arange(evict.start + before.numel(), evict.seen)])
                heads.append(held[mask[h].nonzero().flatten().cpu()])
            chosen[name] = heads
        self.selections[request_id] = chosen
        stages.append((evict.seen, chosen))

    def take_selections(self) -> dict[str, dict[str, Any]]:
        """The recorded selections (``{request_id: {layer_name: [prompt positions each KV head keeps]}}``, after the
        request's last compaction), then forgotten."""
        selections, self.selections = self.selections, {}
        return {
            rid: {name: [positions.tolist() for positions in heads] for name, heads in layers.items()}
            for rid, layers in selections.items()
        }

    def take_stage_selections(self) -> dict[str, list[dict[str, Any]]]:
        """The recorded selections after each compaction of every request (several with ``compression_chunk_size``:
        (``{request_id: [{"seen": tokens, "kept": {layer_name: [positions of each KV head]}}, ...]}``), then
        forgotten."""
        stages, self.stage_selections = self.stage_selections, {}
        return {
            rid: [
                {"seen": seen, "kept": {name: [p.tolist() for p in heads] for name, heads in layers.items()}}
                for seen, layers in entries
            ]
            for rid, entries in stages.items()
        }
