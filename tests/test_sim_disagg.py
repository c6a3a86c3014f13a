"""Prefill/decode disaggregation (``simulate --disagg P:D``): the transfer by hand, TTFT with
it, decode replicas against load, the report and bad input."""

from __future__ import annotations

import json

import pytest

from kvblocks.sim import SchedulerConfig, SimulationError, TimeModel, builtin_workload, get_model
from kvblocks.sim.cluster.disagg import parse_disagg, simulate_disagg, transfer_seconds
from kvblocks.sim.workload.traces import Request, Workload

TM = TimeModel.for_model(get_model("llama-3.1-8b"))
KV = 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, bf16: 131,072 B per token


def test_transfer_seconds_by_hand():
    # 1,000 tokens x 128 KiB over one 450 GB/s link: 131,072,000 B / 4.5e11 B/s
    assert transfer_seconds(1000, KV, 450.0) == pytest.approx(131_072_000 / 450e9)
    # TP 2: each GPU sends half over its own link; replicated KV heads send twice the bytes
    assert transfer_seconds(1000, KV, 450.0, gpus=2) == pytest.approx(131_072_000 / 2 / 450e9)
    assert transfer_seconds(1000, KV, 450.0, gpus=2, kv_copies=2) == pytest.approx(
        131_072_000 / 450e9
    )
    with pytest.raises(SimulationError, match="bandwidth"):
        transfer_seconds(1000, KV, 0.0)


def _one(prompt: int, output: int) -> Workload:
    return Workload("one", [Request(0, 0.0, prompt, output)], "lengths")


def test_ttft_includes_the_transfer():
    # 1,000 tokens x 131,072 B over 0.131072 GB/s: exactly 1 s more than over a free link
    cfg = SchedulerConfig(num_blocks=2000)
    slow = simulate_disagg(_one(1000, 5), cfg, TM, 1, 1, KV, 0.131072)
    fast = simulate_disagg(_one(1000, 5), cfg, TM, 1, 1, KV, 1e12)
    assert slow.transfer_s[0] == pytest.approx(1.0)
    assert slow.summary["ttft_p50_s"] - fast.summary["ttft_p50_s"] == pytest.approx(1.0)
    # TTFT = the prefill pool's first token + the transfer + the decode pool's admission step
    pre_first = slow.prefill.summary["ttft_p50_s"]
    assert slow.summary["ttft_p50_s"] > pre_first + 1.0
    # decoding is the same on both: TPOT does not see the link
    assert slow.summary["tpot_p50_s"] == pytest.approx(fast.summary["tpot_p50_s"])
    assert slow.summary["completed"] == 1 and slow.summary["transfer_bytes"] == 1000 * KV


def test_more_decode_replicas_help_tpot_under_load():
    w = builtin_workload().head(300).scaled(0.05)  # 300 requests in ~2 s: heavy decode load
    cfg = SchedulerConfig(num_blocks=4000, max_num_seqs=64)
    one = simulate_disagg(w, cfg, TM, 2, 1, KV, 450.0).summary
    four = simulate_disagg(w, cfg, TM, 2, 4, KV, 450.0).summary
    assert one["completed"] == four["completed"] == 300
    assert four["tpot_p99_s"] < one["tpot_p99_s"]
    assert four["latency_p99_s"] < one["latency_p99_s"]


@pytest.mark.parametrize(
    "bad, needle",
    [("0:1", "prefill replicas"), ("1:0", "decode replicas"), ("x", "P:D"), ("1:", "P:D"),
     ("1:2:3", "P:D"), ("-1:2", "P:D"), ("1.5:2", "P:D"), ("1:2000", "[1, 1024]")],
)  # fmt: skip
def test_parse_disagg_bad(bad, needle):
    with pytest.raises(SimulationError, match=None) as e:
        parse_disagg(bad)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_parse_disagg_good():
    assert parse_disagg("1:3") == (1, 3) and parse_disagg(" 2 : 5 ") == (2, 5)


def one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_cli_bad_disagg(run_main):
    rc, _, err = run_main("simulate", "--disagg", "0:1")
    one_line_error(rc, err, "--disagg", "prefill replicas")
    rc, _, err = run_main("simulate", "--disagg", "x")
    one_line_error(rc, err, "P:D")
    for extra in (["--replicas", "2"], ["--contiguous", "all"], ["--compare-all-full"]):
        rc, _, err = run_main("simulate", "--disagg", "1:1", *extra)
        one_line_error(rc, err, "--disagg", extra[0])


def test_cli_disagg_report_and_json(run_main):
    rc, out, _ = run_main("simulate", "--limit", "40", "--disagg", "1:2", "--no-progress")
    assert rc == 0
    for needle in ("disagg    1 prefill + 2 decode replicas", "prefill pool", "decode pool",
                   "KV transfer:", "gpus      3 x h100-sxm"):  # fmt: skip
        assert needle in out, needle
    rc, out, _ = run_main("simulate", "--limit", "40", "--disagg", "1:2", "--tp", "2", "--json",
                          "--no-progress")  # fmt: skip
    assert rc == 0
    doc = json.loads(out)
    assert doc["gpus"] == (1 + 2) * 2 and doc["tp"] == 2
    assert doc["disagg"]["prefill_replicas"] == 1 and doc["disagg"]["decode_replicas"] == 2
    assert len(doc["prefill_pool"]["replicas"]) == 1 and len(doc["decode_pool"]["replicas"]) == 2
    assert doc["paged"]["completed"] == 40 and doc["contiguous"] is None
    assert doc["ttft_p99"] >= doc["paged"]["transfer_p99_s"] > 0
