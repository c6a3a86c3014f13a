"""The ``kvblocks simulate`` and ``kvblocks plan`` subcommands (dispatched by kvblocks/__main__.py).

Every error the user can cause (a flag out of range, missing or malformed file, bad lengths,
unknown model, memory that does not fit) prints one ``kvblocks: error: ...`` line and exits with
status 2; no traceback. Every numeric flag is parsed by its :class:`~kvblocks.sim.limits.Limit`
(an argparse ``type=``), so NaN, infinities and out-of-range values stop the parse itself.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

from . import limits as L
from .errors import SimulationError
from .gpus import DEFAULT_GPU, GPUS, GpuSpec, get_gpu
from .hybrid_models import parse_layer_kinds
from .models import DEFAULT_MODEL, PRESETS, ModelSpec, custom_model, get_model, memory_bill
from .plan import DIST_HELP, format_plan, make_plan, parse_dist, plan_json

__all__ = ["add_commands", "run"]

DEFAULT_GPU_MEM = 80.0
DEFAULT_SWAP_GIB = 4.0

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
  kvblocks simulate --layers 40 --kv-heads 8 --head-dim 128 --params 13 --gpu-mem 48 --plot mem.png
"""

PLAN_EPILOG = f"""\
{DIST_HELP}.

examples:
  kvblocks plan --model llama-3.1-8b --gpu-mem 80 --prompt-len uniform:128:4096 --output-len 512
  kvblocks plan --model deepseek-v2-lite --gpu-mem 48 --prompt-len lognormal:2000:3000 --output-len normal:300:100
"""


def _add_model_args(p: argparse.ArgumentParser, plan: bool = False) -> None:
    g = p.add_argument_group("model and memory")
    names = ", ".join(m.name.lower() for m in PRESETS.values())
    g.add_argument("--model", metavar="NAME", help=f"preset: {names} (default {DEFAULT_MODEL})")
    g.add_argument("--layers", type=L.LAYERS.parse, help="custom model: transformer layers")
    g.add_argument("--kv-heads", type=L.KV_HEADS.parse, default=0, help="custom model: KV heads")
    g.add_argument(
        "--head-dim", type=L.HEAD_DIM.parse, default=0, help="custom model: head dimension"
    )
    g.add_argument("--latent-dim", type=L.LATENT_DIM.parse, default=0,
                   help="custom MLA model: latent elements per token and layer")  # fmt: skip
    g.add_argument("--layer-groups", metavar="SPEC",
                   help="custom hybrid model: COUNT:KIND[:SIZE],... with KIND full, sliding_window "
                   "(SIZE window), chunked_local (SIZE chunk) or state (SIZE elements per layer and "
                   "sequence); counts add up to --layers, e.g. 12:full,12:sliding_window:128")  # fmt: skip
    g.add_argument("--all-full", action="store_true",
                   help="bill window and chunk layers as full attention (the baseline a hybrid "
                   "KV cache is measured against)")  # fmt: skip
    g.add_argument(
        "--params",
        type=L.PARAMS.parse,
        default=0.0,
        metavar="BILLIONS",
        help="custom model: parameters (weights)",
    )
    g.add_argument("--dtype", "--kv-dtype", dest="dtype", metavar="DTYPE",
                   help="KV cache dtype: bf16 (default), fp16, fp8, fp4 (NVFP4, one fp8 scale per 16), fp32")  # fmt: skip
    g.add_argument("--weight-dtype", metavar="DTYPE",
                   help="weights: bf16 (default), fp8, int4 (group-128 scales), fp4; changes the "
                   "memory bill and the bytes each step reads")  # fmt: skip
    g.add_argument("--gpu", metavar="NAME",
                   help=f"GPU from the catalog: {', '.join(GPUS)} (memory, bandwidth, FLOP/s, link, "
                   f"price; default {DEFAULT_GPU} with --gpu-mem 80)")  # fmt: skip
    if plan:
        g.add_argument("--tp", default=None, metavar="N[,N...]",
                       help="tensor parallel sizes to consider (cluster plan: 1,2,4,8; else 1)")  # fmt: skip
        g.add_argument("--pp", default=None, metavar="N[,N...]",
                       help="pipeline stage counts to consider (1)")  # fmt: skip
    else:
        g.add_argument("--tp", type=L.TP.parse, default=1, metavar="N",
                       help="tensor parallel GPUs per replica (1): weights and KV split, all-reduce per layer")  # fmt: skip
        g.add_argument("--pp", type=L.PP.parse, default=1, metavar="N",
                       help="pipeline stages per replica (1): layers split, stages run in turn")  # fmt: skip
    g.add_argument(
        "--gpu-mem",
        type=L.GPU_MEM.parse,
        default=None,
        metavar="GiB",
        help="memory per GPU (default: the --gpu's, else 80)",
    )
    g.add_argument("--usd-per-hour", type=L.USD_PER_HOUR.parse, metavar="USD",
                   help="price of one GPU-hour (default: the catalog's)")  # fmt: skip
    g.add_argument(
        "--reserve",
        type=L.RESERVE.parse,
        metavar="GiB",
        help="activation/context reserve (default 10%% of --gpu-mem)",
    )
    g.add_argument(
        "--block-size",
        type=L.BLOCK_SIZE.parse,
        default=16,
        metavar="N",
        help="tokens per KV block (default 16)",
    )
    g.add_argument(
        "--num-blocks",
        type=L.NUM_BLOCKS.parse,
        metavar="N",
        help="KV blocks, overriding the memory computation",
    )


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    from .hosttier import DEFAULT_PCIE_GBPS
    from .routers import ROUTERS

    g = p.add_argument_group("cluster and host tier")
    g.add_argument("--replicas", type=L.REPLICAS.parse, default=1, metavar="N",
                   help="engines, each with its own BlockManager, behind --router (1)")  # fmt: skip
    g.add_argument("--router", choices=list(ROUTERS), default=None,
                   help="how arrivals are routed (round_robin; see docs/simulator.md)")  # fmt: skip
    g.add_argument("--overlap-weight", type=L.OVERLAP_WEIGHT.parse, metavar="W",
                   help="prefix_aware: weight of prefill blocks against load (Dynamo's 1.0)")  # fmt: skip
    g.add_argument("--host-cache", type=L.HOST_CACHE.parse, default=0.0, metavar="GiB",
                   help="host-memory prefix-cache tier per replica (needs the core's host tier)")  # fmt: skip
    g.add_argument("--host-write-through", action="store_true",
                   help="host tier: copy each block to the host when it is cached, not when evicted")  # fmt: skip
    g.add_argument("--pcie-gbps", type=L.PCIE_GBPS.parse, default=DEFAULT_PCIE_GBPS, metavar="GB/s",
                   help=f"host <-> device bandwidth for swaps and host-tier copies ({DEFAULT_PCIE_GBPS:g}, "
                   "PCIe Gen4 x16 effective)")  # fmt: skip


def _add_time_args(p: argparse.ArgumentParser) -> None:
    from .timing import Efficiency

    e = Efficiency()
    g = p.add_argument_group(
        "time model (a roofline per step from the model and --gpu; docs/simulator.md)"
    )
    g.add_argument("--compute-eff", type=L.COMPUTE_EFF.parse, metavar="F",
                   help=f"GEMM FLOP/s over the peak ({e.compute:g})")  # fmt: skip
    g.add_argument("--bandwidth-eff", type=L.BANDWIDTH_EFF.parse, metavar="F",
                   help=f"HBM bytes/s over the peak ({e.bandwidth:g})")  # fmt: skip
    g.add_argument("--attention-eff", type=L.ATTENTION_EFF.parse, metavar="F",
                   help=f"attention FLOP/s over the bf16 peak ({e.attention:g})")  # fmt: skip
    g.add_argument("--link-eff", type=L.LINK_EFF.parse, metavar="F",
                   help=f"all-reduce bandwidth over the link's ({e.link:g})")  # fmt: skip
    g.add_argument("--collective-us", type=L.COLLECTIVE_US.parse, metavar="US",
                   help=f"latency of one all-reduce or pipeline send ({e.collective_us:g})")  # fmt: skip
    g.add_argument("--step-overhead-ms", type=L.STEP_OVERHEAD_MS.parse, metavar="MS",
                   help=f"host work per step: scheduling, sampling, launches ({e.host_ms:g})")  # fmt: skip
    g.add_argument("--peak-tflops", type=L.PEAK_TFLOPS.parse, help="GEMM peak (default: the GPU's)")
    g.add_argument("--hbm-tbs", type=L.HBM_TBS.parse, help="HBM bandwidth (default: the GPU's)")
    g.add_argument("--link-gbs", type=L.LINK_GBS.parse, help="GPU-GPU link (default: the GPU's)")
    g.add_argument("--prefill-us", type=L.PREFILL_US.parse,
                   help="fixed compute cost per prefill token, instead of FLOPs / peak")  # fmt: skip
    g.add_argument("--decode-us", type=L.DECODE_US.parse,
                   help="fixed compute cost per decode token, instead of FLOPs / peak")  # fmt: skip
    g.add_argument("--kv-read-ns", type=L.KV_READ_NS.parse,
                   help="cost per cached token read by a decoding token (default: KV bytes / bandwidth)")  # fmt: skip
    g.add_argument("--calibrate", metavar="CSV",
                   help="fit the efficiencies and host overhead to measured steps "
                   "(prefill_tokens,decode_tokens,context_tokens,ms[,prefill_context]) and use them")  # fmt: skip
    g.add_argument("--ttft-slo", type=L.TTFT_SLO.parse, metavar="S",
                   help="goodput: time to first token target (2)")  # fmt: skip
    g.add_argument("--tpot-slo", type=L.TPOT_SLO.parse, metavar="S",
                   help="goodput: time per output token target (0.1)")  # fmt: skip


def add_commands(sub: "argparse._SubParsersAction") -> None:
    """Add ``simulate`` and ``plan`` to the subcommands of the ``kvblocks`` parser."""
    sim = sub.add_parser(
        "simulate",
        help="replay a workload through the real allocator and print the memory bill",
        description="Replay a workload through kvblocks.BlockManager under a continuous-batching "
        "scheduler model, and contrast it with contiguous max-length reservation.",
        epilog=SIM_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = sim.add_argument_group("workload")
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
    _add_model_args(sim)
    g = sim.add_argument_group("engine")
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
    g.add_argument("--compare-all-full", action="store_true",
                   help="hybrid models: replay again with every layer billed as full attention "
                   "and print the gain (concurrency, throughput, hit rate)")  # fmt: skip
    _add_cluster_args(sim)
    _add_time_args(sim)
    g = sim.add_argument_group("output")
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

    plan = sub.add_parser(
        "plan",
        help="how many sequences fit: paged vs contiguous, with the per-token bill",
        description="Capacity plan: concurrent sequences under paged allocation versus contiguous "
        "max-length reservation, and the GPU memory bill per token.",
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(plan, plan=True)
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
    g = plan.add_argument_group("cluster plan (simulates the trace on every configuration)")
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
    g = plan.add_argument_group("engine (cluster plan)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--max-num-seqs", type=L.MAX_NUM_SEQS.parse, default=256, help="sequences per batch (256)"
    )
    g.add_argument("--token-budget", type=L.TOKEN_BUDGET.parse, default=8192,
                   help="tokens per step, max_num_batched_tokens (8192)")  # fmt: skip
    _add_time_args(plan)


def _model(args: argparse.Namespace) -> ModelSpec:
    if args.layers is not None:
        if args.model:
            raise SimulationError("give either --model or --layers/--kv-heads/--head-dim, not both")
        kinds = parse_layer_kinds(args.layer_groups, args.layers) if args.layer_groups else ()
        return custom_model(args.layers, args.kv_heads, args.head_dim, args.dtype or "bf16", args.params * 1e9,
                            args.latent_dim, layer_kinds=kinds)  # fmt: skip
    if args.layer_groups:
        raise SimulationError(
            "--layer-groups describes a custom model: give it with --layers, not --model"
        )
    m = get_model(args.model or DEFAULT_MODEL).with_kv_dtype(args.dtype)
    return m.with_weight_dtype(getattr(args, "weight_dtype", None))


def _gpu(args: argparse.Namespace) -> GpuSpec:
    """The ``--gpu`` (H100-SXM by default), its price overridden by ``--usd-per-hour``."""
    name = getattr(args, "gpu", None) or DEFAULT_GPU
    return get_gpu(name, getattr(args, "usd_per_hour", None))


def _gpu_mem(args: argparse.Namespace, gpu: Optional[GpuSpec] = None) -> float:
    """GiB per GPU: ``--gpu-mem``, else the ``--gpu``'s, else 80."""
    if args.gpu_mem is not None:
        return float(args.gpu_mem)
    if getattr(args, "gpu", None):
        return (gpu or _gpu(args)).mem_gib
    return DEFAULT_GPU_MEM


def _efficiency(args: argparse.Namespace) -> Any:
    from dataclasses import replace

    from .timing import Efficiency

    e = Efficiency()
    for flag, attr in (("compute_eff", "compute"), ("bandwidth_eff", "bandwidth"),
                       ("attention_eff", "attention"), ("link_eff", "link"),
                       ("collective_us", "collective_us"), ("step_overhead_ms", "host_ms")):  # fmt: skip
        v = getattr(args, flag, None)
        if v is not None:
            e = replace(e, **{attr: v})
    return e


def _time_model(args: argparse.Namespace, model: ModelSpec, gpu: GpuSpec, tp: int, pp: int) -> Any:
    """The roofline the flags ask for (calibrated first when ``--calibrate`` is given)."""
    from dataclasses import replace

    from .timing import TimeModel

    def build(eff: Any) -> Any:
        return TimeModel.for_model(
            model, None, getattr(args, "prefill_us", None), getattr(args, "decode_us", None),
            getattr(args, "kv_read_ns", None), gpu, tp, pp, eff, getattr(args, "peak_tflops", None),
            getattr(args, "hbm_tbs", None), getattr(args, "link_gbs", None),
        )  # fmt: skip

    eff = _efficiency(args)
    tm = build(eff)
    path = getattr(args, "calibrate", None)
    if path:
        from .calibrate import calibrate

        cal = getattr(args, "_calibration", None)
        if cal is None or cal.path != path:
            cal = calibrate(tm, path)
            args._calibration = cal
        e = cal.eff
        if getattr(args, "step_overhead_ms", None) is not None:  # an explicit flag wins
            e = replace(e, host_ms=args.step_overhead_ms)
        tm = build(e)
    return tm


def _engine(args: argparse.Namespace, model: ModelSpec, host_cache_gib: float = 0.0,
            all_full: Optional[bool] = None, gpu: Optional[GpuSpec] = None, tp: int = 0,
            pp: int = 0) -> Any:  # fmt: skip
    """The memory bill, the scheduler config and the time model the flags ask for
    (``all_full`` overrides ``--all-full``; ``gpu``, ``tp``, ``pp`` override the flags)."""
    from dataclasses import replace

    from .batching import SchedulerConfig
    from .hosttier import DEFAULT_PCIE_GBPS, host_cache_blocks
    from .metrics import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S
    from .roofline import parallel_layout

    preemption = getattr(args, "preemption", "recompute")
    host_mem = getattr(args, "host_mem", None)
    host = host_mem if host_mem is not None else (DEFAULT_SWAP_GIB if preemption == "swap" else 0.0)
    full = args.all_full if all_full is None else all_full
    gpu = gpu or _gpu(args)
    tp = tp or getattr(args, "tp", 1)
    pp = pp or getattr(args, "pp", 1)
    par = parallel_layout(model, tp, pp)
    bill = memory_bill(model, _gpu_mem(args, gpu), args.block_size, args.reserve, args.num_blocks, host,
                       max_blocks=L.MAX_SIM_BLOCKS, all_full=full, gpus=par.gpus,
                       kv_copies=par.kv_copies)  # fmt: skip
    tm = _time_model(args, model, gpu, tp, pp)
    pcie = args.pcie_gbps if args.pcie_gbps is not None else DEFAULT_PCIE_GBPS
    tm = replace(tm, swap_bytes_per_s=pcie * 1e9)
    cfg = SchedulerConfig(
        num_blocks=bill.num_blocks,
        block_size=bill.block_size,
        enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
        watermark=getattr(args, "watermark", 0.01),
        max_num_seqs=getattr(args, "max_num_seqs", 256),
        token_budget=getattr(args, "token_budget", 8192),
        preemption=preemption,
        host_write_through=args.host_write_through and host_cache_gib > 0,
        host_blocks=bill.host_blocks,
        block_bytes=bill.block_bytes,
        host_cache_blocks=host_cache_blocks(host_cache_gib, bill.block_bytes)
        if host_cache_gib
        else 0,
        layout=bill.groups,
        slo_ttft_s=getattr(args, "ttft_slo", None)
        or getattr(args, "ttft_p99", None)
        or DEFAULT_TTFT_SLO_S,
        slo_tpot_s=getattr(args, "tpot_slo", None)
        or getattr(args, "tpot_p99", None)
        or DEFAULT_TPOT_SLO_S,
    )
    cfg.validate()
    return bill, cfg, tm


def _engine_desc(cfg: Any, tm: Any) -> str:
    return (
        f"continuous batching, {cfg.token_budget:,} tokens/step, <= {cfg.max_num_seqs} seqs, watermark "
        f"{cfg.watermark:g}, prefix caching {'on' if cfg.enable_prefix_caching else 'off'}, "
        f"preemption by {cfg.preemption}\n"
        f"time      {tm.describe()}"
    )


def _gpu_line(gpu: GpuSpec, tm: Any, replicas: int, bill: Any) -> str:
    """The GPU / parallelism line of a report: what the GPUs are, how many, at what price."""
    par = tm.parallel
    n = replicas * par.gpus
    per_gpu_w = bill.weight_bytes / par.gpus / (1 << 30)
    per_gpu_kv = bill.num_blocks * bill.block_bytes * par.kv_copies / par.gpus / (1 << 30)
    bubble = f", pipeline bubble {100 * (par.pp - 1) / par.pp:.0f}%" if par.pp > 1 else ""
    return (
        f"gpus      {n} x {gpu.name} = {replicas} replica{'s' if replicas > 1 else ''} x TP {par.tp} x PP {par.pp}"
        f" ({bill.gpu_bytes / par.gpus / (1 << 30):.4g} GiB, {gpu.hbm_tb_s:g} TB/s, {gpu.bf16_tflops:g} bf16 TFLOP/s, {gpu.link} "
        f"{gpu.link_gb_s:g} GB/s); per GPU {per_gpu_w:.2f} GiB weights ({bill.model.weight_dtype}) + "
        f"{per_gpu_kv:.2f} GiB KV ({bill.model.kv_dtype}){bubble}; ${n * gpu.usd_per_hour:,.2f}/hour"
    )


def _slo_keys(summary: Dict[str, Any], gpus: int, usd_per_hour: float) -> Dict[str, Any]:
    """The headline figures an operator states SLOs in (top-level ``--json`` keys)."""
    return {
        "ttft_p50": summary.get("ttft_p50_s"),
        "ttft_p99": summary.get("ttft_p99_s"),
        "tpot_p50": summary.get("tpot_p50_s"),
        "tpot_p99": summary.get("tpot_p99_s"),
        "e2e_p50": summary.get("latency_p50_s"),
        "e2e_p99": summary.get("latency_p99_s"),
        "throughput_tok_s": summary.get("throughput_tok_s"),
        "throughput_req_s": summary.get("throughput_req_s"),
        "goodput": summary.get("goodput"),
        "goodput_req_s": summary.get("goodput_req_s"),
        "gpus": gpus,
        "usd_per_hour": gpus * usd_per_hour,
    }


def _describe(args: argparse.Namespace, cfg: Any, tm: Any, bill: Any, replicas: int) -> str:
    """The engine, time, GPU (and calibration) lines of a text report."""
    lines = [_engine_desc(cfg, tm), _gpu_line(_gpu(args), tm, replicas, bill)]
    cal = getattr(args, "_calibration", None)
    if cal is not None:
        lines.append(f"calib     {cal.describe()}")
    return "\n".join(lines)


def _json_head(
    args: argparse.Namespace, summary: Dict[str, Any], tm: Any, replicas: int
) -> Dict[str, Any]:
    """The top-level ``--json`` keys: SLO figures, GPUs, parallelism, calibration."""
    gpu = _gpu(args)
    par = tm.parallel
    head = _slo_keys(summary, replicas * par.gpus, gpu.usd_per_hour)
    head.update(gpu=gpu.name, replicas=replicas, tp=par.tp, pp=par.pp, gpu_spec=gpu.as_dict())
    cal = getattr(args, "_calibration", None)
    if cal is not None:
        head["calibration"] = cal.as_dict()
    return head


def _check_host_tier(gib: float, write_through: bool = False) -> None:
    from .hosttier import HOST_TIER_MISSING, host_tier_available

    if gib > 0 and not host_tier_available():
        raise SimulationError(HOST_TIER_MISSING)
    if write_through and gib <= 0:
        raise SimulationError("--host-write-through needs a host tier (--host-cache GiB > 0)")


def _simulate(args: argparse.Namespace) -> int:
    from .contiguous import simulate_contiguous
    from .progress import ProgressBar
    from .report import format_simulation, simulation_json
    from .scheduler import simulate_paged
    from .workload import load_workload

    _check_host_tier(args.host_cache, args.host_write_through)
    if args.overlap_weight is not None and args.router != "prefix_aware":
        raise SimulationError("--overlap-weight applies to --router prefix_aware only")
    model = _model(args)
    if args.compare_all_full and args.all_full:
        raise SimulationError(
            "--compare-all-full already replays the --all-full baseline; give one"
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
    contiguous = None
    if not args.no_contiguous:
        max_len = args.max_model_len or int(wstats["max_total"])
        bar = ProgressBar("contiguous", len(workload)) if show else None
        try:
            contiguous = simulate_contiguous(workload, cfg, tm, max_len, progress=bar)
        finally:
            if bar is not None:
                bar.close()
    desc = _describe(args, cfg, tm, bill, 1)
    if args.plot:
        from .plot import plot_results

        plot_results([r for r in (paged, contiguous) if r is not None], args.plot,
                     title=f"{workload.name} on {model.name}, {_gpu_mem(args):g} GiB")  # fmt: skip
    base_bill = base[0] if base is not None else None
    if args.json:
        print(simulation_json(workload.name, wstats, bill, cfg.as_dict(), tm.as_dict(), paged, contiguous,
                              all_full, base_bill, _json_head(args, paged.summary, tm, 1)))  # fmt: skip
    else:
        print(
            format_simulation(
                workload.name, wstats, bill, desc, paged, contiguous, all_full, base_bill
            )
        )
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _simulate_cluster(args: argparse.Namespace, model: ModelSpec, bill: Any, cfg: Any, tm: Any,
                      workload: Any, wstats: Dict[str, float], show: bool) -> int:  # fmt: skip
    """``simulate --replicas N --router R``: the cluster replay and its report (no contiguous
    baseline: it models one engine)."""
    from .cluster import simulate_cluster
    from .cluster_report import cluster_json, format_cluster
    from .progress import ProgressBar

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
        from .plot import plot_results

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
    from .roofline import parallel_layout

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
    from .capacity import (
        CapacityPlan,
        capacity_json,
        cheapest,
        format_capacity,
        parse_counts,
        parse_sizes,  # fmt: skip
        sweep,
    )
    from .progress import ProgressBar
    from .routers import ROUTERS
    from .workload import load_workload

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
        from .plot import plot_capacity

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
    from .capacity import parse_counts, parse_sizes
    from .cluster import Cluster, ReplayStopped
    from .gpuplan import (
        Family,
        format_gpu_plan,
        gpu_plan_json,
        idle_prefill_s,
        search,
        ttft_already_missed,
    )
    from .gpus import parse_gpus
    from .models import KV_DTYPES, GiB
    from .progress import ProgressBar
    from .routers import ROUTERS
    from .workload import load_workload

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
        from .plot import plot_gpu_plan

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


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``simulate`` or ``plan`` command; returns the exit status."""
    return _simulate(args) if args.command == "simulate" else _plan(args)
