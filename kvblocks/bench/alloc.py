"""Suite ``alloc``: allocate+free at several sizes, fork with copy-on-write, the batched decode
step (``append_batch``, list of ids and SeqBatch, and with block fills), building a 1M-block
pool, and memory per block. Baselines: the bundled pure-Python pool (:mod:`.pybaseline`) and,
when importable, vLLM's own ``BlockPool`` (allocate+free, build, memory).
"""

from __future__ import annotations

import ctypes
import tracemalloc
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .._core import BlockManager, BlockPool
from .pybaseline import PyBlockPool, PySeqTables
from .timing import Case, Op, Settings

__all__ = ["build"]

SIZES = (1, 16, 128, 1024)
NSEQ = 256
BS = 16
BUILD_BLOCKS = 1_000_000
MEMORY_BLOCKS = 1 << 16  # Python pools are measured with tracemalloc at this size


def _alloc_free(vllm: Optional[Callable[[int], Any]]) -> List[Op]:
    pool = BlockPool(1 << 16, enable_prefix_caching=True)
    py = PyBlockPool(1 << 16)
    vp = vllm(1 << 16) if vllm else None
    ops = []
    for n in SIZES:
        cases = [
            Case("kvblocks", lambda n=n: pool.free(pool.allocate(n))),  # type: ignore[misc]
            Case("python", lambda n=n: py.free(py.allocate(n))),  # type: ignore[misc]
        ]
        if vp is not None:
            cases.append(Case("vllm", lambda n=n: vp.free_blocks(vp.get_new_blocks(n))))  # type: ignore[misc]  # mypy cannot type a lambda with defaults
        ops.append(Op(f"allocate_free/n={n}", f"allocate+free n={n}", "block", n, cases))
    one = [  # the scalar path: an int in and out, no one-element array
        Case("kvblocks", lambda: pool.free_one(pool.allocate_one())),
        Case("python", lambda: py.free(py.allocate(1))),
    ]
    if vp is not None:
        one.append(Case("vllm", lambda: vp.free_blocks(vp.get_new_blocks(1))))
    ops.append(Op("allocate_free/one", "allocate_one+free_one", "block", 1, one))
    return ops


def _fork_cow() -> Op:
    mgr = BlockManager(4096, BS)
    prompt = np.arange(100, dtype=np.int32)
    mgr.add("p", prompt)
    mgr.schedule(["p"], [100])
    one = np.array([7], dtype=np.int32)

    def cycle():
        mgr.fork("p", "c")
        mgr.append("c", one)  # into the shared, partly filled last block: copy-on-write
        mgr.take_copies()
        mgr.free("c")

    tables = PySeqTables(PyBlockPool(4096), BS)
    tables.add("p", prompt.tolist())

    def pycycle():
        tables.fork("p", "c")
        tables.append("c", 7)
        tables.take_copies()
        tables.free("c")

    return Op(
        "fork_cow",
        "fork + copy-on-write append + free",
        "call",
        1,
        [Case("kvblocks", cycle), Case("python", pycycle)],
    )


def _append_batch() -> List[Op]:
    ids = list(range(NSEQ))
    steps = BS - 1  # fill the reserved block short of full: no boundary crossed, no hashing
    mgr = BlockManager(NSEQ * 8 + 1, BS)
    tables = PySeqTables(PyBlockPool(NSEQ * 8 + 1), BS)
    for i in ids:
        prompt = np.arange(i, i + 3 * BS, dtype=np.int32)  # block-aligned: 3 full blocks
        mgr.add(i, prompt)
        mgr.reserve(i, BS)  # room for one block of decode
        tables.add(i, prompt.tolist())
        tables.reserve(i, BS)
    mgr.schedule(ids, [3 * BS] * NSEQ)
    toks = np.arange(NSEQ, dtype=np.int32)
    pytoks = toks.tolist()
    batch = mgr.batch(ids)

    def reset():
        for i in ids:
            mgr.truncate(i, 3 * BS)
            mgr.reserve(i, BS)

    def pyreset():
        for i in ids:
            tables.truncate(i, 3 * BS)
            tables.reserve(i, BS)

    py = Case("python", lambda: tables.append_batch(ids, pytoks), inner=steps, teardown=pyreset)
    ops = [
        Op(
            "append_batch/list",
            f"append_batch {NSEQ} seqs (list of ids)",
            "seq",
            NSEQ,
            [
                Case("kvblocks", lambda: mgr.append_batch(ids, toks), inner=steps, teardown=reset),
                py,
            ],
        ),
        Op(
            "append_batch/seqbatch",
            f"append_batch {NSEQ} seqs (SeqBatch)",
            "seq",
            NSEQ,
            [
                Case(
                    "kvblocks", lambda: mgr.append_batch(batch, toks), inner=steps, teardown=reset
                ),
                py,
            ],
        ),
    ]

    # decode steps over one block's worth of tokens: each sequence crosses a boundary, its
    # filled block is hashed and (once the step is scheduled) cached; fresh tokens every sample
    fill = BS
    mgr2 = BlockManager(NSEQ * 40 + 1, BS)
    tables2 = PySeqTables(PyBlockPool(NSEQ * 40 + 1), BS)
    for i in ids:
        prompt = np.arange(i, i + 3 * BS, dtype=np.int32)
        mgr2.add(i, prompt)
        tables2.add(i, prompt.tolist())
    b2 = mgr2.batch(ids)
    mgr2.schedule(b2, [3 * BS] * NSEQ)
    ones = np.ones(NSEQ, dtype=np.int32)
    rng = np.random.default_rng(0)
    state: Dict[str, Any] = {
        "rows": list(rng.integers(0, 32000, (fill, NSEQ), dtype=np.int32)),
        "k": 0,
    }
    pystate = {"rows": [r.tolist() for r in state["rows"]], "k": 0}

    def step():
        k = state["k"]
        state["k"] = k + 1
        mgr2.append_batch(b2, state["rows"][k])
        mgr2.schedule(b2, ones)

    def reset2():
        for i in ids:
            mgr2.truncate(i, 3 * BS)
        state["rows"] = list(rng.integers(0, 32000, (fill, NSEQ), dtype=np.int32))
        state["k"] = 0

    def pystep():
        k = pystate["k"]
        pystate["k"] = k + 1
        tables2.append_batch(ids, pystate["rows"][k])

    def pyreset2():
        for i in ids:
            tables2.truncate(i, 3 * BS)
        pystate["rows"] = rng.integers(0, 32000, (fill, NSEQ), dtype=np.int32).tolist()
        pystate["k"] = 0

    ops.append(
        Op(
            "decode_step/fills",
            f"append_batch+schedule {NSEQ} seqs (block fills)",
            "seq",
            NSEQ,
            [
                Case("kvblocks", step, inner=fill, teardown=reset2),
                Case("python", pystep, inner=fill, teardown=pyreset2),
            ],
            note="a decode step crossing block boundaries: each filled block is hashed and, "
            "once scheduled, cached (python: SHA-256 on fill)",
        )
    )
    return ops


def _fresh_memory() -> Callable[[], object]:
    """Between builds: give freed memory back to the OS (glibc), so that each build pays its
    page faults like a first build instead of reusing pages the last one touched."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


def _build(s: Settings, vllm: Optional[Callable[[int], object]]) -> Op:
    release = _fresh_memory()

    def case(impl, make, samples):
        held: list = []

        def teardown():
            held.clear()
            release()

        return Case(
            impl,
            lambda: held.append(make(BUILD_BLOCKS + 1)),
            inner=1,
            teardown=teardown,
            samples=samples,
            min_samples=1,
            warmup=False,
        )

    cases = [
        case("kvblocks", BlockPool, 3 if s.quick else 15),
        case("python", PyBlockPool, 1 if s.quick else 5),
    ]
    if vllm:
        cases.append(case("vllm", vllm, 1 if s.quick else 5))
    return Op(
        "build/1M",
        "build a 1,000,000-block pool",
        "block",
        BUILD_BLOCKS,
        cases,
        note="timed cold: no warm-up, freed memory returned to the OS between builds (glibc), "
        "so page faults count; GC off, which spares the Python pools collections",
    )


def _python_bytes(make: Callable[[int], object]) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = make(MEMORY_BLOCKS + 1)
        used = tracemalloc.get_traced_memory()[0] - before
        del pool
    finally:
        tracemalloc.stop()
    return used / (MEMORY_BLOCKS + 1)


def memory(vllm: Optional[Callable[[int], object]]) -> Dict[str, float]:
    """Bytes of allocator metadata per block (the Python pools by tracemalloc, 65,537 blocks)."""
    pool = BlockPool(BUILD_BLOCKS + 1)
    out = {"kvblocks": pool.metadata_bytes / pool.num_blocks, "python": _python_bytes(PyBlockPool)}
    if vllm:
        out["vllm"] = _python_bytes(vllm)
    return out


def build(s: Settings, vllm: Optional[Callable[[int], Any]]) -> Tuple[List[Op], dict]:
    """The ops of the suite and its untimed facts (bytes per block)."""
    ops = _alloc_free(vllm) + [_fork_cow()] + _append_batch() + [_build(s, vllm)]
    return ops, {"bytes_per_block": memory(vllm)}
