"""Fuzz bytes -> a run's configuration and its calls' arguments, front to back.

The decoding is our own (not ``atheris.FuzzedDataProvider``): a file decodes identically with and
without atheris; when the bytes run out every read returns its minimum. The configuration and
every call's operation byte decode as in the first harness, so ``fuzz/corpus`` and
``fuzz/regressions`` still choose the same pools, layouts and sequence of operations.
"""

from __future__ import annotations

from typing import Any, List

#: sequence ids the harness uses (ints and strs, so both id kinds meet)
IDS: List[Any] = [0, 1, 2, 3, 4, 5, 6, 7, "a", "b", "c", "d"]
#: salts: the default, str and bytes (equal text hashes alike), empty
SALTS: List[Any] = [None, None, None, "t1", b"t1", "", "1"]
#: the odd tokens an input can ask for (the int32 ends, negatives)
ODD_TOKENS = [0, 7, 2**31 - 1, -(2**31), -1, 255]


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

    def tokens(self, sources: List[List[int]], lo: int = 0, hi: int = 10) -> List[int]:
        """Tokens from a tiny alphabet, often continuing the prefix of one of ``sources``."""
        n = self.int(lo, hi)
        out: List[int] = []
        if sources and self.bool():
            base = self.pick(sources)
            out = list(base[: self.int(0, len(base))])[:n]
        while len(out) < n:
            c = self.byte()
            out.append(c % 4 if c < 224 else self.pick(ODD_TOKENS))
        return out


class Config:
    """One run's pools and K/V layout: the bytes an input opens with."""

    def __init__(self, inp: Input) -> None:
        self.block_size = inp.pick([1, 2, 3, 4, 4, 8])
        self.num_blocks = inp.int(2, 28)
        host = inp.pick([0, 0, 1, 2])
        self.num_host_blocks = 0 if host == 0 else inp.int(2, 24)
        self.caching = inp.int(0, 3) != 0
        self.watermark = inp.pick([0.0, 0.0, 0.0, 0.15])
        self.events = inp.bool()
        self.layers, self.heads = inp.int(1, 2), inp.int(1, 2)
        self.head_dim = inp.pick([1, 2, 4])
        self.kind = inp.pick(["NHD", "HND"])
        self.joint = inp.bool()
        self.metadata_buffer = inp.bool()  # (read for the layout of older inputs; unused)
        self.pool_blocks = inp.int(2, 20)  # blocks of the block-level engine's own BlockPool
