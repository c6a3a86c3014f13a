"""Sliding-window models on a kvblocks paged KV cache: the window saving, measured.

Runs two tiny randomly initialised models (nothing is downloaded), 4 layers, 2 K/V heads x 16,
fp32, window 32: Gemma 2 (sliding and full layers alternating: two KV cache groups) and Mistral
(every layer windowed: one window group). For a 200-token prompt and 57 new tokens it checks the
generated tokens against transformers' default cache and prints the K/V bytes held by
PagedKVCache, by PagedKVCache with every layer treated as full attention, and by DynamicCache.

    pip install kvblocks[transformers]
    python examples/hf_sliding_window.py [--block-size 16] [--window 32]
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import DynamicCache

from kvblocks.integrations.transformers import PagedKVCache, dynamic_cache_bytes
from kvblocks.testing import tiny_lm

CACHE_KW = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=32)
    args = ap.parse_args()
    kw = tiny_lm(
        head_dim=16, num_hidden_layers=4, max_position_embeddings=512, sliding_window=args.window
    )
    families = (
        ("Gemma 2", transformers.Gemma2ForCausalLM, transformers.Gemma2Config),
        ("Mistral", transformers.MistralForCausalLM, transformers.MistralConfig),
    )
    print(f"{'model':8s} {'tokens':>6s} {'PagedKVCache':>26s} {'all full':>10s} {'Dynamic':>10s}")
    for name, model_cls, config_cls in families:
        torch.manual_seed(0)
        config = config_cls(**kw)
        model = model_cls(config).eval()
        model.generation_config.eos_token_id = None
        ids = torch.randint(3, 128, (1, 200))
        gen = dict(max_new_tokens=57, do_sample=False)
        # the same layers, every one served as full attention (the mask still windows them)
        full_config = config_cls(**dict(kw, sliding_window=None))
        full_config.layer_types = ["full_attention"] * kw["num_hidden_layers"]
        dyn = DynamicCache(config=config)
        cache = PagedKVCache(config, num_blocks=256, block_size=args.block_size)
        full = PagedKVCache(full_config, num_blocks=256, block_size=args.block_size)
        with torch.no_grad():
            ref = model.generate(ids, **{CACHE_KW: dyn}, **gen)
            out = model.generate(ids, **{CACHE_KW: cache}, **gen)
            assert torch.equal(out, model.generate(ids, **{CACHE_KW: full}, **gen))
        assert torch.equal(out, ref), "generated tokens differ from DynamicCache"
        held = f"{cache.kv_bytes_held() / 1024:.1f} KiB ({cache.num_blocks_held()} x {cache.layers_per_block} layers)"
        print(
            f"{name:8s} {cache.get_seq_length():6d} {held:>26s} "
            f"{full.kv_bytes_held() / 1024:>6.1f} KiB {dynamic_cache_bytes(dyn) / 1024:>6.1f} KiB"
        )


if __name__ == "__main__":
    main()
