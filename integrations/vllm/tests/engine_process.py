"""Run a batch in an engine started the default way (engine core and workers in their own processes); a script.

``python engine_process.py JOB.json`` reads ``{"engine": LLM kwargs, "plugin": options, "prompts": [[ids]],
"presses": [...] | null, "requests": [{option: value}] | null, "max_tokens": int, "ignore_eos": bool,
"async_scheduling": bool}`` (``requests``: each prompt's own options, instead of ``presses``; 32 tokens by default)
and writes ``JOB.json.out``: the greedy tokens, the selections recorded by each rank, the scheduler class and how
many requests each rank compacted.

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


if __name__ == "__main__":  # vLLM starts its processes with spawn
    job = json.loads(open(sys.argv[1]).read())
    engine = dict(job["engine"])
    if job.get("async_scheduling"):
        keep_async_scheduling()
        engine["async_scheduling"] = True
    from vllm import LLM, SamplingParams

    llm = LLM(**engine, additional_config={"kvpress_critical": job["plugin"]})
    presses = job.get("presses") or [job["plugin"]["press"]] * len(job["prompts"])
    requests = job.get("requests") or [{"press": press} for press in presses]
    params = [
        SamplingParams(
            max_tokens=job.get("max_tokens", 32),
            temperature=0,
            ignore_eos=job.get("ignore_eos", False),
            extra_args={"kvpress_critical": options},
        )
        for options in requests
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params)
    by_rank = llm.collective_rpc("kvpress_critical_selections")
    order = {o.request_id: i for i, o in enumerate(outputs)}
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        # per rank, per prompt (in order): {layer: [[positions] per local KV head]}
        "selections": [
            [rank.get(key) for key in sorted(rank, key=lambda k: order[k.rpartition("-")[0]])] for rank in by_rank
        ],
        "scheduler": str(llm.llm_engine.vllm_config.scheduler_config.scheduler_cls),
        "compacted": llm.collective_rpc("kvpress_critical_compacted"),
    }
    with open(sys.argv[1] + ".out", "w") as handle:
        json.dump(result, handle)
