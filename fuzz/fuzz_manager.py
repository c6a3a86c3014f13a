#!/usr/bin/env python3
"""Coverage-guided fuzzing of BlockManager, BlockPool and kvblocks.ops against kvblocks.testing.

One fuzz input is one engine run: ``decoder.py`` turns its bytes into a configuration and a
sequence of calls, ``harness.py`` makes every call on the core and on the executable spec
(``kvblocks.testing.ReferenceManager`` / ``ReferencePool``) side by side and reads every
sequence's K/V back (``kvblocks.testing.KVReadback``); this file is the command line. The order
of calls is an engine step's (docs/engine-integration.md): schedule (add, append, fork, free,
swap_out / swap_in, reserve, truncate, hostile calls), then the drain (swap pairs ->
``ops.swap_blocks``, take_copies -> ``ops.copy_blocks``), ``metadata`` -> ``write_slots``,
``append_batch``. A broken rule raises ``Finding``: a short kind (e.g. ``kv-readback``) and the
calls that led there, as Python.

Runs:
    python fuzz/fuzz_manager.py fuzz/corpus -max_total_time=3600      # atheris (libFuzzer flags)
    python fuzz/fuzz_manager.py --replay fuzz/corpus crash-...        # replay files, no atheris
    python fuzz/fuzz_manager.py --random 20000 --seconds 120          # seeded random bytes
    python fuzz/fuzz_manager.py --minimize crash-...                  # shrink, same finding
    python fuzz/fuzz_manager.py --show crash-...                      # the trace as Python
Environment: KVB_FUZZ_IGNORE=kind,kind (findings of these kinds end the input quietly);
KVB_FUZZ_TRACE=1 prints every trace while replaying. See fuzz/README.md.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import random
import sys
import time
from typing import Dict, List, Optional, Tuple

try:
    import atheris
except ImportError:  # the replay and random modes need no atheris
    atheris = None

# an in-place build next to this folder wins over an installed kvblocks
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if glob.glob(os.path.join(_ROOT, "kvblocks", "_core*.so")):
    sys.path.insert(0, _ROOT)

from decoder import Input  # (kvblocks is not instrumented: hot and well tested)
from harness import Finding, Harness, PoolEngine

IGNORE = {k for k in os.environ.get("KVB_FUZZ_IGNORE", "").split(",") if k}


def run_input(data: bytes) -> None:
    """One fuzz input. Raises Finding unless its kind is in KVB_FUZZ_IGNORE."""
    f = _try(data)
    if f is not None and f.kind not in IGNORE:
        raise f


test_one_input = run_input  # the atheris entry


# hot checking code whose branches say nothing new about the core (and cost time)
_NOT_INSTRUMENTED = set(
    "both do same verify sync_free_order pools render finding live pick_any_id new_id "
    "tokens real room resync pcall run __init__".split()
)


def _instrument_harness() -> None:
    """Coverage of the harness's own branches (which call failed how, which rule held): the
    C core built by gcc gives libFuzzer no coverage, so these branches are its proxy."""
    for cls in (Harness, PoolEngine):
        for name, obj in list(vars(cls).items()):
            if callable(obj) and hasattr(obj, "__code__") and name not in _NOT_INSTRUMENTED:
                setattr(cls, name, atheris.instrument_func(obj))


def _inputs(paths: List[str]) -> List[str]:
    out = []
    for p in paths:
        out += sorted(glob.glob(os.path.join(p, "*"))) if os.path.isdir(p) else [p]
    return out


def _try(data: bytes) -> Optional[Finding]:
    try:
        Harness(Input(data)).run()
    except Finding as f:
        return f
    return None


def replay(paths: List[str], verbose: bool) -> int:
    found: Dict[str, Tuple[int, str, Finding]] = {}
    files = _inputs(paths)
    t0 = time.perf_counter()
    for path in files:
        data = open(path, "rb").read()
        # named first: a sanitizer report aborts the process in the middle of an input
        print(f"replay {path}", file=sys.stderr, flush=True)
        h = Harness(Input(data))
        try:
            h.run()
            if verbose or os.environ.get("KVB_FUZZ_TRACE"):
                print(f"== {path}: ok\n{h.render()}\n")
        except Finding as f:
            if f.kind not in IGNORE:
                _record(found, f, len(data), path)
    dt = time.perf_counter() - t0
    print(f"replayed {len(files)} inputs in {dt:.1f} s ({len(files) / max(dt, 1e-9):.0f}/s)")
    return _report(found)


def random_run(runs: int, seconds: float, seed: int, max_len: int, save: Optional[str]) -> int:
    """Deterministic random-bytes fuzzing (no coverage feedback): for CI without atheris."""
    rng, found, n, t0 = random.Random(seed), {}, 0, time.perf_counter()
    if save:
        os.makedirs(save, exist_ok=True)
    while n < runs and time.perf_counter() - t0 < seconds:
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(8, max_len)))
        n += 1
        if save:  # kept on disk while it runs: a sanitizer report aborts the process
            open(os.path.join(save, "last-input"), "wb").write(data)
        f = _try(data)
        if f is not None and f.kind not in IGNORE:
            name = f"random-{seed}-{n}"
            if save:
                name = os.path.join(save, "crash-" + hashlib.sha1(data).hexdigest())
                open(name, "wb").write(data)
            _record(found, f, len(data), name)
    dt = time.perf_counter() - t0
    print(f"executions: {n} in {dt:.1f} s ({n / max(dt, 1e-9):.0f} exec/s), seed {seed}")
    return _report(found)


def _record(found, f: Finding, size: int, where: str) -> None:
    if f.key not in found or size < found[f.key][0]:
        found[f.key] = (size, where, f)


def _report(found) -> int:
    if not found:
        print("no findings")
        return 0
    print(f"{len(found)} distinct findings (kind | harness op), smallest input each:")
    for key, (size, where, f) in sorted(found.items()):
        print(f"  {key}: {where} ({size} bytes)\n      {f.summary.splitlines()[0]}")
    return 1


def minimize(path: str, out: Optional[str]) -> int:
    """Shrink a failing input, keeping its finding (the same rule broken in the same op)."""
    data = open(path, "rb").read()
    f = _try(data)
    if f is None:
        print("no finding: nothing to minimize")
        return 1

    def same(cand: bytes) -> bool:
        g = _try(cand)
        return g is not None and g.key == f.key

    chunk = max(1, len(data) // 2)
    while chunk >= 1:
        i, changed = 0, False
        while i < len(data):
            if same(data[:i] + data[i + chunk :]):
                data, changed = data[:i] + data[i + chunk :], True
            else:
                i += chunk
        chunk = chunk if changed else chunk // 2
    for i in range(len(data)):  # smaller byte values decode to simpler calls
        for v in (0, 1, 2):
            if data[i] > v and same(data[:i] + bytes([v]) + data[i + 1 :]):
                data = data[:i] + bytes([v]) + data[i + 1 :]
                break
    dest = out or path + ".min"
    open(dest, "wb").write(data)
    print(f"{f.key}: {len(data)} bytes -> {dest}\n\n{_try(data)}")
    return 0


def main(argv: List[str]) -> int:
    if not any(a in argv for a in ("--replay", "--random", "--minimize", "--show")):
        if atheris is None:
            why = "atheris is not installed: use --replay FILES or --random N (fuzz/README.md)"
            return print(why, file=sys.stderr) or 2
        _instrument_harness()
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replay", nargs="+", metavar="PATH", help="run these files / folders")
    ap.add_argument("--random", type=int, metavar="N", help="run N seeded random inputs")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="time limit (--random)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=400, help="longest random input, bytes")
    ap.add_argument("--save", metavar="DIR", help="write failing random inputs here")
    ap.add_argument("--minimize", metavar="FILE", help="shrink a failing input")
    ap.add_argument("--show", metavar="FILE", help="print the trace of one input")
    ap.add_argument("-o", dest="out", help="output file of --minimize")
    ap.add_argument("-v", action="store_true", help="print the trace of every replayed input")
    args = ap.parse_args(argv[1:])
    if args.minimize:
        return minimize(args.minimize, args.out)
    if args.show:
        h = Harness(Input(open(args.show, "rb").read()))
        try:
            h.run()
            print(h.render() + "\n# ok")
        except Finding as f:
            print(f)
        return 0
    if args.replay:
        return replay(args.replay, args.v)
    return random_run(args.random, args.seconds, args.seed, args.max_len, args.save)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
