"""The model, memory, engine and time-model flags (``add_model_args``, ``add_time_args``: the
flags ``kvblocks simulate`` and ``kvblocks plan`` share) and, from them, what a replay needs: the model, the GPU, the memory bill, the scheduler
config and the roofline time model (calibrated when ``--calibrate`` is given), and the report
lines and ``--json`` keys they add (``kvblocks simulate`` and ``kvblocks plan`` share them)."""

from __future__ import annotations

import argparse
from typing import Any, Dict, Optional

from .. import limits as L
from ..errors import SimulationError
from ..models.gpus import DEFAULT_GPU, GPUS, GpuSpec, get_gpu
from ..models.hybrid import parse_layer_kinds
from ..models.spec import DEFAULT_MODEL, PRESETS, ModelSpec, custom_model, get_model, memory_bill

__all__ = ["add_model_args", "add_time_args", "model_from_args", "engine_from_args"]

DEFAULT_GPU_MEM = 80.0
DEFAULT_SWAP_GIB = 4.0


def add_model_args(p: argparse.ArgumentParser, plan: bool = False) -> None:
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

    from ..tier.host import DEFAULT_PCIE_GBPS, host_cache_blocks
    from .batching import SchedulerConfig
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
    from ..tier.host import HOST_TIER_MISSING, host_tier_available

    if gib > 0 and not host_tier_available():
        raise SimulationError(HOST_TIER_MISSING)
    if write_through and gib <= 0:
        raise SimulationError("--host-write-through needs a host tier (--host-cache GiB > 0)")


add_time_args = _add_time_args
model_from_args = _model
engine_from_args = _engine
