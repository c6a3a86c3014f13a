"""Every failing call raises its typed error and leaves the full state exactly as it was."""

import numpy as np
import pytest
from helpers import KEY, compute

import kvblocks
from kvblocks import (
    BlockManager,
    BlockPool,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    OutOfBlocksError,
    UnknownSequenceError,
)


def pool_state(pool):
    return (
        pool.ref_counts().tolist(),
        pool.free_list().tolist(),
        pool.num_cached,
        pool.num_evictable,
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        pool.stats,
    )


def state(mgr):
    tables = {
        s: (
            mgr.block_table(s).tolist(),
            mgr.token_ids(s).tolist(),
            mgr.block_hashes(s).tolist(),
            mgr.is_swapped(s),
        )
        for s in mgr.seq_ids()
    }
    host = pool_state(mgr.host_pool) if mgr.host_pool is not None else None
    return tables, pool_state(mgr.pool), host


@pytest.fixture
def mgr():
    m = BlockManager(12, 4, num_host_blocks=4, hash_key=KEY)
    m.add("a", list(range(10)))  # 3 blocks, last partial
    compute(m, "a")  # its full blocks enter the prefix cache
    m.fork("a", "b")
    m.add(7, list(range(100, 104)))  # one full block
    compute(m, 7)
    m.free(7)  # cached, evictable
    m.add(8, [1, 2])
    return m


def fails(mgr, exc, fn, *args, **kw):
    before = state(mgr)
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert state(mgr) == before
    mgr.check()
    assert isinstance(info.value, KVBlocksError) or exc is MemoryError
    return str(info.value)


def test_out_of_blocks_messages(mgr):
    msg = fails(mgr, OutOfBlocksError, mgr.add, "big", list(range(500, 600)))
    assert "need 25 blocks" in msg and "free" in msg
    fails(mgr, OutOfBlocksError, mgr.append, "a", list(range(40)))
    fails(mgr, OutOfBlocksError, mgr.reserve, "a", 40)
    fails(mgr, OutOfBlocksError, mgr.pool.allocate, 100)


def test_append_batch_all_or_nothing(mgr):
    for i in range(5):
        mgr.add(f"x{i}", list(range(200, 204)))  # full blocks: the next token needs a block
    assert mgr.pool.num_free < 5
    fails(mgr, OutOfBlocksError, mgr.append_batch, [f"x{i}" for i in range(5)], [1] * 5)
    fails(mgr, InvalidArgumentError, mgr.append_batch, ["a", "a"], [1, 2])
    fails(mgr, UnknownSequenceError, mgr.append_batch, ["a", "zz"], [1, 2])
    fails(mgr, InvalidArgumentError, mgr.append_batch, ["a", "b"], [1])
    fails(mgr, InvalidTypeError, mgr.append_batch, ["a"], [1.5])
    fails(mgr, InvalidTypeError, mgr.append_batch, [3.0], [1])
    batch = mgr.batch(["x0"])
    mgr.free("x0")
    fails(mgr, UnknownSequenceError, mgr.append_batch, batch, [1])
    other = BlockManager(4, 4)
    other.add("a", [1])
    fails(mgr, InvalidArgumentError, mgr.append_batch, other.batch(["a"]), [1])


def test_sequence_errors(mgr):
    fails(mgr, DuplicateSequenceError, mgr.add, "a", [1, 2])
    fails(mgr, DuplicateSequenceError, mgr.fork, "a", "b")
    fails(mgr, UnknownSequenceError, mgr.fork, "nope", "c")
    fails(mgr, UnknownSequenceError, mgr.append, "nope", [1])
    fails(mgr, UnknownSequenceError, mgr.free, "nope")
    fails(mgr, UnknownSequenceError, mgr.truncate, "nope", 0)
    fails(mgr, UnknownSequenceError, mgr.reserve, "nope", 1)
    fails(mgr, UnknownSequenceError, mgr.block_table, "nope")
    fails(mgr, UnknownSequenceError, mgr.num_tokens, 12345)
    fails(mgr, InvalidTypeError, mgr.add, 1.5, [1])
    fails(mgr, InvalidTypeError, mgr.add, ("t",), [1])
    fails(mgr, InvalidTypeError, mgr.add, "c", np.array([1.0, 2.0]))
    fails(mgr, InvalidTypeError, mgr.add, "c", ["x"])
    fails(mgr, InvalidArgumentError, mgr.add, "c", np.array([1, 2**40]))
    fails(mgr, InvalidArgumentError, mgr.add, "c", np.zeros((2, 2), dtype=np.int32))
    fails(mgr, InvalidTypeError, mgr.add, "c", [1], salt=1.5)
    fails(mgr, InvalidArgumentError, mgr.truncate, "a", 11)
    fails(mgr, InvalidArgumentError, mgr.truncate, "a", -1)
    fails(mgr, InvalidArgumentError, mgr.reserve, "a", -1)
    fails(mgr, InvalidArgumentError, mgr.blocks_needed, "a", -1)
    assert isinstance(UnknownSequenceError("x"), KeyError)
    assert isinstance(DuplicateSequenceError("x"), ValueError)


def test_swap_errors(mgr):
    fails(mgr, InvalidStateError, mgr.swap_in, "a")
    mgr.swap_out(8)  # host: 3 usable blocks, 2 left
    msg = fails(mgr, OutOfBlocksError, mgr.swap_out, "a")  # needs 3
    assert "need 3 host blocks, 2 free" in msg
    fails(mgr, InvalidStateError, mgr.swap_out, 8)
    fails(mgr, InvalidStateError, mgr.append, 8, [1])
    fails(mgr, InvalidStateError, mgr.append_batch, [8], [1])
    fails(mgr, InvalidStateError, mgr.fork, 8, 9)
    fails(mgr, InvalidStateError, mgr.truncate, 8, 0)
    fails(mgr, InvalidStateError, mgr.metadata, [8], [1])
    nohost = BlockManager(8, 4)
    nohost.add("a", [1])
    fails(nohost, InvalidStateError, nohost.swap_out, "a")


def test_pool_errors():
    pool = BlockPool(8, hash_key=KEY)
    ids = pool.allocate(3)
    h = kvblocks.hash_blocks(list(range(12)), 4, key=KEY)
    pool.cache(ids, h)
    pool.free(ids[::-1])
    held = pool.allocate(2)
    for call, exc in [
        (lambda: pool.allocate(-1), InvalidArgumentError),
        (lambda: pool.allocate(8), OutOfBlocksError),
        (lambda: pool.free([0]), InvalidArgumentError),  # the null block
        (lambda: pool.free([8]), InvalidArgumentError),
        (lambda: pool.free([-3]), InvalidArgumentError),
        (lambda: pool.free([ids[0]]), InvalidStateError),  # free already
        (lambda: pool.free([held[0], held[0]]), InvalidStateError),  # more than it holds
        (lambda: pool.free([held[0], 99]), InvalidArgumentError),  # undo the first
        (lambda: pool.incref([0]), InvalidArgumentError),
        (lambda: pool.incref([7]), InvalidStateError),  # free, never cached
        (lambda: pool.incref([held[0], 9]), InvalidArgumentError),
        (lambda: pool.free(np.array([1.0])), InvalidTypeError),
        (lambda: pool.cache(held, h[:1]), InvalidArgumentError),  # lengths differ
        (lambda: pool.cache([7], h[:1]), InvalidStateError),  # not referenced
        (lambda: pool.cache(held[:1], h[1:2].astype(np.int64)), InvalidTypeError),
        (lambda: pool.cache(held[:1], h[1:2].reshape(2, 1)), InvalidArgumentError),
        (lambda: pool.lookup(np.zeros((2, 3), dtype=np.uint64)), InvalidArgumentError),
        (lambda: pool.ref_count(99), InvalidArgumentError),
    ]:
        before = pool_state(pool)
        with pytest.raises(exc):
            call()
        assert pool_state(pool) == before
        pool.check()
    # a block already cached under another hash
    pinned = pool.lookup_and_pin(h)
    assert pinned.tolist() == ids.tolist()
    before = pool_state(pool)
    with pytest.raises(InvalidArgumentError):
        pool.cache(pinned[:1], h[1:2])
    assert pool_state(pool) == before
    with pytest.raises(InvalidStateError):
        pool.reset_prefix_cache()  # cached blocks are referenced
    assert pool_state(pool) == before
    nocache = BlockPool(4, enable_prefix_caching=False)
    with pytest.raises(InvalidStateError):
        nocache.cache(nocache.allocate(1), h[:1])


def test_constructor_errors():
    for call in [
        lambda: BlockPool(0),  # BlockPool(1), the null block alone, is valid
        lambda: BlockManager(1, 4),  # a manager needs one block besides the null block
        lambda: BlockManager(8, 0),
        lambda: BlockManager(8, 4, watermark=1.0),
        lambda: BlockManager(8, 4, watermark=-0.1),
        lambda: BlockManager(8, 4, num_host_blocks=1),
        lambda: BlockManager(8, 4, hash_key=b"short"),
        lambda: BlockPool(8, hash_key=123),
    ]:
        with pytest.raises(KVBlocksError):
            call()


def test_hash_blocks_errors():
    with pytest.raises(InvalidArgumentError):
        kvblocks.hash_blocks([1, 2], 0)
    with pytest.raises(InvalidArgumentError):
        kvblocks.hash_blocks([1, 2], 1, key=b"x" * 15)
    with pytest.raises(InvalidArgumentError):
        kvblocks.hash_blocks([1, 2], 1, parent=1, salt="s")
    with pytest.raises(InvalidArgumentError):
        kvblocks.hash_blocks([1, 2], 1, parent=-1)
    with pytest.raises(InvalidArgumentError):
        kvblocks.hash_blocks([1, 2], 1, parent=np.zeros(3, dtype=np.uint64))
    with pytest.raises(InvalidTypeError):
        kvblocks.hash_blocks([1, 2], 1, salt=[1])


def test_success_paths_after_failures(mgr):
    """The same calls succeed once the cause is gone (every failing op has a passing twin)."""
    mgr.free("b")
    mgr.free(8)
    assert mgr.add("c", list(range(10))) == 8  # full blocks of "a" are cached
    mgr.append("a", [5])
    mgr.reserve("a", 2)
    mgr.truncate("a", 3)
    mgr.fork("a", "d")
    pairs = mgr.swap_out("d")
    assert pairs.shape == (1, 2)
    assert mgr.swap_in("d").shape == (1, 2)
    mgr.check()


def test_hash_list_arguments():
    pool = BlockPool(4, hash_key=KEY)
    h = kvblocks.hash_blocks([1, 2, 3, 4], 4, key=KEY)
    as_ints = [int(h[0, 0]) | (int(h[0, 1]) << 64)]
    assert pool.lookup(as_ints).size == 0  # 128-bit ints are accepted
    for bad in ([-1], [1 << 128], [1, "x"]):
        with pytest.raises(InvalidArgumentError):
            pool.lookup(bad)
