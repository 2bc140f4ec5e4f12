"""Run a batch in an engine started the default way (engine core and workers in their own processes); a script.

``python engine_process.py JOB.json`` reads ``{"engine": LLM kwargs, "plugin": options, "prompts": [[ids]],
"requests": [{"options": {option: value}, "max_tokens": int, "ignore_eos": bool}], "async_scheduling": bool}`` (one
request per prompt: its own plugin options and sampling) and writes ``JOB.json.out``: the greedy tokens, the
selections recorded by each rank (after each request's last compaction, and after each one), the prompt tokens each
took from a prefix cache, the scheduler class, how many compactions
each rank did and how many requests each rank still tracks once the batch is done (0: nothing left behind). Where the
engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in the job's environment), the result also
holds each request's compression record and the pool's state once the batch is done (blocks in use, requests
holding blocks: the idle-pool check of the in-process engines). A job
may hold a ``"then"`` job: another engine configuration, started once the first is shut down (its result under
``"then"``), so that one process serves several configurations. With ``"count_preemptions": true`` the engine keeps
its statistics and the result holds how many times vLLM preempted a request (``vllm:num_preemptions``).

vLLM's CPU platform turns async scheduling off (``CpuPlatform.check_and_update_config``: "not required on CPU"),
while it is vLLM's default on GPUs; with ``async_scheduling`` this script keeps it on through that hook so that the
plugin's async scheduler runs here (vLLM's multiprocess executor supports it on CPUs too).
"""

import json
import sys


def keep_async_scheduling() -> None:
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_keeping_async(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    CpuPlatform.check_and_update_config = classmethod(check_keeping_async)


def run(job: dict) -> dict:
    """Start the job's engine (async scheduling kept on if asked) and run its batch (:func:`serve_job`)."""
    engine = dict(job["engine"])
    if job.get("async_scheduling"):
        keep_async_scheduling()
        engine["async_scheduling"] = True
    if job.get("count_preemptions"):
        engine["disable_log_stats"] = False
    from vllm import LLM

    llm = LLM(**engine, additional_config={"kvpress_critical": job["plugin"]})
    result = serve_job(llm, job)
    if "then" in job:
        llm.llm_engine.engine_core.shutdown()  # its processes and memory, before the next engine starts
        del llm
        result["then"] = run(job["then"])
    return result


def serve_job(llm, job: dict) -> dict:
    """The job's prompts and requests run by ``llm`` (an engine of any kind): what the module docstring says."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            max_tokens=request.get("max_tokens", 32),
            temperature=0,
            ignore_eos=request.get("ignore_eos", False),
            extra_args={"kvpress_critical": request.get("options", {})},
        )
        for request in job["requests"]
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params)
    preemptions = None
    if job.get("count_preemptions"):
        preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    by_rank = llm.collective_rpc("kvpress_critical_selections")
    stages_by_rank = llm.collective_rpc("kvpress_critical_stage_selections")
    order = {o.request_id: i for i, o in enumerate(outputs)}

    def per_prompt(rank: dict, missing):
        return [
            next((value for key, value in rank.items() if order.get(key.rpartition("-")[0]) == i), missing)
            for i in range(len(outputs))
        ]

    # one more step: the workers learn which requests finished with the next step's scheduler output
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1))
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "cached": [o.num_cached_tokens or 0 for o in outputs],  # prompt tokens taken from a prefix cache
        # per rank, per prompt (in order): {layer: [[positions] per local KV head]}, or None (never compacted)
        "selections": [per_prompt(rank, None) for rank in by_rank],
        # per rank, per prompt: [{"seen": tokens, "kept": {layer: [[positions] per local KV head]}} per compaction]
        "stages": [per_prompt(rank, []) for rank in stages_by_rank],
        "scheduler": str(llm.llm_engine.vllm_config.scheduler_config.scheduler_cls),
        "compacted": llm.collective_rpc("kvpress_critical_compacted"),
        "tracked": llm.collective_rpc("kvpress_critical_tracked"),
        "preemptions": preemptions,
        **_in_process_state(llm, order),
    }


# the pool of an engine with nothing left behind (:func:`pool_state`): every block back, no request holding blocks,
# none tracked by the plugin's scheduler
IDLE_POOL = {"blocks not back in the pool": 0, "requests holding blocks": [], "requests the scheduler tracks": 0}


def pool_state(scheduler) -> dict:
    """What an engine's scheduler still holds (:data:`IDLE_POOL` when nothing): blocks out of the pool (vLLM's null
    block aside), the requests holding blocks in any KV-cache group, the requests the plugin's scheduler tracks."""
    pool = scheduler.kv_cache_manager.block_pool
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    return {
        "blocks not back in the pool": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
        "requests holding blocks": sorted(rid for m in managers for rid, blocks in m.req_to_blocks.items() if blocks),
        "requests the scheduler tracks": scheduler.kvpress_tracked_requests,
    }


def _in_process_state(llm, order: dict) -> dict:
    """Each prompt's compression record (or None), the KV-cache groups and the pool's state (:func:`pool_state`),
    where the engine core runs in this process; nothing otherwise."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return {}
    import dataclasses

    scheduler = core.scheduler
    records = [None] * len(order)
    for key, record in scheduler.kvpress_records.items():
        index = order.get(key.rpartition("-")[0])
        if index is not None:
            records[index] = dataclasses.asdict(record)
    groups = scheduler.kv_cache_config.kv_cache_groups
    return {
        "records": records,
        "groups": [type(group.kv_cache_spec).__name__ for group in groups],
        "compressed_group": scheduler.kvpress_group,
        "compressed_layers": list(groups[scheduler.kvpress_group].layer_names),
        "pool": pool_state(scheduler),
    }


if __name__ == "__main__":  # vLLM starts its processes with spawn
    job = json.loads(open(sys.argv[1]).read())
    result = run(job)
    with open(sys.argv[1] + ".out", "w") as handle:
        json.dump(result, handle)
