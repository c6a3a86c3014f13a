"""``kvblocks bench``: the subcommand's arguments and its run (dispatched by kvblocks/__main__.py).

Everything a user can get wrong (an unknown suite, an unreadable or mismatched ``--compare``
file, ``--plot`` without matplotlib, a missing output folder) is checked before any timing
starts and raises :class:`~kvblocks.bench.errors.BenchError`: one ``kvblocks: error:`` line,
status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

from .errors import BenchError

__all__ = ["add_command", "run", "run_vllm"]

MAX_SAMPLES = 100_000

EPILOG = """\
suites:
  alloc      allocate+free (n = 1, 16, 128, 1024), fork + copy-on-write, append_batch (list,
             SeqBatch, with block fills), building a 1M-block pool, bytes per block
  prefix     hash_blocks, lookup, lookup_and_pin, allocation evicting cached blocks
  metadata   BlockManager.metadata, decode 256x4096 and prefill 32x2048, against numpy
  tier       the host tier of the prefix cache against the same calls without one: evicting
             allocation with demotion (write-back, write-through), caching with write-through,
             add and probe of a prompt cached on the host (docs/host-tier.md)
  groups     KV cache groups (full + sliding window) against one full group: append_batch of a
             decode step over 256 sequences that releases what the window left behind (2K
             context; 1K, 8K and 32K with windows 128 and 1,024), metadata of one group
             (docs/hybrid-models.md)
  all        the five above (the default)
  vllm       vLLM's KV cache manager against kvblocks' (kvblocks.integrations.vllm) under
             vLLM's scheduler API: admission, decode and free of 256 requests sharing 4 system
             prompts, medians of --reps interleaved runs, --case full|hybrid|chunked|mamba|mixed|all;
             runs alone, not part of all; without vllm it prints "skipped: vllm not
             importable" and exits 0 (docs/vllm.md)

Every operation is also timed, in the same run and the same harness, against a baseline:
alloc and prefix on the bundled pure-Python vLLM-style pool (and on vLLM's own BlockPool when
vllm is importable; "x python" is its p50 over kvblocks' p50), metadata on numpy, tier on a
manager without a host tier, groups on a single full group. See docs/benchmarking.md.

examples:
  kvblocks bench alloc
  kvblocks bench all --json before.json
  kvblocks bench all --compare before.json --plot latency.png
  kvblocks bench prefix --quick
  kvblocks bench vllm --case hybrid --reps 5 --json vllm.json
"""


def _samples(text: str) -> int:
    try:
        n = int(text, 10)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_SAMPLES:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [1, {MAX_SAMPLES:,}], not {text[:40]!r}"
        )
    return n


def add_command(sub: "argparse._SubParsersAction") -> None:
    """Add ``bench`` to the subcommands of the ``kvblocks`` parser."""
    p = sub.add_parser(
        "bench",
        help="allocation-latency microbenchmarks on this machine, against a pure-Python pool",
        description="Time kvblocks' allocator on this machine: p50, p99 and ns per block or call "
        "for every operation, timer overhead subtracted, GC off, with same-run ratios against a "
        "baseline (a pure-Python vLLM-style block pool, numpy, or kvblocks without the feature).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help="alloc, prefix, metadata, groups, tier or all (default all); or vllm alone",
    )
    p.add_argument("--quick", action="store_true", help="fewer samples: seconds per suite, noisier")
    p.add_argument(
        "--samples", type=_samples, metavar="N", help="at most N samples per case (a smoke test)"
    )
    p.add_argument(
        "--json", metavar="FILE", help="write the results as JSON ('-': to stdout, no table)"
    )
    p.add_argument("--compare", metavar="FILE", help="ratios against an earlier --json FILE")
    p.add_argument(
        "--plot", metavar="FILE", help="latency histograms and CDFs (PNG/SVG/PDF; needs matplotlib)"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.add_argument(
        "--progress", action="store_true", help="progress bar even when stderr is not a terminal"
    )
    p.add_argument(
        "--no-vllm", action="store_true", help="do not time vLLM's BlockPool even if importable"
    )
    v = p.add_argument_group("the vllm suite")
    v.add_argument(
        "--case",
        choices=("full", "hybrid", "chunked", "mamba", "mixed", "all"),
        default="all",
        help="default all",
    )
    v.add_argument("--reps", type=_samples, default=7, metavar="N", help="runs (default 7)")
    v.add_argument(
        "--requests", type=_samples, default=256, metavar="N", help="requests (default 256)"
    )


def _command(args: argparse.Namespace, suites: List[str]) -> str:
    parts = ["kvblocks", "bench", *suites]
    if args.quick:
        parts.append("--quick")
    if args.samples:
        parts += ["--samples", str(args.samples)]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Check every input, then time the suites and write the outputs asked for."""
    from .report import compare, format_report, load_baseline
    from .runner import resolve_suites
    from .runner import run as run_bench

    if "vllm" in args.suites:
        return run_vllm(args)
    suites = resolve_suites(args.suites)
    old = load_baseline(args.compare, suites) if args.compare else None
    if args.plot:
        from .plot import check_plot

        check_plot(args.plot)
    if args.json and args.json != "-":
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            raise BenchError(f"--json {args.json}: no such folder {folder}")
    show = not args.quiet and (args.progress or sys.stderr.isatty())
    res = run_bench(
        suites,
        quick=args.quick,
        max_samples=args.samples,
        progress=show,
        use_vllm=not args.no_vllm,
        command=_command(args, suites),
    )
    doc = res.doc
    if old is not None:
        doc["compare"] = compare(doc, old, args.compare)
    text = json.dumps(doc, indent=1)
    wrote = []
    if args.json == "-":
        print(text)
    else:
        print(format_report(doc))
        if args.json:
            try:
                with open(args.json, "w", encoding="utf-8") as f:
                    f.write(text + "\n")
            except OSError as e:
                raise BenchError(f"cannot write {args.json}: {e.strerror or e}") from None
            wrote.append(args.json)
    if args.plot:
        from .plot import plot_run

        plot_run(doc, res.samples, args.plot)
        wrote.append(args.plot)
    for path in wrote:
        print(f"wrote {path}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def run_vllm(args: argparse.Namespace) -> int:
    """``kvblocks bench vllm``: vLLM's manager against kvblocks' (kvblocks.bench.vllm_manager);
    status 0 with ``skipped: vllm not importable (...)`` when vLLM (or torch) cannot be imported."""
    if args.suites != ["vllm"]:
        raise BenchError("the vllm suite runs alone: kvblocks bench vllm [--case ...]")
    for flag in ("compare", "plot", "samples"):
        if getattr(args, flag):
            raise BenchError(f"--{flag} does not apply to the vllm suite")
    if args.json and args.json != "-":
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            raise BenchError(f"--json {args.json}: no such folder {folder}")
    try:
        from . import vllm_manager
    except Exception as e:  # ImportError, or vllm's import failing without its platform
        print(f"kvblocks bench vllm: skipped: vllm not importable ({type(e).__name__}: {e})")
        return 0
    import contextlib

    quiet = args.json == "-"
    with contextlib.redirect_stdout(sys.stderr) if quiet else contextlib.nullcontext():
        doc = vllm_manager.run(args.case, args.reps, args.requests)
    doc["command"] = f"kvblocks bench vllm --case {args.case} --reps {args.reps} " + (
        f"--requests {args.requests}"
    )
    text = json.dumps(doc, indent=1)
    if quiet:
        print(text)
    elif args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise BenchError(f"cannot write {args.json}: {e.strerror or e}") from None
        print(f"wrote {args.json}")
    return 0
