"""A hypothesis state machine driving vLLM's own KVCacheManager and kvblocks' side by side
(kvblocks.integrations.vllm); skipped unless vllm (0.34) is importable.

Three configurations: one full-attention group (the one-group native path), a full +
sliding-window pair and a full + chunked-local pair (the native hybrid path). Rules: admission of a new request (one of a few
shared system prompts + its own tokens, an optional ``cache_salt``, a prefill chunk, lookahead
slots, ``full_sequence_must_fit``), admission of an earlier prompt again or continued
(full-prompt and long prefix hits), resume of a preempted one, one step of a running request
(the next prefill chunk, or a decode token), preemption, finish, ``reset_prefix_cache``; a
small pool, so allocation fails sometimes. Every answer is compared as it comes (hits: the
number of computed tokens and the hit's block ids, the shared-prefix boundary, the new
blocks or None) and, after every rule, the block ids of every live request per group, free
block counts, usage, the prefix-cache stats and the events (``take_events``).

A KV connector's calls are a rule too: ``evict_blocks`` of a few blocks (free ones keep their
free-list place, held ones join the head when freed), or ``block_pool.touch`` of a few blocks
and their ``free_blocks(..., evict_first=True)``. Differences docs/vllm.md names ("Tests that
cannot pass natively") are kept out: no ``ref_cnt`` write, and none reads
``cached_block_hash_to_block``.

Profiles: the default is fast (60 examples of at most 50 steps per configuration);
``KVB_HYPOTHESIS_PROFILE=mid`` runs 1,000 examples of at most 100 steps, ``deep`` 10,000.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")
torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from kvblocks.integrations.vllm.manager import KVCacheManager, VLLMKVCacheManager  # noqa: E402

BS = 4
MAX_LIVE = 5
PROFILES = {
    "fast": dict(max_examples=60, stateful_step_count=50),
    "mid": dict(max_examples=1_000, stateful_step_count=100),
    "deep": dict(max_examples=10_000, stateful_step_count=100),
}
PROFILE = settings(
    **PROFILES[os.environ.get("KVB_HYPOTHESIS_PROFILE", "fast")],
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

# three system prompts: a partial block, two full blocks, two full blocks and three tokens
SYSTEM_PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]]
TOKEN = st.integers(1, 12)  # a small vocabulary: own tokens often repeat a cached block
CHUNK = st.sampled_from([3, 4, 8, 64])
LOOKAHEAD = st.sampled_from([0, 0, 1, 3])


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


def mamba_spec(mode: str = "align", spec_blocks: int = 0, checkpoint_alignment=None, bs: int = BS):
    return MambaSpec(
        block_size=bs,
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        num_speculative_blocks=spec_blocks,
        num_prefill_checkpoint_blocks=int(checkpoint_alignment is not None),
        prefill_checkpoint_alignment=checkpoint_alignment,
    )


def config(num_blocks: int, specs) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )


def request(rid: str, tokens: list, salt, hbs: int = BS, lookahead: int = 0) -> Request:
    sp = SamplingParams(max_tokens=8)
    sp.update_from_generation_config({}, eos_token_id=0)
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(hbs, sha256, lookahead),
        cache_salt=salt,
    )


def _ids(blocks):
    return None if blocks is None else blocks.get_block_ids()


class Differential(RuleBasedStateMachine):
    """vLLM's manager (``ref``) and kvblocks' (``kvb``) fed the same calls; ``live`` maps a
    request id to its pair of Request objects (one per manager), ``waiting`` holds preempted
    pairs in preemption order."""

    SPECS: list = []
    CACHING = (False, True)  # prefix caching off / on
    # coordinator.retention_interval values set after the build, as vLLM's tests do
    RETENTION: tuple = (None,)
    EAGLE = False  # EAGLE / MTP speculative decoding: hits drop their last block
    LOOKAHEAD_HASH = 0  # vLLM's num_hash_lookahead_tokens: hashes cover tokens past a block
    HBS = 0  # the hash block size (0: the specs' block sizes' gcd)
    CHUNK_SCALE = 1  # prefill chunks are CHUNK's sizes times this (longer blocks: longer)

    @initialize(
        num_blocks=st.sampled_from([10, 16, 24, 40]),
        caching=st.booleans(),
        retention=st.integers(0, 3),
    )
    def build(self, num_blocks, caching, retention):
        caching = self.CACHING[caching]
        init_none_hash(sha256)
        specs = [f() for f in self.SPECS]
        # groups of different block sizes: vLLM hashes at their gcd and aligns hits to
        # their lcm (resolve_kv_cache_block_sizes); without caching both are the lcm
        sizes = [sp.block_size for sp in specs]
        sbs = math.lcm(*sizes)
        self.hbs = (self.HBS or math.gcd(*sizes)) if caching else sbs
        self.mixed = len(set(sizes)) > 1
        args = dict(
            max_model_len=256,
            scheduler_block_size=sbs,
            hash_block_size=self.hbs,
            enable_caching=caching,
            enable_kv_cache_events=True,
            log_stats=True,
            use_eagle=self.EAGLE,
            num_hash_lookahead_tokens=self.LOOKAHEAD_HASH,
        )
        self.ref = VLLMKVCacheManager(config(num_blocks, specs), **args)
        self.kvb = KVCacheManager(config(num_blocks, specs), **args)
        assert self.kvb.native
        self.retention = self.RETENTION[retention % len(self.RETENTION)]
        if self.retention is not None:
            for m in (self.ref, self.kvb):
                m.coordinator.retention_interval = self.retention
            event(f"retention interval {self.retention}")
        self.live: dict[str, tuple] = {}
        self.waiting: list[tuple] = []
        self.prompts: list[tuple] = []  # (tokens, salt) of every admitted request
        self.n = 0

    def _pairs(self, pair):
        return zip((self.ref, self.kvb), pair)

    def _drop(self, pair):
        for m, r in self._pairs(pair):
            m.free(r)
            r.num_computed_tokens = 0

    def _admit(self, pair, chunk, la, must_fit):
        assert self.ref.get_num_cached_tokens(pair[0]) == self.kvb.get_num_cached_tokens(pair[1])
        got = []
        for m, r in self._pairs(pair):
            blocks, hit, spb = m.get_computed_blocks(r)
            m.record_prefix_cache_stats(r, hit)  # the scheduler's call after the lookup
            n = min(r.num_tokens - hit, chunk * self.CHUNK_SCALE)
            new = m.allocate_slots(
                r, n, hit, blocks, num_lookahead_tokens=la, full_sequence_must_fit=must_fit
            )
            if new is not None:
                r.num_computed_tokens = hit + n
                r.status = RequestStatus.RUNNING
            got.append((hit, spb, blocks.get_block_ids(), _ids(new)))
        assert got[0] == got[1]
        event("prefix hit" if got[0][0] else "miss")
        if any(0 in g for g in got[0][2]):
            event("window hit with null blocks")
        if got[0][3] is None:  # no room: both refused; the request is dropped
            event("admission refused")
            self._drop(pair)
        else:
            self.live[pair[0].request_id] = pair

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(
        prompt=st.integers(0, len(SYSTEM_PROMPTS) - 1),
        own=st.lists(TOKEN, min_size=1, max_size=12),
        salt=st.sampled_from([None, None, "a", "b"]),
        chunk=CHUNK,
        la=LOOKAHEAD,
        must_fit=st.booleans(),
    )
    def admit(self, prompt, own, salt, chunk, la, must_fit):
        self._new(SYSTEM_PROMPTS[prompt] + own, salt, chunk, la, must_fit)

    @precondition(lambda self: self.prompts and len(self.live) < MAX_LIVE)
    @rule(
        pick=st.integers(0, 63),
        more=st.lists(TOKEN, max_size=10),
        chunk=CHUNK,
        la=LOOKAHEAD,
        must_fit=st.booleans(),
    )
    def admit_again(self, pick, more, chunk, la, must_fit):
        """An earlier prompt again (a full-prompt hit) or continued (a longer prefix hit:
        with a window, the blocks before it come back null)."""
        toks, salt = self.prompts[pick % len(self.prompts)]
        self._new(toks + more, salt, chunk, la, must_fit)

    def _new(self, toks, salt, chunk, la, must_fit):
        self.prompts.append((toks, salt))
        self.n += 1
        rid = f"q{self.n}"
        la = self.LOOKAHEAD_HASH
        pair = (request(rid, toks, salt, self.hbs, la), request(rid, toks, salt, self.hbs, la))
        self._admit(pair, chunk, la, must_fit)

    @precondition(lambda self: self.waiting and len(self.live) < MAX_LIVE)
    @rule(chunk=CHUNK, la=LOOKAHEAD, must_fit=st.booleans())
    def resume(self, chunk, la, must_fit):
        self._admit(self.waiting.pop(0), chunk, la, must_fit)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, MAX_LIVE - 1), tok=TOKEN, chunk=CHUNK, la=LOOKAHEAD)
    def step(self, pick, tok, chunk, la):
        """The next prefill chunk, or one decode token (appended before the call)."""
        rid = sorted(self.live)[pick % len(self.live)]
        pair = self.live[rid]
        if pair[0].num_computed_tokens == pair[0].num_tokens:
            for r in pair:
                r.append_output_token_ids(tok)
        out = []
        for m, r in self._pairs(pair):
            n = min(r.num_tokens - r.num_computed_tokens, chunk * self.CHUNK_SCALE)
            new = m.allocate_slots(r, n, num_lookahead_tokens=la)
            if new is not None:
                r.num_computed_tokens += n
            out.append(_ids(new))
        assert out[0] == out[1]
        if out[0] is None:  # the scheduler would preempt; here it finishes
            event("step refused")
            for m, r in self._pairs(self.live.pop(rid)):
                m.free(r)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def preempt(self, pick):
        pair = self.live.pop(sorted(self.live)[pick % len(self.live)])
        for m, r in self._pairs(pair):
            m.free(r)
            r.num_computed_tokens = 0
            r.status = RequestStatus.PREEMPTED
            r.num_preemptions += 1  # as vLLM's scheduler (the preempted prefix-cache stats)
        self.waiting.append(pair)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def finish(self, pick):
        for m, r in self._pairs(self.live.pop(sorted(self.live)[pick % len(self.live)])):
            m.free(r)

    @rule(
        ids=st.sets(st.integers(1, 39), min_size=1, max_size=3),
        evict_first=st.booleans(),
    )
    def connector(self, ids, evict_first):
        """A KV connector's calls: ``evict_blocks`` of a few blocks (free, held or without an
        entry), or a pin of a few blocks and their release with ``evict_first``."""
        ids = {b for b in ids if b < self.ref.block_pool.num_gpu_blocks}
        for m in (self.ref, self.kvb):
            if not evict_first:
                m.evict_blocks(ids)
                continue
            blocks = [m.block_pool.blocks[b] for b in sorted(ids)]
            m.block_pool.touch(blocks)
            m.block_pool.free_blocks(blocks, evict_first=True)
        event("evict_first release" if evict_first else "evict_blocks")

    @rule()
    def new_step(self):
        """The scheduler's call at each step (Mamba: hits on blocks cached in the step
        before may be admitted now)."""
        for m in (self.ref, self.kvb):
            m.new_step_starts()

    @rule()
    def reset_prefix_cache(self):
        """With requests running vLLM refuses (False) and changes nothing; so must kvblocks."""
        assert self.ref.reset_prefix_cache() == self.kvb.reset_prefix_cache()

    @invariant()
    def same_state(self):
        if not hasattr(self, "ref"):
            return
        for rid in self.live:
            assert self.ref.get_block_ids(rid) == self.kvb.get_block_ids(rid), rid
        ref_pool, kvb_pool = self.ref.block_pool, self.kvb.block_pool
        # copy-on-write of partial hits: the same copies, whose ends the scheduler frees
        # once they have run (here at once)
        copies = [m.take_kv_cache_block_copies() for m in (self.ref, self.kvb)]
        assert copies[0][0] == copies[1][0]
        assert [b.block_id for b in copies[0][1]] == [b.block_id for b in copies[1][1]]
        if copies[0][0]:
            event("copy-on-write")
            for m, (_, kept) in zip((self.ref, self.kvb), copies):
                m.block_pool.free_blocks(kept)
        assert ref_pool.get_num_free_blocks() == kvb_pool.get_num_free_blocks()
        assert self.ref.usage == self.kvb.usage
        assert self.ref.make_prefix_cache_stats() == self.kvb.make_prefix_cache_stats()
        assert self.ref.take_boundary_state_offloads() == self.kvb.take_boundary_state_offloads()
        assert self.ref.take_new_block_ids() == self.kvb.take_new_block_ids()  # KV zeroing
        align = {
            g
            for g, spec in enumerate(self.ref.kv_cache_config.kv_cache_groups)
            if getattr(spec.kv_cache_spec, "mamba_cache_mode", None) == "align"
        }
        if (align or self.mixed) and self.ref.enable_caching:  # an entry's token count (a
            for b in range(1, ref_pool.num_gpu_blocks):  # Mamba group's rules, a partial
                rb, kb = ref_pool.blocks[b], kvb_pool.blocks[b]  # prompt tail, read it)
                assert rb.block_hash == kb.block_hash, b
                if rb.block_hash is not None and (
                    self.mixed or get_group_id(rb.block_hash) in align
                ):
                    assert rb.block_hash_num_tokens == kb.block_hash_num_tokens, b
        for g, spec in enumerate(self.ref.kv_cache_config.kv_cache_groups):  # checkpoints
            if getattr(spec.kv_cache_spec, "num_prefill_checkpoint_blocks", 0):
                ck = self.ref.coordinator.single_type_managers[g]._checkpoints
                assert ck == self.kvb.coordinator.single_type_managers[g]._checkpoints
                if ck:
                    event("checkpoint reserved")
        if self.mixed and getattr(self.kvb, "_native", None) is not None and self.kvb._native.sec:
            event("a block with several keys")  # (a partial prompt tail's extra key)
        events = self.kvb.take_events()
        assert self.ref.take_events() == events
        if any(type(e).__name__ == "BlockRemoved" for e in events):
            event("cached block evicted")

    def teardown(self):
        if not hasattr(self, "ref"):
            return
        for pair in self.live.values():
            for m, r in self._pairs(pair):
                m.free(r)
        assert self.ref.block_pool.get_num_free_blocks() == (
            self.kvb.block_pool.get_num_free_blocks()
        )
        free = [
            [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
            for m in (self.ref, self.kvb)
        ]
        assert free[0] == free[1]
        assert self.ref.reset_prefix_cache() and self.kvb.reset_prefix_cache()
        assert self.ref.take_events() == self.kvb.take_events()


class FullOnly(Differential):
    SPECS = [full_spec]


class FullAndSlidingWindow(Differential):
    SPECS = [full_spec, lambda: sw_spec(8)]


class FullAndChunkedLocal(Differential):
    SPECS = [full_spec, lambda: chunk_spec(8)]


class FullAndMamba(Differential):
    """Mamba in vLLM's "align" mode (its mode with prefix caching) beside full attention."""

    SPECS = [full_spec, mamba_spec]


class MambaOnly(Differential):
    SPECS = [mamba_spec]


class FullAndMambaSpeculative(Differential):
    """Align mode with two speculative blocks (moved to the table's end each step)."""

    SPECS = [full_spec, lambda: mamba_spec(spec_blocks=2)]


class FullAndMambaNone(Differential):
    """Mamba's "none" mode (no prefix caching), one speculative block."""

    SPECS = [full_spec, lambda: mamba_spec("none", 1)]
    CACHING = (False, False)


TestFullOnly = FullOnly.TestCase
TestFullOnly.settings = PROFILE
TestFullAndSlidingWindow = FullAndSlidingWindow.TestCase
TestFullAndSlidingWindow.settings = PROFILE
TestFullAndChunkedLocal = FullAndChunkedLocal.TestCase
TestFullAndChunkedLocal.settings = PROFILE
TestFullAndMamba = FullAndMamba.TestCase
TestFullAndMamba.settings = PROFILE
TestMambaOnly = MambaOnly.TestCase
TestMambaOnly.settings = PROFILE
TestFullAndMambaSpeculative = FullAndMambaSpeculative.TestCase
TestFullAndMambaSpeculative.settings = PROFILE
TestFullAndMambaNone = FullAndMambaNone.TestCase
TestFullAndMambaNone.settings = PROFILE


def mla_spec():
    return MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)


def sw_mla_spec(window: int):
    return SlidingWindowMLASpec(
        block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=window
    )


class MLAOnly(Differential):
    """One MLA group (DeepSeek V2/V3: vLLM's FullAttentionManager rules), the one-group
    path, with EAGLE."""

    SPECS = [mla_spec]
    EAGLE = True


class MLAAndSlidingWindowMLA(Differential):
    """MLA beside a sliding-window MLA group of 8 tokens and a plain full-attention group
    (three attention groups, full ones looked up apart: their specs differ)."""

    SPECS = [mla_spec, lambda: sw_mla_spec(8), full_spec]


TestMLAOnly = MLAOnly.TestCase
TestMLAOnly.settings = PROFILE
TestMLAAndSlidingWindowMLA = MLAAndSlidingWindowMLA.TestCase
TestMLAAndSlidingWindowMLA.settings = PROFILE


class MixedBlockSizes(Differential):
    """Full attention in blocks of 8 and a window of 8 tokens in blocks of 4 (hashes of 4,
    hits aligned to 8: the window caches only the tail an aligned hit reads; the full
    group keys a prompt's last hash boundary inside a block as that block's extra key)."""

    SPECS = [lambda: full_spec(8), lambda: sw_spec(8, 4)]


class MixedBlockSizesWindowLarger(Differential):
    """Full attention in blocks of 4 beside a window of 13 tokens in blocks of 8."""

    SPECS = [lambda: full_spec(4), lambda: sw_spec(13, 8)]


class FullOnlyEagle(Differential):
    """One full-attention group with EAGLE (the one-group path: a hit's last block is
    dropped)."""

    SPECS = [full_spec]
    EAGLE = True


class FullAndSlidingWindowEagle(Differential):
    """Full attention + a window of 8 with EAGLE (vLLM's fixed point: each group looks a
    block past the candidate and drops it once per candidate, a window needs one block
    more)."""

    SPECS = [full_spec, lambda: sw_spec(8)]
    EAGLE = True


class SlidingWindowsEagle(Differential):
    """Two windows (5 and 12 tokens, looked up apart) beside full attention, with EAGLE."""

    SPECS = [lambda: sw_spec(5), full_spec, lambda: sw_spec(12)]
    EAGLE = True


class FullAndSlidingWindowLookahead(Differential):
    """Full attention + a window of 8 with lookahead hashes of 2 tokens (each hash covers
    the block and the 2 tokens after it: the events carry them); blocks of different sizes
    (full in 8, the window in 4) so that partial prompt tails carry them too."""

    SPECS = [lambda: full_spec(8), lambda: sw_spec(8, 4)]
    LOOKAHEAD_HASH = 2


class FullOnlyLookahead(Differential):
    SPECS = [full_spec]
    LOOKAHEAD_HASH = 1


TestFullAndSlidingWindowLookahead = FullAndSlidingWindowLookahead.TestCase
TestFullAndSlidingWindowLookahead.settings = PROFILE
TestFullOnlyLookahead = FullOnlyLookahead.TestCase
TestFullOnlyLookahead.settings = PROFILE
TestFullOnlyEagle = FullOnlyEagle.TestCase
TestFullOnlyEagle.settings = PROFILE
TestFullAndSlidingWindowEagle = FullAndSlidingWindowEagle.TestCase
TestFullAndSlidingWindowEagle.settings = PROFILE
TestSlidingWindowsEagle = SlidingWindowsEagle.TestCase
TestSlidingWindowsEagle.settings = PROFILE


class MixedBlockSizesWindowsOnly(Differential):
    """Two windows (8 tokens in blocks of 4, 12 in blocks of 8), no full-attention group:
    the hit's first candidate is the request's length, not an aligned one."""

    SPECS = [lambda: sw_spec(8, 4), lambda: sw_spec(12, 8)]


TestMixedBlockSizesWindowsOnly = MixedBlockSizesWindowsOnly.TestCase
TestMixedBlockSizesWindowsOnly.settings = PROFILE
TestMixedBlockSizes = MixedBlockSizes.TestCase
TestMixedBlockSizes.settings = PROFILE
TestMixedBlockSizesWindowLarger = MixedBlockSizesWindowLarger.TestCase
TestMixedBlockSizesWindowLarger.settings = PROFILE


class FullAndMambaCheckpoints(Differential):
    """Mamba prefill checkpoint blocks (a state exported inside a chunk, kept at its
    boundary): the alignment half a block, as vLLM's tests (16 tokens in blocks of 32);
    dense or sparse retention (0: replay boundaries only; 8: every second block)."""

    SPECS = [full_spec, lambda: mamba_spec(checkpoint_alignment=2)]
    CACHING = (True, True)
    RETENTION = (None, 0, 8, None)


class MambaPartialHits(Differential):
    """Mamba in blocks of 8 beside full attention in blocks of 4 (hashes of 4): vLLM's
    partial hash hits (a Mamba hit on any hash boundary, the shared block copied on
    write, the prompt's last hash boundary keyed inside a state block)."""

    SPECS = [full_spec, lambda: mamba_spec(bs=8)]
    CACHING = (True, True)


class MambaPartialHitsFullLarger(Differential):
    """Partial hash hits with full attention in blocks of 8 over hashes of 4 (its hits
    probe the first non-full block's hash boundaries, copied on write too) beside Mamba
    in blocks of 16."""

    SPECS = [lambda: full_spec(8), lambda: mamba_spec(bs=16)]
    HBS = 4
    CACHING = (True, True)


TestMambaPartialHits = MambaPartialHits.TestCase
TestMambaPartialHits.settings = PROFILE
TestMambaPartialHitsFullLarger = MambaPartialHitsFullLarger.TestCase
TestMambaPartialHitsFullLarger.settings = PROFILE


class MambaCheckpointsBlockAligned(Differential):
    """Mamba alone with checkpoints at block alignment and a speculative block."""

    SPECS = [lambda: mamba_spec(spec_blocks=1, checkpoint_alignment=4)]
    RETENTION = (None, 0, 4, 12)


TestFullAndMambaCheckpoints = FullAndMambaCheckpoints.TestCase
TestFullAndMambaCheckpoints.settings = PROFILE
TestMambaCheckpointsBlockAligned = MambaCheckpointsBlockAligned.TestCase
TestMambaCheckpointsBlockAligned.settings = PROFILE


class MambaPartialHitsCheckpoints(Differential):
    """Partial hash hits (full attention in blocks of 4, Mamba in blocks of 8, hashes of
    4) with prefill checkpoint blocks aligned to a hash block: a checkpoint on a hash
    boundary inside a block re-keys the reserved block there (its entries replaced) or,
    transient, drops them."""

    SPECS = [full_spec, lambda: mamba_spec(bs=8, checkpoint_alignment=4)]
    CACHING = (True, True)
    CHUNK_SCALE = 2  # (chunks of 16 export states inside blocks before the prompt's end)


class MambaPartialHitsCheckpointsHalf(Differential):
    """The same with the checkpoint alignment half a hash block (2 tokens)."""

    SPECS = [full_spec, lambda: mamba_spec(bs=8, checkpoint_alignment=2)]
    CACHING = (True, True)
    CHUNK_SCALE = 2


TestMambaPartialHitsCheckpoints = MambaPartialHitsCheckpoints.TestCase
TestMambaPartialHitsCheckpoints.settings = PROFILE
TestMambaPartialHitsCheckpointsHalf = MambaPartialHitsCheckpointsHalf.TestCase
TestMambaPartialHitsCheckpointsHalf.settings = PROFILE


class MambaPartialHitsSpeculative(Differential):
    """Partial hash hits with two speculative Mamba blocks (moved to the table's end each
    step) and checkpoint blocks aligned to half a hash block."""

    SPECS = [full_spec, lambda: mamba_spec(spec_blocks=2, checkpoint_alignment=2, bs=8)]
    CACHING = (True, True)
    CHUNK_SCALE = 2


class MambaPartialHitsSpeculativeOnly(Differential):
    """Partial hash hits with one speculative Mamba block, no checkpoint blocks; full
    attention in blocks of 8 over hashes of 4, Mamba in blocks of 16."""

    SPECS = [lambda: full_spec(8), lambda: mamba_spec(spec_blocks=1, bs=16)]
    HBS = 4
    CACHING = (True, True)


TestMambaPartialHitsSpeculative = MambaPartialHitsSpeculative.TestCase
TestMambaPartialHitsSpeculative.settings = PROFILE
TestMambaPartialHitsSpeculativeOnly = MambaPartialHitsSpeculativeOnly.TestCase
TestMambaPartialHitsSpeculativeOnly.settings = PROFILE
