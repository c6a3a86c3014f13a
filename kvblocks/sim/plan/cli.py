"""The ``kvblocks plan`` subcommand: its parser (:func:`add_parser`) and its run: the
length-distribution plan, the replica sweep over a trace (``--trace --ttft-p99``) and the GPU
plan (``--gpu NAME[,NAME...]``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional, Tuple

from .. import limits as L
from ..engine.cli import _add_time_args, _check_host_tier, _engine, _gpu_mem, _model, add_model_args
from ..errors import SimulationError
from ..models.spec import memory_bill
from .lengths import DIST_HELP, format_plan, make_plan, parse_dist, plan_json

__all__ = ["add_parser", "plan_command"]

PLAN_EPILOG = f"""\
{DIST_HELP}.

examples:
  kvblocks plan --model llama-3.1-8b --gpu-mem 80 --prompt-len uniform:128:4096 --output-len 512
  kvblocks plan --model deepseek-v2-lite --gpu-mem 48 --prompt-len lognormal:2000:3000 --output-len normal:300:100
"""


def add_parser(sub: "argparse._SubParsersAction") -> None:
    """Add ``plan`` to the subcommands of the ``kvblocks`` parser."""
    plan = sub.add_parser(
        "plan",
        help="how many sequences fit: paged vs contiguous, with the per-token bill",
        description="Capacity plan: concurrent sequences under paged allocation versus contiguous "
        "max-length reservation, and the GPU memory bill per token.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(plan, plan=True)
    plan.add_argument("--prompt-len", metavar="DIST", help="prompt length distribution")
    plan.add_argument("--output-len", metavar="DIST", help="output length distribution")
    plan.add_argument(
        "--max-len",
        type=L.MAX_LEN.parse,
        metavar="N",
        help="contiguous reservation (default: longest draw)",
    )
    plan.add_argument(
        "--samples", type=L.SAMPLES.parse, default=100_000, help="lengths drawn (100000)"
    )
    plan.add_argument("--seed", type=L.SEED.parse, default=0, help="random seed (0)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_cluster_plan_args(plan)
    _add_time_args(plan)


def _add_cluster_plan_args(p: argparse.ArgumentParser) -> None:
    """The cluster and GPU plans: a trace, targets, the ranges to simulate, their engine."""
    g = p.add_argument_group("cluster plan (simulates the trace on every configuration)")
    g.add_argument("--trace", metavar="FILE", help="Mooncake JSONL, kvblocks JSONL or Azure CSV")
    g.add_argument("--format", default="auto", choices=["auto", "mooncake", "azure", "kvblocks"],
                   help="trace format")  # fmt: skip
    g.add_argument("--limit", type=L.LIMIT.parse, metavar="N", help="plan on the first N requests")
    g.add_argument("--time-scale", type=L.TIME_SCALE.parse, default=1.0, metavar="F",
                   help="multiply arrival times by F")  # fmt: skip
    g.add_argument("--ttft-p99", type=L.TTFT_P99.parse, metavar="SECONDS",
                   help="target: time to first token, 99th percentile")  # fmt: skip
    g.add_argument("--tpot-p99", type=L.TPOT_P99.parse, metavar="SECONDS",
                   help="target: time per output token, 99th percentile (with --gpu)")  # fmt: skip
    g.add_argument("--cost", action="store_true",
                   help="with --gpu: cheapest in $/hour, not in GPUs (prices: --usd-per-hour or the catalog)")  # fmt: skip
    g.add_argument("--kv-dtypes", metavar="D[,D...]",
                   help="with --gpu: KV dtypes to consider, e.g. bf16,fp8 (default: --kv-dtype or bf16)")  # fmt: skip
    g.add_argument("--disagg", metavar="auto|P:D,...", default=None,
                   help="with --gpu: also search prefill/decode disaggregation (P prefill + D decode "
                   "replicas): auto (P = 1/4, 1/2, 3/4 of each --replicas count) or a list such as 1:3,2:2")  # fmt: skip
    g.add_argument("--replicas", default="1-8", metavar="LIST",
                   help="replica counts to simulate, e.g. 1-8 or 2,4,8 (1-8)")  # fmt: skip
    g.add_argument("--host-cache", default=None, metavar="GiB,...",
                   help="host-cache sizes per replica to simulate (0,256; with --gpu 0; 0 = no host tier)")  # fmt: skip
    g.add_argument("--router", default="prefix_aware", metavar="NAME",
                   help="round_robin, least_loaded or prefix_aware (prefix_aware)")  # fmt: skip
    g.add_argument("--host-write-through", action="store_true",
                   help="host tiers copy each block to the host when it is cached")  # fmt: skip
    g.add_argument("--pcie-gbps", type=L.PCIE_GBPS.parse, default=None, metavar="GB/s",
                   help="host <-> device bandwidth (25)")  # fmt: skip
    g.add_argument("--plot", metavar="FILE", help="draw the curve (PNG/SVG/PDF; needs matplotlib)")
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bar on stderr")  # fmt: skip
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g = p.add_argument_group("engine (cluster plan)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--max-num-seqs", type=L.MAX_NUM_SEQS.parse, default=256, help="sequences per batch (256)"
    )
    g.add_argument("--token-budget", type=L.TOKEN_BUDGET.parse, default=8192,
                   help="tokens per step, max_num_batched_tokens (8192)")  # fmt: skip


def _int_list(text: Optional[str], flag: str, lim: Any, default: List[int]) -> List[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (each within ``lim``); ``default`` when not given."""
    if text is None:
        return default
    out: List[int] = []
    for part in str(text).split(","):
        try:
            v = int(part.strip(), 10)
        except ValueError:
            raise SimulationError(
                f"{flag}: {part.strip()!r} is not an integer (e.g. 1,2,4,8)"
            ) from None
        out.append(lim.check_int(v))
    return sorted(set(out))


def _plan(args: argparse.Namespace) -> int:
    v2 = args.gpu is not None and (args.trace is not None or args.ttft_p99 is not None)
    args.tp_list = _int_list(args.tp, "--tp", L.TP, [1, 2, 4, 8] if v2 and args.tp is None else [1])
    args.pp_list = _int_list(args.pp, "--pp", L.PP, [1])
    if not v2:
        for flag, vals in (("--tp", args.tp_list), ("--pp", args.pp_list)):
            if len(vals) > 1:
                raise SimulationError(
                    f"{flag} takes one value here; a list needs --gpu and --trace (a cluster plan)"
                )
        for flag, v in (("--tpot-p99", args.tpot_p99), ("--kv-dtypes", args.kv_dtypes)):
            if v is not None:
                raise SimulationError(
                    f"{flag} belongs to the GPU plan: give --gpu NAME with --trace and --ttft-p99"
                )
        for flag, on in (("--cost", args.cost), ("--disagg", args.disagg is not None)):
            if on:
                raise SimulationError(
                    f"{flag} belongs to the GPU plan: give --gpu NAME with --trace and --ttft-p99"
                )
        args.tp, args.pp = args.tp_list[0], args.pp_list[0]
    if v2:
        return _plan_gpus(args)
    if args.trace is not None or args.ttft_p99 is not None:
        if args.host_cache is None:
            args.host_cache = "0,256"
        return _plan_trace(args)
    if args.prompt_len is None or args.output_len is None:
        raise SimulationError(
            "the following arguments are required: --prompt-len, --output-len "
            "(or --trace FILE --ttft-p99 SECONDS for a cluster plan)"
        )
    model = _model(args)
    from ..engine.roofline import parallel_layout

    par = parallel_layout(model, args.tp, args.pp)
    mem = _gpu_mem(args)
    bill = memory_bill(model, mem, args.block_size, args.reserve, args.num_blocks,
                       all_full=args.all_full, gpus=par.gpus, kv_copies=par.kv_copies)  # fmt: skip
    base = None
    if bill.groups.hybrid and not args.all_full:  # the all-full baseline costs nothing here
        base = memory_bill(model, mem, args.block_size, args.reserve, args.num_blocks,
                           all_full=True, gpus=par.gpus, kv_copies=par.kv_copies)  # fmt: skip
    prompt = parse_dist(args.prompt_len, "--prompt-len")
    output = parse_dist(args.output_len, "--output-len")
    plan = make_plan(bill, prompt, output, args.max_len, args.samples, args.seed, base)
    print(plan_json(plan) if args.json else format_plan(plan))
    return 0


def _plan_trace(args: argparse.Namespace) -> int:
    """``plan --trace FILE --ttft-p99 S``: simulate the range, print the curve and the answer."""
    from ..cluster.routers import ROUTERS
    from ..engine.progress import ProgressBar
    from ..workload.traces import load_workload
    from .capacity import (
        CapacityPlan,
        capacity_json,
        cheapest,
        format_capacity,
        parse_counts,
        parse_sizes,  # fmt: skip
        sweep,
    )

    if args.trace is None or args.ttft_p99 is None:
        raise SimulationError("a cluster plan needs both --trace FILE and --ttft-p99 SECONDS")
    if args.prompt_len is not None or args.output_len is not None:
        raise SimulationError("--prompt-len/--output-len and --trace are different plans; give one")
    if args.router not in ROUTERS:
        raise SimulationError(f"--router must be one of {', '.join(ROUTERS)}; got {args.router!r}")
    counts = parse_counts(args.replicas, "--replicas")
    sizes = parse_sizes(args.host_cache, "--host-cache")
    for g in sizes:
        _check_host_tier(g)
    _check_host_tier(max(sizes), args.host_write_through)
    model = _model(args)
    bill, cfg, tm = _engine(args, model)
    workload = load_workload(args.trace, args.format, args.limit)
    if args.time_scale != 1.0:
        workload = workload.scaled(args.time_scale)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    total = len(counts) * len(sizes)
    labels = [(n, g) for n in counts for g in sizes]
    bars: List[ProgressBar] = []

    def replay_bar(k: int) -> Any:
        if not show:
            return None
        n, g = labels[k]
        host = f" +{g:g}G" if g else ""
        bars.append(ProgressBar(f"plan {k + 1}/{total}: {n} GPU{host}", len(workload)))
        return bars[-1]

    def done(k: int, _total: int) -> None:
        if bars:
            bars[-1].close()

    points = sweep(workload, cfg, tm, args.ttft_p99, counts, sizes, args.router, done, replay_bar,
                   args.host_write_through)  # fmt: skip
    best = cheapest(points, args.ttft_p99)
    plan = CapacityPlan(args.ttft_p99, args.router, points, best, args.host_write_through)
    if args.plot:
        from ..report.plot import plot_capacity

        plot_capacity(points, args.ttft_p99, args.plot,
                      title=f"{workload.name} on {model.name}, {_gpu_mem(args):g} GiB per GPU")  # fmt: skip
    if args.json:
        extra = {"workload": dict(workload.stats(), name=workload.name), "memory": bill.as_dict()}
        print(capacity_json(plan, extra))
    else:
        header = [
            f"workload  {workload.name}: {len(workload):,} requests",
            f"replica   {model.name} on {_gpu_mem(args):g} GiB: {bill.num_blocks:,} blocks x "
            f"{bill.block_size} tokens",
        ]
        print(format_capacity(plan, header))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _plan_gpus(args: argparse.Namespace) -> int:
    """``plan --gpu NAME[,NAME...] --trace FILE --ttft-p99 S [--tpot-p99 S] [--cost]``."""
    from ..cluster.disagg import parse_disagg
    from ..cluster.routers import ROUTERS
    from ..engine.progress import ProgressBar
    from ..models.gpus import parse_gpus
    from ..models.spec import KV_DTYPES, GiB
    from ..workload.traces import load_workload
    from .capacity import parse_counts, parse_sizes
    from .gpuplan import (
        Family,
        candidates,
        format_gpu_plan,
        gpu_plan_json,
        idle_prefill_s,
        search,
    )
    from .replays import Floors, replay_candidate

    if args.trace is None or args.ttft_p99 is None:
        raise SimulationError("a GPU plan needs both --trace FILE and --ttft-p99 SECONDS")
    if args.prompt_len is not None or args.output_len is not None:
        raise SimulationError("--prompt-len/--output-len and --trace are different plans; give one")
    if args.router not in ROUTERS:
        raise SimulationError(f"--router must be one of {', '.join(ROUTERS)}; got {args.router!r}")
    if args.kv_dtypes is not None and args.dtype is not None:
        raise SimulationError("give --kv-dtype or --kv-dtypes, not both")
    gpus = parse_gpus(args.gpu, args.usd_per_hour)
    counts = parse_counts(args.replicas, "--replicas")
    sizes = parse_sizes(args.host_cache if args.host_cache is not None else "0", "--host-cache")
    for g in sizes:
        _check_host_tier(g)
    dtypes = [d.strip().lower() for d in (args.kv_dtypes or args.dtype or "bf16").split(",")]
    for d in dtypes:
        if d not in KV_DTYPES:
            raise SimulationError(f"unknown KV dtype {d!r} (known: {', '.join(KV_DTYPES)})")
    splits: Optional[List[Tuple[int, int]]] = None
    if args.disagg is not None and args.disagg.strip().lower() != "auto":
        splits = [parse_disagg(x.strip()) for x in args.disagg.split(",")]
    with_disagg = args.disagg is not None
    if with_disagg and all(h > 0 for h in sizes):
        raise SimulationError("--disagg has no host tier: add 0 to --host-cache")
    workload = load_workload(args.trace, args.format, args.limit)
    if args.time_scale != 1.0:
        workload = workload.scaled(args.time_scale)
    if len(workload) == 0:
        raise SimulationError("the workload has no requests")
    base = _model(args)
    families: List[Family] = []
    for gpu in gpus:
        for tp in args.tp_list:
            for pp in args.pp_list:
                for d in dtypes:
                    for h in sizes:
                        f = Family(gpu.name, tp, pp, d, h, gpu.usd_per_hour)
                        try:
                            f.engine = _engine(
                                args, base.with_kv_dtype(d), h, gpu=gpu, tp=tp, pp=pp
                            )
                        except SimulationError as e:
                            f.fits, f.why_not = False, str(e)
                            if "does not" not in f.why_not:
                                f.why_not = f.why_not.replace("--tp", "TP").replace("--pp", "PP")
                        families.append(f)
    import numpy as np

    p99_prompt = int(np.percentile([r.prompt_len for r in workload.requests], 99, method="higher"))
    idle: Dict[Any, float] = {}  # the idle floor depends on the time model alone
    for f in families:
        if f.fits:
            tm = f.engine[2]
            if tm not in idle:
                idle[tm] = idle_prefill_s(tm, p99_prompt, args.token_budget)
            f.idle_ttft_s = idle[tm]
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    links = {g.name: g.link_gb_s for g in gpus}

    floors = Floors(workload, args.token_budget, args.ttft_p99)

    fitting = [f for f in families if f.fits]
    searched = [0, len(candidates(fitting, counts, splits, with_disagg))]  # done, in all

    def done(c: Any) -> None:
        searched[0] += 1

    def replay(f: Family, n: int, prefill: int = 0) -> Dict[str, Any]:
        head = f"plan {searched[0] + 1}/{searched[1]}: {f.label(n, prefill)}"
        bar = ProgressBar(head, len(workload)) if show else None
        try:
            return replay_candidate(workload, f.engine, n, prefill, args.router, args.ttft_p99,
                                    args.tpot_p99, links[f.gpu], progress=bar,
                                    known=floors.known(f.engine))  # fmt: skip
        finally:
            if bar is not None:
                bar.close()

    plan = search(families, counts, replay, args.ttft_p99, args.tpot_p99, args.cost,
                  done=done, requests=len(workload), disagg=splits, with_disagg=with_disagg,
                  floor=lambda f: floors.reason(f.engine))  # fmt: skip
    if args.plot:
        from ..report.plot import plot_gpu_plan

        plot_gpu_plan(plan, args.plot, title=f"{workload.name} on {base.name}")
    if args.json:
        extra = {"workload": dict(workload.stats(), name=workload.name), "model": base.name,
                 "gpu_catalog": {g.name: g.as_dict() for g in gpus}}  # fmt: skip
        cal = getattr(args, "_calibration", None)
        if cal is not None:
            extra["calibration"] = cal.as_dict()
        print(gpu_plan_json(plan, extra))
    else:
        header = [f"workload  {workload.name}: {len(workload):,} requests",
                  f"model     {base.name}, weights {base.weight_bytes / GiB:.2f} GiB ({base.weight_dtype}); "
                  f"GPUs {', '.join(g.name for g in gpus)}; TP {','.join(map(str, args.tp_list))}; "
                  f"PP {','.join(map(str, args.pp_list))}; replicas {args.replicas}; {sum(1 for c in plan.replayed if c.ran)} replays"]  # fmt: skip
        print(format_gpu_plan(plan, header))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


plan_command = _plan
