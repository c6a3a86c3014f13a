"""vLLM's KV cache manager vs kvblocks' under vLLM's scheduler API, same process (issue 26).

    python benchmarks/bench_vllm.py [--reps 7] [--requests 256] [--case full|hybrid|all]

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

Cases: ``full`` (one full-attention group: vLLM's unitary coordinator) and ``hybrid``
(gpt-oss's shape: one full-attention group + one sliding-window group of 128 tokens, vLLM's
HybridKVCacheCoordinator; admission hits the window's last 8 blocks of the shared prompt with
null blocks before them, and the decode step frees each request's blocks that left the
window, 32 per request).

Reports per phase the median over repetitions of the phase's time (ms), the ratio vLLM /
kvblocks of those medians, and the p50 / p99 of one call (one request's operation, pooled over
the repetitions, µs; perf_counter_ns around each call, about 0.1 µs of timer overhead), checks
that both managers gave the same block ids, and writes benchmarks/results/bench_vllm.json
(``--case all``) or bench_vllm_<case>.json.
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
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from kvblocks.integrations.vllm.manager import KVCacheManager as KVBKVCacheManager

BLOCK_SIZE = 16
NUM_BLOCKS = 40_000
WINDOW = 128  # gpt-oss's sliding window


def make_config(num_blocks: int, case: str = "full") -> KVCacheConfig:
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    groups = [KVCacheGroupSpec(["layer"], full)]
    if case == "hybrid":
        sw = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=WINDOW,
        )
        groups.append(KVCacheGroupSpec(["sw_layer"], sw))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def make_requests(n: int, seed: int = 0, **sampling: Any) -> list[Request]:
    """The workload's requests; ``sampling``: SamplingParams fields (default max_tokens=64)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30000) for _ in range(512)] for _ in range(4)]
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    out = []
    for i in range(n):
        sp = SamplingParams(**{"max_tokens": 64, **sampling})
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


def timed(fn: Callable[[Any], Any], items: list) -> list[int]:
    """ns of fn(item) for each item, GC off."""
    clock = time.perf_counter_ns
    out = []
    gc.disable()
    try:
        for it in items:
            t0 = clock()
            fn(it)
            out.append(clock() - t0)
        return out
    finally:
        gc.enable()


def run_once(cls: type, n: int, case: str) -> tuple[dict[str, list[int]], list]:
    mgr = cls(
        make_config(NUM_BLOCKS, case),
        max_model_len=8192,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    if case == "hybrid":
        assert cls is VLLMKVCacheManager or getattr(mgr, "native", False), "not native"
    reqs = make_requests(n)

    def admit(r: Request) -> None:
        blocks, hit, _ = mgr.get_computed_blocks(r)
        got = mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        assert got is not None

    out = {"admission": timed(admit, reqs)}
    for r in reqs:  # the step's tokens are computed; one output token each
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(7)

    def decode(r: Request) -> None:
        assert mgr.allocate_slots(r, 1) is not None

    out["decode"] = timed(decode, reqs)
    ids = [mgr.get_block_ids(r.request_id) for r in reqs]
    out["free"] = timed(mgr.free, reqs)
    return out, ids


def pct(xs: list[int], q: float) -> float:
    """q-th percentile (0..100) of xs, linear interpolation."""
    s = sorted(xs)
    i = (len(s) - 1) * q / 100
    lo = int(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def run_case(case: str, reps: int, n: int) -> dict:
    sides = {"vllm": VLLMKVCacheManager, "kvblocks": KVBKVCacheManager}
    phase_ms: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    calls: dict[str, dict[str, list[int]]] = {s: {} for s in sides}
    for rep in range(reps + 1):  # the first repetition warms up and is not counted
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        ids = {}
        for side in order:
            t, ids[side] = run_once(sides[side], n, case)
            if rep:
                for k, v in t.items():
                    phase_ms[side].setdefault(k, []).append(sum(v) / 1e6)
                    calls[side].setdefault(k, []).extend(v)
        if ids["vllm"] != ids["kvblocks"]:
            sys.exit(f"{case}: block ids differ between vLLM's manager and kvblocks'")
    shape = "full attention" if case == "full" else f"full + sliding window {WINDOW}"
    print(
        f"{case} ({shape}): {n} requests, 4 shared 512-token prompts + 512 own, block size "
        f"{BLOCK_SIZE}, {NUM_BLOCKS} blocks; {reps} interleaved runs"
    )
    print(
        f"{'phase':<11}{'vLLM ms':>9}{'kvb ms':>9}{'speedup':>9}"
        f"{'vLLM p50/p99 us':>18}{'kvb p50/p99 us':>17}"
    )
    res = {}
    for k in ("admission", "decode", "free"):
        v = statistics.median(phase_ms["vllm"][k])
        b = statistics.median(phase_ms["kvblocks"][k])
        row = {"vllm_ms": v, "kvblocks_ms": b, "speedup": v / b}
        for side in sides:
            row[f"{side}_call_p50_us"] = pct(calls[side][k], 50) / 1e3
            row[f"{side}_call_p99_us"] = pct(calls[side][k], 99) / 1e3
        res[k] = row
        print(
            f"{k:<11}{v:>9.2f}{b:>9.2f}{v / b:>8.2f}x"
            f"{row['vllm_call_p50_us']:>10.1f}/{row['vllm_call_p99_us']:<7.1f}"
            f"{row['kvblocks_call_p50_us']:>9.1f}/{row['kvblocks_call_p99_us']:<7.1f}"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--case", choices=("full", "hybrid", "all"), default="all")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/bench_vllm*.json")
    args = ap.parse_args()
    init_none_hash(sha256)
    cases = ("full", "hybrid") if args.case == "all" else (args.case,)
    out: dict = {"requests": args.requests, "reps": args.reps, "block_size": BLOCK_SIZE}
    out.update(num_blocks=NUM_BLOCKS, window=WINDOW)
    for case in cases:
        out[case] = run_case(case, args.reps, args.requests)
    if "full" in out:  # the names of the single-case file of before
        out["phases"] = {
            f"{k}_ms": {"vllm": r["vllm_ms"], "kvblocks": r["kvblocks_ms"], "speedup": r["speedup"]}
            for k, r in out["full"].items()
        }
    name = "bench_vllm.json" if args.case == "all" else f"bench_vllm_{args.case}.json"
    path = Path(args.json or Path(__file__).parent / "results" / name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
