"""Write a Qwen3-Next-like linear-attention hybrid with random weights for the serving benchmark (no download).

Qwen3-Next's layout, scaled down: Gated DeltaNet linear attention in three layers of four and gated full attention in
the fourth (12 layers: 9 linear, 3 full), 8 query and 2 KV heads of 256 dimensions in the full-attention layers, 4 key
and 8 value heads of 128 dimensions in the linear ones, a mixture of 8 experts (2 per token) and a shared one,
SmolLM2's tokenizer. Its full-attention layers hold every token of a request and its linear-attention layers a fixed
state, as in Qwen3-Next at long context; vLLM sizes the attention blocks so that one covers a linear layer's state
(it logs the size). The weights are random, so it measures memory and speed, not answers. vLLM's CPU build runs
Gated DeltaNet in bfloat16 only. Run in the plugin's environment::

    python benchmarks/make_qwen3_next_like.py /tmp/qwen3-next-like
    python benchmarks/bench_vllm.py --model /tmp/qwen3-next-like --dtype bfloat16 --pool-tokens 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_random_model  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: the embedded SmolLM2's")
    args = parser.parse_args(argv)
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
        full_attention_interval=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    save_random_model(Qwen3NextForCausalLM(config), args.folder, args.tokenizer)
    kinds = config.layer_types
    print(
        f"wrote {args.folder}: {kinds.count('linear_attention')} linear-attention layers, "
        f"{kinds.count('full_attention')} full-attention layers"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
