"""The ``kvblocks simulate`` subcommand: its parser (:func:`add_parser`) and its run (one engine,
or a cluster with ``--replicas`` / ``--router`` / ``--host-cache``), with the contiguous baseline
and the report."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict

from . import limits as L
from .engine.cli import (
    DEFAULT_SWAP_GIB,
    _add_time_args,
    _check_host_tier,
    _describe,
    _engine,
    _gpu_mem,
    _json_head,
    _model,
    add_model_args,
)
from .errors import SimulationError
from .models.spec import ModelSpec

__all__ = ["add_parser", "run"]

SIM_EPILOG = """\
workloads:
  (none)               the built-in default (kvblocks/data/default_workload.jsonl): chats under
                       shared system prompts, multi-turn history, parallel sampling, long documents
  Mooncake JSONL       {"timestamp" ms, "input_length", "output_length", "hash_ids"}; each hash id
                       is 512 deterministic tokens, so equal ids share prefix-cache blocks
  Azure CSV            TIMESTAMP, ContextTokens, GeneratedTokens (lengths only: no sharing)

memory:   KV pool = --gpu-mem - weights - reserve (default reserve: 10% of --gpu-mem), in blocks of
          --block-size tokens x KV bytes per token; --num-blocks sets the pool directly. At most
          16,777,216 blocks (2^24, ~600 MiB of allocator metadata): raise --block-size for more memory.
time:     step = overhead + prefill tokens x prefill cost + decode tokens x decode cost
          + KV tokens read x kv-read cost; defaults model one H100-class GPU (see docs/simulator.md).

examples:
  kvblocks simulate
  kvblocks simulate --trace mooncake_conversation_trace.jsonl --model llama-3.1-8b --gpu-mem 80
  kvblocks simulate --trace azure_conv.csv --model qwen2.5-7b --gpu-mem 24 --json
  kvblocks simulate --contiguous all              # max-length, power-of-two and oracle baselines
  kvblocks simulate --disagg 1:3                  # 1 prefill + 3 decode replicas
  kvblocks simulate --layers 40 --kv-heads 8 --head-dim 128 --params 13 --gpu-mem 48 --plot mem.png
"""


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    from .cluster.routers import ROUTERS
    from .tier.host import DEFAULT_PCIE_GBPS

    g = p.add_argument_group("cluster and host tier")
    g.add_argument("--replicas", type=L.REPLICAS.parse, default=1, metavar="N",
                   help="engines, each with its own BlockManager, behind --router (1)")  # fmt: skip
    g.add_argument("--router", choices=list(ROUTERS), default=None,
                   help="how arrivals are routed (round_robin; see docs/simulator.md)")  # fmt: skip
    g.add_argument("--disagg", metavar="P:D", default=None,
                   help="prefill/decode disaggregation: P prefill and D decode replicas, the KV "
                   "of each prompt moved over the --gpu's link (GPUs = (P + D) x TP x PP)")  # fmt: skip
    g.add_argument("--overlap-weight", type=L.OVERLAP_WEIGHT.parse, metavar="W",
                   help="prefix_aware: weight of prefill blocks against load (Dynamo's 1.0)")  # fmt: skip
    g.add_argument("--host-cache", type=L.HOST_CACHE.parse, default=0.0, metavar="GiB",
                   help="host-memory prefix-cache tier per replica (needs the core's host tier)")  # fmt: skip
    g.add_argument("--host-write-through", action="store_true",
                   help="host tier: copy each block to the host when it is cached, not when evicted")  # fmt: skip
    g.add_argument("--pcie-gbps", type=L.PCIE_GBPS.parse, default=DEFAULT_PCIE_GBPS, metavar="GB/s",
                   help=f"host <-> device bandwidth for swaps and host-tier copies ({DEFAULT_PCIE_GBPS:g}, "
                   "PCIe Gen4 x16 effective)")  # fmt: skip


def add_parser(sub: "argparse._SubParsersAction") -> None:
    """Add ``simulate`` to the subcommands of the ``kvblocks`` parser."""
    sim = sub.add_parser(
        "simulate",
        help="replay a workload through the real allocator and print the memory bill",
        description="Replay a workload through kvblocks.BlockManager under a continuous-batching "
        "scheduler model, and contrast it with contiguous max-length reservation.",
        epilog=SIM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_args(sim)
    add_model_args(sim)
    _add_engine_args(sim)
    _add_cluster_args(sim)
    _add_time_args(sim)
    _add_output_args(sim)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """``--trace`` and what to replay of it."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--trace",
        metavar="FILE",
        help="Mooncake JSONL, kvblocks JSONL or Azure CSV (default: built-in)",
    )
    g.add_argument(
        "--format",
        default="auto",
        choices=["auto", "mooncake", "azure", "kvblocks"],
        help="trace format",
    )
    g.add_argument(
        "--limit", type=L.LIMIT.parse, metavar="N", help="replay only the first N requests"
    )
    g.add_argument("--time-scale", type=L.TIME_SCALE.parse, default=1.0, metavar="F",
                   help="multiply arrival times by F (2 = half the rate, 0 = all at once)")  # fmt: skip


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's knobs and the baselines."""
    g = p.add_argument_group("engine")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--watermark",
        type=L.WATERMARK.parse,
        default=0.01,
        help="fraction of blocks admission keeps free (0.01)",
    )
    g.add_argument(
        "--preemption",
        default="recompute",
        choices=["recompute", "swap"],
        help="when decode cannot grow",
    )
    g.add_argument(
        "--host-mem",
        type=L.HOST_MEM.parse,
        metavar="GiB",
        help=f"swap space (default {DEFAULT_SWAP_GIB:g} with swap)",
    )
    g.add_argument(
        "--max-num-seqs", type=L.MAX_NUM_SEQS.parse, default=256, help="sequences per batch (256)"
    )
    g.add_argument(
        "--token-budget",
        type=L.TOKEN_BUDGET.parse,
        default=8192,
        help="tokens per step, max_num_batched_tokens (8192)",
    )
    g.add_argument("--max-model-len", type=L.MAX_MODEL_LEN.parse, metavar="N",
                   help="contiguous baseline reservation per sequence (default: longest request)")  # fmt: skip
    g.add_argument("--no-contiguous", action="store_true", help="skip the contiguous baseline")
    g.add_argument("--contiguous", choices=["max", "pow2", "oracle", "all"], default=None,
                   help="contiguous baseline: max-length reservation (the default), power-of-two "
                   "buckets, the exact final length (oracle), or all three; given, the report "
                   "also splits the waste into reserved, internal and external fragmentation")  # fmt: skip
    g.add_argument("--compare-all-full", action="store_true",
                   help="hybrid models: replay again with every layer billed as full attention "
                   "and print the gain (concurrency, throughput, hit rate)")  # fmt: skip


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """``--json``, ``--plot``, the progress bar."""
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the report as JSON")
    g.add_argument(
        "--plot",
        metavar="FILE",
        help="write memory use and concurrency over time (PNG/SVG/PDF; needs matplotlib)",
    )
    g.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="progress bar on stderr",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``simulate`` command; returns the exit status."""
    return _simulate(args)


def _simulate(args: argparse.Namespace) -> int:
    from .engine.contiguous import simulate_contiguous
    from .engine.paged import simulate_paged
    from .engine.progress import ProgressBar
    from .report.simulation import format_simulation, simulation_json
    from .workload.traces import load_workload

    _check_host_tier(args.host_cache, args.host_write_through)
    if args.overlap_weight is not None and args.router != "prefix_aware":
        raise SimulationError("--overlap-weight applies to --router prefix_aware only")
    model = _model(args)
    if args.compare_all_full and args.all_full:
        raise SimulationError(
            "--compare-all-full already replays the --all-full baseline; give one"
        )
    if args.disagg is not None:
        from .cluster.disagg import parse_disagg

        parse_disagg(args.disagg)
        bad = [flag for flag, on in (("--replicas", args.replicas > 1),
                                     ("--host-cache", args.host_cache > 0),
                                     ("--compare-all-full", args.compare_all_full),
                                     ("--contiguous", args.contiguous is not None)) if on]  # fmt: skip
        if bad:
            raise SimulationError(
                f"--disagg sets its own replicas and has no contiguous baseline; drop {', '.join(bad)}"
            )
    bill, cfg, tm = _engine(args, model, args.host_cache)
    base = _engine(args, model, args.host_cache, all_full=True) if args.compare_all_full else None
    cluster = args.replicas > 1 or args.router is not None or args.host_cache > 0
    if base is not None and cluster:
        raise SimulationError(
            "--compare-all-full compares single-engine replays; drop --replicas/--router/--host-cache"
        )
    workload = load_workload(args.trace, args.format, args.limit)
    if args.time_scale != 1.0:
        workload = workload.scaled(args.time_scale)
    wstats = workload.stats()
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if args.contiguous is not None and args.no_contiguous:
        raise SimulationError("--contiguous and --no-contiguous contradict each other; give one")
    if args.contiguous is not None and cluster:
        raise SimulationError(
            "--contiguous is a single-engine baseline; drop --replicas/--router/--host-cache"
        )
    if args.disagg is not None:
        return _simulate_disagg(args, model, bill, cfg, tm, workload, wstats, show)
    if cluster:
        return _simulate_cluster(args, model, bill, cfg, tm, workload, wstats, show)
    bar = ProgressBar("simulate", len(workload)) if show else None
    try:
        paged = simulate_paged(workload, cfg, tm, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    all_full = None
    if base is not None:
        bar = ProgressBar("all layers full", len(workload)) if show else None
        try:
            all_full = simulate_paged(workload, base[1], base[2], progress=bar)
        finally:
            if bar is not None:
                bar.close()
    contigs = []
    if not args.no_contiguous:
        from .engine.contiguous import POLICIES

        max_len = args.max_model_len or int(wstats["max_total"])
        which = args.contiguous or "max"
        for policy in POLICIES if which == "all" else (which,):
            name = "contiguous" if policy == "max" else f"contiguous {policy}"
            bar = ProgressBar(name, len(workload)) if show else None
            try:
                contigs.append(simulate_contiguous(workload, cfg, tm, max_len, bar, policy))
            finally:
                if bar is not None:
                    bar.close()
    contiguous = contigs[0] if contigs else None
    split = args.contiguous is not None
    desc = _describe(args, cfg, tm, bill, 1)
    if args.plot:
        from .report.plot import plot_results

        plot_results([paged, *contigs], args.plot,
                     title=f"{workload.name} on {model.name}, {_gpu_mem(args):g} GiB")  # fmt: skip
    base_bill = base[0] if base is not None else None
    if args.json:
        print(simulation_json(workload.name, wstats, bill, cfg.as_dict(), tm.as_dict(), paged, contiguous,
                              all_full, base_bill, _json_head(args, paged.summary, tm, 1),
                              contigs if split else None))  # fmt: skip
    else:
        print(format_simulation(workload.name, wstats, bill, desc, paged, contigs, all_full,
                                base_bill, waste_split=split))  # fmt: skip
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _simulate_cluster(args: argparse.Namespace, model: ModelSpec, bill: Any, cfg: Any, tm: Any,
                      workload: Any, wstats: Dict[str, float], show: bool) -> int:  # fmt: skip
    """``simulate --replicas N --router R``: the cluster replay and its report (no contiguous
    baseline: it models one engine)."""
    from .cluster.cluster import simulate_cluster
    from .cluster.report import cluster_json, format_cluster
    from .engine.progress import ProgressBar

    router = args.router or "round_robin"
    bar = ProgressBar(f"simulate x{args.replicas}", len(workload)) if show else None
    try:
        res = simulate_cluster(workload, cfg, tm, args.replicas, router, args.overlap_weight, bar)
    finally:
        if bar is not None:
            bar.close()
    host_desc = None
    if args.host_cache:
        policy = "write-through" if cfg.host_write_through else "write-back"
        host_desc = (f"host cache {args.host_cache:g} GiB ({cfg.host_cache_blocks:,} blocks, "
                     f"{policy}), PCIe {args.pcie_gbps:g} GB/s")  # fmt: skip
    if args.plot:
        from .report.plot import plot_results

        plot_results([res.paged], args.plot,
                     title=f"{workload.name} on {model.name}: replica 0 of {args.replicas}")  # fmt: skip
    if args.json:
        cluster = {"host_cache_gib": args.host_cache, "pcie_gbps": args.pcie_gbps}
        head = _json_head(args, res.summary, tm, args.replicas)
        print(
            cluster_json(
                workload.name, wstats, bill, cfg.as_dict(), tm.as_dict(), res, cluster, head
            )
        )
    else:
        desc = _describe(args, cfg, tm, bill, args.replicas)
        print(format_cluster(workload.name, wstats, bill, desc, res, host_desc))
        if args.plot:
            print(f"plot written to {args.plot} (replica 0)")
    return 0


def _simulate_disagg(args: argparse.Namespace, model: ModelSpec, bill: Any, cfg: Any, tm: Any,
                     workload: Any, wstats: Dict[str, float], show: bool) -> int:  # fmt: skip
    """``simulate --disagg P:D``: prefill pool, KV transfer, decode pool (no contiguous
    baseline)."""
    from .cluster.disagg import disagg_json, format_disagg, parse_disagg, simulate_disagg
    from .engine.cli import _gpu
    from .engine.progress import ProgressBar

    p, d = parse_disagg(args.disagg)
    link = _gpu(args).link_gb_s
    router = args.router or "round_robin"
    bar = ProgressBar(f"prefill x{p}", len(workload)) if show else None
    try:
        res = simulate_disagg(workload, cfg, tm, p, d, bill.kv_bytes_per_token, link, router,
                              args.overlap_weight, bar)  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    if args.plot:
        from .report.plot import plot_results

        plot_results([res.decode.paged], args.plot,
                     title=f"{workload.name} on {model.name}: decode replica 0 of {d}")  # fmt: skip
    if args.json:
        head = _json_head(args, res.summary, tm, p + d)
        print(disagg_json(workload.name, wstats, bill, cfg.as_dict(), tm.as_dict(), res, head))
    else:
        print(
            format_disagg(workload.name, wstats, bill, _describe(args, cfg, tm, bill, p + d), res)
        )
        if args.plot:
            print(f"plot written to {args.plot} (decode replica 0)")
    return 0
