"""The GPU planner's search: the fast search (candidates cheapest first, replays stopped as soon
as their miss is certain) gives exactly the exhaustive search's answer; the stop rule follows
the report's percentile; disaggregated candidates; the router's direct pool lookups equal the
event-built index."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvblocks.sim import SchedulerConfig, TimeModel, get_model, load_workload
from kvblocks.sim.cluster.cluster import Cluster
from kvblocks.sim.engine.metrics import percentile
from kvblocks.sim.models.gpus import GPUS
from kvblocks.sim.models.spec import memory_bill
from kvblocks.sim.plan.gpuplan import Family, candidates, cost_key, disagg_splits, search
from kvblocks.sim.plan.replays import (
    Floors,
    certainly_late,
    late_needed,
    max_prefix_hits,
    prefill_floor_s,
    replay_candidate,
)

L8 = get_model("llama-3.1-8b")
NOISE = ("wall_s", "allocator_s", "allocator_share", "check_s")


def _trace(tmp_path, n=40, gap_ms=150, seed=0):
    """Prompts of 1-6k tokens with shared prefixes (hash ids reused), outputs of 8-64."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p = int(rng.integers(1000, 6000))
        shared = int(rng.integers(0, 3))  # 0-2 leading blocks from a common pool
        ids = [int(rng.integers(0, 4)) * 100 + k for k in range(shared)]
        ids += list(range(10_000 + i * 20, 10_000 + i * 20 + math.ceil(p / 512) - shared))
        rows.append(json.dumps({"timestamp": i * gap_ms, "input_length": p,
                                "output_length": int(rng.integers(8, 64)), "hash_ids": ids}))  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return load_workload(str(path))


def _families(blocks=(400, 1200)):
    """Two replica shapes of Llama-3.1-8B on an L40S: a small and a larger KV pool."""
    out = []
    for tp, nb in zip((1, 2), blocks):
        bill = memory_bill(L8, 48, 16, num_blocks=nb)
        cfg = SchedulerConfig(num_blocks=nb, block_size=16, block_bytes=bill.block_bytes,
                              token_budget=2048)  # fmt: skip
        tm = TimeModel.for_model(L8, gpu=GPUS["l40s"], tp=tp)
        f = Family("l40s", tp, 1, "bf16", 0.0, 1.0)
        f.engine = (bill, cfg, tm)
        out.append(f)
    return out


def _replayer(w, stop, floors=None):
    def replay(f, n, prefill=0):
        known = floors.known(f.engine) if floors is not None else None
        return replay_candidate(w, f.engine, n, prefill, "prefix_aware", replay.ttft,
                                replay.tpot, 48.0, stop=stop, known=known)  # fmt: skip

    return replay


@pytest.mark.parametrize(
    "ttft, tpot, by_cost, disagg",
    [(0.5, None, False, False), (2.0, None, False, False), (5.0, 0.05, False, False),
     (1.0, 0.08, True, False), (1e-3, None, False, False), (0.3, None, False, False),
     (2.0, None, False, True), (3.0, 0.05, True, True)],
)  # fmt: skip
def test_fast_search_equals_exhaustive(tmp_path, monkeypatch, ttft, tpot, by_cost, disagg):
    """Several SLOs, by GPUs and by cost, with and without disaggregation: the same answer
    with the same figures, and every candidate cheaper than it replayed and missing. The
    reference replays every candidate to its end one engine step a call (no decode-only runs,
    no stop rule, no floor)."""
    from kvblocks.sim.engine.paged import PagedEngine

    w = _trace(tmp_path)
    fams = _families()
    counts = [1, 2, 3, 4]
    answers = []
    floors = Floors(w, 2048, ttft)
    for stop, exhaustive in ((True, False), (False, True)):
        rp = _replayer(w, stop, floors if stop else None)
        rp.ttft, rp.tpot = ttft, tpot
        with monkeypatch.context() as m:
            if exhaustive:
                m.setattr(PagedEngine, "_only_decoding", lambda self: False)
            plan = search(fams, counts, rp, ttft, tpot, by_cost, requests=len(w),
                          with_disagg=disagg, exhaustive=exhaustive,
                          floor=(lambda f: floors.reason(f.engine)) if stop else None)  # fmt: skip
        answers.append(plan)
    fast, full = answers
    # the reference, computed apart: every candidate replayed to its end
    ref = [c for c in full.replayed if c.meets]
    best = min(ref, key=lambda c: cost_key(c, by_cost), default=None)
    for plan in (fast, full):
        if best is None:
            assert plan.best is None
            continue
        assert plan.best is not None
        assert (plan.best.label(), plan.best.ttft_p99_s, plan.best.tpot_p99_s) == (
            best.label(),
            best.ttft_p99_s,
            best.tpot_p99_s,
        )
    n_all = len(candidates(fams, counts, None, disagg))
    assert len(full.replayed) == n_all
    if best is not None:
        assert all(c.meets is False for c in fast.cheaper)
        bk = cost_key(best, by_cost)
        assert {c.label() for c in fast.cheaper} == {
            c.label() for c in full.replayed if cost_key(c, by_cost) < bk
        }
        # a stopped replay missed for certain: its full replay misses too
        by_label = {c.label(): c for c in full.replayed}
        for c in fast.replayed:
            assert c.meets == by_label[c.label()].meets


def test_late_needed_is_the_reports_p99():
    """p99 > T exactly when late_needed(n) values exceed T, in the worst case for the rest:
    with one fewer the p99 can still be <= T."""
    for n in (1, 2, 3, 50, 99, 100, 101, 199, 201, 1000, 12_031):
        k = late_needed(n)
        v = np.zeros(n)
        v[n - k :] = 1.0 + 1e-9  # k values just over T = 1, the rest as early as can be
        assert percentile(v, 99) > 1.0, n
        v = np.zeros(n)
        v[n - k + 1 :] = 1.0 + 1e-12  # one fewer: the p99 can still be <= T
        assert percentile(v, 99) <= 1.0, n
    assert late_needed(12_031) == 122  # 1.01% of the conversation trace


def test_stop_rule_never_stops_a_replay_that_meets(tmp_path):
    """A target equal to the replay's own p99 is met: the stopped replay runs to the end."""
    w = _trace(tmp_path, n=60, gap_ms=40)
    f = _families()[0]
    full = replay_candidate(w, f.engine, 1, 0, "round_robin", 1e9, None, 48.0, stop=False)
    p99, t99 = full["ttft_p99_s"], full["tpot_p99_s"]
    same = replay_candidate(w, f.engine, 1, 0, "round_robin", p99, t99, 48.0)
    assert not same.get("stopped") and same["ttft_p99_s"] == p99
    tight = replay_candidate(w, f.engine, 1, 0, "round_robin", p99 / 10, None, 48.0)
    assert tight["stopped"] and tight["why"] == "ttft"
    slow = replay_candidate(w, f.engine, 1, 0, "round_robin", 1e9, t99 / 10, 48.0)
    assert slow["stopped"] and slow["why"] == "tpot"


def test_disagg_splits_and_candidates():
    assert [disagg_splits(n, None) for n in range(1, 9)] == [
        [], [1], [1, 2], [1, 2, 3], [1, 3, 4], [2, 3, 5], [2, 4, 5], [2, 4, 6],
    ]  # fmt: skip
    assert disagg_splits(4, [(1, 3), (2, 2), (1, 1)]) == [1, 2]
    f = Family("h100-sxm", 2, 1, "bf16", 0.0, 2.5)
    host = Family("h100-sxm", 2, 1, "bf16", 256.0, 2.5)
    cs = candidates([f, host], [1, 2], [(1, 3)], True)
    got = [(c.family.host_cache_gib, c.replicas, c.prefill) for c in cs]
    assert got == [(0.0, 1, 0), (0.0, 2, 0), (0.0, 4, 1), (256.0, 1, 0), (256.0, 2, 0)]
    c = cs[2]
    assert (c.gpus, c.decode, c.label()) == (8, 3, "8 x h100-sxm (1P+3D x TP2, KV bf16)")
    agg = cs[1]
    agg4 = type(agg)(f, 4)
    assert cost_key(agg4, False) < cost_key(c, False)  # ties: aggregated first


def test_disagg_stopped_replay_names_its_pool(tmp_path):
    w = _trace(tmp_path, n=300, gap_ms=5)  # the prefill pool runs past a stop check (512 steps)
    f = _families()[0]
    s = replay_candidate(w, f.engine, 2, 1, "round_robin", 1e-3, None, 48.0)
    assert s["stopped"] and s["pool"] == "prefill" and s["why"] == "ttft"
    s = replay_candidate(w.head(40), f.engine, 2, 1, "round_robin", 1e-3, None, 48.0)
    assert s["stopped"] and s["pool"] == "decode" and s["why"] == "ttft"  # ended in the decode pool
    full = replay_candidate(w.head(40), f.engine, 2, 1, "round_robin", 1e9, None, 48.0, stop=False)
    assert full["disagg"]["prefill_replicas"] == 1 and full["completed"] == 40


def test_direct_router_lookups_equal_the_event_index(tmp_path):
    """Asking the pools (one group, no host tier) gives the event-built index's routing: the
    same summary, counters included."""
    w = _trace(tmp_path, n=50, gap_ms=30)
    f = _families()[0]
    _, cfg, tm = f.engine
    out = []
    for direct in (False, True):
        cl = Cluster(w, cfg, tm, 3, "prefix_aware", direct_lookup=direct)
        assert cl.direct is direct
        res = cl.run()
        out.append(({k: v for k, v in res.summary.items() if k not in NOISE}, cl.owner.tolist()))
    assert out[0] == out[1]
    assert out[0][0]["prefix_hit_rate"] > 0


def test_plan_cli_searches_disagg(tmp_path, capsys):
    from kvblocks.__main__ import main

    path = tmp_path / "t.jsonl"
    rows = [json.dumps({"timestamp": i * 300, "input_length": 3000, "output_length": 64,
                        "hash_ids": list(range(i * 10, i * 10 + 6))}) for i in range(16)]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    rc = main(["plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--trace", str(path),
               "--ttft-p99", "0.05", "--tp", "1", "--replicas", "1-3", "--disagg", "auto",
               "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "(1P+1D x TP1" in out and "(1P+2D x TP1" in out and "(2P+1D x TP1" in out
    rc = main(["plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--trace", str(path),
               "--ttft-p99", "30", "--tp", "1", "--replicas", "2", "--disagg", "1:1",
               "--json", "--no-progress"])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["replicas"] == 2 and doc["disagg"] is None  # aggregated wins the tie
    assert any(c["disagg"] == "1:1" for c in doc["frontier"]) or doc["replays"] == 1
    for argv, needle in (
        (["--disagg", "1:x"], "--disagg takes P:D"),
        (["--disagg", "1:1", "--host-cache", "256"], "--disagg has no host tier"),
    ):
        rc = main(["plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--trace", str(path),
                   "--ttft-p99", "1", "--no-progress", *argv])  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    rc = main(["plan", "--prompt-len", "100", "--output-len", "10", "--disagg", "auto"])
    err = capsys.readouterr().err
    assert rc == 2 and "--disagg belongs to the GPU plan" in err


def test_prefill_floor_is_under_every_ttft(tmp_path):
    """The static floor: a lower bound on every request's TTFT, whatever the replica count and
    the load, with its longest possible prefix hit (requests sharing hash ids)."""
    w = _trace(tmp_path, n=60, gap_ms=30)
    hits = max_prefix_hits(w, 16)
    assert hits is not None and hits.max() > 0 and (hits % 16 == 0).all()
    assert all(h <= r.prompt_len - 1 for h, r in zip(hits, w.requests))
    for f in _families():
        _, cfg, tm = f.engine
        lb = np.array([prefill_floor_s(tm, r.prompt_len, int(h), cfg.token_budget)
                       for r, h in zip(w.requests, hits)])  # fmt: skip
        for n in (1, 3):
            res = Cluster(w, cfg, tm, n, "prefix_aware").run()
            ft = np.full(len(w), np.nan)
            for r in res.results:
                m = np.isfinite(r.recorder.first_token)
                ft[m] = r.recorder.first_token[m]
            ttft = ft - np.array([r.arrival for r in w.requests])
            assert np.isfinite(ttft).all() and (ttft >= lb).all()
    # an idle replica, one prompt, no cache: the floor is close to the real prefill
    one = w.head(1)
    _, cfg, tm = _families()[0].engine
    res = Cluster(one, cfg, tm, 1, "round_robin").run()
    real = res.summary["ttft_p50_s"]
    lb0 = prefill_floor_s(tm, one.requests[0].prompt_len, 0, cfg.token_budget)
    assert 0.8 * real <= lb0 <= real * (1 + 1e-9)  # tight: certainly_late keeps a margin


def test_floor_proves_a_family_infeasible_without_replays(tmp_path):
    w = _trace(tmp_path, n=40)
    fams = _families()
    floors = Floors(w, 2048, 0.05)  # no prompt of 1k+ tokens prefills in 50 ms on an L40S
    assert all(floors.reason(f.engine) for f in fams)
    calls = []

    def replay(f, n, prefill=0):
        calls.append(n)
        return {}

    plan = search(fams, [1, 2], replay, 0.05, requests=len(w),
                  floor=lambda f: floors.reason(f.engine))  # fmt: skip
    assert plan.best is None and not calls
    assert all(not c.ran and "at any replica count" in c.reason for c in plan.replayed)
    k = certainly_late(w, fams[0].engine[2], 2048, 16, 0.05)
    assert k is not None and k.sum() >= late_needed(len(w))
    assert certainly_late(w, fams[0].engine[2], 2048, 16, 1e6) is not None
    assert not certainly_late(w, fams[0].engine[2], 2048, 16, 1e6).any()


def test_no_floor_for_the_builtin_workload():
    from kvblocks.sim import builtin_workload

    assert max_prefix_hits(builtin_workload().head(20), 16) is None


def test_gpu_plan_progress_bar_counts_candidates(tmp_path, capsys):
    """``plan --gpu ... --progress``: one bar per replay, headed with its place in the
    search ("plan 2/6: ...")."""
    from kvblocks.__main__ import main

    path = tmp_path / "t.jsonl"
    rows = [json.dumps({"timestamp": i * 50, "input_length": 3000, "output_length": 400,
                        "hash_ids": list(range(i * 10, i * 10 + 6))}) for i in range(40)]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    rc = main(["plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--trace", str(path),
               "--ttft-p99", "0.6", "--tp", "1,2", "--replicas", "1-3", "--progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0
    assert "plan 1/6: 1 x l40s (1 x TP1, KV bf16) [" in err and "requests" in err


def test_progress_throttle_sees_steps_taken_in_a_row():
    """An engine may report several steps at once (decode-only steps in a row): the throttle
    still looks at the clock each time the count passes a multiple of ``every``."""
    from kvblocks.sim.engine.progress import ProgressThrottle

    seen = []
    tick = ProgressThrottle(lambda done, now: seen.append(done), every=10, interval_s=-1.0)
    for steps in (3, 9, 14, 17, 35, 36, 40):
        tick.step(steps, steps, 0.0)
    assert seen == [14, 35, 40]
