"""What bench_alloc.py, bench_prefix.py and bench_metadata.py share: each runs one suite of
``kvblocks bench`` (the installed code, kvblocks/bench/) and writes its JSON as
bench/results/<suite>_<commit>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# an in-place build of this checkout wins; without one, the installed kvblocks is used
if any((REPO / "kvblocks").glob("_core*.so")) and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def result_path(suite: str) -> Path:
    from kvblocks.bench.machine import git_commit

    commit = (git_commit() or "unknown").split("+", 1)[0]
    return RESULTS / f"{suite}_{commit}.json"


def run_suite(suite: str, argv: Optional[List[str]] = None) -> Tuple[int, Path]:
    """``kvblocks bench SUITE --json bench/results/SUITE_<commit>.json [argv]``."""
    from kvblocks.__main__ import main

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(suite)
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        return main(["bench", "--help"]), path
    return main(["bench", suite, "--json", str(path), *args]), path
