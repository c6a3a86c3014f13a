"""``kvblocks bench``: allocation-latency microbenchmarks for your own hardware.

Suites ``alloc``, ``prefix``, ``metadata``, ``groups`` and ``tier`` (``all`` for the five)
time kvblocks' allocator and, in the same run and the same harness, a bundled pure-Python
vLLM-style block pool (:mod:`kvblocks.bench.pybaseline`), numpy metadata builders, vLLM's own
``BlockPool`` when ``vllm`` is importable, and the same calls with one KV cache group
(``groups``) or without a host tier (``tier``). For every operation: p50, p99 and ns per block or per call, with the
timer overhead measured and subtracted and GC off (method: :mod:`kvblocks.bench.timing`).

From Python::

    from kvblocks.bench import run, format_report
    res = run(["alloc"], quick=True)
    print(format_report(res.doc))       # res.doc is what ``--json`` writes

The command line (``kvblocks bench``) lives in :mod:`kvblocks.bench.cli`; the JSON schema,
reading p50/p99 and a results table are in docs/benchmarking.md.
"""

from __future__ import annotations

from .errors import BenchError

__all__ = ["BenchError", "BenchRun", "SUITES", "run", "format_report"]


def __getattr__(name: str):  # the suites import kvblocks' core and numpy only when used
    if name in ("run", "BenchRun", "SUITES"):
        from . import runner

        return getattr(runner, name)
    if name == "format_report":
        from .report import format_report

        return format_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
