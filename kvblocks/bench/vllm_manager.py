"""``kvblocks bench vllm``: vLLM's KV cache manager vs kvblocks' under vLLM's scheduler API,
same process (issue 26; docs/vllm.md "Speed"). benchmarks/bench_vllm.py is a thin wrapper.

Needs vllm==0.34.0 importable (.ci/vllm builds a venv with it: run with that venv's python and
vLLM's source root on PYTHONPATH); without it ``kvblocks bench vllm`` prints ``skipped: vllm
not importable (...)`` and exits 0. The workload of vllm-seam.md: 256 requests, each one of 4
shared 512-token system prompts + 512 tokens of its own, block size 16, 40,000 blocks, prefix
caching on, sha256 block hashes computed by vLLM's ``Request`` (the same for both managers,
outside the timed region). Per repetition, for each manager in turn (the order alternates),
on a fresh manager:

- admission: ``get_computed_blocks`` + ``allocate_slots`` for all requests (one prefill-heavy
  step: the first request of each prompt misses, the others hit its 32 shared blocks);
- decode: one output token appended to every request (outside the timing), then
  ``allocate_slots(request, 1)`` for all of them;
- free: ``free`` of every request.

Cases: ``full`` (one full-attention group: vLLM's unitary coordinator) and ``hybrid``
(gpt-oss's shape: one full-attention group + one sliding-window group of 128 tokens, vLLM's
HybridKVCacheCoordinator; admission hits the window's last 8 blocks of the shared prompt with
null blocks before them, and the decode step frees each request's blocks that left the
window, 32 per request); ``chunked`` (Llama 4's shape: one full-attention group + one chunked
local attention group, the chunk shortened from Llama 4's 8192 tokens to 256 so that this
workload crosses chunks; admission's hit ends on a chunk boundary, so the chunk group's part
is 32 null blocks without a lookup, and the decode step frees the 32 blocks per request
before the new token's chunk); ``mamba`` (a Jamba / Qwen3-Next style hybrid: one
full-attention group + one Mamba state group in vLLM's "align" mode with prefill checkpoint
blocks, alignment one block; before the timing, one request per shared prompt computes that
prompt alone, so its state block is cached; admission then hits the prompt's 32 full blocks
and the Mamba group's one state block (31 nulls before it) and allocates the full blocks, the
checkpoint block and the running state block; the decode step frees each request's hit state
and checkpoint blocks and takes one new state block).

Reports per phase the median over repetitions of the phase's time (ms), the ratio vLLM /
kvblocks of those medians, and the p50 / p99 of one call (one request's operation, pooled over
the repetitions, µs; perf_counter_ns around each call, about 0.1 µs of timer overhead), and
checks that both managers gave the same block ids (:class:`BenchError` otherwise). Importing
this module imports vLLM and torch.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any, Callable

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMKVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from ..integrations.vllm.manager import KVCacheManager as KVBKVCacheManager
from .errors import BenchError

__all__ = ["BLOCK_SIZE", "CASES", "CHUNK", "NUM_BLOCKS", "WINDOW", "run", "run_case"]

CASES = ("full", "hybrid", "chunked", "mamba", "mixed")

BLOCK_SIZE = 16
NUM_BLOCKS = 40_000
WINDOW = 128  # gpt-oss's sliding window
CHUNK = 256  # the chunked case's attention chunk (Llama 4's: 8192)


def make_config(num_blocks: int, case: str = "full") -> KVCacheConfig:
    # "mixed": groups of different block sizes (full attention in blocks of 32 beside the
    # window in blocks of 16: hashes of 16, hits aligned to 32)
    full = FullAttentionSpec(
        block_size=2 * BLOCK_SIZE if case == "mixed" else BLOCK_SIZE,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
    )
    groups = [KVCacheGroupSpec(["layer"], full)]
    if case in ("hybrid", "mixed"):
        sw = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            sliding_window=WINDOW,
        )
        groups.append(KVCacheGroupSpec(["sw_layer"], sw))
    elif case == "chunked":
        cl = ChunkedLocalAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
            attention_chunk_size=CHUNK,
        )
        groups.append(KVCacheGroupSpec(["chunk_layer"], cl))
    elif case == "mamba":
        mamba = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=BLOCK_SIZE,
        )
        groups.append(KVCacheGroupSpec(["mamba_layer"], mamba))
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
        scheduler_block_size=2 * BLOCK_SIZE if case == "mixed" else BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    if case != "full":
        assert cls is VLLMKVCacheManager or getattr(mgr, "native", False), "not native"
    reqs = make_requests(n)
    if case == "mamba":  # each shared prompt computed alone once: its state block cached
        for r in make_requests(4)[:4]:
            seed = Request(
                request_id=f"seed-{r.request_id}",
                prompt_token_ids=r.prompt_token_ids[:512],
                sampling_params=r.sampling_params,
                pooling_params=None,
                block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
            )
            assert mgr.allocate_slots(seed, 512) is not None
            mgr.free(seed)
        mgr.new_step_starts()

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
    """Time one case (``full``, ``hybrid``, ``chunked``, ``mamba`` or ``mixed``), print its table,
    return its rows."""
    sides = {"vllm": VLLMKVCacheManager, "kvblocks": KVBKVCacheManager}
    phase_ms: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    calls: dict[str, dict[str, list[int]]] = {s: {} for s in sides}
    for rep in range(reps + 1):  # the first repetition warms up and is not counted
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
        ids = {}
        for side in order:
            t, ids[side] = run_once(sides[side], n, case)
            if rep:
                for k, ns in t.items():
                    phase_ms[side].setdefault(k, []).append(sum(ns) / 1e6)
                    calls[side].setdefault(k, []).extend(ns)
        if ids["vllm"] != ids["kvblocks"]:
            raise BenchError(f"{case}: block ids differ between vLLM's manager and kvblocks'")
    shape = {
        "full": "full attention",
        "hybrid": f"full + sliding window {WINDOW}",
        "chunked": f"full + chunked local {CHUNK}",
        "mamba": "full + Mamba align, prefill checkpoints",
        "mixed": f"full in blocks of {2 * BLOCK_SIZE} + sliding window {WINDOW}",
    }[case]
    print(
        f"{case} ({shape}): {n} requests, 4 shared 512-token prompts + 512 own, block size "
        f"{BLOCK_SIZE}, {NUM_BLOCKS} blocks; {reps} interleaved runs"
    )
    print(
        f"{'phase':<11}{'vLLM ms':>9}{'kvb ms':>9}{'speedup':>9}"
        f"{'vLLM p50/p99 us':>18}{'kvb p50/p99 us':>17}"
    )
    res: dict[str, dict[str, float]] = {}
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


def run(case: str = "all", reps: int = 7, requests: int = 256) -> dict:
    """Time ``case`` (``full``, ``hybrid``, ``chunked``, ``mamba``, ``mixed`` or ``all``), print the
    tables; the results doc."""
    if reps < 1 or requests < 1:
        raise BenchError(f"--reps and --requests must be >= 1, not {reps} and {requests}")
    init_none_hash(sha256)
    cases = CASES if case == "all" else (case,)
    out: dict = {"requests": requests, "reps": reps, "block_size": BLOCK_SIZE}
    out.update(num_blocks=NUM_BLOCKS, window=WINDOW, chunk=CHUNK)
    for c in cases:
        out[c] = run_case(c, reps, requests)
    if "full" in out:  # the names of the single-case file of before
        out["phases"] = {
            f"{k}_ms": {"vllm": r["vllm_ms"], "kvblocks": r["kvblocks_ms"], "speedup": r["speedup"]}
            for k, r in out["full"].items()
        }
    return out
