"""vLLM's KV cache manager vs kvblocks' under vLLM's scheduler API, same process (issue 26).

    python benchmarks/bench_vllm.py [--reps 7] [--requests 256] [--case full|hybrid|chunked|mamba|mixed|all]

A thin wrapper of ``kvblocks bench vllm`` (kvblocks/bench/vllm_manager.py has the workload
and the method) that writes benchmarks/results/bench_vllm.json (``--case all``) or
bench_vllm_<case>.json by default. Needs vllm==0.34.0 importable (.ci/vllm builds a venv with
it: run this with that venv's python and vLLM's source root on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvblocks.bench.vllm_manager import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument(
        "--case", choices=("full", "hybrid", "chunked", "mamba", "mixed", "all"), default="all"
    )
    ap.add_argument("--json", default=None, help="default: benchmarks/results/bench_vllm*.json")
    args = ap.parse_args()
    out = run(args.case, args.reps, args.requests)
    name = "bench_vllm.json" if args.case == "all" else f"bench_vllm_{args.case}.json"
    path = Path(args.json or Path(__file__).parent / "results" / name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
