"""Routers of the cluster simulator: which replica gets an arriving request.

A router sees what a real one sees and nothing else: each replica's load, as its metrics
report it (:class:`Load`: prompt tokens queued or still to prefill, device blocks referenced by
running sequences), and, for the prefix-aware router, each replica's KV events. Each router has
one scoring method, :meth:`Router.costs`, giving one number per replica; the lowest cost wins
and ties go to the lowest replica index, so a replay is deterministic. With ``bs`` the block
size, ``P`` the prompt length in tokens, ``q_r`` replica r's queued tokens, ``u_r`` its blocks
in use and ``o_r`` the blocks of the prompt's prefix it holds:

* ``round_robin``: replicas in turn, whatever their state (the baseline).
* ``least_loaded``: ``cost_r = q_r / bs + u_r``, the replica's work in blocks (Dynamo's cost
  with ``overlap_score_weight = 0``: pure load balancing).
* ``prefix_aware``: Dynamo's KV-router cost, ``cost_r = w x prefill_r + decode_r`` with
  ``prefill_r = (q_r + P - o_r x bs) / bs`` (blocks to prefill once the request is queued
  there, its cached prefix skipped) and ``decode_r = u_r + ceil(P / bs) - o_r`` (blocks it will
  hold, the cached ones not counted again). ``w = overlap_weight`` weighs the prefill work,
  hence the cache hit, against the memory load; the default 1.0 is Dynamo's
  ``overlap_score_weight`` default. ``o_r`` comes from a :class:`PrefixIndex` fed with the
  replicas' KV events (host-tier blocks count 0.75), and the prompt's block hashes are
  computed as the engines compute them (``kvblocks.hash_blocks`` under the cluster's shared
  hash key, as llm-d's router hashes prompts with the engines' seed).

>>> r = make_router("least_loaded", 3, block_size=16)
>>> r.costs([], 100, [Load(0, 40), Load(320, 0), Load(0, 10)])
[40.0, 20.0, 10.0]
>>> r.choose([], 100, [Load(0, 40), Load(320, 0), Load(0, 10)])
2
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from ... import hash_blocks
from ..errors import SimulationError
from .prefixindex import PrefixIndex

__all__ = [
    "ROUTERS",
    "DEFAULT_OVERLAP_WEIGHT",
    "Load",
    "Router",
    "RoundRobin",
    "LeastLoaded",
    "PrefixAware",
    "make_router",
]

DEFAULT_OVERLAP_WEIGHT = 1.0  # Dynamo KvRouterConfig.overlap_score_weight


class Load(NamedTuple):
    """One replica's load as its metrics report it."""

    queued_tokens: int  # prompt tokens waiting, or admitted and still to prefill
    blocks_in_use: int  # device blocks referenced by its sequences


class Router:
    """Base class: ``choose`` takes the lowest of ``costs`` (ties: the lowest index)."""

    name = ""
    needs_events = False  # whether the cluster must feed it the replicas' KV events
    needs_hashes = False  # whether ``costs`` reads the prompt's block hashes

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size

    def costs(self, hashes: Sequence[int], prompt_len: int, loads: Sequence[Load]) -> List[float]:
        """One cost per replica for a prompt of ``prompt_len`` tokens (lower is better)."""
        raise NotImplementedError

    def choose(self, hashes: Sequence[int], prompt_len: int, loads: Sequence[Load]) -> int:
        """The replica that gets the request."""
        c = self.costs(hashes, prompt_len, loads)
        return min(range(len(c)), key=c.__getitem__)

    def observe(self, replica: int, events: Sequence[object]) -> None:
        """Take in ``replica``'s KV events (only routers that ``needs_events``)."""

    def describe(self) -> Dict[str, Any]:
        """The router's name and settings (for reports)."""
        return {"router": self.name}


class RoundRobin(Router):
    """Replicas in turn."""

    name = "round_robin"

    def __init__(self, num_replicas: int, block_size: int) -> None:
        super().__init__(num_replicas, block_size)
        self.turn = 0

    def costs(self, hashes: Sequence[int], prompt_len: int, loads: Sequence[Load]) -> List[float]:
        n = self.num_replicas
        return [float((r - self.turn) % n) for r in range(n)]

    def choose(self, hashes: Sequence[int], prompt_len: int, loads: Sequence[Load]) -> int:
        r = self.turn
        self.turn = (r + 1) % self.num_replicas
        return r


class LeastLoaded(Router):
    """The replica with the least work in blocks: queued prompt blocks plus blocks in use."""

    name = "least_loaded"

    def costs(self, hashes: Sequence[int], prompt_len: int, loads: Sequence[Load]) -> List[float]:
        bs = self.block_size
        return [q / bs + u for q, u in loads]


class PrefixAware(Router):
    """Longest cached prefix (from KV events) against load, Dynamo's cost (module docstring)."""

    name = "prefix_aware"
    needs_events = True
    needs_hashes = True

    def __init__(
        self, num_replicas: int, block_size: int, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT
    ) -> None:
        super().__init__(num_replicas, block_size)
        if not (isinstance(overlap_weight, (int, float)) and 0.0 <= overlap_weight <= 1e6):
            raise SimulationError(
                f"--overlap-weight must be a number in [0, 1e6], got {overlap_weight!r}"
            )
        self.overlap_weight = float(overlap_weight)
        self.index = PrefixIndex(num_replicas)
        # per replica, the cached prefix of a prompt's hashes, asked of the replicas directly
        # (a cluster sets it where that equals the event-built index); None: the index
        self.lookup: Optional[Callable[[Any], List[float]]] = None

    def observe(self, replica: int, events: Sequence[object]) -> None:
        self.index.apply(replica, events)

    def costs(self, hashes: Sequence[int], prompt_len: int, loads: Sequence[Load]) -> List[float]:
        bs = self.block_size
        w = self.overlap_weight
        blocks = -(-prompt_len // bs)
        over = self.index.overlap(hashes) if self.lookup is None else self.lookup(hashes)
        return [
            w * (q + prompt_len - o * bs) / bs + u + blocks - o for (q, u), o in zip(loads, over)
        ]

    def describe(self) -> Dict[str, Any]:
        return {"router": self.name, "overlap_weight": self.overlap_weight}


ROUTERS = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAware)}


def make_router(
    name: str, num_replicas: int, block_size: int, overlap_weight: Optional[float] = None
) -> Router:
    """The router called ``name`` (``round_robin``, ``least_loaded``, ``prefix_aware``)."""
    cls = ROUTERS.get(name)
    if cls is None:
        raise SimulationError(f"--router must be one of {', '.join(ROUTERS)}; got {name!r}")
    if overlap_weight is not None and cls is not PrefixAware:
        raise SimulationError("--overlap-weight applies to --router prefix_aware only")
    if cls is PrefixAware:
        return PrefixAware(
            num_replicas,
            block_size,
            DEFAULT_OVERLAP_WEIGHT if overlap_weight is None else overlap_weight,
        )
    return cls(num_replicas, block_size)


def prompt_hash_array(tokens: np.ndarray, block_size: int, key: bytes) -> np.ndarray:
    """The 64-bit wire values of a prompt's full-block hashes, as an array."""
    return np.ascontiguousarray(hash_blocks(tokens, block_size, key=key)[:, 0])


def prompt_hashes(tokens: np.ndarray, block_size: int, key: bytes) -> List[int]:
    """The 64-bit wire values of a prompt's full-block hashes (what the index is keyed by)."""
    out: List[int] = prompt_hash_array(tokens, block_size, key).tolist()
    return out
