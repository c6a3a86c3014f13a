"""The decode step with KV cache groups under memory pressure (docs/hybrid-models.md, "Eviction
across groups").

    python benchmarks/bench_groups_pressure.py [--runs N]

256 sequences decode at about 2K tokens of context with a full and a sliding-window (128)
group, block size 16. The pool leaves no never-used block: once the window groups have
released their old blocks, every evictable block is a window block whose full-attention twin
is held, so every allocation evicts and meets the second-chance rule. Reported per run: the
step's ``append_batch`` p50, p99 and max (the max is the one step that gives every evictable
block its one move, at the onset of pressure), beside the same step on a roomy pool where no
allocation evicts. Writes benchmarks/results/groups_pressure.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblocks import BlockManager, KVGroup  # noqa: E402

BS, NSEQ, CONTEXT, WINDOW = 16, 256, 2048, 128
WARM, TIMED = 600, 1000  # steps before timing (the window groups release), steps timed


def one_run(roomy: bool, seed: int) -> Dict[str, float]:
    groups = (KVGroup("full"), KVGroup("sliding_window", window=WINDOW))
    per = CONTEXT // BS
    # full tables and window blocks held, plus the released window blocks still cached
    nb = NSEQ * (per + 2) + NSEQ * (WINDOW // BS + 3) + NSEQ * per
    if roomy:
        nb += 2 * NSEQ * (WARM + TIMED) // BS + NSEQ * per
    mgr = BlockManager(nb, BS, groups=groups)
    rng = np.random.default_rng(seed)
    ids = list(range(NSEQ))
    for i in ids:
        mgr.add(i, rng.integers(0, 32000, CONTEXT + i % BS, dtype=np.int32))
    batch = mgr.batch(ids)
    mgr.schedule(batch, [mgr.num_tokens(i) for i in ids])
    toks = rng.integers(0, 32000, NSEQ, dtype=np.int32)
    ones = np.ones(NSEQ, np.int32)
    for _ in range(WARM):
        mgr.append_batch(batch, toks)
        mgr.schedule(batch, ones)
    evictions = mgr.pool.stats["evictions"]
    ts: List[int] = []
    for _ in range(TIMED):
        t0 = time.perf_counter_ns()
        mgr.append_batch(batch, toks)
        ts.append(time.perf_counter_ns() - t0)
        mgr.schedule(batch, ones)
    arr = np.array(ts) / 1e3
    mgr.check()
    return {
        "p50_us": round(float(np.median(arr)), 2),
        "p99_us": round(float(np.percentile(arr, 99)), 2),
        "max_us": round(float(arr.max()), 1),
        "evictions": int(mgr.pool.stats["evictions"] - evictions),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    out = {"pressure": [], "roomy": []}
    for r in range(args.runs):
        for kind in ("pressure", "roomy"):
            res = one_run(kind == "roomy", seed=r)
            out[kind].append(res)
            print(
                f"run {r + 1} {kind:8s} p50 {res['p50_us']:6.1f} us  p99 {res['p99_us']:6.1f} us"
                f"  max {res['max_us']:7.1f} us  evictions {res['evictions']}"
            )
    assert all(r["evictions"] > 0 for r in out["pressure"]), "the pressured run evicted nothing"
    assert all(r["evictions"] == 0 for r in out["roomy"]), "the roomy run evicted"
    path = Path(__file__).resolve().parent / "results" / "groups_pressure.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
