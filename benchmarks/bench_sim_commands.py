"""Time the simulator's commands of issue 27 as a user runs them: wall and user CPU seconds.

    python benchmarks/bench_sim_commands.py [--reps 3] [--only simulate,plan10,...]

Each command runs ``--reps`` times as a subprocess (``python -m kvblocks ...``), interleaved
(one of each, then again), with its wall time and its user CPU time (``getrusage`` of the
child); the table gives the median of each, their range, and the load average around the
runs (this machine is shared: wall time moves with others' work, user time much less). The
plan commands also report their configurations: the search space (families x replica
counts), the candidates the search evaluated (replayed or proven to miss by the TTFT floor)
and the replays. Reads ../shared/traces/mooncake_conversation_trace.jsonl relative to the
repository (skips, exit 0, when it is missing); writes JSON to
benchmarks/results/sim_commands_<commit>.json. Targets (issue 27): ``simulate --trace`` (one
GPU, defaults) at most 10 s; a plan of about 50 configurations at most 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvblocks.bench.machine import git_commit  # noqa: E402
from kvblocks.bench.report import save  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"

PLAN70 = ["plan", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--no-progress", "--json"]
# name: (arguments after "python -m kvblocks", the plan's search space or 0)
COMMANDS: Dict[str, Tuple[List[str], int]] = {
    "simulate": (["simulate", "--trace", "{T}"], 0),
    "simulate_no_contiguous": (["simulate", "--trace", "{T}", "--no-contiguous"], 0),
    # 1 GPU x TP 1,2,4,8 x replicas 1-8 = 32 configurations
    "plan2": ([*PLAN70, "--trace", "{T}", "--ttft-p99", "2"], 32),
    "plan10": ([*PLAN70, "--trace", "{T}", "--ttft-p99", "10"], 32),
    # 2 GPUs x TP 4,8 x KV bf16,fp8 x replicas 1-6 = 48 configurations
    "plan10_48": (
        [
            "plan",
            "--model",
            "llama-3.1-70b",
            "--gpu",
            "h100-sxm,h200",
            "--tp",
            "4,8",
            "--kv-dtypes",
            "bf16,fp8",
            "--replicas",
            "1-6",
            "--trace",
            "{T}",
            "--ttft-p99",
            "10",
            "--no-progress",
            "--json",
        ],
        48,
    ),  # fmt: skip
}


def run_once(argv: List[str]) -> Dict[str, Any]:
    """One run: wall and user seconds of the child, the load average before, its stdout."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "kvblocks", *argv], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "load": load,
            "stdout": out}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help=f"comma-separated names of: {', '.join(COMMANDS)}")
    args = ap.parse_args()
    if not Path(args.trace).exists():
        print(f"skipped: {args.trace} not found")
        return 0
    names = args.only.split(",") if args.only else list(COMMANDS)
    for n in names:
        if n not in COMMANDS:
            ap.error(f"unknown command {n!r} (known: {', '.join(COMMANDS)})")
    runs: Dict[str, List[Dict[str, Any]]] = {n: [] for n in names}
    for _ in range(args.reps):
        for n in names:
            argv = [a.replace("{T}", args.trace) for a in COMMANDS[n][0]]
            runs[n].append(run_once(argv))
    print(
        f"bench_sim_commands: {Path(args.trace).name}, medians of {args.reps} runs (wall, user CPU)"
    )
    print(
        f"  {'command':<24}{'wall s':>9}{'user s':>9}  {'wall range':>13}  {'load':>9}  configurations"
    )
    results: Dict[str, Any] = {}
    for n in names:
        rs = runs[n]
        wall = statistics.median(r["wall_s"] for r in rs)
        user = statistics.median(r["user_s"] for r in rs)
        loads = [r["load"] for r in rs]
        row: Dict[str, Any] = {
            "argv": COMMANDS[n][0],
            "wall_s_median": wall,
            "user_s_median": user,
            "wall_s": [r["wall_s"] for r in rs],
            "user_s": [r["user_s"] for r in rs],
            "load_avg_1min": loads,
        }
        conf = ""
        if COMMANDS[n][1]:
            doc = json.loads(rs[-1]["stdout"])
            row.update(space=COMMANDS[n][1], evaluated=len(doc["frontier"]),
                       replays=doc["replays"],
                       answer=doc["answer"]["config"] if doc.get("answer") else None)  # fmt: skip
            conf = (f"{row['space']} in the space, {row['evaluated']} evaluated, "
                    f"{row['replays']} replayed; answer: {row['answer']}")  # fmt: skip
        results[n] = row
        rng = f"{min(row['wall_s']):.1f}-{max(row['wall_s']):.1f}"
        print(
            f"  {n:<24}{wall:>9.2f}{user:>9.2f}  {rng:>13}  {min(loads):>4.1f}-{max(loads):<4.1f}  {conf}"
        )
    commit = (git_commit() or "unknown").split("+", 1)[0][:7]
    rows = [{"command": n, **row} for n, row in results.items()]
    extra = {"trace": Path(args.trace).name, "reps": args.reps}
    path = save(f"sim_commands_{commit}", rows, extra, REPO / "benchmarks" / "results")
    print(f"  wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
