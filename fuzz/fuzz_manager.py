#!/usr/bin/env python3
"""Coverage-guided fuzzing of BlockManager, BlockPool and kvblocks.ops, checked byte for byte.

One fuzz input is one engine run. Its bytes are decoded into a small configuration (block
size, pool sizes, prefix caching, watermark, a tiny numpy KVCache and its host twin) and then
into a sequence of calls, grouped the way spec-round2.md's engine step orders them:

    schedule   add, append (prefill chunk), fork, free, swap_out / swap_in (+ ops.swap_blocks),
               reserve, truncate, pool.lookup probes, reset_prefix_cache, hostile calls
    step       drain (take_copies -> ops.copy_blocks, queued swap pairs -> ops.swap_blocks,
               in either order) -> metadata -> write_slots of every layer -> append_batch

A second, block-level engine drives its own BlockPool the vLLM way (hash_blocks,
lookup_and_pin, allocate, cache after the K/V is written, free tail first).

The K/V of the token at position p is a fixed function of the salt and of tokens[:p + 1], so
prefix-cache hits must give identical bytes. After every call the harness runs mgr.check() /
pool.check(), compares every sequence with its pure-Python model (tokens, swapped state,
number of computed tokens) and gathers (ops.gather over block_table) the computed K/V of every
settled sequence (see ``settled``), which must equal the sequence's expected contiguous copy.
Cache hits (add, lookup, lookup_and_pin) must hold their prefix's bytes. A failed call may
raise only KVBlocksError and must change nothing; hostile ids (1.0, True, None, numpy ints,
int/str subclasses) and bad scalars (bool, float, 2**63-1) must be refused or normalized as
spec-round2.md says.

A broken rule raises ``Finding`` with a short kind (e.g. ``kv-readback``) and the trace of
calls that led there, written as Python.

Input decoding is our own (``Input``), not atheris.FuzzedDataProvider, so that a corpus or
crash file decodes identically with and without atheris; atheris only supplies the bytes and
the coverage feedback.

Runs:
    python fuzz/fuzz_manager.py fuzz/corpus -max_total_time=3600      # atheris (libFuzzer flags)
    python fuzz/fuzz_manager.py --replay fuzz/corpus crash-...        # replay files, no atheris
    python fuzz/fuzz_manager.py --random 20000 --seconds 120          # seeded random bytes
    python fuzz/fuzz_manager.py --minimize crash-...                  # shrink, same finding
    python fuzz/fuzz_manager.py --show crash-...                      # the trace as Python
Environment: KVB_FUZZ_IGNORE=kind,kind  (findings of these kinds end the input quietly, so a
long run keeps looking for other bugs); KVB_FUZZ_TRACE=1 prints every trace while replaying.
See fuzz/README.md.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import random
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

try:
    import atheris
except ImportError:  # the replay and random modes need no atheris
    atheris = None

# an in-place build next to this folder wins over an installed kvblocks
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if glob.glob(os.path.join(_ROOT, "kvblocks", "_core*.so")):
    sys.path.insert(0, _ROOT)

import kvblocks  # (not instrumented: its Python modules are hot and well tested)
from kvblocks import (
    AttentionMetadata,
    BlockManager,
    BlockPool,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    KVCache,
    KVLayout,
    OutOfBlocksError,
    UnknownSequenceError,
    ops,
)

# spec-round2 features, detected so that the harness runs on the old and the new core alike
ROUND2 = hasattr(BlockManager, "num_computed")
HAS_SCHEDULE = hasattr(BlockManager, "schedule")

MAX_OPS = 80  # calls decoded from one input at most
MAX_TOKENS = 40  # a sequence never grows past this (keeps runs short)
IDS: List[Any] = [0, 1, 2, 3, 4, 5, 6, 7, "a", "b", "c", "d"]
KEY = b"kvblocks-fuzz-k!"
M64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# findings and input decoding
# ---------------------------------------------------------------------------------------------
class Finding(AssertionError):
    """A broken rule. ``kind`` names the rule; the message holds the details and the trace."""

    def __init__(
        self, kind: str, summary: str, op: str = "", sub: str = "", trace: str = ""
    ) -> None:
        super().__init__(f"[{kind}] {summary}\n(during {op})\n{trace}")
        self.kind = kind
        self.summary = summary
        self.key = " | ".join(x for x in (kind, op, sub) if x)  # one distinct bug, roughly


class Input:
    """Decodes fuzz bytes front to back; when they run out every read returns its minimum."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def int(self, lo: int, hi: int) -> int:
        """An int in [lo, hi] (one byte when the range fits in 256 values, else two)."""
        span = hi - lo + 1
        if span <= 1:
            return lo
        v = self.byte()
        if span > 256:
            v = v << 8 | self.byte()
        return lo + v % span

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]


# ---------------------------------------------------------------------------------------------
# the K/V every token gets: a function of the salt and of the token prefix only
# ---------------------------------------------------------------------------------------------
def _mix(h: int, t: int) -> int:
    h = ((h ^ (t & 0xFFFFFFFF)) * 0x100000001B3) & M64
    h ^= h >> 29
    h = (h * 0xBF58476D1CE4E5B9) & M64
    return h ^ (h >> 32)


def salt_bytes(salt: Any) -> bytes:
    """The salt as the core folds it into the first block: None is no salt, a str is tagged
    "s" and UTF-8 encoded, bytes are tagged "b" (so "1" and b"1", "" and None differ)."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return b"s" + salt.encode()
    return b"b" + bytes(salt)


def root_of(salt: Any) -> int:
    h = 0x5EED
    for b in salt_bytes(salt):
        h = _mix(h, b + 1)
    return _mix(h, 0xFFFF)


def prefix_hashes(root: int, tokens: List[int]) -> List[int]:
    out, h = [], root
    for t in tokens:
        h = _mix(h, t)
        out.append(h)
    return out


class KVModel:
    """Expected K/V of positions, as raw bf16 (uint16) values: [layers, 2, n, heads, dim]."""

    def __init__(self, layers: int, heads: int, dim: int) -> None:
        rng = np.random.default_rng(20240611)
        self.mult = rng.integers(
            1, 1 << 62, size=(layers, 2, 1, heads, dim), dtype=np.uint64
        ) * np.uint64(2) + np.uint64(1)

    def values(self, hs: List[int]) -> np.ndarray:
        h = np.array(hs, dtype=np.uint64).reshape(1, 1, -1, 1, 1)
        return ((h * self.mult) >> np.uint64(48)).astype(np.uint16)


# ---------------------------------------------------------------------------------------------
# hostile arguments
# ---------------------------------------------------------------------------------------------
TRAPS: List[str] = []  # subclass dunders that ran (spec: they never run)


class TrapInt(int):
    """An int subclass whose __hash__ / __eq__ must never run (ids are normalized first)."""

    def __hash__(self):
        TRAPS.append(f"TrapInt({int(self)}).__hash__")
        return int.__hash__(self)

    def __eq__(self, other):
        TRAPS.append(f"TrapInt({int(self)}).__eq__")
        return int.__eq__(self, other)

    def __repr__(self):
        return f"TrapInt({int(self)})"


class TrapStr(str):
    """A str subclass whose __hash__ / __eq__ must never run."""

    def __hash__(self):
        TRAPS.append(f"TrapStr({str(self)!r}).__hash__")
        return str.__hash__(self)

    def __eq__(self, other):
        TRAPS.append(f"TrapStr({str(self)!r}).__eq__")
        return str.__eq__(self, other)

    def __repr__(self):
        return f"TrapStr({str(self)!r})"


class Reentrant:
    """A token array whose conversion (__array__) calls back into the manager once."""

    def __init__(self, tokens: List[int], action: Callable[[], None], text: str) -> None:
        self.tokens = tokens
        self.action = action
        self.text = text
        self.ran = False

    def __array__(self, dtype=None, copy=None):
        if not self.ran:
            self.ran = True
            self.action()
        return np.asarray(self.tokens, dtype=np.int64 if dtype is None else dtype)

    def __repr__(self):
        return f"Reentrant({self.tokens}, lambda: {self.text})"


def fmt(x: Any) -> str:
    """Python source for an argument, for the trace."""
    if isinstance(x, np.ndarray):
        return f"np.array({x.tolist()}, dtype=np.{x.dtype})"
    if isinstance(x, np.generic):
        return f"np.{type(x).__name__}({x.item()!r})"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(fmt(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    return repr(x)


class Err:
    """What a call that raised a KVBlocksError returns inside the harness."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------
class Seq:
    """What one sequence of the manager must hold."""

    __slots__ = ("tokens", "hs", "salt", "computed", "hits", "swapped", "checked")

    def __init__(self, tokens: List[int], salt: Any, hits: int = 0) -> None:
        self.salt = salt
        self.tokens = list(tokens)
        self.hs = prefix_hashes(root_of(salt), self.tokens)
        self.computed = hits  # tokens whose K/V are written (add's cache hits are)
        self.hits = hits  # leading tokens served by add from the prefix cache
        self.swapped = False
        self.checked = None  # what the last read-back saw (skip it while nothing changed)

    def copy(self) -> "Seq":
        s = Seq.__new__(Seq)
        s.salt, s.tokens, s.hs = self.salt, list(self.tokens), list(self.hs)
        s.computed, s.hits, s.swapped = self.computed, self.hits, self.swapped
        s.checked = None
        return s

    def extend(self, tokens: List[int]) -> None:
        h = self.hs[-1] if self.hs else root_of(self.salt)
        for t in tokens:
            h = _mix(h, t)
            self.hs.append(h)
        self.tokens.extend(tokens)

    def cut(self, n: int) -> None:
        del self.tokens[n:]
        del self.hs[n:]
        self.computed = min(self.computed, n)
        self.hits = min(self.hits, n)


class PoolSeq:
    """A sequence of the block-level engine: the engine's own block table."""

    __slots__ = ("tokens", "hs", "salt", "table", "hashes")

    def __init__(self, tokens, salt, table, hashes) -> None:
        self.tokens, self.salt, self.table, self.hashes = list(tokens), salt, list(table), hashes
        self.hs = prefix_hashes(root_of(salt), self.tokens)


# ---------------------------------------------------------------------------------------------
# the harness
# ---------------------------------------------------------------------------------------------
class Harness:
    def __init__(self, inp: Input) -> None:
        self.inp = inp
        self.ops_run: List[str] = []
        self.trace: List[str] = []
        self.op = "setup"
        bs = inp.pick([1, 2, 3, 4, 4, 8])
        nblocks = inp.int(2, 28)
        host = inp.pick([0, 0, 1, 2])
        host = 0 if host == 0 else inp.int(2, 24)
        caching = inp.int(0, 3) != 0
        watermark = inp.pick([0.0, 0.0, 0.0, 0.15])
        events = inp.bool()
        layers, heads = inp.int(1, 2), inp.int(1, 2)
        dim = inp.pick([1, 2, 4])
        kind = inp.pick(["NHD", "HND"])
        joint = inp.bool()
        self.bs = bs
        self.watermark = watermark
        self.trace += [
            "import numpy as np",
            "import kvblocks",
            "from kvblocks import BlockManager, BlockPool, KVCache, KVLayout, ops",
            f"mgr = BlockManager({nblocks}, {bs}, enable_prefix_caching={caching}, "
            f"watermark={watermark}, num_host_blocks={host}, hash_key={KEY!r}, "
            f"enable_kv_events={events})",
            f"layout = KVLayout({layers}, {heads}, {dim}, {bs}, 'bf16', kind={kind!r}, "
            f"joint={joint})",
            f"cache = KVCache(layout, {nblocks}, pin_memory=False)",
        ]
        self.mgr = BlockManager(
            nblocks,
            bs,
            enable_prefix_caching=caching,
            watermark=watermark,
            num_host_blocks=host,
            hash_key=KEY,
            enable_kv_events=events,
        )
        self.caching = caching
        self.events = events
        self.layout = KVLayout(layers, heads, dim, bs, "bf16", kind=kind, joint=joint)
        self.layers = layers
        self.cache = KVCache(self.layout, nblocks, pin_memory=False)
        self.host = KVCache(self.layout, host, pin_memory=False) if host else None
        if host:
            self.trace.append(f"host = KVCache(layout, {host}, pin_memory=False)")
        self.kv = KVModel(layers, heads, dim)
        self.seqs: Dict[Any, Seq] = {}
        self.bytes_gen = 0  # bumped by every write into cache or host
        self.unsettled: set = set()  # ids whose bytes wait for pending copies or swap pairs
        # old core only: blocks are cached at commit, so an add's hits hold their K/V only
        # once the next forward ran (round 2 caches computed blocks only: no waiting)
        self.await_forward: set = set()
        self.swap_queue: List[Tuple[str, Any, np.ndarray]] = []  # deferred swap pairs
        self.recent: List[Tuple[Any, List[int]]] = []  # (salt, tokens) of freed sequences
        self.meta_buf: Optional[AttentionMetadata] = None
        if inp.bool():
            self.meta_buf = AttentionMetadata.allocate(
                len(IDS), len(IDS) * MAX_TOKENS, len(IDS) * (MAX_TOKENS + 1), MAX_TOKENS + 1
            )
            self.trace.append("buf = kvblocks.AttentionMetadata.allocate(...)")
        # the block-level engine
        pblocks = inp.int(2, 20)
        self.pool = BlockPool(pblocks, hash_key=KEY)
        self.pcache = KVCache(self.layout, pblocks, pin_memory=False)
        self.pseqs: Dict[int, PoolSeq] = {}
        self.pnext = 0
        self.trace.append(
            f"pool = BlockPool({pblocks}, hash_key={KEY!r}); "
            f"pcache = KVCache(layout, {pblocks}, pin_memory=False)"
        )

    # -- calling the library -------------------------------------------------------------------
    def call(
        self,
        text: str,
        fn: Callable,
        *args,
        expect: tuple = (),
        must_fail: bool = False,
        atomic: bool = True,
        kind: str = "",
        sub: str = "",
        **kw,
    ):
        """Run one library call. Returns its result, or an Err for a KVBlocksError.

        ``expect``: the KVBlocksError types this call may raise (any other one is a finding);
        ``must_fail``: success is a finding; ``atomic``: a failure must change nothing;
        ``kind``: the finding kind when the call is accepted or raises the wrong error
        (hostile arguments: alias-id, bad-scalar, bad-tokens); ``sub``: added to the key
        that tells distinct findings apart.
        """
        self.trace.append(text)
        snap = self.snapshot() if atomic else None
        del TRAPS[:]
        try:
            r = fn(*args, **kw)
        except KVBlocksError as e:
            self.trace.append(f"#   -> {type(e).__name__}: {e}")
            if TRAPS:
                raise self.finding("id-normalization", f"{text}: ran {TRAPS[0]}")
            if not isinstance(e, expect):
                raise self.finding(
                    kind or "spurious-error",
                    f"{text} raised {type(e).__name__}: {e}",
                    f"{text.split('(')[0]} {type(e).__name__}{sub}",
                )
            if snap is not None and self.snapshot() != snap:
                raise self.finding(
                    "not-atomic", f"{text} raised {type(e).__name__} and changed the state"
                )
            return Err(e)
        except Finding:
            raise
        except Exception as e:  # noqa: BLE001 - anything but KVBlocksError is a finding
            raise self.finding(
                kind or "unexpected-exception",
                f"{text} raised {type(e).__name__}: {e}",
                f"{text.split('(')[0]} {type(e).__name__}{sub}",
            ) from e
        if TRAPS:
            raise self.finding("id-normalization", f"{text}: ran {TRAPS[0]}")
        if must_fail:
            raise self.finding(
                kind or "accepted-misuse",
                f"{text} succeeded; expected one of {[t.__name__ for t in expect]}",
                text.split("(")[0] + sub,
            )
        if r is not None and not isinstance(r, (np.ndarray, AttentionMetadata)):
            self.trace.append(f"#   -> {r!r}")
        return r

    def finding(self, kind: str, detail: str, sub: str = "") -> Finding:
        return Finding(kind, detail, self.op, sub, self.render())

    def render(self) -> str:
        return "\n".join(self.trace[-400:])

    def snapshot(self):
        m = self.mgr
        seqs = []
        for sid in m.seq_ids():
            seqs.append(
                (
                    type(sid).__name__,
                    sid,
                    m.token_ids(sid).tobytes(),
                    m.block_table(sid).tobytes(),
                    m.is_swapped(sid),
                    m.num_computed(sid) if ROUND2 else 0,
                )
            )
        seqs.sort(key=lambda t: (t[0], str(t[1])))
        hp = m.host_pool
        return (
            seqs,
            m.pool.ref_counts().tobytes(),
            m.pool.num_free,
            m.pool.num_cached,
            m.pool.free_list().tobytes(),
            m.num_pending_copies,
            hp.ref_counts().tobytes() if hp is not None else b"",
            self.pool.ref_counts().tobytes(),
            self.pool.num_free,
            self.pool.num_cached,
            self.pool.free_list().tobytes(),
        )

    # -- choosing things -----------------------------------------------------------------------
    def live(self, swapped: Optional[bool] = None) -> List[Any]:
        return [s for s, q in self.seqs.items() if swapped is None or q.swapped == swapped]

    def pick_live(self, swapped: Optional[bool] = None):
        ids = self.live(swapped)
        return self.inp.pick(ids) if ids else None

    def pick_any_id(self):
        """Mostly live ids, sometimes unknown ones."""
        ids = self.live()
        if ids and self.inp.int(0, 4):
            return self.inp.pick(ids)
        return self.inp.pick(IDS)

    def new_id(self):
        free = [i for i in IDS if i not in self.seqs]
        return self.inp.pick(free) if free else None

    def tokens(self, lo: int = 0, hi: int = 10) -> List[int]:
        """Tokens from a tiny alphabet, often continuing the prefix of an existing prompt."""
        inp = self.inp
        n = inp.int(lo, hi)
        out: List[int] = []
        src = [q.tokens for q in self.seqs.values()] + [t for _, t in self.recent]
        if src and inp.bool():
            base = inp.pick(src)
            out = list(base[: inp.int(0, len(base))])[:n]
        while len(out) < n:
            c = inp.byte()
            out.append(c % 4 if c < 224 else inp.pick([0, 7, 2**31 - 1, -(2**31), -1, 255]))
        return out

    def salt(self):
        return self.inp.pick([None, None, None, "t1", b"t1", "", "1"])

    def as_tokens(self, toks: List[int]):
        """The same tokens as a list, an int64 / int32 array, or a range-free tuple."""
        form = self.inp.int(0, 3)
        if form == 0:
            return list(toks)
        if form == 1:
            return np.array(toks, dtype=np.int64)
        if form == 2:
            return np.array(toks, dtype=np.int32)
        return tuple(toks)

    # -- checks --------------------------------------------------------------------------------
    def settled(self) -> bool:
        return not self.swap_queue and self.mgr.num_pending_copies == 0

    def verify(self) -> None:
        """After every call: native checks, model comparison, byte read-back, cache bytes."""
        m = self.mgr
        try:
            m.check()
            self.pool.check()
        except KVBlocksError as e:
            raise self.finding("corruption", f"check() failed: {type(e).__name__}: {e}")
        ids = m.seq_ids()
        for sid in ids:
            if type(sid) not in (int, str):
                raise self.finding(
                    "id-normalization", f"seq_ids() holds a {type(sid).__name__}: {sid!r}"
                )
        if sorted(map(repr, ids)) != sorted(map(repr, self.seqs)):
            raise self.finding(
                "model-mismatch",
                f"seq_ids() {sorted(map(repr, ids))} but the "
                f"model has {sorted(map(repr, self.seqs))}",
            )
        bs = self.bs
        if self.settled():
            self.unsettled.clear()
        for sid, q in self.seqs.items():
            toks = m.token_ids(sid)
            if toks.tolist() != q.tokens:
                raise self.finding(
                    "model-mismatch", f"token_ids({sid!r}) = {toks.tolist()}, expected {q.tokens}"
                )
            if m.is_swapped(sid) != q.swapped:
                raise self.finding("model-mismatch", f"is_swapped({sid!r}) = {m.is_swapped(sid)}")
            table = m.block_table(sid)
            if len(table) < -(-len(q.tokens) // bs):
                raise self.finding(
                    "model-mismatch",
                    f"block_table({sid!r}) = {table.tolist()} is short for {len(q.tokens)} tokens",
                )
            if ROUND2 and m.num_computed(sid) != q.computed:
                raise self.finding(
                    "model-mismatch",
                    f"num_computed({sid!r}) = {m.num_computed(sid)}, expected {q.computed}",
                )
            if sid not in self.unsettled and sid not in self.await_forward:
                # the bytes a sequence reads change only with its table, its computed count
                # or a write into a cache (bytes_gen): else the last read-back still holds
                state = (self.bytes_gen, table.tobytes(), q.computed, q.swapped)
                if q.checked != state:
                    self.readback(sid, q, table)
                    q.checked = state
        self.pool_verify()
        if self.settled():
            self.probe_check()
        if self.events and self.inp.int(0, 7) == 0:
            self.call("mgr.pool.take_events()", m.pool.take_events, atomic=False)

    def readback(self, sid, q: Seq, table: np.ndarray) -> None:
        n = q.computed
        if n == 0:
            return
        cache = self.host if q.swapped else self.cache
        want = self.kv.values(q.hs[:n])
        for layer in range(self.layers):
            k, v = ops.gather(cache, layer, table, n)
            for name, got, exp in (("K", k, want[layer, 0]), ("V", v, want[layer, 1])):
                if not np.array_equal(got, exp):
                    bad = int(np.flatnonzero((got != exp).reshape(n, -1).any(axis=1))[0])
                    where = "host" if q.swapped else "device"
                    # a wrong byte inside add's cache hits: the hit block was never written
                    raise self.finding(
                        "cached-before-computed" if bad < q.hits else "kv-readback",
                        f"sequence {sid!r} ({where}, table {table.tolist()}, {n} computed of "
                        f"{len(q.tokens)} tokens {q.tokens}, {q.hits} from add's cache hits): "
                        f"{name} of layer {layer} differs "
                        f"first at position {bad} (block {int(table[bad // self.bs])})",
                    )

    def check_block_bytes(self, cache: KVCache, blocks, hs: List[int], what: str) -> None:
        """Block i of ``blocks`` must hold the K/V of positions [i*bs, (i+1)*bs) of ``hs``."""
        bs = self.bs
        n = len(blocks) * bs
        if n == 0:
            return
        want = self.kv.values(hs[:n])
        table = np.asarray(blocks, dtype=np.int32)
        for layer in range(self.layers):
            k, v = ops.gather(cache, layer, table, n)
            if not (np.array_equal(k, want[layer, 0]) and np.array_equal(v, want[layer, 1])):
                bad = int(
                    np.flatnonzero(
                        ((k != want[layer, 0]) | (v != want[layer, 1])).reshape(n, -1).any(axis=1)
                    )[0]
                )
                raise self.finding(
                    "cache-bytes",
                    f"{what}: cached block "
                    f"{int(table[bad // bs])} (hit {bad // bs}) does not hold "
                    f"its prefix's K/V (position {bad}, layer {layer})",
                )

    def probe_check(self) -> None:
        """Round 2: a block is cached only once computed, so every prefix-cache hit of a live
        or recently freed prompt must hold its K/V. (The old core caches at commit: there the
        read-back of an add's hits after the next forward finds blocks never written.)"""
        if not self.caching or not ROUND2:
            return
        cands = []
        for q in self.seqs.values():
            cands.append((q.salt, q.tokens, q.hs, len(q.tokens)))
        for salt, toks in self.recent:
            cands.append((salt, toks, prefix_hashes(root_of(salt), toks), len(toks)))
        for salt, toks, hs, upto in cands:
            full = upto // self.bs
            if full == 0:
                continue
            h = kvblocks.hash_blocks(
                np.array(toks[: full * self.bs], dtype=np.int64), self.bs, salt=salt, key=KEY
            )
            hit = self.mgr.pool.lookup(h)
            self.check_block_bytes(
                self.cache,
                hit.tolist(),
                hs,
                f"mgr.pool.lookup of {toks[: full * self.bs]} salt {salt!r}",
            )

    # -- drain: copies and swap pairs ----------------------------------------------------------
    def run_copies(self) -> None:
        pairs = self.call("pairs = mgr.take_copies()", self.mgr.take_copies, atomic=False)
        if len(pairs):
            self.trace.append(f"#   pairs = {pairs.tolist()}")
            try:
                ops.copy_blocks(self.cache, pairs)
            except KVBlocksError as e:
                raise self.finding(
                    "copy-pairs-refused",
                    f"ops.copy_blocks(cache, {pairs.tolist()}) refused take_copies()'s pairs: {e}",
                )
            self.trace.append("ops.copy_blocks(cache, pairs)")
            self.bytes_gen += 1

    def run_swaps(self) -> None:
        for direction, sid, pairs in self.swap_queue:
            src, dst = (self.cache, self.host) if direction == "out" else (self.host, self.cache)
            text = (
                f"ops.swap_blocks({'cache, host' if direction == 'out' else 'host, cache'}, "
                f"{pairs.tolist()})  # swap_{direction}({sid!r})"
            )
            try:
                ops.swap_blocks(src, dst, pairs)
            except KVBlocksError as e:
                raise self.finding("swap-pairs-refused", f"{text}: {e}")
            self.trace.append(text)
            self.bytes_gen += 1
        self.swap_queue = []

    def drain(self, swaps_first: bool = True) -> None:
        """The documented drain: swap pairs in the order the calls returned them, then the
        copy-on-write pairs, last (a copy's destination may be a block a swap_out of this
        step released, and a swap_in may write a block a later copy reads)."""
        self.run_swaps()
        self.run_copies()
        self.unsettled.clear()

    def flush_swaps(self) -> None:
        """Before calls that may hand out a block a queued swap pair still reads or writes."""
        if self.swap_queue:
            self.run_swaps()
            self.recompute_unsettled()

    def recompute_unsettled(self) -> None:
        if self.mgr.num_pending_copies == 0:
            self.unsettled.clear()

    def mark_unsettled(self, sid) -> None:
        self.unsettled.add(sid)

    # -- counting checks -----------------------------------------------------------------------
    def min_batch_need(self, ids: List[Any]) -> int:
        """A lower bound of the blocks one token for each of ``ids`` takes: growth, plus a
        copy for each sharer of a partly filled block but the last when they hold every
        reference (what sequential appends do)."""
        m, bs = self.mgr, self.bs
        refs = m.pool.ref_counts()
        need = 0
        sharers: Dict[int, int] = {}
        for sid in ids:
            q = self.seqs[sid]
            table = m.block_table(sid)
            w = len(q.tokens) // bs
            if w >= len(table):
                need += 1
            elif refs[table[w]] > 1:
                sharers[int(table[w])] = sharers.get(int(table[w]), 0) + 1
        for b, s in sharers.items():
            need += s - 1 if refs[b] == s else s
        return need

    # ------------------------------------------------------------------------------------------
    # schedule-phase operations
    # ------------------------------------------------------------------------------------------
    def op_add(self, sid=None, idobj=None) -> None:
        m, inp = self.mgr, self.inp
        if sid is None:
            sid = self.new_id() if inp.int(0, 7) else inp.pick(IDS)
            if sid is None:
                return
            idobj = sid
        toks = self.tokens(0, 14)
        salt = self.salt()
        exists = sid in self.seqs
        full = len(toks) // self.bs
        expect_hits = None
        if self.caching and not exists:
            h = kvblocks.hash_blocks(np.array(toks, dtype=np.int64), self.bs, salt=salt, key=KEY)
            cap = max(0, (len(toks) - 1) // self.bs)
            expect_hits = min(len(m.pool.lookup(h[:full])), cap) * self.bs
        can = m.can_add(len(toks))
        arg = self.as_tokens(toks)
        r = self.call(
            f"mgr.add({fmt(idobj)}, {fmt(arg)}, salt={salt!r})",
            m.add,
            idobj,
            arg,
            salt=salt,
            expect=(DuplicateSequenceError, OutOfBlocksError) if exists else (OutOfBlocksError,),
            must_fail=exists,
        )
        if isinstance(r, Err):
            if isinstance(r.exc, OutOfBlocksError) and can:
                raise self.finding("count", f"can_add({len(toks)}) said yes, add refused")
            return
        q = Seq(toks, salt, r)
        self.seqs[sid] = q
        if r % self.bs or r > max(0, len(toks) - 1) or r < 0:
            raise self.finding("add-hits", f"add returned {r} cached tokens for {len(toks)}")
        if expect_hits is not None and r != expect_hits:
            raise self.finding(
                "add-hits",
                f"add returned {r} cached tokens, lookup() just before found {expect_hits}",
            )
        self.new_seq_bytes(sid, r)

    def new_seq_bytes(self, sid, cached: int) -> None:
        if not self.settled():
            self.mark_unsettled(sid)
        if cached and not ROUND2:
            self.await_forward.add(sid)

    def op_append(self, sid=None, idobj=None) -> None:
        m, _inp = self.mgr, self.inp
        if sid is None:
            sid = self.pick_any_id()
            idobj = sid
        q = self.seqs.get(sid)
        toks = self.tokens(0, 2 * self.bs + 1)
        if q is not None and len(q.tokens) + len(toks) > MAX_TOKENS:
            return
        arg = self.as_tokens(toks)
        need = free = None
        if q is not None and not q.swapped:
            need = m.blocks_needed(sid, len(toks))
            free = m.pool.num_free
        if q is None:
            r = self.call(
                f"mgr.append({fmt(idobj)}, {fmt(arg)})",
                m.append,
                idobj,
                arg,
                expect=(UnknownSequenceError,),
                must_fail=True,
            )
            return
        if q.swapped:
            self.call(
                f"mgr.append({fmt(idobj)}, {fmt(arg)})",
                m.append,
                idobj,
                arg,
                expect=(InvalidStateError,),
                must_fail=True,
            )
            return
        r = self.call(
            f"mgr.append({fmt(idobj)}, {fmt(arg)})",
            m.append,
            idobj,
            arg,
            expect=(OutOfBlocksError,),
        )
        self.check_counts(f"append({sid!r}, {len(toks)} tokens)", r, need, free)
        if not isinstance(r, Err):
            q.extend(toks)
            self.mark_unsettled(sid)

    def check_counts(self, what: str, r, need: Optional[int], free: Optional[int]) -> None:
        """blocks_needed is what a call takes, and it fails for lack of blocks only then."""
        if need is None:
            return
        if isinstance(r, Err):
            if isinstance(r.exc, OutOfBlocksError) and need <= free:
                raise self.finding(
                    "count",
                    f"{what}: OutOfBlocksError but blocks_needed = {need} <= num_free = {free}",
                )
            return
        took = free - self.mgr.pool.num_free
        if took > need:
            raise self.finding("count", f"{what} took {took} blocks, blocks_needed said {need}")

    def op_reserve(self, sid=None, idobj=None, n=None) -> None:
        m, inp = self.mgr, self.inp
        if sid is None:
            sid = self.pick_any_id()
            idobj = sid
        q = self.seqs.get(sid)
        if n is None:
            n = inp.int(0, 2 * self.bs + 1)
        if q is None or q.swapped:
            self.call(
                f"mgr.reserve({fmt(idobj)}, {fmt(n)})",
                m.reserve,
                idobj,
                n,
                expect=(UnknownSequenceError if q is None else InvalidStateError,),
                must_fail=True,
            )
            return
        if len(q.tokens) + int(n) > MAX_TOKENS:
            return
        need, free = m.blocks_needed(sid, int(n)), m.pool.num_free
        r = self.call(
            f"mgr.reserve({fmt(idobj)}, {fmt(n)})", m.reserve, idobj, n, expect=(OutOfBlocksError,)
        )
        self.check_counts(f"reserve({sid!r}, {n})", r, need, free)
        if not isinstance(r, Err):
            self.mark_unsettled(sid)

    def op_truncate(self, sid=None, idobj=None, n=None) -> None:
        m, inp = self.mgr, self.inp
        if sid is None:
            sid = self.pick_any_id()
            idobj = sid
        q = self.seqs.get(sid)
        if q is None:
            self.call(
                f"mgr.truncate({fmt(idobj)}, 0)",
                m.truncate,
                idobj,
                0,
                expect=(UnknownSequenceError,),
                must_fail=True,
            )
            return
        if n is None:
            n = inp.int(0, len(q.tokens) + 1)
        bad = q.swapped or int(n) > len(q.tokens)
        self.call(
            f"mgr.truncate({fmt(idobj)}, {fmt(n)})",
            m.truncate,
            idobj,
            n,
            expect=(InvalidStateError, InvalidArgumentError) if bad else (),
            must_fail=bad,
        )
        if not bad:
            q.cut(int(n))

    def op_fork(self, parent=None, pobj=None, child=None, cobj=None) -> None:
        m = self.mgr
        if parent is None:
            parent = self.pick_any_id()
            pobj = parent
        if child is None:
            child = self.new_id() if self.inp.int(0, 7) else self.inp.pick(IDS)
            if child is None:
                return
            cobj = child
        p = self.seqs.get(parent)
        # every error that applies is a valid answer: the spec orders none of them
        exp = tuple(
            e
            for e, applies in (
                (UnknownSequenceError, p is None),
                (DuplicateSequenceError, child in self.seqs),
                (InvalidStateError, p is not None and p.swapped),
            )
            if applies
        )
        bad = bool(exp)
        self.call(
            f"mgr.fork({fmt(pobj)}, {fmt(cobj)})", m.fork, pobj, cobj, expect=exp, must_fail=bad
        )
        if not bad:
            self.seqs[child] = p.copy()
            if parent in self.unsettled:
                self.mark_unsettled(child)
            if parent in self.await_forward:
                self.await_forward.add(child)

    def op_free(self, sid=None, idobj=None) -> None:
        m = self.mgr
        if sid is None:
            sid = self.pick_any_id()
            idobj = sid
        q = self.seqs.get(sid)
        self.call(
            f"mgr.free({fmt(idobj)})",
            m.free,
            idobj,
            expect=(UnknownSequenceError,) if q is None else (),
            must_fail=q is None,
        )
        if q is not None:
            del self.seqs[sid]
            self.unsettled.discard(sid)
            self.await_forward.discard(sid)
            self.remember(q.salt, q.tokens)

    def remember(self, salt, tokens) -> None:
        self.recent.append((salt, list(tokens)))
        del self.recent[:-6]

    def op_swap_out(self, sid=None, idobj=None) -> None:
        m = self.mgr
        if sid is None:
            sid = self.pick_any_id()
            idobj = sid
        q = self.seqs.get(sid)
        if q is None:
            exp, bad = (UnknownSequenceError, InvalidStateError), True
        elif self.host is None or q.swapped:
            exp, bad = (InvalidStateError,), True
        else:
            exp, bad = (OutOfBlocksError,), False
        if not bad and self.inp.int(0, 3) == 0:
            self.flush_swaps()
        r = self.call(
            f"pairs = mgr.swap_out({fmt(idobj)})", m.swap_out, idobj, expect=exp, must_fail=bad
        )
        if bad or isinstance(r, Err):
            return
        q.swapped = True
        self.after_swap("out", sid, r)

    def op_swap_in(self, sid=None, idobj=None) -> None:
        m = self.mgr
        if sid is None:
            sid = self.pick_any_id()
            idobj = sid
        q = self.seqs.get(sid)
        if q is None:
            exp, bad = (UnknownSequenceError, InvalidStateError), True
        elif self.host is None or not q.swapped:
            exp, bad = (InvalidStateError,), True
        else:
            exp, bad = (OutOfBlocksError,), False
        self.flush_swaps()  # swap_in reads what a queued swap_out writes
        need = m.blocks_needed(sid, 0) if not bad else None
        free = m.pool.num_free
        r = self.call(
            f"pairs = mgr.swap_in({fmt(idobj)})", m.swap_in, idobj, expect=exp, must_fail=bad
        )
        if bad:
            return
        if isinstance(r, Err):
            if need <= free:
                raise self.finding(
                    "count",
                    f"swap_in({sid!r}): OutOfBlocksError but "
                    f"blocks_needed({sid!r}, 0) = {need} <= num_free = {free}",
                )
            return
        q.swapped = False
        self.after_swap("in", sid, r)

    def after_swap(self, direction: str, sid, pairs: np.ndarray) -> None:
        pairs = np.asarray(pairs)
        self.trace.append(f"#   pairs = {pairs.tolist()}")
        table = self.mgr.block_table(sid)
        dst = pairs[:, 1].tolist() if len(pairs) else []
        # swap_out moves every block; swap_in shares computed full blocks still cached on the
        # device again instead of copying them, so its pairs cover the rest, in table order
        # (the byte-level read-back checks the shared ones)
        ok = (
            dst == table.tolist()
            if direction == "out"
            else len(set(dst)) == len(dst) and [b for b in table.tolist() if b in set(dst)] == dst
        )
        if not ok:
            raise self.finding(
                "model-mismatch",
                f"swap_{direction}({sid!r}) pairs "
                f"{pairs.tolist()} do not end in block_table {table.tolist()}",
            )
        self.swap_queue.append((direction, sid, pairs))
        # the documented idiom moves the bytes at once; a deferred pair waits for the drain
        if self.inp.int(0, 2):
            self.run_swaps()
            self.recompute_unsettled()
            if self.mgr.num_pending_copies:
                self.mark_unsettled(sid)
        else:
            self.mark_unsettled(sid)
            for other in list(self.seqs):
                self.mark_unsettled(other)  # conservative: bytes are in flight

    def op_drain(self) -> None:
        self.drain(self.inp.bool())

    def op_reset_cache(self) -> None:
        pool = self.mgr.pool
        refs = pool.ref_counts()
        busy = any(pool.is_cached(b) and refs[b] > 0 for b in range(1, pool.num_blocks))
        self.call(
            "mgr.pool.reset_prefix_cache()",
            pool.reset_prefix_cache,
            expect=(InvalidStateError,) if busy else (),
            must_fail=busy,
        )
        if not busy and pool.num_cached:
            raise self.finding("model-mismatch", "reset_prefix_cache left cached blocks")

    def op_queries(self) -> None:
        """can_append over a batch must agree with what append_batch of it would take."""
        m = self.mgr
        ids = [s for s in self.live(False) if self.inp.bool()]
        if not ids:
            return
        need, free = self.min_batch_need(ids), m.pool.num_free
        ok = self.call(f"mgr.can_append({fmt(ids)})", m.can_append, list(ids), atomic=False)
        if not ok and need <= free:
            raise self.finding(
                "count",
                f"can_append({ids!r}) is False, but one token each "
                f"takes at most {need} blocks and {free} are free",
            )

    # ------------------------------------------------------------------------------------------
    # the step: drain -> metadata -> forward (write_slots) -> commit (append_batch)
    # ------------------------------------------------------------------------------------------
    def op_step(self) -> None:
        m, inp = self.mgr, self.inp
        running = self.live(False)
        misuse = ROUND2 and inp.int(0, 15) == 0
        if not (misuse and m.num_pending_copies):
            self.drain(inp.bool())
        batch = [s for s in running if inp.int(0, 3)]
        if not batch and running and inp.bool():
            batch = [inp.pick(running)]
        qlens = []
        for sid in batch:
            q = self.seqs[sid]
            extra = inp.int(0, q.computed) if inp.int(0, 5) == 0 else 0
            qlens.append(len(q.tokens) - q.computed + extra)
        if misuse:
            self.step_misuse(batch, qlens)
            return
        slots = self.schedule(batch, qlens)
        if slots is None:
            return
        self.forward(batch, qlens, slots)
        self.await_forward.clear()
        # commit: one sampled token for some of the batch (the decode step)
        commit = [s for s in batch if inp.int(0, 3) and len(self.seqs[s].tokens) < MAX_TOKENS]
        if inp.int(0, 5) == 0 and commit:  # parallel sampling: fork after the step
            self.op_fork(commit[0], commit[0])
        self.commit(commit)

    def step_misuse(self, batch: List[Any], qlens: List[int]) -> None:
        """Round-2 misuse of metadata: pending copies, a gap, a repeated sequence."""
        m = self.mgr
        if not batch:
            return
        if m.num_pending_copies:
            self.call(
                f"mgr.metadata({fmt(batch)}, {qlens})  # copies pending",
                m.metadata,
                batch,
                qlens,
                expect=(InvalidStateError,),
                must_fail=True,
            )
            return
        gaps = [
            i
            for i, sid in enumerate(batch)
            if len(self.seqs[sid].tokens) - qlens[i] == self.seqs[sid].computed and qlens[i] > 0
        ]
        if gaps:
            q = list(qlens)
            q[gaps[0]] -= 1
            self.call(
                f"mgr.metadata({fmt(batch)}, {q})  # a gap",
                m.metadata,
                batch,
                q,
                expect=(InvalidStateError,),
                must_fail=True,
            )
        else:
            self.call(
                f"mgr.metadata({fmt(batch + batch[:1])}, ...)  # repeated",
                m.metadata,
                batch + batch[:1],
                qlens + qlens[:1],
                expect=(InvalidArgumentError,),
                must_fail=True,
            )

    def schedule(self, batch: List[Any], qlens: List[int]) -> Optional[np.ndarray]:
        """metadata (or schedule) for the batch; returns the slot mapping, checked."""
        m, inp = self.mgr, self.inp
        if HAS_SCHEDULE and inp.int(0, 3) == 0:
            self.call(f"mgr.schedule({fmt(batch)}, {qlens})", m.schedule, batch, qlens)
            return self.expected_slots(batch, qlens)
        ids_arg: Any = list(batch)
        form = inp.int(0, 3)
        if form == 1 and batch:
            ids_arg = self.call(f"sb = mgr.batch({fmt(batch)})", m.batch, list(batch), atomic=False)
        elif form == 2:
            ids_arg = iter(batch)  # spec: any iterable, consumed once
        out = self.meta_buf if inp.bool() else None
        text = f"meta = mgr.metadata({fmt(batch)}, {qlens}{', out=buf' if out else ''})"
        meta = self.call(
            text,
            m.metadata,
            ids_arg,
            np.array(qlens, dtype=np.int64),
            out=out,
            expect=(InvalidArgumentError,) if out is not None else (),
        )
        if isinstance(meta, Err):  # fixed buffers too small: fine, nothing was written
            return None
        self.check_meta(batch, qlens, meta)
        if out is not None and (out.slot_mapping[meta.num_tokens :] != -1).any():
            raise self.finding("metadata", "the fixed slot_mapping's tail is not -1")
        return np.asarray(meta.slot_mapping)

    def expected_slots(self, batch: List[Any], qlens: List[int]) -> np.ndarray:
        bs, out = self.bs, []
        for sid, ql in zip(batch, qlens):
            table = self.mgr.block_table(sid)
            n = len(self.seqs[sid].tokens)
            out += [int(table[p // bs]) * bs + p % bs for p in range(n - ql, n)]
        return np.array(out, dtype=np.int64)

    def check_meta(self, batch: List[Any], qlens: List[int], meta) -> None:
        bs = self.bs
        want_slots = self.expected_slots(batch, qlens)
        got = np.asarray(meta.slot_mapping)
        if not np.array_equal(got, want_slots):
            raise self.finding(
                "metadata", f"slot_mapping {got.tolist()}, block tables give {want_slots.tolist()}"
            )
        qo, kvp, kvi = [0], [0], []
        for i, sid in enumerate(batch):
            n = len(self.seqs[sid].tokens)
            nb = -(-n // bs)
            table = self.mgr.block_table(sid)[:nb].tolist()
            qo.append(qo[-1] + qlens[i])
            kvp.append(kvp[-1] + nb)
            kvi += table
            row = np.asarray(meta.block_tables[i]).tolist()
            if row[:nb] != table or any(row[nb:]):
                raise self.finding("metadata", f"block_tables row {i} = {row}, table {table}")
            if int(meta.seq_lens[i]) != n:
                raise self.finding("metadata", f"seq_lens[{i}] = {int(meta.seq_lens[i])} != {n}")
            last = n - (nb - 1) * bs if nb else 0
            if int(meta.kv_last_page_len[i]) != last:
                raise self.finding("metadata", f"kv_last_page_len[{i}] wrong")
        if (
            np.asarray(meta.qo_indptr).tolist() != qo
            or np.asarray(meta.kv_indptr).tolist() != kvp
            or np.asarray(meta.kv_indices).tolist() != kvi
        ):
            raise self.finding(
                "metadata", "qo_indptr / kv_indptr / kv_indices disagree with the block tables"
            )

    def forward(self, batch: List[Any], qlens: List[int], slots: np.ndarray) -> None:
        """Write the K/V of every query token at its slot, every layer."""
        if not batch:
            return
        parts = []
        for sid, ql in zip(batch, qlens):
            q = self.seqs[sid]
            n = len(q.tokens)
            parts.append(self.kv.values(q.hs[n - ql : n]) if ql else None)
        parts = [p for p in parts if p is not None]
        if parts:
            vals = np.concatenate(parts, axis=2)  # [L, 2, tokens, H, D]
            uniq, first = np.unique(slots, return_index=True)
            if len(uniq) != len(slots):  # fork siblings computing one shared position
                for s in uniq:
                    idx = np.flatnonzero(slots == s)
                    if not all(np.array_equal(vals[:, :, idx[0]], vals[:, :, j]) for j in idx):
                        raise self.finding(
                            "metadata", f"slot {int(s)} gets two different tokens in one step"
                        )
                slots, vals = slots[first], vals[:, :, first]
            self.bytes_gen += 1
            for layer in range(self.layers):
                ops.write_slots(self.cache, layer, vals[layer, 0], vals[layer, 1], slots)
            self.trace.append(
                "for l in range(layout.num_layers): "
                "ops.write_slots(cache, l, k[l], v[l], meta.slot_mapping)"
            )
        for sid in batch:
            self.seqs[sid].computed = len(self.seqs[sid].tokens)

    def commit(self, ids: List[Any]) -> None:
        m, inp = self.mgr, self.inp
        if not ids and inp.bool():
            return
        toks = [inp.int(0, 3) for _ in ids]
        need, free = self.min_batch_need(ids), m.pool.num_free
        can = m.can_append(list(ids))
        ids_arg: Any = list(ids)
        if ids and inp.int(0, 3) == 0:
            ids_arg = self.call(f"sb = mgr.batch({fmt(ids)})", m.batch, list(ids), atomic=False)
        arg = self.as_tokens(toks)
        r = self.call(
            f"mgr.append_batch({fmt(ids)}, {fmt(arg)})",
            m.append_batch,
            ids_arg,
            arg,
            expect=(OutOfBlocksError,),
        )
        if isinstance(r, Err):
            if need <= free:
                raise self.finding(
                    "count",
                    f"append_batch({ids!r}) raised OutOfBlocksError, "
                    f"but it takes at most {need} blocks and {free} are free",
                )
            if can:
                raise self.finding("count", f"can_append({ids!r}) said yes, append_batch refused")
            return
        if not can and need <= free:
            raise self.finding(
                "count",
                f"can_append({ids!r}) said no; append_batch took "
                f"{free - m.pool.num_free} blocks of {free} free",
            )
        for sid, t in zip(ids, toks):
            self.seqs[sid].extend([t])
            self.mark_unsettled(sid)

    def op_commit_bad(self) -> None:
        """append_batch with a duplicate, a swapped or an unknown sequence: nothing changes."""
        m, inp = self.mgr, self.inp
        ids = [s for s in self.live() if inp.bool()]
        kind = inp.int(0, 2)
        if kind == 0 and ids:
            ids.insert(inp.int(0, len(ids)), inp.pick(ids))
        elif kind == 1:
            ids.insert(inp.int(0, len(ids)), inp.pick(IDS))
        bad = (
            len(set(map(repr, ids))) != len(ids)
            or any(s not in self.seqs for s in ids)
            or any(self.seqs[s].swapped for s in ids if s in self.seqs)
        )
        if not bad:
            return self.commit(ids)
        self.call(
            f"mgr.append_batch({fmt(ids)}, {[1] * len(ids)})",
            m.append_batch,
            ids,
            [1] * len(ids),
            expect=(InvalidArgumentError, InvalidStateError, UnknownSequenceError),
            must_fail=True,
        )

    # ------------------------------------------------------------------------------------------
    # hostile calls
    # ------------------------------------------------------------------------------------------
    def disguise(self, sid) -> Tuple[Any, bool]:
        """(an object standing for ``sid``, whether the spec normalizes it to ``sid``)."""
        inp = self.inp
        if isinstance(sid, str):
            return inp.pick(
                [
                    (TrapStr(sid), True),
                    (np.str_(sid), True),
                    (sid.encode(), False),
                    ((sid,), False),
                    ([sid], False),
                ]
            )
        forms = [
            (np.int64(sid), True),
            (np.int32(sid), True),
            (np.uint8(sid), True),
            (TrapInt(sid), True),
            (float(sid), False),
            (None, False),
            (str(sid).encode(), False),
            ([sid], False),
            (complex(sid), False),
        ]
        if sid in (0, 1):
            forms.append((bool(sid), False))
        return inp.pick(forms)

    def op_hostile_id(self) -> None:
        inp, m = self.inp, self.mgr
        target = inp.int(0, 9)
        if target in (0, 1):  # a new id for add / fork
            sid = self.new_id()
            parent = self.pick_live()
            if sid is None or (target == 1 and parent is None):
                return
        else:
            sid = self.pick_live()
            if sid is None:
                return
        obj, normal = self.disguise(sid)
        if normal:  # the very same call as with the exact id
            if target == 0:
                self.op_add(sid, obj)
            elif target == 1:
                self.op_fork(parent, parent, sid, obj)
            else:
                [
                    self.op_append,
                    self.op_free,
                    self.op_truncate,
                    self.op_reserve,
                    self.op_swap_out,
                    self.op_swap_in,
                    self.id_query,
                    self.batch_with,
                ][target - 2](sid, obj)
            return
        calls = [
            ("mgr.add({0}, [1, 2])", lambda: m.add(obj, [1, 2])),
            ("mgr.fork({1!r}, {0})", lambda: m.fork(parent, obj)),
            ("mgr.append({0}, [1])", lambda: m.append(obj, [1])),
            ("mgr.free({0})", lambda: m.free(obj)),
            ("mgr.truncate({0}, 0)", lambda: m.truncate(obj, 0)),
            ("mgr.reserve({0}, 1)", lambda: m.reserve(obj, 1)),
            ("mgr.swap_out({0})", lambda: m.swap_out(obj)),
            ("mgr.num_tokens({0})", lambda: m.num_tokens(obj)),
            ("mgr.block_table({0})", lambda: m.block_table(obj)),
            ("mgr.append_batch([{0}], [1])", lambda: m.append_batch([obj], [1])),
        ]
        text, fn = calls[target]
        self.call(
            text.format(fmt(obj), parent if target == 1 else None) + f"  # {sid!r} is live",
            fn,
            expect=(InvalidTypeError,),
            must_fail=True,
            kind="alias-id",
        )

    def id_query(self, sid, obj) -> None:
        m, q = self.mgr, self.seqs[sid]
        n = self.call(f"mgr.num_tokens({fmt(obj)})", m.num_tokens, obj, atomic=False)
        if n != len(q.tokens):
            raise self.finding(
                "id-normalization",
                f"num_tokens({fmt(obj)}) = {n}, num_tokens({sid!r}) = {len(q.tokens)}",
            )
        t = self.call(f"mgr.block_table({fmt(obj)})", m.block_table, obj, atomic=False)
        if t.tolist() != m.block_table(sid).tolist():
            raise self.finding("id-normalization", f"block_table({fmt(obj)}) differs")

    def batch_with(self, sid, obj) -> None:
        """append_batch / can_append with the disguised id among exact ones."""
        q = self.seqs[sid]
        if q.swapped or len(q.tokens) >= MAX_TOKENS:
            return
        others = [
            s
            for s in self.live(False)
            if s != sid and self.inp.bool() and len(self.seqs[s].tokens) < MAX_TOKENS
        ]
        ids = others + [sid]
        objs = others + [obj]
        m = self.mgr
        need, free = self.min_batch_need(ids), m.pool.num_free
        r = self.call(
            f"mgr.append_batch({fmt(objs)}, {[2] * len(ids)})",
            m.append_batch,
            objs,
            [2] * len(ids),
            expect=(OutOfBlocksError,),
        )
        if isinstance(r, Err):
            if need <= free:
                raise self.finding(
                    "count",
                    f"append_batch({ids!r}): OutOfBlocksError, needs at most {need}, {free} free",
                )
            return
        for s in ids:
            self.seqs[s].extend([2])
            self.mark_unsettled(s)

    def op_bad_scalar(self) -> None:
        m, inp = self.mgr, self.inp
        sid = self.pick_live(False)
        val = inp.pick(
            [
                True,
                False,
                1.0,
                2.5,
                None,
                "3",
                -1,
                2**31,
                2**63 - 1,
                2**63,
                -(2**63),
                2**64,
                np.int64(2),
                np.uint64(2**63),
                np.int8(-3),
                np.float64(1.0),
                np.bool_(True),
                TrapInt(1),
            ]
        )
        is_int = isinstance(val, (int, np.integer)) and not isinstance(val, (bool, np.bool_))
        kind = "bad-scalar"
        if isinstance(val, (bool, np.bool_)):
            sub = " (bool)"
        elif is_int:
            sub = " (int)" if -(2**31) <= int(val) < 2**31 else " (huge int)"
        else:
            sub = f" ({type(val).__name__})"
        self.scalar_sub = sub
        target = inp.int(0, 7)
        if target == 0:  # truncate
            if sid is None:
                return
            q = self.seqs[sid]
            if is_int and 0 <= int(val) <= len(q.tokens):
                return self.op_truncate(sid, sid, val)
            exp = InvalidArgumentError if is_int else InvalidTypeError
            self.call(
                f"mgr.truncate({sid!r}, {fmt(val)})",
                m.truncate,
                sid,
                val,
                expect=(exp,),
                must_fail=True,
                kind=kind,
                sub=sub,
            )
        elif target == 1:  # reserve
            if sid is None:
                return
            q = self.seqs[sid]
            if is_int and 0 <= int(val) and len(q.tokens) + int(val) <= MAX_TOKENS:
                return self.op_reserve(sid, sid, val)
            exp = (InvalidArgumentError, OutOfBlocksError) if is_int else (InvalidTypeError,)
            self.call(
                f"mgr.reserve({sid!r}, {fmt(val)})",
                m.reserve,
                sid,
                val,
                expect=exp,
                must_fail=True,
                kind=kind,
                sub=sub,
            )
        elif target == 2:  # blocks_needed: an int >= 0, or refused
            if sid is None:
                return
            self.scalar_query(
                f"mgr.blocks_needed({sid!r}, {fmt(val)})",
                lambda: m.blocks_needed(sid, val),
                val,
                is_int,
                lambda r: r >= 0,
            )
        elif target == 3:
            self.scalar_query(
                f"mgr.can_add({fmt(val)})",
                lambda: m.can_add(val),
                val,
                is_int,
                lambda r: r in (True, False) and not (r and int(val) > m.pool.num_blocks * self.bs),
            )
        elif target == 4:
            ids = self.live(False)
            self.scalar_query(
                f"mgr.can_append({fmt(ids)}, {fmt(val)})",
                lambda: m.can_append(ids, val),
                val,
                is_int,
                lambda r: (
                    r in (True, False)
                    and not (r and ids and int(val) > m.pool.num_blocks * self.bs)
                ),
            )
        elif target == 5:
            self.scalar_query(
                f"mgr.blocks_for_tokens({fmt(val)})",
                lambda: m.blocks_for_tokens(val),
                val,
                is_int,
                lambda r: r == -(-int(val) // self.bs),
            )
        elif target == 6:  # the block-level pool
            if is_int and 0 <= int(val) <= self.pool.num_free:
                return
            exp = (InvalidArgumentError, OutOfBlocksError) if is_int else (InvalidTypeError,)
            self.call(
                f"pool.allocate({fmt(val)})",
                self.pool.allocate,
                val,
                expect=exp,
                must_fail=True,
                kind=kind,
                sub=sub,
            )
        else:  # bad token arrays
            self.bad_tokens(sid)

    def scalar_query(self, text: str, fn, val, is_int: bool, good) -> None:
        r = self.call(
            text,
            fn,
            expect=(InvalidArgumentError, OutOfBlocksError) if is_int else (InvalidTypeError,),
            must_fail=not is_int,
            kind="bad-scalar",
            sub=self.scalar_sub,
        )
        if not isinstance(r, Err) and not good(r):
            raise self.finding(
                "bad-scalar", f"{text} = {r!r}", text.split("(")[0] + " result" + self.scalar_sub
            )
        if isinstance(r, Err) and is_int and 0 <= int(val) < 2**31:
            raise self.finding(
                "bad-scalar", f"{text} refused a small int", text.split("(")[0] + " refused"
            )

    def bad_tokens(self, sid) -> None:
        m, inp = self.mgr, self.inp
        val, exp = inp.pick(
            [
                ([1.5], InvalidTypeError),
                ([True, False], InvalidTypeError),
                (np.array([2**31], dtype=np.int64), InvalidArgumentError),
                (np.array([-(2**31) - 1], dtype=np.int64), InvalidArgumentError),
                ([[1, 2]], InvalidArgumentError),
                ("abc", InvalidTypeError),
                (None, InvalidTypeError),
                (np.array([1.0]), InvalidTypeError),
                ([1, "a"], InvalidTypeError),
                (np.array([2**63], dtype=np.uint64), InvalidArgumentError),
            ]
        )
        exps = (InvalidTypeError, InvalidArgumentError)
        kind, sub = "bad-tokens", ""
        which = inp.int(0, 2)
        if which == 0:
            new = self.new_id()
            if new is None:
                return
            self.call(
                f"mgr.add({new!r}, {fmt(val)})",
                m.add,
                new,
                val,
                expect=exps,
                must_fail=True,
                kind=kind,
                sub=sub,
            )
        elif which == 1 and sid is not None:
            self.call(
                f"mgr.append({sid!r}, {fmt(val)})",
                m.append,
                sid,
                val,
                expect=exps,
                must_fail=True,
                kind=kind,
                sub=sub,
            )
        elif sid is not None:
            self.call(
                f"mgr.append_batch([{sid!r}], {fmt(val)})",
                m.append_batch,
                [sid],
                val,
                expect=exps + (InvalidArgumentError,),
                must_fail=True,
                kind=kind,
                sub=sub,
            )

    def op_reentrant(self) -> None:
        """A token array whose conversion calls the manager: spec-round2 converts every
        argument first, then validates against the state the callback left."""
        m, inp = self.mgr, self.inp
        victim = self.pick_live()
        newid = self.new_id()
        kind = inp.int(0, 3)  # 0 free, 1 add, 2 free + add (the slot is reused), 3 query
        did = {"free": False, "add": False}

        def action():
            # a core may refuse calls made during argument conversion: then nothing happened
            try:
                if kind in (0, 2) and victim is not None:
                    self.trace.append(f"#   (inside __array__) mgr.free({victim!r})")
                    m.free(victim)
                    q = self.seqs.pop(victim)
                    self.unsettled.discard(victim)
                    self.await_forward.discard(victim)
                    self.remember(q.salt, q.tokens)
                    did["free"] = True
                if kind in (1, 2) and newid is not None and m.pool.num_free > 0:
                    self.trace.append(f"#   (inside __array__) mgr.add({newid!r}, [3])")
                    r = m.add(newid, [3])
                    self.seqs[newid] = Seq([3], None, r)
                    self.new_seq_bytes(newid, r)
                    did["add"] = True
                if kind == 3:
                    ids = self.live()[::-1]
                    self.trace.append(f"#   (inside __array__) mgr.can_append({ids!r})")
                    m.can_append(ids)
            except KVBlocksError as e:
                self.trace.append(f"#   (inside __array__) -> {type(e).__name__}: {e}")

        text = {
            0: f"mgr.free({victim!r})",
            1: f"mgr.add({newid!r}, [3])",
            2: f"mgr.free({victim!r}); mgr.add({newid!r}, [3])",
            3: "mgr.can_append(reversed live ids)",
        }[kind]
        where = inp.int(0, 2)
        if where == 0:  # append to some sequence
            sid = self.pick_live(False)
            if sid is None or len(self.seqs[sid].tokens) >= MAX_TOKENS:
                return
            toks = [inp.int(0, 3)]
            arg = Reentrant(toks, action, text)
            self.trace.append(f"mgr.append({sid!r}, {arg!r})")
            r = self.raw(lambda: m.append(sid, arg))
            if sid in self.seqs:
                if isinstance(r, Err) and isinstance(r.exc, OutOfBlocksError):
                    return
                self.expect_ok(r, f"append({sid!r}) after the callback")
                self.seqs[sid].extend(toks)
                self.mark_unsettled(sid)
            else:
                self.expect_err(
                    r, (UnknownSequenceError,), f"append({sid!r}) of a sequence the callback freed"
                )
        elif where == 1:  # append_batch over the running sequences, a distinct token each
            ids = [s for s in self.live(False) if len(self.seqs[s].tokens) < MAX_TOKENS]
            if not ids:
                return
            toks = [inp.int(0, 3) for _ in ids]
            arg = Reentrant(toks, action, text)
            self.trace.append(f"mgr.append_batch({ids!r}, {arg!r})")
            r = self.raw(lambda: m.append_batch(ids, arg))
            if all(s in self.seqs for s in ids):
                if isinstance(r, Err) and isinstance(r.exc, OutOfBlocksError):
                    return
                self.expect_ok(r, f"append_batch({ids!r}) after the callback")
                for s, t in zip(ids, toks):
                    self.seqs[s].extend([t])
                    self.mark_unsettled(s)
            else:
                self.expect_err(
                    r,
                    (UnknownSequenceError,),
                    f"append_batch({ids!r}) with a sequence the callback freed",
                )
        else:  # add under the id the callback may take
            sid = newid
            if sid is None:
                return
            toks = [inp.int(0, 3)]
            arg = Reentrant(toks, action, text)
            self.trace.append(f"mgr.add({sid!r}, {arg!r})")
            r = self.raw(lambda: m.add(sid, arg))
            if did["add"]:
                self.expect_err(
                    r,
                    (DuplicateSequenceError, OutOfBlocksError),
                    f"add({sid!r}) of an id the callback added",
                )
            elif not isinstance(r, Err) or not isinstance(r.exc, OutOfBlocksError):
                self.expect_ok(r, f"add({sid!r}) after the callback")
                q = Seq(toks, None, r)
                self.seqs[sid] = q
                self.new_seq_bytes(sid, r)

    def raw(self, fn):
        try:
            return fn()
        except KVBlocksError as e:
            self.trace.append(f"#   -> {type(e).__name__}: {e}")
            return Err(e)
        except Exception as e:  # noqa: BLE001
            raise self.finding("unexpected-exception", f"{type(e).__name__}: {e}") from e

    def expect_ok(self, r, what: str) -> None:
        if isinstance(r, Err):
            raise self.finding("reentrancy", f"{what} raised {type(r.exc).__name__}: {r.exc}")

    def expect_err(self, r, exp: tuple, what: str) -> None:
        if not isinstance(r, Err):
            raise self.finding("reentrancy", f"{what} succeeded")
        if not isinstance(r.exc, exp):
            raise self.finding("reentrancy", f"{what} raised {type(r.exc).__name__}")

    # ------------------------------------------------------------------------------------------
    # the block-level engine (its own BlockPool, vLLM style)
    # ------------------------------------------------------------------------------------------
    def pool_verify(self) -> None:
        refs = np.zeros(self.pool.num_blocks, dtype=np.int64)
        for ps in self.pseqs.values():
            for b in ps.table:
                refs[b] += 1
        got = self.pool.ref_counts()
        if not np.array_equal(got, refs):
            raise self.finding(
                "pool-refs", f"pool.ref_counts() {got.tolist()}, the tables hold {refs.tolist()}"
            )

    def pool_hashes(self, salt, toks) -> np.ndarray:
        return kvblocks.hash_blocks(np.array(toks, dtype=np.int64), self.bs, salt=salt, key=KEY)

    def op_pool_admit(self) -> None:
        pool, inp, bs = self.pool, self.inp, self.bs
        toks = self.tokens(1, 12)
        src = [p.tokens for p in self.pseqs.values()]
        if src and inp.bool():
            base = inp.pick(src)
            toks = base[: inp.int(0, len(base))] + toks[: inp.int(1, 4)]
        salt = inp.pick([None, "t1"])
        h = self.pool_hashes(salt, toks)
        cap = (len(toks) - 1) // bs
        hit = self.call(
            f"hit = pool.lookup_and_pin({fmt(h[:cap])})", pool.lookup_and_pin, h[:cap], atomic=False
        )
        hs = prefix_hashes(root_of(salt), toks)
        self.check_block_bytes(self.pcache, hit.tolist(), hs, "pool.lookup_and_pin")
        need = -(-len(toks) // bs) - len(hit)
        new = self.call(
            f"new = pool.allocate({need})",
            pool.allocate,
            need,
            expect=(OutOfBlocksError,),
            atomic=False,
        )
        pid = self.pnext
        self.pnext += 1
        if isinstance(new, Err):
            if need <= pool.num_free:
                raise self.finding(
                    "count", f"pool.allocate({need}) refused with {pool.num_free} free"
                )
            self.call("pool.free(hit[::-1])", pool.free, hit[::-1], atomic=False)
            return
        table = hit.tolist() + new.tolist()
        self.pseqs[pid] = ps = PoolSeq(toks, salt, table, h)
        # compute: write the K/V of the positions after the hits, then register full blocks
        start = len(hit) * bs
        if start < len(toks):
            self.pool_write(ps, start, len(toks))
        full = len(toks) // bs
        if full > len(hit):
            self.call(
                f"pool.cache({table[len(hit) : full]}, h[{len(hit)}:{full}])",
                pool.cache,
                np.array(table[len(hit) : full], dtype=np.int32),
                h[len(hit) : full],
            )

    def pool_write(self, ps: PoolSeq, a: int, b: int) -> None:
        bs = self.bs
        slots = np.array([ps.table[p // bs] * bs + p % bs for p in range(a, b)], dtype=np.int64)
        vals = self.kv.values(ps.hs[a:b])
        for layer in range(self.layers):
            ops.write_slots(self.pcache, layer, vals[layer, 0], vals[layer, 1], slots)
        self.trace.append(f"# pool engine: write_slots positions [{a}, {b})")

    def op_pool_decode(self) -> None:
        pool, inp, bs = self.pool, self.inp, self.bs
        if not self.pseqs:
            return
        pid = inp.pick(list(self.pseqs))
        ps = self.pseqs[pid]
        if len(ps.tokens) >= MAX_TOKENS:
            return
        n = len(ps.tokens)
        if n % bs == 0:
            new = self.call(
                "pool.allocate(1)", pool.allocate, 1, expect=(OutOfBlocksError,), atomic=False
            )
            if isinstance(new, Err):
                return
            ps.table.append(int(new[0]))
        t = inp.int(0, 3)
        ps.tokens.append(t)
        ps.hs.append(_mix(ps.hs[-1] if ps.hs else root_of(ps.salt), t))
        self.pool_write(ps, n, n + 1)
        if (n + 1) % bs == 0:
            i = n // bs
            block = ps.tokens[i * bs : (i + 1) * bs]
            if i == 0:
                h = self.pool_hashes(ps.salt, block)
            else:
                h = kvblocks.hash_blocks(block, bs, parent=ps.hashes[i - 1], key=KEY)
            full = self.pool_hashes(ps.salt, ps.tokens)
            if not np.array_equal(h[0], full[i]):
                raise self.finding(
                    "hash-chain", "hash_blocks(parent=h[i-1]) != hash_blocks of the whole prefix"
                )
            ps.hashes = full
            self.call(f"pool.cache([{ps.table[i]}], {fmt(h)})", pool.cache, [ps.table[i]], h)

    def op_pool_free(self) -> None:
        if not self.pseqs:
            return
        pid = self.inp.pick(list(self.pseqs))
        ps = self.pseqs.pop(pid)
        self.call(f"pool.free({ps.table[::-1]})", self.pool.free, ps.table[::-1])

    def op_pool_probe(self) -> None:
        pool, inp = self.pool, self.inp
        src = [(p.salt, p.tokens) for p in self.pseqs.values()]
        if not src:
            return
        salt, toks = inp.pick(src)
        h = self.pool_hashes(salt, toks)
        hit = self.call(f"pool.lookup({fmt(h)})", pool.lookup, h, atomic=False)
        self.check_block_bytes(
            self.pcache, hit.tolist(), prefix_hashes(root_of(salt), toks), "pool.lookup"
        )

    def op_pool_bad(self) -> None:
        """Block-level misuse: each must raise and change nothing."""
        pool, inp = self.pool, self.inp
        refs = pool.ref_counts()
        nb = pool.num_blocks
        free_uncached = [b for b in range(1, nb) if refs[b] == 0 and not pool.is_cached(b)]
        free_any = [b for b in range(1, nb) if refs[b] == 0]
        used = [b for b in range(1, nb) if refs[b] > 0]
        cases = [
            ("pool.free([0])", pool.free, [0]),
            (f"pool.free([{nb}])", pool.free, [nb]),
            ("pool.free([-1])", pool.free, [-1]),
            ("pool.incref([0])", pool.incref, [0]),
            ("pool.lookup(np.zeros((1, 2), np.int64))", pool.lookup, np.zeros((1, 2), np.int64)),
            ("pool.ref_count(True)", pool.ref_count, True),
            ("pool.ref_count(1.0)", pool.ref_count, 1.0),
            ("pool.free([True])", pool.free, [True]),
        ]
        if free_any:
            b = inp.pick(free_any)
            cases.append((f"pool.free([{b}])  # a free block", pool.free, [b]))
        if free_uncached:
            b = inp.pick(free_uncached)
            cases.append((f"pool.incref([{b}])  # a free, uncached block", pool.incref, [b]))
        if used:
            b = inp.pick(used)
            cases.append(
                (
                    f"pool.free([{b}] * {int(refs[b]) + 1})  # one too many",
                    pool.free,
                    [b] * (int(refs[b]) + 1),
                )
            )
        text, fn, arg = inp.pick(cases)
        self.call(
            text,
            fn,
            arg,
            expect=(InvalidArgumentError, InvalidStateError, InvalidTypeError, OutOfBlocksError),
            must_fail=True,
            kind="pool-misuse",
        )
        if used and inp.bool():  # cache() with a wrong number of hashes, or a free block
            b = inp.pick(used)
            self.call(
                f"pool.cache([{b}, {b}], <1 hash>)",
                pool.cache,
                [b, b],
                np.zeros((1, 2), np.uint64),
                expect=(InvalidArgumentError,),
                must_fail=True,
                kind="pool-misuse",
            )
        if free_uncached and inp.bool():
            b = inp.pick(free_uncached)
            self.call(
                f"pool.cache([{b}], <hash>)  # a free block",
                pool.cache,
                [b],
                np.array([[b, 7]], np.uint64),
                expect=(InvalidArgumentError, InvalidStateError),
                must_fail=True,
                kind="pool-misuse",
            )

    def op_pool_reset(self) -> None:
        pool = self.pool
        refs = pool.ref_counts()
        busy = any(pool.is_cached(b) and refs[b] > 0 for b in range(1, pool.num_blocks))
        self.call(
            "pool.reset_prefix_cache()",
            pool.reset_prefix_cache,
            expect=(InvalidStateError,) if busy else (),
            must_fail=busy,
        )

    # ------------------------------------------------------------------------------------------
    OPS = [  # (weight, method name)
        (5, "op_add"),
        (3, "op_append"),
        (8, "op_step"),
        (3, "op_fork"),
        (3, "op_free"),
        (2, "op_swap_out"),
        (2, "op_swap_in"),
        (2, "op_reserve"),
        (2, "op_truncate"),
        (1, "op_drain"),
        (1, "op_reset_cache"),
        (1, "op_queries"),
        (1, "op_commit_bad"),
        (2, "op_hostile_id"),
        (2, "op_bad_scalar"),
        (1, "op_reentrant"),
        (2, "op_pool_admit"),
        (2, "op_pool_decode"),
        (1, "op_pool_free"),
        (1, "op_pool_probe"),
        (1, "op_pool_bad"),
        (1, "op_pool_reset"),
    ]
    TABLE = [name for w, name in OPS for _ in range(w)]

    def run(self) -> int:
        self.verify()
        n = 0
        while self.inp.left() and n < MAX_OPS:
            name = self.inp.pick(self.TABLE)
            self.op = name
            self.ops_run.append(name)
            self.trace.append(f"# -- {name}")
            getattr(self, name)()
            self.verify()
            n += 1
        self.op = "final drain"
        self.drain(False)
        self.verify()
        return n


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
IGNORE = {k for k in os.environ.get("KVB_FUZZ_IGNORE", "").split(",") if k}


def run_input(data: bytes) -> None:
    """One fuzz input. Raises Finding unless its kind is in KVB_FUZZ_IGNORE."""
    h = Harness(Input(data))
    try:
        h.run()
    except Finding as f:
        if f.kind not in IGNORE:
            raise


def test_one_input(data: bytes) -> None:  # atheris entry
    run_input(data)


# hot checking code whose branches say nothing new about the core (and cost time)
_NOT_INSTRUMENTED = {
    "snapshot",
    "verify",
    "readback",
    "check_block_bytes",
    "probe_check",
    "render",
    "finding",
    "pool_verify",
    "expected_slots",
    "check_meta",
    "live",
    "pick_live",
    "pick_any_id",
    "new_id",
    "tokens",
    "as_tokens",
    "salt",
    "pool_write",
    "settled",
    "mark_unsettled",
    "run",
    "__init__",
}


def _instrument_harness() -> None:
    """Coverage of the harness's own branches (which call failed how, which rule held): the
    C core built by gcc gives libFuzzer no coverage, so these branches are its proxy."""
    for name, obj in list(Harness.__dict__.items()):
        if callable(obj) and hasattr(obj, "__code__") and name not in _NOT_INSTRUMENTED:
            setattr(Harness, name, atheris.instrument_func(obj))


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
        with open(path, "rb") as f:
            data = f.read()
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
    rng = random.Random(seed)
    found: Dict[str, Tuple[int, str, Finding]] = {}
    if save:
        os.makedirs(save, exist_ok=True)
    t0 = time.perf_counter()
    n = 0
    while n < runs and time.perf_counter() - t0 < seconds:
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(8, max_len)))
        n += 1
        if save:  # kept on disk while it runs: a sanitizer report aborts the process
            with open(os.path.join(save, "last-input"), "wb") as fh:
                fh.write(data)
        f = _try(data)
        if f is not None and f.kind not in IGNORE:
            name = f"random-{seed}-{n}"
            if save:
                name = os.path.join(save, "crash-" + hashlib.sha1(data).hexdigest())
                with open(name, "wb") as fh:
                    fh.write(data)
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
    with open(path, "rb") as fh:
        data = fh.read()
    f = _try(data)
    if f is None:
        print("no finding: nothing to minimize")
        return 1
    key = f.key  # the same rule broken in the same harness op
    chunk = max(1, len(data) // 2)
    while chunk >= 1:
        i, changed = 0, False
        while i < len(data):
            cand = data[:i] + data[i + chunk :]
            g = _try(cand)
            if g is not None and g.key == key:
                data, changed = cand, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    for i in range(len(data)):  # smaller byte values decode to simpler calls
        for v in (0, 1, 2):
            if data[i] > v:
                cand = data[:i] + bytes([v]) + data[i + 1 :]
                g = _try(cand)
                if g is not None and g.key == key:
                    data = cand
                    break
    dest = out or path + ".min"
    with open(dest, "wb") as fh:
        fh.write(data)
    print(f"{key}: {len(data)} bytes -> {dest}\n")
    print(_try(data))
    return 0


def main(argv: List[str]) -> int:
    if not any(a in argv for a in ("--replay", "--random", "--minimize", "--show")):
        if atheris is None:
            print(
                "atheris is not installed: use --replay FILES or --random N (see fuzz/README.md)",
                file=sys.stderr,
            )
            return 2
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
        with open(args.show, "rb") as fh:
            h = Harness(Input(fh.read()))
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
