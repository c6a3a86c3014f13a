"""kvblocks' native hybrid KV cache manager (full attention, sliding window, chunked local
attention and Mamba state groups) beside vLLM's own HybridKVCacheCoordinator; skipped unless vllm (0.34) is
importable."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")
torch = pytest.importorskip("torch")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvblocks.integrations.vllm.hybrid import HybridKVCacheManager  # noqa: E402
from kvblocks.integrations.vllm.manager import (  # noqa: E402
    NATIVE_BUILDS,
    KVCacheManager,
    VLLMKVCacheManager,
)

BS = 4
HASH_FN = sha256  # the requests' hash function (a test may take a shorter one)


def sha256_16(obj) -> bytes:
    """A 16-byte hash (the width of vLLM's xxhash options): the adapter's numpy key path."""
    return sha256(obj)[:16]


def full_spec(bs: int = BS):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)


def sw_spec(window: int, bs: int = BS):
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window
    )


def chunk_spec(chunk: int):
    return ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, attention_chunk_size=chunk
    )


def mamba_spec(mode: str = "align", spec_blocks: int = 0, checkpoints: int = 0, bs: int = 0):
    return MambaSpec(
        block_size=bs or BS,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        num_speculative_blocks=spec_blocks,
        num_prefill_checkpoint_blocks=checkpoints,
        prefill_checkpoint_alignment=BS if checkpoints else None,
    )


def config(num_blocks: int, specs) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )


def request(rid: str, tokens: list) -> Request:
    sp = SamplingParams(max_tokens=8)
    sp.update_from_generation_config({}, eos_token_id=0)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BS, HASH_FN),
    )


def managers(num_blocks: int, specs, **kw):
    init_none_hash(sha256)
    args = dict(max_model_len=256, scheduler_block_size=BS, hash_block_size=BS, **kw)
    args.setdefault("enable_caching", True)
    return (
        VLLMKVCacheManager(config(num_blocks, specs), **args),
        KVCacheManager(config(num_blocks, specs), **args),
    )


def test_full_plus_sliding_window_is_native():
    before = NATIVE_BUILDS["hybrid"]
    _, kvb = managers(32, [full_spec(), sw_spec(8)])
    assert kvb.native and type(kvb) is HybridKVCacheManager
    assert NATIVE_BUILDS["hybrid"] == before + 1


@pytest.mark.parametrize("specs", [[full_spec(), chunk_spec(8)], [chunk_spec(8)]])
def test_chunked_local_is_native(specs):
    before = NATIVE_BUILDS["hybrid"]
    _, kvb = managers(32, specs)
    assert kvb.native and type(kvb) is HybridKVCacheManager
    assert NATIVE_BUILDS["hybrid"] == before + 1


ONE_BLOCK_SHAPES = [
    [full_spec(), sw_spec(8)],
    [full_spec(), chunk_spec(8)],
    [full_spec(), mamba_spec()],
    [mamba_spec(checkpoints=1)],
    [sw_spec(8)],
]


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("specs", ONE_BLOCK_SHAPES)
def test_a_pool_of_the_null_block_alone_is_native(specs, caching):
    """vLLM's num_gpu_blocks == 1 (the null block alone) on BlockPool(1): nothing to
    allocate; every answer as vLLM's (refusals, free counts, usage, stats, events, the
    free list, reset)."""
    ref, kvb = managers(1, specs, enable_caching=caching, enable_kv_cache_events=True)
    assert kvb.native and type(kvb) is HybridKVCacheManager
    out = []
    for m in (ref, kvb):
        r = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
        blocks, hit, _ = m.get_computed_blocks(r)
        got = [hit, blocks.get_block_ids()]
        got.append(_ids(m.allocate_slots(r, 9, hit, blocks, full_sequence_must_fit=True)))
        got.append(_ids(m.allocate_slots(r, 4, hit, blocks)))
        m.free(r)
        m.new_step_starts()
        free = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
        got += [m.block_pool.get_num_free_blocks(), m.usage, free, m.reset_prefix_cache()]
        got += [m.take_events(), m.take_new_block_ids(), m.take_boundary_state_offloads()]
        out.append(got)
    assert out[0] == out[1]
    assert out[0][2] is None and out[0][3] is None


@pytest.mark.parametrize("specs", [[full_spec(), mamba_spec()], [mamba_spec()]])
def test_mamba_align_is_native(specs):
    before = NATIVE_BUILDS["hybrid"]
    _, kvb = managers(32, specs)
    assert kvb.native and type(kvb) is HybridKVCacheManager
    assert NATIVE_BUILDS["hybrid"] == before + 1


@pytest.mark.parametrize("at_build", [False, True])
@pytest.mark.parametrize("retention", [None, 0, 8])
@pytest.mark.parametrize("alignment", [2, BS])
def test_mamba_prefill_checkpoints_as_vllm(retention, alignment, at_build):
    """vLLM's prefill checkpoint blocks: a chunk that can export a state inside itself
    reserves one block more at index cdiv(end, bs) - 2 (not padded with a null), keyed at
    its position when that state is the prompt's, a retained boundary or the shared-prefix
    boundary, and evicted (a transient state) otherwise; a later request hits it."""
    specs = [full_spec(), mamba_spec(checkpoints=1)]
    specs[1] = MambaSpec(**{**specs[1].__dict__, "prefill_checkpoint_alignment": alignment})
    init_none_hash(sha256)
    args = dict(max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
    args.update(enable_caching=True, enable_kv_cache_events=True)
    cfgs = [config(64, specs) for _ in range(2)]
    if at_build:  # vLLM's prefix_cache_retention_interval, or set afterwards as its tests do
        for c in cfgs:
            c.prefix_cache_retention_interval = retention
    ref, kvb = VLLMKVCacheManager(cfgs[0], **args), KVCacheManager(cfgs[1], **args)
    assert kvb.native and type(kvb) is HybridKVCacheManager
    toks = list(range(1, 42))  # 41 tokens: chunks of 16, 16 and 9
    out = []
    for m in (ref, kvb):
        if not at_build:
            m.coordinator.retention_interval = retention
        assert m.coordinator.retention_interval == retention
        mm = m.coordinator.single_type_managers[1]
        got = []
        a = request("a", toks)
        got.append(_admit(m, a, 16, 0))
        got.append((dict(mm._checkpoints), m.take_events(), m.take_boundary_state_offloads()))
        for _ in range(2):
            m.new_step_starts()
            got.append(_step(m, a, 16, 0))
            got.append((dict(mm._checkpoints), m.take_events(), m.get_block_ids("a")))
            got.append(m.take_boundary_state_offloads())
        m.new_step_starts()
        b = request("b", toks + [7, 7, 7, 7, 7])
        got.append(_admit(m, b, 64, 0))
        m.free(a)
        m.free(b)
        free = [x.block_id for x in m.block_pool.free_block_queue.get_all_free_blocks()]
        got += [free, m.take_events()]
        out.append(got)
    assert out[0] == out[1]
    assert any(out[0][i][0] for i in (1, 3, 6))  # a checkpoint was reserved
    assert out[0][8][0] > 0  # the follower hits a Mamba state


def test_mamba_hit_cached_in_the_same_step_waits_for_the_next():
    """vLLM defers a hit whose Mamba state block was cached in the current step (its state
    is written by this step's forward): the allocation is refused until new_step_starts."""
    ref, kvb = managers(40, [full_spec(), mamba_spec()])
    toks = list(range(1, 18))
    out = []
    for m in (ref, kvb):
        a = request("a", toks)
        _admit(m, a, 16, 0)  # 16 tokens: the state block at index 3 is cached
        b = request("b", toks)
        blocks, hit, _ = m.get_computed_blocks(b)
        refused = m.allocate_slots(b, b.num_tokens - hit, hit, blocks)
        m.new_step_starts()
        blocks, hit2, _ = m.get_computed_blocks(b)
        admitted = m.allocate_slots(b, b.num_tokens - hit2, hit2, blocks)
        out.append((hit, refused, hit2, _ids(admitted), m.get_block_ids("a")))
    assert out[0] == out[1]
    assert out[0][0] == 16 and out[0][1] is None and out[0][3] is not None


def _ids(blocks):
    return None if blocks is None else blocks.get_block_ids()


def _admit(m, r, chunk, la):
    blocks, hit, spb = m.get_computed_blocks(r)
    n = min(r.num_tokens - hit, chunk)
    new = m.allocate_slots(r, n, hit, blocks, num_lookahead_tokens=la, full_sequence_must_fit=True)
    if new is not None:
        r.num_computed_tokens = hit + n
        r.status = RequestStatus.RUNNING
    return hit, spb, blocks.get_block_ids(), _ids(new)


def _step(m, r, chunk, la):
    n = min(r.num_tokens - r.num_computed_tokens, chunk)
    new = m.allocate_slots(r, n, num_lookahead_tokens=la)
    if new is not None:
        r.num_computed_tokens += n
    return _ids(new)


SPECS = {
    "full+sw8": lambda: [full_spec(), sw_spec(8)],
    "full+sw5": lambda: [full_spec(), sw_spec(5)],
    "sw8+full+sw8": lambda: [sw_spec(8), full_spec(), sw_spec(8)],
    "full+sw6+sw12": lambda: [full_spec(), sw_spec(6), sw_spec(12)],
    "sw8": lambda: [sw_spec(8)],
    # chunked local attention (Llama 4): chunks of 2 blocks, 4 blocks, 1.5 blocks (vLLM
    # rounds the chunk start down to a block), two chunk groups looked up jointly, a chunk
    # group beside a window group, a chunk group alone
    "full+chunk8": lambda: [full_spec(), chunk_spec(8)],
    "chunk16+full": lambda: [chunk_spec(16), full_spec()],
    "full+chunk6": lambda: [full_spec(), chunk_spec(6)],
    "chunk8+full+chunk8": lambda: [chunk_spec(8), full_spec(), chunk_spec(8)],
    "full+sw8+chunk8": lambda: [full_spec(), sw_spec(8), chunk_spec(8)],
    "chunk8": lambda: [chunk_spec(8)],
    # Mamba in align mode (vLLM's mode with prefix caching): beside full attention, alone,
    # beside full attention and a window, with two speculative blocks; "none" mode (no
    # caching) with one speculative block
    "full+mamba": lambda: [full_spec(), mamba_spec()],
    "mamba": lambda: [mamba_spec()],
    "full+sw8+mamba": lambda: [full_spec(), sw_spec(8), mamba_spec()],
    "full+mamba-spec2": lambda: [full_spec(), mamba_spec(spec_blocks=2)],
    "full+mamba-none": lambda: [full_spec(), mamba_spec("none", 1)],
}
NO_CACHING = {"full+mamba-none"}  # Mamba's "none" mode is its mode without prefix caching


# a chunk group alone holds at most a chunk of blocks per request: smaller pools evict
POOLS = {"chunk8": [10, 12, 16]}


@pytest.mark.parametrize("shape", sorted(SPECS))
@pytest.mark.parametrize("seed", range(6))
def test_same_blocks_hits_free_counts_and_events_as_vllm(shape, seed):
    """One seeded random stream into vLLM's KVCacheManager (its HybridKVCacheCoordinator)
    and kvblocks' native hybrid manager: admission with shared prefixes (prefix hits, full
    prompt hits), chunked prefill, decode past the window (skipped blocks become null and
    are freed), lookahead slots, preemption and resume, free, reset, eviction pressure. At
    every step: the same hits, shared-prefix boundary, block ids per group (nulls included),
    free counts, usage, events and cached-token probes. Now and then a KV connector's calls:
    ``evict_blocks`` of a few blocks (free, held or without an entry), or a pin of a few
    blocks and their release with ``evict_first``."""
    rng = random.Random(seed)
    caching = seed != 5 and shape not in NO_CACHING  # one seed per shape without caching
    num_blocks = rng.choice(POOLS.get(shape, [24, 40, 64]))
    ref, kvb = managers(
        num_blocks,
        SPECS[shape](),
        enable_kv_cache_events=True,
        enable_caching=caching,
    )
    assert kvb.native and type(kvb) is HybridKVCacheManager
    _stream(ref, kvb, rng, num_blocks, caching)


def _stream(ref, kvb, rng, num_blocks, caching, windows=True):
    """The random stream of test_same_blocks_hits_free_counts_and_events_as_vllm (windows:
    whether it must reach window hits and null table entries)."""
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 13, 21]))] for _ in range(3)]
    live: dict[str, tuple] = {}
    waiting: list[tuple] = []
    seen = {"hit": 0, "window hit": 0, "null": 0, "evicted": 0}
    for step in range(250):
        chunk, la = rng.choice([3, 8, 64]), rng.choice([0, 0, 1, 3])
        act = rng.random()
        if live and (len(live) > 4 or act < 0.12):  # finish one
            for m, r in zip((ref, kvb), live.pop(rng.choice(sorted(live)))):
                m.free(r)
        elif live and act < 0.2:  # preempt one; it waits to resume
            pair = live.pop(rng.choice(sorted(live)))
            for m, r in zip((ref, kvb), pair):
                m.free(r)
                r.num_computed_tokens = 0
                r.status = RequestStatus.PREEMPTED
            waiting.append(pair)
        elif act < 0.5 or not live:  # admit a new or a preempted request
            if waiting and rng.random() < 0.5:
                pair = waiting.pop(0)
            else:
                toks = rng.choice(prefixes) + [
                    rng.randrange(1, 50) for _ in range(rng.randrange(14))
                ]
                pair = (request(f"q{step}", toks), request(f"q{step}", toks))
            assert ref.get_num_cached_tokens(pair[0]) == kvb.get_num_cached_tokens(pair[1])
            got = [_admit(m, r, chunk, la) for m, r in zip((ref, kvb), pair)]
            assert got[0] == got[1], step
            seen["hit"] += got[0][0] > 0
            seen["window hit"] += any(0 in g for g in got[0][2])
            if got[0][3] is None:
                for m, r in zip((ref, kvb), pair):
                    m.free(r)
                    r.num_computed_tokens = 0
            else:
                live[pair[0].request_id] = pair
        else:  # one step of a running request (a decode token once its prompt is done)
            rid = rng.choice(sorted(live))
            if live[rid][0].num_computed_tokens == live[rid][0].num_tokens:
                tok = rng.randrange(1, 50)
                for r in live[rid]:
                    r.append_output_token_ids(tok)
            out = [_step(m, r, chunk, la) for m, r in zip((ref, kvb), live[rid])]
            assert out[0] == out[1], step
            if out[0] is None:
                for m, r in zip((ref, kvb), live.pop(rid)):
                    m.free(r)
        if rng.random() < 0.04:  # a KV connector's calls: evict_blocks, or pin + evict first
            some = set(rng.sample(range(1, num_blocks), rng.randrange(1, 3)))
            if rng.random() < 0.6:
                for m in (ref, kvb):
                    m.evict_blocks(some)
            else:
                for m in (ref, kvb):
                    blocks = [m.block_pool.blocks[b] for b in sorted(some)]
                    m.block_pool.touch(blocks)
                    m.block_pool.free_blocks(blocks, evict_first=True)
        for rid in live:
            ids = kvb.get_block_ids(rid)
            assert ref.get_block_ids(rid) == ids, step
            seen["null"] += any(0 in g for g in ids)
        assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()
        assert ref.usage == kvb.usage
        ev = kvb.take_events()
        assert ref.take_events() == ev, step
        seen["evicted"] += sum(isinstance(e, BlockRemoved) for e in ev)
        if not live and rng.random() < 0.3:
            assert ref.reset_prefix_cache() == kvb.reset_prefix_cache()
        if rng.random() < 0.5:  # the scheduler's next step (Mamba: deferred hits may go)
            for m in (ref, kvb):
                m.new_step_starts()
        assert ref.take_boundary_state_offloads() == kvb.take_boundary_state_offloads()
        assert ref.take_new_block_ids() == kvb.take_new_block_ids()
        copies = [m.take_kv_cache_block_copies() for m in (ref, kvb)]  # partial hits'
        assert copies[0][0] == copies[1][0], step  # copy-on-write: the scheduler frees
        assert [b.block_id for b in copies[0][1]] == [b.block_id for b in copies[1][1]]
        for m, (_, kept) in zip((ref, kvb), copies):  # both ends once the copy has run
            m.block_pool.free_blocks(kept)
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
    if not windows:
        del seen["window hit"], seen["null"]
    assert all(seen.values()) or not caching, seen  # hits, window hits, null blocks, evictions


# groups of different block sizes (vLLM: hashes at their gcd, hits and caching aligned to
# their lcm; a window group caches only the tail a hit at an aligned boundary reads; a
# full-attention group of blocks larger than the hash keys the prompt's last hash boundary
# inside a block as an extra key of that block)
MIXED = {
    "full4+sw8/8": lambda: [full_spec(4), sw_spec(8, 8)],
    "full4+sw5/8": lambda: [full_spec(4), sw_spec(5, 8)],
    "full8+sw8/4": lambda: [full_spec(8), sw_spec(8, 4)],
    "full8+sw13/4": lambda: [full_spec(8), sw_spec(13, 4)],
    "sw6/4+full12+sw12/8": lambda: [sw_spec(6, 4), full_spec(12), sw_spec(12, 8)],
    "full4+full8": lambda: [full_spec(4), full_spec(8)],
    # no full-attention group: a hit's candidate length is not aligned to start with
    "sw8/4+sw12/8": lambda: [sw_spec(8, 4), sw_spec(12, 8)],
    # an align-mode Mamba group of blocks longer than the hash: vLLM's partial hash hits
    # (hits on hash boundaries inside blocks, copied on write; caching only)
    "full4+mamba8": lambda: [full_spec(4), mamba_spec(bs=8)],
    "full4+full8+mamba8": lambda: [full_spec(4), full_spec(8), mamba_spec(bs=8)],
}


def _is_window(spec) -> bool:
    return isinstance(spec, SlidingWindowSpec)


@pytest.mark.parametrize("shape", sorted(MIXED))
@pytest.mark.parametrize("seed", range(4))
def test_groups_of_different_block_sizes_as_vllm(shape, seed):
    """The stream of test_same_blocks_hits_free_counts_and_events_as_vllm over groups of
    different block sizes, served natively (seed 3: without prefix caching)."""
    import math

    specs = MIXED[shape]()
    sizes = [sp.block_size for sp in specs]
    rng = random.Random(seed)
    caching = seed != 3
    if not caching and "mamba" in shape:
        pytest.skip("Mamba among block sizes without caching: vLLM's managers")
    num_blocks = rng.choice([24, 40, 64])
    hbs = math.gcd(*sizes) if caching else math.lcm(*sizes)
    init_none_hash(sha256)
    args = dict(
        max_model_len=256,
        scheduler_block_size=math.lcm(*sizes),
        hash_block_size=hbs,
        enable_kv_cache_events=True,
        enable_caching=caching,
    )
    ref = VLLMKVCacheManager(config(num_blocks, specs), **args)
    kvb = KVCacheManager(config(num_blocks, MIXED[shape]()), **args)
    assert kvb.native and type(kvb) is HybridKVCacheManager
    global BS, HASH_FN
    old = BS, HASH_FN
    BS = hbs  # (the requests' hashes: at the hash block size; seed 2: 16 bytes wide)
    HASH_FN = sha256_16 if seed == 2 else sha256
    try:
        _stream(ref, kvb, rng, num_blocks, caching, any(map(_is_window, specs)))
    finally:
        BS, HASH_FN = old


def _decode(m, rid, prompt, steps):
    """Admit prompt as request rid, compute it, then decode `steps` tokens one step each."""
    r = request(rid, prompt)
    m.allocate_slots(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    r.status = RequestStatus.RUNNING
    for t in range(steps):
        r.append_output_token_ids(t + 1)
        m.allocate_slots(r, 1)
        r.num_computed_tokens += 1


def test_sliding_window_hit_has_null_blocks_and_decode_frees_them():
    ref, kvb = managers(40, [full_spec(), sw_spec(8)], enable_kv_cache_events=True)
    toks = list(range(1, 26))  # 6 full blocks of 4 and one token
    for m in (ref, kvb):
        r = request("a", toks)
        m.allocate_slots(r, r.num_tokens)
        m.free(r)
    got = []
    for m in (ref, kvb):
        r = request("b", toks + [7, 7, 7])
        blocks, hit, _ = m.get_computed_blocks(r)
        got.append((hit, blocks.get_block_ids()))
        m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        got.append(m.get_block_ids("b"))
    assert got[0] == got[2] and got[1] == got[3]
    hit, (full_ids, sw_ids) = got[0]
    # window 8, blocks of 4: a hit needs cdiv(7, 4) = 2 cached blocks, the 4 before are null
    assert hit == 24 and len(full_ids) == 6 and sw_ids[:4] == [0] * 4 and all(sw_ids[4:])
    assert got[1][1][:4] == [0] * 4  # and stay null in the request's table
    ev = kvb.take_events()
    assert ev == ref.take_events()
    assert [type(e) for e in ev] == [BlockStored, BlockStored, BlockStored, BlockStored]
    assert [e.group_idx for e in ev] == [0, 1, 0, 1]
    for m in (ref, kvb):  # decode past the window: the blocks before it are freed, null
        _decode(m, "c", list(range(100, 117)), 12)
    assert ref.get_block_ids("c") == kvb.get_block_ids("c")
    assert kvb.get_block_ids("c")[1][:5] == [0] * 5
    assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()


def test_chunked_local_hits_are_null_before_the_chunk_and_decode_frees_them():
    """vLLM's rules for a chunk of 8 tokens, blocks of 4: a hit of at most L tokens is null
    up to the chunk holding token L, then the blocks cached from that chunk's start; at a
    chunk boundary that is a hit without any cached block. Decode frees every block before
    the chunk of the next token."""
    toks = list(range(1, 26))  # 6 full blocks of 4 and one token
    ref, kvb = managers(40, [full_spec(), chunk_spec(8)], enable_kv_cache_events=True)
    got = []
    for m in (ref, kvb):
        r = request("a", toks)
        m.allocate_slots(r, r.num_tokens)
        m.free(r)
        for rid, prompt in (("b", toks + [7, 7, 7]), ("c", toks[:21])):
            blocks, hit, _ = m.get_computed_blocks(request(rid, prompt))
            got.append((hit, blocks.get_block_ids()))
    assert got[:2] == got[2:]
    (hit_b, (full_b, chunk_b)), (hit_c, (full_c, chunk_c)) = got[:2]
    # b: at most 27 tokens; full attention hits 24, a chunk boundary: 6 nulls, no lookup
    assert hit_b == 24 and len(full_b) == 6 and chunk_b == [0] * 6
    # c: at most 20 tokens; the chunk holding token 20 starts at 16: block 4 is looked up
    assert hit_c == 20 and len(full_c) == 5 and chunk_c[:4] == [0] * 4 and chunk_c[4] != 0
    ref1, kvb1 = managers(16, [chunk_spec(8)])
    for m in (ref1, kvb1):  # a chunk group alone, nothing cached: a hit of nulls only
        blocks, hit, _ = m.get_computed_blocks(request("d", list(range(1, 18))))
        assert hit == 16 and blocks.get_block_ids() == ([0] * 4,)
    for m in (ref, kvb):  # decode: the blocks before the next token's chunk become null
        _decode(m, "e", list(range(100, 117)), 12)
    assert ref.get_block_ids("e") == kvb.get_block_ids("e")
    assert kvb.get_block_ids("e")[1][:6] == [0] * 6 and all(kvb.get_block_ids("e")[1][6:])
    assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()
    assert ref.take_events() == kvb.take_events()


def test_a_window_groups_sparse_retention_falls_back():
    """vLLM's sliding-window retention masks are not served: built with one, the model runs
    on vLLM's managers; set afterwards on a native manager that served nothing yet, the
    manager goes to vLLM's own managers (which take the setting) and behaves as vLLM's; set
    after it served requests, it is refused (NotImplementedError), nothing changed."""
    specs = [full_spec(), sw_spec(8)]
    c = config(32, specs)
    c.prefix_cache_retention_interval = 0
    kvb = KVCacheManager(c, max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
    assert not kvb.native
    ref, kvb = managers(32, specs, enable_kv_cache_events=True)
    assert kvb.native
    held = kvb.coordinator  # (a reference taken before: it follows the manager)
    before = NATIVE_BUILDS["fallback"]
    for c in (ref.coordinator, held):
        c.retention_interval = 0
    assert not kvb.native and NATIVE_BUILDS["fallback"] == before + 1
    assert kvb.coordinator.retention_interval == 0 == held.retention_interval
    for i in range(3):  # the same answers as vLLM's from here on
        got = []
        for m in (ref, kvb):
            r = request(f"r{i}", list(range(1, 30)))
            blocks, hit, _ = m.get_computed_blocks(r)
            got.append((hit, m.allocate_slots(r, 29 - hit, hit, blocks).get_block_ids()))
            m.free(r)
        assert got[0] == got[1]
        assert ref.take_events() == kvb.take_events()
    _, kvb = managers(32, specs)
    assert kvb.allocate_slots(request("a", list(range(1, 10))), 9) is not None
    with pytest.raises(NotImplementedError):
        kvb.coordinator.retention_interval = 0
    assert kvb.native and kvb.coordinator.retention_interval is None


def test_a_setting_on_a_group_view_of_a_fresh_manager_goes_to_vllms_managers():
    """vLLM's tests set attributes on a built manager's single-type managers (``use_eagle``,
    a spy on ``cache_blocks``): a native manager that served nothing yet goes to vLLM's own
    managers, and the setting reaches vLLM's manager object (the spy sees the calls)."""
    ref, kvb = managers(32, [full_spec(), sw_spec(8)])
    view = kvb.coordinator.single_type_managers[1]
    calls: list = []
    original = view.cache_blocks

    def spy(request, n, *args, **kwargs):
        calls.append(n)
        return original(request, n, *args, **kwargs)

    view.cache_blocks = spy
    assert not kvb.native
    assert kvb.coordinator.single_type_managers[1].cache_blocks is spy
    for m in (ref, kvb):
        assert m.allocate_slots(request("a", list(range(1, 14))), 13) is not None
    assert calls == [12]  # (vLLM's coordinator caches up to a scheduler block boundary)
    assert kvb.get_block_ids("a") == ref.get_block_ids("a")
    assert [b.block_id for b in view.req_to_blocks["a"]] == ref.get_block_ids("a")[1]


def cross_spec():
    return CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", ["full+cross", "cross+full", "full+sw8+cross"])
def test_cross_attention_as_vllm(shape, seed):
    """Encoder-decoder models (Whisper): a cross-attention group sized by the step's
    encoder tokens (vLLM's CrossAttentionManager: once per request, no prefix caching),
    beside the decoder's groups; a random stream of admissions with encoder inputs,
    decode steps without, preemption, resume and finish, compared call by call."""
    specs = {
        "full+cross": [full_spec(), cross_spec()],
        "cross+full": [cross_spec(), full_spec()],
        "full+sw8+cross": [full_spec(), sw_spec(8), cross_spec()],
    }[shape]
    ref, kvb = managers(24, specs, enable_caching=False)
    assert kvb.native and type(kvb) is HybridKVCacheManager
    rng = random.Random(seed)
    live: dict[str, tuple] = {}
    waiting: list[tuple] = []
    n = 0
    for _ in range(60):
        op = rng.random()
        if op < 0.3 or not live:
            n += 1
            toks = [rng.randint(1, 9) for _ in range(rng.randint(1, 20))]
            pair = (request(f"r{n}", toks), request(f"r{n}", toks))
            enc = rng.choice([0, 1, 3, 4, 5, 17])
            waiting.append((pair, enc))
        elif op < 0.45 and waiting:
            pair, enc = waiting.pop(0)
            must_fit = rng.random() < 0.5
            out = []
            for m, r in zip((ref, kvb), pair):
                new = m.allocate_slots(
                    r, r.num_tokens, num_encoder_tokens=enc, full_sequence_must_fit=must_fit
                )
                if new is not None:
                    r.num_computed_tokens = r.num_tokens
                out.append(_ids(new))
            assert out[0] == out[1]
            if out[0] is not None:
                live[pair[0].request_id] = pair
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            pair = live[rid]
            out = []
            for m, r in zip((ref, kvb), pair):
                r.append_output_token_ids(rng.randint(1, 9))
                new = m.allocate_slots(r, 1, num_lookahead_tokens=rng.choice([0, 2]))
                if new is not None:
                    r.num_computed_tokens += 1
                out.append(_ids(new))
            assert out[0] == out[1]
            if out[0] is None:
                for m, r in zip((ref, kvb), live.pop(rid)):
                    m.free(r)
        else:
            pair = live.pop(rng.choice(sorted(live)))
            for m, r in zip((ref, kvb), pair):
                m.free(r)
                r.num_computed_tokens = 0
            if rng.random() < 0.5:  # preempted: comes back with its encoder input
                waiting.append((pair, rng.choice([1, 4, 9])))
        for rid in live:
            assert ref.get_block_ids(rid) == kvb.get_block_ids(rid)
        assert ref.block_pool.get_num_free_blocks() == kvb.block_pool.get_num_free_blocks()
        assert ref.usage == kvb.usage
        assert ref.take_new_block_ids() == kvb.take_new_block_ids()
    for pair in live.values():
        for m, r in zip((ref, kvb), pair):
            m.free(r)
    free = [
        [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
        for m in (ref, kvb)
    ]
    assert free[0] == free[1]


@pytest.mark.parametrize("shape", ["full", "full+sw8"])
def test_eagle_hits_drop_a_block_and_the_map_keeps_the_earliest_duplicate(shape):
    """EAGLE: a hit drops its last block, so a prompt computed again caches a duplicate of
    that block; vLLM's ``cached_block_hash_to_block._cache`` maps the key to the earliest
    block (the one lookups return), and so must the view (it gave the latest: a test that
    pops an entry and puts the snapshot's block back then hid the earliest for good)."""
    import copy

    specs = {"full": lambda: [full_spec()], "full+sw8": lambda: [full_spec(), sw_spec(8)]}[shape]
    ref, kvb = managers(32, specs(), use_eagle=True)
    assert kvb.native
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    for i in range(2):
        got = []
        for m in (ref, kvb):
            r = request(f"r{i}", prompt)
            blocks, hit, _ = m.get_computed_blocks(r)
            new = m.allocate_slots(r, r.num_tokens - hit, hit, blocks)
            got.append((hit, blocks.get_block_ids(), new.get_block_ids()))
        assert got[0] == got[1]
    assert got[0][0] == 2 * BS  # the 3 cached blocks, the last dropped
    maps = [copy.copy(m.block_pool.cached_block_hash_to_block._cache) for m in (ref, kvb)]
    assert maps[0] == maps[1]


@pytest.mark.parametrize("hash_fn", [sha256, sha256_16])
def test_a_partial_prompt_tail_is_an_extra_key_of_its_block(hash_fn):
    """Full attention in blocks of 8 beside a window in blocks of 4 (hashes of 4): a
    13-token prompt's last hash boundary (12) lies inside block 1, which vLLM keys by that
    boundary's hash as well as, once full, by its own; get_cached_block finds the block by
    either key, evicting it drops both (one BlockRemoved each), as vLLM's pool."""
    global BS, HASH_FN
    old = BS, HASH_FN
    BS, HASH_FN = 4, hash_fn
    try:
        init_none_hash(sha256)
        specs = lambda: [full_spec(8), sw_spec(8, 4)]  # noqa: E731
        args = dict(max_model_len=256, scheduler_block_size=8, hash_block_size=4)
        ref = VLLMKVCacheManager(config(16, specs()), enable_kv_cache_events=True, **args)
        kvb = KVCacheManager(config(16, specs()), enable_kv_cache_events=True, **args)
        assert kvb.native
        pair = [request("a", list(range(1, 14))) for _ in range(2)]
        for m, r in zip((ref, kvb), pair):
            assert m.allocate_slots(r, 13) is not None
            r.num_computed_tokens = 13
            for tok in (50, 51, 52):  # decode to 16 tokens: block 1 fills
                r.append_output_token_ids(tok)
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
        assert ref.take_events() == kvb.take_events()
        partial, full = pair[0].block_hashes[2], pair[0].block_hashes[3]
        found = [
            [
                None if b is None else [x.block_id for x in b]
                for b in (
                    m.block_pool.get_cached_block(partial, [0]),
                    m.block_pool.get_cached_block(full, [0]),
                )
            ]
            for m in (ref, kvb)
        ]
        assert found[0] == found[1] and found[0][0] == found[0][1] is not None, found
        (b,) = found[1][0]
        assert kvb._native.pool.keys_of(b).shape == (2, 2)  # its own key, then the tail's
        for m in (ref, kvb):
            m.evict_blocks({b})
        assert ref.take_events() == kvb.take_events()
        for m in (ref, kvb):
            assert m.block_pool.get_cached_block(partial, [0]) is None
            assert m.block_pool.get_cached_block(full, [0]) is None
    finally:
        BS, HASH_FN = old


def test_eagle_drops_again_after_another_group_shrinks_the_hit():
    """vLLM's fixed point with EAGLE: each EAGLE group drops its last block once per
    candidate length, and a group that shrinks the candidate without dropping makes the
    others drop again (``eagle_verified`` cleared). Full attention + windows of 5 and 12
    tokens: a 40-token prompt cached in every group, then blocks evicted so that the 12-token
    window shrinks the hit in the first pass (its block 9) and the 5-token window in the
    second (its block 7): the 12-token window must look up again with the drop (its block 4
    missing makes that lookup shorter than one without the drop)."""
    ref, kvb = managers(64, [full_spec(), sw_spec(5), sw_spec(12)], use_eagle=True)
    assert kvb.native
    prompt = list(range(1, 41))
    ids = []
    for m in (ref, kvb):
        r = request("a", prompt)
        assert m.allocate_slots(r, 40) is not None
        ids.append(m.get_block_ids("a"))
        m.free(r)
    assert ids[0] == ids[1]
    (_, g1, g2) = ids[0]
    for m in (ref, kvb):
        m.evict_blocks({g2[9], g2[4], g1[7]})
    got = []
    for m in (ref, kvb):
        blocks, hit, _ = m.get_computed_blocks(request("b", prompt + [99]))
        got.append((hit, blocks.get_block_ids()))
    assert got[0] == got[1]
    assert got[0][0] == 3 * BS  # (without the second drop: 4 blocks)


@pytest.mark.parametrize("shape", ["full", "full+sw8"])
def test_cache_map_takes_back_only_the_entry_it_hid(shape):
    """``cached_block_hash_to_block._cache``: vLLM's tests pop an entry to stage a miss and
    set it back. Setting a key onto another block (an alias id, -1, an id out of range, a
    block that holds another key) is refused and changes nothing; the popped entry itself
    comes back and hits again."""
    import copy

    specs = {"full": lambda: [full_spec()], "full+sw8": lambda: [full_spec(), sw_spec(8)]}[shape]
    ref, kvb = managers(32, specs())
    prompt = list(range(1, 15))
    r = request("a", prompt)
    assert kvb.allocate_slots(r, 14) is not None
    kvb.free(r)
    m = kvb.block_pool.cached_block_hash_to_block
    snap = copy.copy(m._cache)
    key, b = next(iter(snap.items()))
    other = next(v for k, v in snap.items() if v != b)
    hit = kvb.get_num_cached_tokens(request("b", prompt))
    assert m._cache.pop(key) == b
    assert kvb.get_num_cached_tokens(request("c", prompt)) < hit
    for bad in (other, -1, 0, 32, 2**40):
        with pytest.raises(NotImplementedError):
            m._cache[key] = bad
    assert kvb.get_num_cached_tokens(request("d", prompt)) < hit
    m._cache[key] = b
    assert kvb.get_num_cached_tokens(request("e", prompt)) == hit
    assert copy.copy(m._cache) == snap
