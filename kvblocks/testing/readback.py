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

KV cache groups (``BlockManager(groups=...)``, docs/hybrid-models.md) are read back in the
memory model of vLLM's hybrid allocator: one cache of ``num_layers`` layers over the pool's
block ids, and the k-th layer of *every* group stores into cache layer k of the blocks in that
group's tables (a block belongs to one group at a time, so the groups share the memory). The
K/V of a token, and the content of a state block, depend on its group too: a block that two
groups use at once, or that one group reads after another group wrote it, is reported with the
group that wrote it. Per group, ``forward()`` builds ``metadata(..., group=g)`` for every
group before writing any (as an engine builds all of its step's metadata first), then writes
through each group's own slot mapping; a state group (no per-token slots, slot -1) has the
whole of its S blocks written by every step that computes something, with content derived from
the prefix hash of the step's last query (committed or draft). ``assert_reads_back`` then
checks, per group, what the next step still reads:

* full: every computed position;
* sliding window W / chunked local C: the computed positions from the first one the next
  query reads (``first_needed``: ``q0 - W + 1`` or ``q0 - q0 % C`` with
  ``q0 = min(computed, tokens - 1)``) on; their table entries must not be the null block,
  and every other computed position whose entry is not null (a held block the window has not
  moved past yet) must hold its own bytes too. Released entries are never read;
* state S: its S blocks hold the state the last step that computed something wrote (a fork's
  child the parent's, through the copies of ``take_copies``).

>>> from kvblocks import BlockManager
>>> mgr = BlockManager(16, 4)
>>> rb = KVReadback(mgr)
>>> rb.add("a", [1, 2, 3, 4, 5])
0
>>> _ = rb.forward(["a"])
>>> rb.append_batch(["a"], [6]); _ = rb.forward(["a"])
>>> rb.assert_reads_back(mgr, "a")

With groups, the same calls; each group reads back its own in-window history:

>>> from kvblocks import KVGroup
>>> mgr = BlockManager(32, 4, groups=(KVGroup("full"), KVGroup("sliding_window", window=3)))
>>> rb = KVReadback(mgr)
>>> rb.add("a", list(range(10)))
0
>>> _ = rb.forward(["a"])
>>> rb.append_batch(["a"], [7]); _ = rb.forward(["a"])
>>> mgr.block_table("a", group=1).tolist()  # the next query (position 10) reads [8, 10]
[0, 0, 6]
>>> rb.assert_all()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import ops
from ..groups import KVGroup
from ..layout import KVLayout
from ..storage import KVCache

__all__ = ["KVReadback", "ReadbackError", "first_needed"]

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


def first_needed(
    group: KVGroup, computed: int, ntokens: int, query_start: Optional[int] = None
) -> int:
    """The first position the next step of a sequence reads in ``group``
    (docs/hybrid-models.md): 0 for full and state groups; for a sliding window W
    ``q0 - W + 1``, for a chunk C ``q0 - q0 % C`` (at least 0), where
    ``q0 = min(computed, ntokens - 1, query_start)`` is the step's first query.

    >>> first_needed(KVGroup("sliding_window", window=4), 10, 11)
    7
    >>> first_needed(KVGroup("chunked_local", chunk=4), 10, 11, query_start=7)
    4
    """
    if group.kind not in ("sliding_window", "chunked_local"):
        return 0
    q0 = min(computed, ntokens - 1)
    if query_start is not None:
        q0 = min(q0, query_start)
    if q0 <= 0:
        return 0
    if group.kind == "sliding_window":
        return max(0, q0 - group.span + 1)
    return q0 - q0 % group.span


def state_hashes(state: int, count: int) -> List[int]:
    """The per-slot hashes whose K/V fill a state group's blocks for the state ``state``."""
    return [_mix(state ^ _mix(0x57A7E << 32 | i)) for i in range(count)]


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
    host_tables: Optional[List[np.ndarray]] = None  # per group: host blocks while swapped out
    state: Optional[int] = None  # the state the last step wrote (state groups), None: none yet

    def copy(self) -> "_Expected":
        return _Expected(
            list(self.tokens),
            list(self.hashes),
            self.computed,
            [],
            self.swapped,
            self.host_tables,
            self.state,
        )


class KVReadback:
    """Device and host K/V caches next to a BlockManager, checked byte for byte.

    ``mgr`` is the manager under test (``BlockManager``, or anything with its methods). The
    layout keywords pick the cache geometry; the block size is the manager's. With KV cache
    groups (``mgr.groups``), ``num_layers`` is the layers of each group, all groups sharing
    the cache's layers (see the module).
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
        self.groups: Tuple[KVGroup, ...] = tuple(getattr(mgr, "groups", None) or (KVGroup(),))
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
        self.last_metadata: Tuple = ()  # every group's metadata of the last forward()
        # forward() alternates between the v1 calls (metadata per group, each declaring its
        # group's step) and one plan_step with each group's metadata written from the plan,
        # so that every machine and read-back test checks both paths' bytes
        self._forwards = 0
        self._token_bytes = num_kv_heads * head_dim * self.layout.itemsize
        self._words = -(-self._token_bytes // 8)

    # -- the K/V of a token ----------------------------------------------------------------
    def kv(
        self, hashes: Sequence[int], layer: int, group: int = 0
    ) -> Tuple[np.ndarray, np.ndarray]:
        """K and V ``[n, num_kv_heads, head_dim]`` (storage dtype) of tokens whose prefix
        hashes are ``hashes``, in ``layer`` of ``group``."""
        lay = self.layout
        h = np.asarray(list(hashes), dtype=np.uint64).reshape(-1, 1)
        idx = np.arange(self._words, dtype=np.uint64).reshape(1, -1)
        out = []
        for which in (0, 1):
            salt = np.uint64(_mix(((group << 16 | layer) << 1 | which) + 1))
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
        """``mgr.swap_out``; the host table of each group is its device table with every
        block that is not null replaced by the host block of its pair (pairs come group after
        group, in table order)."""
        held = [self._table(seq_id, g) != 0 for g in range(len(self.groups))]
        pairs = np.asarray(self.mgr.swap_out(seq_id))
        if len(pairs) != sum(int(h.sum()) for h in held):
            raise ReadbackError(
                f"swap_out({seq_id!r}) gave {len(pairs)} pairs for "
                f"{sum(int(h.sum()) for h in held)} held blocks"
            )
        tables, k = [], 0
        for h in held:
            t = np.zeros(len(h), dtype=np.int64)
            t[h] = pairs[k : k + int(h.sum()), 1]
            k += int(h.sum())
            tables.append(t)
        e = self.expected[seq_id]
        e.swapped, e.host_tables, e.drafts = True, tables, []
        self._swaps.append(("out", pairs))
        return pairs

    def swap_in(self, seq_id) -> np.ndarray:
        pairs = np.asarray(self.mgr.swap_in(seq_id))
        e = self.expected[seq_id]
        e.swapped, e.host_tables = False, None
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
        after row i's committed ones) of every group (every other call through ``plan_step``
        and the plan's writers), then ``write_slots`` of their K/V on
        every layer through each group's slot mapping (a state group: its blocks, whole).
        Returns group 0's metadata (every group's: ``last_metadata``)."""
        seq_ids = list(seq_ids)
        rows = [self.expected[sid] for sid in seq_ids]
        if query_lens is None:
            query_lens = [len(e.tokens) - e.computed for e in rows]
        query_lens = [int(q) for q in query_lens]
        kw = {}
        if drafts is None:
            drafts = [[] for _ in seq_ids]
        else:
            drafts = [[int(t) for t in d] for d in drafts]
            kw["draft_lens"] = [len(d) for d in drafts]
        self._forwards += 1
        if self._forwards % 2 == 0 and hasattr(self.mgr, "plan_step"):
            plan = self.mgr.plan_step(seq_ids, query_lens, **kw)
            metas = tuple(plan.metadata(g) for g in range(len(self.groups)))
        else:
            metas = tuple(
                self.mgr.metadata(seq_ids, query_lens, **kw, **({"group": g} if g else {}))
                for g in range(len(self.groups))
            )
        hashes, labels = [], []
        for sid, e, q, d in zip(seq_ids, rows, query_lens, drafts):
            n = len(e.tokens)
            hashes += e.hashes[n - q : n]
            labels += [(sid, p, e.tokens[p]) for p in range(n - q, n)]
            prev = e.hashes[-1] if e.hashes else _SEED
            hashes += prefix_hashes(d, prev, n)
            labels += [(sid, n + j, f"draft {t}") for j, t in enumerate(d)]
        writes = []  # per group: (slots, hashes, labels) of what it writes
        for g, (group, meta) in enumerate(zip(self.groups, metas)):
            slots = np.asarray(meta.slot_mapping, dtype=np.int64)
            if len(slots) < len(hashes):
                raise ReadbackError(
                    f"metadata{self._of(g)} gave {len(slots)} slots for {len(hashes)} queries"
                )
            slots = slots[: len(hashes)]
            if group.kind == "state":
                if (slots != -1).any():
                    raise ReadbackError(f"metadata{self._of(g)}: a state group maps queries")
                writes.append(self._state_writes(g, meta, seq_ids, rows, query_lens, drafts))
            else:
                names = [self._label(x, g) for x in labels]
                writes.append((slots, hashes, names))
        first: Dict[int, Tuple[int, int]] = {}  # slot -> (group, index) writing it first
        kept = []
        for g, (slots, h, names) in enumerate(writes):
            keep = []
            for i, slot in enumerate(slots.tolist()):
                if slot < 0:
                    continue
                gj, j = first.setdefault(slot, (g, i))
                if (gj, j) == (g, i):
                    keep.append(i)
                elif gj != g or writes[gj][1][j] != h[i]:
                    raise ReadbackError(
                        f"one step writes two different K/V into slot {slot} (block "
                        f"{slot // self.layout.block_size}): {writes[gj][2][j]} and {names[i]}"
                    )
            kept.append((slots[keep], [h[i] for i in keep], [names[i] for i in keep]))
        for g, (slots, h, names) in enumerate(kept):
            if not len(slots):
                continue
            for layer in range(self.layout.num_layers):
                k, v = self.kv(h, layer, g)
                ops.write_slots(self.cache, layer, k, v, slots)
                for row, name in enumerate(names):
                    self._origin[k[row].tobytes()] = name
        for e, q, d in zip(rows, query_lens, drafts):
            e.computed = len(e.tokens)
            e.drafts = d
            if q or d:
                e.state = self._state_of(e, d)
        self.last_metadata = metas
        return metas[0]

    def _state_of(self, e: _Expected, drafts: List[int]) -> int:
        """The state a step whose last query is the end of ``e``'s tokens + ``drafts``
        writes: the prefix hash of that query."""
        prev = e.hashes[-1] if e.hashes else _SEED
        return (prefix_hashes(drafts, prev, len(e.tokens)) or [prev])[-1]

    def _state_writes(self, g: int, meta, seq_ids, rows, query_lens, drafts):
        """The slots, hashes and labels of state group g's blocks for the rows that compute
        something: every slot of their S blocks, as the metadata's block table row gives
        them."""
        bs, span = self.layout.block_size, self.groups[g].span
        table = np.asarray(meta.block_tables)
        slots: List[int] = []
        hashes: List[int] = []
        names: List[str] = []
        for row, (sid, e, q, d) in enumerate(zip(seq_ids, rows, query_lens, drafts)):
            if not (q or d):
                continue
            blocks = table[row, :span].tolist()
            if len(blocks) != span or 0 in blocks:
                raise ReadbackError(
                    f"metadata{self._of(g)}: sequence {sid!r} has state blocks {blocks}, "
                    f"not {span} blocks"
                )
            slots += [b * bs + o for b in blocks for o in range(bs)]
            hashes += state_hashes(self._state_of(e, d), span * bs)
            names += [
                f"the state of sequence {sid!r} (group {g}, slot {i}) after position "
                f"{len(e.tokens) + len(d) - 1}"
                for i in range(span * bs)
            ]
        return np.asarray(slots, dtype=np.int64), hashes, names

    # -- the check ---------------------------------------------------------------------------------
    def assert_reads_back(self, mgr, seq_id) -> None:
        """Gather what the next step of ``seq_id`` reads, in every group, through
        ``mgr.block_table`` (the host tables while swapped out) and compare K and V byte for
        byte on every layer: all computed positions of a full group; those from
        :func:`first_needed` on of a window or chunk group (their entries must not be null),
        with every computed position of a block it still holds; a state group's blocks."""
        e = self.expected[seq_id]
        if e.swapped and any(kind == "out" for kind, _ in self._swaps):
            raise ReadbackError("swap pairs not drained yet: call drain() first")
        for g, group in enumerate(self.groups):
            where = "host" if e.swapped else "device"
            if e.swapped:
                assert e.host_tables is not None and self.host is not None  # swapped: a host
                cache, table = self.host, e.host_tables[g]
            else:
                cache, table = self.cache, self._table(seq_id, g, mgr)
            if group.kind == "state":
                self._check_state(seq_id, e, g, cache, table, where)
            else:
                self._check_tokens(seq_id, e, g, cache, table, where)

    def _check_tokens(self, seq_id, e: _Expected, g: int, cache, table, where: str) -> None:
        n, bs = e.computed, self.layout.block_size
        if n == 0:
            return
        if len(table) < -(-n // bs):
            raise ReadbackError(
                f"sequence {seq_id!r}{self._in(g)}: {n} computed positions but its "
                f"{where} table has {len(table)} blocks of {bs}"
            )
        lo = first_needed(self.groups[g], n, len(e.tokens))
        null = [i for i in range(lo // bs, -(-n // bs)) if table[i] == 0]
        if null:
            raise ReadbackError(
                f"sequence {seq_id!r}{self._in(g)}: its next step reads positions from {lo} "
                f"on ({n} computed, {len(e.tokens)} committed) but {where} table entries "
                f"{null} are the null block (released); {where} table {table.tolist()}"
            )
        pos = np.arange(n)
        check = pos[np.asarray(table)[pos // bs] != 0]  # never a released position
        self._compare(seq_id, e, g, cache, table, where, e.hashes[:n], check, n)

    def _check_state(self, seq_id, e: _Expected, g: int, cache, table, where: str) -> None:
        span, bs = self.groups[g].span, self.layout.block_size
        if len(table) != span or (np.asarray(table) == 0).any():
            raise ReadbackError(
                f"sequence {seq_id!r}{self._in(g)}: {where} state table {table.tolist()} is "
                f"not {span} blocks"
            )
        if e.state is None:  # no step has written it yet
            return
        n = span * bs
        self._compare(seq_id, e, g, cache, table, where, state_hashes(e.state, n), np.arange(n), n)

    def _compare(self, seq_id, e, g, cache, table, where, hashes, check, n) -> None:
        """K and V of positions ``check`` (of the first ``n`` through ``table``) against the
        K/V of ``hashes`` on every layer of group g."""
        if not len(check):
            return
        bs = self.layout.block_size
        state = self.groups[g].kind == "state"
        for layer in range(self.layout.num_layers):
            want = self.kv([hashes[i] for i in check.tolist()], layer, g)
            got = ops.gather(cache, layer, np.asarray(table), n)
            for name, w, gg in zip("KV", want, got):
                w8 = w.reshape(len(check), -1).view(np.uint8)
                g8 = np.ascontiguousarray(gg[check]).reshape(len(check), -1).view(np.uint8)
                bad = check[(w8 != g8).any(axis=1)]
                if bad.size:
                    p = int(bad[0])
                    found = self._what(got[0][p])
                    what = (
                        f"state slot {p} of its {n}"
                        if state
                        else f"position {p} (token {e.tokens[p]}) of {e.computed} computed"
                    )
                    raise ReadbackError(
                        f"sequence {seq_id!r} reads back wrong K/V{self._in(g)}: {what}, layer "
                        f"{layer}, {name}, {where} block {int(table[p // bs])} offset {p % bs}: "
                        f"holds {found}; {bad.size} of {len(check)} positions wrong (first "
                        f"ones: {bad[:8].tolist()}); {where} table {np.asarray(table).tolist()}"
                    )

    def _table(self, seq_id, g: int, mgr=None) -> np.ndarray:
        mgr = self.mgr if mgr is None else mgr
        return np.asarray(mgr.block_table(seq_id, group=g) if g else mgr.block_table(seq_id))

    def _in(self, g: int) -> str:
        return f" in group {g} ({self.groups[g]!r})" if len(self.groups) > 1 else ""

    def _of(self, g: int) -> str:
        return f"(group={g})" if len(self.groups) > 1 else ""

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
    def _label(self, label, group: int = 0) -> str:
        sid, pos, tok = label
        return f"sequence {sid!r} position {pos} (token {tok}){self._in(group)}"

    def _what(self, k_row: np.ndarray) -> str:
        raw = np.ascontiguousarray(k_row).view(np.uint8)
        if (raw == POISON).all():
            return "bytes never written (poison)"
        label = self._origin.get(raw.tobytes())
        if label is not None:
            return f"the K/V written for {label}"
        return "bytes written for something else"
