"""The text report of ``kvblocks bench``, and ``--compare`` (ratios against an earlier JSON)."""

from __future__ import annotations

import json
import os
import platform
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .errors import BenchError
from .machine import git_commit, summary_lines
from .runner import SCHEMA

__all__ = ["format_report", "load_baseline", "compare", "save", "table"]

SLOWDOWN_WARN = 1.3
_MACHINE_KEYS = ("cpu_model", "arch", "cores_logical", "python", "numpy")


def _dur(ns: Optional[float]) -> str:
    if ns is None:
        return "-"
    if ns < 1e3:
        return f"{ns:.0f} ns" if ns >= 10 else f"{ns:.1f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.3g} us" if ns < 1e5 else f"{ns / 1e3:.0f} us"
    if ns < 1e9:
        return f"{ns / 1e6:.3g} ms" if ns < 1e8 else f"{ns / 1e6:.0f} ms"
    return f"{ns / 1e9:.3g} s"


def _num(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def _ratio(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}x" if v >= 100 else (f"{v:.1f}x" if v >= 10 else f"{v:.2f}x")


def load_baseline(path: str, suites: Sequence[str]) -> dict:
    """Read and check a ``--compare`` file; BenchError (one line) when it cannot be used."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise BenchError(f"--compare {path}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise BenchError(f"--compare {path}: not a text file") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BenchError(f"--compare {path}: not JSON ({e})") from None
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != SCHEMA
        or not isinstance(doc.get("suites"), dict)
    ):
        found = doc.get("schema") if isinstance(doc, dict) else None
        what = f"schema {found!r}" if found else "no schema field"
        raise BenchError(
            f"--compare {path}: not a kvblocks bench result ({what}; expected {SCHEMA!r}, "
            "as written by 'kvblocks bench --json')"
        )
    have = [s for s in suites if s in doc["suites"]]
    if not have:
        raise BenchError(
            f"--compare {path}: has suites {', '.join(sorted(doc['suites'])) or 'none'}, "
            f"none of {', '.join(suites)}"
        )
    for s in have:
        ops = doc["suites"][s].get("ops") if isinstance(doc["suites"][s], dict) else None
        if not isinstance(ops, list) or not all(
            isinstance(o, dict)
            and isinstance(o.get("id"), str)
            and isinstance(o.get("results", {}).get("kvblocks", {}).get("p50_ns"), (int, float))
            for o in ops
        ):
            raise BenchError(
                f"--compare {path}: suite {s!r} is malformed (ops without id or kvblocks p50_ns)"
            )
    return doc


def compare(doc: dict, old: dict, path: str) -> dict:
    """Per op present in both: kvblocks p50 and p99, new over old (below 1: faster now)."""
    ops: Dict[str, dict] = {}
    missing: List[str] = []
    for suite, body in doc["suites"].items():
        before = {o["id"]: o for o in old["suites"].get(suite, {}).get("ops", [])}
        for o in body["ops"]:
            b = before.get(o["id"])
            if b is None:
                missing.append(o["id"])
                continue
            new, prev = o["results"]["kvblocks"], b["results"]["kvblocks"]
            ops[o["id"]] = {
                "p50": new["p50_ns"] / prev["p50_ns"] if prev["p50_ns"] > 0 else None,
                "p99": (
                    new["p99_ns"] / prev["p99_ns"]
                    if isinstance(prev.get("p99_ns"), (int, float)) and prev["p99_ns"] > 0
                    else None
                ),
            }
    m_new, m_old = doc.get("machine", {}), old.get("machine", {})
    differs = [k for k in _MACHINE_KEYS if m_new.get(k) != m_old.get(k)]
    kinds = (m_new.get("build", {}).get("kind"), (m_old.get("build") or {}).get("kind"))
    if kinds[0] != kinds[1]:
        differs.append("build")
    return {
        "file": path,
        "created": old.get("created"),
        "commit": m_old.get("commit"),
        "machine_differs": differs,
        "ops": ops,
        "not_in_file": missing,
        "quick": [doc["settings"]["quick"], bool(old.get("settings", {}).get("quick"))],
    }


def _table(header: List[str], rows: List[List[str]], left: int = 1) -> List[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    return [line(header)] + [line(r) for r in rows]


def format_report(doc: dict) -> str:
    """The human-readable report of a run (``doc`` from :func:`kvblocks.bench.run`)."""
    out = [
        f"kvblocks bench: {', '.join(doc['suites'])}"
        + ("  (--quick)" if doc["settings"]["quick"] else "")
    ]
    out += summary_lines(doc["machine"])
    t = doc["timing"]
    out += textwrap.wrap(f"timing    GC off; {t['overhead']}", 100, subsequent_indent=" " * 12)
    for note in (t["warmup"], t["percentiles"]):
        out += textwrap.wrap(note, 100, initial_indent=" " * 10, subsequent_indent=" " * 12)
    out.append(f"baselines python = {doc['baselines']['python']}")
    out.append(f"          vllm: {doc['baselines']['vllm']}")
    load = doc.get("load_average") or {}
    if load.get("start") and load.get("end"):
        busy = load["start"][0] >= 0.5
        line = (
            f"load      1-minute load average {load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end"
            + (
                " (other processes were busy: medians can shift between runs; same-run ratios hold "
                "better)"
                if busy
                else ""
            )
        )
        out += textwrap.wrap(line, 100, subsequent_indent=" " * 10)
    kind = doc["machine"]["build"]["kind"]
    if kind not in ("release", "release?"):
        out.append(
            f"warning   {kind} build of the extension: timings do not represent a release build"
        )
    cmp = doc.get("compare")
    if cmp:
        when = (
            f" ({cmp['created']}" + (f", commit {cmp['commit']}" if cmp.get("commit") else "") + ")"
        )
        out.append(
            f"compare   against {cmp['file']}{when}: kvblocks p50 and p99 now / then "
            "(below 1.00x: faster now)"
        )
        if cmp["machine_differs"]:
            out.append(
                f"warning   the compared file is from another machine or build "
                f"(differs: {', '.join(cmp['machine_differs'])})"
            )
        if cmp["quick"][0] != cmp["quick"][1]:
            out.append("warning   one of the two runs used --quick")
    for suite, body in doc["suites"].items():
        out.append("")
        ov = body["overhead"]
        out.append(
            f"{suite}  ({body['seconds']:.1f} s; subtracted: timer {ov['timer_overhead_ns']:.0f} ns per sample, "
            f"harness {ov['call_overhead_ns']:.1f} ns per call)"
        )
        impls: List[str] = []
        for o in body["ops"]:
            impls += [k for k in o["results"] if k != "kvblocks" and k not in impls]
        header = ["operation", "per", "p50", "p99", "ns/unit"]
        for b in impls:
            header += [f"{b} p50", f"x {b}"]
        if cmp:
            header += ["p50 now/then", "p99 now/then"]
        rows = []
        notes = []
        for o in body["ops"]:
            k = o["results"]["kvblocks"]
            r = [
                o["label"],
                o["unit"],
                _dur(k["p50_ns"]),
                _dur(k["p99_ns"]),
                _num(k["ns_per_unit"]),
            ]
            for b in impls:
                v = o["results"].get(b)
                r += [_dur(v["p50_ns"]) if v else "-", _ratio(o["speedup"].get(b)) if v else "-"]
            if cmp:
                c = cmp["ops"].get(o["id"])
                r += [_ratio(c["p50"]) if c else "new", _ratio(c["p99"]) if c else "new"]
            rows.append(r)
            if o.get("note"):
                notes.append(f"  {o['label']}: {o['note']}")
        if ov.get("probe_slowdown", 1.0) > SLOWDOWN_WARN:
            out += textwrap.wrap(
                f"warning: other processes slowed this suite: the harness probe (a fixed no-op loop "
                f"timed in every round) ran {ov['probe_slowdown']:.2f}x slower than in its quietest "
                "round; medians will not match a quiet run (same-run ratios hold better)",
                100,
                subsequent_indent="  ",
            )
        out += _table(header, rows)
        mem = body.get("bytes_per_block")
        if mem:
            parts = [f"kvblocks {mem['kvblocks']:.1f} B"]
            parts += [
                f"{k} {v:.0f} B ({v / mem['kvblocks']:.1f}x)"
                for k, v in mem.items()
                if k != "kvblocks"
            ]
            out.append(f"memory per block: {', '.join(parts)} (Python pools by tracemalloc)")
        few = [o["label"] for o in body["ops"] if o["results"]["kvblocks"]["samples"] < 100]
        if few:
            out.append(
                f"  (fewer than 100 samples, so p99 is close to the maximum: {'; '.join(few)})"
            )
        if notes:
            out.append("notes:")
            out += notes
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# the standalone scripts (benchmarks/): a plain table and a JSON of rows beside the script
# ---------------------------------------------------------------------------------------------
def save(
    name: str, rows: list, extra: Optional[dict] = None, results: Optional[Path] = None
) -> Path:
    """Write ``rows`` (with the commit, the machine and the timer overhead) as
    ``results/<name>.json``; ``results`` defaults to the folder beside the running script."""
    from .timing import timer_overhead_ns

    if results is None:
        results = Path(sys.argv[0]).resolve().parent / "results"
    results.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": name,
        "commit": (git_commit() or "unknown").split("+", 1)[0],
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "timer_overhead_ns": timer_overhead_ns(),
        "rows": rows,
        **(extra or {}),
    }
    path = results / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def table(rows: list, cols: list) -> str:
    """Rows (dicts) as right-aligned columns; floats with one decimal, None as ``-``."""
    widths = [max(len(c), *(len(_cell(r.get(c))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append("  ".join(_cell(r.get(c)).rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)
