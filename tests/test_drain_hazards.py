"""Drain hazards, enumerated: every kind of pending pair x every call that releases or re-hands
out its block before the drain x every later claimant of a free block, with byte read-back.

One schedule phase builds a pending pair (a copy-on-write copy, a swap-out, a swap-in, an
offload or an onload), then a releasing call acts on the pair's owner (free, truncate,
swap_out, reset_prefix_cache, or an evicting add), then a claimant takes free blocks (a fresh
prompt, a prompt served from the host, a swap_in, a copy-on-write write, a prompt with device
hits). ``check()`` runs before the drain, where a conflict between pending pairs is visible
(after it every pair has run); then the documented drain and one forward pass, and every live
sequence must read back exactly its own K/V. docs/host-tier.md has the rule each cell follows.

Found on 2a8a32e: swap_in, free, then an add whose prefix is on the host took the freed
swap-in destination as an onload destination; the onload ran before the swap pair, which then
overwrote the onloaded prefix (the new prompt read the freed sequence's K/V).
"""

import itertools

import numpy as np
import pytest

from kvblocks import BlockManager, KVBlocksError, OutOfBlocksError
from kvblocks.testing import KVReadback

BS = 2
H_PROMPT = [1, 2, 3, 4, 5]  # served from the host to the "onload" claimant
Q_PROMPT = [30, 31, 32, 33, 34]  # served from the host to the onload pair's owner


class Cell:
    """One engine (device pool, host tier, K/V caches) and the state of one matrix cell."""

    def __init__(self, write_through: bool) -> None:
        self.mgr = BlockManager(
            24,
            BS,
            num_host_blocks=96,
            host_prefix_cache=True,
            host_write_through=write_through,
        )
        self.rb = KVReadback(self.mgr)
        self.owner_tokens = []  # the prompt of the pending pair's owner "o"
        self.fresh = itertools.count(1000)

    def step(self) -> None:
        """The drain in the documented order, then one forward over every live sequence
        with tokens to compute."""
        self.rb.drain()
        todo = [
            s for s, e in self.rb.expected.items() if not e.swapped and len(e.tokens) > e.computed
        ]
        if todo:
            self.rb.forward(todo)

    def computed(self, sid, tokens) -> None:
        self.rb.add(sid, tokens)
        self.step()

    def on_host(self, tokens) -> None:
        """tokens' full blocks are on the host tier and nowhere on the device."""
        self.computed("tmp", tokens)
        self.rb.free("tmp")
        filler = [next(self.fresh) for _ in range(BS * (self.mgr.pool.num_free - 1) + 1)]
        self.computed("filler", filler)  # evicts every cached block: demoted to the host
        self.rb.free("filler")
        self.step()
        self.mgr.pool.reset_prefix_cache()  # the device copies are gone, the host ones stay

    def swapped(self, sid, tokens) -> None:
        self.computed(sid, tokens)
        self.rb.swap_out(sid)
        self.step()


# -- the pending pairs ------------------------------------------------------------------------
def pair_copy(c: Cell) -> None:
    c.owner_tokens = [60, 61, 62]
    c.computed("o", c.owner_tokens)  # last block partial
    c.rb.fork("o", "o/child")
    c.rb.append("o", [63])  # o writes into the shared partial block: (src, dst) pending
    assert c.mgr.num_pending_copies == 1


def pair_swap_out(c: Cell) -> None:
    c.owner_tokens = [70, 71, 72, 73, 74]
    c.computed("o", c.owner_tokens)
    c.rb.swap_out("o")  # its device blocks are released, their swap pairs pending


def pair_swap_in(c: Cell) -> None:
    c.owner_tokens = [80, 81, 82, 83, 84]
    c.swapped("o", c.owner_tokens)
    release_evict(c)  # o's device copies are evicted: every block comes back by a swap pair
    c.step()
    assert len(c.rb.swap_in("o")) == 3


def pair_offload(c: Cell) -> None:
    c.owner_tokens = [next(c.fresh) for _ in range(BS * (c.mgr.pool.num_free - 6) - 1)]
    c.computed("z", [90, 91, 92, 93, 94])
    c.computed("spare", [next(c.fresh) for _ in range(6 * BS)])
    c.rb.free("z")  # cached, evictable, before spare's blocks in the LRU
    c.rb.free("spare")
    c.rb.add("o", c.owner_tokens)  # evicts z's blocks, not spare's
    assert c.mgr.num_pending_offloads >= 2  # demoted (or written through): o holds them now


def pair_onload(c: Cell) -> None:
    c.owner_tokens = Q_PROMPT[:4] + [39]
    c.rb.add("o", c.owner_tokens)
    assert c.mgr.num_pending_onloads == 2


PAIRS = {
    "copy": pair_copy,
    "swap_out": pair_swap_out,
    "swap_in": pair_swap_in,
    "offload": pair_offload,
    "onload": pair_onload,
}


# -- the releasing calls (on the pair's owner "o") --------------------------------------------
def release_free(c: Cell) -> None:
    c.rb.free("o")


def release_truncate(c: Cell) -> None:
    c.rb.truncate("o", 1)


def release_swap_out(c: Cell) -> None:
    c.rb.swap_out("o")


def release_reset(c: Cell) -> None:
    c.mgr.pool.reset_prefix_cache()


def release_evict(c: Cell) -> None:
    """An add that takes every free block (evicting the cached ones), then its free."""
    n = c.mgr.pool.num_free
    if n:
        c.rb.add("evictor", [next(c.fresh) for _ in range(BS * n - 1)])
        c.rb.free("evictor")


RELEASES = {
    "free": release_free,
    "truncate": release_truncate,
    "swap_out": release_swap_out,
    "reset_prefix_cache": release_reset,
    "evicting_add": release_evict,
}


# -- the claimants ------------------------------------------------------------------------------
def claim_fresh(c: Cell) -> None:
    c.rb.add("claim", [next(c.fresh) for _ in range(5)])


def claim_onload(c: Cell) -> None:
    # both full blocks from the host, unless every fresh block is one a swap pair reads or
    # writes: then the hit ends early (those tokens are recomputed)
    assert c.rb.add("claim", H_PROMPT[:4] + [9]) in (0, 2, 4)


def claim_swap_in(c: Cell) -> None:
    c.rb.swap_in("w")


def claim_copy(c: Cell) -> None:
    c.rb.append("l", [66])  # l's partial block is shared with l/child: a fresh destination


def claim_hit(c: Cell) -> None:
    c.rb.add("claim", c.owner_tokens[:4] + [7])  # hits what the device caches of o's prompt


CLAIMS = {
    "fresh": claim_fresh,
    "onload": claim_onload,
    "swap_in": claim_swap_in,
    "copy": claim_copy,
    "hit": claim_hit,
}


def prepare(c: Cell) -> None:
    """What every claimant needs, made before the cell's schedule phase."""
    c.on_host(H_PROMPT)
    c.on_host(Q_PROMPT)
    c.swapped("w", [40, 41, 42])
    c.computed("l", [44, 45, 46])
    c.rb.fork("l", "l/child")


@pytest.mark.parametrize("write_through", [False, True], ids=["write_back", "write_through"])
@pytest.mark.parametrize("claim", list(CLAIMS))
@pytest.mark.parametrize("release", list(RELEASES))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_released_block_of_a_pending_pair_is_never_misread(pair, release, claim, write_through):
    c = Cell(write_through)
    prepare(c)
    PAIRS[pair](c)
    c.mgr.check()
    before = set(c.rb.expected)
    try:
        RELEASES[release](c)
    except KVBlocksError:
        assert set(c.rb.expected) == before  # refused: nothing changed
    c.mgr.check()
    CLAIMS[claim](c)
    c.mgr.check()  # before the drain: no onload writes a block a swap pair reads or writes
    c.step()
    c.rb.assert_all()
    c.mgr.check()
    for sid in list(c.rb.expected):  # and the next steps still read back
        if c.rb.expected[sid].swapped:
            try:
                c.rb.swap_in(sid)
            except OutOfBlocksError:
                c.rb.free(sid)
    c.step()
    c.rb.assert_all()
    c.mgr.check()


def test_freed_swap_in_destination_is_never_an_onload_destination():
    """The reported case, directed: the freed destination heads the free list, and the host
    hit trades it with the block of a position the forward computes."""
    c = Cell(False)
    c.on_host(H_PROMPT)
    c.swapped("s", [40, 41, 42, 43, 44])
    c.mgr.pool.reset_prefix_cache()
    dests = set(c.rb.swap_in("s")[:, 1].tolist())
    c.rb.free("s")
    assert c.rb.add("q", H_PROMPT[:4] + [9]) == 4  # the host hit is kept
    table = c.mgr.block_table("q").tolist()
    assert not set(table[:2]) & dests  # no onload writes a block a swap-in pair writes
    c.mgr.check()
    c.step()
    c.rb.assert_all()
    assert np.array_equal(c.mgr.block_table("q"), table)
