"""The native state of kvblocks' hybrid KV cache manager for vLLM (hybrid.py): one
``kvblocks.BlockPool`` for every KV cache group, and per request one block table per group.

vLLM's rules per group kind live here, as its single-type managers have them:

- cache hits (``find``): vLLM's fixed point over the attention groups (groups of one spec
  looked up jointly, full attention first). Full attention: the run cached from block 0.
  A sliding window: the rightmost run of ``cdiv(window - 1, block_size)`` cached blocks, the
  blocks before it null. Chunked local attention: the blocks before the chunk holding the
  hit's end token are null (a hit of nulls only when that end starts a chunk), then the run
  cached from the chunk's first block. Each run is one native lookup of the group's keys
  (vLLM's hash + group id: the hash's first 128 bits, the group mixed into the second word,
  the full 32 bytes checked against the array beside the pool);
- skipped blocks (``remove_skipped``): a window group's blocks before the window, a chunk
  group's before the chunk of the next token, are freed and become the null block 0;
- caching (``cache_groups``) and free (``free_request``) group by group in vLLM's order;
- EAGLE / MTP (``_eagle_hit``): a group's hit looks a block further and drops its last block;
- groups of different block sizes (``mixed``: ``_mixed_hit``, ``_cache_mixed``): each group
  reads every scale-th hash, hits and caching are aligned to the sizes' lcm, a window caches
  only the tail an aligned hit reads, a full-attention group keys the prompt's last hash
  boundary inside a block as that block's extra key (``BlockPool.add_key_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, cast

import numpy as np
from vllm.distributed.kv_events import BlockStored
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMKVCacheManager
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

import kvblocks

from .mamba import MambaAlign, is_align
from .state import _EMPTY_I32, _NativeState

_MASK64 = 0xFFFFFFFFFFFFFFFF
# attention kinds served natively, as vLLM's coordinator splits groups (full attention first)
_FULL, _WINDOW, _CHUNK, _MAMBA, _CROSS = 0, 1, 2, 3, 4
_KINDS = {
    FullAttentionSpec: _FULL,
    MLAAttentionSpec: _FULL,  # (MLA's latent cache: vLLM's FullAttentionManager rules)
    SlidingWindowSpec: _WINDOW,
    SlidingWindowMLASpec: _WINDOW,  # (vLLM's SlidingWindowManager)
    ChunkedLocalAttentionSpec: _CHUNK,
    MambaSpec: _MAMBA,
    CrossAttentionSpec: _CROSS,  # (without prefix caching only: hybrid.py)
}


def _group_salt(g: int) -> np.uint64:
    """XORed into the second key word of group g's entries (0 for group 0)."""
    return np.uint64((g * 0xD1B54A32D192ED03) & _MASK64)


class _HybridState(_NativeState):
    """The native pool, and per request one block table per KV cache group."""

    def __init__(self, mgr: VLLMKVCacheManager, coord: Any) -> None:
        vpool = coord.block_pool
        stms = coord.single_type_managers
        super().__init__(
            vpool.num_gpu_blocks,
            stms[0].block_size,
            mgr.enable_caching,
            mgr.enable_kv_cache_events,
            vpool.medium,
        )
        self.num_groups = len(stms)
        self.lookahead = getattr(vpool, "num_hash_lookahead_tokens", 0)
        # per group: its block size. Groups of different block sizes (vLLM's hybrid
        # coordinator: hashes at the sizes' gcd, ``hash_block_size``; hits and caching
        # aligned to their lcm, ``scheduler_block_size``) take the ``mixed`` paths below;
        # ``scale[g]``: group g's block in hash blocks (its hashes: every scale-th one)
        self.bsz = [m.block_size for m in stms]
        # vLLM's fine-grained partial hash hits (an align-mode Mamba group's blocks longer
        # than a hash block): hits and caching at hash-block granularity, a hit that ends
        # inside a block copied on write (``phit``, ``cow``); served on the mixed paths
        self.fine = bool(getattr(coord, "enable_partial_hash_hits", False))
        self.mixed = len(set(self.bsz)) > 1 or self.fine
        self.sbs = coord.scheduler_block_size if self.mixed else stms[0].block_size
        self.hbs = vpool.hash_block_size if mgr.enable_caching else self.sbs
        self.scale = [bs // self.hbs if mgr.enable_caching else 1 for bs in self.bsz]
        # the tokens a hit is aligned to (vLLM's _cache_hit_alignment_tokens)
        self.halign = self.hbs if self.fine else self.sbs
        # per group: request id -> (table index, block) of a hit ending inside that block,
        # to be replaced by a private copy at the next allocation (vLLM's _partial_hit_reqs)
        self.phit: list[dict[str, tuple[int, int]]] = [{} for _ in stms]
        # per group: (source, copy) block pairs not yet taken (vLLM's _pending_cow_copies);
        # both ends hold one reference more until the scheduler frees them
        self.cow: list[list[tuple[int, int]]] = [[] for _ in stms]
        self.stms = stms
        # per group: whether vLLM's FullAttentionManager caches the prompt's last hash
        # boundary inside a block as an extra key of that block (block size > hash size)
        self.partial = [
            self.mixed and _KINDS[type(m.kv_cache_spec)] == _FULL and self.scale[g] > 1
            for g, m in enumerate(stms)
        ]
        # per group: vLLM's manager class (a window group's reachable_block_mask) and spec
        if self.mixed:
            self.ntok = np.zeros(self.num_blocks, dtype=np.int32)
        self.stm_cls = [type(m) for m in stms]
        self.specs = [m.kv_cache_spec for m in stms]
        # per group: sliding window (0 for full attention), extra retained tokens, vLLM's
        # admission cap in blocks (None: no cap)
        self.window = [getattr(m.kv_cache_spec, "sliding_window", 0) or 0 for m in stms]
        # per group: attention chunk (0 unless chunked local attention)
        # (FullAttentionSpec has the field too, for its merged specs: not a chunk here)
        self.chunk = [
            m.kv_cache_spec.attention_chunk_size
            if type(m.kv_cache_spec) is ChunkedLocalAttentionSpec
            else 0
            for m in stms
        ]
        self.extra = [getattr(m.kv_cache_spec, "extra_retained_tokens", 0) or 0 for m in stms]
        self.cap = [getattr(m, "max_admission_blocks_per_request", None) for m in stms]
        # Mamba groups (mamba.py): a state block per request, every token before the last
        # skipped; in align mode (prefix caching) vLLM's MambaManager rules, otherwise a
        # window of two tokens with the speculative blocks' tokens more (spec_tokens)
        self.mamba = [type(m.kv_cache_spec) is MambaSpec for m in stms]
        align = [g for g in range(self.num_groups) if is_align(stms[g].kv_cache_spec)]
        self.align: Optional[MambaAlign] = (
            MambaAlign(self, align, [stms[g].kv_cache_spec for g in align]) if align else None
        )
        self.is_align = [g in align for g in range(self.num_groups)]
        # vLLM's coordinator.retention_interval: None (dense) when built natively; vLLM's
        # tests set it afterwards (hybrid.py's coordinator view), Mamba groups follow it
        self.retention: Optional[int] = None
        # per group: vLLM's single-type manager when the worker zeroes the group's new
        # blocks (a model with Mamba layers: its attention groups), whose new_block_ids
        # the adapter fills and vLLM's take_new_block_ids drains; else None
        self.zeroing = [m if getattr(m, "_record_new_block_ids", False) else None for m in stms]
        self.mamba_any = any(self.mamba)
        # cross-attention groups (encoder-decoder models, no prefix caching): vLLM's
        # CrossAttentionManager sizes them by the step's encoder tokens, once per request
        # (no hits, no skipped blocks, no external blocks)
        self.cross = [type(m.kv_cache_spec) is CrossAttentionSpec for m in stms]
        self.cross_any = any(self.cross)
        self.spec_tokens = [
            m.kv_cache_spec.num_speculative_blocks * self.block_size
            if self.mamba[g] and not self.is_align[g]
            else 0
            for g, m in enumerate(stms)
        ]
        # the hybrid coordinator caches up to a scheduler block boundary (the unitary one
        # takes the count as it is): what the Mamba rules see as the cached token count
        self.round_cache = len(stms) > 1
        # groups whose blocks leave the attention span (window, chunk or Mamba state):
        # vLLM's remove_skipped_blocks frees them
        self.sw_groups = [
            g for g in range(self.num_groups) if self.window[g] or self.chunk[g] or self.mamba[g]
        ]
        self.salt = [_group_salt(g) for g in range(self.num_groups)]
        self.salt_int = [int(x) for x in self.salt]
        # vLLM's attention groups (verify_and_split_kv_cache_groups: groups of one spec,
        # looked up jointly), full attention first; none without prefix caching
        split: list[tuple[Any, list[int]]] = []
        for g, m in enumerate(stms if mgr.enable_caching else ()):
            for spec, gids in split:
                if spec == m.kv_cache_spec:
                    gids.append(g)
                    break
            else:
                split.append((m.kv_cache_spec, [g]))
        split.sort(key=lambda sg: not isinstance(sg[0], FullAttentionSpec))
        # (kind, group ids, span): a window's span is the cached blocks a hit needs, a
        # chunk's the chunk in tokens
        self.attn: list[tuple[int, list[int], int]] = []
        for spec, gids in split:
            kind = _KINDS[type(spec)]
            if kind == _WINDOW:
                span = cdiv(spec.sliding_window - 1, self.bsz[gids[0]])
            elif kind == _MAMBA and self.fine:  # the rightmost cached hash boundary
                span = 0
            elif kind == _MAMBA:  # the rightmost cached block: a window of one block
                kind, span = _WINDOW, 1
            else:
                span = spec.attention_chunk_size if kind == _CHUNK else 0
            self.attn.append((kind, gids, span))
        self.simple = len(self.attn) == 2 and self.attn[0][0] == _FULL
        # the common shape (gpt-oss, Gemma): one full-attention and one window group
        self.simple1 = self.simple and self.num_groups == 2 and len(self.attn[1][1]) == 1
        self.simple1 = self.simple1 and len(self.attn[0][1]) == 1 and not self.mixed
        # EAGLE / MTP (vLLM's drop_eagle_group_ids): the attention groups whose hits drop
        # their last block, and the margin a hybrid coordinator looks past the candidate
        drop: set[int] = set(getattr(coord, "drop_eagle_group_ids", ()))
        self.eagle_idx = {i for i, (_, gids, _) in enumerate(self.attn) if set(gids) & drop}
        self.margin = 0 if len(stms) == 1 else stms[0].block_size
        if self.eagle_idx:
            self.simple1 = False
        self.tables: dict[str, list[list[int]]] = {}  # request id -> table per group
        # request id -> per group, how many leading table entries are null (vLLM's tables
        # of a window: nulls, then blocks; nulls come from hits and remove_skipped only)
        self.nulls: dict[str, list[int]] = {}
        # request id -> cached blocks per group (vLLM's num_cached_block: present while the
        # request has been cached or adopted hits)
        self.ncached: dict[str, list[int]] = {}

    def skipped(self, g: int, num_computed_tokens: int) -> int:
        """vLLM's get_num_skipped_tokens of group g: tokens before the window, or before
        the chunk holding the next token."""
        if self.mamba[g]:  # only the last token's state is kept
            return num_computed_tokens - 1 if num_computed_tokens > 1 else 0
        w = self.window[g]
        if not w:
            c = self.chunk[g]
            return num_computed_tokens // c * c if c else 0
        n = num_computed_tokens - w + 1 - self.extra[g]
        return n if n > 0 else 0

    # -- lookups ------------------------------------------------------------------------------
    def _gkeys(self, keys: np.ndarray, g: int, s: int, e: int) -> np.ndarray:
        k = keys[s:e]
        if g == 0:
            return k
        k = k.copy()
        k[:, 1] ^= self.salt[g]
        return k

    def run(
        self,
        g: int,
        hashes: Sequence[bytes],
        keys: np.ndarray,
        tails: Optional[np.ndarray],
        s: int,
        e: int,
    ) -> np.ndarray:
        """Ids of group g's longest run of cached blocks for hashes[s:e] (vLLM's
        ``get_cached_block`` per block: the earliest block under each hash, duplicates kept
        natively)."""
        if s >= e:
            return _EMPTY_I32
        kg = None if keys is None else self._gkeys(keys, g, s, e)
        return self._cached_from(g, hashes, kg, tails, s, e, s)

    def _cached_from(
        self,
        g: int,
        hashes: Sequence[bytes],
        kg: Optional[np.ndarray],
        tails: Optional[np.ndarray],
        s: int,
        e: int,
        pos: int,
    ) -> np.ndarray:
        """Group g's run of cached blocks for hashes[pos:e] (the earliest block under each
        hash); kg: the group's keys of hashes[s:e], or None for 32-byte hashes in a list,
        whose keys, salt and check are made natively."""
        if kg is None:
            salt = self.salt_int[g]
            return self.pool.lookup_bytes(
                cast(list, hashes), e, start=pos, full=self.full, group=g, key_salt=salt
            )
        hit = self.pool.lookup(kg[pos - s :], group=g)
        k = len(hit)
        if k and tails is not None:  # the other half of each hit's hash (0 once evicted)
            ok = (self.full[hit, 2:] == tails[pos : pos + k]).all(axis=1)
            if not ok.all():
                k = int(np.argmin(ok))
        elif k:
            hash_of, sec = self.hash_of, self.sec
            for i, b in enumerate(hit.tolist()):
                h = hashes[pos + i]
                if hash_of.get(b) != h and not (sec and h in sec.get(b, ())):  # (its other
                    k = i  # keys: a partial prompt tail's)
                    break
        return hit[:k]

    def lookup_one(self, h: bytes, g: int) -> Optional[int]:
        if not 0 <= g < self.num_groups or not self.enable_caching:
            return None
        hk = self.hash_keys([h], 1)
        hit = self.run(g, hk[0], hk[1], hk[2], 0, 1)
        return int(hit[0]) if len(hit) else None

    @staticmethod
    def is32(hashes: Sequence[bytes], n: int) -> bool:
        """Whether hashes[:n] can take the native bytes path (a list of 32-byte hashes;
        mixed widths past the first raise InvalidArgumentError there)."""
        return type(hashes) is list and n > 0 and len(hashes[0]) == 32

    def hash_keys(self, hashes: Sequence[bytes], n: int, request: Any = None) -> tuple:
        """(hashes, keys, tails) for ``run``: keys None for the native bytes path."""
        if self.is32(hashes, n):
            return hashes, None, None
        if request is not None:
            return (hashes, *self.request_keys(request, n))
        return (hashes, *self.to_keys_tails(list(hashes[:n])))

    def _full_hit(self, gids: list[int], hk: tuple, m: int) -> tuple[list, int]:
        runs = [self.run(g, hk[0], hk[1], hk[2], 0, m) for g in gids]
        k = min(len(r) for r in runs)
        return [r[:k].tolist() for r in runs], k

    def _window_hit(self, gids: list[int], need: int, hk: tuple, m: int) -> tuple[list, int]:
        """vLLM's SlidingWindowManager.find_longest_cache_hit: the rightmost run of
        ``need`` blocks cached in every group of gids ending at or before block m, the
        blocks before it null; else the cached run from block 0 (shorter than need)."""
        e = m
        while e >= need:
            s = e - need
            runs = [self.run(g, hk[0], hk[1], hk[2], s, e) for g in gids]
            k = min(len(r) for r in runs)
            if k == need:
                return [[0] * s + r.tolist() for r in runs], e
            e = s + k  # block s + k misses: every window ending past it does too
        runs = [self.run(g, hk[0], hk[1], hk[2], 0, e) for g in gids]
        k = min(len(r) for r in runs)
        return [r[:k].tolist() for r in runs], k

    def _chunk_hit(self, gids: list[int], chunk: int, hk: tuple, curr: int) -> tuple[list, int]:
        """vLLM's ChunkedLocalAttentionManager.find_longest_cache_hit for a hit of at most
        curr tokens: the blocks before the chunk holding token curr are null (a hit without
        any cached block when curr starts a chunk), then the run cached in every group of
        gids from the chunk's first block."""
        bs = self.block_size
        lo = curr // chunk * chunk // bs if curr > 0 else 0
        m = min(curr // bs, len(hk[0]))
        k = 0
        runs: list = [_EMPTY_I32] * len(gids)
        if lo < m:
            runs = [self.run(g, hk[0], hk[1], hk[2], lo, m) for g in gids]
            k = min(len(r) for r in runs)
        return [[0] * lo + r[:k].tolist() for r in runs], lo + k

    def _kind_hit(
        self, kind: int, gids: list[int], span: int, hk: tuple, m: int, length: int
    ) -> tuple[list, int]:
        """The hit of one attention kind's groups: at most m blocks (a chunk group: of at most
        ``length`` tokens, its rule reads the token count)."""
        if kind == _FULL:
            return self._full_hit(gids, hk, m)
        if kind == _WINDOW:
            return self._window_hit(gids, span, hk, m)
        return self._chunk_hit(gids, span, hk, length)

    def gview(self, hk: tuple, g: int) -> tuple:
        """hk (hash_keys) at group g's block size: vLLM's BlockHashListWithBlockSize keeps
        the hash ending each block (every scale-th one: it chains over the whole prefix)."""
        k = self.scale[g]
        if k == 1:
            return hk
        hashes, keys, tails = hk
        return (
            hashes[k - 1 :: k],
            None if keys is None else keys[k - 1 :: k],
            None if tails is None else tails[k - 1 :: k],
        )

    def _mixed_hit(
        self, kind: int, gids: list[int], span: int, hk: tuple, curr: int
    ) -> tuple[list, int]:
        """The hit of one attention kind's groups among groups of different block sizes
        (hits aligned to the scheduler block size, the sizes' lcm): per group ids, tokens.
        Full attention: the cached run from block 0, rounded down to the alignment. A window
        (vLLM's right-to-left scan, which only starts a run at a block ending on the
        alignment): the rightmost aligned end e with the span [e - span, e) cached in every
        group, nulls before it; else the run from block 0, rounded down."""
        g0 = gids[0]
        bs = self.bsz[g0]
        if kind == _MAMBA:
            return self._fine_mamba_hit(gids, hk, curr)
        a = self.sbs // bs  # blocks per alignment unit
        v = self.gview(hk, g0)
        m = min(curr // bs, len(v[0]))
        if kind == _WINDOW:
            e = m - m % a
            while e >= span and e > 0:
                s0 = e - span
                runs = [self.run(g, v[0], v[1], v[2], s0, e) for g in gids]
                k = min(len(r) for r in runs)
                if k == span:
                    return [[0] * s0 + r.tolist() for r in runs], e * bs
                miss = s0 + k  # every window holding this block misses
                e = miss - miss % a
        runs = [self.run(g, v[0], v[1], v[2], 0, m) for g in gids]
        k = min(len(r) for r in runs)
        if self.fine:  # hits on hash boundaries: the first non-full block's interior too
            out = [r[:k].tolist() for r in runs]
            sc = self.scale[g0]
            if sc > 1:
                lo = k * sc
                hi = min(lo + sc - 1, curr // self.hbs, len(hk[0]))
                for fi in range(hi - 1, lo - 1, -1):
                    tail = self._probe(gids, hk, fi)
                    if tail is not None:
                        for o, b in zip(out, tail):
                            o.append(b)
                        return out, (fi + 1) * self.hbs
            return out, k * bs
        k -= k % a
        return [r[:k].tolist() for r in runs], k * bs

    def _probe(self, gids: list[int], hk: tuple, fi: int) -> Optional[list]:
        """The block each group of gids caches under hash fi (vLLM's get_cached_block:
        None unless every group has one)."""
        out = []
        for g in gids:
            r = self.run(g, hk[0], hk[1], hk[2], fi, fi + 1)
            if not len(r):
                return None
            out.append(int(r[0]))
        return out

    def _fine_mamba_hit(self, gids: list[int], hk: tuple, curr: int) -> tuple[list, int]:
        """vLLM's MambaManager.find_longest_cache_hit under partial hash hits: the rightmost
        hash boundary of at most curr tokens whose key any block of each group holds (a
        full block's or a partial tail's), that block after nulls up to its index."""
        hbs = self.hbs
        sc = self.scale[gids[0]]
        for fi in range(min(curr // hbs, len(hk[0])) - 1, -1, -1):
            tail = self._probe(gids, hk, fi)
            if tail is not None:
                i = fi // sc
                return [[0] * i + [b] for b in tail], (fi + 1) * hbs
        return [[] for _ in gids], 0

    def _eagle_hit(
        self, kind: int, gids: list[int], span: int, hk: tuple, curr: int, margin: int
    ) -> tuple[list, int]:
        """The hit of an EAGLE / MTP group (vLLM's drop_eagle_block): looked up ``margin``
        tokens past the candidate (a block; none under the unitary coordinator), a window
        needing one block more, and the last block dropped; per group ids, tokens."""
        bs = self.block_size
        n = len(hk[0])
        mx = min(curr + margin, n * bs) if margin else curr
        m = min(mx // bs, n)
        if kind == _WINDOW:
            blocks, k = self._window_hit(gids, span + 1, hk, m)
        else:
            blocks, k = self._full_hit(gids, hk, m)
        if k:
            for b in blocks:
                b.pop()
            k -= 1
        return blocks, k * bs

    def find(self, hk: tuple, max_length: int) -> tuple:
        """vLLM's HybridKVCacheCoordinator.find_longest_cache_hit over hk (hash_keys):
        per-group ids (lists or int32 arrays, 0 = null), the hit length, the uncached common
        prefix tokens, and per group how many leading ids are null (None: not counted)."""
        if hk[1] is None:
            try:
                if self.simple1:
                    return self._find_simple(hk[0], max_length)
                return (*self._find(hk, max_length), None)
            except kvblocks.InvalidArgumentError:  # mixed widths: the numpy path
                hashes = hk[0]
                hk = (hashes, *self.to_keys_tails(list(hashes)))
        return (*self._find(hk, max_length), None)

    def _find_simple(self, hashes: list, max_length: int) -> tuple:
        """``_find`` of one full-attention group and one window or chunk group, 32-byte
        hashes (duplicates natively): native lookups only (vLLM's simple hybrid: one pass)."""
        bs = self.block_size
        _, (gf,), _ = self.attn[0]
        kind, (gw,), need = self.attn[1]
        lookup, full = self.pool.lookup_bytes, self.full
        m = min(max_length // bs, len(hashes))
        hf = lookup(hashes, m, full=full, group=gf, key_salt=self.salt_int[gf])
        e = kf = len(hf)
        sw_salt = self.salt_int[gw]
        nulls = [0, 0]
        if kind == _CHUNK:  # need: the chunk; null up to the chunk holding token e * bs
            lo = e * bs // need * need // bs
            hw = (
                lookup(hashes, e, start=lo, full=full, group=gw, key_salt=sw_salt)
                if lo < e
                else _EMPTY_I32
            )
            e = lo + len(hw)
            if lo:
                hw = np.concatenate((np.zeros(lo, dtype=np.int32), hw))
                nulls[gw] = lo
            out: list = [None, None]
            out[gf] = hf[:e] if e < kf else hf
            out[gw] = hw
            return out, e * bs, (kf - e) * bs, nulls
        while e >= need:
            s0 = e - need
            r = lookup(hashes, e, start=s0, full=full, group=gw, key_salt=sw_salt)
            k = len(r)
            if k == need:
                hw = np.concatenate((np.zeros(s0, dtype=np.int32), r)) if s0 else r
                nulls[gw] = s0
                break
            e = s0 + k
        else:
            hw = lookup(hashes, e, full=full, group=gw, key_salt=sw_salt)
            e = len(hw)
        out = [None, None]
        out[gf] = hf[:e] if e < kf else hf
        out[gw] = hw
        return out, e * bs, (kf - e) * bs, nulls

    def find_per_group(self, hk: tuple, max_length: int) -> tuple[list, list]:
        """vLLM's find_longest_cache_hit_per_group: each attention group's own longest hit
        of at most max_length tokens (no fixed point); (ids per group, tokens per group)."""
        bs = self.block_size
        blocks: list = [[] for _ in range(self.num_groups)]
        hits = [0] * self.num_groups
        m = min(max_length // bs, len(hk[0]))
        for idx, (kind, gids, span) in enumerate(self.attn):
            if self.mixed:
                got, t = self._mixed_hit(kind, gids, span, hk, max_length)
            elif idx in self.eagle_idx:
                got, t = self._eagle_hit(kind, gids, span, hk, max_length, bs)
            else:
                got, k = self._kind_hit(kind, gids, span, hk, m, max_length)
                t = k * bs
            for g, b in zip(gids, got):
                blocks[g] = b
                hits[g] = t
        return blocks, hits

    def _find(self, hk: tuple, max_length: int) -> tuple[list, int, int]:
        bs = self.block_size
        hashes = hk[0]
        hit_length = max_length
        longest = 0
        by_group: list[Optional[list]] = [None] * self.num_groups
        len_by = [0] * self.num_groups
        eagle = self.eagle_idx
        verified: set[int] = set()  # (vLLM's eagle_verified: each EAGLE group drops once
        while True:  # per candidate length)
            curr = hit_length
            for idx, (kind, gids, span) in enumerate(self.attn):
                g0 = gids[0]
                if kind == _FULL and by_group[g0] is not None:
                    curr = min(curr, len_by[g0])
                    continue
                if self.mixed:
                    blocks, curr = self._mixed_hit(kind, gids, span, hk, curr)
                elif idx in eagle and idx not in verified:
                    blocks, curr = self._eagle_hit(kind, gids, span, hk, curr, self.margin)
                    verified.add(idx)
                else:
                    m = min(curr // bs, len(hashes))
                    blocks, k = self._kind_hit(kind, gids, span, hk, m, curr)
                    if k * bs < curr:
                        verified.clear()
                    curr = k * bs
                for g, b in zip(gids, blocks):
                    by_group[g] = b
                    len_by[g] = curr
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self.simple:
                break
        for kind, gids, _ in self.attn:
            if kind == _FULL:
                nb = cdiv(hit_length, self.bsz[gids[0]])
                for g in gids:
                    b = by_group[g]
                    if b is not None:
                        del b[nb:]
        return [b if b is not None else [] for b in by_group], hit_length, longest - hit_length

    # -- caching ------------------------------------------------------------------------------
    def cache_groups(self, request: Any, num_tokens: int) -> None:
        """vLLM's coordinator cache_blocks: each group's newly full blocks (null blocks
        skipped) under the request's hashes, one BlockStored per group that caches."""
        if self.mixed:
            self._cache_mixed(request, num_tokens)
            return
        rid = request.request_id
        bs = self.block_size
        hashes = request.block_hashes
        num_full = min(num_tokens // bs * bs, len(hashes) * bs) // bs
        nc = self.ncached.get(rid)
        align = self.align
        if nc is not None and min(nc) >= num_full:
            if align is None:
                return
            n = num_tokens // bs * bs if self.round_cache else num_tokens
            if align.idle(request, n):  # no block to cache, no checkpoint, no prompt tail
                return
        if num_full <= 0:
            return
        tables = self.tables[rid]
        if nc is None:
            nc = self.ncached[rid] = [0] * self.num_groups
        for g in range(self.num_groups):
            c = nc[g]
            if c < num_full:
                ids_l = tables[g][c:num_full]
                if align is not None and self.retention is not None and self.is_align[g]:
                    mask = align.mask(request, g, c, num_full)  # sparse retention
                    if mask is not None:
                        ids_l = [b if keep else 0 for b, keep in zip(ids_l, mask)]
                self.cache_ids(request, g, ids_l, c, num_full)
                nc[g] = num_full
            if align is not None and self.is_align[g]:
                n = num_tokens // bs * bs if self.round_cache else num_tokens
                align.after_cache(request, g, n, c, nc[g])

    def cache_ids(self, request: Any, g: int, ids_l: list, c: int, num_full: int) -> None:
        """vLLM's BlockPool.cache_full_blocks: blocks ids_l (0: null, skipped) of group g
        under the request's hashes [c, num_full) (at the group's block size), and its
        BlockStored; a key another block holds caches the block too, behind it (duplicates
        natively)."""
        hashes = request.block_hashes
        k = self.scale[g]
        if k > 1:  # the hash ending each of the group's blocks
            hashes = hashes[k - 1 : num_full * k : k]
        if not (self.is32(hashes, num_full) and self._cache32(g, ids_l, hashes, c)):
            keys, tails = self.request_keys(request, num_full * k)
            if k > 1:
                keys = keys[k - 1 :: k]
                tails = None if tails is None else tails[k - 1 :: k]
            self._cache_run(g, ids_l, hashes, keys, tails, c)
        if self.ntok is not None:  # every entry's token count, among block sizes
            n = len(ids_l)
            ids = np.array(ids_l, dtype=np.int32)
            tok = np.arange(c + 1, c + 1 + n, dtype=np.int32) * self.bsz[g]
            if 0 in ids_l:
                live = ids != 0
                ids, tok = ids[live], tok[live]
            self.ntok[ids] = tok
        elif self.is_align[g] and ids_l.count(0) < len(ids_l):
            bs = self.bsz[g]  # the tokens each entry covers (Mamba's rules read them)
            ht = self.hash_tokens
            for j, b in enumerate(ids_l, c + 1):
                if b:
                    ht[b] = (g, j * bs)
        if self.enable_events:
            self.events.append(self._stored(request, c, num_full, g, ids_l, self.bsz[g], hashes))

    # -- groups of different block sizes: caching ---------------------------------------------
    def _cache_mixed(self, request: Any, num_tokens: int) -> None:
        """vLLM's coordinator cache_blocks among groups of different block sizes: the
        tokens rounded down to the scheduler block size, each group's newly full blocks
        (a window group's masked by vLLM's reachable_block_mask: only the tail a hit at an
        aligned boundary reads), a full-attention group's partial prompt tail."""
        rid = request.request_id
        fine = self.fine
        # (vLLM's get_num_cacheable_tokens: not rounded under partial hash hits)
        n = num_tokens if fine else num_tokens - num_tokens % self.sbs
        nh = min(n, len(request.block_hashes) * self.hbs)
        tables = self.tables.get(rid)
        if tables is None:
            return
        nc = self.ncached.get(rid)
        if nc is None:
            if fine:  # (a partial tail alone may make the request one vLLM tracks)
                self._cache_fine_new(request, n, nh, tables)
                return
            if nh < min(self.bsz):
                return
            nc = self.ncached[rid] = [0] * self.num_groups
        bsz = self.bsz
        align = self.align
        for g in range(self.num_groups):
            num_full = nh // bsz[g]
            c = nc[g]
            if c < num_full:
                ids_l = tables[g][c:num_full]
                if self.window[g]:
                    mask = self.stm_cls[g].reachable_block_mask(
                        start_block=c,
                        end_block=num_full,
                        alignment_tokens=self.sbs,
                        kv_cache_spec=self.specs[g],
                        use_eagle=False,
                        retention_interval=None,
                        reachable_boundaries=(),
                    )
                    if mask is not None:
                        ids_l = [b if keep else 0 for b, keep in zip(ids_l, mask)]
                if self.partial[g] or fine:  # a partial tail's block fills: its entries
                    for b in ids_l:  # go first
                        if b and self.hashed[b]:
                            self.drop_entries(b)
                self.cache_ids(request, g, ids_l, c, num_full)
                nc[g] = num_full
            if self.partial[g]:
                self._cache_partial_tail(request, g, n)
            elif fine and self.is_align[g]:
                cast(MambaAlign, align).fine_after_cache(request, g, n, c, nc)

    def _cache_fine_new(self, request: Any, n: int, nh: int, tables: list) -> None:
        """``_cache_mixed`` of a request no group tracks yet, under partial hash hits: the
        counts made only if some group caches a block or a Mamba partial tail (vLLM's
        num_cached_block then holds the request)."""
        rid = request.request_id
        nc = [0] * self.num_groups
        self.ncached[rid] = nc
        if nh >= min(self.bsz):
            self._cache_mixed(request, n)
            return
        for g in range(self.num_groups):  # (no full block: the partial tails alone)
            if self.partial[g]:
                self._cache_partial_tail(request, g, n)
            elif self.is_align[g]:
                cast(MambaAlign, self.align).fine_after_cache(request, g, n, 0, nc)
        if not any(rid in ph for ph in self.phit):
            del self.ncached[rid]

    def _cache_partial_tail(self, request: Any, g: int, num_tokens: int) -> None:
        """vLLM's FullAttentionManager._cache_partial_tail_block and
        BlockPool.cache_partial_block: the prompt's last hash boundary inside a block keys
        that block too (its first key, or an extra one when it has a key already)."""
        hbs = self.hbs
        hashes = request.block_hashes
        boundary = min((request.num_prompt_tokens - 1) // hbs, len(hashes)) * hbs
        bs = self.bsz[g]
        if boundary == 0 or boundary > num_tokens or boundary % bs == 0:
            return
        t = self.tables[request.request_id][g]
        idx = boundary // bs
        if idx >= len(t) or not t[idx]:
            return
        self.cache_partial(request, g, t[idx], boundary)

    def cache_partial(self, request: Any, g: int, b: int, boundary: int) -> bytes:
        """vLLM's BlockPool.cache_partial_block (existing entries kept): block b of group
        g keyed by the request's hash ending at token ``boundary`` (a hash-block
        boundary), its first key when it has none (the entry's token count is the
        boundary), else an extra key, after a shorter prefix's entries give way; a
        BlockStored of one hash block unless the block had that key. Returns the hash."""
        hbs = self.hbs
        hashes = request.block_hashes
        nhb = boundary // hbs
        h = hashes[nhb - 1]
        if self.hashed[b] and int(self.gid[b]) == g:
            if self.hash_of.get(b) == h or h in self.sec.get(b, ()):
                return h  # (vLLM: already cached, no event)
            if cast(np.ndarray, self.ntok)[b] < boundary:
                self.drop_entries(b)  # a shorter prefix's entries give way
        if self.hashed[b]:
            self._add_key(b, h, g)
        else:
            self._cache_run_or_bytes(g, b, h)
            cast(np.ndarray, self.ntok)[b] = boundary
        if self.enable_events:
            lora = request.lora_request
            start = (nhb - 1) * hbs
            la = self.lookahead
            if la:
                extra, _ = generate_lookahead_block_hash_extra_keys(
                    request, start, boundary, boundary + la, 0
                )
            else:
                extra, _ = generate_block_hash_extra_keys(request, start, boundary, 0)
            self.events.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h)],
                    parent_block_hash=(
                        maybe_convert_block_hash(hashes[nhb - 2]) if nhb > 1 else None
                    ),
                    token_ids=request.all_token_ids[start:boundary],
                    block_size=boundary - start,
                    lora_id=lora.adapter_id if lora else None,
                    medium=self.medium,
                    lora_name=lora.name if lora else None,
                    extra_keys=to_event_extra_keys([extra]),
                    group_idx=g,
                    session_id=request.session_id,
                    lookahead_token_ids=(
                        [request.all_token_ids[boundary : boundary + la]] if la else None
                    ),
                )
            )
        return h

    def _cache_run_or_bytes(self, g: int, b: int, h: bytes) -> None:
        """Block b (without an entry) cached under h in group g, as any block."""
        if not (len(h) == 32 and self._cache32(g, [b], [h], 0)):
            k, t = self.to_keys_tails([h])
            self._cache_run(g, [b], [h], k, t, 0)

    def _add_key(self, b: int, h: bytes, g: int) -> None:
        """One more key of block b (natively: BlockPool.add_key_bytes / add_key)."""
        if len(h) == 32:
            self.pool.add_key_bytes(b, h, group=g, key_salt=self.salt_int[g])
        else:
            key = self.to_keys([h])[0].copy()
            key[1] ^= self.salt[g]
            self.pool.add_key(b, key)
        self.sec.setdefault(b, []).append(h)

    def drop_entries(self, b: int) -> None:
        """Every key of block b leaves the cache (vLLM's _remove_cached_block_hashes: the
        first key, then the others; a BlockRemoved each), natively in one uncache."""
        self._forget(b)
        self.pool.uncache([b])
        self.hashed[b] = False

    def _cache32(self, g: int, ids_l: list, hashes: list, c: int) -> bool:
        """``_cache_run`` in one native call (cache_bytes) when it can: 32-byte hashes,
        the blocks after the leading nulls all real."""
        n = len(ids_l)
        j = ids_l.count(0)  # nulls lead a table (a window's, a Mamba group's gaps)
        if j == n:
            return True
        if j and ids_l[:j].count(0) != j:  # not all leading: count them
            j = 0
            while j < n and ids_l[j] == 0:
                j += 1
        ids = ids_l[j:] if j else ids_l
        if 0 in ids:
            return False
        try:
            self.pool.cache_bytes(
                ids,
                hashes,
                c + j,
                full=self.full,
                mark=self.hashed,
                group=g,
                key_salt=self.salt_int[g],
                dup=True,
            )
        except kvblocks.InvalidArgumentError:  # mixed widths: the numpy path
            return False
        self.gid[ids] = g
        return True

    def _cache_run(
        self,
        g: int,
        ids_l: list,
        hashes: Sequence[bytes],
        keys: np.ndarray,
        tails: Optional[np.ndarray],
        c: int,
    ) -> None:
        ids = np.array(ids_l, dtype=np.int32)
        pos = np.arange(c, c + len(ids))
        live = ids != 0
        if not live.all():
            ids, pos = ids[live], pos[live]
        if not len(ids):
            return
        raw = keys[pos]
        if tails is not None:
            self.full[ids, :2] = raw
            self.full[ids, 2:] = tails[pos]
        kg = raw
        if g:
            kg[:, 1] ^= self.salt[g]  # (raw is a copy: fancy indexing)
        self.pool.cache(ids, kg, group=g, dup=True)  # duplicates behind earlier blocks
        self.hashed[ids] = True
        self.gid[ids] = g
        if tails is None:
            self.hash_of.update(zip(ids.tolist(), (hashes[i] for i in pos.tolist())))

    # -- freeing ------------------------------------------------------------------------------
    def remove_skipped(self, rid: str, processed: int) -> None:
        """vLLM's remove_skipped_blocks: each sliding-window group's blocks before the
        window are freed (one free_blocks per group, last first) and become null."""
        tables = self.tables.get(rid)
        if tables is None:
            return
        nulls = self.nulls[rid]
        for g in self.sw_groups:
            t = tables[g]
            if self.is_align[g]:
                cast(MambaAlign, self.align).remove_skipped(g, rid, t, processed)
                continue
            n = self.skipped(g, processed) // self.bsz[g]
            if n > len(t):
                n = len(t)
            nn = nulls[g]
            if n <= nn:
                continue
            # blocks nn..n-1 leave, last first: a table is [nulls | cached | uncached], so
            # vLLM's free_blocks puts t[c:n] (uncached) at the free list's head and
            # t[nn:c] (cached) at its tail, last first; one native free in that order
            if self.uncached_held or self.mixed:  # a hole in the cached part (evict_blocks,
                self.free_in_order(t[nn:n][::-1])  # a window's tail-only caching)
            else:
                c = self._cached_end(rid, g)
                self.pool.free(t[max(c, nn) : n] + t[nn : min(c, n)][::-1])
            t[nn:n] = [0] * (n - nn)
            nulls[g] = n

    def _cached_end(self, rid: str, g: int) -> int:
        """The table position past the request's cached blocks in group g."""
        nc = self.ncached.get(rid)
        return nc[g] if nc is not None and self.enable_caching else 0

    def free_request(self, rid: str) -> None:
        """vLLM's coordinator free: group by group, each table without its null head
        freed last block first (uncached blocks to the free list's head, cached ones to its
        tail), in one native call."""
        tables = self.tables.pop(rid, None)
        nulls = self.nulls.pop(rid, None)
        nc = self.ncached.pop(rid, None)
        self.keys.pop(rid, None)
        if self.align is not None:
            self.align.forget(rid)
        if self.fine:
            for ph in self.phit:
                ph.pop(rid, None)
        if not tables or nulls is None:
            return
        if self.uncached_held or self.mixed:  # a hole in a cached part (evict_blocks, a
            # window's tail-only caching among block sizes): group by group
            for t, nn in zip(tables, nulls):
                self.free_in_order([b for b in t[nn:][::-1] if b])
            return
        if nc is None or not self.enable_caching:
            nc = nulls
        order: list[int] = []
        is_align = self.is_align
        for g, (t, nn, c) in enumerate(zip(tables, nulls, nc)):
            if is_align[g]:  # null gaps: each block by its entry (a handful of blocks)
                live = [b for b in t[::-1] if b]
                cached = self.pool.is_cached
                order += [b for b in live[::-1] if not cached(b)]
                order += [b for b in live if cached(b)]
                continue
            if c > nn:  # t[c:] to the head (forward: each pushed there), t[c-1..nn] to the tail
                order += t[c:] + t[c - 1 : nn - 1 : -1] if nn else t[c:] + t[c - 1 :: -1]
            elif nn < len(t):
                order += t[nn:]
        if order:
            self.pool.free(order)

    def pop(self, rid: str) -> list[int]:
        """Drop the request's tables; its blocks without the null heads, group by group."""
        tables = self.tables.pop(rid, None) or []
        nulls = self.nulls.pop(rid, None)
        self.ncached.pop(rid, None)
        self.keys.pop(rid, None)
        if self.align is not None:
            self.align.forget(rid)
        if self.fine:
            for ph in self.phit:
                ph.pop(rid, None)
        out: list[int] = []
        for g, t in enumerate(tables):
            if self.is_align[g]:  # the null head only: vLLM keeps the gaps
                i = 0
                while i < len(t) and not t[i]:
                    i += 1
                out.extend(t[i:])
                continue
            out.extend(t[nulls[g] :] if nulls else t)
        return out
