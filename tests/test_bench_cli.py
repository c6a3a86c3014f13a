"""``kvblocks bench`` (issue 16): output structure, the JSON schema, --compare, bad inputs.

Runs use ``--quick --samples N`` (a few samples per case), so the whole file takes seconds.
Nothing here asserts a timing: only the shape of what is printed and written, and arithmetic
that holds whatever the numbers (ratios, p50 <= p99).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from subproc import env, run_python

from kvblocks.__main__ import main
from kvblocks.bench import runner as bench_runner
from kvblocks.bench import vllm_pool
from kvblocks.bench.machine import describe_machine, detect_build
from kvblocks.bench.report import load_baseline

ROOT = Path(__file__).resolve().parents[1]
TINY = ("--quick", "--samples", "3")
ALLOC_OPS = [
    "allocate_free/n=1",
    "allocate_free/n=16",
    "allocate_free/n=128",
    "allocate_free/n=1024",
    "allocate_free/one",
    "fork_cow",
    "append_batch/list",
    "append_batch/seqbatch",
    "decode_step/fills",
    "build/1M",
]
STATS = {"p50_ns", "p99_ns", "mean_ns", "min_ns", "max_ns", "ns_per_unit", "samples", "inner"}


def bench(*args: str, **kw) -> subprocess.CompletedProcess:
    return run_python(["-m", "kvblocks", "bench", *args], timeout=300, **kw)


@pytest.fixture(scope="module")
def alloc_run(tmp_path_factory):
    """One tiny ``bench alloc`` run, with --json and a forced progress bar."""
    out = tmp_path_factory.mktemp("bench") / "alloc.json"
    p = bench("alloc", *TINY, "--json", str(out), "--progress")
    assert p.returncode == 0, p.stderr
    return p, json.loads(out.read_text()), out


def test_alloc_text_report(alloc_run):
    p, doc, out = alloc_run
    text = p.stdout
    for needle in (
        "kvblocks bench: alloc",
        "machine ",
        "software ",
        "timer overhead",
        "subtracted: timer",
        "warm-up:",
        "GC off",
        "baselines python",
        "vllm:",
        "memory per block: kvblocks",
    ):
        assert needle in text, needle
    header = next(line for line in text.splitlines() if line.startswith("operation"))
    assert header.split() == [
        "operation",
        "per",
        "p50",
        "p99",
        "ns/unit",
        "python",
        "p50",
        "x",
        "python",
    ]
    for op in doc["suites"]["alloc"]["ops"]:
        row = next(line for line in text.splitlines() if line.startswith(op["label"]))
        assert row.rstrip().endswith(
            "x"
        )  # a same-run ratio for every op: all have a Python counterpart
    assert f"wrote {out}" in text
    assert "bench alloc [" in p.stderr and "100%" in p.stderr  # --progress forces the bar


def test_alloc_json_schema(alloc_run):
    _, doc, _ = alloc_run
    assert doc["schema"] == "kvblocks-bench/1"
    assert doc["command"] == "kvblocks bench alloc --quick --samples 3"
    assert doc["settings"] == {"quick": True, "max_samples": 3, "rounds": 2}
    m = doc["machine"]
    for key in (
        "cpu_model",
        "arch",
        "cores_logical",
        "cores_usable",
        "os",
        "python",
        "numpy",
        "kvblocks",
        "build",
    ):
        assert key in m, key
    assert m["build"]["kind"] in ("release", "release?", "debug", "sanitizer", "unknown")
    t = doc["timing"]
    assert (
        "warm-up" in t["warmup"] and t["gc"] == "off while timing" and "subtracted" in t["overhead"]
    )
    for ov in (t["before_run"], doc["suites"]["alloc"]["overhead"]):
        assert (
            ov["subtracted"] is True and ov["timer_overhead_ns"] > 0 and ov["call_overhead_ns"] >= 0
        )
    assert doc["vllm_timed"] is False or "vllm" in doc["suites"]["alloc"]["ops"][0]["results"]
    body = doc["suites"]["alloc"]
    assert [o["id"] for o in body["ops"]] == ALLOC_OPS
    for o in body["ops"]:
        assert set(o) == {"id", "label", "unit", "units", "note", "results", "speedup"}
        assert o["unit"] in ("block", "seq", "call") and o["units"] >= 1
        for r in o["results"].values():
            assert set(r) == STATS
            assert 0 <= r["min_ns"] <= r["p50_ns"] <= r["p99_ns"] <= r["max_ns"]
            assert r["ns_per_unit"] == pytest.approx(r["p50_ns"] / o["units"])
            assert 1 <= r["samples"] <= 3 and r["inner"] >= 1
        assert set(o["speedup"]) == set(o["results"]) - {"kvblocks"} and "python" in o["speedup"]
        if o["results"]["kvblocks"]["p50_ns"] > 0:
            assert o["speedup"]["python"] == pytest.approx(
                o["results"]["python"]["p50_ns"] / o["results"]["kvblocks"]["p50_ns"]
            )
    mem = body["bytes_per_block"]
    assert mem["kvblocks"] > 0 and mem["python"] > 0


def test_report_warnings(alloc_run):
    from kvblocks.bench.report import format_report

    _, doc, _ = alloc_run
    doc = json.loads(json.dumps(doc))
    doc["machine"]["build"]["kind"] = "debug"
    doc["suites"]["alloc"]["overhead"]["probe_slowdown"] = 2.0
    doc["load_average"] = {"start": [3.0, 2.0, 1.0], "end": [3.5, 2.0, 1.0]}
    text = format_report(doc)
    assert "debug build of the extension" in text
    assert "other processes slowed this suite" in text and "2.00x slower" in text
    assert "load average 3.00 at start" in text and "other processes were busy" in text


def test_all_suites_json_to_stdout():
    p = bench("all", *TINY, "--json", "-")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # no progress bar when stderr is not a terminal
    doc = json.loads(p.stdout)
    assert list(doc["suites"]) == ["alloc", "prefix", "metadata", "groups", "tier"]
    ids = [o["id"] for body in doc["suites"].values() for o in body["ops"]]
    assert len(ids) == len(set(ids))
    prefix = {o["id"]: o for o in doc["suites"]["prefix"]["ops"]}
    assert set(prefix) == {
        "hash_blocks/32k",
        "hash_blocks/32k/vllm_sha256_cbor",
        "hash_blocks/32k/vllm_sha256_cbor_v030",
        "hash_blocks/32k/sglang_sha256",
        "lookup/2048",
        "lookup_and_pin/2048",
        "allocate_evicting/128",
        "allocate_uncached/128",
    }
    assert all("python" in o["speedup"] for o in prefix.values())
    meta = doc["suites"]["metadata"]["ops"]
    assert {o["id"].split("/")[1] for o in meta} == {"decode", "prefill"}
    assert any(o["id"] == "metadata/decode/advancing" for o in meta)
    for o in meta:
        assert set(o["speedup"]) == {"numpy-list", "numpy-2d"} and o["unit"] == "block"
    tier = doc["suites"]["tier"]
    assert [o["id"] for o in tier["ops"]] == [
        "demote/128",
        "demote_present/128",
        "demote_drain/128",
        "cache_write_through/128",
        "add_hits/2047",
        "probe/2047",
    ]
    assert all(set(o["speedup"]) == {"device-only"} for o in tier["ops"])
    assert set(tier["ratio_vs_device"]) == {o["id"] for o in tier["ops"]}
    assert tier["target_ratio"] == 2.0
    groups = doc["suites"]["groups"]
    assert [o["id"] for o in groups["ops"]] == GROUPS_OPS
    assert all(set(o["speedup"]) == {"single-group"} for o in groups["ops"])
    assert groups["target_ratio"] == {"append_batch": 2.0, "metadata/group0": 1.1}


GROUPS_OPS = [
    "append_batch/w=128/ctx=2k",
    "append_batch/w=128/ctx=1k",
    "append_batch/w=128/ctx=8k",
    "append_batch/w=128/ctx=32k",
    "append_batch/w=1024/ctx=1k",
    "append_batch/w=1024/ctx=8k",
    "append_batch/w=1024/ctx=32k",
    "metadata/group0",
    "metadata/group0/advancing",
    "metadata/group1",
]


def test_groups_suite_ratios_and_scaling():
    """The groups suite in-process: ratios and release scaling are computed from its rows."""
    from kvblocks.bench import format_report
    from kvblocks.bench import run as run_bench

    doc = run_bench(["groups"], quick=True, max_samples=2, use_vllm=False).doc
    body = doc["suites"]["groups"]
    ops = {o["id"]: o for o in body["ops"]}
    assert list(ops) == GROUPS_OPS and body["num_seqs"] == 256 and body["block_size"] == 16
    assert doc["baselines"]["single-group"].startswith("the same call")
    for i, r in body["ratio_vs_single"].items():
        k, s = ops[i]["results"]["kvblocks"], ops[i]["results"]["single-group"]
        assert r["p50"] == pytest.approx(k["p50_ns"] / s["p50_ns"], rel=1e-2)
        assert r["p99"] == pytest.approx(k["p99_ns"] / s["p99_ns"], rel=1e-2)
    assert set(body["ratio_vs_single"]) == set(GROUPS_OPS)  # every op has the baseline
    scaling = body["release_scaling"]
    assert list(scaling) == ["w=128", "w=1024"]
    assert list(scaling["w=128"]["ns_per_seq"]) == ["1k", "2k", "8k", "32k"]
    assert list(scaling["w=1024"]["ns_per_seq"]) == ["1k", "8k", "32k"]
    for row in scaling.values():
        v = list(row["ns_per_seq"].values())
        assert row["spread"] == pytest.approx(max(v) / min(v), rel=1e-2)
    one = ops["append_batch/w=1024/ctx=8k"]["results"]["kvblocks"]
    assert scaling["w=1024"]["ns_per_seq"]["8k"] == pytest.approx(one["p50_ns"] / 256, abs=0.01)
    text = format_report(doc)
    assert "x single-group" in text and "full + window 1024" in text


@pytest.mark.parametrize("window", [None, 128])
def test_groups_check_accepts_the_timed_step(window):
    from kvblocks.bench.groups import _Decoding

    d = _Decoding(1024, window, 0)
    for _ in range(40):  # the timed case: setup, then the call
        d.before_append()
        d.append()
    d.check_releases()
    held = d.window_held()
    assert max(held) <= (window or 0) // 16 + 2 and (window is None) == (max(held) == 0)


def test_groups_check_catches_a_step_that_releases_nothing(monkeypatch):
    """The check fails when the timed call would not release: a window wider than every
    context, or a step whose token is never computed (the window cannot move on)."""
    from kvblocks.bench.groups import _Decoding

    with pytest.raises(AssertionError, match="did not release one block per sequence"):
        _Decoding(1024, 4096, 0).check_releases()
    d = _Decoding(1024, 128, 0)
    monkeypatch.setattr(d, "before_append", lambda: None)
    with pytest.raises(AssertionError, match="did not release"):
        d.check_releases()
    d = _Decoding(1024, 128, 0)  # the untimed setup releases: the call would time no release

    def two_steps() -> None:
        d.mgr.schedule(d.sb, d.ones)
        d.mgr.append_batch(d.sb, d.toks)
        d.mgr.schedule(d.sb, d.ones)

    monkeypatch.setattr(d, "before_append", two_steps)
    with pytest.raises(AssertionError, match="the untimed part of the step released"):
        d.check_releases()


def test_compare_ratios(alloc_run, tmp_path):
    _, old, old_path = alloc_run
    # an op the earlier file lacks, and one whose p50 we know
    old = json.loads(old_path.read_text())
    old["suites"]["alloc"]["ops"] = [
        o for o in old["suites"]["alloc"]["ops"] if o["id"] != "fork_cow"
    ]
    prev = tmp_path / "prev.json"
    prev.write_text(json.dumps(old))
    new_path = tmp_path / "new.json"
    p = bench("alloc", *TINY, "--compare", str(prev), "--json", str(new_path))
    assert p.returncode == 0, p.stderr
    assert f"against {prev}" in p.stdout and "p50 now/then" in p.stdout
    row = next(line for line in p.stdout.splitlines() if line.startswith("fork + copy-on-write"))
    assert row.split()[-2:] == ["new", "new"]
    doc = json.loads(new_path.read_text())
    cmp = doc["compare"]
    assert (
        cmp["file"] == str(prev)
        and cmp["not_in_file"] == ["fork_cow"]
        and cmp["machine_differs"] == []
    )
    before = {o["id"]: o for o in old["suites"]["alloc"]["ops"]}
    for o in doc["suites"]["alloc"]["ops"]:
        if o["id"] == "fork_cow":
            assert o["id"] not in cmp["ops"]
            continue
        was = before[o["id"]]["results"]["kvblocks"]
        if was["p50_ns"] > 0:
            assert cmp["ops"][o["id"]]["p50"] == pytest.approx(
                o["results"]["kvblocks"]["p50_ns"] / was["p50_ns"]
            )


# ---------------------------------------------------------------------------------------------
# Bad input: one error line, status 2, and no timing started (checked in-process).
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(bench_runner, "run", refuse)


def one_line_error(capsys, argv, *needles):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvblocks: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            ("bench", "allocs"),
            ("unknown suite 'allocs'", "alloc, prefix, metadata, groups, tier, all"),
        ),
        (("bench", "alloc", "nope"), ("unknown suite 'nope'",)),
        (("bench", "groups", "group"), ("unknown suite 'group'",)),
        (("bench", "--samples", "0"), ("argument --samples: must be an integer in [1, 100,000]",)),
        (("bench", "--samples", "2.5"), ("argument --samples",)),
        (("bench", "--samples=-3"), ("argument --samples",)),
        (
            ("bench", "--frobnicate"),
            ("unrecognized arguments: --frobnicate", "kvblocks bench --help"),
        ),
        (("bench", "--json", "/nonexistent-dir/x.json"), ("--json", "no such folder")),
    ],
)
def test_usage_errors(capsys, no_work, argv, needles):
    one_line_error(capsys, argv, *needles)


def _doc(suites=("alloc",)):
    return {
        "schema": "kvblocks-bench/1",
        "suites": {
            s: {
                "ops": [
                    {
                        "id": "allocate_free/n=1",
                        "results": {"kvblocks": {"p50_ns": 100.0, "p99_ns": 150.0}},
                    }
                ]
            }
            for s in suites
        },
    }


@pytest.mark.parametrize(
    "content, needles",
    [
        (None, ("cannot read",)),
        (b"{not json", ("not JSON",)),
        (b"\xff\xfe\x00garbage", ("not a text file",)),
        (b"[1, 2, 3]", ("not a kvblocks bench result",)),
        (
            json.dumps({"bench": "bench_alloc", "rows": []}).encode(),
            ("not a kvblocks bench result", "no schema field"),
        ),
        (
            json.dumps({**_doc(), "schema": "kvblocks-bench/0"}).encode(),
            ("schema 'kvblocks-bench/0'",),
        ),
        (json.dumps(_doc(("prefix",))).encode(), ("has suites prefix, none of alloc",)),
        (
            json.dumps(
                {"schema": "kvblocks-bench/1", "suites": {"alloc": {"ops": [{"id": 3}]}}}
            ).encode(),
            ("suite 'alloc' is malformed",),
        ),
    ],
)
def test_bad_compare_file(capsys, no_work, tmp_path, content, needles):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_bytes(content)
    line = one_line_error(capsys, ["bench", "alloc", "--compare", str(path)], "--compare", *needles)
    assert len(line) < 300


def test_compare_file_is_accepted_when_one_suite_matches(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(_doc(("alloc",))))
    assert load_baseline(str(path), ["alloc", "prefix"])["schema"] == "kvblocks-bench/1"


def test_plot_without_matplotlib(capsys, no_work, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    one_line_error(
        capsys,
        ["bench", "alloc", "--plot", str(tmp_path / "p.png")],
        "--plot needs matplotlib",
        "kvblocks[plot]",
    )


def test_plot_checks_format_and_folder(capsys, no_work, tmp_path):
    pytest.importorskip("matplotlib")
    one_line_error(capsys, ["bench", "--plot", str(tmp_path / "p.xyz")], "cannot write .xyz")
    one_line_error(capsys, ["bench", "--plot", str(tmp_path / "no" / "p.png")], "no such folder")


def test_plot_writes_a_figure(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "lat.png"
    p = bench("metadata", *TINY, "--plot", str(out))
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {out}" in p.stdout


# ---------------------------------------------------------------------------------------------
# vLLM's BlockPool (a stand-in module: vllm itself is never needed)
# ---------------------------------------------------------------------------------------------
FAKE_BLOCK_POOL = """
from kvblocks.bench.pybaseline import PyBlockPool

class BlockPool:
    def __init__(self, num_gpu_blocks, enable_caching, enable_kv_cache_events=False):
        self._p = PyBlockPool(num_gpu_blocks)

    def get_new_blocks(self, n):
        return self._p.allocate(n)

    def free_blocks(self, blocks):
        self._p.free(blocks)
"""


def fake_vllm(root: Path, source: str = FAKE_BLOCK_POOL) -> Path:
    pkg = root / "vllm"
    (pkg / "v1" / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.0.fake"\n')
    (pkg / "v1" / "__init__.py").write_text("")
    (pkg / "v1" / "core" / "__init__.py").write_text("")
    (pkg / "v1" / "core" / "block_pool.py").write_text(source)
    return root


def test_vllm_block_pool_is_timed_when_importable(tmp_path):
    e = env()
    e["PYTHONPATH"] = str(fake_vllm(tmp_path)) + ":" + e["PYTHONPATH"]
    p = bench("alloc", *TINY, "--json", "-", env=e)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["vllm_timed"] is True and "0.0.fake" in doc["baselines"]["vllm"]
    body = doc["suites"]["alloc"]
    ops = {o["id"]: o for o in body["ops"]}
    for i in ("allocate_free/n=1", "allocate_free/n=1024", "build/1M"):
        assert "vllm" in ops[i]["results"] and "vllm" in ops[i]["speedup"]
    assert "vllm" not in ops["fork_cow"]["results"]
    assert body["bytes_per_block"]["vllm"] > 0


def test_vllm_unusable_is_skipped(monkeypatch, tmp_path):
    fake_vllm(
        tmp_path,
        "class BlockPool:\n    def __init__(self, num_gpu_blocks, enable_caching, kv_cache_spec):\n"
        "        pass\n    def get_new_blocks(self, n): pass\n    def free_blocks(self, b): pass\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, m)
    make, why = vllm_pool.load()
    assert make is None and "kv_cache_spec" in why
    monkeypatch.setitem(sys.modules, "vllm", None)
    make, why = vllm_pool.load()
    assert make is None and why.startswith("vllm not installed")


def test_vllm_suite_without_vllm_is_skipped_cleanly(capsys, monkeypatch):
    """``kvblocks bench vllm`` without vLLM: one ``skipped: vllm not importable`` line on
    stdout, status 0 (tests/test_vllm_integration.py runs it with vLLM)."""
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.delitem(sys.modules, "kvblocks.bench.vllm_manager", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    assert main(["bench", "vllm", "--case", "hybrid"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("kvblocks bench vllm: skipped: vllm not importable (") and not err
    assert len(out.strip().splitlines()) == 1


def test_vllm_suite_without_vllm_in_a_fresh_process():
    p = bench("vllm")
    if "skipped" not in p.stdout:
        pytest.skip("vllm is importable here")
    assert p.returncode == 0 and "skipped: vllm not importable" in p.stdout, p.stderr


@pytest.mark.parametrize(
    "argv, needles",
    [
        (("bench", "vllm", "alloc"), ("the vllm suite runs alone",)),
        (("bench", "vllm", "--samples", "3"), ("--samples does not apply to the vllm suite",)),
        (("bench", "vllm", "--case", "mla"), ("argument --case: invalid choice",)),
        (("bench", "vllm", "--reps", "0"), ("argument --reps",)),
    ],
)
def test_vllm_suite_usage_errors(capsys, no_work, argv, needles):
    one_line_error(capsys, argv, *needles)


# ---------------------------------------------------------------------------------------------
# machine and build description
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "blob, kind, opt",
    [
        (b"\0GNU C11 12.2.0 -mtune=generic -g -O3 -O3 -std=c11 -fPIC\0", "release", "-O3"),
        (b"\0GNU C11 12.2.0 -g -O3 -O0 -std=c11 -fPIC\0__assert_fail\0", "debug", "-O0"),
        (
            b"\0GNU C11 12.2.0 -g -O0 -std=c11 -fsanitize=address,undefined\0__asan_init\0",
            "sanitizer",
            "-O0",
        ),
        (b"\0stripped\0", "release?", None),
        (b"\0stripped\0__assert_fail\0", "debug", None),
    ],
)
def test_build_kind_from_the_extension(tmp_path, blob, kind, opt):
    so = tmp_path / "_core.so"
    so.write_bytes(b"\x7fELF" + blob)
    info = detect_build(str(so))
    assert info["kind"] == kind and info["optimization"] == opt
    if kind == "sanitizer":
        assert info["sanitizers"] == ["address", "undefined"]


def test_machine_description_of_this_build():
    m = describe_machine()
    assert m["cores_logical"] >= 1 and m["cpu_model"] and m["build"]["kind"] != "unknown"


# ---------------------------------------------------------------------------------------------
# the scripts in benchmarks/ call the same code
# ---------------------------------------------------------------------------------------------
def test_bench_script_is_a_thin_caller(tmp_path):
    out = tmp_path / "m.json"  # a later --json wins over the script's benchmarks/results/ path
    script = str(ROOT / "benchmarks" / "bench_prefix.py")
    p = run_python([script, *TINY, "--no-curve", "--json", str(out), "-q"])
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert list(doc["suites"]) == ["prefix"] and doc["command"].startswith("kvblocks bench prefix")


def test_standalone_scripts_time_with_the_package_harness():
    """One timing harness: benchmarks/ has no timing module of its own."""
    from kvblocks.bench.report import table
    from kvblocks.bench.timing import measure

    assert not list((ROOT / "benchmarks").glob("_*.py"))
    r = measure(lambda: None, inner=10, repeats=5)
    assert r["samples"] == 5 and r["p50_ns"] >= 0
    assert table([{"a": 1.5, "b": None}], ["a", "b"]).splitlines()[1].split() == ["1.5", "-"]


def test_python_api():
    import kvblocks.bench as kb

    assert kb.SUITES == ("alloc", "prefix", "metadata", "groups", "tier")
    assert isinstance(kb.BenchError("x"), ValueError)
    with pytest.raises(kb.BenchError, match="unknown suite 'group'"):
        kb.run(["group"])
    assert callable(kb.run) and callable(kb.format_report)
