"""KV events (issue 24, findings 2 and 7): the request's extra keys on the wire, and the C
writer (``pool.take_events_wire`` / ``encode_batch(pool)``) giving the bytes of the Python path
(``encode_batch(pool.take_events())``) on any workload.

The class test drives two managers with the same hash key through the same random calls
(adds with and without salts and adapters, appends, forks, frees, evictions, host-tier
demotions, resets, groups) and compares the two paths' bytes at every drain, in both forms
and both hash signednesses.
"""

from __future__ import annotations

import random

import pytest

msgspec = pytest.importorskip("msgspec")

from helpers import KEY, compute

import kvblocks
from kvblocks import BlockManager, BlockPool, KVGroup
from kvblocks.errors import InvalidArgumentError, InvalidTypeError
from kvblocks.events import AllBlocksCleared, BlockStored, coalesce, encode_batch

decode = msgspec.msgpack.decode

REQUESTS = [
    {},
    {"salt": "tenant-a"},
    {"salt": b"\x00bytes-salt"},
    {"lora_name": "alice", "lora_id": 1},
    {"lora_name": "bob"},
    {"salt": "tenant-b", "lora_name": "alice", "lora_id": 1},
    {"salt": ""},  # vLLM: an empty salt is none
]


def stored(payload):
    return [e for e in decode(payload)[1] if e["type"] == "BlockStored"]


# -- extra keys ---------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["siphash", "vllm_sha256_cbor_v030"])
def test_salt_on_block_0_and_the_adapter_on_every_block(algo):
    mgr = BlockManager(
        32, 4, hash_key=KEY if algo == "siphash" else None, hash_algo=algo, enable_kv_events=True
    )
    mgr.add("a", list(range(13)), salt="t", lora_name="L", lora_id=7)
    compute(mgr, "a")
    (a1,) = stored(encode_batch(mgr.pool.take_events(), ts=0.0))  # the Python path
    mgr.append("a", [1, 2, 3, 4])
    compute(mgr, "a")
    mgr.add("b", list(range(50, 59)), salt="t")
    compute(mgr, "b")
    mgr.add("c", list(range(80, 89)))
    compute(mgr, "c")
    a2, b, c = stored(encode_batch(mgr.pool, ts=0.0))  # the C writer
    assert a1["extra_keys"] == [["L", "t"], ["L"], ["L"]] and a1["parent_block_hash"] is None
    assert a2["extra_keys"] == [["L"]] and a2["parent_block_hash"] == a1["block_hashes"][-1]
    assert (a1["lora_name"], a1["lora_id"], a2["lora_name"], a2["lora_id"]) == ("L", 7, "L", 7)
    assert b["extra_keys"] == [["t"], None] and b["lora_id"] is None and b["lora_name"] is None
    assert c["extra_keys"] == [None, None]
    mgr.check()


def test_bytes_salt_goes_out_as_bin_and_empty_salt_as_none():
    pool = BlockPool(8, block_size=2, hash_key=KEY, enable_kv_events=True)
    h = kvblocks.hash_blocks([1, 2, 3, 4], 2, key=KEY)
    pool.cache(pool.allocate(2), h, token_ids=[1, 2, 3, 4], salt=b"\xffs")
    payload = pool.take_events_wire(ts=0.0)
    assert b"\xc4\x02\xffs" in payload
    assert stored(payload)[0]["extra_keys"] == [[b"\xffs"], None]
    h2 = kvblocks.hash_blocks([5, 6], 2, key=KEY)
    pool.cache(pool.allocate(1), h2, token_ids=[5, 6], salt="")
    (ev,) = pool.take_events()
    assert ev.extra_keys is None


def test_the_salt_is_only_on_a_chains_first_block():
    """pool.cache with a parent continues a chain: its first block carries no salt."""
    pool = BlockPool(8, block_size=2, hash_key=KEY, enable_kv_events=True)
    h = kvblocks.hash_blocks([1, 2, 3, 4], 2, key=KEY)
    pool.cache(pool.allocate(1), h[1:], parent=h[0], token_ids=[3, 4], salt="s", lora_name="A")
    (ev,) = pool.take_events()
    assert ev.extra_keys == [("A",)]
    assert ev.lora_id is None


def test_coalesce_keeps_extra_keys_per_block():
    a = BlockStored([1], None, [0, 0], 2, lora_name="L", extra_keys=[("L", "s")])
    b = BlockStored([2], 1, [0, 0], 2, lora_name="L")  # none given: nil for its block
    (m,) = coalesce([a, b])
    assert m.extra_keys == [("L", "s"), None] and a.extra_keys == [("L", "s")]
    (st,) = decode(encode_batch([m], ts=0.0))[1]
    assert st["extra_keys"] == [["L", "s"], None]


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda m: m.add("x", range(9), lora_id=3), InvalidArgumentError),
        (lambda m: m.add("x", range(9), lora_name="A", lora_id=-1), InvalidArgumentError),
        (lambda m: m.add("x", range(9), lora_name="A", lora_id="3"), InvalidTypeError),
        (lambda m: m.add("x", range(9), lora_name="A", lora_id=1.0), InvalidTypeError),
        (lambda m: m.add("x", range(9), salt=3), InvalidTypeError),
    ],
    ids=["id-without-name", "negative-id", "str-id", "float-id", "int-salt"],
)
def test_bad_adapter_or_salt_changes_nothing(call, exc):
    mgr = BlockManager(16, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", range(9), lora_name="A", lora_id=1)
    compute(mgr, "a")
    before = (mgr.pool.num_free, mgr.pool.num_cached, len(mgr), mgr.pool.stats.queries)
    with pytest.raises(exc):
        call(mgr)
    assert (mgr.pool.num_free, mgr.pool.num_cached, len(mgr), mgr.pool.stats.queries) == before
    assert "x" not in mgr
    mgr.check()


def test_bad_extra_keys_on_an_event_raise_typed_errors():
    with pytest.raises(InvalidArgumentError, match="extra_keys"):
        encode_batch([BlockStored([1, 2], None, [0] * 4, 2, extra_keys=[None])], ts=0)
    with pytest.raises(InvalidArgumentError, match="extra_keys"):
        encode_batch([BlockStored([1], None, [0] * 2, 2, extra_keys=(None,))], ts=0)
    with pytest.raises(InvalidTypeError):
        encode_batch([BlockStored([1], None, [0] * 2, 2, extra_keys=[(object(),)])], ts=0)
    with pytest.raises(InvalidArgumentError, match="lora_id"):
        BlockPool(8, hash_key=KEY).cache([], [], lora_id=1)


# -- the C writer -------------------------------------------------------------------------------
def twins(**kw):
    """Two managers that hash alike (same key) and record events."""
    nb = kw.pop("num_blocks", 24)
    return [BlockManager(nb, 4, hash_key=KEY, enable_kv_events=True, **kw) for _ in range(2)]


def settle(m):
    """Drain the host tier's pending copies (a step does before it computes)."""
    if m.host_pool is not None:
        m.take_offloads()
        m.take_onloads()


def drive(mgrs, rng, steps, check):
    """The same random calls on every manager of mgrs; check(mgrs) after each."""
    n = 0
    for _ in range(steps):
        r = rng.random()
        live = list(mgrs[0].seq_ids())
        if r < 0.45 or not live:
            kw = rng.choice(REQUESTS)
            toks = [rng.randrange(6) for _ in range(rng.randrange(1, 22))]
            sid = f"s{n}"
            n += 1
            for m in mgrs:
                try:
                    m.add(sid, toks, **kw)
                    settle(m)
                    compute(m, sid)
                except kvblocks.OutOfBlocksError:
                    pass
        elif r < 0.65:
            sid = rng.choice(live)
            toks = [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
            for m in mgrs:
                try:
                    m.append(sid, toks)
                    settle(m)
                    m.take_copies()
                    compute(m, sid)
                except kvblocks.OutOfBlocksError:
                    m.free(sid)
        elif r < 0.72:
            sid, child = rng.choice(live), f"s{n}"
            n += 1
            for m in mgrs:
                settle(m)
                m.fork(sid, child)
        elif r < 0.97:
            sid = rng.choice(live)
            for m in mgrs:
                m.free(sid)
        else:
            for m in mgrs:
                for s in list(m.seq_ids()):
                    m.free(s)
                m.pool.reset_prefix_cache()
        for m in mgrs:
            settle(m)
        check(mgrs)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fmt, hash_int", [("map", "unsigned"), ("array", "signed")])
def test_c_writer_matches_the_python_path_on_random_workloads(seed, fmt, hash_int):
    rng = random.Random(seed)
    kw = dict(fmt=fmt, hash_int=hash_int, data_parallel_rank=rng.choice([0, 3, 200, None]))
    seen = []

    def check(mgrs):
        py = encode_batch(mgrs[0].pool.take_events(), ts=2.5, **kw)
        c = encode_batch(mgrs[1].pool, ts=2.5, **kw)
        assert c == py
        seen.append(len(decode(c)[1]))
        assert mgrs[1].pool.take_events() == []  # drained

    drive(twins(), rng, 60, check)
    assert sum(seen) > 20  # the workload produced events


@pytest.mark.parametrize("seed", range(3))
def test_c_writer_matches_with_groups(seed):
    groups = (KVGroup("full"), KVGroup("sliding_window", window=8))
    rng = random.Random(seed)

    def check(mgrs):
        assert encode_batch(mgrs[1].pool, ts=0.5) == encode_batch(
            mgrs[0].pool.take_events(), ts=0.5
        )

    drive(twins(groups=groups, num_blocks=40), rng, 40, check)


@pytest.mark.parametrize("seed", range(3))
def test_manager_batch_is_both_pools_events_in_recorded_order(seed):
    """encode_batch(mgr): both pools' events in one batch, in the order they were recorded:
    the bytes of the Python path on mgr.take_events() (docs/host-tier.md, "Events")."""
    rng = random.Random(seed)

    def check(mgrs):
        a, b = mgrs
        evs = a.take_events()
        assert encode_batch(b, ts=1.0, data_parallel_rank=300) == encode_batch(
            evs, ts=1.0, data_parallel_rank=300
        )
        assert not b.pool.take_events() and not b.host_pool.take_events()  # both drained

    mgrs = twins(num_host_blocks=16, host_prefix_cache=True, num_blocks=16)
    drive(mgrs, rng, 60, check)
    media = {e["medium"] for e in decode(encode_batch(mgrs[1], ts=0))[1]} | {"GPU"}
    assert media <= {"GPU", "CPU"}


def test_wide_values_take_msgpack_s_wider_forms():
    """Token ids across int32, 16+ events and hashes, long names: the writer picks msgspec's
    forms (fixint, cc..cf, d0..d3, fixstr, d9, da, dc)."""
    bs = 20
    pool = BlockPool(64, block_size=bs, hash_key=KEY, enable_kv_events=True)
    rng = random.Random(5)
    toks = [
        rng.choice(
            [
                0,
                127,
                128,
                255,
                256,
                65535,
                65536,
                2**31 - 1,
                -1,
                -32,
                -33,
                -128,
                -129,
                -32768,
                -32769,
                -(2**31),
            ]
        )
        for _ in range(bs * 20)
    ]
    h = kvblocks.hash_blocks(toks, bs, key=KEY)
    ids = pool.allocate(20)
    pool.cache(
        ids[:18],
        h[:18],
        token_ids=toks[: 18 * bs],
        lora_name="x" * 40,
        salt="s" * 300,
        lora_id=2**40,
    )
    for i in (18, 19):  # separate events: 19 events in all
        pool.cache(
            ids[i : i + 1],
            h[i : i + 1],
            parent=h[i - 1] if i == 18 else 12345,
            token_ids=toks[i * bs : (i + 1) * bs],
        )
    for k in range(17):
        pool.free(ids[k : k + 1])
    pool.free(ids[17:])
    pool.allocate(63)  # evicts all 20, one removal event (one group)
    twin = BlockPool(64, block_size=bs, hash_key=KEY, enable_kv_events=True)
    assert pool.num_free == 0 and twin.num_free == 63
    c = pool.take_events_wire(ts=1e9, data_parallel_rank=70000)
    # replay the same calls on the twin for the Python path
    ids2 = twin.allocate(20)
    twin.cache(
        ids2[:18],
        h[:18],
        token_ids=toks[: 18 * bs],
        lora_name="x" * 40,
        salt="s" * 300,
        lora_id=2**40,
    )
    for i in (18, 19):
        twin.cache(
            ids2[i : i + 1],
            h[i : i + 1],
            parent=h[i - 1] if i == 18 else 12345,
            token_ids=toks[i * bs : (i + 1) * bs],
        )
    for k in range(17):
        twin.free(ids2[k : k + 1])
    twin.free(ids2[17:])
    twin.allocate(63)
    assert c == encode_batch(twin.take_events(), ts=1e9, data_parallel_rank=70000)
    ts, events, dp = decode(c)
    assert dp == 70000 and events[0]["token_ids"] == toks[: 18 * bs]
    assert events[0]["extra_keys"][0] == ["x" * 40, "s" * 300]


def test_empty_log_and_cleared():
    pool = BlockPool(8, enable_kv_events=True)
    assert pool.take_events_wire(ts=1.5) == encode_batch([], ts=1.5)
    pool.reset_prefix_cache()
    assert pool.take_events_wire(ts=1.5) == encode_batch([AllBlocksCleared()], ts=1.5)
    pool.reset_prefix_cache()
    assert pool.take_events_wire(ts=1.5, fmt="array") == encode_batch(
        [AllBlocksCleared()], ts=1.5, fmt="array"
    )


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(ts="now"), InvalidTypeError),
        (dict(ts=0, fmt="json"), InvalidArgumentError),
        (dict(ts=0, hash_int="u64"), InvalidArgumentError),
        (dict(ts=0, data_parallel_rank=-1), InvalidArgumentError),
        (dict(ts=0, data_parallel_rank=1.0), InvalidArgumentError),
    ],
    ids=["ts", "fmt", "hash_int", "rank", "float-rank"],
)
def test_c_writer_bad_arguments_drain_nothing(kw, exc):
    mgr = BlockManager(8, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", range(9))
    compute(mgr, "a")
    with pytest.raises(exc):
        encode_batch(mgr.pool, **kw)
    with pytest.raises(exc):
        encode_batch(mgr, **kw)
    assert len(mgr.pool.take_events()) == 1  # still there


def test_c_writer_refuses_a_stored_block_without_tokens_and_drains_nothing():
    """A block cached without token_ids while events were off, demoted to the host tier
    once events are on: the host's BlockStored has no tokens. Both paths refuse it; the C
    writer drains neither log (the device's removal stays too)."""
    mgr = BlockManager(
        6, 4, hash_key=KEY, num_host_blocks=8, host_prefix_cache=True, enable_kv_events=True
    )
    mgr.pool.record_events = mgr.host_pool.record_events = False
    ids = mgr.pool.allocate(1)
    mgr.pool.cache(ids, kvblocks.hash_blocks(range(4), 4, key=KEY))  # no tokens kept
    mgr.pool.free(ids)
    mgr.pool.record_events = mgr.host_pool.record_events = True
    mgr.pool.free(mgr.pool.allocate(mgr.pool.num_free))  # evicts it: demoted to the host
    mgr.take_offloads()
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        encode_batch(mgr, ts=0)
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        encode_batch(mgr.host_pool, ts=0)
    assert [type(e).__name__ for e in mgr.pool.take_events()] == ["BlockRemoved"]
    evs = mgr.host_pool.take_events()  # still there
    assert [type(e).__name__ for e in evs] == ["BlockStored"] and evs[0].token_ids == []
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        encode_batch(evs, ts=0)


def test_router_consistency_state_unchanged_by_the_c_path():
    """After a drain through the C writer the pool's state (cache, counters) is unchanged:
    only the log was cleared."""
    mgr = BlockManager(16, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", range(17), salt="t")
    compute(mgr, "a")
    before = (mgr.pool.num_cached, mgr.pool.num_free, mgr.pool.events_dropped)
    assert len(stored(encode_batch(mgr.pool, ts=0))) == 1
    assert (mgr.pool.num_cached, mgr.pool.num_free, mgr.pool.events_dropped) == before
    mgr.check()


# -- cached_hashes: the router consistency check -------------------------------------------------
def test_cached_hashes_equal_what_a_router_applying_every_event_holds():
    rng = random.Random(11)
    router: set = set()

    def check(mgrs):
        for ev in decode(encode_batch(mgrs[0].pool, ts=0))[1]:
            if ev["type"] == "BlockStored":
                router.update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                router.difference_update(ev["block_hashes"])
            else:
                router.clear()
        pool = mgrs[0].pool
        assert set(pool.cached_hashes(wire=True).tolist()) == router
        full = pool.cached_hashes()
        assert full.shape == (pool.num_cached, 2) and full.dtype.name == "uint64"
        assert [kvblocks.hash_to_int(h) for h in full] == [
            pool.block_hash(b) for b in range(pool.num_blocks) if pool.is_cached(b)
        ]

    drive(twins(num_blocks=20)[:1], rng, 80, check)


def test_cached_hashes_by_group_and_bad_input():
    groups = (KVGroup("full"), KVGroup("sliding_window", window=4))
    mgr = BlockManager(32, 4, hash_key=KEY, groups=groups)
    mgr.add("a", list(range(9)))
    compute(mgr, "a")
    g0, g1 = mgr.pool.cached_hashes(group=0), mgr.pool.cached_hashes(group=1)
    assert len(g0) == len(g1) == 2 and len(mgr.pool.cached_hashes()) == 4
    assert (g0 == mgr.block_hashes("a", group=0)).all()
    assert mgr.pool.cached_hashes(group=5).shape == (0, 2)
    with pytest.raises(InvalidTypeError):
        mgr.pool.cached_hashes(group="0")
    with pytest.raises(InvalidArgumentError):
        mgr.pool.cached_hashes(group=-1)
    with pytest.raises(InvalidArgumentError):
        mgr.pool.cached_hashes(group=255)
    with pytest.raises(TypeError):
        mgr.pool.cached_hashes(0)  # keyword only
    assert BlockPool(4).cached_hashes(wire=True).shape == (0,)


def test_block_hash_bad_input():
    pool = BlockPool(4)
    assert pool.block_hash(1) is None
    with pytest.raises(InvalidArgumentError):
        pool.block_hash(4)
    with pytest.raises(InvalidTypeError):
        pool.block_hash("1")
    assert "128-bit" in BlockPool.block_hash.__doc__
