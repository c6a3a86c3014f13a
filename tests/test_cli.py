"""The ``kvblocks`` command line, run as users run it: ``python -m kvblocks ...`` in a subprocess."""

from __future__ import annotations

import json
import subprocess

import pytest
from subproc import run_python



def run(*args: str, stdin_tty: bool = False, pre: str = "") -> subprocess.CompletedProcess:
    if pre:
        cmd = ["-c", pre + "; import sys; from kvblocks.__main__ import main; sys.exit(main(sys.argv[1:]))", *args]
    else:
        cmd = ["-m", "kvblocks", *args]
    return run_python(cmd, timeout=120)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_simulate_default_prints_summary():
    p = run("simulate")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for row in ("peak KV usage", "internal fragmentation", "prefix hit rate", "queueing delay p99",
                "throughput (output tok/s)", "contiguous (max-length)", "inside BlockManager calls"):  # fmt: skip
        assert row in out
    assert "builtin:default" in out and "Llama-3.1-8B" in out
    assert p.stderr == ""  # no progress bar when stderr is not a terminal


def test_simulate_json_and_progress(tmp_path):
    p = run("simulate", "--json", "--progress", "--limit", "120", "--model", "qwen2.5-7b", "--gpu-mem", "24")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["memory"]["model"] == "Qwen2.5-7B" and doc["workload"]["requests"] == 120
    paged, contig = doc["paged"], doc["contiguous"]
    assert paged["completed"] + paged["rejected"] == 120 and paged["blocks_in_use_at_end"] == 0
    assert 0 <= paged["allocator_share"] <= 1 and paged["queue_p99_s"] >= paged["queue_p50_s"]
    assert contig["internal_fragmentation"] > paged["internal_fragmentation"]
    assert "simulate [" in p.stderr and "requests" in p.stderr


def test_simulate_mooncake_trace_and_custom_model(tmp_path):
    t = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 10 * i, "input_length": 700 + i, "output_length": 20, "hash_ids": [0, 100 + i % 3]} for i in range(30)]
    t.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = run("simulate", "--trace", str(t), "--layers", "16", "--kv-heads", "4", "--head-dim", "64",
            "--num-blocks", "400", "--json", "--no-contiguous")  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["contiguous"] is None and doc["memory"]["kv_bytes_per_token"] == 2 * 16 * 4 * 64 * 2
    assert doc["paged"]["cached_tokens"] > 0  # hash id 0 (and repeats of the second id) are shared


def test_simulate_azure_csv(tmp_path):
    t = tmp_path / "azure.csv"
    t.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"2023-11-16 18:15:{i:02d}.5,{300 + i},{10 + i}\n" for i in range(20)))
    p = run("simulate", "--trace", str(t), "--model", "mistral-7b", "--gpu-mem", "24")
    assert p.returncode == 0, p.stderr
    assert "20 requests" in p.stdout


def test_simulate_swap_preemption():
    p = run("simulate", "--preemption", "swap", "--limit", "100", "--gpu-mem", "20", "--json", "--no-contiguous")
    if p.returncode != 0:
        assert_one_line_error(p, "swap")
    else:
        assert json.loads(p.stdout)["paged"]["completed"] > 0


def test_plan():
    p = run("plan", "--model", "llama-3.1-8b", "--gpu-mem", "80", "--prompt-len", "uniform:128:4096", "--output-len", "512")
    assert p.returncode == 0, p.stderr
    for s in ("weights", "KV per token", "block rounding", "contiguous max-length", "paged, all at full length"):
        assert s in p.stdout
    p = run("plan", "--model", "deepseek-v2-lite", "--gpu-mem", "48", "--prompt-len", "lognormal:2000:3000",
            "--output-len", "normal:300:100", "--json")  # fmt: skip
    doc = json.loads(p.stdout)
    assert doc["memory"]["kv_bytes_per_token"] == 27 * 576 * 2
    assert doc["paged_concurrent"] > doc["contiguous_concurrent"]


def test_help_documents_dist_syntax():
    p = run("plan", "--help")
    assert p.returncode == 0 and "uniform:LO:HI" in p.stdout and "lognormal:MEAN:STD" in p.stdout
    p = run("simulate", "--help")
    assert p.returncode == 0 and "Mooncake" in p.stdout and "--gpu-mem" in p.stdout


def test_error_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert_one_line_error(run("simulate", "--trace", str(missing)), str(missing), "no such file")


def test_error_malformed_line(tmp_path):
    t = tmp_path / "bad.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 1, oops}\n')
    assert_one_line_error(run("simulate", "--trace", str(t)), f"{t}:2:", "malformed JSON")


@pytest.mark.parametrize("value, msg", [(-4, "must be >= 1"), (10**12, "absurdly large")])
def test_error_bad_lengths(tmp_path, value, msg):
    t = tmp_path / "bad.jsonl"
    t.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n' * 2
                 + json.dumps({"timestamp": 3, "input_length": 10, "output_length": value, "hash_ids": [1]}) + "\n")  # fmt: skip
    assert_one_line_error(run("simulate", "--trace", str(t)), f"{t}:3:", msg)


def test_error_csv_line(tmp_path):
    t = tmp_path / "bad.csv"
    t.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,12,3\n2.0,-7,3\n")
    assert_one_line_error(run("simulate", "--trace", str(t)), f"{t}:3:", "ContextTokens")


def test_error_unknown_model_and_bad_dist_and_no_fit():
    assert_one_line_error(run("simulate", "--model", "gpt-17"), "unknown model 'gpt-17'")
    assert_one_line_error(run("plan", "--model", "nope", "--gpu-mem", "80", "--prompt-len", "1", "--output-len", "1"), "unknown model")
    assert_one_line_error(run("plan", "--model", "llama-3.1-8b", "--gpu-mem", "80", "--prompt-len", "-5", "--output-len", "1"), "--prompt-len")
    assert_one_line_error(run("plan", "--model", "llama-3.1-8b", "--gpu-mem", "80", "--prompt-len", "1", "--output-len", "uniform:9"), "--output-len")
    assert_one_line_error(run("simulate", "--model", "llama-3.1-70b", "--gpu-mem", "80"), "does not fit")


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    p = run("simulate", "--limit", "20", "--plot", str(tmp_path / "m.png"), pre="import sys; sys.modules['matplotlib'] = None")
    assert_one_line_error(p, "matplotlib", "kvblocks[plot]")


def test_plot_writes_file(tmp_path):
    pytest.importorskip("matplotlib")
    for name in ("m.png", "m.svg"):
        out = tmp_path / name
        p = run("simulate", "--limit", "60", "--plot", str(out))
        assert p.returncode == 0, p.stderr
        assert out.exists() and out.stat().st_size > 1000


def test_console_entry_point_is_callable():
    from kvblocks.__main__ import main

    assert callable(main)
    assert main(["plan", "--gpu-mem", "80", "--prompt-len", "100", "--output-len", "100", "--samples", "10"]) == 0
