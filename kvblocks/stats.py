"""Prefix-cache and allocation counters (``pool.stats``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["CacheStats"]


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
