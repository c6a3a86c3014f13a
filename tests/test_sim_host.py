"""The simulator on the core's host tier: hits per tier, the drain order, write policies, the
PCIe time model, host-tier events in the prefix-aware router, the planner's host axis, and the
command line's refusals."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace
from pathlib import Path
from typing import List, Tuple

import pytest

from kvblocks import InvalidStateError
from kvblocks.sim import PagedEngine, SchedulerConfig, TimeModel, get_model
from kvblocks.sim.cluster.cluster import Cluster
from kvblocks.sim.tier import drain
from kvblocks.sim.tier.drain import StepCopies
from kvblocks.sim.tier.host import host_tier_available
from kvblocks.sim.workload.traces import Request, Workload

pytestmark = pytest.mark.skipif(not host_tier_available(), reason="no host tier in this build")

TM = TimeModel.for_model(get_model("llama-3.1-8b"))
BS = 16
BLOCK_BYTES = BS * 131072  # Llama-3.1-8B: 128 KiB of KV per token


def families(n_fam: int = 6, rounds: int = 4, prefix: int = 1024, n: int = 1, out: int = 8,
             tail: int = 80, gap: float = 0.5) -> Workload:  # fmt: skip
    """``n_fam`` conversations, each with a ``prefix``-token history, visited in turn
    ``rounds`` times, one request every ``gap`` seconds: a pool that holds two histories
    evicts each one long before it comes back."""
    reqs: List[Request] = []
    for i in range(n_fam * rounds):
        f = i % n_fam
        segs = ((1000 + f, prefix), (5000 + i, tail))
        reqs.append(Request(i, gap * i, prefix + tail, out, n=n, segments=segs))
    return Workload("families", reqs, "kvblocks")


def cfg(cache: int = 0, num_blocks: int = 160, **kw) -> SchedulerConfig:
    """A small engine with a host tier of ``cache`` blocks (0: none)."""
    return SchedulerConfig(num_blocks=num_blocks, block_size=BS, block_bytes=BLOCK_BYTES,
                           host_cache_blocks=cache, **kw)  # fmt: skip


def replay(c: SchedulerConfig, w: Workload = None, tm: TimeModel = TM) -> Tuple[PagedEngine, dict]:
    e = PagedEngine(w if w is not None else families(), c, tm)
    return e, e.run().summary


# ------------------------------------------------------------------------------ hits per tier


def test_the_host_tier_raises_the_hit_rate_of_an_evicting_workload():
    _, none = replay(cfg())
    e, host = replay(cfg(cache=512))
    assert none["evictions"] > 0 and none["prefix_hit_rate"] < 0.05  # histories evicted
    assert host["prefix_hit_rate"] > 0.5 > none["prefix_hit_rate"] + 0.4
    assert host["prefix_hit_rate_host"] > 0.5 and host["host_demotions"] > 0
    assert host["onload_blocks"] > 0 and host["offload_blocks"] > 0
    # prefill skipped: the first token comes sooner despite the PCIe copies
    assert host["ttft_p50_s"] < none["ttft_p50_s"]


def test_tier_counters_add_up():
    e, s = replay(cfg(cache=512))
    hs = e.mgr.host_stats
    stats = e.pool.stats
    assert s["host_hit_tokens"] == hs.hit_tokens > 0
    assert s["device_hit_tokens"] == stats.hit_tokens
    assert stats.hit_tokens + hs.hit_tokens == s["cached_tokens"]
    assert s["prefix_hit_rate_device"] + s["prefix_hit_rate_host"] == pytest.approx(
        s["prefix_hit_rate"]
    )
    assert s["token_hit_rate"] == pytest.approx(s["prefix_hit_rate"])
    assert s["onload_blocks"] == hs.onloads and s["offload_blocks"] == hs.offloads
    assert s["host_demotions"] == hs.demotions and s["host_stats"]["stored"] == hs.stored
    assert e.mgr.num_pending_offloads == 0 and e.mgr.num_pending_onloads == 0


def test_a_small_host_tier_evicts_and_still_helps():
    _, small = replay(cfg(cache=250))  # under four histories: some come back, some not
    _, big = replay(cfg(cache=512))
    assert small["host_evictions"] > 0 and big["host_evictions"] == 0
    assert 0 < small["prefix_hit_rate_host"] < big["prefix_hit_rate_host"]


# ------------------------------------------------------------------------------ drain order


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("write_through", [False, True])
def test_replays_under_pressure_keep_the_drain_order(preemption, write_through):
    """Forks (copy-on-write), preemption and demotions in the same steps: every list is
    drained in order (the core raises InvalidStateError otherwise) and the pools check."""
    w = families(n_fam=5, rounds=3, prefix=512, n=3, out=64, tail=88, gap=0.05)
    c = cfg(cache=256, num_blocks=80, preemption=preemption,
            host_blocks=64 if preemption == "swap" else 0, host_write_through=write_through,
            max_num_seqs=16)  # fmt: skip
    e, s = replay(c, w)
    assert s["completed"] == len(w) and s["rejected"] == 0
    assert s["cow_copies"] > 0 and s["preemptions"] > 0
    assert s["host_demotions"] > 0 and s["offload_blocks"] > 0 and s["host_evictions"] > 0
    if not (write_through and preemption == "swap"):
        assert s["prefix_hit_rate_host"] > 0.2
    # (write-through stores every new block, swapped blocks take host blocks first: the host
    # LRU cycles through the histories before any comes back)
    if preemption == "swap":
        assert s["preemptions_swap"] == s["preemptions"] and s["swapped_blocks"] > 0


def test_draining_out_of_order_is_what_the_core_refuses():
    """The test above can fail: the same replay with onloads taken before offloads raises."""

    class WrongOrder(StepCopies):
        def drain(self, mgr, host_tier, copies):
            mgr.take_onloads()
            super().drain(mgr, host_tier, copies)

    e = PagedEngine(families(), cfg(cache=512), TM)
    e.copies = WrongOrder(BLOCK_BYTES, TM.swap_bytes_per_s)
    with pytest.raises(InvalidStateError, match="offloads are pending"):
        e.run()


# ------------------------------------------------------------------------------ write policy, time


def test_write_through_copies_at_compute_and_hides_them_beside_the_forward_pass():
    e_wb, wb = replay(cfg(cache=512))
    e_wt, wt = replay(cfg(cache=512, host_write_through=True))
    assert wb["write_through_offload_blocks"] == 0
    assert wb["demotion_offload_blocks"] == wb["offload_blocks"] > 0
    assert wt["write_through_offload_blocks"] > 0
    assert wt["demotion_offload_blocks"] < wb["demotion_offload_blocks"]  # already on the host
    assert wt["prefix_hit_rate_host"] > 0.5
    assert e_wt.copies.serial_s < e_wb.copies.serial_s


def test_pcie_bandwidth_prices_the_copies():
    _, fast = replay(cfg(cache=512), tm=replace(TM, swap_bytes_per_s=50e9))
    _, slow = replay(cfg(cache=512), tm=replace(TM, swap_bytes_per_s=5e9))
    assert fast["onload_blocks"] == slow["onload_blocks"] > 0
    assert slow["transfer_s"] == pytest.approx(10 * fast["transfer_s"], rel=0.05)
    assert slow["ttft_p99_s"] > fast["ttft_p99_s"]


def test_step_copies_time_model():
    c = StepCopies(block_bytes=1 << 20, bytes_per_s=1e9)
    c.demotions, c.onloads, c.write_through = 2, 3, 0
    assert c.step_seconds(0.01, swapped_blocks=5) == pytest.approx(0.01 + 10 * (1 << 20) / 1e9)
    c.demotions = c.onloads = 0
    c.write_through = 5  # 5.2 ms of copies beside a 10 ms forward pass: hidden
    assert c.step_seconds(0.01, swapped_blocks=0) == pytest.approx(0.01)
    c.write_through = 20  # 21 ms: the step waits for the rest
    assert c.step_seconds(0.01, swapped_blocks=0) == pytest.approx(20 * (1 << 20) / 1e9)
    assert c.counters()["transfer_s"] == pytest.approx(c.serial_s + c.overlap_s)


def test_docstring_examples():
    assert doctest.testmod(drain).failed == 0


# ------------------------------------------------------------------------------ cluster


def test_each_replica_has_its_own_tier_and_the_router_indexes_host_events():
    w = families(n_fam=8, rounds=3)
    c = cfg(cache=512)
    cl = Cluster(w, c, TM, 2, "prefix_aware")
    res = cl.run()
    s = res.summary
    assert res.router["indexes_host_events"] is True and len(cl.router.index.host) > 0
    assert s["host_hit_tokens"] == sum(r["host_hit_tokens"] for r in res.replicas) > 0
    assert s["host_stats"]["demotions"] == sum(e.mgr.host_stats.demotions for e in cl.engines)
    assert s["prefix_hit_rate_device"] + s["prefix_hit_rate_host"] == pytest.approx(
        s["prefix_hit_rate"]
    )
    blind = Cluster(w, c, TM, 2, "prefix_aware", index_host_events=False)
    res2 = blind.run()
    assert res2.router["indexes_host_events"] is False and len(blind.router.index.host) == 0
    assert all(e.mgr.host_pool is not None for e in cl.engines)
    assert len({id(e.mgr) for e in cl.engines}) == 2


# ------------------------------------------------------------------------------ command line


def mooncake(tmp_path: Path, n_fam: int = 6, rounds: int = 4) -> str:
    """The ``families`` pattern as a Mooncake trace (hash ids are 512-token blocks): the
    first round spaced out, each later one a burst (a queue forms, and served histories
    shorten it)."""
    path = tmp_path / "fam.jsonl"
    rows = []
    for i in range(n_fam * rounds):
        f, r = i % n_fam, i // n_fam
        t = 500 * i if r == 0 else 2000 * (n_fam + r)
        rows.append({"timestamp": t, "input_length": 1100, "output_length": 8,
                     "hash_ids": [10 * f, 10 * f + 1, 1000 + i]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_simulate_host_cache_report_and_json(run_main, tmp_path):
    trace = mooncake(tmp_path)
    args = ("simulate", "--trace", trace, "--num-blocks", "160", "--no-progress")
    rc, out, _ = run_main(*args, "--host-cache", "1")
    assert rc == 0
    assert "host cache 1 GiB (512 blocks, write-back), PCIe 25 GB/s" in out
    for row in ("from the host tier", "demotions to the host", "onloads (host -> device)",
                "of which write-through", "PCIe time in steps"):  # fmt: skip
        assert row in out
    rc, out, _ = run_main(*args, "--host-cache", "1", "--host-write-through", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["config"]["host_write_through"] is True
    p = doc["paged"]
    assert p["prefix_hit_rate_host"] > 0.3 and p["write_through_offload_blocks"] > 0


@pytest.mark.parametrize(
    "extra, needle",
    [
        (("--host-cache=-1",), "--host-cache"),
        (("--host-cache", "1e9"), "--host-cache"),
        (("--host-cache", "nan"), "--host-cache"),
        (("--host-cache", "1e-9"), "holds no block"),
        (("--host-cache", "40000", "--block-size", "1"), "more than the simulator's"),
        (("--pcie-gbps", "0"), "--pcie-gbps"),
        (("--pcie-gbps=-3",), "--pcie-gbps"),
        (("--host-write-through",), "needs a host tier"),
        (("--host-cache", "1", "--no-prefix-caching"), "drop --no-prefix-caching"),
    ],
)
def test_bad_host_flags_are_one_line(run_main, extra, needle):
    rc, out, err = run_main("simulate", "--limit", "5", "--no-progress", *extra)
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("kvblocks: error: ") and needle in lines[0]


def test_plan_sweeps_host_sizes_and_prefers_the_cheaper_tier(run_main, tmp_path):
    trace = mooncake(tmp_path)
    args = ("plan", "--trace", trace, "--num-blocks", "160", "--replicas", "1",
            "--host-cache", "0,1", "--no-progress", "--router", "round_robin")  # fmt: skip
    rc, out, _ = run_main(*args, "--ttft-p99", "1000", "--json")
    assert rc == 0
    doc = json.loads(out)
    none, host = doc["curve"]
    assert (none["host_mem_gib"], host["host_mem_gib"]) == (0, 1)
    assert none["hit_rate_host"] is None and host["hit_rate_host"] > 0.3
    assert host["ttft_p99_s"] < none["ttft_p99_s"]
    assert doc["best"]["host_cache_gib"] == 0 and doc["host_write_through"] is False
    # a target only the host tier meets
    target = (host["ttft_p99_s"] + none["ttft_p99_s"]) / 2
    rc, out, _ = run_main(*args, "--ttft-p99", str(target))
    assert rc == 0 and "cheapest: 1 replica + 1 GiB host cache each" in out
    assert "one host tier per replica (write-back)" in out
    # none meets: the closest is named
    rc, out, err = run_main(*args, "--ttft-p99", str(host["ttft_p99_s"] / 2))
    assert rc == 2 and "closest: 1 replica + 1 GiB host cache each" in err
    rc, out, err = run_main(*args[:7], "--host-cache", "0", "--host-write-through",
                            "--ttft-p99", "1")  # fmt: skip
    assert rc == 2 and "needs a host tier" in err
