"""Suite ``prefix``: hashing a 32K-token prompt (in each hash mode), lookup and
lookup-and-pin of 2,048 cached blocks, and allocation that evicts cached blocks. Baseline:
the bundled pure-Python pool (SHA-256 block hashes, a dict from hash to block,
:mod:`.pybaseline`).
"""

from __future__ import annotations

import hashlib
from typing import Callable, List, Optional, Tuple

import numpy as np

from .._core import HASH_ALGOS, BlockPool, hash_blocks
from .pybaseline import PyBlockPool, sha256_block_hashes
from .timing import Case, Op, Settings

__all__ = ["build"]

BS = 16
PROMPT = 32768
LOOKUP = 2048
EVICT_N, EVICT_TOTAL, EVICT_INNER = 128, 4096, 16


def _hash() -> Op:
    toks = np.random.default_rng(0).integers(0, 128000, PROMPT, dtype=np.int32)
    lst = toks.tolist()
    n = PROMPT // BS
    return Op(
        "hash_blocks/32k",
        f"hash a {PROMPT:,}-token prompt ({n:,} blocks)",
        "block",
        n,
        [
            Case("kvblocks", lambda: hash_blocks(toks, BS)),
            Case("python", lambda: sha256_block_hashes(lst, BS)),
        ],
        note="kvblocks: keyed SipHash-128; python: SHA-256 of pickled (parent, tokens)",
    )


def _hash_modes() -> List[Op]:
    """ns per block of each hash mode over the same prompt, against Python doing the same
    (vLLM's own hashing is Python: SHA-256 of each block's serialized tuple)."""
    toks = np.random.default_rng(0).integers(0, 128000, PROMPT, dtype=np.int32)
    lst = toks.tolist()
    n = PROMPT // BS
    ops = []
    py_sglang: Callable[[], object] = lambda: _py_sglang(toks, BS)
    py_vllm: Callable[[], object] = lambda: sha256_block_hashes(lst, BS)
    for algo in HASH_ALGOS[1:]:
        seed = "0" if algo.startswith("vllm") else None

        def ours(a: str = algo, s: Optional[str] = seed) -> object:
            return hash_blocks(toks, BS, algo=a, seed=s)

        if algo == "sglang_sha256":
            py, note = py_sglang, "python: hashlib.sha256(parent digest + tokens) per page"
        else:
            py, note = py_vllm, "python: SHA-256 of pickled (parent, tokens, None) (vLLM)"
        ops.append(
            Op(
                f"hash_blocks/32k/{algo}",
                f"hash a {PROMPT:,}-token prompt, {algo}",
                "block",
                n,
                [Case("kvblocks", ours), Case("python", py)],
                note=note,
            )
        )
    return ops


def _py_sglang(toks: np.ndarray, bs: int) -> list:
    raw = toks.astype("<u4").tobytes()
    out, parent = [], b""
    for i in range(len(toks) // bs):
        parent = hashlib.sha256(parent + raw[4 * i * bs : 4 * (i + 1) * bs]).digest()
        out.append(parent)
    return out


def _lookup() -> List[Op]:
    n = LOOKUP
    pool = BlockPool(n + 1)
    h = hash_blocks(np.arange(n * BS, dtype=np.int32), BS)
    ids = pool.allocate(n)
    pool.cache(ids, h)
    pool.free(ids[::-1])  # all cached and evictable
    py = PyBlockPool(n + 1)
    pyh = [bytes(x) for x in h]
    blocks = py.allocate(n)
    py.cache(blocks, pyh)
    py.free(blocks[::-1])

    def pycycle():
        hit = py.lookup(pyh)
        py.touch(hit)
        py.free(hit[::-1])

    return [
        Op(
            "lookup/2048",
            f"lookup {n:,} cached blocks (no pin)",
            "block",
            n,
            [Case("kvblocks", lambda: pool.lookup(h)), Case("python", lambda: py.lookup(pyh))],
        ),
        Op(
            "lookup_and_pin/2048",
            f"lookup_and_pin + free {n:,} blocks",
            "block",
            n,
            [
                Case("kvblocks", lambda: pool.free(pool.lookup_and_pin(h)[::-1])),
                Case("python", pycycle),
            ],
            note="python: lookup, touch (pin), free",
        ),
    ]


def _evict() -> List[Op]:
    """Steady state: every free block holds a cache entry; each allocate(n) evicts n."""
    n, total = EVICT_N, EVICT_TOTAL
    h = hash_blocks(np.arange(total * 4, dtype=np.int32), 4)
    pyh = [bytes(x) for x in h]
    pool = BlockPool(total + 1)
    py = PyBlockPool(total + 1)
    plain = BlockPool(total + 1, enable_prefix_caching=False)
    pyplain = PyBlockPool(total + 1)
    held: list = []
    pyheld: list = []
    held_plain: list = []
    pyheld_plain: list = []

    def fill():
        for ids in held:
            pool.free(ids)
        held.clear()
        pool.reset_prefix_cache()
        got = pool.allocate(total)
        pool.cache(got, h)
        pool.free(got[::-1])

    def pyfill():
        for b in pyheld:
            py.free(b)
        pyheld.clear()
        got = py.allocate(total)
        py.cache(got, pyh)
        py.free(got[::-1])

    def release(p, lst):
        def f():
            for x in lst:
                p.free(x)
            lst.clear()

        return f

    def check():  # the timed calls did evict
        fill()
        pool.free(pool.allocate(n))
        assert pool.stats.evictions >= n

    inner = EVICT_INNER
    return [
        Op(
            "allocate_evicting/128",
            f"allocate {n} evicting cached blocks",
            "block",
            n,
            [
                Case(
                    "kvblocks",
                    lambda: held.append(pool.allocate(n)),
                    inner=inner,
                    setup=fill,
                    check=check,
                ),
                Case("python", lambda: pyheld.append(py.allocate(n)), inner=inner, setup=pyfill),
            ],
        ),
        Op(
            "allocate_uncached/128",
            f"allocate {n}, nothing cached (for contrast)",
            "block",
            n,
            [
                Case(
                    "kvblocks",
                    lambda: held_plain.append(plain.allocate(n)),
                    inner=inner,
                    teardown=release(plain, held_plain),
                ),
                Case(
                    "python",
                    lambda: pyheld_plain.append(pyplain.allocate(n)),
                    inner=inner,
                    teardown=release(pyplain, pyheld_plain),
                ),
            ],
        ),
    ]


def build(s: Settings, vllm=None) -> Tuple[List[Op], dict]:
    return [_hash()] + _hash_modes() + _lookup() + _evict(), {}
