"""Prefix-cache and allocation counters (``pool.stats``) and the host tier's
(``BlockManager.host_stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CacheStats", "HostStats"]


@dataclass(frozen=True)
class CacheStats:
    """Counters since the pool was created. Readable as attributes or like a dict.

    ``hit_rate`` is the token hit rate when sequences were added through a BlockManager
    (hit_tokens / query_tokens), else the block hit rate of pool-level lookups. Re-admissions
    of preempted sequences (``add(..., recompute=True)``) are counted apart, in
    ``recompute_query_tokens`` / ``recompute_hit_tokens``: getting one's own blocks back is
    not prefix reuse. Block counts (``query_blocks``, ``hit_blocks``) include both.
    """

    queries: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    recompute_query_tokens: int = 0
    recompute_hit_tokens: int = 0
    evictions: int = 0
    allocations: int = 0
    frees: int = 0
    stored: int = 0

    @property
    def hits(self) -> int:
        """Blocks served from the prefix cache."""
        return self.hit_blocks

    @property
    def hit_rate(self) -> float:
        if self.query_tokens:
            return self.hit_tokens / self.query_tokens
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hits"] = self.hits
        d["hit_rate"] = self.hit_rate
        return d

    def __getitem__(self, name: str):
        return self.as_dict()[name]


@dataclass(frozen=True)
class HostStats:
    """Counters of a BlockManager's host tier since creation (``mgr.host_stats``).

    - ``hits`` / ``hit_tokens``: blocks and tokens that ``add`` served from the host tier
      (onloads), first admissions; ``recompute_hit_tokens`` the same for re-admissions.
      Device-tier hits are in ``pool.stats``; a prompt's cached tokens are the sum of both.
      With KV cache groups these count prompt blocks, not copies: the joint hit beyond the
      one the device alone serves (every group onloads only what its query reads).
    - ``query_tokens``: tokens asked for by first admissions (``pool.stats.query_tokens``),
      so ``hit_rate`` is the host tier's share of them.
    - ``demotions``: evicted device entries kept on the host, by a copy or because the host
      already held the hash; ``dropped``: evicted entries lost (no host block free, or their
      content was still arriving).
    - ``offloads`` / ``onloads``: (device, host) and (host, device) copies queued (in all
      KV cache groups).
    - ``evictions`` / ``stored``: host-cache entries dropped to make room / registered.

    >>> HostStats(hits=2, hit_tokens=32, query_tokens=128).hit_rate
    0.25
    """

    hits: int = 0
    hit_tokens: int = 0
    recompute_hit_tokens: int = 0
    query_tokens: int = 0
    demotions: int = 0
    offloads: int = 0
    onloads: int = 0
    dropped: int = 0
    evictions: int = 0
    stored: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d

    def __getitem__(self, name: str):
        return self.as_dict()[name]
