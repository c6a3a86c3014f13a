"""The steady-state decode step as the batch grows: append_batch + metadata into fixed buffers.

256, 1,024 and 4,096 sequences at a 4K-token context (block size 16, contexts staggered by one
token so that a sixteenth of the batch crosses a block boundary each step), 200 steps, the
first 20 dropped; medians and p99 per step and per sequence, with FlashInfer's page list
(``kv_indices``) and without it (``AttentionMetadata.allocate(..., kv_indices=False)``, for
engines that read ``block_tables``). GC off.

Warm and cold: a step timed warm follows the previous step at once, so the manager's arrays
are still in the CPU caches. An engine runs a model forward and its own Python scheduler
between two steps, which evicts them: the cold figures write a buffer of twice the last-level
cache (``--evict-mib``, default 64 MiB: this machine's L3 is 32 MiB) before each timed step,
so every record, table and pool entry the step touches comes from memory. Run:

    python benchmarks/bench_decode_scaling.py [--steps N] [--sizes 256,1024,4096]
        [--evict-mib 64] [--save]    # --save: benchmarks/results/decode_scaling_<commit>.json
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblocks import AttentionMetadata, BlockManager  # noqa: E402
from kvblocks.bench.machine import git_commit  # noqa: E402
from kvblocks.bench.report import save  # noqa: E402

BS, CTX, WARM = 16, 4096, 20


def run(nseq: int, page_list: bool, steps: int, evict):
    """Per-step append_batch and metadata times in ns; `evict` (a uint8 array or None) is
    rewritten before each step, untimed."""
    per = -(-(CTX + steps + 2 * BS) // BS)
    mgr = BlockManager(nseq * (per + 1) + 64, BS)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, CTX + BS, dtype=np.int32)
    for i in range(nseq):
        mgr.add(i, base[: CTX + i % BS])
    sb = mgr.batch(range(nseq))
    mgr.schedule(sb, [mgr.num_tokens(i) for i in range(nseq)])
    toks = rng.integers(0, 32000, nseq, dtype=np.int32)
    ones = np.ones(nseq, dtype=np.int32)
    buf = AttentionMetadata.allocate(
        nseq, nseq, nseq * (per + 1) if page_list else 1, per + 1, kv_indices=page_list
    )
    app, meta = [], []
    for k in range(steps):
        if evict is not None:
            evict.fill(k & 0xFF)  # every cache line written: the step's data is evicted
        t0 = time.perf_counter_ns()
        mgr.append_batch(sb, toks)
        t1 = time.perf_counter_ns()
        mgr.metadata(sb, ones, out=buf)
        t2 = time.perf_counter_ns()
        app.append(t1 - t0)
        meta.append(t2 - t1)
    return np.array(app[WARM:], dtype=np.float64), np.array(meta[WARM:], dtype=np.float64)


def summary(app, meta, nseq):
    step = app + meta
    return {
        "step_p50_us": float(np.median(step)) / 1e3,
        "step_p99_us": float(np.percentile(step, 99)) / 1e3,
        "append_batch_p50_us": float(np.median(app)) / 1e3,
        "append_batch_ns_per_seq": float(np.median(app)) / nseq,
        "metadata_p50_us": float(np.median(meta)) / 1e3,
        "metadata_ns_per_seq": float(np.median(meta)) / nseq,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--evict-mib", type=int, default=64)
    ap.add_argument("--save", action="store_true", help="write the JSON under results/")
    a = ap.parse_args(argv)
    if a.steps <= WARM or a.evict_mib < 1:
        ap.error(f"--steps must be > {WARM} and --evict-mib >= 1")
    sizes = [int(x) for x in a.sizes.split(",")]
    evict = np.zeros(a.evict_mib << 20, dtype=np.uint8)
    gc.disable()
    rows = []
    for page_list in (True, False):
        print("with FlashInfer's page list" if page_list else "without the page list")
        for n in sizes:
            w = summary(*run(n, page_list, a.steps, None), n)
            c = summary(*run(n, page_list, a.steps, evict), n)
            rows.append({"seqs": n, "page_list": page_list, "warm": w, "cold": c})
            for name, r in (("warm", w), ("cold", c)):
                print(
                    f"  {n:5d} seqs {name}: step {r['step_p50_us']:7.1f} us "
                    f"(p99 {r['step_p99_us']:7.1f})  append_batch {r['append_batch_p50_us']:6.1f} us "
                    f"({r['append_batch_ns_per_seq']:4.0f} ns/seq)  metadata "
                    f"{r['metadata_p50_us']:6.1f} us ({r['metadata_ns_per_seq']:4.0f} ns/seq)"
                )
    if a.save:
        commit = (git_commit() or "unknown").split("+", 1)[0][:7]
        extra = {"context": CTX, "block_size": BS, "steps": a.steps, "evict_mib": a.evict_mib}
        print(f"saved {save(f'decode_scaling_{commit}', rows, extra)}")


if __name__ == "__main__":
    main()
