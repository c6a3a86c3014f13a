"""Hugging Face transformers generation on a kvblocks paged KV cache.

Runs a tiny randomly initialised Llama (GQA: 4 query heads, 2 KV heads; nothing is downloaded)
three ways and checks every generated token against transformers' default DynamicCache:

1. greedy decoding of a left-padded batch of prompts of different lengths;
2. beam search (num_beams=4, num_return_sequences=2): beams share blocks through fork and
   copy-on-write; prints the KV bytes held by both caches;
3. prefix caching across generate calls (``cache.generate(model, ...)``): a second batch sharing
   a long prefix reuses its blocks.

    pip install kvblocks[transformers]
    python examples/hf_generate.py [--device cpu|cuda] [--block-size 16]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvblocks.integrations.transformers import PagedKVCache, dynamic_cache_bytes
from kvblocks.testing import tiny_config

PAD = 0
CACHE_KW = (
    "cache" if int(__import__("transformers").__version__.split(".")[0]) >= 5 else "past_key_values"
)


def left_pad(rows):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.as_tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def generate(model, ids, mask, cache, **kw):
    with torch.no_grad():
        return model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            **{CACHE_KW: cache},
            **kw,
        )


def kib(n):
    return f"{n / 1024:8.1f} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="model and KV storage device (cpu or cuda)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = tiny_config(  # the tests' tiny model, twice as wide and deep
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        max_position_embeddings=1024,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval().to(args.device)
    model.generation_config.eos_token_id = None  # fixed-length outputs
    model.generation_config.pad_token_id = PAD
    g = np.random.default_rng(0)
    paged = PagedKVCache(
        model.config, args.num_blocks, block_size=args.block_size, device=args.device
    )
    print(
        f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
        f"device {args.device}, block_size {args.block_size}"
    )

    # 1. greedy, left-padded batch of prompts of different lengths
    ids, mask = left_pad([g.integers(3, 512, n) for n in (12, 40, 27, 5)])
    ref = generate(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=24)
    out = generate(model, ids, mask, paged, max_new_tokens=24)
    print(f"\n1. greedy, 4 padded prompts: tokens identical: {torch.equal(out, ref)}")

    # 2. beam search
    ids, mask = left_pad([g.integers(3, 512, n) for n in (60, 45)])
    kw = dict(num_beams=4, num_return_sequences=2, max_new_tokens=32)
    dyn = DynamicCache(config=model.config)
    ref = generate(model, ids, mask, dyn, **kw)
    paged.reset()
    out = generate(model, ids, mask, paged, **kw)
    held, base = paged.kv_bytes_held(), dynamic_cache_bytes(dyn)
    st = paged.stats
    print(f"2. beam search (2 prompts x 4 beams): tokens identical: {torch.equal(out, ref)}")
    print(
        f"   KV bytes held   DynamicCache {kib(base)}   PagedKVCache {kib(held)}"
        f"   ({held / base:.0%}; {st['blocks_held']} blocks shared by {st['rows']} beams,"
        f" {st['forks']} forks, {st['copy_on_write_blocks']} copy-on-write block copies)"
    )

    # 3. prefix caching across generate calls: register the prompts with prepare(), then generate
    system = g.integers(3, 512, 200)  # a long shared "system prompt"
    batches = [
        [np.concatenate([system, g.integers(3, 512, 7)])],
        # unpadded rows (same length) hit whatever batch the prefix came from; padded rows hit
        # only rows with the same padding (see docs/transformers.md)
        [np.concatenate([system, g.integers(3, 512, 13)]) for _ in range(2)],
    ]
    for call, rows in enumerate(batches, 1):
        ids, mask = left_pad(rows)
        ref = generate(model, ids, mask, DynamicCache(config=model.config), max_new_tokens=16)
        # prepare + generate in one call (prepare(ids, mask, model=model) then model.generate):
        # the cache checks that generate is fed the prepared prompts
        with torch.no_grad():
            out = paged.generate(
                model,
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=16,
                do_sample=False,
            )
        cached = paged.cached_tokens
        print(
            f"3.{call} prefix caching, call {call} ({ids.shape[0]} x {ids.shape[1]} prompt "
            f"tokens): cached tokens per row {cached:3d}, tokens identical: {torch.equal(out, ref)}"
        )
    print(f"   stats: {paged.stats}")


if __name__ == "__main__":
    main()
