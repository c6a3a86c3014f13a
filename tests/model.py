"""A pure-Python model of kvblocks' allocator semantics, for model-based tests.

It mirrors the documented policy exactly (free-list order, lazy LRU eviction, copy-on-write,
first-block-wins caching), so the tests can compare block ids one for one. Hashes come from
kvblocks.hash_blocks (checked separately against SipHash known answers).
"""

from __future__ import annotations

import numpy as np

import kvblocks


class OutOfBlocks(Exception):
    pass


class PoolModel:
    def __init__(self, num_blocks: int, caching: bool = True):
        self.num_blocks = num_blocks
        self.caching = caching
        self.ref = [0] * num_blocks
        self.free = list(range(1, num_blocks))  # index 0 = next to allocate
        self.cached: dict[int, int] = {}  # hash (int) -> block
        self.hash_of: dict[int, int] = {}  # block -> hash
        self.evictions = 0

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise OutOfBlocks(n, len(self.free))
        out = self.free[:n]
        del self.free[:n]
        for b in out:
            if b in self.hash_of:
                del self.cached[self.hash_of.pop(b)]
                self.evictions += 1
            self.ref[b] = 1
        return out

    def release(self, b: int) -> None:
        assert self.ref[b] > 0
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.free.append(b)
            else:
                self.free.insert(0, b)

    def pin(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1

    def put(self, b: int, h: int) -> None:
        if self.caching and b not in self.hash_of and h not in self.cached:
            self.cached[h] = b
            self.hash_of[b] = h

    def drop(self, b: int) -> None:
        if b in self.hash_of:
            del self.cached[self.hash_of.pop(b)]

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        if self.caching:
            for h in hashes:
                if h not in self.cached:
                    break
                out.append(self.cached[h])
        return out

    def reset(self) -> None:
        if any(self.ref[b] for b in self.hash_of):
            raise RuntimeError("referenced")
        for b in sorted(self.hash_of):  # C walks blocks in id order, pushing each at the head
            self.free.remove(b)
            self.free.insert(0, b)
        self.cached.clear()
        self.hash_of.clear()


def hashes_of(tokens, bs, salt, key) -> list[int]:
    full = len(tokens) // bs
    if not full:
        return []
    h = kvblocks.hash_blocks(np.asarray(tokens[: full * bs], dtype=np.int32), bs, salt=salt,
                             key=key)
    return [int(lo) | (int(hi) << 64) for lo, hi in h]


class Seq:
    def __init__(self, salt):
        self.blocks: list[int] = []
        self.tokens: list[int] = []
        self.salt = salt
        self.swapped = False


class ManagerModel:
    def __init__(self, num_blocks, bs, caching=True, host_blocks=0, key=None):
        self.pool = PoolModel(num_blocks, caching)
        self.host = PoolModel(host_blocks, False) if host_blocks else None
        self.bs = bs
        self.key = key
        self.seqs: dict = {}
        self.copies: list[tuple[int, int]] = []

    def _ceil(self, n):
        return -(-n // self.bs)

    def _hashes(self, s: Seq):
        return hashes_of(s.tokens, self.bs, s.salt, self.key)

    def add(self, sid, tokens, salt=None):
        n = len(tokens)
        bs = self.bs
        s = Seq(salt)
        s.tokens = list(tokens)
        hs = self._hashes(s)
        max_hits = (n - 1) // bs if n else 0
        hits = self.pool.match(hs[: min(len(hs), max_hits)])
        need = self._ceil(n) - len(hits)
        pinned_free = sum(1 for b in hits if self.pool.ref[b] == 0)
        if need > len(self.pool.free) - pinned_free:
            raise OutOfBlocks
        for b in hits:
            self.pool.pin(b)
        s.blocks = hits + self.pool.allocate(need)
        for i in range(len(hits), len(hs)):
            self.pool.put(s.blocks[i], hs[i])
        self.seqs[sid] = s
        return len(hits) * bs

    def _need(self, s, n):
        if n <= 0:
            return 0
        grow = max(0, self._ceil(len(s.tokens) + n) - len(s.blocks))
        w = len(s.tokens) // self.bs
        if w < len(s.blocks) and self.pool.ref[s.blocks[w]] > 1:
            grow += 1
        return grow

    def _make_writable(self, s):
        w = len(s.tokens) // self.bs
        if w >= len(s.blocks):
            return
        b = s.blocks[w]
        if self.pool.ref[b] > 1:
            (nb,) = self.pool.allocate(1)
            if len(s.tokens) % self.bs:
                self.copies.append((b, nb))
            s.blocks[w] = nb
            self.pool.release(b)
        else:
            self.pool.drop(b)

    def _grow(self, s, n):
        g = self._ceil(len(s.tokens) + n) - len(s.blocks)
        if g > 0:
            s.blocks += self.pool.allocate(g)

    def _register(self, s, old_full):
        hs = self._hashes(s)
        for i in range(old_full, len(hs)):
            self.pool.put(s.blocks[i], hs[i])

    def append(self, sid, tokens):
        s = self.seqs[sid]
        if s.swapped:
            raise RuntimeError("swapped")
        if not tokens:
            return
        if self._need(s, len(tokens)) > len(self.pool.free):
            raise OutOfBlocks
        self._make_writable(s)
        self._grow(s, len(tokens))
        old_full = len(s.tokens) // self.bs
        s.tokens += list(tokens)
        self._register(s, old_full)

    def append_batch(self, sids, tokens):
        seen = set()
        for sid in sids:  # the C core validates element by element, in order
            if sid in seen:
                raise ValueError("dup")
            if self.seqs[sid].swapped:
                raise RuntimeError("swapped")
            seen.add(sid)
        need = sum(self._need(self.seqs[sid], 1) for sid in sids)
        if need > len(self.pool.free):
            raise OutOfBlocks
        for sid, t in zip(sids, tokens):
            self.append(sid, [t])

    def reserve(self, sid, n):
        s = self.seqs[sid]
        if s.swapped:
            raise RuntimeError("swapped")
        if n == 0:
            return
        if self._need(s, n) > len(self.pool.free):
            raise OutOfBlocks
        self._make_writable(s)
        self._grow(s, n)

    def _drop_dead_copies(self):
        self.copies = [(a, b) for a, b in self.copies if self.pool.ref[b] > 0]

    def truncate(self, sid, n):
        s = self.seqs[sid]
        if s.swapped:
            raise RuntimeError("swapped")
        if not 0 <= n <= len(s.tokens):
            raise ValueError("range")
        keep = self._ceil(n)
        for b in reversed(s.blocks[keep:]):
            self.pool.release(b)
        del s.blocks[keep:]
        del s.tokens[n:]
        self._drop_dead_copies()

    def fork(self, pid, cid):
        p = self.seqs[pid]
        if p.swapped:
            raise RuntimeError("swapped")
        c = Seq(p.salt)
        c.tokens = list(p.tokens)
        c.blocks = p.blocks[: self._ceil(len(p.tokens))]
        for b in c.blocks:
            self.pool.ref[b] += 1
        self.seqs[cid] = c

    def free(self, sid):
        s = self.seqs.pop(sid)
        pool = self.host if s.swapped else self.pool
        for b in reversed(s.blocks):
            pool.release(b)
        self._drop_dead_copies()

    def _move(self, s, src, dst):
        if len(s.blocks) > len(dst.free):
            raise OutOfBlocks
        fresh = dst.allocate(len(s.blocks))
        pairs = list(zip(s.blocks, fresh))
        for b in reversed(s.blocks):
            src.release(b)
        s.blocks = fresh
        self._drop_dead_copies()
        return pairs

    def swap_out(self, sid):
        s = self.seqs[sid]
        if self.host is None or s.swapped:
            raise RuntimeError("state")
        pairs = self._move(s, self.pool, self.host)
        s.swapped = True
        return pairs

    def swap_in(self, sid):
        s = self.seqs[sid]
        if self.host is None or not s.swapped:
            raise RuntimeError("state")
        pairs = self._move(s, self.host, self.pool)
        s.swapped = False
        self._register(s, 0)
        return pairs

    def take_copies(self):
        out, self.copies = self.copies, []
        return out
