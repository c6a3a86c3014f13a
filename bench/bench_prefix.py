"""Prefix-cache benchmarks: hashing a 32K-token prompt, lookup_and_pin of 2,048 cached blocks,
allocation that evicts cached blocks, and the hit-rate-versus-capacity curve of the Mooncake
traces replayed through BlockManager. The pure-Python pool (bench/pybaseline.py, SHA-256
hashes, dict lookups) is timed in the same run for ratios.

    python bench/bench_prefix.py [--quick] [--no-curve]

Prints tables and writes bench/results/bench_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvblocks  # noqa: E402
from _timing import measure, save, table  # noqa: E402
from pybaseline import PyBlockPool, sha256_block_hashes  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def bench_hash(rows, repeats):
    toks = np.random.default_rng(0).integers(0, 128000, 32768, dtype=np.int32)
    r = measure(lambda: kvblocks.hash_blocks(toks, 16), inner=20, repeats=repeats)
    lst = toks.tolist()
    p = measure(lambda: sha256_block_hashes(lst, 16), inner=1, repeats=max(5, repeats // 6))
    rows.append({"op": "hash_blocks 32,768 tokens (2,048 blocks)", "p50_ns": r["p50_ns"],
                 "p99_ns": r["p99_ns"], "ns_per_block": r["p50_ns"] / 2048,
                 "python_ns_per_block": p["p50_ns"] / 2048, "speedup": p["p50_ns"] / r["p50_ns"]})


def bench_lookup(rows, repeats, n=2048):
    pool = kvblocks.BlockPool(n + 1)
    h = kvblocks.hash_blocks(np.arange(n * 16, dtype=np.int32), 16)
    ids = pool.allocate(n)
    pool.cache(ids, h)
    pool.free(ids[::-1])                                   # all evictable

    def cycle():
        pool.free(pool.lookup_and_pin(h))

    r = measure(cycle, inner=20, repeats=repeats)
    lk = measure(lambda: pool.lookup(h), inner=20, repeats=repeats)
    py = PyBlockPool(n + 1)
    pyh = [bytes(x) for x in h]
    blocks = py.allocate(n)
    py.cache(blocks, pyh)
    py.free(blocks)

    def pycycle():
        hit = py.lookup(pyh)
        py.touch(hit)
        py.free(hit)

    p = measure(pycycle, inner=2, repeats=max(5, repeats // 4))
    rows.append({"op": "lookup_and_pin+free 2,048 blocks", "p50_ns": r["p50_ns"],
                 "p99_ns": r["p99_ns"], "ns_per_block": r["p50_ns"] / n,
                 "python_ns_per_block": p["p50_ns"] / n, "speedup": p["p50_ns"] / r["p50_ns"]})
    rows.append({"op": "lookup 2,048 blocks (no pin)", "p50_ns": lk["p50_ns"],
                 "p99_ns": lk["p99_ns"], "ns_per_block": lk["p50_ns"] / n})


def bench_evict(rows, repeats, n=128, total=4096, inner=16):
    """Steady state: every free block holds a cache entry; each allocate(n) evicts n."""
    pool = kvblocks.BlockPool(total + 1)
    h = kvblocks.hash_blocks(np.arange(total * 4, dtype=np.int32), 4)
    held = []

    def fill():
        for ids in held:
            pool.free(ids)
        held.clear()
        pool.reset_prefix_cache()
        got = pool.allocate(total)
        pool.cache(got, h)
        pool.free(got[::-1])

    r = measure(lambda: held.append(pool.allocate(n)), inner=inner, repeats=repeats,
                setup=fill)
    fill()
    assert pool.stats.evictions >= repeats * inner * n
    py = PyBlockPool(total + 1)
    pyh = [bytes(x) for x in h]
    pyheld = []

    def pyfill():
        for b in pyheld:
            py.free(b)
        pyheld.clear()
        got = py.allocate(total)
        py.cache(got, pyh)
        py.free(got)

    p = measure(lambda: pyheld.append(py.allocate(n)), inner=inner,
                repeats=max(5, repeats // 4), setup=pyfill)
    plain = kvblocks.BlockPool(total + 1, enable_prefix_caching=False)
    base = measure(lambda: held.append(plain.allocate(n)), inner=inner, repeats=repeats,
                   setup=lambda: [plain.free(x) for x in held] and held.clear())
    rows.append({"op": f"allocate {n} evicting cached blocks", "p50_ns": r["p50_ns"],
                 "p99_ns": r["p99_ns"], "ns_per_block": r["p50_ns"] / n,
                 "python_ns_per_block": p["p50_ns"] / n, "speedup": p["p50_ns"] / r["p50_ns"],
                 "no_evict_ns_per_block": base["p50_ns"] / n})


def hit_rate_curve(quick):
    from kvblocks.sim.tokens import TokenBook

    out = []
    for name in ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"):
        path = TRACES / name
        if not path.exists():
            continue
        reqs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if quick:
            reqs = reqs[:1500]
        book = TokenBook()
        prompts = [book.prompt(r["hash_ids"], r["input_length"]) for r in reqs]
        peak = max(len(p) for p in prompts) // 16 + 2
        for blocks in (peak, 2 * peak, 8 * peak, 32 * peak, 128 * peak, 512 * peak):
            mgr = kvblocks.BlockManager(blocks, 16)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):   # one request at a time: capacity = cache size
                mgr.add(i, p)
                mgr.free(i)
            dt = time.perf_counter() - t0
            s = mgr.pool.stats
            out.append({"trace": name, "blocks": blocks,
                        "capacity_tokens": blocks * 16, "hit_rate_pct": round(100 * s.hit_rate, 2),
                        "evictions": s.evictions, "replay_s": round(dt, 3)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-curve", action="store_true")
    args = ap.parse_args(argv)
    repeats = 15 if args.quick else 60
    rows: list = []
    bench_hash(rows, repeats)
    bench_lookup(rows, repeats)
    bench_evict(rows, repeats)
    print(table(rows, ["op", "p50_ns", "p99_ns", "ns_per_block", "python_ns_per_block",
                       "speedup", "no_evict_ns_per_block"]))
    curve = [] if args.no_curve else hit_rate_curve(args.quick)
    if curve:
        print()
        print(table(curve, ["trace", "blocks", "capacity_tokens", "hit_rate_pct", "evictions",
                            "replay_s"]))
    print("saved", save("bench_prefix", rows, {"hit_rate_curve": curve}))


if __name__ == "__main__":
    main()
