"""KV-event benchmarks (issue 14): encoding to vLLM's wire format and publish() latency.

    python benchmarks/bench_events.py [--quick]

- encode: ``kvblocks.events.encode_batch`` of 1,000 BlockStored events (16-token blocks; 1 and
  8 blocks per event, the latter a prefill), in ns per event. The baseline, timed in the same
  run, is what vLLM itself does per event: fold its digests to ints, slice the tokens, build
  its msgspec ``BlockStored`` (declared here as vLLM 0.34 declares it), then encode the batch
  with msgspec. kvblocks' side starts from the events ``take_events()`` returns. A lower
  bound is also timed: the structs built from already folded ints, then encoded.
- publish: ``ZmqEventPublisher.publish`` of one small batch, on the calling (engine) thread,
  per call, while the background thread sends.

Prints a table and writes benchmarks/results/bench_events.json. Needs msgspec and pyzmq.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblocks.bench.report import save, table  # noqa: E402
from kvblocks.bench.timing import measure  # noqa: E402
from kvblocks.events import BlockStored, ZmqEventPublisher, encode_batch  # noqa: E402


# vLLM 0.34's declarations (vllm/distributed/kv_events.py), the baseline's structs
class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: List[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[List[List[int]]] = None


def bench_encode(rows, repeats, n=1000, bs=16):
    rng = random.Random(0)
    enc = msgspec.msgpack.Encoder()
    for nb in (1, 8):
        events = [
            BlockStored(
                [rng.getrandbits(128) for _ in range(nb)],
                rng.getrandbits(128),
                [rng.randrange(128000) for _ in range(nb * bs)],
                bs,
            )
            for _ in range(n)
        ]
        assert len(encode_batch(events, ts=1.0)) > n
        r = measure(lambda: encode_batch(events, ts=1.0), inner=1, repeats=repeats)
        # vLLM keeps 32-byte digests and the request's token list; per event it folds each
        # hash (maybe_convert_block_hash), slices the tokens and builds its struct
        digests = [
            (
                [h.to_bytes(32, "big") for h in e.block_hashes],
                e.parent_block_hash.to_bytes(32, "big"),
                e.token_ids,
            )
            for e in events
        ]
        m = (1 << 64) - 1

        def vllm():
            evs = [
                VBlockStored(
                    [int.from_bytes(h, "big") & m for h in hs],
                    int.from_bytes(p, "big") & m,
                    t[:],
                    bs,
                    None,
                    "GPU",
                    None,
                    [None] * nb,
                    0,
                    "full_attention",
                )
                for hs, p, t in digests
            ]
            return enc.encode(VBatch(1.0, evs, 0))

        folded = [
            ([h & m for h in e.block_hashes], e.parent_block_hash & m, e.token_ids) for e in events
        ]

        def vllm_struct_only():  # a lower bound: struct and encode, no fold, no slice
            evs = [
                VBlockStored(hs, p, t, bs, None, "GPU", None, [None] * nb, 0, "full_attention")
                for hs, p, t in folded
            ]
            return enc.encode(VBatch(1.0, evs, 0))

        assert vllm() == vllm_struct_only() == encode_batch(events, ts=1.0)
        v = measure(vllm, inner=1, repeats=repeats)
        v0 = measure(vllm_struct_only, inner=1, repeats=repeats)
        rows.append(
            {
                "op": f"encode BlockStored, {nb} x {bs}-token block(s)",
                "p50_ns": r["p50_ns"] / n,
                "p99_ns": r["p99_ns"] / n,
                "M_events_per_s": 1e3 / (r["p50_ns"] / n),
                "vllm_p50_ns": v["p50_ns"] / n,
                "ratio_vs_vllm": r["p50_ns"] / v["p50_ns"],
                "struct_only_p50_ns": v0["p50_ns"] / n,
                "ratio_vs_struct_only": r["p50_ns"] / v0["p50_ns"],
            }
        )


def bench_publish(rows, calls):
    events = [BlockStored([1, 2, 3], None, list(range(48)), 16)]
    with ZmqEventPublisher("tcp://127.0.0.1:0", bind=True, max_queue_size=1 << 20) as pub:
        lat = np.empty(calls)
        t = time.perf_counter_ns
        for i in range(calls):
            t0 = t()
            pub.publish(events)
            lat[i] = t() - t0
            if i % 64 == 63:  # an engine step does other work between publishes
                time.sleep(0.0002)
        pub.flush()
        assert pub.sent == calls and pub.dropped == 0
    rows.append(
        {
            "op": "publish() one batch, engine thread",
            "p50_ns": float(np.median(lat)),
            "p99_ns": float(np.percentile(lat, 99)),
        }
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rows: list = []
    bench_encode(rows, 50 if args.quick else 300)
    bench_publish(rows, 2000 if args.quick else 20000)
    print(
        table(
            rows,
            [
                "op",
                "p50_ns",
                "p99_ns",
                "M_events_per_s",
                "vllm_p50_ns",
                "ratio_vs_vllm",
                "struct_only_p50_ns",
                "ratio_vs_struct_only",
            ],
        )
    )
    print(f"wrote {save('bench_events', rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
