"""KVReadback: drive a BlockManager the way an engine does and check the bytes.

The allocator can be wrong in ways that its own bookkeeping never shows: a prefix hit on a
block whose K/V were never written, a copy-on-write copy that runs too late or reads a block
that changed hands, a swap that reads the wrong block. The only test that sees all of them is
the one an engine would fail: write every token's K and V where ``metadata`` says, move the
blocks with ``take_copies`` / ``swap_out`` / ``swap_in`` through :mod:`kvblocks.ops`, and
gather each sequence back through its block table.

:class:`KVReadback` holds a numpy device cache and a host cache, wraps the manager's calls
(``add``, ``append``, ``append_batch``, ``reserve``, ``truncate``, ``fork``, ``free``,
``swap_out``, ``swap_in``) to keep, next to the manager, what each sequence should read back:
its committed tokens and how many of them were computed. ``drain()`` runs the pending
host-tier offloads and onloads, swaps and copies, ``forward()`` is the step (``metadata`` then ``write_slots`` on every layer), and
``assert_reads_back(mgr, seq_id)`` gathers every computed position and compares its K and V
byte for byte.

The K/V of a token is a deterministic function of its position and the whole token prefix
up to it (a 64-bit hash chain), so identical prefixes have identical K/V (what prefix caching
relies on) and a value read at the wrong place names where it came from. Both caches start
filled with a poison byte, so a slot that was never written is reported as such.

>>> from kvblocks import BlockManager
>>> mgr = BlockManager(16, 4)
>>> rb = KVReadback(mgr)
>>> rb.add("a", [1, 2, 3, 4, 5])
0
>>> _ = rb.forward(["a"])
>>> rb.append_batch(["a"], [6]); _ = rb.forward(["a"])
>>> rb.assert_reads_back(mgr, "a")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import ops
from ..layout import KVLayout
from ..storage import KVCache

__all__ = ["KVReadback", "ReadbackError"]

POISON = 0xA5  # every byte of both caches before anything is written
_M64 = (1 << 64) - 1
_SEED = 0x5EED_C0DE_1234_5678


class ReadbackError(AssertionError):
    """A sequence does not read back its own K/V (or the engine protocol was broken)."""


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix_np(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def chain(prev: int, position: int, token: int) -> int:
    """The prefix hash of the token at ``position`` after a prefix hashing to ``prev``."""
    return _mix(prev ^ _mix(((token & 0xFFFFFFFF) << 32) | (position & 0xFFFFFFFF)))


def prefix_hashes(tokens: Sequence[int], prev: int = _SEED, start: int = 0) -> List[int]:
    out = []
    for i, t in enumerate(tokens):
        prev = chain(prev, start + i, int(t))
        out.append(prev)
    return out


@dataclass
class _Expected:
    """What one sequence must read back."""

    tokens: List[int]
    hashes: List[int]  # prefix hash of each committed position
    computed: int = 0  # positions [0, computed) hold their K/V
    drafts: List[int] = field(default_factory=list)  # draft tokens written since the commit
    swapped: bool = False
    host_table: Optional[np.ndarray] = None  # host blocks while swapped out

    def copy(self) -> "_Expected":
        return _Expected(
            list(self.tokens), list(self.hashes), self.computed, [], self.swapped, self.host_table
        )


class KVReadback:
    """Device and host K/V caches next to a BlockManager, checked byte for byte.

    ``mgr`` is the manager under test (``BlockManager``, or anything with its methods). The
    layout keywords pick the cache geometry; the block size is the manager's.
    """

    def __init__(
        self,
        mgr,
        *,
        num_layers: int = 2,
        num_kv_heads: int = 2,
        head_dim: int = 4,
        dtype: str = "bf16",
        kind: str = "NHD",
        joint: bool = True,
    ) -> None:
        self.mgr = mgr
        self.layout = KVLayout(
            num_layers, num_kv_heads, head_dim, mgr.block_size, dtype, kind=kind, joint=joint
        )
        self.cache = KVCache(self.layout, mgr.pool.num_blocks, device="cpu", pin_memory=False)
        host_pool = getattr(mgr, "host_pool", None)
        self.host = (
            KVCache(self.layout, host_pool.num_blocks, device="cpu", pin_memory=False)
            if host_pool is not None
            else None
        )
        for c in (self.cache, self.host):
            if c is not None:
                c.planes[...] = POISON
        self.expected: Dict[object, _Expected] = {}
        self._swaps: List[Tuple[str, np.ndarray]] = []  # returned by swap_*, not yet run
        self._origin: Dict[bytes, str] = {}  # K bytes -> what they were written for
        self._token_bytes = num_kv_heads * head_dim * self.layout.itemsize
        self._words = -(-self._token_bytes // 8)

    # -- the K/V of a token ----------------------------------------------------------------
    def kv(self, hashes: Sequence[int], layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """K and V ``[n, num_kv_heads, head_dim]`` (storage dtype) of tokens whose prefix
        hashes are ``hashes``."""
        lay = self.layout
        h = np.asarray(list(hashes), dtype=np.uint64).reshape(-1, 1)
        idx = np.arange(self._words, dtype=np.uint64).reshape(1, -1)
        out = []
        for which in (0, 1):
            salt = np.uint64(_mix((layer << 1 | which) + 1))
            words = _mix_np((h ^ salt) + idx * np.uint64(0x9E3779B97F4A7C15))
            raw = np.ascontiguousarray(words).view(np.uint8)[:, : self._token_bytes]
            out.append(
                np.ascontiguousarray(raw)
                .view(lay.storage_dtype)
                .reshape(len(h), lay.num_kv_heads, lay.head_dim)
            )
        return out[0], out[1]

    # -- the manager's calls, with what each sequence must read back ---------------------------
    def add(self, seq_id, tokens, *, salt=None) -> int:
        tokens = [int(t) for t in tokens]
        cached = self.mgr.add(seq_id, np.array(tokens, dtype=np.int64), salt=salt)
        self.expected[seq_id] = _Expected(tokens, prefix_hashes(tokens), computed=int(cached))
        return cached

    def append(self, seq_id, tokens, *, computed: bool = False) -> None:
        tokens = [int(t) for t in tokens]
        e = self.expected[seq_id]
        if computed:
            if tokens != e.drafts[: len(tokens)]:
                raise ReadbackError(
                    f"append({seq_id!r}, computed=True): {tokens} are not the "
                    f"draft tokens {e.drafts} the last step wrote"
                )
            self.mgr.append(seq_id, tokens, computed=True)
        else:
            self.mgr.append(seq_id, tokens)
        self._commit(e, tokens)
        if computed:
            e.computed = len(e.tokens)

    def append_batch(self, seq_ids, tokens) -> None:
        seq_ids, tokens = list(seq_ids), [int(t) for t in tokens]
        self.mgr.append_batch(seq_ids, tokens)
        for sid, t in zip(seq_ids, tokens):
            self._commit(self.expected[sid], [t])

    def reserve(self, seq_id, n: int) -> None:
        self.mgr.reserve(seq_id, n)

    def truncate(self, seq_id, n: int) -> None:
        self.mgr.truncate(seq_id, n)
        e = self.expected[seq_id]
        del e.tokens[n:], e.hashes[n:]
        e.computed = min(e.computed, n)
        e.drafts = []

    def fork(self, parent, child) -> None:
        self.mgr.fork(parent, child)
        self.expected[child] = self.expected[parent].copy()

    def free(self, seq_id) -> None:
        self.mgr.free(seq_id)
        del self.expected[seq_id]

    def swap_out(self, seq_id) -> np.ndarray:
        pairs = np.asarray(self.mgr.swap_out(seq_id))
        e = self.expected[seq_id]
        e.swapped, e.host_table, e.drafts = True, pairs[:, 1].copy(), []
        self._swaps.append(("out", pairs))
        return pairs

    def swap_in(self, seq_id) -> np.ndarray:
        pairs = np.asarray(self.mgr.swap_in(seq_id))
        e = self.expected[seq_id]
        e.swapped, e.host_table = False, None
        self._swaps.append(("in", pairs))
        return pairs

    def _commit(self, e: _Expected, tokens: List[int]) -> None:
        prev = e.hashes[-1] if e.hashes else _SEED
        e.hashes += prefix_hashes(tokens, prev, len(e.tokens))
        e.tokens += tokens
        e.drafts = []

    # -- the step --------------------------------------------------------------------------------
    @property
    def pending_swaps(self) -> int:
        """Swap pair arrays returned by swap_out / swap_in and not run by drain() yet."""
        return len(self._swaps)

    @property
    def settled(self) -> bool:
        """No onload, copy-on-write copy or swap is waiting to run: the device cache holds
        what every sequence must read back (pending offloads only fill the host tier)."""
        return (
            not self._swaps
            and not self.mgr.num_pending_copies
            and not getattr(self.mgr, "num_pending_onloads", 0)
        )

    def drain(self, *, swaps_first: bool = True) -> np.ndarray:
        """The documented drain (docs/engine-integration.md, docs/host-tier.md): with a
        host tier, ``take_offloads()`` -> ``ops.swap_blocks(cache, host)`` first, then
        ``take_onloads()`` -> ``ops.swap_blocks(host, cache)``; then the swap pairs returned
        since the last drain -> ``ops.swap_blocks``, in the order the calls returned them, then
        ``take_copies()`` -> ``ops.copy_blocks`` (one call), last. ``swaps_first=False`` runs
        the copies before the swaps, an order that is only safe when no swap_out of the same
        schedule phase released a block a copy writes (a test of that misuse). Returns the
        copies."""
        if getattr(self.mgr, "host_prefix_cache", False):
            assert self.host is not None  # a host tier has a host pool
            offloads = np.asarray(self.mgr.take_offloads())
            if len(offloads):
                ops.swap_blocks(self.cache, self.host, offloads)
            onloads = np.asarray(self.mgr.take_onloads())
            if len(onloads):
                ops.swap_blocks(self.host, self.cache, onloads)
        copies = np.asarray(self.mgr.take_copies())
        swaps, self._swaps = self._swaps, []

        def run_copies():
            if len(copies):
                ops.copy_blocks(self.cache, copies)

        def run_swaps():
            for kind, pairs in swaps:
                if len(pairs):
                    src, dst = (self.cache, self.host) if kind == "out" else (self.host, self.cache)
                    ops.swap_blocks(src, dst, pairs)

        for run in (run_swaps, run_copies) if swaps_first else (run_copies, run_swaps):
            run()
        return copies

    def forward(self, seq_ids, query_lens=None, *, drafts=None):
        """One forward step: ``metadata`` for the rows (query: every committed token not yet
        computed, unless ``query_lens`` says otherwise; ``drafts[i]``: draft tokens to write
        after row i's committed ones), then ``write_slots`` of their K/V on every layer.
        Returns the metadata."""
        seq_ids = list(seq_ids)
        rows = [self.expected[sid] for sid in seq_ids]
        if query_lens is None:
            query_lens = [len(e.tokens) - e.computed for e in rows]
        query_lens = [int(q) for q in query_lens]
        if drafts is None:
            meta = self.mgr.metadata(seq_ids, query_lens)
            drafts = [[] for _ in seq_ids]
        else:
            drafts = [[int(t) for t in d] for d in drafts]
            meta = self.mgr.metadata(seq_ids, query_lens, draft_lens=[len(d) for d in drafts])
        hashes, labels = [], []
        for sid, e, q, d in zip(seq_ids, rows, query_lens, drafts):
            n = len(e.tokens)
            hashes += e.hashes[n - q : n]
            labels += [(sid, p, e.tokens[p]) for p in range(n - q, n)]
            prev = e.hashes[-1] if e.hashes else _SEED
            hashes += prefix_hashes(d, prev, n)
            labels += [(sid, n + j, f"draft {t}") for j, t in enumerate(d)]
        slots = np.asarray(meta.slot_mapping, dtype=np.int64)
        if len(slots) < len(hashes):
            raise ReadbackError(f"metadata gave {len(slots)} slots for {len(hashes)} queries")
        slots = slots[: len(hashes)]
        first: Dict[int, int] = {}
        for i, slot in enumerate(slots.tolist()):
            j = first.setdefault(slot, i)
            if hashes[j] != hashes[i] and slot >= 0:
                raise ReadbackError(
                    f"one step writes two different K/V into slot {slot} (block "
                    f"{slot // self.layout.block_size}): {self._label(labels[j])} and "
                    f"{self._label(labels[i])}"
                )
        keep = sorted(i for i in first.values() if slots[i] >= 0)
        h = [hashes[i] for i in keep]
        for layer in range(self.layout.num_layers):
            k, v = self.kv(h, layer)
            ops.write_slots(self.cache, layer, k, v, slots[keep])
            for row, i in enumerate(keep):
                self._origin[k[row].tobytes()] = self._label(labels[i])
        for e, d in zip(rows, drafts):
            e.computed = len(e.tokens)
            e.drafts = d
        return meta

    # -- the check ---------------------------------------------------------------------------------
    def assert_reads_back(self, mgr, seq_id) -> None:
        """Gather every computed position of ``seq_id`` through ``mgr.block_table`` (the host
        table while swapped out) and compare K and V byte for byte on every layer."""
        e = self.expected[seq_id]
        n, bs = e.computed, self.layout.block_size
        if n == 0:
            return
        if e.swapped:
            if any(kind == "out" for kind, _ in self._swaps):
                raise ReadbackError("swap pairs not drained yet: call drain() first")
            cache, table, where = self.host, e.host_table, "host"
            assert cache is not None and table is not None  # swapped: a host cache exists
        else:
            cache, table, where = self.cache, np.asarray(mgr.block_table(seq_id)), "device"
        if len(table) < -(-n // bs):
            raise ReadbackError(
                f"sequence {seq_id!r}: {n} computed positions but its "
                f"{where} table has {len(table)} blocks of {bs}"
            )
        for layer in range(self.layout.num_layers):
            want = self.kv(e.hashes[:n], layer)
            got = ops.gather(cache, layer, table, n)
            for name, w, g in zip("KV", want, got):
                w8 = w.reshape(n, -1).view(np.uint8)
                g8 = np.ascontiguousarray(g).reshape(n, -1).view(np.uint8)
                bad = np.flatnonzero((w8 != g8).any(axis=1))
                if bad.size:
                    p = int(bad[0])
                    found = self._what(got[0][p])
                    raise ReadbackError(
                        f"sequence {seq_id!r} reads back wrong K/V: position {p} (token "
                        f"{e.tokens[p]}) of {n} computed, layer {layer}, {name}, {where} block "
                        f"{int(table[p // bs])} offset {p % bs}: holds {found}; "
                        f"{bad.size} of {n} positions wrong (first ones: {bad[:8].tolist()}); "
                        f"{where} table {np.asarray(table).tolist()}"
                    )

    def assert_all(self, mgr=None) -> None:
        """``assert_reads_back`` for every live sequence (needs ``settled``)."""
        mgr = self.mgr if mgr is None else mgr
        if not self.settled:
            raise ReadbackError("copies or swaps are pending: drain() before checking")
        for sid in list(self.expected):
            self.assert_reads_back(mgr, sid)

    def num_computed(self, seq_id) -> int:
        return self.expected[seq_id].computed

    def tokens(self, seq_id) -> List[int]:
        return list(self.expected[seq_id].tokens)

    # -- reporting ---------------------------------------------------------------------------------
    @staticmethod
    def _label(label) -> str:
        sid, pos, tok = label
        return f"sequence {sid!r} position {pos} (token {tok})"

    def _what(self, k_row: np.ndarray) -> str:
        raw = np.ascontiguousarray(k_row).view(np.uint8)
        if (raw == POISON).all():
            return "bytes never written (poison)"
        label = self._origin.get(raw.tobytes())
        if label is not None:
            return f"the K/V written for {label}"
        return "bytes written for something else"
