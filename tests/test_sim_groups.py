"""Hybrid models in the simulator: preset bills from the published configs, the layer -> group
layout, per-group usage against the real BlockManager, the all-full baseline, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvblocks import BlockManager, KVGroup
from kvblocks.sim import SchedulerConfig, SimulationError, get_model, load_workload, memory_bill
from kvblocks.sim.engine.paged import PagedEngine
from kvblocks.sim.engine.timing import TimeModel
from kvblocks.sim.models.hybrid import LayerKind, group_layout, parse_layer_kinds
from kvblocks.sim.models.spec import GiB, custom_model
from kvblocks.sim.plan.lengths import make_plan, parse_dist

BS = 16

# Hand-computed from each model's config.json (kvblocks/sim/models/spec.py cites the fields):
# per-layer bytes per token = 2 (K, V) x kv heads x head dim x 2 (bf16); L = gcd of the layer
# counts per kind; block bytes = L x per-layer bytes x 16 tokens.
EXPECTED = {
    # name: (per-layer B/token, L, groups, block bytes, KV B/token, weights B)
    "gpt-oss-20b": (2 * 8 * 64 * 2, 12,
                    (KVGroup("full"), KVGroup("sliding_window", window=128)),
                    12 * 2048 * 16, 24 * 2048, int(12.8 * GiB)),
    "gpt-oss-120b": (2048, 18, (KVGroup("full"), KVGroup("sliding_window", window=128)),
                     18 * 2048 * 16, 36 * 2048, int(60.8 * GiB)),
    "gemma-3-27b": (2 * 16 * 128 * 2, 2,
                    (KVGroup("full"),) * 5 + (KVGroup("sliding_window", window=1024),) * 26,
                    2 * 8192 * 16, 62 * 8192, int(27.4e9 * 2)),
    "llama-4-scout": (2 * 8 * 128 * 2, 12,
                      (KVGroup("full"),) + (KVGroup("chunked_local", chunk=8192),) * 3,
                      12 * 4096 * 16, 48 * 4096, int(109e9 * 2)),
    # state: conv 3 x 8192 + recurrent 32 x 128 x 128 = 548,864 elements x 2 B per layer;
    # 12 layers = 13,172,736 B in 393,216 B blocks -> 33.5 -> 34 blocks
    "qwen3-next-80b-a3b": (2 * 2 * 256 * 2, 12,
                           (KVGroup("full"),) + (KVGroup("state", blocks=34),) * 3,
                           12 * 2048 * 16, 12 * 2048, int(80e9 * 2)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_bill_matches_the_published_config(name):
    per_layer, L, groups, block, per_token, weights = EXPECTED[name]
    m = get_model(name)
    assert m.kv_bytes_per_token_layer == per_layer and m.kv_bytes_per_token == per_token
    assert m.weight_bytes == weights
    lay = group_layout(m, BS)
    assert lay.layers_per_group == L and lay.kvgroups == groups and lay.block_bytes == block
    assert sum(s.copies for s in lay.shares) * L == m.num_layers  # no padding layers
    bill = memory_bill(m, 400, BS)
    assert bill.block_bytes == block
    assert bill.num_blocks == (bill.gpu_bytes - weights - bill.reserve_bytes) // block


def test_sequence_bill_by_hand():
    oss = memory_bill(get_model("gpt-oss-20b"), 80, BS)
    # 1000 tokens: full ceil(1000/16) = 63; window reads [872, 999] -> blocks 54..62 = 9
    assert oss.seq_blocks(1000) == 63 + 9
    assert oss.seq_bytes(1000) == 72 * 12 * 2048 * 16
    # 100,000 tokens: 6250 + blocks 6242..6249 (positions 99,872..99,999) = 8
    assert oss.seq_blocks(100_000) == 6250 + 8
    scout = memory_bill(get_model("llama-4-scout"), 400, BS)
    # 10,000 tokens: full 625; each chunk group reads [8192, 9999]: blocks 512..624 = 113
    assert scout.seq_blocks(10_000) == 625 + 3 * 113
    assert scout.seq_blocks(8192) == 512 + 3 * 512  # a whole chunk
    gemma = memory_bill(get_model("gemma-3-27b"), 80, BS)
    # 5000 tokens: 5 full groups x 313; 26 window groups x blocks 248..312 (65)
    assert gemma.seq_blocks(5000) == 5 * 313 + 26 * 65
    qwen = memory_bill(get_model("qwen3-next-80b-a3b"), 400, BS)
    assert qwen.seq_blocks(1) == 1 + 3 * 34 and qwen.seq_blocks(1000) == 63 + 102
    rows = {g["kind"]: g for g in qwen.group_bill()}
    assert rows["state"]["state_bytes_per_seq_exact"] == 36 * 548_864 * 2
    assert rows["state"]["bytes_per_seq"] == 102 * 393_216
    rows = {g["kind"]: g for g in gemma.group_bill()}
    assert rows["sliding_window"]["max_tokens_held"] == 65 * 16
    assert rows["sliding_window"]["bytes_per_token"] == 52 * 8192
    # a single-group model is billed as before
    llama = memory_bill(get_model("llama-3.1-8b"), 80, BS)
    assert llama.block_bytes == 2 * 32 * 8 * 128 * 2 * 16 and llama.seq_blocks(1000) == 63
    assert not llama.groups.hybrid and llama.as_dict()["kvblocks_groups"] == 1


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sequence_bill_is_what_the_block_manager_holds(name):
    """seq_blocks(n) is exactly what BlockManager(groups=layout) holds for a decoding sequence."""
    bill = memory_bill(get_model(name), 400, BS, num_blocks=20_000)
    mgr = BlockManager(bill.num_blocks + 1, BS, groups=bill.groups.kvgroups)
    for k, n in enumerate([1, 15, 16, 17, 130, 1000, 1031, 8200, 9000]):
        cached = mgr.add(k, np.arange(n) % 1000)  # repeats: prefix hits of freed ones
        mgr.schedule([k], [n - cached])
        mgr.append(k, [7])
        mgr.schedule([k], [1])
        assert mgr.blocks_in_use(k) == bill.seq_blocks(n + 1), (name, n)
        mgr.free(k)
    mgr.check()


def test_all_full_layout_and_baseline_bill():
    m = get_model("gpt-oss-20b")
    base = memory_bill(m, 80, BS, all_full=True)
    assert base.groups.kvgroups == (KVGroup("full"),) and base.groups.all_full
    assert base.block_bytes == 24 * 2048 * 16 and base.seq_blocks(1000) == 63
    hyb = memory_bill(m, 80, BS)
    assert hyb.seq_bytes(100_000) < 0.51 * base.seq_bytes(100_000)
    # state layers keep their state under --all-full: qwen3-next bills the same either way
    q = get_model("qwen3-next-80b-a3b")
    assert group_layout(q, BS, all_full=True).shares == group_layout(q, BS).shares


def _engine(name, all_full, num_blocks=None, preemption="recompute", limit=40):
    m = get_model(name)
    host = 40.0 if preemption == "swap" else 0.0
    bill = memory_bill(m, 400, BS, num_blocks=num_blocks, host_mem_gib=host, all_full=all_full)
    cfg = SchedulerConfig(num_blocks=bill.num_blocks, block_size=BS, layout=bill.groups,
                          block_bytes=bill.block_bytes, preemption=preemption,
                          host_blocks=bill.host_blocks)  # fmt: skip
    w = load_workload(None, limit=limit).scaled(0.0)  # all at once: memory pressure
    return bill, PagedEngine(w, cfg, TimeModel.for_model(m))


@pytest.mark.parametrize(
    "name,blocks,preemption",
    [("gpt-oss-20b", 1500, "recompute"), ("llama-4-scout", 1600, "swap"),
     ("qwen3-next-80b-a3b", 2500, "recompute"), ("gemma-3-27b", 12000, "swap")],
)  # fmt: skip
def test_group_usage_is_what_the_sequences_hold(name, blocks, preemption):
    """The per-kind usage the replay records equals the core's blocks_in_use, every step,
    under memory pressure (preemption, swap, forks of parallel samples)."""
    _, e = _engine(name, False, blocks, preemption, limit=60)
    held = e._group_held
    steps = []

    def checked():
        h = held()
        live = [s for s in e.running if not e.mgr.is_swapped(s.uid)]
        assert int(h.sum()) == sum(e.mgr.blocks_in_use(s.uid) for s in live), e.steps
        steps.append(int(h.sum()))
        return h

    e._group_held = checked  # type: ignore[method-assign]
    s = e.run().summary
    assert steps and s["completed"] + s["rejected"] == 60
    assert s["preemptions"] > 0 or name == "gpt-oss-20b"  # (its window frees room)
    if name == "qwen3-next-80b-a3b":  # forks copy the state; some found no room
        assert s["fork_requeued"] > 0
    groups = {g["kind"]: g for g in s["groups"]}
    assert set(groups) == {sh.group.kind for sh in e.shares}
    assert all(g["peak_blocks"] >= g["mean_blocks"] > 0 for g in groups.values())
    assert sum(g["peak_blocks"] for g in groups.values()) >= max(steps) > 0


def test_all_full_baseline_uses_more_memory_for_the_same_workload():
    peak = {}
    for full in (False, True):
        bill, e = _engine("gpt-oss-20b", full, limit=40)
        s = e.run().summary
        peak[full] = s["peak_kv_usage"] * bill.num_blocks * bill.block_bytes
        assert s["completed"] == 40 and s["preemptions"] == 0
        assert ("groups" in s) is (not full)  # the baseline is one full group
    assert peak[True] > 1.2 * peak[False]


def test_plan_gives_the_gain_over_all_full():
    m = get_model("gpt-oss-20b")
    bill, base = memory_bill(m, 80, BS), memory_bill(m, 80, BS, all_full=True)
    n = make_plan(bill, parse_dist("8000"), parse_dist("1000"), samples=10, all_full=base).numbers
    per_seq = 9000 // 16 + 9  # full 563 blocks (ceil 9000/16) + window 9 of the same size
    assert n["mean_blocks"] == 563 + 9 == per_seq + 1
    assert n["paged_concurrent"] == bill.num_blocks // 572
    assert n["all_full_paged_concurrent"] == base.num_blocks // 563
    assert n["hybrid_gain"] == pytest.approx(n["paged_concurrent"] / n["all_full_paged_concurrent"])
    assert 1.9 < n["hybrid_gain"] < 2.0
    assert [g["kind"] for g in n["groups"]] == ["full", "sliding_window"]


def test_cli_reports_per_group_usage_and_the_gain(run_main):
    rc, out, err = run_main("simulate", "--model", "gpt-oss-20b", "--limit", "20",
                            "--no-contiguous", "--compare-all-full", "--json")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    assert [g["kind"] for g in doc["memory"]["groups"]] == ["full", "sliding_window"]
    assert [g["kind"] for g in doc["paged"]["groups"]] == ["full", "sliding_window"]
    assert all(g["peak_blocks"] > 0 and "mean_gib" in g for g in doc["paged"]["groups"])
    assert doc["memory_all_full"]["all_full"] and doc["memory_all_full"]["kvblocks_groups"] == 1
    assert set(doc["hybrid_gain"]) == {"peak_concurrency", "mean_concurrency",
                                       "throughput_tok_s", "prefix_hit_rate"}  # fmt: skip
    assert doc["config"]["groups"][1]["span"] == 128
    rc, out, err = run_main("simulate", "--model", "llama-4-scout", "--gpu-mem", "320",
                            "--limit", "10", "--compare-all-full")  # fmt: skip
    assert rc == 0, err
    assert "blocks held per layer kind" in out and "chunked_local 8,192" in out
    assert "hybrid groups vs all layers full" in out
    rc, out, err = run_main("plan", "--model", "gemma-3-27b", "--prompt-len", "4000",
                            "--output-len", "500", "--samples", "100")  # fmt: skip
    assert rc == 0, err
    assert "26 x 2" in out and "hybrid / all layers full" in out
    rc, out, err = run_main("simulate", "--layers", "24", "--kv-heads", "8",
                            "--head-dim", "64", "--layer-groups", "12:full,12:sliding_window:128",
                            "--limit", "5", "--no-contiguous", "--json")  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["memory"]["block_bytes"] == 12 * 2048 * 16


def test_single_group_models_are_unchanged():
    bill = memory_bill(get_model("llama-3.1-8b"), 80, BS)
    cfg = SchedulerConfig(num_blocks=bill.num_blocks, layout=bill.groups)
    assert cfg.kv_groups is None  # the default BlockManager path, no per-group tracking
    assert TimeModel.for_model(get_model("llama-3.1-8b")).read_kinds == ()


def test_layer_groups_parse():
    assert parse_layer_kinds("10:full, 52:sliding_window:1024", 62) == (
        LayerKind("full", 10), LayerKind("sliding_window", 52, 1024))  # fmt: skip
    assert parse_layer_kinds("4:full,12:state:1000", 16)[1].state_elems == 1000
    m = custom_model(24, 8, 64, layer_kinds=parse_layer_kinds("12:full,12:chunked_local:64", 24))
    assert m.hybrid and "chunked_local 64" in m.name
    with pytest.raises(SimulationError, match="hold 20 layers, not 24"):
        custom_model(24, 8, 64, layer_kinds=(LayerKind("full", 20),))


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("12:full,10:sliding_window:128", "add up to 22 layers, not --layers 24"),
        ("12:full,12:sliding:128", "unknown kind 'sliding'"),
        ("12:full:5,12:sliding_window:128", "full takes no size"),
        ("12:full,12:sliding_window", "sliding_window needs a size"),
        ("12:full,6:sliding_window:128,6:sliding_window:128", "listed twice"),
        ("0:full,24:sliding_window:128", "COUNT >= 1"),
        ("12:full,12:sliding_window:0", "SIZE in [1, 2^31-1]"),
        ("12:full,12:sliding_window:x", "not a whole number"),
        ("24:state:100", "at least one attention kind"),
        ("12;full", "is not COUNT:KIND[:SIZE]"),
    ],
)
def test_bad_layer_groups_are_one_line_errors(run_main, spec, needle):
    rc, out, err = run_main("simulate", "--layers", "24", "--kv-heads", "8",
                            "--head-dim", "64", "--layer-groups", spec)  # fmt: skip
    assert rc == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: ") and needle in lines[0], err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (("simulate", "--model", "gpt-oss-21b"), "unknown model 'gpt-oss-21b'"),
        (("plan", "--model", "gemma-4", "--prompt-len", "9", "--output-len", "9"), "unknown model"),
        (("simulate", "--model", "gpt-oss-20b", "--layer-groups", "24:full"), "with --layers, not --model"),
        (("simulate", "--model", "gpt-oss-20b", "--all-full", "--compare-all-full"), "give one"),
        (("simulate", "--model", "gpt-oss-20b", "--compare-all-full", "--replicas", "2"),
         "single-engine"),
        (("simulate", "--model", "llama-4-scout"), "does not fit"),
        (("simulate", "--layers", "2000", "--kv-heads", "1", "--head-dim", "8", "--layer-groups",
          "1:full,1999:sliding_window:4"), "2000 kvblocks groups (at most 255)"),
    ],
)  # fmt: skip
def test_bad_input_is_one_cli_error_line(run_main, argv, needle):
    rc, out, err = run_main(*argv)
    assert rc == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: ") and needle in lines[0], err


def test_a_sequence_outgrowing_the_pool_is_rejected_not_swapped_forever():
    """Scout's three chunk groups hold up to 3 x 512 blocks per sequence, more than a pool of
    1,200: the only running sequence once swapped out and in again every step, forever."""
    _, e = _engine("llama-4-scout", False, 1200, "swap", limit=60)
    step = e.step

    def bounded() -> float:
        assert e.steps < 50_000, "livelock"
        return step()

    e.step = bounded  # type: ignore[method-assign]
    s = e.run().summary
    assert s["completed"] + s["rejected"] == 60 and s["rejected"] > 0


@pytest.mark.parametrize("extra", [[], ["--compare-all-full"]])
def test_json_report_of_a_hybrid_model(run_main, extra):
    """Regression: the hybrid model's report carried numpy integers, and ``--json`` raised
    "Object of type int64 is not JSON serializable" (with the contiguous baseline, and with
    the all-full comparison)."""
    rc, out, _ = run_main("simulate", "--model", "gpt-oss-20b", "--json", "--limit", "60", *extra)
    assert rc == 0
    doc = json.loads(out)
    assert doc["ttft_p99"] is None or doc["ttft_p99"] >= 0
