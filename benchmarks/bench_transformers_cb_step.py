"""Per-step bookkeeping of transformers' continuous batching: allocation + index building.

Same run, same cache geometry (a tiny random Llama's ``PagedAttentionCache`` on the CPU, page 16):
transformers' own allocator and Python index loop (``can_store_request_tokens`` per request, then
``extend_read_and_write_indices`` and ``torch.tensor`` into the index storage, as its
``prepare_batch_tensors`` does), against kvblocks stage 2 (``can_store_request_tokens`` reserving
through the BlockManager, the ids committed with one ``append_batch``, and one ``row_indices``
call writing into the same storage). Two batches: 64 requests decoding at ~2K context, and a
prefill-heavy mix (16 requests prefilling 128-token chunks, 48 decoding). Each sample is one
step; p50 and p99 over ``--steps`` steps, GC off.

    PYTHONPATH=. python benchmarks/bench_transformers_cb_step.py [--json FILE] [--steps 40]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import cache as cb_cache
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import FutureRequestState, RequestState

from kvblocks.integrations import transformers_cb
from kvblocks.testing import tiny_config

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)

PAGE = 16


def build_cache(num_blocks: int, max_batch_tokens: int):
    config = tiny_config(max_position_embeddings=8192)
    cbc = ContinuousBatchingConfig(
        page_size=PAGE,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_memory_percent=0.9,
    )
    return cb_cache.PagedAttentionCache(
        config, cbc, "cpu", DistributedHelper(None, None), dtype=torch.float32
    )


def make_io(cache, max_batch_tokens):
    reads = cache.max_tokens_read + max_batch_tokens
    return SimpleNamespace(
        write_index_storage=torch.zeros((1, max_batch_tokens), dtype=torch.int64),
        read_index_storage=torch.zeros((1, reads), dtype=torch.int64),
        block_table=torch.zeros((0, 0, 0), dtype=torch.int32),
        use_block_table=False,
        max_kv_read=1,
        true_write_sizes=[0],
        true_read_sizes=[0],
    )


def requests(n_decode, n_prefill, context, chunk):
    g = np.random.default_rng(0)
    out = []
    for i in range(n_decode + n_prefill):
        prompt = g.integers(3, 120, context).tolist()
        st = RequestState(request_id=f"r{i}", initial_tokens=prompt, max_new_tokens=10**6)
        out.append((st, i >= n_decode))
    return out


def step_transformers(cache, io, batch):
    """transformers' bookkeeping of one step: allocation, per-request index lists, tensors."""
    write, read = [[]], [[]]
    for fs in batch:
        st = fs.state
        assert cache.can_store_request_tokens(st, fs.query_length)
        cache.extend_read_and_write_indices(
            st.request_id, st.position_offset, fs.query_length, read, write
        )
    io.write_index_storage[0, : len(write[0])] = torch.tensor(write[0], dtype=torch.int64)
    io.read_index_storage[0, : len(read[0])] = torch.tensor(read[0], dtype=torch.int64)


def step_kvblocks(cache, io, batch):
    """kvblocks stage 2: reserve at scheduling, commit ids, one row_indices into the storage."""
    for fs in batch:
        assert cache.can_store_request_tokens(fs.state, fs.query_length)
    alloc = cache.cache_allocators["full_attention"]
    ids, q, d = alloc.commit_step(batch)
    alloc.build_indices(io, ids, q, d)


def advance(batch):
    for fs in batch:
        fs.state.position_offset += fs.query_length
        fs.state.tokens_to_process = [7] * fs.query_length


def run(kind, n_decode, n_prefill, context, chunk, steps):
    """Prefill every request to its context untimed, then time ``steps`` steps."""
    n = n_decode + n_prefill
    max_batch_tokens = max(context, n_prefill * chunk + n_decode)
    grown = n_decode * (context + steps) + n_prefill * (context + steps * chunk)
    num_blocks = grown // PAGE + 4 * n
    ctx = transformers_cb.enabled() if kind == "kvblocks" else None
    if ctx is not None:
        ctx.__enter__()
    try:
        cache = build_cache(num_blocks, max_batch_tokens)
        io = make_io(cache, max_batch_tokens)
        step = step_kvblocks if kind == "kvblocks" else step_transformers
        reqs = requests(n_decode, n_prefill, context, chunk)
        for st, _ in reqs:  # prefill in chunks of at most max_batch_tokens
            done = 0
            while done < context:
                q = min(max_batch_tokens, context - done)
                st.tokens_to_process = st.initial_tokens[done : done + q]
                fs = FutureRequestState(st, True, {}, q)
                step(cache, io, [fs])
                advance([fs])
                done += q
        samples = []
        gc.disable()
        for _ in range(steps):
            batch = [FutureRequestState(st, True, {}, chunk if pre else 1) for st, pre in reqs]
            for fs in batch:
                fs.state.tokens_to_process = [7] * fs.query_length
            t0 = time.perf_counter_ns()
            step(cache, io, batch)
            samples.append((time.perf_counter_ns() - t0) / 1e6)
            advance(batch)
        gc.enable()
        rows = int(sum(fs.state.position_offset for fs in batch))
        return dict(
            p50_ms=float(np.median(samples)),
            p99_ms=float(np.percentile(samples, 99)),
            read_rows_last_step=rows,
        )
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = [("decode 64 x ~2K", 64, 0, 1), ("prefill-heavy 16x128 + 48 decode", 48, 16, 128)]
    rows = []
    print(f"{'batch':34} {'allocator':12} {'p50 ms':>8} {'p99 ms':>8} {'speedup':>8}")
    for name, nd, npf, chunk in cases:
        res = {
            k: run(k, nd, npf, args.context, chunk, args.steps)
            for k in ("transformers", "kvblocks")
        }
        speed = res["transformers"]["p50_ms"] / res["kvblocks"]["p50_ms"]
        for k, r in res.items():
            print(
                f"{name:34} {k:12} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
                f"{speed if k == 'kvblocks' else 1.0:7.1f}x"
            )
            rows.append(
                dict(
                    batch=name,
                    allocator=k,
                    **r,
                    speedup_p50=round(speed, 1) if k == "kvblocks" else 1.0,
                )
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
