"""Instruction counts of the core's hot paths, for same-binary comparisons on a noisy machine.

Run one case under callgrind twice, with N and 2N iterations, and take the difference over N
(the start-up, imports and set-up cancel out); callgrind counts instructions, so two builds
compare without timing noise:

    PY=$(python -c "import sys; print(sys.executable)")   # the real binary, not a shim
    for n in 200 400; do PYTHONHASHSEED=0 valgrind --tool=callgrind \
        --callgrind-out-file=/dev/null $PY benchmarks/callgrind_core.py decode $n 2>&1 |
        grep Collected; done

Cases: alloc (allocate + free of 128 blocks), one (allocate(1) + free: the one-element array
path; allocate_one + free_one where the build has them), decode (append_batch + metadata over
256 sequences at 2K context), grouped (the same with a full + window-128 manager, both groups'
metadata), step and grouped_step (the v2 step of decode and grouped: a SeqBatch,
append_batch, plan_step once, each group's metadata into fixed buffers), prefix (add of a cached 32K-token prompt: hash, lookup, pin; free), prefix_list
(the same prompt given as a Python list).
Results: benchmarks/results/callgrind_core.json.

OpenBLAS's worker threads (numpy's) spin while idle, and callgrind counts their instructions
too, in proportion to the run's length: the script sets ``OPENBLAS_NUM_THREADS=1`` before numpy
is imported (without it, a 256-sequence decode step of two groups counted 106k instructions of
``blas_thread_server`` beside the core's 64k).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: no spinning workers
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblocks import BlockManager, BlockPool  # noqa: E402

case, n = sys.argv[1], int(sys.argv[2])
if case == "alloc":
    pool = BlockPool(4096, enable_prefix_caching=True)
    for _ in range(n):
        ids = pool.allocate(128)
        pool.free(ids)
elif case == "one":
    pool = BlockPool(4096, enable_prefix_caching=True)
    if hasattr(pool, "allocate_one"):
        for _ in range(n):
            pool.free_one(pool.allocate_one())
    else:
        for _ in range(n):
            pool.free(pool.allocate(1))
elif case == "decode":
    mgr = BlockManager(40000, 16)
    seqs = list(range(256))
    for s in seqs:
        mgr.add(s, np.arange(1000 + s, 1000 + s + 2048, dtype=np.int32) % 30000)
    mgr.metadata(seqs, [2048] * 256)
    tok = np.ones(256, dtype=np.int32)
    for _ in range(n):
        mgr.append_batch(seqs, tok)
        mgr.metadata(seqs, [1] * 256)
elif case == "grouped":
    from kvblocks import KVGroup

    mgr = BlockManager(80000, 16, groups=(KVGroup("full"), KVGroup("sliding_window", window=128)))
    seqs = list(range(256))
    for s in seqs:
        mgr.add(s, np.arange(1000 + s, 1000 + s + 2048, dtype=np.int32) % 30000)
    for g in (0, 1):
        mgr.metadata(seqs, [2048] * 256, group=g)
    tok = np.ones(256, dtype=np.int32)
    for _ in range(n):
        mgr.append_batch(seqs, tok)
        mgr.metadata(seqs, [1] * 256, group=0)
        mgr.metadata(seqs, [1] * 256, group=1)
elif case in ("step", "grouped_step"):  # the v2 step: planned once, metadata into buffers
    from kvblocks import AttentionMetadata, KVGroup

    groups = (KVGroup("full"), KVGroup("sliding_window", window=128))
    mgr = BlockManager(80000, 16, groups=groups if case == "grouped_step" else None)
    for s in range(256):
        mgr.add(s, np.arange(1000 + s, 1000 + s + 2048, dtype=np.int32) % 30000)
    sb = mgr.batch(list(range(256)))
    mgr.plan_step(sb, np.full(256, 2048, dtype=np.int32))
    ng = 2 if case == "grouped_step" else 1
    width = (2048 + n) // 16 + 2  # the table's blocks after n more tokens, and room
    bufs = [AttentionMetadata.allocate(256, 256, 256 * width, width) for _ in range(ng)]
    tok = np.ones(256, dtype=np.int32)
    ones = np.ones(256, dtype=np.int32)
    for _ in range(n):
        mgr.append_batch(sb, tok)
        step = mgr.plan_step(sb, ones)
        for g in range(ng):
            step.metadata(g, out=bufs[g])
elif case in ("prefix", "prefix_list"):
    mgr = BlockManager(8192, 16)
    toks = np.arange(32768, dtype=np.int32)
    if case == "prefix_list":
        toks = toks.tolist()
    mgr.add("warm", toks)
    mgr.metadata(["warm"], [32768])
    mgr.free("warm")
    for i in range(n):
        mgr.add(i, toks)
        mgr.free(i)
else:
    raise SystemExit(
        f"unknown case {case!r}: alloc, one, decode, grouped, step, grouped_step, prefix or "
        "prefix_list"
    )
