"""The simulator's time model against published measurements (docs/simulator-validation.md).

    python benchmarks/sim_validation.py [--json OUT] [extra simulate flags, e.g. --compute-eff 0.5]

Each case rebuilds a published benchmark as a synthetic trace (fixed input and output
lengths, the published batch or a sequential stream for concurrency 1), replays it with
``kvblocks simulate --json`` and compares one figure with the published one. The published
numbers and their sources live in CASES below; nothing is downloaded. Prints a markdown
table (predicted, published, error) and the mean absolute error per figure kind.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvblocks.__main__ import main  # noqa: E402

NIM = "NVIDIA NIM LLM benchmarking, Performance (v1.0.0 docs): Llama-3.3-70B-Instruct NIM 1.8.0, 2 x H100 80G, fp8, TP2"
TRT = "TensorRT-LLM release/0.5.0 docs/source/performance.md, H100 GPUs (FP8), static batch"
# The TRT-LLM table does not name its KV dtype; fp8 is the one under which its batches fit:
# 64 x 2,176 LLaMA-7B tokens of bf16 KV (512 KiB each, MHA) are 68 GiB, beyond 80 GiB less
# the weights and a reserve. NIM's fp8 profile is taken with bf16 KV (the vLLM default).
FP8_KV = ("--kv-dtype", "fp8")
MILL = (
    "Millstone AI inference benchmark, gpt-oss-120b MXFP4 (vLLM, Jan 2026): peak system throughput"
)
# The summary table gives each GPU's peak system throughput and the concurrency range tested;
# the series' reports state the peak at the top of that range and 1K context, 1,024 output
# tokens per request, no prompt caching, full-precision KV. MXFP4 is about 4.25 bits per
# expert weight: --weight-dtype fp4 (4 bits and one fp8 scale per 16) is the nearest.
LLAMA2_7B = (
    "--layers",
    "32",
    "--kv-heads",
    "32",
    "--head-dim",
    "128",
    "--params",
    "6.74",
)  # Llama-2-7B

# name, source, model flags, gpu flags, (input, output), batch (0: sequential, one at a time),
# figure (ttft_p50 | tpot_p50 | throughput_tok_s), published value (s or tok/s)
CASES: List[Dict[str, Any]] = [
    dict(name="Llama-3.3-70B fp8 TP2, 5000/500, concurrency 1: TTFT", src=NIM,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8"), gpu=("--gpu", "h100-sxm", "--tp", "2"),
         lens=(5000, 500), batch=0, figure="ttft_p50", published=0.40677),
    dict(name="Llama-3.3-70B fp8 TP2, 5000/500, concurrency 1: ITL", src=NIM,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8"), gpu=("--gpu", "h100-sxm", "--tp", "2"),
         lens=(5000, 500), batch=0, figure="tpot_p50", published=0.01858),
    dict(name="Llama-3.3-70B fp8 TP2, 500/2000, concurrency 1: TTFT", src=NIM,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8"), gpu=("--gpu", "h100-sxm", "--tp", "2"),
         lens=(500, 2000), batch=0, figure="ttft_p50", published=0.04777),
    dict(name="Llama-3.3-70B fp8 TP2, 500/2000, concurrency 1: ITL", src=NIM,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8"), gpu=("--gpu", "h100-sxm", "--tp", "2"),
         lens=(500, 2000), batch=0, figure="tpot_p50", published=0.01891),
    dict(name="Llama-3.3-70B fp8 TP2, 5000/500, saturated (concurrency 250): output tok/s", src=NIM,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8"), gpu=("--gpu", "h100-sxm", "--tp", "2"),
         lens=(5000, 500), batch=250, figure="throughput_tok_s", published=920.12),
    dict(name="LLaMA-7B fp8 TP1, batch 64, 128/128: output tok/s", src=TRT, model=LLAMA2_7B + ("--weight-dtype", "fp8") + FP8_KV,
         gpu=("--gpu", "h100-sxm"), lens=(128, 128), batch=64, figure="throughput_tok_s", published=9193),
    dict(name="LLaMA-7B fp8 TP1, batch 64, 128/2048: output tok/s", src=TRT, model=LLAMA2_7B + ("--weight-dtype", "fp8") + FP8_KV,
         gpu=("--gpu", "h100-sxm"), lens=(128, 2048), batch=64, figure="throughput_tok_s", published=5367),
    dict(name="LLaMA-7B fp8 TP1, batch 64, 2048/128: output tok/s", src=TRT, model=LLAMA2_7B + ("--weight-dtype", "fp8") + FP8_KV,
         gpu=("--gpu", "h100-sxm"), lens=(2048, 128), batch=64, figure="throughput_tok_s", published=2058),
    dict(name="LLaMA-7B fp8 TP1, batch 32, 2048/2048: output tok/s", src=TRT, model=LLAMA2_7B + ("--weight-dtype", "fp8") + FP8_KV,
         gpu=("--gpu", "h100-sxm"), lens=(2048, 2048), batch=32, figure="throughput_tok_s", published=2230),
    dict(name="LLaMA-70B fp8 TP4, batch 64, 128/128: output tok/s", src=TRT,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8") + FP8_KV, gpu=("--gpu", "h100-sxm", "--tp", "4"),
         lens=(128, 128), batch=64, figure="throughput_tok_s", published=3317),
    dict(name="LLaMA-70B fp8 TP4, batch 64, 128/2048: output tok/s", src=TRT,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8") + FP8_KV, gpu=("--gpu", "h100-sxm", "--tp", "4"),
         lens=(128, 2048), batch=64, figure="throughput_tok_s", published=2616),
    dict(name="LLaMA-70B fp8 TP4, batch 64, 2048/128: output tok/s", src=TRT,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8") + FP8_KV, gpu=("--gpu", "h100-sxm", "--tp", "4"),
         lens=(2048, 128), batch=64, figure="throughput_tok_s", published=843),
    dict(name="LLaMA-70B fp8 TP4, batch 64, 2048/2048: output tok/s", src=TRT,
         model=("--model", "llama-3.1-70b", "--weight-dtype", "fp8") + FP8_KV, gpu=("--gpu", "h100-sxm", "--tp", "4"),
         lens=(2048, 2048), batch=64, figure="throughput_tok_s", published=1583),
    dict(name="gpt-oss-120b MXFP4 TP1, H100 SXM, 4 concurrent, 1K/1K: output tok/s", src=MILL,
         model=("--model", "gpt-oss-120b", "--weight-dtype", "fp4"), gpu=("--gpu", "h100-sxm"),
         lens=(1024, 1024), batch=4, figure="throughput_tok_s", published=511),
    dict(name="gpt-oss-120b MXFP4 TP1, H200, 10 concurrent, 1K/1K: output tok/s", src=MILL,
         model=("--model", "gpt-oss-120b", "--weight-dtype", "fp4"), gpu=("--gpu", "h200"),
         lens=(1024, 1024), batch=10, figure="throughput_tok_s", published=849),
]  # fmt: skip


def trace(path: Path, n: int, isl: int, osl: int, gap_ms: float) -> None:
    """``n`` requests of fixed lengths, no shared prefixes, ``gap_ms`` apart."""
    blocks = -(-isl // 512)
    with open(path, "w") as f:
        for i in range(n):
            ids = list(range(i * blocks, (i + 1) * blocks))
            f.write(
                json.dumps(
                    {
                        "timestamp": i * gap_ms,
                        "input_length": isl,
                        "output_length": osl,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )


def run_case(c: Dict[str, Any], extra: List[str], tmp: Path) -> float:
    isl, osl = c["lens"]
    path = tmp / "case.jsonl"
    if c["batch"]:  # all at once, the batch as the sequence limit (a static batch)
        n, gap = c["batch"], 0.0
        engine = [
            "--max-num-seqs",
            str(c["batch"]),
            "--token-budget",
            str(max(8192, c["batch"] * isl)),
        ]
    else:  # one at a time: each request arrives after the previous one is long done
        n, gap = 4, 1000.0 * (2.0 + osl * 0.2)
        engine = []
    trace(path, n, isl, osl, gap)
    argv = ["simulate", "--trace", str(path), "--json", "--no-contiguous", "--no-progress",
            "--no-prefix-caching", *c["model"], *c["gpu"], *engine, *extra]  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    if rc:
        raise SystemExit(f"{c['name']}: kvblocks simulate failed ({rc})")
    return float(json.loads(buf.getvalue())[c["figure"]])


def fmt(v: float, figure: str) -> str:
    return f"{v:,.0f} tok/s" if figure == "throughput_tok_s" else f"{v * 1e3:.1f} ms"


def main_(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    args, extra = ap.parse_known_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for c in CASES:
            pred = run_case(c, extra, Path(d))
            err = (pred - c["published"]) / c["published"]
            rows.append(dict(name=c["name"], source=c["src"], figure=c["figure"], predicted=pred,
                             published=c["published"], error=err))  # fmt: skip
    print("| case | published | predicted | error |")
    print("| :--- | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['name']} | {fmt(r['published'], r['figure'])} | {fmt(r['predicted'], r['figure'])} | {100 * r['error']:+.0f}% |"
        )
    print()
    for kind in ("ttft_p50", "tpot_p50", "throughput_tok_s"):
        errs = [abs(r["error"]) for r in rows if r["figure"] == kind]
        if errs:
            print(f"mean |error| {kind}: {100 * sum(errs) / len(errs):.0f}% over {len(errs)} cases")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main_(sys.argv[1:]))
