"""The private vLLM internals the plugin reads and writes, in one place (vLLM 0.32).

The plugin subclasses vLLM's scheduler, workers and attention backends, wraps three of its methods, and reads and
writes state that vLLM does not publish: the block manager's per-request blocks, the model runner's batch, its
partial-prefill mask and its generators, the runner output's sampled tokens. The accessors below are the only places
that touch that state; :data:`SURFACE` lists every vLLM name the plugin relies on (the classes it imports or
subclasses, the methods it overrides, calls or wraps with the parameters it passes, the attributes it reads), and
the plugin's surface test (``tests/test_units.py::test_the_vllm_surface_the_plugin_relies_on_is_there``) checks
each against the installed vLLM in seconds. A vLLM upgrade starts there: what the test reports missing or changed
is what a port must follow. The version notes are in docs/vllm.md ("vLLM's internals the plugin relies on").
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator

import torch


def _attributes(module: str, owner: str, names: str) -> tuple[tuple[str, str, str], ...]:
    """SURFACE entries of the attributes ``names`` (space-separated) of class ``owner`` in ``module``."""
    return tuple((module, f"{owner}.{name}", "attribute") for name in names.split())


# (module, qualified name, what the plugin needs of it): "class" (imported or subclassed), "method(param, ...)" (the
# parameters the plugin passes or overrides, by name), "attribute" (read or written on instances: checked in the
# class's source, since instance attributes are set in __init__)
SURFACE: tuple[tuple[str, str, str], ...] = (
    # the scheduler side (scheduler.py)
    ("vllm.v1.core.sched.scheduler", "Scheduler", "class"),
    ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "class"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.add_request", "method(request)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.schedule", "method()"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "method(scheduler_output, model_runner_output)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.finish_requests", "method(request_ids, finished_status)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._free_request", "method(request)"),
    (
        "vllm.v1.core.sched.scheduler",
        "Scheduler._reserve_prefill_lookahead",
        "method(request, num_computed_tokens, num_new_tokens)",
    ),
    ("vllm.v1.core.sched.scheduler", "Scheduler.scheduler_reserve_full_isl", "attribute"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.kv_cache_manager", "attribute"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.kv_cache_config", "attribute"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.waiting", "attribute"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.running", "attribute"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.requests", "attribute"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.block_pool", "attribute"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.coordinator", "attribute"),
    ("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.single_type_managers", "attribute"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager.req_to_blocks", "attribute"),
    (
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager._remove_blocks_in_range",
        "method(request_id, first_block, last_block)",
    ),
    ("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", "method()"),
    # prefix caching (prefix_cache.py): a compaction's rewritten blocks leave the index, shared ones are never written
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.enable_caching", "attribute"),
    ("vllm.v1.core.block_pool", "BlockPool._maybe_evict_cached_block", "method(block)"),
    ("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager.num_cached_block", "attribute"),
    (
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager.cache_blocks",
        "method(request, num_tokens)",
    ),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock.ref_cnt", "attribute"),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock.block_hash", "attribute"),
    ("vllm.v1.request", "Request.skip_reading_prefix_cache", "attribute"),
    # a compressed prefix shared (prefix_cache.py): kept under the plugin's own block hashes, adopted by a later
    # request through the scheduler's local prefix-cache lookup; a block shared with it is never written in place
    ("vllm.v1.core.sched.scheduler", "Scheduler._get_local_prefix_cache_hit", "method(request)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler._handle_blocked_waiting_request", "method(request)"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.hash_block_size", "attribute"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.free", "method(request)"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager.empty_kv_cache_blocks", "attribute"),
    ("vllm.v1.core.block_pool", "BlockPool.get_cached_block", "method(block_hash, kv_cache_group_ids)"),
    ("vllm.v1.core.block_pool", "BlockPool._insert_block_hash", "method(block_hash_with_group_id, block, num_tokens)"),
    ("vllm.v1.core.block_pool", "BlockPool.get_new_blocks", "method(num_blocks)"),
    ("vllm.v1.core.block_pool", "BlockPool.free_blocks", "method(ordered_blocks)"),
    ("vllm.v1.core.block_pool", "BlockPool.touch", "method(blocks)"),
    ("vllm.v1.core.block_pool", "BlockPool.null_block", "attribute"),
    ("vllm.v1.core.kv_cache_utils", "make_block_hash_with_group_id", "function"),
    ("vllm.v1.core.kv_cache_utils", "get_block_hash", "function"),
    ("vllm.v1.request", "Request.block_hashes", "attribute"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.requests", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_id_to_index", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.block_table", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState.block_ids", "attribute"),
    ("vllm.v1.worker.block_table", "BlockTable.block_table", "attribute"),
    ("vllm.v1.request", "Request", "class"),
    ("vllm.v1.request", "RequestStatus", "class"),
    *_attributes(
        "vllm.v1.request",
        "Request",
        "request_id sampling_params num_prompt_tokens num_computed_tokens num_tokens max_tokens num_preemptions "
        "resumable status client_index trace_headers",
    ),
    ("vllm.v1.request", "Request.take_events", "method()"),
    ("vllm.v1.request", "Request.get_finished_reason", "method()"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", "attribute"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.finished_req_ids", "attribute"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_new_reqs", "attribute"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_cached_reqs", "attribute"),
    ("vllm.v1.core.sched.output", "CachedRequestData.resumed_req_ids", "attribute"),
    ("vllm.v1.engine", "EngineCoreOutput", "class"),
    ("vllm.v1.engine", "EngineCoreOutputs", "class"),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec", "class"),
    ("vllm.v1.kv_cache_interface", "KVCacheSpec", "class"),
    ("vllm.v1.kv_cache_interface", "SlidingWindowSpec", "class"),
    ("vllm.v1.kv_cache_interface", "MambaSpec", "class"),
    ("vllm.v1.kv_cache_interface", "MambaSpec.max_memory_usage_bytes", "method(vllm_config)"),
    ("vllm.v1.kv_cache_interface", "MambaSpec.mamba_type", "attribute"),
    (
        "vllm.v1.kv_cache_interface",
        "SlidingWindowSpec.max_admission_blocks_per_request",
        "method(max_in_flight_tokens, max_model_len)",
    ),
    ("vllm.config", "VllmConfig.max_in_flight_tokens", "attribute"),
    # the bound a request holds (kv_spec.py): vLLM's start-up check and concurrency figures call these
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec.max_memory_usage_bytes", "method(vllm_config)"),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec.merge", "method(specs)"),
    # the worker side (worker.py, worker_state.py, attention.py)
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "class"),
    ("vllm.v1.worker.gpu_worker", "Worker", "class"),
    ("vllm.v1.worker.gpu_worker", "Worker.execute_model", "method(scheduler_output)"),
    ("vllm.v1.worker.gpu_worker", "Worker.sample_tokens", "method(grammar_output)"),
    ("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory", "method()"),
    ("vllm.v1.worker.gpu_worker", "Worker.get_kv_cache_spec", "method()"),
    ("vllm.v1.worker.gpu_worker", "Worker.initialize_from_config", "method(kv_cache_config)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.input_batch", "attribute"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.discard_request_mask", "attribute"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.attn_groups", "attribute"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.kv_cache_config", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.generators", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_computed_tokens_cpu", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", "attribute"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", "attribute"),
    ("vllm.v1.outputs", "ModelRunnerOutput", "class"),
    ("vllm.v1.outputs", "ModelRunnerOutput.sampled_token_ids", "attribute"),
    ("vllm.v1.outputs", "ModelRunnerOutput.req_id_to_index", "attribute"),
    ("vllm.v1.outputs", "AsyncModelRunnerOutput", "class"),
    ("vllm.v1.outputs", "EMPTY_MODEL_RUNNER_OUTPUT", "object"),
    ("vllm.v1.attention.backend", "CommonAttentionMetadata", "class"),
    *_attributes(
        "vllm.v1.attention.backend",
        "CommonAttentionMetadata",
        "block_table_tensor query_start_loc_cpu seq_lens seq_lens_cpu_upper_bound max_seq_len num_reqs "
        "_num_computed_tokens_cache _token_to_req_indices_cache",
    ),
    ("vllm.v1.attention.backend", "CommonAttentionMetadata.replace", "method()"),
    ("vllm.v1.attention.backends.registry", "AttentionBackendEnum", "class"),
    ("vllm.v1.attention.backends.registry", "register_backend", "function"),
    ("vllm.v1.attention.selector", "_cached_get_attn_backend", "function"),
    ("vllm.model_executor.layers.attention", "Attention", "class"),
    ("vllm.model_executor.layers.attention", "Attention.sliding_window", "attribute"),
    # an fp8 cache's per-tensor scales (kv_codes.py): set on each attention layer by this function (1.0) and by the
    # checkpoint's kv-cache quantization (vllm.model_executor.layers.quantization.kv_cache)
    ("vllm.model_executor.layers.attention.attention", "set_default_quant_scales", "function"),
    *_attributes("vllm.v1.attention.backend", "AttentionLayer", "_k_scale_float _v_scale_float"),
    ("vllm.distributed", "get_tp_group", "function"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.cpu_group", "attribute"),
    # the entry points (plugin.py, engine_config.py)
    ("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "method()"),
    ("vllm.sampling_params", "SamplingParams._verify_extra_args", "method()"),
    ("vllm.v1.engine.input_processor", "InputProcessor.process_inputs", "method()"),
    ("vllm.exceptions", "VLLMValidationError", "class"),
    ("vllm.config.compilation", "CUDAGraphMode", "class"),
    ("vllm.config.compilation", "CompilationMode", "class"),
)


def resolve(module: str, name: str):
    """The object ``module.name`` (``name`` may be ``Class.member``)."""
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


# ---------------------------------------------------------------------------------------------- scheduler side
def managers(scheduler) -> list:
    """The scheduler's block managers, one per KV-cache group (the plugin compresses one of them:
    :func:`kvpress_critical_vllm.kv_spec.compressed_group`)."""
    return scheduler.kv_cache_manager.coordinator.single_type_managers


def free_blocks(scheduler) -> int:
    """Blocks free in the scheduler's pool (shared by every group)."""
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def real_blocks(scheduler, request_id: str, first_block: int = 0, end_block: int | None = None, group: int = 0) -> list:
    """The blocks ``first_block .. end_block - 1`` a request holds in KV-cache group ``group`` (its null placeholders
    aside)."""
    held = managers(scheduler)[group].req_to_blocks.get(request_id, ())
    return [block for block in held[first_block:end_block] if block is not None and not block.is_null]


def real_blocks_held(scheduler, request_id: str, group: int = 0) -> int:
    """Blocks a request holds in KV-cache group ``group`` (its null placeholders aside)."""
    return len(real_blocks(scheduler, request_id, group=group))


def remove_blocks(scheduler, request_id: str, first_token: int, end_token: int, group: int = 0) -> None:
    """Free the blocks of positions ``first_token .. end_token - 1`` of a request in KV-cache group ``group`` (whole
    blocks; replaced by the null block in its table, as vLLM's sliding-window manager does)."""
    manager = managers(scheduler)[group]
    manager._remove_blocks_in_range(request_id, first_token // manager.block_size, end_token // manager.block_size)


def companion_admission_blocks(spec, vllm_config) -> int:
    """The most blocks a request holds in a KV-cache group the plugin does not compress (``spec``), as vLLM admits
    requests: in a sliding-window group, the window, the tokens in flight and one block for a window that starts inside
    one; in a linear-attention (Mamba) group, its recurrent state's blocks (one, more with speculative decoding or
    when vLLM's prefix cache keeps states at block boundaries: ``mamba_cache_mode`` "align")."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec):
        return spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes
    max_model_len = vllm_config.model_config.max_model_len
    return spec.max_admission_blocks_per_request(vllm_config.max_in_flight_tokens, max_model_len)


# ------------------------------------------------------------------------------------------------ prefix caching
NEVER_CACHED = 1 << 62  # a request's count of cached blocks that no block index reaches


def prefix_caching(scheduler) -> bool:
    """Whether the engine's prefix cache is on (``enable_prefix_caching``)."""
    return bool(scheduler.kv_cache_manager.enable_caching)


def skip_prefix_cache_reads(request) -> None:
    """The request takes no prefix-cache hit: it computes its whole prompt (vLLM's flag for prompt logprobs)."""
    request.skip_reading_prefix_cache = True


def unhash_blocks(
    scheduler, request_id: str, first_block: int, end_block: int, group: int = 0, skip: set[int] = frozenset()
) -> int:
    """Take blocks ``first_block .. end_block - 1`` of a request in group ``group`` (but the indices in ``skip``) out
    of the prefix cache's index (no later request can hit them); the number that were in it."""
    pool = scheduler.kv_cache_manager.block_pool
    blocks = managers(scheduler)[group].req_to_blocks.get(request_id, ())
    return sum(
        bool(pool._maybe_evict_cached_block(block))
        for index, block in enumerate(blocks[first_block:end_block], first_block)
        if index not in skip and block is not None and not block.is_null
    )


def block_digest(block) -> bytes | None:
    """The hash a block is in the prefix cache's index under (its group id aside), or ``None``."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return bytes(get_block_hash(block.block_hash)) if block.block_hash is not None else None


def stop_caching(scheduler, request_id: str) -> None:
    """No block of the request enters the prefix cache's index from now on: vLLM caches a request's full blocks from
    its count of cached blocks up (``cache_blocks``), and the count is set past any block (vLLM forgets it when the
    request is freed or preempted)."""
    for manager in managers(scheduler):
        if request_id in manager.num_cached_block:
            manager.num_cached_block[request_id] = NEVER_CACHED


def hash_block_size(scheduler) -> int:
    """Tokens per entry of a request's block hashes (``Request.block_hashes``)."""
    return scheduler.hash_block_size


def prefix_hash(request, n_tokens: int, hash_block: int) -> bytes | None:
    """vLLM's chained hash of a request's first ``n_tokens`` tokens (a whole number of ``hash_block``-token hash
    blocks), with what vLLM mixes into it (LoRA, multimodal inputs, ``cache_salt``), or ``None`` when not computed."""
    hashes, blocks = request.block_hashes, n_tokens // hash_block
    return bytes(hashes[blocks - 1]) if 0 < blocks <= len(hashes) and n_tokens % hash_block == 0 else None


def cached_blocks(scheduler, digests: list[bytes], group: int) -> list | None:
    """The blocks kept in the prefix cache's index under the plugin's hashes ``digests`` (in group ``group``), or
    ``None`` when any of them left it (evicted for another allocation, or the cache was reset)."""
    pool = scheduler.kv_cache_manager.block_pool
    found = []
    for digest in digests:
        blocks = pool.get_cached_block(digest, [group])
        if not blocks:
            return None
        found.append(blocks[0])
    return found


def hash_blocks(scheduler, blocks: list, digests: list[bytes], group: int) -> None:
    """Put ``blocks`` in the prefix cache's index under the plugin's hashes ``digests``: kept when freed, until vLLM
    reuses them (least recently used first), and reachable by no request's own token hashes."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = scheduler.kv_cache_manager.block_pool
    for block, digest in zip(blocks, digests):
        pool._insert_block_hash(make_block_hash_with_group_id(digest, group), block, None)


def adopt_blocks(scheduler, request_id: str, group: int, skipped: int, blocks: list) -> None:
    """A waiting request starts from ``blocks`` after ``skipped`` null placeholders in group ``group``, as a request
    whose first blocks a compaction freed: the blocks are referenced (out of the free queue), none of its blocks
    enters the index by its token hashes, and vLLM's allocation then adds only the blocks of its next tokens."""
    manager = managers(scheduler)[group]
    hold_blocks(scheduler, blocks)
    manager.req_to_blocks[request_id] = [scheduler.kv_cache_manager.block_pool.null_block] * skipped + list(blocks)
    manager.num_cached_block[request_id] = NEVER_CACHED


def release_request_blocks(scheduler, request) -> None:
    """Give back every block a waiting request holds (what :func:`adopt_blocks` gave it, when it was not admitted)."""
    scheduler.kv_cache_manager.free(request)


def empty_blocks(scheduler):
    """vLLM's empty ``KVCacheBlocks`` (a lookup's "no hit")."""
    return scheduler.kv_cache_manager.empty_kv_cache_blocks


def take_free_blocks(scheduler, count: int) -> list:
    """``count`` blocks from the free queue (the least recently used cached ones evicted first), referenced once."""
    return scheduler.kv_cache_manager.block_pool.get_new_blocks(count)


def hold_blocks(scheduler, blocks: list) -> None:
    """Take one reference to each of ``blocks`` (out of the free queue, so that vLLM does not reuse them)."""
    scheduler.kv_cache_manager.block_pool.touch(blocks)


def give_back_blocks(scheduler, blocks: list) -> None:
    """Drop one reference to each of ``blocks`` (those with a hash stay in the index until reused)."""
    scheduler.kv_cache_manager.block_pool.free_blocks(blocks)


def block_at(scheduler, request_id: str, index: int, group: int):
    """The block at ``index`` of a request's table in group ``group``."""
    return managers(scheduler)[group].req_to_blocks[request_id][index]


def swap_block(scheduler, request_id: str, index: int, block, group: int):
    """Put ``block`` at ``index`` of a request's table in group ``group``; the block it replaces (still referenced)."""
    held = managers(scheduler)[group].req_to_blocks[request_id]
    old, held[index] = held[index], block
    return old


def discard_sampled_tokens(model_runner_output, request_ids: Iterable[str]) -> None:
    """No token of this step for ``request_ids``: vLLM then appends none and checks no stop for them, as for a
    partial prefill."""
    index = model_runner_output.req_id_to_index
    sampled = model_runner_output.sampled_token_ids
    for request_id in request_ids:
        row = index.get(request_id)
        if row is not None and row < len(sampled):
            sampled[row] = []


# ------------------------------------------------------------------------------------------------- worker side
def requests_starting_over(scheduler_output) -> set[str]:
    """The requests a worker forgets at this step: finished, new, or resumed after a preemption (which run their
    prompt again)."""
    gone = set(scheduler_output.finished_req_ids)
    gone.update(request.req_id for request in scheduler_output.scheduled_new_reqs)
    gone.update(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
    return gone


def replace_block_ids(runner, request_id: str, group: int, replaced: dict[int, int]) -> None:
    """Write ``replaced`` (block index -> block id) into a request's block table on this worker, in group ``group``:
    the batch's row (read from the next step on) and the request's state (a row rebuilt from it later). Kernel blocks
    are the cache's blocks: the worker refuses any other layout at start-up."""
    ids = runner.requests[request_id].block_ids[group]
    table = runner.input_batch.block_table[group]
    row = runner.input_batch.req_id_to_index.get(request_id)
    for index, block_id in replaced.items():
        ids[index] = block_id
        if row is not None:
            table.block_table.np[row, index] = block_id


def batch_rows(runner, num_reqs: int) -> tuple[list[str], list[int]]:
    """The request id and the computed tokens of each of the first ``num_reqs`` rows of the runner's batch."""
    batch = runner.input_batch
    return list(batch.req_ids[:num_reqs]), batch.num_computed_tokens_cpu[:num_reqs].tolist()


def query_starts(cm, num_reqs: int) -> list[int]:
    """Where each row's tokens start in the step's queries (and where the last one ends): ``num_reqs + 1`` offsets."""
    return cm.query_start_loc_cpu[: num_reqs + 1].tolist()


def block_table(cm) -> torch.Tensor:
    """The step's block table (device, one row per request of the batch)."""
    return cm.block_table_tensor


def shifted_view(cm, shift: torch.Tensor, block_size: int):
    """
    ``cm`` (vLLM's ``CommonAttentionMetadata``) with each row's first ``shift[row]`` positions (whole blocks) out of
    its attention view: ``seq_len - shift`` and its block-table row shifted by ``shift / block_size`` (positions,
    RoPE and the slot mapping of new tokens untouched). ``shift`` is an int tensor over the real rows (padding rows
    shift by 0).
    """
    num_rows = cm.seq_lens.shape[0]
    shift_rows = torch.zeros(num_rows, dtype=torch.int64)
    shift_rows[: shift.shape[0]] = shift
    seq_lens = cm.seq_lens - shift_rows.to(device=cm.seq_lens.device, dtype=cm.seq_lens.dtype)
    upper = cm.seq_lens_cpu_upper_bound
    if upper is not None:
        upper = upper - shift_rows[: upper.shape[0]].to(upper.dtype)
    table = cm.block_table_tensor
    columns = torch.arange(table.shape[1], device=table.device)
    index = (columns[None, :] + (shift_rows // block_size).to(table.device)[:, None]).clamp_(max=table.shape[1] - 1)
    table = table.gather(1, index[: table.shape[0]])
    reference = upper if upper is not None else seq_lens.cpu()
    max_seq_len = int(reference[: shift.shape[0]].max()) if shift.shape[0] else cm.max_seq_len
    return cm.replace(
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=upper,
        block_table_tensor=table,
        max_seq_len=max_seq_len,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )


def batch_of(runner):
    """The model runner's persistent batch (request ids, computed tokens, generators)."""
    return runner.input_batch


def discarded_rows(runner) -> list[bool]:
    """Per row of the runner's batch: whether this step's sample is thrown away (a partial prefill)."""
    batch, mask = getattr(runner, "input_batch", None), getattr(runner, "discard_request_mask", None)
    if batch is None or mask is None:
        return []
    return [bool(flag) for flag in mask.np[: batch.num_reqs]]


def generators_of(runner) -> dict:
    """The runner's per-row generators of seeded requests (the sampling metadata holds this same dict)."""
    batch = getattr(runner, "input_batch", None)
    return getattr(batch, "generators", None) or {}


def attention_groups(runner) -> list:
    """The runner's attention groups (their metadata builders and KV cache specs)."""
    return runner.attn_groups


def kv_cache_groups(runner) -> list:
    """The runner's KV-cache groups (``kv_cache_config.kv_cache_groups``: their layer names and specs), in the order of
    :func:`attention_groups`."""
    return runner.kv_cache_config.kv_cache_groups


def forward_context(vllm_config) -> dict:
    """Every attention layer by name (``compilation_config.static_forward_context``)."""
    return vllm_config.compilation_config.static_forward_context


def attention_modules(model) -> Iterator[tuple[str, object]]:
    """``(module name, module)`` of each of the model's attention layers (vLLM's ``Attention``: its ``layer_name``
    keys the forward context)."""
    from vllm.model_executor.layers.attention import Attention

    for name, module in model.named_modules():
        if isinstance(module, Attention):
            yield name, module


def tp_cpu_group():
    """The CPU process group of this worker's tensor-parallel ranks (the compaction's vote)."""
    from vllm.distributed import get_tp_group

    return get_tp_group().cpu_group


def kv_scales(layer) -> tuple[float, float]:
    """An attention layer's per-tensor fp8 cache scales ``(k_scale, v_scale)`` (``_k_scale_float``, ``_v_scale_float``:
    what ``CPU_ATTN`` quantizes and dequantizes with)."""
    return float(layer._k_scale_float), float(layer._v_scale_float)


class UnitScales:
    """An attention layer seen with fp8 scales of 1.0 (everything else its own): the layout probe writes small integers
    through the backend, which an fp8 cache then stores exactly."""

    _k_scale_float = 1.0
    _v_scale_float = 1.0

    def __init__(self, layer):
        self._layer = layer

    def __getattr__(self, name: str):
        return getattr(self._layer, name)
