"""The v2 time model (roofline), the GPU catalog, TP/PP, dtypes, calibration and the GPU plan.

Hand-computed numbers use the datasheet figures and the documented default efficiencies; no
test asserts a wall-clock time."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvblocks.__main__ import main
from kvblocks.sim import get_model, memory_bill
from kvblocks.sim.engine.calibrate import fit, read_profile
from kvblocks.sim.engine.roofline import parallel_layout
from kvblocks.sim.engine.timing import Efficiency, TimeModel
from kvblocks.sim.errors import SimulationError, WorkloadError
from kvblocks.sim.models.gpus import GPUS, get_gpu, parse_gpus
from kvblocks.sim.plan.gpuplan import Family, search

L8 = get_model("llama-3.1-8b")
L70 = get_model("llama-3.1-70b")
H100 = get_gpu("h100-sxm")
BW = 3.35e12 * 0.8  # default bandwidth efficiency
PEAK = 989e12 * 0.6  # default compute efficiency
APEAK = 989e12 * 0.5  # default attention efficiency


def run_main(capsys, *argv: str):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------- the roofline


def test_decode_step_is_the_weight_read_plus_the_kv_read():
    """Batch 1, 1000 cached tokens: memory-bound GEMMs (the token rides on the weight read),
    the KV read of the context and the write of the new token, 1 ms host."""
    tm = TimeModel.for_model(L8)
    weights = int(8.03e9 * 2)
    kv_tok = 2 * 32 * 8 * 128 * 2
    expect = 1e-3 + weights / BW + (1000 + 1) * kv_tok / BW
    assert tm.step(0, 1, 1000) == pytest.approx(expect, rel=1e-9)
    # the audit's double count is gone: 64 more decode tokens cost only their KV, not FLOPs
    d = tm.step(0, 65, 1000) - tm.step(0, 1, 1000)
    assert d == pytest.approx(64 * kv_tok / BW, rel=1e-9)
    assert d < 64 * 2 * 8.03e9 / (989e12 * 0.5) / 10


def test_prefill_step_is_a_roofline_with_quadratic_attention():
    tm = TimeModel.for_model(L8)
    n = 4096
    gemm = max(int(8.03e9 * 2) / BW, n * 2 * 8.03e9 / PEAK)
    assert gemm == n * 2 * 8.03e9 / PEAK  # compute-bound at 4096 tokens
    pairs, reads = tm.prefill_attention([(0, n)])
    assert pairs == n * (n + 1) / 2 and reads == n
    flops = pairs * 2 * (128 + 128) * 32 * 32
    kv_bytes = (reads + n) * 2 * 32 * 8 * 128 * 2
    attn = max(kv_bytes / BW, flops / APEAK)
    assert tm.step(n, 0, 0, 0, pairs, reads) == pytest.approx(1e-3 + gemm + attn, rel=1e-9)
    # a second chunk of the same prompt attends to the first: more pairs than the first
    p2, r2 = tm.prefill_attention([(n, n)])
    assert p2 == n * n + n * (n + 1) / 2 and r2 == 2 * n
    # small chunk: memory-bound, max not sum
    assert tm.step(64, 0, 0) == pytest.approx(1e-3 + int(8.03e9 * 2) / BW + 64 * 131072 / BW)


def test_window_layers_attend_to_at_most_their_window():
    tm = TimeModel.for_model(get_model("gpt-oss-20b"))  # 12 full + 12 window-128 layers
    pairs, reads = tm.prefill_attention([(0, 1000)])
    full = 1000 * 1001 / 2
    window = 128 * 129 / 2 + (1000 - 128) * 128
    assert pairs == pytest.approx(0.5 * full + 0.5 * window)
    assert reads == pytest.approx(0.5 * 1000 + 0.5 * 1000)


def test_step_time_grows_with_work():
    tm = TimeModel.for_model(L8)
    times = [
        tm.step(p, d, k)
        for p, d, k in [(0, 1, 0), (0, 8, 8000), (0, 64, 64000), (512, 64, 64000), (8192, 0, 0)]
    ]
    assert times == sorted(times)


def test_moe_reads_only_the_experts_its_tokens_route_to():
    m = get_model("deepseek-v2-lite")  # 64 routed experts, 6 per token
    tm = TimeModel.for_model(m)
    total = m.weight_bytes
    assert tm.dense_bytes + tm.expert_bytes == pytest.approx(total)
    one = tm.step(0, 1, 0) - tm.step(0, 0, 0)  # the first token's experts
    assert one == pytest.approx(tm.expert_bytes * 6 / 64 / tm.mem_bytes_per_s, rel=0.01)
    # many tokens touch every expert: the read saturates at all the weights
    w = lambda t: tm.dense_bytes + tm.expert_bytes * (1 - tm.expert_skip**t)  # noqa: E731
    assert w(1) < w(8) < w(64) < w(1024) <= total
    assert w(1024) == pytest.approx(total, rel=1e-6)
    # a dense model reads everything from the first token
    assert TimeModel.for_model(L8).expert_bytes == 0


def test_tensor_parallel_halves_weight_and_kv_bytes_per_gpu():
    t1 = TimeModel.for_model(L70, gpu=H100, tp=1)
    t2 = TimeModel.for_model(L70, gpu=H100, tp=2)
    t8 = TimeModel.for_model(L70, gpu=H100, tp=8)
    assert t2.dense_bytes == pytest.approx(t1.dense_bytes / 2)
    assert t2.kv_bytes_per_token == pytest.approx(t1.kv_bytes_per_token / 2)
    assert t8.flops_per_token == pytest.approx(t1.flops_per_token / 8)
    # every layer ends in two all-reduces: 160 latencies, ring bytes over the link
    assert t8.comm_s_per_step == pytest.approx(160 * 8e-6)
    assert t8.comm_s_per_token == pytest.approx(160 * 2 * 7 / 8 * 8192 * 2 / (450e9 * 0.7))
    assert t1.comm_s_per_step == 0
    assert t8.step(0, 32, 32000) < t2.step(0, 32, 32000) < t1.step(0, 32, 32000)


def test_pipeline_parallel_splits_memory_not_the_step():
    t1 = TimeModel.for_model(L70, pp=1)
    t2 = TimeModel.for_model(L70, pp=2)
    assert t2.dense_bytes == t1.dense_bytes  # the stages read their halves one after the other
    assert t2.step(0, 8, 8000) > t1.step(0, 8, 8000)  # plus one activation send
    assert t2.as_dict()["pipeline_bubble"] == 0.5
    b1 = memory_bill(L70, 80, 16, gpus=1) if False else None
    assert b1 is None
    b2 = memory_bill(L70, 80, 16, gpus=2)
    assert b2.gpu_bytes == 2 * 80 * (1 << 30) and b2.num_blocks > 0


def test_tp_memory_bill_gains_the_freed_weights():
    one = memory_bill(L8, 80, 16)
    two = memory_bill(L8, 80, 16, gpus=2)
    per_block = one.block_bytes
    assert (
        two.num_blocks
        == (2 * 80 * (1 << 30) - L8.weight_bytes - 2 * int(80 * (1 << 30) * 0.1)) // per_block
    )
    assert two.num_blocks > 2 * one.num_blocks
    # TP wider than the KV heads stores each head twice
    p = parallel_layout(L8, 16)
    assert p.kv_copies == 2 and p.kv_share == 2 / 16
    copies = memory_bill(L8, 80, 16, gpus=16, kv_copies=2)
    plain = memory_bill(L8, 80, 16, gpus=16, kv_copies=1)
    assert (
        copies.num_blocks == plain.num_blocks // 2
        or abs(copies.num_blocks - plain.num_blocks / 2) <= 1
    )


@pytest.mark.parametrize(
    "model, tp, pp, needle",
    [("llama-3.1-8b", 3, 1, "does not divide the 32 attention heads"),
     ("qwen2.5-7b", 8, 1, "does not divide the 28 attention heads"),
     ("llama-3.1-8b", 1, 3, "does not divide the 32 layers"),
     ("llama-3.1-8b", 0, 1, "--tp must be"), ("llama-3.1-8b", 1, -2, "--pp must be")],
)  # fmt: skip
def test_bad_parallelism_is_refused(model, tp, pp, needle):
    with pytest.raises(SimulationError, match=needle):
        parallel_layout(get_model(model), tp, pp)


def test_mla_latent_is_stored_on_every_tp_rank():
    p = parallel_layout(get_model("deepseek-v2-lite"), 4)
    assert p.kv_copies == 4 and p.kv_share == 1.0


# ------------------------------------------------------------------------- dtypes


def test_kv_dtypes_change_bytes_per_token():
    bf16 = L8.kv_bytes_per_token
    assert L8.with_kv_dtype("fp8").kv_bytes_per_token * 2 == bf16
    # fp4: half a byte an element plus one fp8 scale per 16 elements
    assert L8.with_kv_dtype("fp4").kv_bytes_per_token == 32 * 2 * (1024 // 2 + 1024 // 16)
    t16 = TimeModel.for_model(L8)
    t8 = TimeModel.for_model(L8.with_kv_dtype("fp8"))
    assert t8.kv_read_s_per_token == pytest.approx(t16.kv_read_s_per_token / 2)
    b16, b8 = memory_bill(L8, 80, 16), memory_bill(L8.with_kv_dtype("fp8"), 80, 16)
    assert abs(b8.num_blocks - 2 * b16.num_blocks) <= 1


def test_weight_dtypes_change_the_bill_the_read_and_the_peak():
    f8 = L8.with_weight_dtype("fp8")
    i4 = L8.with_weight_dtype("int4")
    assert f8.weight_bytes == int(8.03e9)
    assert i4.weight_bytes == int(8.03e9 * (0.5 + 4 / 128))
    t16, t8 = TimeModel.for_model(L8), TimeModel.for_model(f8)
    assert t8.dense_bytes == pytest.approx(t16.dense_bytes / 2, rel=1e-6)
    assert t8.gemm_flops_per_s == pytest.approx(1979e12 * 0.6)  # H100 has fp8 tensor cores
    a100 = TimeModel.for_model(f8, gpu=get_gpu("a100-80gb"))
    assert a100.gemm_flops_per_s == pytest.approx(312e12 * 0.6)  # A100 does not
    assert memory_bill(f8, 80, 16).num_blocks > memory_bill(L8, 80, 16).num_blocks
    with pytest.raises(SimulationError, match="unknown weight dtype"):
        L8.with_weight_dtype("int3")
    with pytest.raises(SimulationError, match="unknown KV dtype"):
        L8.with_kv_dtype("fp2")


# ------------------------------------------------------------------------- GPUs


def test_gpu_catalog():
    for name in ("a100-80gb", "h100-sxm", "h200", "b200", "mi300x", "l40s"):
        g = GPUS[name]
        assert g.mem_gib > 0 and g.hbm_tb_s > 0 and g.bf16_tflops > 0 and g.link_gb_s > 0
        assert g.fp8_tflops >= g.bf16_tflops and g.usd_per_hour > 0
    assert get_gpu("H100").name == "h100-sxm"
    assert get_gpu("h200", usd_per_hour=9.0).usd_per_hour == 9.0
    assert [g.name for g in parse_gpus("h100-sxm,h200,h100")] == ["h100-sxm", "h200"]
    with pytest.raises(SimulationError, match="unknown GPU 'h900'"):
        get_gpu("h900")
    # a faster GPU gives a shorter step
    assert TimeModel.for_model(L8, gpu=GPUS["h200"]).step(0, 8, 8000) < TimeModel.for_model(
        L8
    ).step(0, 8, 8000)


# ------------------------------------------------------------------------- calibration


def _synthetic(tm: TimeModel, n: int = 120, seed: int = 1):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # decode only
            d = int(rng.integers(1, 256))
            rows.append((0, d, d * int(rng.integers(100, 4000)), 0))
        elif kind == 1:  # prefill chunk, fresh prompt
            rows.append((int(rng.integers(256, 8192)), 0, 0, 0))
        elif kind == 2:  # long-context prefill chunk: attention-bound
            rows.append((int(rng.integers(512, 2048)), 0, 0, int(rng.integers(16000, 64000))))
        else:  # mixed
            d = int(rng.integers(1, 64))
            rows.append((int(rng.integers(64, 1024)), d, d * 2000, 0))
    out = []
    for p, d, k, s in rows:
        pairs, reads = tm.prefill_attention([(s, p)]) if p else (0.0, 0.0)
        out.append((p, d, k, tm.step(p, d, k, 0, pairs, reads) * 1e3, s))
    return np.array(out, dtype=np.float64)


def test_calibration_recovers_known_constants():
    truth = Efficiency(compute=0.42, bandwidth=0.71, attention=0.33, host_ms=2.5)
    rows = _synthetic(TimeModel.for_model(L8, eff=truth))
    cal = fit(TimeModel.for_model(L8), rows)
    assert cal.eff.compute == pytest.approx(0.42, rel=0.03)
    assert cal.eff.bandwidth == pytest.approx(0.71, rel=0.03)
    assert cal.eff.attention == pytest.approx(0.33, rel=0.03)
    assert cal.eff.host_ms == pytest.approx(2.5, rel=0.05)
    assert cal.mean_abs_rel_error < 0.01 < cal.default_mean_abs_rel_error


def test_calibration_cli_uses_the_fit(tmp_path, capsys):
    truth = Efficiency(compute=0.5, bandwidth=0.6, attention=0.4, host_ms=3.0)
    rows = _synthetic(TimeModel.for_model(L8, eff=truth), 60)
    path = tmp_path / "prof.csv"
    lines = ["prefill_tokens,decode_tokens,kv_tokens_read,ms,prefill_start"]
    lines += [f"{int(p)},{int(d)},{int(k)},{ms:.6f},{int(s)}" for p, d, k, ms, s in rows]
    path.write_text("\n".join(lines) + "\n")
    assert read_profile(str(path)).shape == (60, 5)
    rc, out, err = run_main(
        capsys, "simulate", "--limit", "20", "--no-contiguous", "--calibrate", str(path), "--json"
    )
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["calibration"]["rows"] == 60
    assert doc["time_model"]["efficiency"]["bandwidth"] == pytest.approx(0.6, rel=0.03)
    assert doc["calibration"]["mean_abs_rel_error"] < 0.02


@pytest.mark.parametrize(
    "text, needle",
    [("", "empty calibration file"), ("prefill_tokens,decode_tokens,ms\n1,2,3\n", "lacks column(s) kv_tokens_read"),
     ("prefill_tokens,decode_tokens,kv_tokens_read,ms\n1,2,x,3\n1,1,1,1\n", ":2: kv_tokens_read 'x' is not a number"),
     ("prefill_tokens,decode_tokens,kv_tokens_read,ms\n1,2,3,-1\n1,1,1,1\n", ":2: ms must be a finite number > 0"),
     ("prefill_tokens,decode_tokens,kv_tokens_read,ms\n1,2,3,nan\n", "ms must be a finite"),
     ("prefill_tokens,decode_tokens,kv_tokens_read,ms\n1,2,3\n", ":2: 3 fields, no ms"),
     ("prefill_tokens,decode_tokens,kv_tokens_read,ms\n0,0,0,1\n", "prefill_tokens or decode_tokens > 0"),
     ("prefill_tokens,decode_tokens,kv_tokens_read,ms\n1,1,1,1\n", "at least 2")],
)  # fmt: skip
def test_malformed_calibration_file(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=None):
        read_profile(str(path))
    rc, _, err = run_main(capsys, "simulate", "--limit", "5", "--calibrate", str(path))
    one_line(rc, err, needle)


def test_missing_calibration_file(tmp_path, capsys):
    rc, _, err = run_main(capsys, "simulate", "--calibrate", str(tmp_path / "nope.csv"))
    one_line(rc, err, "cannot read the calibration file")


# ------------------------------------------------------------------------- CLI


SLO_KEYS = (
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "tpot_p99",
    "throughput_tok_s",
    "throughput_req_s",
    "goodput",
)


def test_simulate_json_has_the_slo_keys_and_the_gpus(capsys):
    rc, out, err = run_main(capsys, "simulate", "--limit", "40", "--no-contiguous", "--json",
                            "--gpu", "h200", "--tp", "2", "--weight-dtype", "fp8", "--kv-dtype", "fp8")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    for k in SLO_KEYS:
        assert k in doc and doc[k] is not None, k
    assert 0.0 <= doc["goodput"] <= 1.0 and doc["tpot_p99"] >= doc["tpot_p50"] > 0
    assert (doc["gpu"], doc["gpus"], doc["tp"], doc["pp"], doc["replicas"]) == ("h200", 2, 2, 1, 1)
    assert doc["usd_per_hour"] == pytest.approx(2 * GPUS["h200"].usd_per_hour)
    mem = doc["memory"]
    assert mem["gpu_gib"] == pytest.approx(2 * GPUS["h200"].mem_gib, rel=1e-6)
    assert (mem["weight_dtype"], mem["kv_dtype"], mem["gpus_per_replica"]) == ("fp8", "fp8", 2)
    assert mem["weights_gib"] == pytest.approx(8.03e9 / (1 << 30), rel=1e-6)
    assert doc["time_model"]["tp"] == 2 and doc["time_model"]["gpu"] == "h200"


def test_simulate_text_shows_tpot_and_the_gpu_line(capsys):
    rc, out, err = run_main(capsys, "simulate", "--limit", "30", "--no-contiguous", "--replicas", "2",
                            "--tp", "2", "--gpu", "a100-80gb", "--usd-per-hour", "1.5")  # fmt: skip
    assert rc == 0, err
    assert "gpus      4 x a100-80gb = 2 replicas x TP 2 x PP 1" in out and "$6.00/hour" in out
    assert "time per output token p99" in out and "goodput" in out


def test_goodput_follows_the_slo(capsys):
    docs = []
    for tpot in ("10", "0.0001"):
        rc, out, err = run_main(capsys, "simulate", "--limit", "30", "--no-contiguous", "--json",
                                "--ttft-slo", "1000", "--tpot-slo", tpot)  # fmt: skip
        assert rc == 0, err
        docs.append(json.loads(out))
    assert docs[0]["goodput"] == 1.0 and docs[1]["goodput"] == 0.0


def test_70b_does_not_fit_one_gpu_but_does_with_tp(capsys):
    rc, _, err = run_main(
        capsys, "simulate", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--limit", "5"
    )
    one_line(rc, err, "does not fit", "--tp")
    rc, out, err = run_main(capsys, "simulate", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--tp", "4",
                            "--limit", "10", "--no-contiguous", "--json")  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["gpus"] == 4


@pytest.mark.parametrize(
    "argv, needle",
    [(("simulate", "--gpu", "h900"), "unknown GPU 'h900'"),
     (("simulate", "--tp", "3"), "does not divide the 32 attention heads"),
     (("simulate", "--tp", "-1"), "--tp"), (("simulate", "--pp", "nan"), "--pp"),
     (("simulate", "--compute-eff", "0"), "--compute-eff"), (("simulate", "--bandwidth-eff", "1.5"), "--bandwidth-eff"),
     (("simulate", "--usd-per-hour", "-2"), "--usd-per-hour"), (("simulate", "--collective-us", "inf"), "--collective-us"),
     (("simulate", "--weight-dtype", "int3"), "unknown weight dtype"), (("simulate", "--kv-dtype", "fp2"), "unknown KV dtype"),
     (("simulate", "--tpot-slo", "0"), "--tpot-slo"),
     (("plan", "--gpu", "h100-sxm", "--trace", "x.jsonl", "--ttft-p99", "2", "--tp", "two"), "--tp: 'two'"),
     (("plan", "--gpu", "b900", "--trace", "x.jsonl", "--ttft-p99", "2"), "unknown GPU"),
     (("plan", "--tpot-p99", "-1"), "--tpot-p99"),
     (("plan", "--prompt-len", "100", "--output-len", "10", "--tp", "2,4"), "--tp takes one value"),
     (("plan", "--prompt-len", "100", "--output-len", "10", "--cost"), "--cost belongs")],
)  # fmt: skip
def test_bad_v2_input_is_one_line(capsys, argv, needle):
    rc, _, err = run_main(capsys, *argv)
    one_line(rc, err, needle)


# ------------------------------------------------------------------------- the GPU plan


def _fams(*specs):
    return [Family("h100-sxm", tp, 1, "bf16", 0.0, 2.5, fits=fits, why_not="" if fits else "weights")
            for tp, fits in specs]  # fmt: skip


def test_search_takes_the_cheapest_that_meets_and_explains():
    """A fake replay: TTFT p99 = 40 / GPUs; target 3 s -> 14 GPUs (7 x TP2; TP4 needs 16).
    Candidates run cheapest first and the search ends at the first that meets."""
    calls = []

    def replay(f, n):
        calls.append((f.tp, n))
        g = f.tp * n
        return {
            "ttft_p99_s": 40.0 / g,
            "tpot_p99_s": 0.05,
            "throughput_tok_s": 100.0 * g,
            "goodput": 1.0,
            "rejected": 0,
        }

    plan = search(_fams((1, False), (2, True), (4, True)), list(range(1, 9)), replay, 3.0)
    b = plan.best
    assert b is not None and (b.gpus, b.replicas, b.family.tp) == (14, 7, 2)
    assert len(calls) == 6 + 3 + 1  # TP2 x 1-6, TP4 x 1-3 (4-12 GPUs), then 7 x TP2
    assert calls == sorted(calls, key=lambda c: (c[0] * c[1], c[0]))
    assert all(c.gpus < 14 for c in plan.cheaper)
    assert any(c.gpus == 12 and c.family.tp == 2 for c in plan.cheaper)
    reasons = " | ".join(c.reason for c in plan.cheaper)
    assert "TTFT p99" in reasons and "does not fit" in reasons
    doc = plan.as_dict()
    assert {"gpus", "tp", "pp", "replicas", "gpu", "why_not_cheaper", "frontier"} <= set(doc)


def test_search_by_cost_and_tpot():
    def replay(f, n):
        return {
            "ttft_p99_s": 1.0,
            "tpot_p99_s": 0.2 / (f.tp * n),
            "throughput_tok_s": 1.0,
            "goodput": 1.0,
            "rejected": 0,
        }

    fams = [Family("a100-80gb", 2, 1, "bf16", 0.0, 1.0), Family("h200", 2, 1, "bf16", 0.0, 4.0)]
    plan = search(fams, [1, 2, 4], replay, 2.0, tpot_p99_s=0.05, by_cost=True)
    assert plan.best is not None and plan.best.family.gpu == "a100-80gb" and plan.best.gpus == 4
    assert any("TPOT p99" in c.reason for c in plan.cheaper)


def test_no_family_fits():
    with pytest.raises(SimulationError, match="no configuration fits"):
        search(_fams((1, False)), [1, 2], lambda f, n: {}, 1.0)


def _trace(tmp_path, n=24, prompt=3000, out=64, gap_ms=400):
    path = tmp_path / "t.jsonl"
    rows = [json.dumps({"timestamp": i * gap_ms, "input_length": prompt, "output_length": out,
                        "hash_ids": list(range(i * 10, i * 10 + math.ceil(prompt / 512)))})
            for i in range(n)]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def test_plan_answers_the_70b_question(tmp_path, capsys):
    """'How many H100s for this trace at TTFT p99 < 2 s with Llama-3.1-70B?'"""
    trace = _trace(tmp_path)
    rc, out, err = run_main(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-sxm", "--trace", trace,
                            "--ttft-p99", "2", "--tp", "1,2,4,8", "--replicas", "1-4", "--json", "--no-progress")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["gpu"] == "h100-sxm" and doc["gpus"] == doc["tp"] * doc["pp"] * doc["replicas"]
    assert doc["tp"] >= 2  # 131 GiB of weights never fit one 80 GB GPU
    assert doc["ttft_p99"] <= 2.0
    assert any(d["tp"] == 1 and "does not fit" in d["reason"] for d in doc["does_not_fit"])
    for c in doc["why_not_cheaper"]:
        assert c["gpus"] <= doc["gpus"] and c["reason"]
    rc, out, err = run_main(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-sxm,h200", "--trace", trace,
                            "--ttft-p99", "2", "--tp", "2,4", "--replicas", "1-2", "--cost", "--no-progress")  # fmt: skip
    assert rc == 0, err
    assert "answer    " in out and "why not cheaper" in out or "answer    " in out
    assert "h100-sxm" in out and "h200" in out


def test_idle_prefill_is_the_sum_of_its_chunks():
    from kvblocks.sim.plan.gpuplan import idle_prefill_s

    tm = TimeModel.for_model(L8)
    one = idle_prefill_s(tm, 8192, 8192)
    p, r = tm.prefill_attention([(0, 8192)])
    assert one == pytest.approx(tm.step(8192, 0, 0, 0, p, r))
    two = idle_prefill_s(tm, 16384, 8192)
    p2, r2 = tm.prefill_attention([(8192, 8192)])
    assert two == pytest.approx(one + tm.step(8192, 0, 0, 0, p2, r2))
    assert idle_prefill_s(TimeModel.for_model(L8, tp=2), 16384, 8192) < two


def test_early_stop_never_ends_a_replay_that_meets_the_target(tmp_path):
    """The plan's stop rule: a replay that ends with TTFT p99 <= target is never stopped, and
    an overloaded one is stopped (ReplayStopped) before its end."""
    from kvblocks.sim import SchedulerConfig, load_workload
    from kvblocks.sim.cluster.cluster import Cluster, ReplayStopped
    from kvblocks.sim.plan.gpuplan import ttft_already_missed

    w = load_workload(_trace(tmp_path, n=60, prompt=3000, out=32, gap_ms=50))
    bill = memory_bill(L8, 80, 16)
    cfg = SchedulerConfig(num_blocks=bill.num_blocks, block_size=16, block_bytes=bill.block_bytes)
    tm = TimeModel.for_model(L8)
    full = Cluster(w, cfg, tm, 1, "round_robin").run()
    p99 = full.summary["ttft_p99_s"]
    loose = Cluster(w, cfg, tm, 1, "round_robin").run(
        None, lambda c: ttft_already_missed(c, p99), 1
    )
    assert loose.summary["ttft_p99_s"] == pytest.approx(p99)
    with pytest.raises(ReplayStopped):
        Cluster(w, cfg, tm, 1, "round_robin").run(
            None, lambda c: ttft_already_missed(c, p99 / 20), 1
        )


def test_pipeline_parallel_cli(capsys):
    rc, out, err = run_main(
        capsys, "simulate", "--limit", "20", "--no-contiguous", "--json", "--pp", "2"
    )
    assert rc == 0, err
    doc = json.loads(out)
    assert (doc["gpus"], doc["pp"], doc["time_model"]["pipeline_bubble"]) == (2, 2, 0.5)


def test_gpu_plan_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "plan.png"
    rc, out, err = run_main(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l40s", "--trace", _trace(tmp_path),
                            "--ttft-p99", "5", "--tp", "1,2", "--replicas", "1-2", "--plot", str(out_png), "--no-progress")  # fmt: skip
    assert rc == 0, err
    assert out_png.stat().st_size > 0 and "plot written" in out


def test_every_constant_is_a_flag(capsys):
    rc, out, err = run_main(capsys, "simulate", "--limit", "10", "--no-contiguous", "--json", "--tp", "2",
                            "--compute-eff", "0.4", "--bandwidth-eff", "0.5", "--attention-eff", "0.3",
                            "--link-eff", "0.9", "--collective-us", "20", "--step-overhead-ms", "2",
                            "--peak-tflops", "500", "--hbm-tbs", "2", "--link-gbs", "100")  # fmt: skip
    assert rc == 0, err
    tm = json.loads(out)["time_model"]
    assert tm["gemm_flops_per_s"] == pytest.approx(500e12 * 0.4)
    assert tm["attention_flops_per_s"] == pytest.approx(500e12 * 0.3)
    assert tm["mem_bytes_per_s"] == pytest.approx(2e12 * 0.5)
    assert tm["host_ms"] == 2 and tm["collectives_ms_per_step"] == pytest.approx(64 * 20e-3)
    assert tm["collectives_ns_per_token"] == pytest.approx(
        64 * 2 * 0.5 * 4096 * 2 / (100e9 * 0.9) * 1e9
    )


def test_plan_kv_dtypes_and_cost(tmp_path, capsys):
    trace = _trace(tmp_path, n=12)
    rc, out, err = run_main(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "l40s,h100-sxm", "--trace", trace,
                            "--ttft-p99", "5", "--tp", "1", "--replicas", "1-2", "--kv-dtypes", "bf16,fp8",
                            "--cost", "--json", "--no-progress")  # fmt: skip
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["objective"] == "usd_per_hour" and doc["kv_dtype"] in ("bf16", "fp8")
    cheapest = min(GPUS["l40s"].usd_per_hour, GPUS["h100-sxm"].usd_per_hour)
    assert doc["usd_per_hour"] >= cheapest
    rc, _, err = run_main(capsys, "plan", "--gpu", "h100-sxm", "--trace", trace, "--ttft-p99", "5",
                          "--kv-dtypes", "bf16,fp3")  # fmt: skip
    one_line(rc, err, "unknown KV dtype 'fp3'")
