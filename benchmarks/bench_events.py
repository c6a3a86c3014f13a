"""KV-event benchmarks (issue 14): encoding to vLLM's wire format and publish() latency.

    python benchmarks/bench_events.py [--quick]

- encode: ``kvblocks.events.encode_batch`` of 1,000 BlockStored events (16-token blocks; 1 and
  8 blocks per event, the latter a prefill), in ns per event. The baseline, timed in the same
  run, is what vLLM itself does per event: fold its digests to ints, slice the tokens, build
  its msgspec ``BlockStored`` (declared here as vLLM 0.34 declares it), then encode the batch
  with msgspec. kvblocks' side starts from the events ``take_events()`` returns. A lower
  bound is also timed: the structs built from already folded ints, then encoded.
- drain (issue 24): take_events + encode of 1,000 stored events from a pool's log, the C
  writer (``encode_batch(pool)``) and the Python path, p50/p99 per batch and the ratio to
  msgspec encoding vLLM's own structs for the same events, prebuilt (its encode step alone).
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
from kvblocks import BlockPool  # noqa: E402
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


def bench_drain(rows, repeats, n=1000, bs=16):
    """take_events + encode of a pool's 1,000 stored events (issue 24, finding 7): the C
    writer (``encode_batch(pool)``) and the Python path (``encode_batch(pool.take_events())``),
    each timed from a full log (refilled untimed before each sample), against msgspec
    encoding vLLM's own structs for the same events, built beforehand (the floor of any
    Python publisher: vLLM's encode step alone). Requests carry a salt and an adapter on a
    third of the events, so extra keys are on the wire."""
    for nb in (1, 8):
        rng = random.Random(nb)
        pool = BlockPool(
            n * nb + 2, block_size=bs, hash_key=b"0123456789abcdef", enable_kv_events=True
        )
        work = []
        for i in range(n):
            h = np.array(
                [[rng.getrandbits(64), rng.getrandbits(64)] for _ in range(nb)], dtype=np.uint64
            )
            kw = {"salt": "tenant-a", "lora_name": "alice", "lora_id": 1} if i % 3 == 0 else {}
            work.append(
                (h, rng.getrandbits(127) | 1, [rng.randrange(128000) for _ in range(nb * bs)], kw)
            )
        held = [pool.allocate(n * nb)]

        def fill():
            pool.free(held[0])
            pool.reset_prefix_cache()
            pool.take_events()
            ids = held[0] = pool.allocate(n * nb)
            for i, (h, par, t, kw) in enumerate(work):
                pool.cache(ids[i * nb : (i + 1) * nb], h, parent=par, token_ids=t, **kw)

        fill()
        events = pool.take_events()
        assert len(events) == n
        m = (1 << 64) - 1
        prebuilt = VBatch(
            1.0,
            [
                VBlockStored(
                    [x & m for x in e.block_hashes],
                    e.parent_block_hash & m,
                    e.token_ids,
                    bs,
                    e.lora_id,
                    "GPU",
                    e.lora_name,
                    e.extra_keys or [None] * nb,
                    0,
                    "full_attention",
                )
                for e in events
            ],
            0,
        )
        enc = msgspec.msgpack.Encoder()
        want = enc.encode(prebuilt)
        fill()
        assert encode_batch(pool, ts=1.0) == want
        fill()
        assert encode_batch(pool.take_events(), ts=1.0) == want
        c = measure(lambda: encode_batch(pool, ts=1.0), inner=1, repeats=repeats, setup=fill)
        py = measure(
            lambda: encode_batch(pool.take_events(), ts=1.0),
            inner=1,
            repeats=max(repeats // 4, 10),
            setup=fill,
        )
        v = measure(lambda: enc.encode(prebuilt), inner=1, repeats=repeats)
        for name, r in (
            ("C writer: encode_batch(pool)", c),
            ("Python: encode_batch(pool.take_events())", py),
        ):
            rows.append(
                {
                    "op": f"drain {n} stored, {nb} x {bs}-token block(s): {name}",
                    "p50_ns": r["p50_ns"] / n,
                    "p99_ns": r["p99_ns"] / n,
                    "batch_p50_us": r["p50_ns"] / 1e3,
                    "batch_p99_us": r["p99_ns"] / 1e3,
                    "msgspec_prebuilt_p50_us": v["p50_ns"] / 1e3,
                    "msgspec_prebuilt_p99_us": v["p99_ns"] / 1e3,
                    "ratio_vs_msgspec_prebuilt": r["p50_ns"] / v["p50_ns"],
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
    drain: list = []
    bench_drain(drain, 30 if args.quick else 200)
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
    print(
        table(
            drain,
            [
                "op",
                "batch_p50_us",
                "batch_p99_us",
                "msgspec_prebuilt_p50_us",
                "msgspec_prebuilt_p99_us",
                "ratio_vs_msgspec_prebuilt",
            ],
        )
    )
    print(f"wrote {save('bench_events', rows + drain)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
