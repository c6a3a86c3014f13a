"""Core allocator benchmarks: allocate+free, fork + copy-on-write, the batched decode step,
building a 1M-block pool and memory per block; the pure-Python pool (bench/pybaseline.py)
is timed in the same run for a ratio.

    python bench/bench_alloc.py [--quick]

Prints a table and writes bench/results/bench_alloc.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvblocks  # noqa: E402
from _timing import measure, save, table  # noqa: E402
from pybaseline import PyBlockPool  # noqa: E402


def bench_alloc_free(rows, repeats):
    pool = kvblocks.BlockPool(1 << 16, enable_prefix_caching=True)
    py = PyBlockPool(1 << 16)
    for n in (1, 16, 128, 1024):
        inner = max(1, 20000 // n)

        def cycle(n=n):
            pool.free(pool.allocate(n))

        def pycycle(n=n):
            py.free(py.allocate(n))

        r = measure(cycle, inner=inner, repeats=repeats)
        p = measure(pycycle, inner=max(1, inner // 10), repeats=max(5, repeats // 4))
        rows.append({"op": f"allocate+free n={n}", "p50_ns": r["p50_ns"], "p99_ns": r["p99_ns"],
                     "ns_per_block": r["p50_ns"] / n, "python_ns_per_block": p["p50_ns"] / n,
                     "speedup": p["p50_ns"] / r["p50_ns"]})


def bench_fork_cow(rows, repeats):
    mgr = kvblocks.BlockManager(4096, 16)
    mgr.add("p", np.arange(100, dtype=np.int32))
    one = np.array([7], dtype=np.int32)

    def cycle():
        mgr.fork("p", "c")
        mgr.append("c", one)      # shared partial block: copy-on-write
        mgr.take_copies()
        mgr.free("c")

    r = measure(cycle, inner=2000, repeats=repeats)
    rows.append({"op": "fork+cow append+free", "p50_ns": r["p50_ns"], "p99_ns": r["p99_ns"]})


def bench_append_batch(rows, repeats, nseq=256, bs=16):
    mgr = kvblocks.BlockManager(nseq * 8 + 1, bs)
    ids = list(range(nseq))
    for i in ids:
        mgr.add(i, np.arange(i, i + 16 * 3, dtype=np.int32))  # block-aligned: 3 full blocks
        mgr.reserve(i, bs)                                     # room for one block of decode
    toks = np.arange(nseq, dtype=np.int32)
    batch = mgr.batch(ids)
    steps = bs - 1  # fill the reserved block short of full: no boundary crossed, no hashing

    def reset():
        for i in ids:
            mgr.truncate(i, 48)
            mgr.reserve(i, bs)

    for label, arg in (("list", ids), ("SeqBatch", batch)):
        r = measure(lambda: mgr.append_batch(arg, toks), inner=steps, repeats=repeats,
                    teardown=reset)
        rows.append({"op": f"append_batch 256 seqs ({label})", "p50_ns": r["p50_ns"],
                     "p99_ns": r["p99_ns"], "ns_per_block": r["p50_ns"] / nseq})
    # amortised over full blocks: crossing boundaries, hashing and caching blocks as they fill
    mgr2 = kvblocks.BlockManager(nseq * 40 + 1, bs)
    for i in ids:
        mgr2.add(i, np.arange(i, i + 48, dtype=np.int32))
    b2 = mgr2.batch(ids)

    def reset2():
        for i in ids:
            mgr2.truncate(i, 48)

    r = measure(lambda: mgr2.append_batch(b2, toks), inner=4 * bs, repeats=max(5, repeats // 2),
                teardown=reset2)
    rows.append({"op": "append_batch 256 seqs (with block fills)", "p50_ns": r["p50_ns"],
                 "p99_ns": r["p99_ns"], "ns_per_block": r["p50_ns"] / nseq})


def bench_build(rows, repeats, n=1_000_000):
    times = []
    for _ in range(max(3, repeats // 10)):
        t0 = time.perf_counter_ns()
        pool = kvblocks.BlockPool(n + 1)
        times.append(time.perf_counter_ns() - t0)
        bytes_per_block = pool.metadata_bytes / pool.num_blocks
        del pool
    t0 = time.perf_counter_ns()
    py = PyBlockPool(n + 1)
    py_ns = time.perf_counter_ns() - t0
    del py
    a = np.asarray(times)
    rows.append({"op": "build 1M-block pool", "p50_ns": float(np.median(a)),
                 "p99_ns": float(np.percentile(a, 99)), "bytes_per_block": bytes_per_block,
                 "python_ns": float(py_ns), "speedup": py_ns / float(np.median(a))})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args(argv)
    repeats = 15 if args.quick else 60
    rows: list = []
    bench_alloc_free(rows, repeats)
    bench_fork_cow(rows, repeats)
    bench_append_batch(rows, repeats)
    bench_build(rows, repeats)
    print(table(rows, ["op", "p50_ns", "p99_ns", "ns_per_block", "python_ns_per_block",
                       "speedup", "bytes_per_block"]))
    print("saved", save("bench_alloc", rows))


if __name__ == "__main__":
    main()
