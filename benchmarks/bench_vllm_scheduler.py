"""vLLM's whole scheduler step on vLLM's KV cache manager vs on kvblocks' (issue 26, item 5).

How much of a vLLM scheduler step is the KV manager? This runs vLLM 0.34.0's own
``Scheduler`` (built by vLLM's test helper ``tests.v1.core.utils.create_scheduler``, prefix
caching on, 40,000 blocks of 16) over the workload of ../shared/vllm-seam.md (256 requests,
each one of 4 shared 512-token system prompts + 512 tokens of its own), with a fake model
output (one sampled token per request whose prompt is done), twice per repetition: once on
vLLM's ``KVCacheManager``, once with ``kvblocks.integrations.vllm.enable()`` (the order
alternates). Timed, per repetition:

- prefill: every ``schedule()`` + ``update_from_output()`` until all 256 prompts are computed
  (chunked prefill, 32,768 tokens per step; the shared prompts hit after their first
  request, so about 5 steps);
- decode: 32 steps of 256 running requests, one token each; the median step.

Both sides must schedule the same tokens in every step and give every request the same block
ids (checked). Reports medians and p99 over repetitions and the ratios vLLM / kvblocks, and
writes benchmarks/results/bench_vllm_scheduler.json. There is no target: the ratio says how
much of vLLM's step its KV bookkeeping was. Run with .ci/vllm's venv, from vLLM's source root:

    cd ~/.cache/kvblocks-vllm/vllm-0.34.0 && HF_HOME=~/.cache/kvblocks-vllm/hf \\
      HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PYTHONPATH=$KVB:$KVB/.ci:$PWD \\
      ../venv/bin/python $KVB/benchmarks/bench_vllm_scheduler.py [--reps 5]

(``$KVB``: this checkout; ``.ci/vllm`` writes the offline model configs under ``hf``.)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import vllm_cpu  # .ci/vllm_cpu.py: vLLM's CPU platform check, as in .ci/vllm
from tests.v1.core.utils import create_scheduler
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

import kvblocks.integrations.vllm as kvb_vllm
from kvblocks.bench import vllm_manager as bench_vllm  # the workload's requests

BLOCK_SIZE, NUM_BLOCKS = bench_vllm.BLOCK_SIZE, bench_vllm.NUM_BLOCKS
NREQ, DECODE_STEPS = 256, 32


def make_requests() -> list[Request]:
    """`kvblocks bench vllm`'s requests, long enough for every decode step and never stopped."""
    return bench_vllm.make_requests(NREQ, max_tokens=DECODE_STEPS + 8, ignore_eos=True)


def fake_output(sched: Any, so: Any) -> ModelRunnerOutput:
    """One sampled token for each scheduled request whose prompt is computed, none for a
    request in the middle of its prompt (what a model runner returns)."""
    ids = list(so.num_scheduled_tokens)
    tokens = []
    for rid in ids:
        r = sched.requests[rid]
        tokens.append([7] if r.num_computed_tokens >= r.num_prompt_tokens else [])
    return ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=tokens,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def one_run(native: bool) -> tuple[float, list[float], list[Any], dict[str, Any]]:
    ctx = kvb_vllm.enable() if native else None
    try:
        sched = create_scheduler(
            enable_prefix_caching=True,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_seqs=NREQ,
            max_num_batched_tokens=32768,
            max_model_len=2048,
        )
    finally:
        if ctx is not None:
            kvb_vllm.disable()
    kind = type(sched.kv_cache_manager).__module__
    assert kind.startswith("kvblocks") == native, kind
    for r in make_requests():
        sched.add_request(r)
    trace: list[Any] = []  # tokens scheduled per step, for the side-by-side check
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
            so = sched.schedule()
            sched.update_from_output(so, fake_output(sched, so))
            trace.append(dict(so.num_scheduled_tokens))
        prefill = (time.perf_counter_ns() - t0) / 1e6
        steps = []
        for _ in range(DECODE_STEPS):
            t0 = time.perf_counter_ns()
            so = sched.schedule()
            sched.update_from_output(so, fake_output(sched, so))
            steps.append((time.perf_counter_ns() - t0) / 1e6)
            trace.append(dict(so.num_scheduled_tokens))
    finally:
        gc.enable()
    mgr = sched.kv_cache_manager
    blocks = {rid: mgr.get_block_ids(rid) for rid in sched.requests}
    return prefill, steps, trace, blocks


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--verbose", action="store_true", help="every rep's step times")
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results/bench_vllm_scheduler.json")
    )
    args = ap.parse_args()
    vllm_cpu.pytest_configure(None)
    init_none_hash(sha256)
    res: dict[str, dict[str, list[float]]] = {
        s: {"prefill": [], "decode": []} for s in ("vllm", "kvblocks")
    }
    for rep in range(args.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        got = {}
        for native in order:
            prefill, steps, trace, blocks = one_run(native)
            side = "kvblocks" if native else "vllm"
            res[side]["prefill"].append(prefill)
            res[side]["decode"].append(statistics.median(steps))
            if args.verbose:
                print(
                    f"rep {rep} {side:8s} prefill {prefill:7.2f} ms, decode steps "
                    f"{' '.join(f'{x:.2f}' for x in steps)}"
                )
            got[native] = (trace, blocks)
        if got[False] != got[True]:
            sys.exit("the two managers scheduled different steps or gave different blocks")
    summary: dict[str, Any] = {
        "workload": {
            "requests": NREQ,
            "num_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE,
            "reps": args.reps,
        }
    }
    for phase, unit in (("prefill", "ms for all prefill steps"), ("decode", "ms per step")):
        v, k = res["vllm"][phase], res["kvblocks"][phase]
        ratio = statistics.median(v) / statistics.median(k)
        summary[phase] = {
            "unit": unit,
            "vllm_median": statistics.median(v),
            "vllm_p99": p99(v),
            "kvblocks_median": statistics.median(k),
            "kvblocks_p99": p99(k),
            "ratio_vllm_over_kvblocks": ratio,
        }
        print(
            f"{phase:8s} vLLM {statistics.median(v):8.2f} (p99 {p99(v):8.2f})  kvblocks "
            f"{statistics.median(k):8.2f} (p99 {p99(k):8.2f})  {unit}; ratio {ratio:.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
