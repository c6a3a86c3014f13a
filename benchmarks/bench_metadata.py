"""Attention-metadata benchmarks: ``kvblocks bench metadata`` (BlockManager.metadata for a
256 x 4,096-token decode and a 32 x 2,048-token prefill, against two numpy builders).

    python bench/bench_metadata.py [--quick] [any other 'kvblocks bench' flag]

Prints the table and writes bench/results/metadata_<commit>.json.
"""

import sys

from _suite import run_suite

if __name__ == "__main__":
    sys.exit(run_suite("metadata")[0])
