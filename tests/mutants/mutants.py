"""Deliberate one-line bugs, each a change the tests of its module must catch (``make mutants``, not part of CI).

Each mutant replaces one line (``before``, found exactly once in ``path``) with ``after``: an off-by-one in the
evicted blocks, a freed block still read, a wrong group index in a kernel, and so on. ``run_mutants.py`` applies each
one to a copy of the repository at a revision, runs the tests of its module there (``tests``: the test files, which
exist under these names in the revisions the table compares; a file a revision lacks is skipped there) and restores
it. A mutant the tests do not catch is a behaviour no test checks.
"""

from __future__ import annotations

from dataclasses import dataclass

PLUGIN = "integrations/vllm/kvpress_critical_vllm"
PLUGIN_TESTS = "integrations/vllm/tests"


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # planner, scheduler, worker, layouts, ops, selection
    path: str
    before: str
    after: str
    what: str
    tests: tuple[str, ...]  # test files, relative to the repository root

    @property
    def plugin(self) -> bool:
        return any(test.startswith(PLUGIN_TESTS) for test in self.tests)


def plugin_tests(*names: str) -> tuple[str, ...]:
    return tuple(f"{PLUGIN_TESTS}/test_{name}.py" for name in names)


# fmt: off
MUTANTS = (
    Mutant(
        "planner-evicts-a-block-too-many", "planner", f"{PLUGIN}/budget.py",
        "    return max(0, (seen - start - budget) // block_size * block_size)",
        "    return max(0, (seen - start - budget + block_size - 1) // block_size * block_size)",
        "the evicted positions rounded up to whole blocks: a head keeps fewer entries than its budget",
        plugin_tests("units", "exactness", "blocks"),
    ),
    Mutant(
        "planner-drops-the-last-chunk", "planner", f"{PLUGIN}/budget.py",
        "        del ends[-2]",
        "        del ends[-1]",
        "a last chunk shorter than SnapKV's window is dropped instead of merged: the prompt's end is never a "
        "compaction point",
        plugin_tests("units", "chunked"),
    ),
    Mutant(
        "planner-admits-without-the-tail", "planner", f"{PLUGIN}/budget.py",
        "    return max(peak, blocks_for(n_tokens, block_size) - evicted // block_size)",
        "    return peak",
        "admission counts the chunks' peaks but not what a request holds after its last compaction",
        plugin_tests("units", "chunked", "decoding"),
    ),
    Mutant(
        "scheduler-frees-a-block-still-read", "scheduler", f"{PLUGIN}/vllm_compat.py",
        "first_token // manager.block_size, end_token // manager.block_size)",
        "first_token // manager.block_size, end_token // manager.block_size + 1)",
        "a confirmed compaction frees one block past its evicted positions: the request still reads it",
        plugin_tests("blocks", "exactness", "head_wise", "chunked", "decoding"),
    ),
    Mutant(
        "scheduler-step-runs-past-a-compaction", "scheduler", f"{PLUGIN}/scheduler.py",
        "            num_new_tokens = stop - num_computed_tokens",
        "            num_new_tokens = stop - num_computed_tokens + 1",
        "a step's tokens of a request run one past its next compaction point",
        plugin_tests("chunked", "decoding", "engine_features"),
    ),
    Mutant(
        "scheduler-no-window-lookahead", "scheduler", f"{PLUGIN}/scheduler.py",
        "            plan = tracked.schedule.stage(tracked.directed, end + window)",
        "            plan = tracked.schedule.stage(tracked.directed, end)",
        "no step before a compaction saves its window queries: a prompt whose last step is shorter than SnapKV's "
        "window is scored with fewer queries",
        plugin_tests("selection", "engine_features", "head_wise", "chunked"),
    ),
    Mutant(
        "worker-writes-after-a-failed-selection", "worker", f"{PLUGIN}/compaction.py",
        "            if fail:",
        "            if fail and kept is not None:",
        "a request whose selection failed on this rank is written anyway",
        plugin_tests("fail_closed"),
    ),
    Mutant(
        "worker-reads-a-freed-block", "worker", f"{PLUGIN}/step_plan.py",
        "            shift[row] = shifts[request_id]",
        "            shift[row] = max(0, shifts[request_id] - block_size)",
        "a compacted row's view starts one block early: it attends over an evicted block",
        plugin_tests("exactness", "blocks", "chunked", "decoding"),
    ),
    Mutant(
        "worker-keeps-a-resumed-request", "worker", f"{PLUGIN}/vllm_compat.py",
        "    gone.update(scheduler_output.scheduled_cached_reqs.resumed_req_ids)",
        "    gone.update(())",
        "a preempted request that resumes keeps its old shift while it is recomputed from its first token",
        plugin_tests("engine_features", "head_wise", "chunked", "decoding", "preemption"),
    ),
    Mutant(
        "worker-head-wise-counts-with-the-tail", "worker", f"{PLUGIN}/worker_state.py",
        "HeadWise(evict.evicted, evict.seen - pinned, (counts - pinned).cpu())",
        "HeadWise(evict.evicted, evict.seen - pinned, counts.cpu())",
        "a head-wise region's lengths count the pinned tail too: the kernel reads past each head's entries",
        plugin_tests("head_wise"),
    ),
    Mutant(
        "worker-saves-the-first-queries", "worker", f"{PLUGIN}/worker_state.py",
        "            earlier[layer_name] = chunk[-save.window :].clone()",
        "            earlier[layer_name] = chunk[: save.window].clone()",
        "an earlier step's saved window queries are its first, not its last",
        plugin_tests("selection", "engine_features", "head_wise", "chunked"),
    ),
    Mutant(
        "prefix-cache-keeps-a-rewritten-hash", "scheduler", f"{PLUGIN}/prefix_cache.py",
        "        self.metrics.unhashed(unhash_blocks(scheduler, request_id, first, end, group, skip=skip))",
        "        self.metrics.unhashed(0)",
        "a hash left on a rewritten block: a later request with the same prefix is served the compacted entries",
        plugin_tests("prefix_cache"),
    ),
    Mutant(
        "prefix-cache-writes-a-kept-prefix-in-place", "scheduler", f"{PLUGIN}/prefix_cache.py",
        "                if index < protected_end or block.ref_cnt > 1 or self.prefixes.holds(block)",
        "                if index < protected_end or block.ref_cnt > 1",
        "a kept compressed prefix held by one request is written in place by its next compaction: the prefix is lost "
        "(or, were its hash kept, served rewritten)",
        plugin_tests("prefix_cache"),
    ),
    Mutant(
        "scheduler-frees-a-sliding-window-groups-blocks", "scheduler", f"{PLUGIN}/scheduler.py",
        "        remove_blocks(self, request.request_id, plan.start, plan.evicted, self.kvpress_group)",
        "        remove_blocks(self, request.request_id, plan.start, plan.evicted, 0)",
        "a hybrid model's compaction frees blocks of the first KV-cache group (sliding-window layers) instead of the "
        "full-attention group's: the compacted entries stay allocated, the window loses blocks it still reads",
        plugin_tests("hybrid"),
    ),
    Mutant(
        "head-wise-attention-drops-the-sinks", "worker", f"{PLUGIN}/head_wise_attention.py",
        "        terms[\"sinks\"] = sinks",
        "        pass",
        "gpt-oss's attention sinks are left out of the head-wise rows' softmax: their attention is a plain softmax "
        "(the uniform rows, vLLM's, keep them)",
        plugin_tests("units", "models"),
    ),
    Mutant(
        "kv-spec-counts-no-linear-attention-state", "scheduler", f"{PLUGIN}/vllm_compat.py",
        "        return spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes",
        "        return 0",
        "admission counts no block for a linear-attention layer's recurrent state beside the compressed group",
        plugin_tests("units"),
    ),
    Mutant(
        "layouts-tail-offsets-wrong-head-stride", "layouts", f"{PLUGIN}/layouts.py",
        "        heads = torch.arange(num_kv_heads, device=kv_cache.device)[:, None, None] * block_size * width",
        "        heads = torch.arange(num_kv_heads, device=kv_cache.device)[:, None, None] * block_size * width // 2",
        "the tail of a head-wise row is read at the wrong offset for every KV head but the first",
        plugin_tests("units", "head_wise"),
    ),
    Mutant(
        "ops-ragged-wrong-group-index", "ops", "csrc/ragged_attention.cpp",
        "        const scalar_t* src = q + b * query.stride(0) + (kv * group + g) * query.stride(1) + i * query.stride(2);",  # noqa: E501
        "        const scalar_t* src = q + b * query.stride(0) + (kv * group + group - 1 - g) * query.stride(1) + i * query.stride(2);",  # noqa: E501
        "the C++ kernels load a KV head's query heads in reverse order (a wrong group index)",
        ("tests/ops/test_ragged_attention.py", "tests/ops/test_paged_ragged_attention.py"),
    ),
    Mutant(
        "ops-paged-tail-block-off-by-one", "ops", "csrc/ragged_attention.cpp",
        "        const int64_t block = tt[b * tail_table.size(1) + t / block_size];",
        "        const int64_t block = tt[b * tail_table.size(1) + (t > 0 ? t - 1 : 0) / block_size];",
        "the C++ paged kernel reads the first entry of each tail block from the block before",
        ("tests/ops/test_paged_ragged_attention.py",),
    ),
    Mutant(
        "ops-bf16-odd-channel", "ops", "csrc/projected_norm.cpp",
        "      row[j] = bf16_bits(e) | (odd ? 0u : bf16_bits(e + s_d) << 16);",
        "      row[j] = bf16_bits(e) | (odd ? 0u : bf16_bits(e) << 16);",
        "the bf16 projected-norm kernel packs each even channel of the values twice",
        ("tests/ops/test_projected_value_norm.py", "tests/ops/test_extension.py"),
    ),
    Mutant(
        "selection-first-stage-one-more", "selection", "kvpress_critical/selection/criticalkv.py",
        "    n_first = int(n_kept * first_stage_ratio)",
        "    n_first = int(n_kept * first_stage_ratio) + 1",
        "CriticalKV's first stage keeps one entry more than the paper's floor(ratio * budget)",
        ("tests/selection/test_selection.py", "tests/presses/test_equivalence_kvpress.py",
         "tests/presses/test_model_matrix.py"),
    ),
    Mutant(
        "fp8-scores-codes-without-their-scales", "worker", f"{PLUGIN}/kv_codes.py",
        "        keys = self.codes(keys).float().mul_(self.k_scale).to(dtype)",
        "        keys = self.codes(keys).float().to(dtype)",
        "an fp8 cache's keys are scored as their codes, without the layer's k_scale: SnapKV's softmax sees other "
        "scores and the selection is not the rule's on the cached entries",
        plugin_tests("fp8_units"),
    ),
    Mutant(
        "fp8-compaction-requantizes-the-kept-entries", "layouts", f"{PLUGIN}/layouts.py",
        "        flat[(*index, key_offsets)] = keys.to(flat.dtype)",
        "        flat[(*index, key_offsets)] = keys.to(torch.float8_e5m2).view(torch.uint8) "
        "if flat.dtype == torch.uint8 else keys.to(flat.dtype)",
        "a compaction writes the kept keys of an fp8 cache re-encoded in another fp8 format instead of moving their "
        "bytes",
        plugin_tests("fp8_units"),
    ),
    Mutant(
        "ops-fp8-e4m3-exponent-misplaced", "ops", "csrc/cpu_attention_kernel.inc",
        " " * 43 + "_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7))",
        " " * 43 + "_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 6))",
        "the AVX-512 micro-kernels read an e4m3 code's exponent and mantissa one bit too low",
        ("tests/ops/test_paged_ragged_attention.py",),
    ),
    Mutant(
        "selection-window-sees-itself-late", "selection", "kvpress_critical/selection/scorers.py",
        "    causal = positions[None, :] > (k_len - window + torch.arange(window, device=keys.device))[:, None]",
        "    causal = positions[None, :] >= (k_len - window + torch.arange(window, device=keys.device))[:, None]",
        "SnapKV's window queries do not see their own key",
        ("tests/selection/test_scorers.py", "tests/presses/test_kvpress_scorers.py"),
    ),
)
# fmt: on
