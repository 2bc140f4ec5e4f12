"""Write a Gemma-3-like hybrid model with random weights for the serving benchmark on hybrid models (no download).

Gemma 3's attention layout, scaled down: five sliding-window layers per full-attention one (12 layers: 10 sliding of
128 tokens, 2 full), 4 query and 2 KV heads of 64 dimensions, hidden size 256, SmolLM2's tokenizer. Its full-attention
layers hold every token of a request and its sliding-window layers a window, as in Gemma 3 at long context; the
weights are random, so it measures memory and speed, not answers. Run in the plugin's environment::

    python benchmarks/make_gemma3_like.py /tmp/gemma3-like
    python benchmarks/bench_vllm.py --model /tmp/gemma3-like --presses critical_snapkv,critical_adakv_snapkv \\
        --pool-tokens 4096
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
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: the embedded SmolLM2's")
    args = parser.parse_args(argv)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(args.layers)]
    config = Gemma3TextConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        max_position_embeddings=8192, sliding_window=args.window, layer_types=layer_types,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    save_random_model(Gemma3ForCausalLM(config), args.folder, args.tokenizer)
    print(
        f"wrote {args.folder}: {layer_types.count('sliding_attention')} sliding-window layers of {args.window} tokens, "
        f"{layer_types.count('full_attention')} full-attention layers"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
