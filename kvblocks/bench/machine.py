"""The machine and the build a benchmark ran on, so results can be compared across machines.

The build kind (release, debug, sanitizer) is read from the compiled extension itself, with no
help from the core: GCC records the compiler flags in the debug info it writes by default
(``DW_AT_producer``, e.g. ``GNU C11 12.2.0 ... -g -O3 -std=c11``; the last ``-O`` wins); a build
with C assertions on (``KVBLOCKS_DEBUG``) imports ``__assert_fail`` (``__assert_rtn`` on macOS),
which ``-DNDEBUG`` compiles away; a sanitizer build links the ASan/UBSan runtimes. A stripped
extension keeps the last two signals only, so its optimisation level reads "unknown".
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["describe_machine", "detect_build", "git_commit"]

_PRODUCER = re.compile(rb"(GNU C[\w+]* [0-9][\w.]*[^\x00\n]{0,600}|clang version [^\x00\n]{0,300})")


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for key in ("model name", "Model", "Hardware", "cpu model", "Processor"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.M)
        if m and m.group(1).strip():
            return m.group(1).strip()
    if sys.platform == "darwin":
        try:
            return subprocess.check_output(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                text=True,
                stderr=subprocess.DEVNULL,
                timeout=5,
            ).strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def _physical_cores() -> Optional[int]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    pairs = set()
    phys = core = None
    for line in text.splitlines() + [""]:
        if line.startswith("physical id"):
            phys = line.split(":", 1)[1].strip()
        elif line.startswith("core id"):
            core = line.split(":", 1)[1].strip()
        elif not line.strip():
            if core is not None:
                pairs.add((phys, core))
            phys = core = None
    return len(pairs) or None


def git_commit() -> Optional[str]:
    """The commit of the kvblocks source tree imported, if it is a git checkout."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            text=True,
            stderr=subprocess.DEVNULL,
            timeout=10,
        ).strip()
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD", "--", "csrc", "kvblocks"],
            cwd=root,
            stderr=subprocess.DEVNULL,
            timeout=10,
        ).returncode
        return out + ("+dirty" if dirty == 1 else "")
    except (OSError, subprocess.SubprocessError):
        return None


def detect_build(path: Optional[str] = None) -> Dict[str, object]:
    """Build kind of the extension ``kvblocks._core`` (or the shared object at ``path``)."""
    own = path is None
    if path is None:
        from .. import _core

        path = _core.__file__
    info: Dict[str, object] = {
        "extension": os.path.basename(str(path)),
        "kind": "unknown",
        "optimization": None,
        "assertions": None,
        "sanitizers": [],
        "compiler": None,
    }
    try:
        data = Path(str(path)).read_bytes()
    except OSError as e:
        info["detected_from"] = f"unreadable extension ({e.strerror})"
        return info
    producers = [m.decode("utf-8", "replace") for m in _PRODUCER.findall(data)]
    # our C sources are compiled with -std=c11; prefer that producer over library objects
    ours = [p for p in producers if "-std=c11" in p] or producers
    opt = None
    sanitizers: List[str] = []
    if ours:
        p = ours[0]
        info["compiler"] = p.split(" -", 1)[0]
        levels = re.findall(r"(?:^|\s)(-O[0-3sgz]?|-Ofast)(?=\s|$)", p)
        opt = levels[-1] if levels else None
        for m in re.findall(r"-fsanitize=([\w,-]+)", p):
            sanitizers += [x for x in m.split(",") if x and x not in sanitizers]
    for marker, name in (
        (b"__asan_init", "address"),
        (b"__ubsan_handle", "undefined"),
        (b"__tsan_init", "thread"),
        (b"__msan_init", "memory"),
    ):
        if marker in data and name not in sanitizers:
            sanitizers.append(name)
    assertions = b"__assert_fail" in data or b"__assert_rtn" in data or b"_wassert" in data
    info.update(optimization=opt, assertions=assertions, sanitizers=sanitizers)
    info["debug_level"] = None
    if own:  # the running build records its debug level (0 release, 1 assertions, 2 + checks)
        try:
            from .. import _core

            info["debug_level"] = int(_core.BUILD_DEBUG_LEVEL)
        except (ImportError, AttributeError):
            pass
    if info["debug_level"]:
        assertions = True
    if sanitizers:
        kind = "sanitizer"
    elif assertions or opt in ("-O0", "-Og"):
        kind = "debug"
    elif opt is not None:
        kind = "release"
    elif info["debug_level"] == 0:
        kind = "release"  # recorded by the build itself (the flags were stripped)
    else:
        kind = "release?"  # no assertions, optimisation level not recorded (stripped)
    info["kind"] = kind
    info["detected_from"] = (
        "compiler flags in the extension's debug info"
        if ours
        else "imported symbols only (no compiler flags recorded)"
    )
    return info


def describe_machine() -> Dict[str, object]:
    """CPU, cores, OS, Python, numpy, kvblocks and its build, as a JSON-ready dict."""
    import numpy as np

    from .. import __version__

    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return {
        "cpu_model": _cpu_model(),
        "arch": platform.machine(),
        "cores_logical": os.cpu_count(),
        "cores_physical": _physical_cores(),
        "cores_usable": usable,
        "os": platform.platform(terse=True),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": np.__version__,
        "kvblocks": __version__,
        "commit": git_commit(),
        "build": detect_build(),
    }


def summary_lines(m: Dict[str, object]) -> List[str]:
    """Two lines for the text report."""
    b = m["build"]
    assert isinstance(b, dict)
    cores = f"{m['cores_logical']} logical cores"
    if m.get("cores_physical"):
        cores += f" ({m['cores_physical']} physical)"
    if m.get("cores_usable") not in (None, m["cores_logical"]):
        cores += f", {m['cores_usable']} usable"
    flags = ", ".join(
        x
        for x in (
            b.get("optimization") or "optimisation unknown",
            "assertions on" if b.get("assertions") else "assertions off",
            ("sanitizers: " + "+".join(b["sanitizers"])) if b.get("sanitizers") else "",
        )
        if x
    )
    commit = f", commit {m['commit']}" if m.get("commit") else ""
    return [
        f"machine   {m['cpu_model']} ({m['arch']}), {cores}; {m['os']}",
        (
            f"software  {m['python']}, numpy {m['numpy']}, kvblocks {m['kvblocks']}{commit}, "
            f"{b['kind']} build ({flags})"
        ),
    ]
