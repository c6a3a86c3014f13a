"""Core allocator benchmarks: ``kvblocks bench alloc`` (allocate+free, fork + copy-on-write,
append_batch, building a 1M-block pool, bytes per block) against the pure-Python pool.

    python bench/bench_alloc.py [--quick] [any other 'kvblocks bench' flag]

Prints the table and writes bench/results/alloc_<commit>.json.
"""

import sys

from _suite import run_suite

if __name__ == "__main__":
    sys.exit(run_suite("alloc")[0])
