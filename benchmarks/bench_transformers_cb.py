"""transformers continuous batching: kvblocks' allocator against transformers' own, same run.

A tiny random Llama on the CPU (bookkeeping, not the model, dominates), ``generate_batch`` over
prompts that share a few "system prompts", greedy, at two cache sizes (roomy and under pressure).
For each allocator: wall time and generated tokens/s (median of ``--repeat`` runs), prompt tokens
served from the prefix cache, and the KV blocks held after each step (peak): blocks referenced by
requests, and blocks not allocatable (referenced + transformers' cached blocks, which it holds
until it evicts them all at once; kvblocks' evictable blocks count as free). The cache tensor
itself is the same size for both (transformers preallocates it). Outputs are checked identical.

    PYTHONPATH=. python benchmarks/bench_transformers_cb.py [--json out.json] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching import continuous_api

from kvblocks.integrations import transformers_cb
from kvblocks.testing import tiny_config

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


def workload(num_prompts: int, page: int):
    g = torch.Generator().manual_seed(1)
    systems = [torch.randint(3, 120, (3 * page,), generator=g).tolist() for _ in range(4)]
    return [
        systems[i % 4] + torch.randint(3, 120, (page // 2 + i % 5,), generator=g).tolist()
        for i in range(num_prompts)
    ]


class Probe:
    """Per-step samples of block occupancy and the prefix tokens matched, for either allocator."""

    def __init__(self) -> None:
        self.peak_referenced = self.peak_held = self.hit_tokens = 0
        self.bytes_per_block = 0

    def __enter__(self):
        probe = self
        self._update = continuous_api.ContinuousBatchProcessor.update_batch
        self._search = cb_cache.PagedAttentionCache.search_prefix_match

        def update_batch(proc):
            probe._update(proc)
            probe.sample(proc.cache)

        def search_prefix_match(cache, request_id, prompt_ids):
            n = probe._search(cache, request_id, prompt_ids)
            probe.hit_tokens += n
            return n

        continuous_api.ContinuousBatchProcessor.update_batch = update_batch
        cb_cache.PagedAttentionCache.search_prefix_match = search_prefix_match
        return self

    def __exit__(self, *exc):
        continuous_api.ContinuousBatchProcessor.update_batch = self._update
        cb_cache.PagedAttentionCache.search_prefix_match = self._search

    def sample(self, cache) -> None:
        (alloc,) = cache.cache_allocators.values()
        self.bytes_per_block = alloc.bytes_per_block
        referenced = len({b for t in alloc.block_table.values() for b in t})
        free = (
            cache.pool.count_free_blocks(alloc.index)
            + cache.pool.num_free_sectors * alloc.blocks_per_sector
        )
        held = cache.num_blocks - free
        self.peak_referenced = max(self.peak_referenced, referenced)
        self.peak_held = max(self.peak_held, held)


def run(model, prompts, gen, cbc_kwargs, use_kvblocks: bool):
    cbc = ContinuousBatchingConfig(**cbc_kwargs)
    with Probe() as probe:
        t0 = time.perf_counter()
        if use_kvblocks:
            with transformers_cb.enabled() as kb:
                out = model.generate_batch(
                    prompts, generation_config=gen, continuous_batching_config=cbc, warmup=False
                )
            kb.check()
            assert kb.blocks_in_use == 0
        else:
            out = model.generate_batch(
                prompts, generation_config=gen, continuous_batching_config=cbc, warmup=False
            )
        wall = time.perf_counter() - t0
    tokens = {k: list(v.generated_tokens) for k, v in out.items()}
    extra = {"evictions": kb.stats.evictions} if use_kvblocks else {}
    return wall, tokens, probe, extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(tiny_config(max_position_embeddings=512)).eval()
    model.config._attn_implementation = "sdpa"
    gen = GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    prompts = workload(args.prompts, args.page)
    n_gen = args.prompts * args.new_tokens
    rows = []
    for label, num_blocks in (("roomy", 256), ("pressure", 24)):
        cbc = dict(page_size=args.page, num_blocks=num_blocks, max_batch_tokens=256)
        res = {}
        for name, use in (("transformers", False), ("kvblocks", True)):
            walls = []
            for _ in range(args.repeat):
                wall, tokens, probe, extra = run(model, prompts, gen, cbc, use)
                walls.append(wall)
            res[name] = (statistics.median(walls), tokens, probe, extra)
        assert res["transformers"][1] == res["kvblocks"][1], "outputs differ"
        for name, (wall, _, probe, extra) in res.items():
            rows.append(
                dict(
                    cache=f"{label} ({num_blocks} blocks)",
                    allocator=name,
                    wall_s=round(wall, 3),
                    tokens_per_s=round(n_gen / wall, 1),
                    hit_tokens=probe.hit_tokens,
                    peak_referenced=probe.peak_referenced,
                    peak_held=probe.peak_held,
                    peak_held_kib=probe.peak_held * probe.bytes_per_block // 1024,
                    **extra,
                )
            )
    hdr = (
        "cache",
        "allocator",
        "wall_s",
        "tokens_per_s",
        "hit_tokens",
        "peak_referenced",
        "peak_held",
        "peak_held_kib",
        "evictions",
    )
    print(
        f"{args.prompts} prompts x {args.new_tokens} new tokens, page {args.page}, "
        f"median of {args.repeat}; outputs identical"
    )
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join(str(r.get(h, "")) for h in hdr))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
