"""A pure-Python block pool in the style of vLLM v1's block_pool.py, timed as the baseline.

One Python object per block with ref_cnt, block_hash and prev/next links of an intrusive
doubly linked free queue with sentinels; a dict from hash to block; SHA-256 block hashes.
:class:`PySeqTables` adds per-sequence block tables on top (append with a new block at each
boundary, hashing and caching a block as it fills, fork by reference and copy-on-write), the
bookkeeping a Python scheduler does around such a pool. Written here for comparison (no vLLM
code), with the same algorithmic shape; ``kvblocks bench`` times it in the same run.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Dict, List


class PyBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None
        self.prev = None
        self.next = None


class PyFreeQueue:
    def __init__(self, blocks):
        self.head = PyBlock(-1)
        self.tail = PyBlock(-1)
        self.num_free = len(blocks)
        prev = self.head
        for b in blocks:
            prev.next = b
            b.prev = prev
            prev = b
        prev.next = self.tail
        self.tail.prev = prev

    def popleft(self) -> PyBlock:
        b = self.head.next
        if b is self.tail:
            raise ValueError("no free blocks")
        self.head.next = b.next
        b.next.prev = self.head
        b.prev = b.next = None
        self.num_free -= 1
        return b

    def remove(self, b: PyBlock) -> None:
        assert b.prev is not None and b.next is not None  # sentinels at both ends
        b.prev.next = b.next
        b.next.prev = b.prev
        b.prev = b.next = None
        self.num_free -= 1

    def append(self, b: PyBlock) -> None:
        last = self.tail.prev
        last.next = b
        b.prev = last
        b.next = self.tail
        self.tail.prev = b
        self.num_free += 1


class PyBlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [PyBlock(i) for i in range(num_blocks)]
        self.free_queue = PyFreeQueue(self.blocks[1:])
        self.cached: dict = {}

    def allocate(self, n: int) -> list:
        if n > self.free_queue.num_free:
            raise ValueError("out of blocks")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                del self.cached[b.block_hash]
                b.block_hash = None
            b.ref_cnt += 1
            out.append(b)
        return out

    def free(self, blocks) -> None:
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def lookup(self, hashes) -> list:
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def cache(self, blocks, hashes) -> None:
        for b, h in zip(blocks, hashes):
            if h not in self.cached:
                self.cached[h] = b
                b.block_hash = h


def sha256_block_hashes(tokens: list, block_size: int, parent: bytes = b"") -> list:
    out = []
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None))).digest()
        out.append(parent)
    return out


def sha256_block_hash(parent: bytes, block_tokens: list) -> bytes:
    return hashlib.sha256(pickle.dumps((parent, tuple(block_tokens), None))).digest()


class PySeqTables:
    """Per-sequence block tables over a :class:`PyBlockPool` (token ids as Python lists)."""

    def __init__(self, pool: PyBlockPool, block_size: int):
        self.pool = pool
        self.bs = block_size
        self.tables: Dict[object, List[PyBlock]] = {}
        self.tokens: Dict[object, list] = {}
        self.hashes: Dict[object, List[bytes]] = {}
        self.copies: list = []  # (src, dst) block ids of copy-on-write copies

    def add(self, seq, tokens) -> int:
        """A prompt: reuse cached full blocks, allocate the rest; returns cached tokens."""
        toks = list(tokens)
        hashes = sha256_block_hashes(toks, self.bs)
        hit = self.pool.lookup(hashes)
        self.pool.touch(hit)
        need = -(-len(toks) // self.bs) - len(hit)
        blocks = hit + self.pool.allocate(need)
        self.pool.cache(blocks[len(hit) : len(hashes)], hashes[len(hit) :])
        self.tables[seq], self.tokens[seq], self.hashes[seq] = blocks, toks, hashes
        return len(hit) * self.bs

    def reserve(self, seq, n: int) -> None:
        """Blocks for ``n`` more tokens, allocated now."""
        blocks = self.tables[seq]
        need = -(-(len(self.tokens[seq]) + n) // self.bs) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))

    def append(self, seq, token: int) -> None:
        toks, blocks = self.tokens[seq], self.tables[seq]
        pos = len(toks)
        i = pos // self.bs
        if i == len(blocks):
            blocks.append(self.pool.allocate(1)[0])
        elif blocks[i].ref_cnt > 1:  # shared partly filled block: copy on write
            new = self.pool.allocate(1)[0]
            self.copies.append((blocks[i].block_id, new.block_id))
            self.pool.free([blocks[i]])
            blocks[i] = new
        toks.append(token)
        if (pos + 1) % self.bs == 0:  # the block is full: hash it and cache it
            hs = self.hashes[seq]
            h = sha256_block_hash(hs[-1] if hs else b"", toks[pos + 1 - self.bs : pos + 1])
            hs.append(h)
            self.pool.cache([blocks[i]], [h])

    def append_batch(self, seqs, tokens) -> None:
        for seq, tok in zip(seqs, tokens):
            self.append(seq, tok)

    def truncate(self, seq, n: int) -> None:
        blocks = self.tables[seq]
        keep = -(-n // self.bs)
        if keep < len(blocks):
            self.pool.free(blocks[keep:][::-1])
            del blocks[keep:]
        del self.tokens[seq][n:]
        del self.hashes[seq][n // self.bs :]

    def fork(self, parent, child) -> None:
        blocks = list(self.tables[parent])
        for b in blocks:
            b.ref_cnt += 1
        self.tables[child] = blocks
        self.tokens[child] = list(self.tokens[parent])
        self.hashes[child] = list(self.hashes[parent])

    def take_copies(self) -> list:
        out, self.copies = self.copies, []
        return out

    def free(self, seq) -> None:
        self.pool.free(self.tables.pop(seq)[::-1])
        del self.tokens[seq], self.hashes[seq]
