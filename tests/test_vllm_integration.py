"""kvblocks' KV cache manager beside vLLM's own (kvblocks.integrations.vllm); skipped unless
vllm (0.34) is importable. The full proof is vLLM's own tests/v1/core under .ci/vllm."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core import kv_cache_manager as vkm  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

import kvblocks.integrations.vllm as kvb_vllm  # noqa: E402
from kvblocks.integrations.vllm.manager import KVCacheManager, VLLMKVCacheManager  # noqa: E402

BS = 4


def config(num_blocks: int, spec=None) -> KVCacheConfig:
    spec = spec or FullAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def request(rid: str, tokens: list) -> Request:
    sp = SamplingParams(max_tokens=8)
    sp.update_from_generation_config({}, eos_token_id=0)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def managers(num_blocks: int, **kw):
    init_none_hash(sha256)
    args = dict(
        max_model_len=256, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True, **kw
    )
    return VLLMKVCacheManager(config(num_blocks), **args), KVCacheManager(
        config(num_blocks), **args
    )


def test_enable_disable_swaps_the_class():
    import vllm.v1.core.sched.scheduler as sched

    assert vkm.KVCacheManager is VLLMKVCacheManager
    with kvb_vllm.enable():
        assert kvb_vllm.is_enabled()
        assert vkm.KVCacheManager is KVCacheManager
        assert sched.KVCacheManager is KVCacheManager
    assert vkm.KVCacheManager is VLLMKVCacheManager
    assert sched.KVCacheManager is VLLMKVCacheManager
    assert not kvb_vllm.is_enabled()


def test_plugin_registers_only_when_asked(monkeypatch):
    from kvblocks.integrations.vllm import plugin

    monkeypatch.delenv("KVBLOCKS_VLLM", raising=False)
    plugin.register()
    assert not kvb_vllm.is_enabled()
    monkeypatch.setenv("KVBLOCKS_VLLM", "1")
    try:
        plugin.register()
        assert vkm.KVCacheManager is KVCacheManager
    finally:
        kvb_vllm.disable()


def test_sliding_window_alone_is_native():
    """One sliding-window group (vLLM's unitary coordinator) runs on the native group
    manager (kvblocks.integrations.vllm.hybrid; differential tests in test_vllm_hybrid.py)."""
    from kvblocks.integrations.vllm.hybrid import HybridKVCacheManager

    spec = SlidingWindowSpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=8
    )
    init_none_hash(sha256)
    m = KVCacheManager(
        config(16, spec),
        max_model_len=64,
        scheduler_block_size=BS,
        hash_block_size=BS,
        enable_caching=True,
    )
    assert m.native and type(m) is HybridKVCacheManager


def _admit(m, r, chunk, la):
    """get_computed_blocks + allocate_slots of one chunk; the outcome as comparable data."""
    blocks, hit, _ = m.get_computed_blocks(r)
    n = min(r.num_tokens - hit, chunk)
    new = m.allocate_slots(r, n, hit, blocks, num_lookahead_tokens=la)
    if new is not None:
        r.num_computed_tokens = hit + n
        r.status = RequestStatus.RUNNING
    return hit, blocks.get_block_ids(), None if new is None else new.get_block_ids()


def _step(m, r, chunk, la):
    """The next prefill chunk, or one decode token (appended before the call)."""
    n = min(r.num_tokens - r.num_computed_tokens, chunk)
    new = m.allocate_slots(r, n, num_lookahead_tokens=la)
    if new is not None:
        r.num_computed_tokens += n
    return None if new is None else new.get_block_ids()


@pytest.mark.parametrize("seed", range(8))
def test_same_blocks_hits_free_counts_and_events_as_vllm(seed):
    """A random stream: admission with shared prefixes and salts-free full-prompt hits (which
    recompute a duplicate block), chunked prefill, decode, speculative lookahead slots,
    preemption and resume, free, reset, eviction pressure, and a KV connector's calls
    (``evict_blocks`` of free, held or uncached blocks; a pin and a release with
    ``evict_first``). Both managers give the same block ids, hits, free counts and events at
    every step, and the same free list at the end."""
    rng = random.Random(seed)
    num_blocks = rng.choice([12, 24, 40])
    ref, kvb = managers(num_blocks, enable_kv_cache_events=True)
    assert kvb.native
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 11]))] for _ in range(3)]
    live: dict[str, tuple] = {}
    waiting: list[tuple] = []
    for step in range(200):
        chunk, la = rng.choice([3, 8, 64]), rng.choice([0, 0, 1, 3])
        act = rng.random()
        if live and (len(live) > 4 or act < 0.15):  # finish one
            for m, r in zip((ref, kvb), live.pop(rng.choice(sorted(live)))):
                m.free(r)
        elif live and act < 0.25:  # preempt one; it waits to resume
            pair = live.pop(rng.choice(sorted(live)))
            for m, r in zip((ref, kvb), pair):
                m.free(r)
                r.num_computed_tokens = 0
                r.status = RequestStatus.PREEMPTED
            waiting.append(pair)
        elif act < 0.55 or not live:  # admit a new or a preempted request
            if waiting and rng.random() < 0.5:
                pair = waiting.pop(0)
            else:
                toks = rng.choice(prefixes) + [
                    rng.randrange(1, 50) for _ in range(rng.randrange(9))
                ]
                pair = (request(f"q{step}", toks), request(f"q{step}", toks))
            got = [_admit(m, r, chunk, la) for m, r in zip((ref, kvb), pair)]
            assert got[0] == got[1]
            if got[0][2] is None:
                for m, r in zip((ref, kvb), pair):
                    m.free(r)
                    r.num_computed_tokens = 0
            else:
                live[pair[0].request_id] = pair
        else:  # one step of a running request
            rid = rng.choice(sorted(live))
            if live[rid][0].num_computed_tokens == live[rid][0].num_tokens:
                tok = rng.randrange(1, 50)
                for r in live[rid]:
                    r.append_output_token_ids(tok)
            out = [_step(m, r, chunk, la) for m, r in zip((ref, kvb), live[rid])]
            assert out[0] == out[1]
            if out[0] is None:
                for m, r in zip((ref, kvb), live.pop(rid)):
                    m.free(r)
        if rng.random() < 0.05:
            some = set(rng.sample(range(1, num_blocks), rng.randrange(1, 3)))
            evict = rng.random() < 0.6
            for m in (ref, kvb):
                if evict:
                    m.evict_blocks(some)
                else:
                    blocks = [m.block_pool.blocks[b] for b in sorted(some)]
                    m.block_pool.touch(blocks)
                    m.block_pool.free_blocks(blocks, evict_first=True)
        for rid in live:
            assert ref.get_block_ids(rid) == kvb.get_block_ids(rid)
        assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()
        assert ref.usage == kvb.usage
        assert ref.take_events() == kvb.take_events()
        if not live and rng.random() < 0.3:
            assert ref.reset_prefix_cache() == kvb.reset_prefix_cache()
    for pair in live.values():
        ref.free(pair[0])
        kvb.free(pair[1])
    assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()
    free = [
        [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
        for m in (ref, kvb)
    ]
    assert free[0] == free[1]
    assert ref.reset_prefix_cache() and kvb.reset_prefix_cache()
    assert ref.take_events() == kvb.take_events()


def test_views_read_the_native_pool():
    ref, kvb = managers(16)
    rs = [request(f"v{i}", list(range(1, 10))) for i in range(2)]
    for r in rs:
        blocks, hit, _ = kvb.get_computed_blocks(r)
        kvb.allocate_slots(r, r.num_tokens - hit, hit, blocks)
    b = kvb.get_blocks("v1").blocks[0]
    assert [x.ref_cnt for x in b] == [2, 2, 1]
    assert b[0].block_hash is not None and b[2].block_hash is None
    assert kvb.block_pool.blocks[b[0].block_id] is b[0]
    assert kvb.block_pool.get_cached_block(rs[0].block_hashes[0], [0]) == [b[0]]
    kvb.free(rs[0])
    kvb.free(rs[1])
    assert kvb.block_pool.get_num_free_blocks() == 15
    assert (
        kvb.block_pool.free_block_queue.fake_free_list_head.next_free_block.block_id
        == kvb.block_pool.native.free_list()[0]
    )


def test_event_shapes_match_vllm():
    ref, kvb = managers(16, enable_kv_cache_events=True)
    for m in (ref, kvb):
        r = request("e", list(range(1, 10)))
        m.allocate_slots(r, r.num_tokens)
        m.free(r)
        m.evict_blocks({1, 2})
    ev_ref, ev_kvb = ref.take_events(), kvb.take_events()
    assert ev_ref == ev_kvb
    assert [type(e) for e in ev_kvb] == [BlockStored, BlockRemoved, BlockRemoved]


def test_a_new_request_under_a_used_id_is_looked_up_by_its_own_hashes():
    """Regression (vLLM's test_scheduler_publishes_lookahead_blocks_at_allocation): probing
    two different prompts under one request id without freeing in between must not reuse the
    first prompt's keys."""
    ref, kvb = managers(16)
    for m in (ref, kvb):
        r = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
        m.allocate_slots(r, r.num_tokens)
    for toks in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9]):
        got = [m.get_computed_blocks(request("probe", toks))[1] for m in (ref, kvb)]
        assert got[0] == got[1]


def test_evicted_blocks_miss_and_lose_their_hash_as_in_vllm():
    """evict_blocks of a cached block in use: its hash (views, cache map) is gone, lookups stop
    before it, and its reuse later records no second BlockRemoved; as vLLM's pool (but for
    the free-list place of the evicted block, a named difference)."""
    ref, kvb = managers(16, enable_kv_cache_events=True)
    toks = list(range(1, 14))  # 3 full blocks of 4
    for m in (ref, kvb):
        r = request("x", toks)
        m.allocate_slots(r, r.num_tokens)
    ids = kvb.get_block_ids("x")[0]
    assert ids == ref.get_block_ids("x")[0]
    for m in (ref, kvb):
        m.evict_blocks({ids[1]})
    for b in ids:
        assert ref.block_pool.blocks[b].block_hash == kvb.block_pool.blocks[b].block_hash
    assert kvb.block_pool.blocks[ids[1]].block_hash is None
    assert len(ref.block_pool.cached_block_hash_to_block._cache) == len(
        kvb.block_pool.cached_block_hash_to_block._cache
    )
    got = [m.get_computed_blocks(request("y", toks))[1] for m in (ref, kvb)]
    assert got[0] == got[1] == 4
    for m in (ref, kvb):
        m.free(request("x", toks))
        big = request("z", list(range(100, 100 + 4 * 15)))
        assert m.allocate_slots(big, big.num_tokens) is not None  # reuses every block
    # the freed evicted block goes to the free list's tail natively (vLLM: its head), a
    # difference docs/vllm.md names: the same blocks, popped in another order
    assert sorted(ref.get_block_ids("z")[0]) == sorted(kvb.get_block_ids("z")[0])

    def removed(m):
        return sorted(
            h for e in m.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes
        )

    assert removed(ref) == removed(kvb)


def test_touch_of_a_free_uncached_block_as_in_vllm():
    """vLLM's BlockPool.touch takes a free block off the free queue whether it is cached or
    not; block_pool.touch and free_blocks give the same free lists as vLLM's pool."""
    ref, kvb = managers(16)
    for m in (ref, kvb):
        r = request("t", list(range(1, 7)))  # one full (cached) block and a partial one
        m.allocate_slots(r, r.num_tokens)
        m.free(r)

    def free_ids(m):
        return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]

    assert free_ids(ref) == free_ids(kvb)
    for b in (2, 1, 7):  # uncached, cached, never used
        for m in (ref, kvb):
            m.block_pool.touch([m.block_pool.blocks[b]])
        assert free_ids(ref) == free_ids(kvb)
        assert ref.block_pool.blocks[b].ref_cnt == kvb.block_pool.blocks[b].ref_cnt == 1
    for m in (ref, kvb):
        m.block_pool.free_blocks([m.block_pool.blocks[b] for b in (7, 1, 2)])
    assert free_ids(ref) == free_ids(kvb)
    assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()


def test_kvblocks_bench_vllm_runs_with_tiny_sizes(capsys, tmp_path):
    """``kvblocks bench vllm`` with vLLM importable: both cases' tables, the JSON written."""
    import json

    from kvblocks.__main__ import main

    out = tmp_path / "vllm.json"
    argv = ["bench", "vllm", "--reps", "1", "--requests", "4", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "skipped" not in text and f"wrote {out}" in text
    for needle in ("full (full attention): 4 requests", "hybrid (full + sliding window 128)"):
        assert needle in text
    doc = json.loads(out.read_text())
    assert doc["requests"] == 4 and doc["reps"] == 1
    assert doc["command"] == "kvblocks bench vllm --case all --reps 1 --requests 4"
    for case in ("full", "hybrid"):
        assert set(doc[case]) == {"admission", "decode", "free"}
        assert all(r["vllm_ms"] > 0 and r["kvblocks_ms"] > 0 for r in doc[case].values())
