"""libkvblocks, the C library (docs/c-api.md): the CMake build, the public header as C11 and
C++17, the exported names, install + pkg-config, and the C and Rust toy engines reading every
sequence's K/V back after each step. Skipped where cmake or a C compiler is missing (cargo
for the Rust engine, abidiff for the ABI check); .ci/capi runs the same under ASan + UBSan."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "include" / "kvblocks.h"
CC = shutil.which("cc") or shutil.which("gcc")
CXX = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(
    not (ROOT / "CMakeLists.txt").exists() or not shutil.which("cmake") or CC is None,
    reason="needs the source tree, cmake and a C compiler",
)


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """A release build of the library and the C examples, installed under build/prefix."""
    out = tmp_path_factory.mktemp("capi")
    _run("cmake", "-S", ROOT, "-B", out / "build", "-DCMAKE_BUILD_TYPE=Release")
    _run("cmake", "--build", out / "build", "-j", str(min(os.cpu_count() or 2, 4)))
    _run("cmake", "--install", out / "build", "--prefix", out / "prefix")
    return out


def _public_names() -> list[str]:
    return sorted(re.findall(r"KVB_API [^(]*?\b(kvb_\w+)\(", HEADER.read_text()))


def test_header_compiles_alone_as_c11_and_cxx17(tmp_path):
    src = tmp_path / "h.c"
    src.write_text(
        "#include <kvblocks.h>\n"
        "int main(void) { return kvb_version(0, 0, 0) != KVBLOCKS_ABI_VERSION; }\n"
    )
    flags = ["-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{HEADER.parent}", "-c"]
    _run(CC, "-std=c11", *flags, src, "-o", tmp_path / "h.o")
    if CXX is not None:
        _run(CXX, "-std=c++17", *flags, "-x", "c++", src, "-o", tmp_path / "hpp.o")


def test_only_the_public_names_are_exported_at_kvblocks_1(build):
    so = build / "build" / "libkvblocks.so"
    soname = _run("readelf", "-d", so).stdout
    assert "[libkvblocks.so.1]" in soname
    syms = _run("nm", "-D", "--defined-only", so).stdout.split()
    exported = sorted(s.split("@@")[0] for s in syms if s.startswith("kvb_"))
    assert all(s.endswith("@@KVBLOCKS_1") for s in syms if s.startswith("kvb_"))
    assert exported == _public_names()
    mapped = re.findall(r"^\s*(kvb_\w+);", (ROOT / "cmake" / "libkvblocks.map").read_text(), re.M)
    assert sorted(mapped) == exported


def test_c_toy_engine_reads_back_its_kv(build):
    r = _run(build / "build" / "toy_engine", "300", "5")
    assert r.stdout.rstrip().endswith(": OK")
    assert " 0 forks" not in r.stdout and " 0 swaps" not in r.stdout
    assert " 0 accepted drafts" not in r.stdout and " 0 cached prompt tokens" not in r.stdout


def test_c_toy_engine_with_the_host_tier(build):
    """Features 31: evicted blocks demoted to the host, prompts continuing there; the drain
    runs offloads, onloads, swap pairs and copies in that order."""
    r = _run(build / "build" / "toy_engine", "400", "2", "31")
    assert r.stdout.rstrip().endswith(": OK")
    assert " 0 offloads" not in r.stdout and " 0 onloads" not in r.stdout


def test_the_api_contract(build):
    """tests/c/capi_contract.c: hostile arguments, short buffers, all-or-nothing, per-handle
    error detail, managers on several threads at once."""
    assert _run(build / "build" / "capi_contract").stdout.strip() == "capi_contract: OK"


@pytest.mark.skipif(shutil.which("pkg-config") is None, reason="needs pkg-config")
def test_pkg_config_finds_the_installed_library(build, tmp_path):
    (pc,) = (build / "prefix").rglob("kvblocks.pc")
    env = dict(os.environ, PKG_CONFIG_PATH=str(pc.parent))
    flags = _run("pkg-config", "--cflags", "--libs", "kvblocks", env=env).stdout.split()
    libdir = _run("pkg-config", "--variable=libdir", "kvblocks", env=env).stdout.strip()
    exe = tmp_path / "toy"
    src = ROOT / "examples" / "c" / "toy_engine.c"
    _run(
        CC,
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        src,
        *flags,
        f"-Wl,-rpath,{libdir}",
        "-o",
        exe,
    )
    assert _run(exe, "100", "3").stdout.rstrip().endswith(": OK")
    static = tmp_path / "toy_static"
    cflags = _run("pkg-config", "--cflags", "kvblocks", env=env).stdout.split()
    _run(CC, "-std=c11", src, *cflags, Path(libdir) / "libkvblocks.a", "-o", static)
    assert _run(static, "100", "4").stdout.rstrip().endswith(": OK")


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo")
def test_rust_toy_engine_reads_back_its_kv(build):
    env = dict(
        os.environ, KVBLOCKS_LIB_DIR=str(build / "build"), CARGO_TARGET_DIR=str(build / "cargo")
    )
    _run(
        "cargo",
        "build",
        "-q",
        "--release",
        "--offline",
        "--manifest-path",
        ROOT / "examples" / "rust" / "Cargo.toml",
        env=env,
    )
    r = _run(build / "cargo" / "release" / "toy_engine", "300", "5")
    assert r.stdout.rstrip().endswith(": OK")
    assert " 0 forks" not in r.stdout and " 0 rollbacks" not in r.stdout


class _Replay:
    """Random op sequences run through the Python BlockManager, each op's observation the
    line ``toy_engine --replay`` (examples/rust/src/replay.rs) prints for it."""

    CLASSES = (
        ("oob", "OutOfBlocksError"),
        ("unknown", "UnknownSequenceError"),
        ("state", "InvalidStateError"),
        ("arg", "InvalidArgumentError"),
        ("arg", "DuplicateSequenceError"),
    )

    def __init__(self, seed: int) -> None:
        import random

        import kvblocks

        self.kvb = kvblocks
        self.rng = random.Random(seed)
        r = self.rng
        self.cfg = (r.randint(6, 24), r.randint(1, 4), r.choice([0, 8, 16, 24]))
        self.mgr = kvblocks.BlockManager(self.cfg[0], self.cfg[1], num_host_blocks=self.cfg[2])
        self.script = [f"new {self.cfg[0]} {self.cfg[1]} {self.cfg[2]}"]
        self.expected = ["new"]

    def _toks(self, n: int) -> list:
        return [self.rng.randint(1, 3) for _ in range(n)]

    def _pick(self) -> str:
        live = sorted(self.mgr.seq_ids(), key=str)
        return self.rng.choice(live) if live and self.rng.random() < 0.9 else "zz"

    @staticmethod
    def _csv(xs) -> str:
        return ",".join(str(x) for x in xs) if len(xs) else "-"

    @staticmethod
    def _pairs(p) -> str:
        return ",".join(f"{a}>{b}" for a, b in p.tolist()) if len(p) else "-"

    def step(self) -> None:
        r, m = self.rng, self.mgr
        op = r.choice(["add", "add", "append", "batch", "batch", "reserve", "truncate", "fork",
                       "free", "out", "in", "sched", "sched", "copies"])  # fmt: skip
        i = self._pick()
        if op == "add":
            i = r.choice("abcdefgh")
            line, call = f"add {i} {{}}", None
            toks = [1, 2, 3, 1][: r.randint(0, 4)] + self._toks(r.randint(0, 6))
            line, call = f"add {i} {self._csv(toks)}", lambda: f"ok {m.add(i, toks)}"
        elif op == "append":
            toks = self._toks(r.randint(0, 5))
            line, call = f"append {i} {self._csv(toks)}", lambda: m.append(i, toks) or "ok"
        elif op == "batch":
            live = sorted(m.seq_ids(), key=str)
            ids = r.sample(live, min(len(live), r.randint(1, 3))) if live else ["zz"]
            toks = self._toks(len(ids))
            line = f"batch {self._csv(ids)} {self._csv(toks)}"
            call = lambda: m.append_batch(ids, toks) or "ok"  # noqa: E731
        elif op == "reserve":
            n = r.randint(0, 5)
            line, call = f"reserve {i} {n}", lambda: m.reserve(i, n) or "ok"
        elif op == "truncate":
            n = r.randint(0, m.num_tokens(i) + 1) if i in m else 1
            line, call = f"truncate {i} {n}", lambda: m.truncate(i, n) or "ok"
        elif op == "fork":
            c = r.choice("abcdefgh")
            line, call = f"fork {i} {c}", lambda: m.fork(i, c) or "ok"
        elif op == "free":
            line, call = f"free {i}", lambda: m.free(i) or "ok"
        elif op in ("out", "in"):
            f = m.swap_out if op == "out" else m.swap_in
            line, call = f"{op} {i}", lambda: f"ok {self._pairs(f(i))}"
        elif op == "sched":
            live = sorted(m.seq_ids(), key=str)
            ids = r.sample(live, min(len(live), r.randint(1, 3))) if live else []
            q = [max(0, m.num_tokens(s) - m.num_computed(s) + r.choice([0, 0, 0, 1, -1]))
                 for s in ids]  # fmt: skip
            line, call = (
                f"sched {self._csv(ids)} {self._csv(q)}",
                lambda: m.schedule(ids, q) or "ok",
            )
        else:
            line, call = "copies", lambda: f"ok {self._pairs(m.take_copies())}"
        try:
            res = call()
        except self.kvb.KVBlocksError as e:
            names = {type(e).__name__} | {c.__name__ for c in type(e).__mro__}
            res = "err " + next((c for c, n in self.CLASSES if n in names), "other")
        state = " ".join(
            f"{s}:{m.num_tokens(s)}:{m.num_computed(s)}:"
            f"{'.'.join(str(b) for b in m.block_table(s).tolist())}:{int(m.is_swapped(s))}"
            for s in sorted(m.seq_ids(), key=str)
        )
        self.script.append(line)
        self.expected.append(f"{res} | {state} copies={m.num_pending_copies}")


@pytest.mark.skipif(shutil.which("cargo") is None, reason="needs cargo")
def test_rust_replays_op_sequences_as_the_python_binding_does(build):
    """The same core through two bindings: 300 random op sequences (adds with shared
    prefixes, appends, decode batches, reserve, truncate, fork, free, swap, steps, copies)
    give the same results, block tables, computed counts and copy pairs from Rust (C API)
    as from Python, op by op."""
    env = dict(os.environ, KVBLOCKS_LIB_DIR=str(build / "build"),
               CARGO_TARGET_DIR=str(build / "cargo"))  # fmt: skip
    _run("cargo", "build", "-q", "--release", "--offline", "--manifest-path",
         ROOT / "examples" / "rust" / "Cargo.toml", env=env)  # fmt: skip
    script, expected = [], []
    for seed in range(300):
        rp = _Replay(seed)
        for _ in range(40):
            rp.step()
        script += rp.script
        expected += rp.expected
    r = subprocess.run([str(build / "cargo" / "release" / "toy_engine"), "--replay"],
                       input="\n".join(script) + "\n", capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = r.stdout.splitlines()
    assert len(got) == len(expected)
    for k, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"op {k}: {script[k]}\n  rust:   {g}\n  python: {e}"


@pytest.mark.skipif(shutil.which("abidiff") is None, reason="needs abidiff (abigail-tools)")
def test_abi_matches_the_baseline(build):
    """abi/check.sh builds with debug info (the types come from DWARF) and compares with the
    checked-in baseline of the header's ABI version."""
    r = _run(ROOT / "abi" / "check.sh")
    assert "is compatible with" in r.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
@pytest.mark.parametrize("cu", sorted((ROOT / "kvblocks" / "cuda").glob("*.cu")), ids=str)
def test_cuda_kernels_compile_ahead_of_time_for_sm80_and_sm90(cu, tmp_path):
    """The kernels NVRTC compiles at first use also compile offline, warnings as errors, so
    a kernel that does not compile is caught on a machine without a GPU."""
    _run(
        "nvcc",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        "-Xcompiler",
        "-Wall,-Werror",
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=sm_90",
        "-fatbin",
        cu,
        "-o",
        tmp_path / "k.fatbin",
    )
    assert (tmp_path / "k.fatbin").stat().st_size > 0


def test_the_c_api_guide_example_runs(build, tmp_path):
    """docs/c-api.md: its complete example compiles (-Werror) against the built library and
    runs: the second prompt reuses the first one's two full blocks."""
    guide = (ROOT / "docs" / "c-api.md").read_text()
    example = guide[guide.index("## A complete example") :]  # (the sections above hold snippets)
    code = re.findall(r"```c\n(.*?)```", example, re.S)[0]
    src = tmp_path / "example.c"
    src.write_text(code)
    exe = tmp_path / "example"
    lib = build / "build"
    _run(
        CC,
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{HEADER.parent}",
        src,
        f"-L{lib}",
        "-lkvblocks",
        f"-Wl,-rpath,{lib}",
        "-o",
        exe,
    )
    out = _run(exe).stdout
    assert "cached prefix of the second prompt: 8 tokens" in out
