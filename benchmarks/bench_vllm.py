"""vLLM's KV cache manager vs kvblocks' under vLLM's scheduler API, same process (issue 26).

    python benchmarks/bench_vllm.py [--reps 7] [--requests 256]

Needs vllm==0.34.0 importable (.ci/vllm builds a venv with it: run this with that venv's
python and vLLM's source root on PYTHONPATH). The workload of ../shared/vllm-seam.md: 256
requests, each one of 4 shared 512-token system prompts + 512 tokens of its own, block size
16, 40,000 blocks, prefix caching on, sha256 block hashes computed by vLLM's ``Request`` (the
same for both managers, outside the timed region). Per repetition, for each manager in turn
(the order alternates), on a fresh manager:

- admission: ``get_computed_blocks`` + ``allocate_slots`` for all requests (one prefill-heavy
  step: the first request of each prompt misses, the others hit its 32 shared blocks);
- decode: one output token appended to every request (outside the timing), then
  ``allocate_slots(request, 1)`` for all of them;
- free: ``free`` of every request.

Reports the median over repetitions of each phase (ms) and the ratio vLLM / kvblocks, checks
that both managers gave the same block ids, and writes benchmarks/results/bench_vllm.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvblocks.integrations.vllm.manager import KVCacheManager as KVBKVCacheManager

BLOCK_SIZE = 16
NUM_BLOCKS = 40_000


def make_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def make_requests(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30000) for _ in range(512)] for _ in range(4)]
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    out = []
    for i in range(n):
        sp = SamplingParams(max_tokens=64)
        sp.update_from_generation_config({}, eos_token_id=0)
        toks = prompts[i % 4] + [rng.randrange(1, 30000) for _ in range(512)]
        out.append(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=toks,
                sampling_params=sp,
                pooling_params=None,
                block_hasher=hasher,
            )
        )
    return out


def timed(fn: Callable[[], Any]) -> float:
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / 1e6
    finally:
        gc.enable()


def run_once(cls: type, n: int) -> tuple[dict[str, float], list]:
    mgr = cls(
        make_config(NUM_BLOCKS),
        max_model_len=8192,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    reqs = make_requests(n)
    ids: list = []

    def admit() -> None:
        for r in reqs:
            blocks, hit, _ = mgr.get_computed_blocks(r)
            got = mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            assert got is not None

    out = {"admission_ms": timed(admit)}
    for r in reqs:  # the step's tokens are computed; one output token each
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)

    def decode() -> None:
        for r in reqs:
            assert mgr.allocate_slots(r, 1) is not None

    out["decode_ms"] = timed(decode)
    ids = [mgr.get_block_ids(r.request_id) for r in reqs]

    def free() -> None:
        for r in reqs:
            mgr.free(r)

    out["free_ms"] = timed(free)
    return out, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "bench_vllm.json"))
    args = ap.parse_args()
    init_none_hash(sha256)
    sides = {"vllm": VLLMKVCacheManager, "kvblocks": KVBKVCacheManager}
    times: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    for rep in range(args.reps + 1):  # the first repetition warms up and is not counted
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        ids = {}
        for side in order:
            t, ids[side] = run_once(sides[side], args.requests)
            if rep:
                for k, v in t.items():
                    times[side].setdefault(k, []).append(v)
        if ids["vllm"] != ids["kvblocks"]:
            sys.exit("block ids differ between vLLM's manager and kvblocks'")
    res = {}
    print(
        f"{args.requests} requests, 4 shared 512-token prompts + 512 own, block size "
        f"{BLOCK_SIZE}, {NUM_BLOCKS} blocks; median of {args.reps} interleaved runs"
    )
    print(f"{'phase':<12}{'vLLM ms':>10}{'kvblocks ms':>13}{'speedup':>9}")
    for k in ("admission_ms", "decode_ms", "free_ms"):
        v = statistics.median(times["vllm"][k])
        b = statistics.median(times["kvblocks"][k])
        res[k] = {"vllm": v, "kvblocks": b, "speedup": v / b}
        print(f"{k[:-3]:<12}{v:>10.2f}{b:>13.2f}{v / b:>8.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "requests": args.requests,
                "reps": args.reps,
                "block_size": BLOCK_SIZE,
                "num_blocks": NUM_BLOCKS,
                "phases": res,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
