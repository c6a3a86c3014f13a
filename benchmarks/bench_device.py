#!/usr/bin/env python
"""Bandwidth of kvblocks.ops.copy_blocks and swap_blocks against a plain copy of the same bytes.

Baselines, measured in the same process on the same buffers:
  * CPU: one numpy fancy-index copy ``planes[:, dst] = planes[:, src]`` (``planes`` is the
    cache's own ``[layers, blocks, bytes]`` uint8 view), i.e. what plain numpy does;
  * CUDA: one device-to-device ``cudaMemcpyAsync`` of the same number of bytes (copy_blocks)
    and one device-to-pinned-host copy of the same bytes (swap_blocks).

Block sizes (all layers, K and V) 16 KiB, 256 KiB and 2 MiB; 1 to 10,000 pairs, the pair count
capped so one call moves at most --max-mib MiB (default 256; memory stays < 2 GiB). Reports p50
and p99 over --repeats timed calls after one warm-up call, with GC off, as GB/s (bytes moved
per second: the bytes read once, written once counted once) and ns per block.

    python benchmarks/bench_device.py             # CPU, ~1 minute on 2 cores
    python benchmarks/bench_device.py --quick     # a few seconds
    python benchmarks/bench_device.py --device cuda

Writes benchmarks/results/device-<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from typing import Callable, Dict, List

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvblocks import KVCache, KVLayout, ops  # noqa: E402
from kvblocks.bench.timing import timer_overhead_ns  # noqa: E402

# (label, layers, kv_heads, head_dim, block_size) in bf16
SIZES = [
    ("16KiB", 8, 1, 64, 8),
    ("256KiB", 16, 4, 128, 8),
    ("2MiB", 32, 8, 128, 16),  # Llama-3-8B
]
PAIRS = [1, 10, 100, 1000, 10000]


def measure(fn: Callable[[], None], repeats: int, sync: Callable[[], None]) -> np.ndarray:
    """One call per sample, each closed by a device sync (kvblocks.bench.timing's loops time
    host work only)."""
    fn()
    sync()  # warm-up (kernel compile, page faults)
    out = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        out[i] = time.perf_counter_ns() - t0
    return out


def device_name(device: str) -> str:
    if device == "cuda":
        import cupy as cp

        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        return "cuda-" + "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
    return f"cpu-{os.cpu_count()}core-{platform.machine()}"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        return ""


def run(device: str, quick: bool, repeats: int, max_mib: int) -> Dict:
    cuda = device == "cuda"
    if cuda:
        import cupy as cp

        stream = cp.cuda.get_current_stream()
        sync = stream.synchronize
    else:
        sync = lambda: None  # noqa: E731
    rng = np.random.default_rng(0)
    rows: List[Dict] = []
    sizes = SIZES[:2] if quick else SIZES
    pair_counts = [p for p in PAIRS if p <= (1000 if quick else 10000)]
    for label, layers, heads, dim, bs in sizes:
        lay = KVLayout(layers, heads, dim, bs, "bf16")
        cap = max(1, (max_mib << 20) // lay.bytes_per_block)
        counts = [p for p in pair_counts if p <= cap]
        if cap < pair_counts[-1] and cap >= 2 * counts[-1]:
            counts.append(cap)  # the largest count that fits the per-call byte cap
        for n in counts:
            nbytes = n * lay.bytes_per_block
            cache = KVCache(lay, 2 * n, device=device)
            perm = rng.permutation(2 * n)
            pairs = np.stack([perm[:n], perm[n:]], axis=1).astype(np.int64)
            src, dst = pairs[:, 0].copy(), pairs[:, 1].copy()
            planes = cache.planes
            res = {}
            res["copy_blocks"] = measure(lambda: ops.copy_blocks(cache, pairs), repeats, sync)
            if cuda:
                flat = cache._raw
                half = nbytes
                base = lambda: cp.cuda.runtime.memcpyAsync(  # noqa: E731
                    flat.data.ptr + half, flat.data.ptr, half, 3, stream.ptr
                )
            else:

                def base() -> None:
                    planes[:, dst] = planes[:, src]

            res["copy_baseline"] = measure(base, repeats, sync)
            host = KVCache(lay, n, device="cpu")
            hperm = rng.permutation(n)
            swap_pairs = np.stack([src, hperm], axis=1)
            seq_pairs = np.stack([np.arange(n), np.arange(n)], axis=1)
            res["swap_random"] = measure(
                lambda: ops.swap_blocks(cache, host, swap_pairs), repeats, sync
            )
            res["swap_contig"] = measure(
                lambda: ops.swap_blocks(cache, host, seq_pairs), repeats, sync
            )
            if cuda:
                hflat = host._raw
                sbase = lambda: cp.cuda.runtime.memcpyAsync(  # noqa: E731
                    hflat.ctypes.data, flat.data.ptr, nbytes, 4, stream.ptr
                )
            else:
                hplanes = host.planes

                def sbase() -> None:
                    hplanes[:, hperm] = planes[:, src]

            res["swap_baseline"] = measure(sbase, repeats, sync)
            row = {"block": label, "block_bytes": lay.bytes_per_block, "pairs": n, "bytes": nbytes}
            for k, t in res.items():
                p50, p99 = float(np.percentile(t, 50)), float(np.percentile(t, 99))
                row[k] = {
                    "p50_ns": p50,
                    "p99_ns": p99,
                    "gbps_p50": nbytes / p50,
                    "ns_per_block_p50": p50 / n,
                }
            row["copy_ratio"] = float(
                np.percentile(res["copy_blocks"], 50) / np.percentile(res["copy_baseline"], 50)
            )
            row["swap_ratio"] = float(
                np.percentile(res["swap_random"], 50) / np.percentile(res["swap_baseline"], 50)
            )
            rows.append(row)
            print_row(row)
            del cache, host, planes
            gc.collect()
    return {"rows": rows}


HEADER = (
    f"{'block':>7} {'pairs':>6} {'MiB':>7} | {'copy GB/s':>9} {'p99 ms':>7} {'base GB/s':>9} "
    f"{'ratio':>5} | {'swap GB/s':>9} {'contig':>7} {'base GB/s':>9} {'ratio':>5} {'ns/blk':>8}"
)


def print_row(r: Dict) -> None:
    print(
        f"{r['block']:>7} {r['pairs']:>6} {r['bytes'] / 2**20:>7.1f} | "
        f"{r['copy_blocks']['gbps_p50']:>9.2f} {r['copy_blocks']['p99_ns'] / 1e6:>7.2f} "
        f"{r['copy_baseline']['gbps_p50']:>9.2f} {r['copy_ratio']:>5.2f} | "
        f"{r['swap_random']['gbps_p50']:>9.2f} {r['swap_contig']['gbps_p50']:>7.2f} "
        f"{r['swap_baseline']['gbps_p50']:>9.2f} {r['swap_ratio']:>5.2f} "
        f"{r['copy_blocks']['ns_per_block_p50']:>8.0f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and pair counts")
    ap.add_argument(
        "--repeats", type=int, default=None, help="timed calls per case (default 15, quick 5)"
    )
    ap.add_argument(
        "--max-mib",
        type=int,
        default=None,
        help="cap on MiB moved per call (default 256, quick 32)",
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/device-<device>.json)"
    )
    args = ap.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    max_mib = args.max_mib or (32 if args.quick else 256)
    gc.disable()
    overhead = timer_overhead_ns()
    name = device_name(args.device)
    print(
        f"kvblocks device bench: {name}, repeats={repeats}, max {max_mib} MiB/call, "
        f"timer overhead {overhead:.0f} ns, ratio = kvblocks p50 / baseline p50 (lower is better)"
    )
    print(HEADER)
    t0 = time.time()
    result = run(args.device, args.quick, repeats, max_mib)
    result.update(
        {
            "device": name,
            "commit": git_commit(),
            "numpy": np.__version__,
            "python": platform.python_version(),
            "repeats": repeats,
            "max_mib": max_mib,
            "quick": args.quick,
            "timer_overhead_ns": overhead,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "wall_s": round(time.time() - t0, 1),
        }
    )
    ratios = [r["copy_ratio"] for r in result["rows"]]
    print(
        f"copy_blocks / numpy fancy-index copy: median ratio {np.median(ratios):.2f}, worst {max(ratios):.2f}"
        f" ({result['wall_s']} s)"
    )
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)),
        "results",
        f"device-{name}{'-quick' if args.quick else ''}.json",
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
