"""Time BlockManager.metadata (the native attention-metadata builder) against numpy.

    python bench/bench_metadata.py [--runs 2000] [--block-size 16] [--quick]

Cases (block size 16, metadata written into preallocated AttentionMetadata buffers):
  decode   256 sequences x 4,096 tokens of context, 1 query token each
  prefill  32 sequences x 2,048 new tokens (whole prompts)
Each case is also built by two numpy baselines in the same run, from block tables the engine
already holds as numpy arrays (nothing of kvblocks timed there):
  numpy-list  one int32 array per sequence (concatenate / repeat / fancy indexing)
  numpy-2d    a persistent padded [B, max_blocks] table, vLLM InputBatch style (masking)
and passing a SeqBatch (``mgr.batch(ids)``, resolved once) versus a list of ids.

Every call is timed on its own (perf_counter_ns; the timer overhead is printed) with GC off;
p50 / p99 over ``--runs`` calls after a warm-up. Targets: <= 40 us per call for both cases and
>= 20x faster than numpy for decode. Prints a table and writes
bench/results/metadata_<commit>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvblocks import AttentionMetadata, BlockManager  # noqa: E402

RESULTS = REPO / "bench" / "results"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timer_overhead_ns(n: int = 5000) -> float:
    t = time.perf_counter_ns
    return float(np.median([-(t() - t()) for _ in range(n)]))


def time_calls(fn, runs: int, warmup: int = 50) -> dict:
    """Per-call ns of fn(), each call timed on its own, GC off."""
    for _ in range(warmup):
        fn()
    t = time.perf_counter_ns
    out = np.empty(runs, dtype=np.int64)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for i in range(runs):
            t0 = t()
            fn()
            out[i] = t() - t0
    finally:
        if gc_was:
            gc.enable()
    return {"p50_us": float(np.percentile(out, 50)) / 1e3,
            "p99_us": float(np.percentile(out, 99)) / 1e3,
            "min_us": float(out.min()) / 1e3, "runs": runs}


# ---------------------------------------------------------------------------------------------
# numpy baselines
# ---------------------------------------------------------------------------------------------
def numpy_list(tables, lens, qlens, bs, out):
    """From one block-table array per sequence; writes the same arrays into ``out``."""
    B = len(tables)
    nb = (lens + bs - 1) // bs
    kv_indptr = out["kv_indptr"][:B + 1]
    kv_indptr[0] = 0
    np.cumsum(nb, out=kv_indptr[1:])
    kv_indices = np.concatenate([t[:n] for t, n in zip(tables, nb)])
    out["kv_indices"][:len(kv_indices)] = kv_indices
    bt = out["block_tables"]
    bt[:B] = 0
    for i in range(B):
        bt[i, :nb[i]] = tables[i][:nb[i]]
    qo = out["qo_indptr"][:B + 1]
    qo[0] = 0
    np.cumsum(qlens, out=qo[1:])
    ntok = int(qo[-1])
    start = np.repeat(lens - qlens - qo[:-1], qlens)
    pos = np.arange(ntok) + start
    blk = kv_indices[np.repeat(kv_indptr[:-1], qlens) + pos // bs]
    sm = out["slot_mapping"]
    sm[:ntok] = blk.astype(np.int64) * bs + pos % bs
    sm[ntok:] = -1
    out["seq_lens"][:B] = lens
    out["kv_last_page_len"][:B] = lens - (nb - 1) * bs
    return ntok


def numpy_2d(table2d, lens, qlens, bs, out):
    """From a persistent padded [B, max_blocks] table (vLLM's InputBatch keeps one)."""
    B = table2d.shape[0]
    nb = (lens + bs - 1) // bs
    kv_indptr = out["kv_indptr"][:B + 1]
    kv_indptr[0] = 0
    np.cumsum(nb, out=kv_indptr[1:])
    mask = np.arange(table2d.shape[1])[None, :] < nb[:, None]
    kv_indices = table2d[mask]
    out["kv_indices"][:len(kv_indices)] = kv_indices
    out["block_tables"][:B] = np.where(mask, table2d, 0)
    qo = out["qo_indptr"][:B + 1]
    qo[0] = 0
    np.cumsum(qlens, out=qo[1:])
    ntok = int(qo[-1])
    seq = np.repeat(np.arange(B), qlens)
    pos = np.arange(ntok) + np.repeat(lens - qlens - qo[:-1], qlens)
    sm = out["slot_mapping"]
    sm[:ntok] = table2d[seq, pos // bs].astype(np.int64) * bs + pos % bs
    sm[ntok:] = -1
    out["seq_lens"][:B] = lens
    out["kv_last_page_len"][:B] = lens - (nb - 1) * bs
    return ntok


# ---------------------------------------------------------------------------------------------
def run_case(name, num_seqs, context, query, bs, runs):
    nb = -(-context // bs)
    mgr = BlockManager(num_seqs * (nb + 1) + 8, bs, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    ids = list(range(num_seqs))
    for i in ids:
        mgr.add(i, rng.integers(0, 32000, size=context, dtype=np.int32))
    qlens = np.full(num_seqs, query, dtype=np.int32)
    buf = AttentionMetadata.allocate(max_batch=num_seqs, max_tokens=num_seqs * query,
                                     max_indices=num_seqs * nb, max_blocks_per_seq=nb)
    sb = mgr.batch(ids)
    tables = [mgr.block_table(i) for i in ids]
    lens = np.array([mgr.num_tokens(i) for i in ids], dtype=np.int32)
    table2d = np.zeros((num_seqs, nb), dtype=np.int32)
    for i, t in enumerate(tables):
        table2d[i, :len(t)] = t
    np_out = {k: np.empty_like(v) for k, v in buf.as_dict().items()}

    # the three constructions agree
    meta = mgr.metadata(sb, qlens, out=buf)
    for fn in (lambda: numpy_list(tables, lens, qlens, bs, np_out),
               lambda: numpy_2d(table2d, lens, qlens, bs, np_out)):
        fn()
        for k, v in buf.as_dict().items():
            assert np.array_equal(np_out[k][:len(getattr(meta, k))], getattr(meta, k)), k

    rows = []
    native = time_calls(lambda: mgr.metadata(sb, qlens, out=buf), runs)
    as_list = time_calls(lambda: mgr.metadata(ids, qlens, out=buf), runs)
    fresh = time_calls(lambda: mgr.metadata(sb, qlens), max(runs // 4, 50))
    nl = time_calls(lambda: numpy_list(tables, lens, qlens, bs, np_out), max(runs // 4, 50))
    n2 = time_calls(lambda: numpy_2d(table2d, lens, qlens, bs, np_out), max(runs // 4, 50))
    cases = [("kvblocks, SeqBatch, out=", native), ("kvblocks, list of ids, out=", as_list)]
    if query == 1:
        def cold():  # every row rewritten: what a reused buffer costs when all tables changed
            buf.invalidate()
            mgr.metadata(sb, qlens, out=buf)

        cases += [("kvblocks, out=, all rows rewritten", time_calls(cold, runs)),
                  ("kvblocks, out=, decode advancing", advancing_decode(num_seqs, context, bs,
                                                                        runs))]
    cases += [("kvblocks, SeqBatch, fresh arrays", fresh), ("numpy-list", nl), ("numpy-2d", n2)]
    base = native["p50_us"]
    for label, r in cases:
        rows.append({"case": name, "how": label, "p50_us": r["p50_us"], "p99_us": r["p99_us"],
                     "min_us": r["min_us"], "runs": r["runs"],
                     "x_vs_native": r["p50_us"] / base,
                     "query_tokens": int(qlens.sum()), "kv_blocks": int(num_seqs * nb),
                     "ns_per_block": 1e3 * r["p50_us"] / (num_seqs * nb)})
    return rows


def advancing_decode(num_seqs, context, bs, runs):
    """Real decode steps: one append_batch (untimed) before each timed metadata call; the
    contexts are staggered so that about num_seqs / bs tables gain a block every step."""
    grow = runs // bs + 2
    nb = -(-context // bs) + grow
    mgr = BlockManager(num_seqs * (nb + 1) + 8, bs, enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    ids = list(range(num_seqs))
    for i in ids:
        mgr.add(i, rng.integers(0, 32000, size=context + i % bs, dtype=np.int32))
    sb = mgr.batch(ids)
    qlens = np.ones(num_seqs, dtype=np.int32)
    toks = np.zeros(num_seqs, dtype=np.int32)
    buf = AttentionMetadata.allocate(num_seqs, num_seqs, num_seqs * nb, nb)
    out = np.empty(runs, dtype=np.int64)
    t = time.perf_counter_ns
    was = gc.isenabled()
    gc.disable()
    try:
        for j in range(runs):
            mgr.append_batch(sb, toks)
            t0 = t()
            mgr.metadata(sb, qlens, out=buf)
            out[j] = t() - t0
    finally:
        if was:
            gc.enable()
    fresh = mgr.metadata(sb, qlens)  # the incremental buffers hold exactly the fresh result
    inc = mgr.metadata(sb, qlens, out=buf)
    for k, v in fresh.as_dict().items():
        got = getattr(inc, k)
        if k == "block_tables":  # the buffer's rows are wider: the rest is null-block padding
            assert not got[:, v.shape[1]:].any()
            got = got[:, :v.shape[1]]
        assert np.array_equal(got, v), k
    return {"p50_us": float(np.percentile(out, 50)) / 1e3,
            "p99_us": float(np.percentile(out, 99)) / 1e3,
            "min_us": float(out.min()) / 1e3, "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="few runs (a smoke test)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    runs = 100 if args.quick else args.runs
    bs = args.block_size
    rows = run_case("decode 256 x 4096", 256, 4096, 1, bs, runs)
    rows += run_case("prefill 32 x 2048", 32, 2048, 2048, bs, runs)

    cols = ["case", "how", "p50_us", "p99_us", "x_vs_native", "ns_per_block"]
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    for r in rows:
        print("  ".join(_fmt(r[c]).ljust(w) if i < 2 else _fmt(r[c]).rjust(w)
                        for i, (c, w) in enumerate(zip(cols, widths))))
    overhead = timer_overhead_ns()
    print(f"timer overhead {overhead:.0f} ns per call (included above)")
    verdict = {}
    for case in ("decode 256 x 4096", "prefill 32 x 2048"):
        how = "kvblocks, out=, decode advancing" if case.startswith("decode") else \
            "kvblocks, SeqBatch, out="
        nat = next(r for r in rows if r["case"] == case and r["how"] == how)
        best_np = min(r["p50_us"] for r in rows if r["case"] == case and r["how"].startswith("numpy"))
        verdict[case] = {"p50_us": nat["p50_us"], "p99_us": nat["p99_us"],
                         "speedup_vs_best_numpy": best_np / nat["p50_us"],
                         "meets_40us": nat["p50_us"] <= 40.0}
        print(f"{case}: p50 {nat['p50_us']:.1f} us, p99 {nat['p99_us']:.1f} us, "
              f"{best_np / nat['p50_us']:.1f}x faster than the best numpy baseline")
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        doc = {"bench": "metadata", "commit": commit(), "machine": platform.machine(),
               "python": platform.python_version(), "numpy": np.__version__,
               "cpus": os.cpu_count(), "block_size": bs, "timer_overhead_ns": overhead,
               "rows": rows, "verdict": verdict}
        path = RESULTS / f"metadata_{commit()}.json"
        path.write_text(json.dumps(doc, indent=1))
        print(f"wrote {path.relative_to(REPO)}")
    return 0


def _fmt(v) -> str:
    return f"{v:,.2f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
