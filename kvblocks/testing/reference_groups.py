"""The executable specification of a BlockManager with KV cache groups (hybrid models).

:class:`ReferenceManager` returns a :class:`GroupedReference` when it is given ``groups=``
other than the default one full-attention group. It is written from ``shared/API.md``
("Hybrid models: KV cache groups"), ``docs/hybrid-models.md`` and the header comments of
``csrc/groups.c`` / ``csrc/table.c``, as plain Python, so that the state machine in
``tests/test_groups_model.py`` can run it side by side with the C core and compare block ids
one for one. The rules it encodes:

* One pool, one block size; a sequence has one table per group, all moved in lock step
  (same committed tokens). Each group keeps its own computed count, draft slots and
  pending copies (``metadata(group=g)`` declares the step for group g only).
* The next step's first query is ``q0 = min(computed, tokens - 1, query start)``. A
  sliding window W reads ``[q0 - W + 1, q0]``, a chunk C reads ``[q0 - q0 % C, q0]``;
  whole blocks below that are released (entry -> null block 0, the reference dropped; a
  cached block stays evictable) when the sequence moves on: an append (for the longer
  sequence, only once the call is known to fit, in every group before any group
  allocates) and a step (``schedule`` / ``metadata``, with its query start).
* An append fits when its blocks (growth and copy-on-write, every group) are at most the free
  blocks plus the blocks its release returns (entries this sequence alone holds).
  ``blocks_needed`` / ``can_append`` do not count that release (conservative).
* Prefix hits: the longest block-aligned prefix (at most ``len - 1`` tokens) every group can
  serve. A full group needs all k blocks cached under its own group key; a window or chunk
  group the blocks from what the query at ``k * block_size`` reads, and at least block
  k - 1; a state group no hit at all (no snapshots of the state).
* State groups: a fixed number of blocks per sequence, never released, no hashing; fork
  copies them at once (pairs in take_copies); truncate below the computed tokens and a step
  that reads released positions are refused. Draft slots are validated as in every kind:
  they must lie within the blocks a token group's table of the sequence holds (its tokens'
  blocks, grown by reserve, cut by truncate; a fork's child starts from its tokens' blocks).
* Order where ids depend on it: group after group, in the order given; within a group the
  single-group order (see reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import _core
from ..errors import (
    CorruptionError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from .readback import first_needed
from .reference import (
    ReferenceManager,
    ReferenceMetadata,
    _ceil_div,
    _err,
    _Rules,
    scalar_of,
    seq_id_of,
    seq_ids_of,
    tokens_of,
)

__all__ = ["GroupedReference"]


@dataclass
class _Tab:
    """One group's table of one sequence."""

    blocks: List[int]  # entries below lo are the null block 0 (released)
    lo: int = 0  # released leading entries
    num_computed: int = 0
    num_offered: int = 0  # leading full blocks already offered to the prefix cache
    drafts: int = 0  # draft slots the last step of this group scheduled
    room: int = 0  # state: the blocks a token group's table would hold (drafts lie within)


@dataclass
class _GSeq:
    tokens: List[int]
    salt: Union[None, str, bytes]
    tabs: List[_Tab] = field(default_factory=list)
    swapped: bool = False


class GroupedReference(ReferenceManager):
    """ReferenceManager with KV cache groups (see the module)."""

    def __init__(self, num_blocks, block_size, *, groups, **kw) -> None:
        super().__init__(num_blocks, block_size, **kw)
        self.groups = tuple(groups)
        self._gcopies: List[List[Tuple[int, int]]] = [[] for _ in self.groups]
        self._seqs: Dict[object, Any] = {}  # sequence -> _GSeq
        full = [j for j in range(len(self.groups)) if self._kind(j) == "full"]
        if full and any(self._windowed(j) for j in range(len(self.groups))):
            self._anchor = full[0]
            self.pool.second_chance = self._twin_cached

    @staticmethod
    def _tag(key: bytes, j: int) -> int:
        """Group j's hash tag (docs/hybrid-models.md): SipHash-128(key, "kvblocks:group:" j)."""
        if not j:
            return 0
        raw = _core.siphash128(key, b"kvblocks:group:" + bytes([j]))
        return int.from_bytes(raw[:8], "little") | int.from_bytes(raw[8:], "little") << 64

    def _twin_cached(self, b: int) -> bool:
        """The eviction rule (docs/hybrid-models.md): a window or chunk group's cached block
        whose full-attention twin (same tokens and position) is cached gets a second chance."""
        h = self.pool._hash_of[b]
        j = self.pool._group_of[h]
        if j >= len(self.groups) or not self._windowed(j):  # (pool.cache(group=) may say any)
            return False
        twin = h ^ self._tag(self.hash_key, j) ^ self._tag(self.hash_key, self._anchor)
        return twin in self.pool._block_of

    def _seq(self, sid) -> Any:
        s = self._seqs.get(sid)
        if s is None:
            raise _err(UnknownSequenceError, f"unknown sequence {sid!r}")
        return s

    # -- per-kind rules --------------------------------------------------------------------------
    def _kind(self, j: int) -> str:
        return self.groups[j].kind

    def _windowed(self, j: int) -> bool:
        return self._kind(j) in ("sliding_window", "chunked_local")

    def _needed_from(self, j: int, nc: int, n: int, qstart: Optional[int] = None) -> int:
        """First position the next query of group j reads (0 for full and state)."""
        return first_needed(self.groups[j], nc, n, query_start=qstart)

    def _table_blocks(self, j: int, n: int) -> int:
        return self.groups[j].span if self._kind(j) == "state" else _ceil_div(n, self.block_size)

    def _hit_lo(self, j: int, n: int, k: int) -> int:
        if not k:
            return 0
        return min(self._needed_from(j, k * self.block_size, n) // self.block_size, k - 1)

    def _ghashes(self, tokens, salt, j: int) -> List[int]:
        full = len(tokens) // self.block_size
        if not self.pool.enable_prefix_caching or not full or self._kind(j) == "state":
            return []
        h = _core.hash_blocks(
            np.array(tokens[: full * self.block_size], dtype=np.int32),
            self.block_size,
            salt=salt,
            key=self.hash_key,
            group=j,
        )
        return [int(lo) | (int(hi) << 64) for lo, hi in h.tolist()]

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_pending_copies(self) -> int:
        return sum(len(c) for c in self._gcopies)

    def pending_copies(self) -> List[Tuple[int, int]]:
        return [p for c in self._gcopies for p in c]

    def block_table(self, seq_id, group=0) -> np.ndarray:
        return np.array(self._seq(seq_id_of(seq_id)).tabs[self._group(group)].blocks, np.int32)

    def num_computed(self, seq_id) -> int:
        return min(t.num_computed for t in self._seq(seq_id_of(seq_id)).tabs)

    def blocks_in_use(self, seq_id) -> int:
        return sum(len(t.blocks) - t.lo for t in self._seq(seq_id_of(seq_id)).tabs)

    def _group(self, group) -> int:
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)):
            raise _err(InvalidTypeError, f"group must be an int, got {type(group).__name__}")
        if not 0 <= group < len(self.groups):
            raise _err(InvalidArgumentError, f"group {group} not in [0, {len(self.groups)})")
        return int(group)

    def can_add(self, num_tokens) -> bool:
        n = scalar_of(num_tokens, "num_tokens", 0)
        if n < 0:
            raise _err(InvalidArgumentError, f"num_tokens must be >= 0, got {n}")
        need = sum(self._table_blocks(j, n) for j in range(len(self.groups)))
        return self.pool.num_free - need >= self._watermark_blocks

    def blocks_needed(self, seq_id, n=1) -> int:
        sid = seq_id_of(seq_id)
        n = scalar_of(n, "n", 0)
        s = self._seq(sid)
        if n < 0:
            raise _err(InvalidArgumentError, f"n must be >= 0, got {n}")
        if s.swapped:
            grow = sum(
                max(0, _ceil_div(len(s.tokens) + n, self.block_size) - len(t.blocks))
                for j, t in enumerate(s.tabs)
                if self._kind(j) != "state"
            )
            return min(2**63 - 1, self._swap_in_plan(s)[1] + grow)
        return min(2**63 - 1, self._need_all([(s, n)]))

    def can_append(self, seq_ids, n=1) -> bool:
        sids = seq_ids_of(seq_ids)
        n = scalar_of(n, "n", 0)
        seqs = [self._seq(sid) for sid in sids]
        if n < 0:
            raise _err(InvalidArgumentError, f"n must be >= 0, got {n}")
        if any(s.swapped for s in seqs):
            return False
        return self._need_all([(s, n) for s in seqs]) <= self.pool.num_free

    def _step_need(self, seqs, ns, cn, forks) -> int:
        need = 0
        for j, g in enumerate(self.groups):
            if self._kind(j) == "state":  # a fork copies the state at once
                need += sum(forks) * g.span
                continue
            need += self._need(list(zip(seqs, ns)), j)
            need += sum(k * self._child_need(s, n) for s, n, k in zip(seqs, cn, forks))
        return need

    def _check_fits(self, s, n: int) -> None:
        """A window group's table may outgrow the pool (released entries): only one call's
        tokens beyond every block of the pool never fit; the rest is counted."""
        if n > self.pool.num_blocks * self.block_size:
            raise _err(OutOfBlocksError, f"{n} tokens can never fit", InvalidArgumentError)

    # -- counting ----------------------------------------------------------------------------------
    def _users(self, j: int, b: int) -> int:
        return self.pool._ref[b] - sum(1 for src, _ in self._gcopies[j] if src == b)

    def _need(self, appends, j: int = 0) -> int:
        """Group j's blocks for appending n tokens to each sequence in turn."""
        if self._kind(j) == "state":
            return 0
        bs, need = self.block_size, 0
        holders: Dict[int, int] = {}
        for s, n in appends:
            if n <= 0:
                continue
            t = s.tabs[j]
            w = len(s.tokens) // bs
            if w < len(t.blocks):
                b = t.blocks[w]
                k = holders.get(b, self._users(j, b))
                if k > 1:
                    need += 1
                    holders[b] = k - 1
            need += max(0, _ceil_div(len(s.tokens) + n, bs) - len(t.blocks))
        return need

    def _need_all(self, appends) -> int:
        return sum(self._need(appends, j) for j in range(len(self.groups)))

    def _gain(self, s: _GSeq, n: int) -> int:
        """Blocks releasing for ``n`` more tokens returns (entries this sequence alone holds)."""
        gain = 0
        for j, t in enumerate(s.tabs):
            upto = self._needed_from(j, t.num_computed, len(s.tokens) + n) // self.block_size
            gain += sum(1 for b in t.blocks[t.lo : upto] if self.pool._ref[b] == 1)
        return gain

    # -- release and copies ----------------------------------------------------------------------------
    def _release_front(self, j: int, t: _Tab, upto: int) -> None:
        if upto <= t.lo:
            return
        for i in range(t.lo, upto):
            b, t.blocks[i] = t.blocks[i], 0
            self.pool._release(b)
        t.lo = upto
        self._drop_dead(j)

    def _move(self, s: _GSeq, n: int) -> None:
        """Release what every group no longer needs once the sequence holds n more tokens."""
        for j, t in enumerate(s.tabs):
            upto = self._needed_from(j, t.num_computed, len(s.tokens) + n) // self.block_size
            self._release_front(j, t, upto)

    def _drop_dead(self, j: int) -> None:
        kept = []
        for src, dst in self._gcopies[j]:
            if self.pool._ref[dst] > 0:
                kept.append((src, dst))
                continue
            if dst in self.pool._hash_of:
                self.pool._uncache(dst)
                self.pool.free_order_known = False  # where an uncached free block goes: open
            self.pool._release(src)
        self._gcopies[j] = kept

    def _copy_source(self, b: int, j: int = 0) -> int:
        for src, dst in self._gcopies[j]:
            if dst == b:
                return src
        return b

    def _make_writable_g(self, j: int, s: _GSeq) -> None:
        bs, t = self.block_size, s.tabs[j]
        w = len(s.tokens) // bs
        if w >= len(t.blocks):
            return
        b = t.blocks[w]
        if self._users(j, b) <= 1:
            self.pool._uncache(b)  # private: its content is about to change
            return
        (new,) = self.pool._allocate(1)
        t.blocks[w] = new
        if len(s.tokens) % bs:  # committed tokens in it: copy them
            src = self._copy_source(b, j)
            self._gcopies[j].append((src, new))
            self.pool._pin(src)
        self.pool._release(b)
        self._drop_dead(j)

    def _grow_g(self, j: int, s: _GSeq, total: int) -> None:
        t = s.tabs[j]
        if self._kind(j) == "state":
            t.room = max(t.room, _ceil_div(total, self.block_size))
            return
        more = _ceil_div(total, self.block_size) - len(t.blocks)
        if more > 0:
            t.blocks += self.pool._allocate(more)

    def _offer_g(self, j: int, s: _GSeq) -> None:
        t = s.tabs[j]
        full = t.num_computed // self.block_size
        if self._kind(j) != "state" and full > t.num_offered:
            hashes = self._ghashes(s.tokens[: full * self.block_size], s.salt, j)
            for i in range(max(t.num_offered, t.lo), min(full, len(hashes))):
                self.pool._register(t.blocks[i], hashes[i], j)
        t.num_offered = max(t.num_offered, full)

    # -- lifecycle ---------------------------------------------------------------------------------
    def add(self, seq_id, token_ids, *, salt=None) -> int:
        from .reference import salt_of

        sid = seq_id_of(seq_id)
        toks = tokens_of(token_ids).tolist()
        salt_b = salt_of(salt)
        if sid in self._seqs:
            raise _err(DuplicateSequenceError, f"sequence {sid!r} already exists")
        n, bs, G = len(toks), self.block_size, len(self.groups)
        if any(self._table_blocks(j, n) >= self.pool.num_blocks for j in range(G)):
            raise _err(OutOfBlocksError, f"add: {n} tokens can never fit")
        K = min((n - 1) // bs if n else 0, n // bs)
        hashes = [self._ghashes(toks, salt_b, j)[:K] for j in range(G)]
        cached = self.pool._block_of
        k = 0
        if self.pool.enable_prefix_caching and all(self._kind(j) != "state" for j in range(G)):
            for kk in range(K, 0, -1):
                if all(
                    all(h in cached for h in hashes[j][self._hit_lo(j, n, kk) : kk])
                    for j in range(G)
                ):
                    k = kk
                    break
        hits = [[cached[h] for h in hashes[j][self._hit_lo(j, n, k) : k]] for j in range(G)]
        need = sum(
            self._table_blocks(j, n) - (0 if self._kind(j) == "state" else k) for j in range(G)
        )
        need += sum(1 for hj in hits for b in hj if self.pool._ref[b] == 0)
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"add({sid!r}): need {need}, {self.pool.num_free} free")
        s = _GSeq(toks, salt_b)
        for j in range(G):  # every group pins its hits before any group allocates
            for b in hits[j]:
                self.pool._pin(b)
            lo = self._hit_lo(j, n, k)
            s.tabs.append(_Tab([0] * lo + hits[j], lo, k * bs, k, room=_ceil_div(n, bs)))
        for j in range(G):
            t = s.tabs[j]
            t.blocks += self.pool._allocate(self._table_blocks(j, n) - len(t.blocks))
        self._seqs[sid] = s
        return k * bs

    def append(self, seq_id, token_ids, *, computed=False) -> None:
        sid = seq_id_of(seq_id)
        toks = tokens_of(token_ids).tolist()
        if not isinstance(computed, (bool, np.bool_)):
            raise _err(InvalidTypeError, f"computed must be a bool, got {type(computed).__name__}")
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"append: {sid!r} is swapped out")
        elif (
            computed
            and toks
            and any(t.num_computed != len(s.tokens) or len(toks) > t.drafts for t in s.tabs)
        ):
            rules.add(InvalidStateError, "append(computed=True): not within the draft slots")
        rules.check()
        if not toks:
            return
        self._check_fits(s, len(toks))
        need, gain = self._need_all([(s, len(toks))]), self._gain(s, len(toks))
        if need > self.pool.num_free + gain:
            raise _err(OutOfBlocksError, f"append: need {need}, {self.pool.num_free + gain} free")
        self._move(s, len(toks))
        for j in range(len(self.groups)):
            self._make_writable_g(j, s)
            self._grow_g(j, s, len(s.tokens) + len(toks))
        s.tokens += toks
        for j, t in enumerate(s.tabs):
            if computed:
                t.num_computed, t.drafts = len(s.tokens), t.drafts - len(toks)
                self._offer_g(j, s)
            else:
                t.drafts = 0

    def append_batch(self, seq_ids, token_ids) -> None:
        seqs, toks = self._batch_args(seq_ids, token_ids)
        need = self._need_all([(s, 1) for s in seqs])
        if need > self.pool.num_free:
            have = self.pool.num_free + sum(self._gain(s, 1) for s in seqs)
            if need > have:
                raise _err(OutOfBlocksError, f"append_batch: need {need}, {have} free")
        for j in range(len(self.groups)):  # every group releases before any allocates
            for s in seqs:
                t = s.tabs[j]
                upto = self._needed_from(j, t.num_computed, len(s.tokens) + 1) // self.block_size
                self._release_front(j, t, upto)
        for j in range(len(self.groups)):
            for s in seqs:
                self._make_writable_g(j, s)
                self._grow_g(j, s, len(s.tokens) + 1)
        for s, tok in zip(seqs, toks):
            s.tokens.append(tok)
            for t in s.tabs:
                t.drafts = 0

    def reserve(self, seq_id, n) -> None:
        s, n = self._reserve_args(seq_id, n)
        if n == 0:
            return
        need = self._need_all([(s, n)])
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"reserve: need {need}, {self.pool.num_free} free")
        for j in range(len(self.groups)):
            self._make_writable_g(j, s)
            self._grow_g(j, s, len(s.tokens) + n)

    def truncate(self, seq_id, num_tokens) -> None:
        sid = seq_id_of(seq_id)
        n = scalar_of(num_tokens, "num_tokens", 0)
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"truncate: {sid!r} is swapped out")
        elif not 0 <= n <= len(s.tokens):
            rules.add(InvalidArgumentError, f"truncate: {n} not in [0, {len(s.tokens)}]")
        else:
            for j, t in enumerate(s.tabs):
                nc = min(t.num_computed, n)
                if self._kind(j) == "state" and n < t.num_computed:
                    rules.add(InvalidStateError, "truncate: a state cannot drop computed tokens")
                elif t.lo and (n == 0 or self._needed_from(j, nc, n) // self.block_size < t.lo):
                    rules.add(InvalidStateError, "truncate: would read released positions")
        rules.check()
        keep = _ceil_div(n, self.block_size)
        for j, t in enumerate(s.tabs):
            if self._kind(j) != "state":
                for i in range(len(t.blocks) - 1, max(keep, t.lo) - 1, -1):
                    self.pool._release(t.blocks[i])
                del t.blocks[keep:]
                t.lo = min(t.lo, keep)
                self._drop_dead(j)
            t.room = min(t.room, keep)
            t.num_computed = min(t.num_computed, n)
            t.num_offered = min(t.num_offered, n // self.block_size)
            t.drafts = 0
        del s.tokens[n:]

    def fork(self, parent_id, child_id) -> None:
        pid, cid = seq_id_of(parent_id), seq_id_of(child_id)
        p = self._seq(pid)
        rules = _Rules()
        if cid in self._seqs:
            rules.add(DuplicateSequenceError, f"sequence {cid!r} already exists")
        if p.swapped:
            rules.add(InvalidStateError, f"fork: {pid!r} is swapped out")
        rules.check()
        need = sum(g.span for g in self.groups if g.kind == "state")
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"fork: the state takes {need}, {self.pool.num_free} free")
        c = _GSeq(list(p.tokens), p.salt)
        nb = _ceil_div(len(p.tokens), self.block_size)
        for j, t in enumerate(p.tabs):
            if self._kind(j) == "state":  # the child's state is copied now
                fresh = self.pool._allocate(len(t.blocks))
                for b, d in zip(t.blocks, fresh):
                    src = self._copy_source(b, j)
                    self._gcopies[j].append((src, d))
                    self.pool._pin(src)
                c.tabs.append(_Tab(fresh, 0, t.num_computed, 0, room=nb))
                continue
            shared = t.blocks[:nb]
            for b in shared[t.lo :]:
                self.pool._pin(b)
            c.tabs.append(_Tab(list(shared), t.lo, t.num_computed, min(t.num_offered, nb)))
        self._seqs[cid] = c

    def free(self, seq_id) -> None:
        sid = seq_id_of(seq_id)
        s = self._seq(sid)
        del self._seqs[sid]
        pool = self.host_pool if s.swapped else self.pool
        assert pool is not None
        for j, t in enumerate(s.tabs):
            for i in range(len(t.blocks) - 1, t.lo - 1, -1):
                pool._release(t.blocks[i])
            if not s.swapped:
                self._drop_dead(j)

    def take_copies(self) -> np.ndarray:
        pairs = []
        for j in range(len(self.groups)):
            got, self._gcopies[j] = self._gcopies[j], []
            for src, _ in got:
                self.pool._release(src)
            pairs += got
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    # -- swap ----------------------------------------------------------------------------------------
    def swap_out(self, seq_id) -> np.ndarray:
        sid = seq_id_of(seq_id)
        if self.host_pool is None:
            raise _err(InvalidStateError, "swap_out: no host pool (num_host_blocks=0)")
        s = self._seq(sid)
        if s.swapped:
            raise _err(InvalidStateError, f"swap_out: {sid!r} is already swapped out")
        need = sum(len(t.blocks) - t.lo for t in s.tabs)
        if need > self.host_pool.num_free:
            raise _err(OutOfBlocksError, f"swap_out: need {need}, {self.host_pool.num_free} free")
        pairs = []
        for j, t in enumerate(s.tabs):
            host = self.host_pool._allocate(len(t.blocks) - t.lo)
            pairs += [(self._copy_source(b, j), h) for b, h in zip(t.blocks[t.lo :], host)]
            for i in range(len(t.blocks) - 1, t.lo - 1, -1):
                self.pool._release(t.blocks[i])
            t.blocks[t.lo :] = host
            t.num_offered, t.drafts = 0, 0
            self._drop_dead(j)
        s.swapped = True
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def _swap_in_plan(self, s):
        """Per group {table index: cached device block} and the device blocks swap_in takes."""
        plans, need = [], 0
        for j, t in enumerate(s.tabs):
            full = t.num_computed // self.block_size
            hashes = self._ghashes(s.tokens[: full * self.block_size], s.salt, j)
            bo = self.pool._block_of
            hits = {i: bo[hashes[i]] for i in range(t.lo, len(hashes)) if hashes[i] in bo}
            need += len(t.blocks) - t.lo - len(hits)
            need += sum(1 for b in hits.values() if self.pool._ref[b] == 0)
            plans.append(hits)
        return plans, need

    def swap_in(self, seq_id) -> np.ndarray:
        sid = seq_id_of(seq_id)
        if self.host_pool is None:
            raise _err(InvalidStateError, "swap_in: no host pool (num_host_blocks=0)")
        s = self._seq(sid)
        if not s.swapped:
            raise _err(InvalidStateError, f"swap_in: {sid!r} is not swapped out")
        plans, need = self._swap_in_plan(s)
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"swap_in: need {need}, {self.pool.num_free} free")
        pairs = []
        for j, t in enumerate(s.tabs):
            hits = plans[j]
            for i in sorted(hits):
                self.pool._pin(hits[i])
            dev = [0] * t.lo
            for i in range(t.lo, len(t.blocks)):
                if i in hits:
                    dev.append(hits[i])
                else:
                    dev.append(self.pool._allocate(1)[0])
                    pairs.append((t.blocks[i], dev[-1]))
            for i in range(len(t.blocks) - 1, t.lo - 1, -1):
                self.host_pool._release(t.blocks[i])
            t.blocks = dev
            self._offer_g(j, s)
        s.swapped = False
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    # -- the step ----------------------------------------------------------------------------------
    def schedule(self, seq_ids, query_lens, draft_lens=None) -> None:
        rows = self._validate_rows(seq_ids, query_lens, draft_lens, range(len(self.groups)))
        for j in range(len(self.groups)):
            self._apply(rows, j)

    def metadata(self, seq_ids, query_lens, *, draft_lens=None, out=None, group=0):
        g = self._group(group)
        rows = self._validate_rows(seq_ids, query_lens, draft_lens, [g])
        bs, state = self.block_size, self._kind(g) == "state"
        for s, q, _d in rows:  # a window group releases what this step cannot read
            t = s.tabs[g]
            n = len(s.tokens)
            self._release_front(g, t, self._needed_from(g, t.num_computed, n, n - q) // bs)
        slots, tables, lens, indptr, indices, last = [], [], [], [0], [], []
        for s, q, d in rows:
            n, t = len(s.tokens), s.tabs[g]
            if state:
                slots += [-1] * (q + d)
                used = list(t.blocks)
            else:
                slots += [t.blocks[p // bs] * bs + p % bs for p in range(n - q, n + d)]
                used = t.blocks[: _ceil_div(n + d, bs)]
            tables.append(used)
            lens.append(n + d)
            indices += used
            indptr.append(len(indices))
            last.append(bs if state else (n + d - (len(used) - 1) * bs if n + d else 0))
        bt = np.zeros((len(rows), max([len(t) for t in tables] + [1])), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        self._apply(rows, g)
        return ReferenceMetadata(
            np.array(slots, dtype=np.int64),
            bt,
            np.array(lens, dtype=np.int32),
            np.array(indptr, dtype=np.int32),
            np.array(indices, dtype=np.int32),
            np.array(last, dtype=np.int32),
            num_tokens=len(slots),
            num_seqs=len(rows),
        )

    def _apply(self, rows, j: int) -> None:
        bs = self.block_size
        for s, q, _d in rows:
            t, n = s.tabs[j], len(s.tokens)
            self._release_front(j, t, self._needed_from(j, t.num_computed, n, n - q) // bs)
        for s, _q, d in rows:
            t = s.tabs[j]
            t.num_computed, t.drafts = len(s.tokens), d
            self._offer_g(j, s)

    def _validate_rows(self, seq_ids, query_lens, draft_lens, groups):
        sids, seqs, q, d = self._step_args(seq_ids, query_lens, draft_lens)
        rules, seen, bs = _Rules(), set(), self.block_size
        if self.num_pending_copies:
            rules.add(InvalidStateError, "metadata: copy-on-write copies are pending")
        for sid, s, qi, di in zip(sids, seqs, q, d):
            n = len(s.tokens)
            if sid in seen:
                rules.add(InvalidArgumentError, f"metadata: {sid!r} appears twice")
            seen.add(sid)
            if s.swapped:
                rules.add(InvalidStateError, f"metadata: {sid!r} is swapped out")
                continue
            for j in groups:
                t = s.tabs[j]
                if not 0 <= qi <= n:
                    rules.add(InvalidArgumentError, f"metadata: query_len {qi} not in [0, {n}]")
                elif n - qi > t.num_computed:
                    rules.add(InvalidStateError, f"metadata: {sid!r}: a gap before the query")
                elif t.lo and self._needed_from(j, t.num_computed, n, n - qi) // bs < t.lo:
                    rules.add(InvalidStateError, f"metadata: {sid!r} reads released positions")
                if di < 0:
                    rules.add(InvalidArgumentError, f"metadata: draft_len {di} < 0")
                elif di and (
                    (self._kind(j) == "state" and _ceil_div(n + di, bs) > t.room)
                    or (
                        self._kind(j) != "state"
                        and (
                            n + di > len(t.blocks) * bs
                            or any(
                                self._users(j, b) != 1 or b in self.pool._hash_of
                                for b in t.blocks[n // bs : _ceil_div(n + di, bs)]
                            )
                        )
                    )
                ):
                    rules.add(InvalidStateError, f"metadata: drafts of {sid!r} not reserved")
        rules.check()
        return list(zip(seqs, q, d))

    def check(self) -> None:
        """Every reference is held by a table entry at or above lo or by a pending copy;
        released entries are the null block; no group released what its next query reads."""
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        host_refs = [0] * (self.host_pool.num_blocks if self.host_pool else 0)
        for s in self._seqs.values():
            for j, t in enumerate(s.tabs):
                if any(t.blocks[: t.lo]) or (
                    t.lo
                    and self._needed_from(j, t.num_computed, len(s.tokens)) // self.block_size
                    < t.lo
                ):
                    raise CorruptionError("reference: a released entry is wrong")
                for b in t.blocks[t.lo :]:
                    (host_refs if s.swapped else refs)[b] += 1
        for c in self._gcopies:
            for src, _ in c:
                refs[src] += 1
        if refs != self.pool._ref or (self.host_pool and host_refs != self.host_pool._ref):
            raise CorruptionError("reference counts differ from the references held")
