"""Running Python in a subprocess against the kvblocks this test session imported.

The source tree has no compiled core unless built in place, so a child must not pick up
``kvblocks/`` from the current directory: it runs in a neutral directory with PYTHONPATH set
to wherever the parent's kvblocks lives (site-packages or an in-place build).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import kvblocks

KVBLOCKS_HOME = str(Path(kvblocks.__file__).resolve().parents[1])
_NEUTRAL = tempfile.mkdtemp(prefix="kvblocks-subproc-")


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = KVBLOCKS_HOME + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def run_python(args, **kw) -> subprocess.CompletedProcess:
    """``python *args`` with the session's kvblocks, in a neutral working directory."""
    kw.setdefault("cwd", _NEUTRAL)
    kw.setdefault("env", env())
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, **kw)
