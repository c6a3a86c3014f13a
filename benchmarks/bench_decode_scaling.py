"""The steady-state decode step as the batch grows: append_batch + metadata into fixed buffers.

256, 1,024 and 4,096 sequences at a 4K-token context (block size 16, contexts staggered by one
token so that a sixteenth of the batch crosses a block boundary each step), 200 steps, the
first 20 dropped; medians per step and per sequence, with FlashInfer's page list
(``kv_indices``) and without it (``AttentionMetadata.allocate(..., kv_indices=False)``, for
engines that read ``block_tables``). GC off. Run:

    python benchmarks/bench_decode_scaling.py
"""

import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblocks import AttentionMetadata, BlockManager  # noqa: E402

BS, CTX, STEPS, WARM = 16, 4096, 200, 20


def run(nseq: int, page_list: bool):
    per = -(-(CTX + STEPS + 2 * BS) // BS)
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
    for _ in range(STEPS):
        t0 = time.perf_counter_ns()
        mgr.append_batch(sb, toks)
        t1 = time.perf_counter_ns()
        mgr.metadata(sb, ones, out=buf)
        t2 = time.perf_counter_ns()
        app.append(t1 - t0)
        meta.append(t2 - t1)
    return np.median(app[WARM:]) / 1e3, np.median(meta[WARM:]) / 1e3


def main() -> None:
    gc.disable()
    for page_list in (True, False):
        print("with FlashInfer's page list" if page_list else "without the page list")
        for n in (256, 1024, 4096):
            a, m = run(n, page_list)
            print(
                f"  {n:5d} seqs: step {a + m:7.1f} us  append_batch {a:6.1f} us "
                f"({a * 1e3 / n:4.0f} ns/seq)  metadata {m:6.1f} us ({m * 1e3 / n:4.0f} ns/seq)"
            )


if __name__ == "__main__":
    main()
