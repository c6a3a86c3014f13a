"""Cluster simulation and the trace planner: routers, the KV-event prefix index, aggregation,
determinism, the JSON report, command-line errors and the planner's choice and refusal."""

from __future__ import annotations

import doctest
import json
from pathlib import Path
from typing import List

import numpy as np
import pytest

import kvblocks
from kvblocks.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvblocks.sim import (
    PagedEngine,
    SchedulerConfig,
    SimulationError,
    TimeModel,
    get_model,
    load_workload,
    simulate_paged,
)
from kvblocks.sim.cluster import cluster, prefixindex, routers
from kvblocks.sim.cluster import report as cluster_report
from kvblocks.sim.cluster.cluster import CLUSTER_HASH_KEY, Cluster, simulate_cluster
from kvblocks.sim.cluster.prefixindex import HOST_CREDIT, PrefixIndex
from kvblocks.sim.cluster.routers import Load, make_router, prompt_hashes
from kvblocks.sim.plan import capacity
from kvblocks.sim.plan.capacity import PlanPoint, cheapest, parse_counts, parse_sizes, sweep
from kvblocks.sim.tier import host as hosttier
from kvblocks.sim.workload.traces import Request, Workload

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CONV = TRACES / "mooncake_conversation_trace.jsonl"
TM = TimeModel.for_model(get_model("llama-3.1-8b"))
BS = 16


def families(
    n_fam: int = 4, per_fam: int = 5, prefix: int = 1024, gap: float = 2.0, out: int = 8
) -> Workload:
    """``n_fam`` families of prompts: each shares a ``prefix``-token segment and adds its own
    tail. The first request of every family arrives at t = 0, then the others in turn, ``gap``
    seconds apart (long enough for each to finish)."""
    reqs: List[Request] = []
    order = [(f, k) for k in range(per_fam) for f in range(n_fam)]
    for i, (f, k) in enumerate(order):
        segs = ((1000 + f, prefix), (5000 + i, 64 + 16 * k))
        t = 0.0 if k == 0 else gap * (i - n_fam + 1)
        reqs.append(Request(i, t, prefix + 64 + 16 * k, out, segments=segs))
    return Workload("families", reqs, "kvblocks")


def burst(n: int, prompt: int = 256, out: int = 16) -> Workload:
    """``n`` unrelated requests, all arriving at t = 0."""
    reqs = [Request(i, 0.0, prompt, out, segments=((9000 + i, prompt),)) for i in range(n)]
    return Workload("burst", reqs, "kvblocks")


def cfg(num_blocks: int = 2000) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=num_blocks, block_size=BS, block_bytes=BS * 131072)


def owners_by_family(res: cluster.ClusterResult, cl: Cluster, n_fam: int) -> List[set]:
    return [set(cl.owner[i] for i in range(len(cl.owner)) if i % n_fam == f) for f in range(n_fam)]


# ------------------------------------------------------------------------------ prefix index


def test_prefix_index_follows_stored_and_removed_events():
    idx = PrefixIndex(3)
    idx.apply(0, [BlockStored([1, 2, 3], None, [0] * 48, 16)])
    idx.apply(2, [BlockStored([1, 2], None, [0] * 32, 16)])
    assert idx.overlap([1, 2, 3, 4]) == [3.0, 0.0, 2.0]
    assert idx.overlap([2, 3]) == [2.0, 0.0, 1.0]  # a lookup starts wherever the list starts
    idx.apply(0, [BlockRemoved([2])])
    assert idx.overlap([1, 2, 3]) == [1.0, 0.0, 2.0]  # chained: nothing after a miss counts
    assert len(idx) == 3 and idx.stored == 5 and idx.removed == 1
    idx.apply(2, [AllBlocksCleared()])
    assert idx.overlap([1, 2, 3]) == [1.0, 0.0, 0.0]
    # 128-bit hashes are keyed by their 64-bit wire value
    idx.apply(1, [BlockStored([(7 << 64) | 9], None, [0] * 16, 16)])
    assert idx.overlap([9]) == [0.0, 1.0, 0.0]


def test_prefix_index_credits_host_blocks_below_device_blocks():
    idx = PrefixIndex(2)
    idx.apply(0, [BlockStored([1, 2], None, [0] * 32, 16)])
    idx.apply(0, [BlockStored([3], 2, [0] * 16, 16, medium="CPU")])
    idx.apply(1, [BlockStored([1, 2, 3], None, [0] * 48, 16)])
    assert idx.overlap([1, 2, 3]) == [2.0 + HOST_CREDIT, 3.0]
    idx.apply(0, [BlockRemoved([3], medium="CPU")])
    assert idx.overlap([1, 2, 3]) == [2.0, 3.0]


def test_prefix_index_refuses_bad_input_and_changes_nothing():
    with pytest.raises(kvblocks.InvalidArgumentError):
        PrefixIndex(0)
    idx = PrefixIndex(2)
    idx.apply(0, [BlockStored([1], None, [0] * 16, 16)])
    with pytest.raises(kvblocks.InvalidArgumentError, match="out of range"):
        idx.apply(2, [BlockStored([5], None, [0] * 16, 16)])
    with pytest.raises(kvblocks.InvalidArgumentError, match="not a KV event"):
        idx.apply(1, ["BlockStored"])
    assert idx.overlap([1, 5]) == [1.0, 0.0] and len(idx) == 1


def test_router_hashes_match_what_the_engine_caches():
    """The index built from an engine's events predicts that engine's prefix hit exactly."""
    w = families(n_fam=2, per_fam=2)
    eng = PagedEngine(w, cfg(), TM, enable_kv_events=True, hash_key=CLUSTER_HASH_KEY)
    idx = PrefixIndex(1)
    first, second = w.requests[0], w.requests[2]  # family 0, twice
    eng.submit(first)
    while not eng.idle:
        eng.step()
        idx.apply(0, eng.pool.take_events())
    hashes = prompt_hashes(w.prompt_tokens(second), BS, CLUSTER_HASH_KEY)
    predicted = idx.overlap(hashes)[0]
    assert predicted == 1024 // BS  # the shared segment, whole blocks
    got = eng.mgr.add("probe", w.prompt_tokens(second))
    assert got == predicted * BS
    eng.mgr.free("probe")


# ------------------------------------------------------------------------------ routers


def test_round_robin_takes_replicas_in_turn():
    w = burst(10)
    cl = Cluster(w, cfg(), TM, 3, "round_robin")
    cl.run()
    assert cl.owner.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_balances_a_burst_and_avoids_a_busy_replica():
    cl = Cluster(burst(12), cfg(), TM, 4, "least_loaded")
    res = cl.run()
    assert [r["requests"] for r in res.replicas] == [3, 3, 3, 3]
    # one huge prompt first: the next ones go elsewhere until the others are as loaded
    reqs = [Request(0, 0.0, 8000, 4, segments=((1, 8000),))]
    reqs += [Request(i, 0.0, 500, 4, segments=((100 + i, 500),)) for i in range(1, 7)]
    cl = Cluster(Workload("skew", reqs, "kvblocks"), cfg(), TM, 2, "least_loaded")
    cl.run()
    assert cl.owner[0] == 0 and cl.owner[1:].tolist() == [1] * 6


def test_least_loaded_cost_is_queued_blocks_plus_blocks_in_use():
    r = make_router("least_loaded", 2, block_size=BS)
    assert r.costs([], 10, [Load(160, 5), Load(0, 9)]) == [15.0, 9.0]
    assert r.choose([], 10, [Load(160, 5), Load(0, 9)]) == 1
    assert r.choose([], 10, [Load(0, 3), Load(0, 3)]) == 0  # ties: the lowest index


def test_prefix_aware_sends_a_shared_prefix_to_the_replica_holding_it():
    w = families(n_fam=4, per_fam=5)
    cl = Cluster(w, cfg(), TM, 4, "prefix_aware")
    pa = cl.run()
    fams = owners_by_family(pa, cl, 4)
    assert all(len(f) == 1 for f in fams)  # every family stays where its prefix is
    assert len(set.union(*fams)) == 4  # and the families are spread over the replicas
    rr = simulate_cluster(w, cfg(), TM, 4, "round_robin")
    # round robin with 4 families on 3 replicas scatters them; prefix-aware hits every time
    rr3 = Cluster(w, cfg(), TM, 3, "round_robin")
    rr3_res = rr3.run()
    assert any(len(f) > 1 for f in owners_by_family(rr3_res, rr3, 4))
    pa3 = simulate_cluster(w, cfg(), TM, 3, "prefix_aware")
    assert pa3.summary["prefix_hit_rate"] > rr3_res.summary["prefix_hit_rate"]
    expect = 16 * 1024 / sum(r.prompt_len for r in w.requests)  # 4 first turns miss, 16 hit
    assert pa.summary["prefix_hit_rate"] == pytest.approx(expect, rel=0.02)
    assert rr.summary["prefix_hit_rate"] == pytest.approx(expect, rel=0.02)  # 4 on 4: lucky


def test_prefix_aware_weighs_the_prefix_against_load():
    r = make_router("prefix_aware", 2, block_size=BS)
    r.observe(0, [BlockStored(list(range(1, 65)), None, [0] * 64 * BS, BS)])
    hashes = list(range(1, 65))
    assert r.choose(hashes, 64 * BS, [Load(0, 0), Load(0, 0)]) == 0
    # replica 0 is far busier than the prefix is worth: the request goes to replica 1
    assert r.choose(hashes, 64 * BS, [Load(0, 1000), Load(0, 0)]) == 1
    w0 = make_router("prefix_aware", 2, block_size=BS, overlap_weight=0.0)
    w0.observe(0, [BlockStored(list(range(1, 65)), None, [0] * 64 * BS, BS)])
    c = w0.costs(hashes, 64 * BS, [Load(0, 0), Load(0, 100)])
    assert c == [0.0, 164.0]  # weight 0: only decode blocks, the cached ones not counted
    assert r.describe() == {"router": "prefix_aware", "overlap_weight": 1.0}


def test_make_router_refuses_unknown_names_and_bad_weights():
    with pytest.raises(SimulationError, match="--router must be one of"):
        make_router("random", 2, BS)
    with pytest.raises(SimulationError, match="--overlap-weight"):
        make_router("prefix_aware", 2, BS, overlap_weight=-1.0)
    with pytest.raises(SimulationError, match="prefix_aware only"):
        make_router("round_robin", 2, BS, overlap_weight=1.0)
    with pytest.raises(SimulationError, match="--replicas must be"):
        Cluster(burst(2), cfg(), TM, 0, "round_robin")


# ------------------------------------------------------------------------------ cluster results


def test_one_replica_cluster_is_the_single_engine():
    from kvblocks.sim import builtin_workload

    w = builtin_workload().head(120)
    single = simulate_paged(w, cfg(4000), TM).summary
    one = simulate_cluster(w, cfg(4000), TM, 1, "round_robin").summary
    for k in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "steps", "evictions",
              "throughput_tok_s", "makespan_s", "peak_kv_usage", "completed"):  # fmt: skip
        assert one[k] == pytest.approx(single[k]), k


def test_aggregate_adds_up_the_replicas():
    w = families(n_fam=3, per_fam=4)
    res = simulate_cluster(w, cfg(), TM, 3, "least_loaded")
    s, per = res.summary, res.replicas
    assert sum(p["requests"] for p in per) == s["requests"] == len(w)
    assert sum(p["cached_tokens"] for p in per) == s["cached_tokens"]
    assert sum(p["steps"] for p in per) == s["steps"]
    assert s["peak_kv_usage"] == max(p["peak_kv_usage"] for p in per)
    assert s["completed"] == len(w) and s["blocks_in_use_at_end"] == 0
    assert s["requests_per_replica_min"] + s["requests_per_replica_max"] >= 2


def test_replay_is_deterministic():
    w = families(n_fam=3, per_fam=3, gap=0.05)
    a = simulate_cluster(w, cfg(300), TM, 2, "prefix_aware")
    b = simulate_cluster(w, cfg(300), TM, 2, "prefix_aware")
    strip = ("wall_s", "allocator_s", "allocator_share", "check_s")
    assert {k: v for k, v in a.summary.items() if k not in strip} == {
        k: v for k, v in b.summary.items() if k not in strip
    }


def test_an_empty_workload_is_refused():
    with pytest.raises(SimulationError, match="no requests"):
        simulate_cluster(Workload("none", [], "kvblocks"), cfg(), TM, 2)


# ------------------------------------------------------------------------------ host tier hook


def test_host_tier_hook_is_feature_detected():
    c = SchedulerConfig(num_blocks=100, block_size=BS, host_cache_blocks=64)
    if hosttier.host_tier_available():
        kw = hosttier.host_manager_kwargs(c)
        assert kw == {"num_host_blocks": 65, "host_prefix_cache": True, "host_write_through": False}
    else:
        with pytest.raises(SimulationError, match="host tier not available in this build"):
            hosttier.host_manager_kwargs(c)
        with pytest.raises(SimulationError, match="host tier not available"):
            PagedEngine(burst(1), c, TM)
    assert hosttier.host_manager_kwargs(SchedulerConfig(num_blocks=100)) == {"num_host_blocks": 0}
    with pytest.raises(SimulationError, match="host_cache_blocks"):
        SchedulerConfig(num_blocks=100, host_cache_blocks=-1).validate()


def test_transfer_time_and_host_sizing():
    assert hosttier.transfer_seconds(1000, 1 << 20, 25.0) == pytest.approx(1000 * (1 << 20) / 25e9)
    assert hosttier.host_cache_blocks(2.0, 1 << 21) == 1024
    with pytest.raises(SimulationError, match="more than the simulator"):
        hosttier.host_cache_blocks(1e6, 1 << 10)


# ------------------------------------------------------------------------------ planner


def _pt(gpus: int, host: float, p99: float, meets: bool) -> PlanPoint:
    return PlanPoint(
        gpus, host / max(gpus, 1), gpus, host, 0.1, None, p99 / 2, p99, 100.0, 0, meets
    )


def test_cheapest_is_fewest_gpus_then_least_host_memory():
    pts = [_pt(1, 0, 9.0, False), _pt(2, 64, 1.0, True), _pt(2, 0, 1.5, True), _pt(4, 0, 0.5, True)]
    assert cheapest(pts, 2.0) is pts[2]
    assert cheapest(pts, 1.2) is pts[1]  # the target, not the stored flag, decides
    with pytest.raises(SimulationError, match=r"closest: 4 replicas with TTFT p99 0\.500 s"):
        cheapest(pts, 0.1)


def test_planner_picks_the_fewest_replicas_that_meet_the_target():
    w = burst(24, prompt=2000, out=8)  # all at once: more replicas, shorter queues
    pts = sweep(w, cfg(), TM, 1.0, [1, 2, 3, 4], [0.0], "least_loaded")
    p99 = [p.ttft_p99_s for p in pts]
    assert p99 == sorted(p99, reverse=True) and p99[0] > p99[-1]
    target = (p99[1] + p99[2]) / 2  # between 2 and 3 replicas
    best = cheapest(sweep(w, cfg(), TM, target, [1, 2, 3, 4], [0.0], "least_loaded"), target)
    assert best.replicas == 3 and best.meets
    with pytest.raises(SimulationError, match="closest: 4 replicas"):
        cheapest(pts, p99[-1] / 2)


def test_planner_validates_its_range_before_simulating():
    w = burst(2)
    with pytest.raises(SimulationError, match="--ttft-p99"):
        sweep(w, cfg(), TM, 0.0, [1], [0.0])
    with pytest.raises(SimulationError, match="at least one"):
        sweep(w, cfg(), TM, 1.0, [], [0.0])
    with pytest.raises(SimulationError, match="more than 256"):
        sweep(w, cfg(), TM, 1.0, list(range(1, 301)), [0.0])
    if not hosttier.host_tier_available():
        with pytest.raises(SimulationError, match="host tier not available"):
            sweep(w, cfg(), TM, 1.0, [1], [0.0, 8.0])


def test_parse_counts_and_sizes():
    assert parse_counts("4,1-2, 2", "--replicas") == [1, 2, 4]
    assert parse_sizes("64, 0", "--host-cache") == [0.0, 64.0]
    for bad, needle in (("0-2", "not in "), ("3-1", "LO > HI"), ("x", "not N or LO-HI"),
                        ("2000", "not in ")):  # fmt: skip
        with pytest.raises(SimulationError, match=needle):
            parse_counts(bad, "--replicas")
    for bad in ("-1", "nan", "x", "1e400"):
        with pytest.raises(SimulationError, match="--host-cache"):
            parse_sizes(bad, "--host-cache")


# ------------------------------------------------------------------------------ command line


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_simulate_cluster_json_schema(run_main):
    rc, out, _ = run_main("simulate", "--limit", "60", "--replicas", "3", "--router",
                          "prefix_aware", "--json", "--no-progress")  # fmt: skip
    assert rc == 0
    doc = json.loads(out)
    assert doc["cluster"]["replicas"] == 3 and doc["cluster"]["router"] == "prefix_aware"
    assert doc["cluster"]["overlap_weight"] == 1.0 and doc["cluster"]["pcie_gbps"] == 25.0
    assert doc["contiguous"] is None and len(doc["replicas"]) == 3
    for key in ("prefix_hit_rate", "ttft_p99_s", "throughput_tok_s", "requests", "evictions"):
        assert key in doc["paged"] and all(key in r for r in doc["replicas"])
    assert 0.0 < doc["paged"]["prefix_hit_rate"] < 1.0
    assert sum(r["requests"] for r in doc["replicas"]) == doc["paged"]["requests"] == 60
    assert doc["time_model"]["swap_gb_per_s"] == 25.0


def test_simulate_cluster_table(run_main):
    rc, out, _ = run_main("simulate", "--limit", "40", "--replicas", "2", "--no-progress")
    assert rc == 0
    assert "cluster   2 replicas, router round_robin" in out
    assert "per replica" in out and "prefix hit rate (tokens)" in out
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("per replica")) + 1
    assert lines[i].split()[:2] == ["replica", "requests"]
    assert lines[i + 1].split()[:2] == ["0", "20"] and lines[i + 2].split()[:2] == ["1", "20"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (("simulate", "--replicas", "0"), ("--replicas", "[1, 1024]")),
        (("simulate", "--replicas", "2.5"), ("--replicas",)),
        (("simulate", "--router", "random"), ("--router", "invalid choice")),
        (("simulate", "--host-cache=-1"), ("--host-cache",)),
        (("simulate", "--host-cache", "1e9"), ("--host-cache",)),
        (("simulate", "--pcie-gbps", "0"), ("--pcie-gbps",)),
        (("simulate", "--overlap-weight", "2", "--replicas", "2"), ("prefix_aware only",)),
        (("plan", "--ttft-p99", "1"), ("--trace FILE and --ttft-p99",)),
        (("plan", "--trace", str(CONV)), ("--trace FILE and --ttft-p99",)),
        (("plan", "--trace", "nope.jsonl", "--ttft-p99", "1"), ("nope.jsonl",)),
        (("plan", "--trace", str(CONV), "--ttft-p99", "0"), ("--ttft-p99",)),
        (("plan", "--trace", str(CONV), "--ttft-p99", "1", "--replicas", "0-4"), ("--replicas",)),
        (("plan", "--trace", str(CONV), "--ttft-p99", "1", "--router", "x"), ("--router",)),
        (("plan", "--trace", str(CONV), "--ttft-p99", "1", "--host-cache", "a"), ("--host-cache",)),
        (("plan", "--trace", str(CONV), "--ttft-p99", "1", "--prompt-len", "9"), ("different",)),
    ],
)
def test_cli_errors_are_one_line(run_main, argv, needles):
    rc, out, err = run_main(*argv)
    one_line_error(rc, err, *needles)
    assert out == ""


@pytest.mark.skipif(hosttier.host_tier_available(), reason="this build has the host tier")
def test_host_cache_without_core_support_is_one_line(run_main):
    rc, out, err = run_main("simulate", "--host-cache", "4")
    one_line_error(rc, err, "host tier not available in this build")
    rc, out, err = run_main("plan", "--trace", str(CONV), "--ttft-p99", "1",
                            "--host-cache", "0,8")  # fmt: skip
    one_line_error(rc, err, "host tier not available in this build")


def test_plan_trace_prints_curve_and_cheapest_json(run_main, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 0,
                    "input_length": 1500,
                    "output_length": 4,
                    "hash_ids": [i, 100 + i, 200 + i],
                }
            )
            + "\n"
            for i in range(16)
        )  # fmt: skip
    )
    args = ("plan", "--trace", str(trace), "--replicas", "1-3", "--num-blocks", "2000",
            "--router", "least_loaded", "--no-progress", "--host-cache", "0")  # fmt: skip
    rc, out, _ = run_main(*args, "--ttft-p99", "1000", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert [p["gpus"] for p in doc["curve"]] == [1, 2, 3]
    assert doc["best"]["gpus"] == 1 and doc["best"]["meets"]
    p99 = [p["ttft_p99_s"] for p in doc["curve"]]
    assert p99[0] > p99[2]
    rc, out, _ = run_main(*args, "--ttft-p99", str((p99[0] + p99[1]) / 2))
    assert rc == 0 and "cheapest: 2 replicas" in out and "<- cheapest" in out
    rc, out, err = run_main(*args, "--ttft-p99", str(p99[2] / 2))
    one_line_error(rc, err, "no configuration in range meets", "closest: 3 replicas")


def test_plan_progress_bar_and_plot(run_main, tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 10 * i,
                    "input_length": 600,
                    "output_length": 2,
                    "hash_ids": [0, i + 1],
                }
            )
            + "\n"
            for i in range(8)
        )  # fmt: skip
    )
    png = tmp_path / "plan.png"
    rc, out, err = run_main("plan", "--trace", str(trace), "--replicas", "1,2",
                            "--num-blocks", "500", "--ttft-p99", "100", "--progress",
                            "--plot", str(png))  # fmt: skip
    assert rc == 0 and png.stat().st_size > 1000
    assert "plan 4/4: 2 GPU +256G" in err and "plot written to" in out  # host axis 0,256


# ------------------------------------------------------------------------------ docs, trace slice


@pytest.mark.parametrize(
    "module", [prefixindex, routers, cluster, hosttier, capacity], ids=lambda m: m.__name__
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_cluster_report_module_formats_hosts_rows():
    assert cluster_report.TIER_ROWS[1][1] == "prefix_hit_rate_host"


@pytest.mark.skipif(not CONV.exists(), reason="needs ../shared/traces")
def test_conversation_slice_prefix_aware_beats_round_robin():
    """A slice of the real trace, 4 replicas: routing by KV events finds more prefix hits and
    a lower TTFT p99 than round robin."""
    w = load_workload(str(CONV), "auto", 600)
    c = SchedulerConfig(num_blocks=29205, block_size=BS, block_bytes=BS * 131072)  # 80 GiB
    rr = simulate_cluster(w, c, TM, 4, "round_robin").summary
    pa = simulate_cluster(w, c, TM, 4, "prefix_aware").summary
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert pa["ttft_p99_s"] < rr["ttft_p99_s"]
    assert np.isfinite(pa["throughput_tok_s"]) and pa["completed"] == rr["completed"] == 600
