"""Prefix-cache benchmarks: ``kvblocks bench prefix`` (hashing a 32K-token prompt, lookup and
lookup_and_pin of 2,048 cached blocks, allocation evicting cached blocks) against the
pure-Python pool; then, from this checkout only, the hit-rate-versus-capacity curve of the
Mooncake traces (../shared/traces) replayed through BlockManager.

    python benchmarks/bench_prefix.py [--quick] [--no-curve] [any other 'kvblocks bench' flag]

Prints the tables and writes benchmarks/results/prefix_<commit>.json (the curve under
"hit_rate_curve").
"""

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
TRACES = REPO.parent / "shared" / "traces"
# an in-place build of this checkout wins; without one, the installed kvblocks is used
if any((REPO / "kvblocks").glob("_core*.so")) and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run_suite(suite, argv):
    """``kvblocks bench SUITE --json benchmarks/results/SUITE_<commit>.json [argv]``."""
    from kvblocks.__main__ import main
    from kvblocks.bench.machine import git_commit

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{suite}_{(git_commit() or 'unknown').split('+', 1)[0]}.json"
    if any(a in ("-h", "--help") for a in argv):
        return main(["bench", "--help"]), path
    return main(["bench", suite, "--json", str(path), *argv]), path


def hit_rate_curve(quick):
    import kvblocks
    from kvblocks.sim.workload.tokens import TokenBook

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
            for i, p in enumerate(prompts):  # one request at a time: capacity = cache size
                cached = mgr.add(i, p)
                mgr.schedule([i], [len(p) - cached])  # computed, so its full blocks are cached
                mgr.free(i)
            dt = time.perf_counter() - t0
            s = mgr.pool.stats
            out.append(
                {
                    "trace": name,
                    "blocks": blocks,
                    "capacity_tokens": blocks * 16,
                    "hit_rate_pct": round(100 * s.hit_rate, 2),
                    "evictions": s.evictions,
                    "replay_s": round(dt, 3),
                }
            )
    return out


def main(argv):
    no_curve = "--no-curve" in argv
    rc, path = run_suite("prefix", [a for a in argv if a != "--no-curve"])
    if rc or no_curve or "--help" in argv or "-h" in argv:
        return rc
    curve = hit_rate_curve("--quick" in argv)
    if curve:
        cols = list(curve[0])
        print()
        print("  ".join(cols))
        for r in curve:
            print("  ".join(str(r[c]).rjust(len(c)) for c in cols))
        doc = json.loads(path.read_text())
        doc["hit_rate_curve"] = curve
        path.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
