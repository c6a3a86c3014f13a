"""``kvblocks config``: the flags that build a C engine against the libkvblocks the package
vendors (kvblocks/include/kvblocks.h, kvblocks/_libkvblocks*.so; docs/c-api.md)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from kvblocks import clib

ROOT = Path(__file__).resolve().parents[1]
CC = shutil.which("cc") or shutil.which("gcc")


def _vendored() -> bool:
    try:
        clib.include_dir(), clib.library_path()
    except Exception:
        return False
    return True


pytestmark = pytest.mark.skipif(not _vendored(), reason="kvblocks built without its C library")


def test_config_prints_cflags_and_libs(run_main):
    rc, out, _ = run_main("config", "--cflags", "--libs")
    assert rc == 0
    flags = shlex.split(out)
    assert flags[0] == f"-I{clib.include_dir()}"
    assert f"-l:{clib.library_path().name}" in flags
    assert run_main("config")[1] == out  # both by default
    rc, out, _ = run_main("config", "--include-dir")
    assert Path(out.strip()) / "kvblocks.h" == clib.include_dir() / "kvblocks.h"


def test_the_vendored_header_is_the_public_one():
    assert (clib.include_dir() / "kvblocks.h").read_bytes() == (
        ROOT / "include" / "kvblocks.h"
    ).read_bytes()


def test_the_vendored_library_exports_only_the_public_api():
    if shutil.which("nm") is None:
        pytest.skip("needs nm")
    out = subprocess.run(["nm", "-D", "--defined-only", str(clib.library_path())],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if " T " in line}
    assert names and all(n.startswith("kvb_") for n in names)
    assert "kvb_manager_new" in names and "kvb_mgr_add" not in names


@pytest.mark.skipif(CC is None or not (ROOT / "examples").is_dir(), reason="needs cc, source tree")
def test_an_engine_builds_and_runs_with_the_flags(tmp_path, run_main):
    _, out, _ = run_main("config", "--cflags", "--libs")
    exe = tmp_path / "toy"
    subprocess.run([CC, "-std=c11", str(ROOT / "examples" / "c" / "toy_engine.c"),
                    *shlex.split(out), "-o", str(exe)], check=True)  # fmt: skip
    r = subprocess.run([str(exe), "100", "2"], capture_output=True, text=True, check=True)
    assert r.stdout.rstrip().endswith(": OK")
