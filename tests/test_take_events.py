"""take_events() merges in C what coalesce() merges: checked against the pool's own state.

The drained events, applied in order to a set, must give exactly the hashes the pool has
cached (is_cached / block_hash of every block), with every stored chain carrying its tokens;
and the drain is already maximal: coalesce() of it changes nothing.
"""

import numpy as np
from helpers import KEY, compute
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored, KVGroup
from kvblocks.errors import KVBlocksError
from kvblocks.events import coalesce

GROUPS = [
    (KVGroup("full"),),
    (KVGroup("full"), KVGroup("sliding_window", window=6)),
]

ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "append", "compute", "free", "reset", "drain"]),
        st.integers(0, 5),
        st.integers(1, 12),
        st.sampled_from([None, "ad-1", "ad-2"]),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(GROUPS))), ops, st.integers(0, 3))
def test_drained_events_replay_to_the_cache(gi, script, vocab):
    mgr = BlockManager(24, 2, groups=GROUPS[gi], hash_key=KEY, enable_kv_events=True)
    held = set()  # hashes the events say are cached (group-blind: hashes differ per group)
    live = {}
    rng = np.random.default_rng(vocab)

    def drain():
        evs = mgr.pool.take_events()
        assert coalesce(evs) == evs  # maximal already
        for ev in evs:
            if isinstance(ev, BlockStored):
                assert (
                    len(ev.token_ids)
                    == len(ev.block_hashes) * ev.block_size
                    == len(ev.block_hashes) * 2
                )
                assert held.isdisjoint(ev.block_hashes)
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= held
                held.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                held.clear()

    for op, i, n, lora in script:
        sid = f"s{i}"
        try:
            if op == "add" and sid not in live:
                toks = rng.integers(0, 1 + vocab, n).tolist()
                mgr.add(sid, toks, lora_name=lora)
                live[sid] = True
            elif op == "append" and sid in live:
                mgr.append(sid, rng.integers(0, 1 + vocab, n % 4 + 1).tolist())
            elif op == "compute" and sid in live:
                compute(mgr, sid)
            elif op == "free" and sid in live:
                mgr.free(sid)
                del live[sid]
            elif op == "reset":
                mgr.pool.reset_prefix_cache()
            elif op == "drain":
                drain()
        except KVBlocksError:
            pass
    drain()
    pool = mgr.pool
    assert held == {pool.block_hash(b) for b in range(1, pool.num_blocks) if pool.is_cached(b)}
    mgr.check()


def test_events_recorded_while_draining_wait_for_the_next_drain(monkeypatch):
    """take_events builds Python objects, and Python code (another thread, a GC callback)
    may record on the same pool meanwhile and grow the log's arrays: the drain reads a log
    it moved out first, and what was recorded meanwhile comes with the next drain."""
    import kvblocks._core as core
    from kvblocks import BlockPool, hash_blocks

    pool = BlockPool(4096, block_size=2, hash_key=KEY, enable_kv_events=True)
    toks = list(range(8))
    ids = pool.allocate(4)
    pool.cache(ids, hash_blocks(toks, 2, key=KEY), token_ids=toks)
    real = core.BlockStored
    more = [list(range(100, 4000))]  # 1,950 blocks: the log's arrays grow

    def reentering(*args, **kw):
        if more:
            t = more.pop()
            got = pool.allocate(len(t) // 2)
            pool.cache(got, hash_blocks(t, 2, key=KEY), token_ids=t)
        return real(*args, **kw)

    monkeypatch.setattr(core, "BlockStored", reentering)
    first = pool.take_events()
    monkeypatch.setattr(core, "BlockStored", real)
    assert [e.token_ids for e in first] == [toks]
    later = pool.take_events()
    assert [len(e.block_hashes) for e in later] == [1950]
    assert later[0].token_ids == list(range(100, 4000))
    assert pool.take_events() == []
    pool.check()
