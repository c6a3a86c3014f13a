"""``kvblocks plan`` with a trace: the replica sweep (``--trace --ttft-p99``) and the GPU plan
(``--gpu NAME[,NAME...]``); the length-distribution plan stays in :mod:`kvblocks.sim.cli`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from .. import limits as L
from ..engine.cli import _check_host_tier, _engine, _gpu_mem, _model
from ..errors import SimulationError
from ..models.spec import memory_bill
from .lengths import format_plan, make_plan, parse_dist, plan_json

__all__ = ["plan_command"]


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
        if args.cost:
            raise SimulationError(
                "--cost belongs to the GPU plan: give --gpu NAME with --trace and --ttft-p99"
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
    from ..cluster.cluster import Cluster, ReplayStopped
    from ..cluster.routers import ROUTERS
    from ..engine.progress import ProgressBar
    from ..models.gpus import parse_gpus
    from ..models.spec import KV_DTYPES, GiB
    from ..workload.traces import load_workload
    from .capacity import parse_counts, parse_sizes
    from .gpuplan import (
        Family,
        format_gpu_plan,
        gpu_plan_json,
        idle_prefill_s,
        search,
        ttft_already_missed,
    )

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
    for f in families:
        if f.fits:
            f.idle_ttft_s = idle_prefill_s(f.engine[2], p99_prompt, args.token_budget)
    show = args.progress if args.progress is not None else sys.stderr.isatty()

    def replay(f: Family, n: int) -> Dict[str, Any]:
        _bill, cfg, tm = f.engine
        bar = ProgressBar(f"plan: {f.label(n)}", len(workload)) if show else None
        try:
            cl = Cluster(workload, cfg, tm, n, args.router)
            return cl.run(bar, lambda c: ttft_already_missed(c, args.ttft_p99)).summary
        except ReplayStopped as e:
            rej = sum(int(x.rec.rejected.sum()) for x in cl.engines)
            return {"stopped": True, "arrived_share": e.arrived / len(workload), "rejected": rej}
        finally:
            if bar is not None:
                bar.close()

    plan = search(families, counts, replay, args.ttft_p99, args.tpot_p99, args.cost)
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
                  f"PP {','.join(map(str, args.pp_list))}; replicas {args.replicas}; {len(plan.replayed)} replays"]  # fmt: skip
        print(format_gpu_plan(plan, header))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


plan_command = _plan
