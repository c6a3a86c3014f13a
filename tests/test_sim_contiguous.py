"""The contiguous baselines (max-length, power-of-two buckets, oracle), their first-fit
allocator and the split of their waste, against small cases computed by hand.

Every case runs on ``TimeModel()`` (1 ms a step whatever it holds) and a pool of
``num_blocks x 1`` slots, so a time-weighted share is a step-weighted one."""

from __future__ import annotations

import json
from typing import List, Tuple

import pytest

from kvblocks.sim import SchedulerConfig, SimulationError, TimeModel
from kvblocks.sim.engine.contiguous import POLICIES, FirstFit, simulate_contiguous
from kvblocks.sim.workload.traces import Request, Workload

TM = TimeModel()


def _wl(*lens: Tuple[int, int]) -> Workload:
    reqs: List[Request] = [Request(i, 0.0, p, o) for i, (p, o) in enumerate(lens)]
    return Workload("hand", reqs, "lengths")


def _run(policy: str, capacity: int, max_len: int, *lens: Tuple[int, int]):
    cfg = SchedulerConfig(num_blocks=capacity, block_size=1, token_budget=1000)
    return simulate_contiguous(_wl(*lens), cfg, TM, max_len, policy=policy).summary


def test_first_fit_allocator():
    m = FirstFit(10)
    assert [m.alloc(3), m.alloc(4), m.alloc(3)] == [0, 3, 7] and m.free == 0
    assert m.alloc(1) is None
    m.release(0, 3)
    m.release(7, 3)
    assert m.holes == [[0, 3], [7, 3]] and m.free == 6
    assert m.alloc(5) is None  # 6 free, no hole of 5: external fragmentation
    m.release(3, 4)  # merges both neighbours
    assert m.holes == [[0, 10]] and m.alloc(10) == 0


def test_max_length_single_request_waste_split():
    # prompt 2, output 3: final length 4 of a 10-slot reservation. Step 1 (prefill): holds 2,
    # will write 2 more (reserved), 6 never (internal). Steps 2-3 (fast-forwarded, 2 ms): holds
    # 3.5 on average, 0.5 reserved, 6 internal. Allocated 10 + 20 slot-ms.
    s = _run("max", 10, 10, (2, 3))
    assert s["policy"] == "max" and s["completed"] == 1
    assert s["waste_reserved"] == pytest.approx(3 / 30)
    assert s["waste_internal"] == pytest.approx(18 / 30)
    assert s["internal_fragmentation"] == pytest.approx(21 / 30)  # the two together
    assert s["waste_external"] == 0.0 and s["regrow_copies"] == 0


def test_oracle_reserves_final_length():
    # 4 slots: step 1 holds 2 (2 reserved), steps 2-3 hold 3.5 (0.5 reserved); 4 + 8 slot-ms
    s = _run("oracle", 10, 10, (2, 3))
    assert s["waste_reserved"] == pytest.approx(3 / 12) and s["waste_internal"] == 0.0
    assert s["peak_kv_usage"] == pytest.approx(0.4)


def test_pow2_regrows_and_copies():
    # prompt 3, output 3, final 5. Step 1: reserve 4 (pow2 of 3), hold 3: 1 reserved. Step 2:
    # token 4 fits (k = 1, the fast-forward stops at the bucket's end). Step 3: token 5 does not:
    # re-reserve 8 (copy 4 tokens), hold 5: 3 internal. Allocated 4 + 4 + 8 slot-ms.
    s = _run("pow2", 10, 10, (3, 3))
    assert s["completed"] == 1 and s["steps"] == 3
    assert s["regrow_copies"] == 1 and s["regrow_copied_tokens"] == 4
    assert s["waste_reserved"] == pytest.approx(1 / 16)
    assert s["waste_internal"] == pytest.approx(3 / 16)
    assert s["peak_kv_usage"] == pytest.approx(0.8)
    # capped at max_len: the bucket of 5 is 8, but max_len 6 reserves 6
    assert _run("pow2", 10, 6, (3, 3))["waste_internal"] == pytest.approx(1 / 14)


def test_pow2_preempts_the_youngest_when_no_hole_fits():
    # two prompts of 4 fill the 8 slots; A's 5th token needs 8: B is preempted (recompute)
    s = _run("pow2", 8, 8, (4, 3), (4, 3))
    assert s["completed"] == 2 and s["preemptions"] == 1 and s["rejected"] == 0
    assert s["regrow_copies"] == 2


def test_oracle_external_fragmentation():
    # A (3), B (4), C (3) fill 10 slots; A and C finish after their prefill, leaving holes of
    # 3 and 3 around B: D (5) waits 2 ms with 6 slots free but no hole of 5 (external), then
    # runs once B is gone. Busy 4 ms; external 6 slots x 2 ms of 10 slots x 4 ms.
    s = _run("oracle", 10, 10, (3, 1), (2, 3), (3, 1), (5, 1))
    assert s["completed"] == 4
    assert s["waste_external"] == pytest.approx(12 / 40)
    # reserved: step 1 B holds 2 of 4, steps 2-3 B holds 3.5 of 4; allocated 10 + 8 + 5
    assert s["waste_reserved"] == pytest.approx(3 / 23) and s["waste_internal"] == 0.0
    # under max-length every region is one size: never external
    assert _run("max", 10, 5, (3, 1), (2, 3), (3, 1), (5, 1))["waste_external"] == 0.0


def test_rejects_what_can_never_fit():
    s = _run("oracle", 10, 20, (12, 1), (3, 2))  # 12 > the pool of 10
    assert s["rejected"] == 1 and s["completed"] == 1
    s = _run("pow2", 10, 8, (9, 1), (3, 2))  # longer than max_len
    assert s["rejected"] == 1 and s["completed"] == 1


def test_unknown_policy():
    cfg = SchedulerConfig(num_blocks=10, block_size=1)
    with pytest.raises(SimulationError, match="unknown contiguous policy 'buddy'"):
        simulate_contiguous(_wl((2, 2)), cfg, TM, 10, policy="buddy")


def test_policies_order_on_the_builtin_workload(run_main):
    rc, out, _ = run_main("simulate", "--limit", "120", "--contiguous", "all", "--json",
                          "--no-progress")  # fmt: skip
    assert rc == 0
    doc = json.loads(out)
    pol = doc["contiguous_policies"]
    assert list(pol) == list(POLICIES) and doc["contiguous"] == pol["max"]
    # less reserved ahead, less waste: max > pow2 > oracle; the oracle has no internal waste
    frag = [pol[p]["internal_fragmentation"] for p in POLICIES]
    assert frag[0] > frag[1] > frag[2] and pol["oracle"]["waste_internal"] == 0.0
    for p in POLICIES:
        s = pol[p]
        assert s["waste_reserved"] + s["waste_internal"] == pytest.approx(
            s["internal_fragmentation"]
        )
        assert 0.0 <= s["waste_external"] < 1.0


def test_cli_default_unchanged_and_columns(run_main):
    rc, default, _ = run_main("simulate", "--limit", "60", "--no-progress")
    assert rc == 0 and "contiguous (pow2)" not in default and "waste:" not in default
    rc, out, _ = run_main("simulate", "--limit", "60", "--no-progress", "--contiguous", "max")
    assert rc == 0 and "max waste:" in out and "contiguous (max-length)" in out
    rc, out, _ = run_main("simulate", "--limit", "60", "--no-progress", "--contiguous", "pow2")
    assert rc == 0 and "contiguous (pow2)" in out and "contiguous (max-length)" not in out
    assert "regrowth copies" in out and "pow2 waste:" in out
    rc, out, _ = run_main("simulate", "--limit", "60", "--json", "--no-progress")
    assert rc == 0 and "contiguous_policies" not in json.loads(out)


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_bad_contiguous(run_main):
    rc, _, err = run_main("simulate", "--contiguous", "buddy")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = run_main("simulate", "--contiguous", "pow2", "--no-contiguous")
    one_line_error(rc, err, "--contiguous", "--no-contiguous")
    rc, _, err = run_main("simulate", "--contiguous", "all", "--replicas", "2")
    one_line_error(rc, err, "single-engine")


# The figures of the three baselines on a small contended input, as the replay gave them before
# it was made cheaper (commit db10956): any change to the contiguous replay must keep them, bit
# for bit.
PINNED = {
    "max": {
        "steps": 22157,
        "makespan_s": 189.46181795542873,
        "ttft_p50_s": 88.91969096919024,
        "ttft_p99_s": 181.41876033140213,
        "tpot_p99_s": 0.01075832846923522,
        "latency_p99_s": 184.24987081235494,
        "mean_kv_usage": 0.7825437121085095,
        "internal_fragmentation": 0.7521676498145762,
        "waste_reserved": 0.011915675991690414,
        "waste_internal": 0.7402519738228854,
        "waste_external": 0.0,
        "throughput_tok_s": 347.63732719747594,
        "preemptions": 0,
        "regrow_copies": 0,
        "rejected": 31,
        "goodput": 0.023333333333333334,
    },
    "pow2": {
        "steps": 8929,
        "makespan_s": 109.17014343164996,
        "ttft_p50_s": 53.60040980312186,
        "ttft_p99_s": 100.40504986848705,
        "tpot_p99_s": 0.029147271703553187,
        "latency_p99_s": 104.45759645003899,
        "mean_kv_usage": 0.8283869023950114,
        "internal_fragmentation": 0.25657251294651184,
        "waste_reserved": 0.03414373424723371,
        "waste_internal": 0.22242877869927846,
        "waste_external": 0.05727828327991136,
        "throughput_tok_s": 869.248651847867,
        "preemptions": 108,
        "regrow_copies": 101,
        "rejected": 0,
        "goodput": 0.05333333333333334,
    },
    "oracle": {
        "steps": 7454,
        "makespan_s": 92.10810952550261,
        "ttft_p50_s": 42.86405975049274,
        "ttft_p99_s": 83.85668111597396,
        "tpot_p99_s": 0.02078810539650354,
        "latency_p99_s": 86.2438609538164,
        "mean_kv_usage": 0.7543042191950359,
        "internal_fragmentation": 0.04816667842984552,
        "waste_reserved": 0.04816667842984552,
        "waste_internal": 0.0,
        "waste_external": 0.12300538492046921,
        "throughput_tok_s": 1030.2675897796544,
        "preemptions": 0,
        "regrow_copies": 0,
        "rejected": 0,
        "goodput": 0.05333333333333334,
    },
}


@pytest.mark.parametrize("policy", POLICIES)
def test_contiguous_figures_are_pinned(policy):
    from kvblocks.sim import builtin_workload, get_model
    from kvblocks.sim.models.gpus import GPUS

    w = builtin_workload().head(300).scaled(0.2)
    tm = TimeModel.for_model(get_model("llama-3.1-8b"), gpu=GPUS["h100-sxm"])
    cfg = SchedulerConfig(num_blocks=4000, block_size=16, token_budget=2048, max_num_seqs=64)
    s = simulate_contiguous(w, cfg, tm, int(w.stats()["max_total"]), policy=policy).summary
    assert {k: s[k] for k in PINNED[policy]} == PINNED[policy]
