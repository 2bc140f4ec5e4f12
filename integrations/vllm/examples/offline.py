"""Offline generation with kvpress-critical's vLLM plugin on CPU: the embedded SmolLM2 (an instruct model: asked
through its chat template, ``llm.chat``) answers one question uncompressed, then at two ratios.

Run in the plugin's environment after ``kvpress-critical-vllm-model`` (docs/vllm.md, "First run"):

    python integrations/vllm/examples/offline.py

vLLM starts its engine processes with spawn, so the script needs the ``__main__`` guard.
"""

import sys
from pathlib import Path

from kvpress_critical_vllm.embedded_model import model_path
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(
        str(model_path()),  # the embedded SmolLM2, converted for vLLM (kvpress-critical-vllm-model)
        dtype="float32",  # CPU: float32 and eager mode start in about a minute (bf16 and compilation take minutes)
        enforce_eager=True,
        block_size=32,  # the plugin frees whole blocks: smaller blocks free closer to the budget (CPU default 128)
        kv_cache_memory_bytes=256 * 2**20,  # vLLM's CPU default sizes the pool from the machine's memory
        max_model_len=2048,
        additional_config={"kvpress_critical": {"press": "critical_snapkv", "compression_ratio": 0.5}},
    )
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text() * 4
    messages = [{"role": "user", "content": f"{text}\n\nIn one sentence, what does this plugin do?"}]
    for ratio in (0.0, 0.5, 0.75):  # 0: this request keeps its whole cache (the engine's default is 0.5)
        params = SamplingParams(
            max_tokens=32, temperature=0, extra_args={"kvpress_critical": {"compression_ratio": ratio}}
        )
        output = llm.chat(messages, params)[0]
        print(f"ratio {ratio}: {len(output.prompt_token_ids)} prompt tokens -> {output.outputs[0].text!r}")
    sys.exit(0)
