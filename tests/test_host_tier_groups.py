"""The host tier with KV cache groups (docs/host-tier.md, "KV cache groups"): a host hit
counts only as far as every group can serve it, by the device rule on the union of the two
tiers; each group onloads the blocks its next query reads that only the host holds; demotion
keeps each entry's group; a state group serves no hit on either tier; a joint hit that does
not fit falls back to the device-only hit before anything changes. The K/V bytes read back
(kvblocks.testing.KVReadback) in every case, and GroupsHostTierMachine runs random engine
steps over random group configurations with the tier."""

import numpy as np
import pytest
from helpers import KEY

from kvblocks import (
    BlockManager,
    BlockRemoved,
    BlockStored,
    KVGroup,
    OutOfBlocksError,
    hash_blocks,
    hash_to_int,
)
from kvblocks.testing import KVReadback
from kvblocks.testing.machines import GroupsEngineMachine

BS = 2
FULL_WINDOW = (KVGroup("full"), KVGroup("sliding_window", window=3))
FULL_CHUNK = (KVGroup("full"), KVGroup("chunked_local", chunk=4))
FULL_STATE = (KVGroup("full"), KVGroup("state", blocks=1))
CONFIGS = {
    "full+window3": FULL_WINDOW,
    "full+chunk4": FULL_CHUNK,
    "window3": (KVGroup("sliding_window", window=3),),
    "chunk4": (KVGroup("chunked_local", chunk=4),),
    "full+full": (KVGroup("full"), KVGroup("full")),
    "window+full+chunk": (
        KVGroup("sliding_window", window=5),
        KVGroup("full"),
        KVGroup("chunked_local", chunk=6),
    ),
}
PROMPT = list(range(1, 10))  # 4 full blocks of 2 and one token


def tier(groups, num_blocks=16, host=24, **kw):
    if kw.get("hash_algo", "siphash") == "siphash":
        kw["hash_key"] = KEY
    return BlockManager(
        num_blocks,
        BS,
        groups=groups,
        num_host_blocks=host,
        host_prefix_cache=True,
        **kw,
    )


def engine(groups, num_blocks=16, host=24, **kw):
    mgr = tier(groups, num_blocks, host, **kw)
    return mgr, KVReadback(mgr)


def run(rb, sid, tokens):
    """Admit, drain, compute, check the bytes; returns the cached tokens."""
    cached = rb.add(sid, tokens)
    rb.drain()
    rb.assert_all()
    rb.forward([sid])
    rb.assert_all()
    rb.mgr.check()
    return cached


def demote_all(rb, tokens=None):
    """A prompt that evicts every evictable device block (demoted to the host), freed."""
    mgr = rb.mgr
    state = sum(g.span for g in mgr.groups if g.kind == "state")
    tokens_groups = sum(g.kind != "state" for g in mgr.groups)
    n = ((mgr.pool.num_free - state) // tokens_groups) * BS
    run(rb, "evict", tokens or [900 + i for i in range(n)])
    rb.free("evict")


def needed_blocks(group, k):
    """Blocks [lo, k) a k-block hit needs in a group (the query at k * BS), as in the device
    rule (docs/hybrid-models.md)."""
    q = k * BS
    if group.kind == "full":
        return set(range(k))
    lo = max(0, q - group.span + 1) if group.kind == "sliding_window" else q - q % group.span
    return set(range(min(lo // BS, k - 1), k))


# -- the joint hit -------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_prompt_continues_on_the_host_in_every_group(name):
    groups = CONFIGS[name]
    mgr, rb = engine(groups)
    run(rb, "a", PROMPT)
    rb.free("a")
    demote_all(rb)
    probe = mgr.probe(PROMPT + [50])
    cached = rb.add("b", PROMPT + [50])
    assert cached == 8 == probe[0]  # all 4 full blocks, served from the host
    onloads = mgr.num_pending_onloads
    rb.drain()
    # each group onloaded exactly the blocks its next query reads, the rest are null entries
    for j, g in enumerate(groups):
        table = mgr.block_table("b", group=j).tolist()
        need = needed_blocks(g, 4)
        assert [i for i in range(4) if table[i] != 0] == sorted(need)
    assert 0 < onloads <= sum(len(needed_blocks(g, 4)) for g in groups)  # (some on the device)
    assert mgr.host_stats.hits == 4 and mgr.host_stats.hit_tokens == 8
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


@pytest.mark.parametrize("name", ["full+window3", "full+chunk4"])
def test_probe_agrees_with_add(name):
    mgr, rb = engine(CONFIGS[name])
    run(rb, "a", PROMPT)
    rb.free("a")
    demote_all(rb)
    cached, need = mgr.probe(PROMPT)
    free = mgr.pool.num_free
    assert rb.add("b", PROMPT) == cached == 8
    assert free - mgr.pool.num_free == need
    rb.drain()
    rb.assert_all()
    mgr.check()


def test_device_and_host_blocks_mix_in_one_hit():
    """The first blocks still on the device, the rest only on the host: the device ones are
    pinned, the others onloaded, and the hit is the whole prefix."""
    mgr, rb = engine(FULL_WINDOW, num_blocks=14)
    run(rb, "a", PROMPT)
    rb.free("a")  # a's tail is freed first: its last blocks head the free list
    run(rb, "x", list(range(700, 707)))  # 8 blocks: 3 free ones, and 5 of a's evicted
    rb.free("x")
    assert 0 < mgr.host_stats.demotions < 10
    cached = rb.add("b", PROMPT)
    assert cached == 8 == mgr.host_stats.hit_tokens + mgr.pool.stats.hit_tokens - 0
    assert 0 < mgr.num_pending_onloads < 5  # the rest of the 5 blocks b holds: device hits
    rb.drain()
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


def test_a_host_hit_counts_only_as_far_as_every_group_serves_it():
    """Blocks 0-2 of both groups on the host, and the full group's block 3 too (cached there
    by hand): the full group alone could serve 4 blocks, the window group only 3 (the query
    at token 8 reads block 3, on neither of its tiers). The joint hit is 3 blocks."""
    mgr, rb = engine(FULL_WINDOW)
    run(rb, "a", PROMPT[:7])  # 3 full blocks in both groups
    rb.free("a")
    demote_all(rb)
    mgr.take_offloads()
    assert mgr.probe(PROMPT)[0] == 6
    hashes = mgr.pool.hash_blocks(PROMPT[:8])  # group 0's hashes (its tag is 0)
    hb = mgr.host_pool.allocate(1)
    assert mgr.host_pool.cache(hb, hashes[3:4], parent=hashes[2], group=0) == 1
    mgr.host_pool.free(hb)
    assert mgr.probe(PROMPT)[0] == 6  # still 3 blocks: the window group limits the hit
    assert rb.add("b", PROMPT) == 6
    assert mgr.num_pending_onloads == 3 + 1  # full: blocks 0-2; window: block 2 only
    rb.drain()
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


def test_a_state_group_makes_host_hits_impossible_as_on_the_device():
    mgr, rb = engine(FULL_STATE)
    run(rb, "a", PROMPT)
    rb.free("a")
    assert mgr.probe(PROMPT)[0] == 0  # no device hit with a state group
    demote_all(rb)
    assert mgr.host_stats.demotions > 0  # the full group's entries are demoted all the same
    assert mgr.probe(PROMPT)[0] == 0
    assert run(rb, "b", PROMPT) == 0
    assert mgr.num_pending_onloads == 0 and mgr.host_stats.hits == 0
    mgr.check()


# -- falls back before anything changes ------------------------------------------------------
@pytest.mark.parametrize("name", ["full+window3", "full+chunk4", "window3"])
def test_out_of_blocks_with_host_hits_changes_nothing(name):
    mgr, rb = engine(CONFIGS[name], num_blocks=12)
    run(rb, "a", PROMPT)
    rb.free("a")
    demote_all(rb)
    run(rb, "f", [800, 801, 802, 803, 804])
    state = (
        mgr.pool.num_free,
        mgr.pool.num_cached,
        mgr.host_pool.num_free,
        mgr.host_pool.num_cached,
        mgr.num_pending_onloads,
        mgr.host_stats,
        mgr.pool.stats,
    )
    big = PROMPT + list(range(100, 100 + 2 * BS * mgr.pool.num_free))
    with pytest.raises(OutOfBlocksError):
        mgr.add("b", big)
    after = (
        mgr.pool.num_free,
        mgr.pool.num_cached,
        mgr.host_pool.num_free,
        mgr.host_pool.num_cached,
        mgr.num_pending_onloads,
        mgr.host_stats,
        mgr.pool.stats,
    )
    assert after == state and "b" not in mgr
    mgr.check()
    rb.free("f")
    assert rb.add("b", PROMPT) == 8  # and the same prompt fits
    rb.drain()
    rb.assert_all()
    mgr.check()


# -- drain hazards ---------------------------------------------------------------------------
def test_onload_destinations_avoid_swap_out_sources_across_groups():
    mgr, rb = engine(FULL_WINDOW, num_blocks=20, host=40)
    run(rb, "a", PROMPT)
    rb.free("a")
    demote_all(rb)
    run(rb, "x", [50, 51, 52])
    sources = set(rb.swap_out("x")[:, 0].tolist())
    assert rb.add("b", PROMPT + [9, 9, 9]) == 8
    onto = set()
    for j in range(2):
        table = mgr.block_table("b", group=j).tolist()
        onto |= {table[i] for i in needed_blocks(FULL_WINDOW[j], 4)}
    assert not onto & sources
    rb.drain()
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()
    rb.swap_in("x")
    rb.drain()
    rb.assert_all()
    mgr.check()


@pytest.mark.parametrize("swap", [False, True])
def test_too_many_swap_out_sources_fall_back_to_the_device_hit(swap):
    """Blocks 0-1 of both groups on the host. The joint hit of a 5-token prompt onloads 3
    blocks (full 0-1, window 1) and computes 2 (block 2 of each group). When 4 free blocks
    are ones a swap-out pair of the coming drain reads, they might all land on onload
    destinations, which the drain would overwrite before the swap pair copies them: the
    host hit is not taken, the tokens are recomputed (decided before anything changes)."""
    mgr, rb = engine(FULL_WINDOW, num_blocks=8, host=40)
    prompt = PROMPT[:5]
    run(rb, "a", prompt)
    rb.free("a")
    demote_all(rb)
    run(rb, "x", [50, 51, 52])  # 2 blocks in each group
    if swap:  # x's 4 blocks are free now, and a swap pair of the coming drain reads each
        sources = set(rb.swap_out("x")[:, 0].tolist())
    else:
        rb.free("x")
    probe = mgr.probe(prompt)
    cached = rb.add("b", prompt)
    assert cached == probe[0] == (0 if swap else 4)
    assert mgr.num_pending_onloads == (0 if swap else 3)
    rb.drain()
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()
    if swap:
        rb.free("b")
        rb.swap_in("x")
        rb.drain()
        rb.assert_all()
        assert len(sources) == 4
    mgr.check()


# -- demotion and events -----------------------------------------------------------------------
def test_demotions_keep_their_group_in_the_host_events():
    mgr, rb = engine(FULL_WINDOW, enable_kv_events=True)
    run(rb, "a", PROMPT)
    rb.free("a")
    stored = [e for e in mgr.pool.take_events() if isinstance(e, BlockStored)]
    by_group = {g: [h for e in stored if e.group_idx == g for h in e.block_hashes] for g in (0, 1)}
    assert by_group[0] and by_group[1] and not set(by_group[0]) & set(by_group[1])
    demote_all(rb)
    mgr.take_offloads()
    host = [e for e in mgr.take_events() if e.medium == "CPU"]
    host_stored = {
        g: {
            h
            for e in host
            if isinstance(e, BlockStored) and e.group_idx == g
            for h in e.block_hashes
        }
        for g in (0, 1)
    }
    assert host_stored[0] and host_stored[0] <= set(by_group[0])
    assert host_stored[1] and host_stored[1] <= set(by_group[1])
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert all(e.group_idx in (0, 1) for e in removed)
    assert rb.add("b", PROMPT) == 8
    rb.drain()
    onloaded = [e for e in mgr.take_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
    for e in onloaded:  # the onloads enter the device cache under their group's hash
        assert set(e.block_hashes) <= set(by_group[e.group_idx])
    rb.assert_all()
    mgr.check()


@pytest.mark.parametrize("name", ["full+window3", "full+chunk4"])
def test_write_through_with_groups_reads_back(name):
    mgr, rb = engine(CONFIGS[name], host_write_through=True)
    run(rb, "a", PROMPT)
    assert mgr.num_pending_offloads > 0  # each group's new cached blocks, copied at once
    rb.free("a")
    demote_all(rb)
    assert run(rb, "b", PROMPT + [3]) == 8
    mgr.check()


def test_recompute_and_swap_with_host_hits_read_back():
    mgr, rb = engine(FULL_WINDOW, num_blocks=24, host=40)
    run(rb, "a", PROMPT)
    rb.free("a")
    demote_all(rb)
    assert run(rb, "b", PROMPT + [11, 12]) == 8
    rb.swap_out("b")
    rb.drain()
    rb.assert_all()
    rb.swap_in("b")
    rb.drain()
    rb.assert_all()
    rb.forward(["b"], [1])  # recompute the newest token
    rb.assert_all()
    rb.append_batch(["b"], [13])
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


# -- the engine state machine ------------------------------------------------------------------
class GroupsHostTierMachine(GroupsEngineMachine):
    """GroupsEngineMachine over a manager whose host pool is a prefix-cache tier (small, so
    the host LRU evicts too): K/V read back after every step, check() after every rule."""

    write_through = False
    hash_algo = "siphash"

    def make_manager(
        self, num_blocks, block_size, *, num_host_blocks, enable_prefix_caching, groups=None
    ):
        return BlockManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host_blocks or 8,
            enable_prefix_caching=True,
            host_prefix_cache=True,
            host_write_through=self.write_through,
            groups=groups,
            hash_algo=self.hash_algo,
        )


class GroupsWriteThroughMachine(GroupsHostTierMachine):
    write_through = True


class GroupsVllmHashMachine(GroupsHostTierMachine):
    """The same in vLLM's 256-bit hash mode: each group's blocks keyed by (hash, group)."""

    hash_algo = "vllm_sha256_cbor"


TestGroupsHostTierEngine = GroupsHostTierMachine.TestCase
TestGroupsWriteThroughEngine = GroupsWriteThroughMachine.TestCase
TestGroupsVllmHashEngine = GroupsVllmHashMachine.TestCase


def test_needed_blocks_matches_the_tables():
    """The helper above agrees with the manager's device hits."""
    mgr = BlockManager(32, BS, groups=FULL_WINDOW)
    mgr.add("a", PROMPT)
    mgr.schedule(["a"], [len(PROMPT)])
    mgr.free("a")
    mgr.add("b", PROMPT)
    table = np.asarray(mgr.block_table("b", group=1))
    assert [i for i in range(4) if table[i]] == sorted(needed_blocks(FULL_WINDOW[1], 4))


# -- the 256-bit hash modes with groups --------------------------------------------------------
@pytest.mark.parametrize("algo", ["vllm_sha256_cbor", "vllm_sha256_cbor_v030", "sglang_sha256"])
def test_256_bit_modes_key_each_group_apart_and_events_carry_hash_and_group(algo):
    """vLLM keys a group's cached block by (block hash, group id): every group's events carry
    the engine's own hash of the block (the same in every group) and their group_idx, on the
    device and on the host; a router's view (cached_hashes) agrees; host hits read back."""
    mgr, rb = engine(FULL_WINDOW, hash_algo=algo, enable_kv_events=True)
    run(rb, "a", PROMPT)
    ref = [hash_to_int(h) for h in hash_blocks(PROMPT, BS, algo=algo)]
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    for g in (0, 1):
        got = [h for e in stored if e.group_idx == g for h in e.block_hashes]
        assert got == ref
        wire = sorted(int(h) for h in mgr.pool.cached_hashes(group=g, wire=True))
        assert wire == sorted(h & (2**64 - 1) for h in ref)
        assert [hash_to_int(h) for h in mgr.block_hashes("a", group=g)] == ref
    rb.free("a")
    demote_all(rb)
    mgr.take_offloads()
    host = [e for e in mgr.take_events() if e.medium == "CPU" and isinstance(e, BlockStored)]
    for g in (0, 1):
        on_host = {h for e in host if e.group_idx == g for h in e.block_hashes}
        assert on_host & set(ref) and on_host <= set(ref) | _evict_hashes(mgr, algo)
    assert rb.add("b", PROMPT) == 8
    rb.drain()
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


def _evict_hashes(mgr, algo):
    """The engine hashes of demote_all's prompts (their blocks may reach the host too)."""
    out = set()
    for size in range(2, 80, 2):
        out |= {hash_to_int(h) for h in hash_blocks([900 + i for i in range(size)], BS, algo=algo)}
    return out


@pytest.mark.parametrize("algo", ["vllm_sha256_cbor", "sglang_sha256"])
def test_256_bit_modes_with_groups_never_share_a_block_across_groups(algo):
    mgr = BlockManager(32, BS, groups=(KVGroup("full"), KVGroup("full")), hash_algo=algo)
    mgr.add("a", PROMPT)
    mgr.schedule(["a"], [len(PROMPT)])
    assert mgr.pool.num_cached == 8  # 4 blocks per group, none shared
    assert mgr.add("b", PROMPT) == 8
    t0, t1 = (set(mgr.block_table("b", group=g).tolist()) for g in (0, 1))
    assert not t0 & t1
    mgr.check()
