"""The ``kvblocks`` command line, run as users run it: ``python -m kvblocks ...`` in a subprocess."""

from __future__ import annotations

import json
import subprocess

import pytest
from subproc import run_python


def run(*args: str, stdin_tty: bool = False, pre: str = "") -> subprocess.CompletedProcess:
    if pre:
        cmd = [
            "-c",
            pre + "; import sys; from kvblocks.__main__ import main; sys.exit(main(sys.argv[1:]))",
            *args,
        ]
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
    p = run(
        "simulate",
        "--json",
        "--progress",
        "--limit",
        "120",
        "--model",
        "qwen2.5-7b",
        "--gpu-mem",
        "24",
    )
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
    rows = [
        {
            "timestamp": 10 * i,
            "input_length": 700 + i,
            "output_length": 20,
            "hash_ids": [0, 100 + i % 3],
        }
        for i in range(30)
    ]
    t.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = run("simulate", "--trace", str(t), "--layers", "16", "--kv-heads", "4", "--head-dim", "64",
            "--num-blocks", "400", "--json", "--no-contiguous")  # fmt: skip
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["contiguous"] is None and doc["memory"]["kv_bytes_per_token"] == 2 * 16 * 4 * 64 * 2
    assert doc["paged"]["cached_tokens"] > 0  # hash id 0 (and repeats of the second id) are shared


def test_simulate_azure_csv(tmp_path):
    t = tmp_path / "azure.csv"
    t.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{i:02d}.5,{300 + i},{10 + i}\n" for i in range(20))
    )
    p = run("simulate", "--trace", str(t), "--model", "mistral-7b", "--gpu-mem", "24")
    assert p.returncode == 0, p.stderr
    assert "20 requests" in p.stdout


def test_simulate_swap_preemption():
    p = run(
        "simulate",
        "--preemption",
        "swap",
        "--limit",
        "100",
        "--gpu-mem",
        "20",
        "--json",
        "--no-contiguous",
    )
    if p.returncode != 0:
        assert_one_line_error(p, "swap")
    else:
        assert json.loads(p.stdout)["paged"]["completed"] > 0


def test_plan():
    p = run(
        "plan",
        "--model",
        "llama-3.1-8b",
        "--gpu-mem",
        "80",
        "--prompt-len",
        "uniform:128:4096",
        "--output-len",
        "512",
    )
    assert p.returncode == 0, p.stderr
    for s in (
        "weights",
        "KV per token",
        "block rounding",
        "contiguous max-length",
        "paged, all at full length",
    ):
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
    t.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 1, oops}\n'
    )
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
    assert_one_line_error(
        run("plan", "--model", "nope", "--gpu-mem", "80", "--prompt-len", "1", "--output-len", "1"),
        "unknown model",
    )
    assert_one_line_error(
        run(
            "plan",
            "--model",
            "llama-3.1-8b",
            "--gpu-mem",
            "80",
            "--prompt-len",
            "-5",
            "--output-len",
            "1",
        ),
        "--prompt-len",
    )
    assert_one_line_error(
        run(
            "plan",
            "--model",
            "llama-3.1-8b",
            "--gpu-mem",
            "80",
            "--prompt-len",
            "1",
            "--output-len",
            "uniform:9",
        ),
        "--output-len",
    )
    assert_one_line_error(
        run("simulate", "--model", "llama-3.1-70b", "--gpu-mem", "80"), "does not fit"
    )


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    p = run(
        "simulate",
        "--limit",
        "20",
        "--plot",
        str(tmp_path / "m.png"),
        pre="import sys; sys.modules['matplotlib'] = None",
    )
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
    assert (
        main(
            [
                "plan",
                "--gpu-mem",
                "80",
                "--prompt-len",
                "100",
                "--output-len",
                "100",
                "--samples",
                "10",
            ]
        )
        == 0
    )


# ---------------------------------------------------------------------------------------------
# Hardening (issue 10): every malformed flag value or trace is one error line and status 2.
# These call main(argv) in-process: a parse-time error never starts a simulation, so each
# case costs microseconds.
# ---------------------------------------------------------------------------------------------
import argparse

from kvblocks.__main__ import (
    build_parser,
)
from kvblocks.sim import limits

PLAN_ARGS = ("--prompt-len", "100", "--output-len", "100", "--samples", "10")


def assert_one_line(rc: int, err: str, *needles: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def limit_flags():
    """(subcommand, flag, Limit) for every flag whose type is a Limit's parser."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for act in p._actions:
            lim = getattr(act.type, "__self__", None)
            if isinstance(lim, limits.Limit):
                yield name, act.option_strings[0], lim, act.default


def test_every_numeric_flag_has_a_limit():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for act in p._actions:
            if act.type in (int, float):
                raise AssertionError(f"{name} {act.option_strings}: plain type={act.type.__name__}")
    flags = {(c, f) for c, f, _, _ in limit_flags()}
    assert (
        ("simulate", "--gpu-mem") in flags
        and ("plan", "--seed") in flags
        # shared (+ --usd-per-hour), simulate, plan; cluster: simulate --replicas
        # --overlap-weight --host-cache --pcie-gbps, plan --limit --time-scale --ttft-p99
        # --pcie-gbps; v2: the 14 time-model flags in both, simulate --tp --pp (plan's take
        # lists), plan --tpot-p99 --max-num-seqs --token-budget (the simulate time-model
        # flags --step-overhead-ms --prefill-us --decode-us --kv-read-ns moved to the shared 14)
        and len(flags) == 2 * 10 + (11 - 4) + 3 + 4 + 4 + 2 * 14 + 2 + 3
    )


@pytest.mark.parametrize(
    "cmd, flag, lim, default", list(limit_flags()), ids=lambda v: getattr(v, "flag", v)
)
def test_flag_defaults_are_in_range(cmd, flag, lim, default):
    if default is not None:
        assert lim.check(default) == default


def bad_values(lim: limits.Limit):
    vals = ["nan", "inf", "-inf", "1e400", "abc", "", str(lim.hi * 10 + 1)]
    vals.append(str(lim.lo) if lim.lo_open else str(lim.lo - 1))
    if lim.hi_open:
        vals.append(str(lim.hi))
    if lim.kind is int:
        vals += ["2.5", "1e3", "0x10", "9" * 5000]
    return vals


@pytest.mark.parametrize(
    "cmd, flag, value",
    [(c, f, v) for c, f, lim, _ in limit_flags() for v in bad_values(lim)],
    ids=lambda v: v if len(str(v)) < 20 else "long",
)
def test_bad_flag_value_is_one_line_error(run_main, cmd, flag, value):
    extra = PLAN_ARGS if cmd == "plan" else ()
    rc, out, err = run_main(cmd, f"{flag}={value}", *extra)
    line = assert_one_line(rc, err, f"argument {flag}: must be ")
    assert len(line) < 200 and out == ""


@pytest.mark.parametrize(
    "argv, needle",
    [
        (("simulate", "--reserve", "-inf"), "--flag=VALUE"),  # argparse reads "-inf" as a flag
        (("plan", "--seed", "-1", *PLAN_ARGS), "argument --seed: must be an integer in [0, "),
        (
            ("simulate", "--gpumem", "3"),
            "unrecognized arguments: --gpumem 3 (see 'kvblocks simulate --help')",
        ),
        (("plan",), "required: --prompt-len, --output-len"),
        (("simulate", "--format", "xml"), "invalid choice"),
    ],
)
def test_usage_errors_are_one_line(run_main, argv, needle):
    rc, _, err = run_main(*argv)
    assert_one_line(rc, err, needle)


@pytest.mark.parametrize(
    "argv, needles",
    [
        # --gpu-mem 1e6 used to build a ~460M-block pool (~20 GB of allocator metadata)
        (
            ("simulate", "--gpu-mem", "1e6"),
            ("460,792,341", "16,777,216", "--block-size", "--num-blocks"),
        ),
        (("simulate", "--num-blocks", "20000000"), ("--num-blocks 20,000,000", "16,777,216")),
        (("simulate", "--preemption", "swap", "--host-mem", "1e5"), ("--host-mem", "16,777,216")),
        (("plan", "--gpu-mem", "1e6", "--block-size", "1", *PLAN_ARGS), ("int32", "--block-size")),
        (
            ("simulate", "--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--params", "900"),
            ("does not fit",),
        ),
    ],
)
def test_too_many_blocks_is_refused_before_allocating(run_main, argv, needles):
    rc, _, err = run_main(*argv)
    assert_one_line(rc, err, *needles)


def test_block_caps_are_what_the_limits_say():
    assert limits.MAX_SIM_BLOCKS == 1 << 24 and limits.MAX_BLOCK_IDS == 2**31 - 2


def test_plan_accepts_a_pool_beyond_the_simulator_cap(run_main):
    rc, out, err = run_main("plan", "--gpu-mem", "1e6", "--json", *PLAN_ARGS)
    assert rc == 0, err
    assert json.loads(out)["memory"]["num_blocks"] == 460_792_341


def test_boundary_values_are_accepted(run_main):
    rc, out, err = run_main(
        "simulate", "--limit", "40", "--time-scale", "0", "--watermark", "0", "--reserve", "0",
        "--host-mem", "0", "--max-model-len", "20000000", "--step-overhead-ms", "0", "--prefill-us", "0",
        "--decode-us", "0", "--kv-read-ns", "0", "--num-blocks", "3000", "--json",
    )  # fmt: skip
    assert rc == 0, err
    assert json.loads(out)["paged"]["completed"] > 0
    rc, out, err = run_main("plan", "--seed", str(2**64 - 1), "--max-len", "20000000",
                            "--layers", "2", "--latent-dim", "64", "--params", "0", *PLAN_ARGS)  # fmt: skip
    assert rc == 0, err


def test_defaults_still_run_in_process(run_main):
    rc, out, err = run_main("simulate", "--limit", "30", "--no-contiguous")
    assert rc == 0 and err == "" and "peak KV usage" in out
    rc, out, err = run_main("plan", *PLAN_ARGS)
    assert rc == 0 and err == "" and "paged, all at full length" in out


MOONCAKE_OK = {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}


def write_mooncake(tmp_path, line: str):
    t = tmp_path / "bad.jsonl"
    t.write_text(json.dumps(MOONCAKE_OK) + "\n" + line + "\n")
    return t


@pytest.mark.parametrize(
    "field, value, needle",
    [
        (f, v, n)
        for f in ("input_length", "output_length")
        for v, n in [
            ("Infinity", "must be an integer, got inf"),
            ("-Infinity", "must be an integer"),
            ("NaN", "must be an integer, got nan"),
            ("1e400", "must be an integer, got inf"),
            ("10.0", "must be an integer, got 10.0"),
            ("10.5", "must be an integer"),
            ("-3", "must be >= 1"),
            ("0", "must be >= 1"),
            ('"10"', "must be an integer"),
            ("true", "must be an integer"),
            ("10000001", "absurdly large"),
            ("9" * 40, "absurdly large"),
            ("9" * 5000, "malformed JSON"),
        ]  # fmt: skip
    ]
    + [
        ("timestamp", v, n)
        for v, n in [
            ("Infinity", "non-negative number of ms, got inf"),
            ("-Infinity", "non-negative"),
            ("NaN", "got nan"),
            ("1e400", "got inf"),
            ("-1", "non-negative"),
            ("1e300", "absurdly large"),
            ('"0"', "non-negative"),
        ]  # fmt: skip
    ]
    + [
        ("hash_ids", v, "bad hash id")
        for v in (
            "[1e400]",
            "[Infinity]",
            "[NaN]",
            "[1.0]",
            "[-1]",
            "[68719476736]",
            "[true]",
            f"[{'9' * 60}]",
        )
    ],
)
def test_bad_mooncake_integer_field_is_one_line_error(run_main, tmp_path, field, value, needle):
    text = json.dumps(MOONCAKE_OK).replace(
        f'"{field}": ' + json.dumps(MOONCAKE_OK[field]), f'"{field}": {value}'
    )
    assert text != json.dumps(MOONCAKE_OK)
    t = write_mooncake(tmp_path, text)
    rc, _, err = run_main("simulate", "--trace", str(t))
    line = assert_one_line(rc, err, f"{t}:2: ", needle)
    assert len(line) < 300


@pytest.mark.parametrize(
    "stamp", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "1e300", "-1e300"]
)
def test_bad_csv_timestamp_is_one_line_error(run_main, tmp_path, stamp):
    t = tmp_path / "bad.csv"
    t.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,12,3\n{stamp},12,3\n")
    rc, _, err = run_main("simulate", "--trace", str(t))
    assert_one_line(rc, err, f"{t}:3: ", "bad TIMESTAMP")


def test_csv_nan_timestamp_no_longer_hangs(tmp_path):
    """The replay compared arrival times with NaN and looped forever: run it as users do, with a
    timeout, so a regression fails instead of hanging the suite."""
    t = tmp_path / "nan.csv"
    t.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,12,3\nnan,12,3\n")
    assert_one_line_error(run("simulate", "--trace", str(t)), f"{t}:3: ", "bad TIMESTAMP 'nan'")


ALL_FORMATS = ("auto", "mooncake", "azure", "kvblocks")


@pytest.mark.parametrize(
    "name, data, line, needle, formats",
    [
        (
            "latin1.csv",
            b"TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,12,3\n2.0,12,3 caf\xe9\n",
            3,
            "byte 0xe9",
            ("auto", "azure"),
        ),
        (
            "latin1.jsonl",
            (json.dumps(MOONCAKE_OK) + '\n{"timestamp": 1, "note": "caf\xe9"}\n').encode("latin-1"),
            2,
            "byte 0xe9 at column 30",
            ("auto", "mooncake"),
        ),
        (
            "utf16.jsonl",
            json.dumps(MOONCAKE_OK).encode("utf-16"),
            1,
            "byte 0xff at column 1",
            ALL_FORMATS,
        ),
        (
            "utf16.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n".encode("utf-16"),
            1,
            "byte 0xff",
            ALL_FORMATS,
        ),
        (
            "binary.jsonl",
            bytes(range(128, 256)) + bytes(range(128)),
            1,
            "byte 0x80 at column 1",
            ALL_FORMATS,
        ),
    ],
)
def test_non_utf8_trace_is_one_line_error(run_main, tmp_path, name, data, line, needle, formats):
    """Decoding errors were UnicodeDecodeError tracebacks; now they name the file and line."""
    t = tmp_path / name
    t.write_bytes(data)
    for fmt in formats:
        rc, _, err = run_main("simulate", "--trace", str(t), "--format", fmt)
        assert_one_line(rc, err, f"{t}:{line}: not UTF-8", needle)


def test_utf8_byte_order_mark_is_accepted(run_main, tmp_path):
    t = tmp_path / "bom.csv"
    t.write_bytes(b"\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\n1.0,12,3\n2.0,14,3\n")
    rc, out, err = run_main("simulate", "--trace", str(t), "--no-contiguous")
    assert rc == 0 and "2 requests" in out, err
