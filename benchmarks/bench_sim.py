"""Time a full replay of the Mooncake conversation trace through kvblocks.BlockManager.

    python benchmarks/bench_sim.py [--block-size 16] [--model llama-3.1-8b] [--gpu-mem 80] [--limit N]

Reads ../shared/traces/mooncake_conversation_trace.jsonl relative to the repository (skips,
exit 0, when it is missing), replays it with the paged scheduler (the contiguous baseline is
timed separately), prints a table and writes JSON to benchmarks/results/sim_<commit>.json. The
target is under 60 s for the whole trace (12,031 requests, ~4.1M decoded tokens) with
16-token blocks on a 2-core machine; "allocator share" is the wall time spent inside
BlockManager calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvblocks.sim import (  # noqa: E402
    SchedulerConfig,
    TimeModel,
    get_model,
    load_workload,
    memory_bill,
    simulate_contiguous,
    simulate_paged,
)

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpu-mem", type=float, default=80.0)
    ap.add_argument("--limit", type=int)
    args = ap.parse_args()
    if not Path(args.trace).exists():
        print(f"skipped: {args.trace} not found")
        return 0
    t0 = time.perf_counter()
    workload = load_workload(args.trace, limit=args.limit)
    load_s = time.perf_counter() - t0
    model = get_model(args.model)
    bill = memory_bill(model, args.gpu_mem, args.block_size)
    tm = TimeModel.for_model(model)
    cfg = SchedulerConfig(
        num_blocks=bill.num_blocks, block_size=args.block_size, block_bytes=bill.block_bytes
    )
    gc.disable()
    try:
        t0 = time.perf_counter()
        paged = simulate_paged(workload, cfg, tm)
        paged_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        contig = simulate_contiguous(workload, cfg, tm, int(workload.stats()["max_total"]))
        contig_s = time.perf_counter() - t0
    finally:
        gc.enable()
    ps = paged.summary
    decoded = int(ps["output_tokens"])
    rows = [
        ("requests", f"{len(workload):,}"),
        ("prompt tokens added", f"{ps['prompt_tokens']:,}"),
        ("output tokens", f"{decoded:,}"),
        ("engine steps", f"{ps['steps']:,}"),
        ("trace load (s)", f"{load_s:.2f}"),
        ("paged replay wall (s)", f"{paged_s:.2f}"),
        (
            "  inside BlockManager (s)",
            f"{ps['allocator_s']:.2f} ({100 * ps['allocator_share']:.1f}%)",
        ),
        ("  ns per decoded token", f"{1e9 * paged_s / max(1, decoded):.0f}"),
        ("contiguous replay wall (s)", f"{contig_s:.2f}"),
        ("prefix hit rate", f"{100 * ps['prefix_hit_rate']:.1f}%"),
        ("preemptions / evictions", f"{ps['preemptions']:,} / {ps['evictions']:,}"),
    ]
    print(
        f"bench_sim: {Path(args.trace).name}, {model.name}, {args.gpu_mem:g} GiB, block size {args.block_size}"
    )
    for k, v in rows:
        print(f"  {k:<28}{v:>24}")
    print(f"  target: paged replay < 60 s -> {'OK' if paged_s < 60 else 'MISSED'}")
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sim_{commit()}.json"
    doc = {
        "bench": "bench_sim",
        "commit": commit(),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "trace": Path(args.trace).name,
        "model": model.name,
        "gpu_mem_gib": args.gpu_mem,
        "block_size": args.block_size,
        "load_s": load_s,
        "paged_wall_s": paged_s,
        "contiguous_wall_s": contig_s,
        "paged": ps,
        "contiguous": contig.summary,
    }
    path.write_text(json.dumps(doc, indent=2, default=float))
    print(f"  wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
