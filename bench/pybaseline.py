"""A pure-Python block pool in the style of vLLM v1's block_pool.py, timed as the baseline.

One Python object per block with ref_cnt, block_hash and prev/next links of an intrusive
doubly linked free queue with sentinels; a dict from hash to block; SHA-256 block hashes.
Written here for comparison (no vLLM code), with the same algorithmic shape.
"""

from __future__ import annotations

import hashlib
import pickle


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
        blk = tuple(tokens[i * block_size:(i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None))).digest()
        out.append(parent)
    return out
