"""Suite ``tier``: what the host tier of the prefix cache costs the allocator.

Each operation is timed twice in the same run: with a host tier (``kvblocks``) and as the
same call on a manager without one (``device-only``), so the ``x device-only`` column is the
tier's overhead factor inverted (0.50x: the tier call takes twice as long). Targets
(issue 15): an evicting allocation that demotes to the host, and a lookup that continues into
the host, each cost at most 2x the device-only call per block.

- ``demote``: allocation that evicts cached device blocks; with the tier each eviction is
  recorded for the host (write-back: the host block, the host LRU eviction and the queued
  offload come at the next drain or host lookup).
- ``demote_drain``: ``demote`` followed by the drain (``take_offloads``), which gives the
  recorded evictions their host blocks: the whole cost of a demotion, wherever it is paid.
- ``demote_present``: the same, but every hash is already on the host (write-through copied
  it when it was cached): the eviction costs a host probe and no copy.
- ``cache_write_through``: registering full blocks in the device cache; with write-through
  each one also takes a host block and queues its offload.
- ``add_hits``: ``add`` of a 32K-token prompt whose 2,047 cached blocks are on the host
  (fresh device blocks, onloads queued, device entries registered) against the same prompt
  cached on the device (pinned in place).
- ``probe``: ``probe`` of that prompt, host against device.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .._core import BlockManager
from .timing import Case, Op, Settings

__all__ = ["build"]

BS = 16
EVICT_N, EVICT_TOTAL, EVICT_INNER = 128, 4096, 16
PROMPT_BLOCKS = 2048
TARGET = 2.0


class _Evicting:
    """A manager whose device pool is full of evictable cached blocks before every sample."""

    def __init__(self, tier: bool, write_through: bool = False, present: bool = False) -> None:
        total = EVICT_TOTAL
        self.mgr = BlockManager(
            total + 1,
            BS,
            num_host_blocks=total + 1 if tier else 0,
            host_prefix_cache=tier,
            host_write_through=write_through,
        )
        self.pool = self.mgr.pool
        self.present = present
        self.held: list = []
        self.rng = np.random.default_rng(1)
        self.hashes = self._fresh()

    def _fresh(self) -> np.ndarray:
        return self.rng.integers(0, 2**63, (EVICT_TOTAL, 2), dtype=np.int64).view(np.uint64)

    def fill(self) -> None:
        for ids in self.held:
            self.pool.free(ids)
        self.held.clear()
        self.mgr.take_offloads()
        self.pool.reset_prefix_cache()
        got = self.pool.allocate(EVICT_TOTAL)
        if not self.present:  # new hashes: each demotion copies (and evicts on the host)
            self.hashes = self._fresh()
        self.pool.cache(got, self.hashes)  # write-through: copied to the host here
        self.mgr.take_offloads()
        self.pool.free(got[::-1])

    def evict(self) -> None:
        self.held.append(self.pool.allocate(EVICT_N))

    def evict_and_drain(self) -> None:
        self.held.append(self.pool.allocate(EVICT_N))
        self.mgr.take_offloads()


def _evict_ops() -> List[Op]:
    n = EVICT_N
    plain = _Evicting(tier=False)
    back = _Evicting(tier=True)
    through = _Evicting(tier=True, write_through=True, present=True)

    def case(impl: str, e: _Evicting) -> Case:
        return Case(impl, e.evict, inner=EVICT_INNER, setup=e.fill, check=_checker(e))

    base = case("device-only", plain)
    drained = [
        Case(impl, e.evict_and_drain, inner=EVICT_INNER, setup=e.fill, check=_checker(e))
        for impl, e in (("kvblocks", back), ("device-only", plain))
    ]
    return [
        Op(
            f"demote/{n}",
            f"allocate {n} evicting cached blocks: demotions recorded",
            "block",
            n,
            [case("kvblocks", back), base],
            note="write-back: each eviction is recorded; its host block (the host LRU "
            "evicts), host entry and offload come with the drain",
        ),
        Op(
            f"demote_present/{n}",
            f"allocate {n} evicting blocks already on the host",
            "block",
            n,
            [case("kvblocks", through), base],
            note="write-through: the hash is on the host already, no copy",
        ),
        Op(
            f"demote_drain/{n}",
            f"allocate {n} evicting cached blocks, then take_offloads",
            "block",
            n,
            drained,
            note="the whole demotion: recorded at eviction, host blocks given and offloads "
            "listed by the drain (device-only: the same calls, nothing to drain)",
        ),
    ]


def _checker(e: _Evicting):
    def check() -> None:  # the timed calls did evict (and demote, with a tier)
        e.fill()
        before = e.mgr.host_stats.demotions
        e.evict()
        assert e.pool.stats.evictions >= EVICT_N
        if e.mgr.host_prefix_cache:
            assert e.mgr.host_stats.demotions - before == EVICT_N

    return check


def _cache_op() -> Op:
    n = EVICT_N
    rng = np.random.default_rng(2)

    def make(tier: bool):
        mgr = BlockManager(
            EVICT_TOTAL + 1,
            BS,
            num_host_blocks=EVICT_TOTAL + 1 if tier else 0,
            host_prefix_cache=tier,
            host_write_through=tier,
        )
        pool = mgr.pool
        state: dict = {}

        def setup() -> None:
            mgr.take_offloads()
            if "ids" in state:
                pool.free(state["ids"])
                pool.reset_prefix_cache()
            state["ids"] = pool.allocate(n)
            state["h"] = rng.integers(0, 2**63, (n, 2), dtype=np.int64).view(np.uint64)

        def fn() -> None:
            pool.cache(state["ids"], state["h"])

        return Case("kvblocks" if tier else "device-only", fn, inner=1, setup=setup)

    return Op(
        f"cache_write_through/{n}",
        f"cache {n} full blocks, written through to the host",
        "block",
        n,
        [make(True), make(False)],
        note="write-through pays the host block and the queued offload when a block is cached",
    )


def _add_ops() -> List[Op]:
    nb = PROMPT_BLOCKS
    tokens = np.random.default_rng(3).integers(0, 128000, nb * BS, dtype=np.int32)

    def device() -> BlockManager:
        mgr = BlockManager(nb + 2, BS)
        mgr.add("warm", tokens)
        mgr.schedule(["warm"], [len(tokens)])
        mgr.free("warm")  # 2,047 full blocks cached, evictable
        return mgr

    def host() -> BlockManager:
        mgr = BlockManager(nb + 2, BS, num_host_blocks=nb + 2, host_prefix_cache=True)
        mgr.add("warm", tokens)
        mgr.schedule(["warm"], [len(tokens)])
        mgr.free("warm")
        mgr.add("flush", np.zeros((nb + 1) * BS, dtype=np.int32))  # evicts all: to the host
        mgr.take_offloads()
        mgr.free("flush")
        mgr.pool.reset_prefix_cache()  # the device holds nothing
        return mgr

    d, h = device(), host()
    assert d.probe(tokens)[0] == h.probe(tokens)[0] == (nb - 1) * BS

    def add(mgr: BlockManager):
        return lambda: mgr.add("s", tokens)

    def reset_device() -> None:
        d.free("s")

    def reset_host() -> None:
        h.take_offloads()
        h.take_onloads()
        h.free("s")
        h.pool.reset_prefix_cache()  # the prompt must come from the host again

    def check_host() -> None:
        before = h.host_stats.hits
        h.add("s", tokens)
        assert h.host_stats.hits - before == nb - 1
        reset_host()

    hits = nb - 1
    return [
        Op(
            f"add_hits/{hits}",
            f"add a {nb * BS // 1024}K-token prompt, {hits:,} cached blocks",
            "block",
            hits,
            [
                Case("kvblocks", add(h), inner=1, teardown=reset_host, check=check_host),
                Case("device-only", add(d), inner=1, teardown=reset_device),
            ],
            note="host: fresh device blocks, onloads queued, device entries registered; "
            "device-only: the cached blocks pinned in place (both include hashing)",
        ),
        Op(
            f"probe/{hits}",
            f"probe that prompt ({hits:,} cached blocks)",
            "block",
            hits,
            [
                Case("kvblocks", lambda: h.probe(tokens)),
                Case("device-only", lambda: d.probe(tokens)),
            ],
            note="block by block: the device prefix ends at once, the host continues it",
        ),
    ]


def build(s: Settings, vllm=None) -> Tuple[List[Op], dict]:
    return _evict_ops() + [_cache_op()] + _add_ops(), {"target_ratio": TARGET}
