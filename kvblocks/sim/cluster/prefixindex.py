"""A router's view of where prefixes are cached, built only from the replicas' KV events.

This is the index KV-aware routers keep (Dynamo's radix tree of block hashes, llm-d's
``kvblock.Index``): each replica publishes ``BlockStored`` when full blocks enter its prefix
cache and ``BlockRemoved`` when they leave it (evicted, or demoted to another medium), and the
router applies them in order. Keys are the 64-bit wire values of the block hashes
(:func:`kvblocks.events.fold_hash`: the low 64 bits), exactly what a router reading vLLM's
event stream gets; a value is a bit set of the replicas holding the block, one per medium
(``"GPU"``: device, anything else: host tier).

:meth:`PrefixIndex.overlap` walks a prompt's chained block hashes from the first block and
gives each replica its longest consecutive run of blocks held in either medium, counting a
host-tier block as :data:`HOST_CREDIT` of a device block (Dynamo credits host hits 0.75, llm-d
0.8: a host hit still costs a PCIe copy). Chained hashes make a prefix match exact: block i
matches only if every block before it matched too.

>>> from kvblocks.events import BlockRemoved, BlockStored
>>> idx = PrefixIndex(2)
>>> idx.apply(0, [BlockStored([11, 12, 13], None, [0] * 48, 16)])
>>> idx.apply(1, [BlockStored([11], None, [0] * 16, 16)])
>>> idx.overlap([11, 12, 13, 14])
[3.0, 1.0]
>>> idx.apply(0, [BlockRemoved([12])])
>>> idx.overlap([11, 12, 13, 14])
[1.0, 1.0]
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from ...errors import InvalidArgumentError
from ...events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["PrefixIndex", "HOST_CREDIT"]

HOST_CREDIT = 0.75  # a host-tier block counts this much of a device block (Dynamo's default)
_M64 = (1 << 64) - 1


class PrefixIndex:
    """Which replicas hold which blocks, per medium, from their KV events."""

    __slots__ = ("num_replicas", "device", "host", "stored", "removed")

    def __init__(self, num_replicas: int) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise InvalidArgumentError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        self.num_replicas = num_replicas
        self.device: Dict[int, int] = {}  # 64-bit block hash -> bit set of replicas
        self.host: Dict[int, int] = {}
        self.stored = 0  # block events applied
        self.removed = 0

    def __len__(self) -> int:
        """Distinct blocks held anywhere (either medium)."""
        return len(self.device.keys() | self.host.keys())

    def apply(self, replica: int, events: Sequence[object]) -> None:
        """Apply one replica's drained events, in order."""
        if not 0 <= replica < self.num_replicas:
            raise InvalidArgumentError(
                f"replica {replica!r} out of range [0, {self.num_replicas - 1}]"
            )
        bit = 1 << replica
        for ev in events:
            if isinstance(ev, BlockStored):
                d = self.device if ev.medium in (None, "GPU") else self.host
                get = d.get
                for h in ev.block_hashes:
                    h &= _M64
                    d[h] = get(h, 0) | bit
                self.stored += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                d = self.device if ev.medium in (None, "GPU") else self.host
                keep = ~bit
                for h in ev.block_hashes:
                    h &= _M64
                    m = d.get(h, 0) & keep
                    if m:
                        d[h] = m
                    else:
                        d.pop(h, None)
                self.removed += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                for d in (self.device, self.host):
                    for h in [h for h, m in d.items() if m & bit]:
                        m = d[h] & ~bit
                        if m:
                            d[h] = m
                        else:
                            del d[h]
            else:
                raise InvalidArgumentError(f"not a KV event: {type(ev).__name__}")

    def overlap(self, hashes: Sequence[int]) -> List[float]:
        """Per replica, the cached prefix of ``hashes`` (64-bit block hashes in order), in
        blocks: device blocks count 1, host-tier blocks :data:`HOST_CREDIT`."""
        n = self.num_replicas
        out = [0.0] * n
        alive = (1 << n) - 1
        dev = self.device.get
        if not self.host:  # device only: record where each replica drops out
            for i, h in enumerate(hashes):
                m = dev(h, 0) & alive
                if m != alive:
                    gone = alive & ~m
                    while gone:
                        low = gone & -gone
                        out[low.bit_length() - 1] = float(i)
                        gone ^= low
                    alive = m
                    if not alive:
                        return out
            for r in range(n):
                if alive >> r & 1:
                    out[r] = float(len(hashes))
            return out
        hst = self.host.get
        for h in hashes:
            g = dev(h, 0) & alive
            c = hst(h, 0) & alive & ~g
            alive = g | c
            if not alive:
                break
            while g:
                low = g & -g
                out[low.bit_length() - 1] += 1.0
                g ^= low
            while c:
                low = c & -c
                out[low.bit_length() - 1] += HOST_CREDIT
                c ^= low
        return out
