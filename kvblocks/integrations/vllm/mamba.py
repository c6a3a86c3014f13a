"""vLLM 0.34's rules for Mamba / linear-attention state groups (``MambaSpec``), over the
native pool of kvblocks' hybrid adapter (hybrid_state.py, hybrid.py).

A Mamba group keeps per request one state block, not one block per token block. With
prefix caching vLLM runs it in "align" mode (``mamba_cache_mode="align"``), and its
``MambaManager`` then keeps a block table indexed by token block whose entries are mostly
null:

- allocation: a step that needs ``r = cdiv(num_tokens_main_model, block_size) + spec``
  entries pads the table with nulls up to ``r - spec - 1`` and puts the running state in
  the block after (``spec`` more for speculative decoding). A request that had blocks
  before keeps its last ``spec`` blocks (scratch, uncached, owned alone) by moving them to
  the table's end and leaving nulls in their place; the step returns the table's new
  entries, nulls and moved blocks included. Lookahead tokens get no slots. The count a
  step asks the pool for is ``r - hit - held`` (negative counts too), capped at ``1 +
  spec`` (``1`` for a request that had blocks) when positive, plus the hit's evictable
  blocks;
- skipped blocks: every state block before block ``(processed - 1) // block_size`` is
  freed (null gaps skipped, never past the blocks already retired), then the state block of
  two steps before, once the processed tokens pass it;
- hits: the rightmost cached block ``i`` (``[null] * i + [block]``), in vLLM's fixed
  point like a window of one block; a hit whose last block was cached in the current step
  cannot be admitted until the next step (``new_step_starts``): its count is the pool's
  size + 1;
- caching: the generic newly-full-block caching (nulls skipped), then the prompt's last
  boundary block cached again if it lost its entry, and every block cached in the step
  remembered (for the rule above) and handed to a KV connector as a boundary state
  (``take_boundary_state_offloads``);
- free: the table without its null head, last block first, null gaps skipped.

Prefill checkpoint blocks (``num_prefill_checkpoint_blocks`` with a
``prefill_checkpoint_alignment``): a chunk that ends the prefill (or any chunk, under dense
retention) and can export a state inside itself reserves one block more, at table index
``cdiv(query_end, block_size) - 2``, for the state at ``(query_end - 1) // block_size *
block_size`` tokens (vLLM's ``get_mamba_prefill_checkpoint_position`` and
``is_mamba_prefill_checkpoint_valid``, called as they are). The reservation is decided while
counting (``to_allocate``, not under the admission cap) and read by the allocation, which
leaves that index unpadded; after caching, the checkpoint block keeps its entry when it is
the prompt's checkpoint, a retained boundary or the shared-prefix boundary, and otherwise
loses every entry (a transient state, vLLM's ``_maybe_evict_cached_block``). With the hash
block size equal to the block size the position is block aligned, so the block is keyed at
its own table index (no re-keying inside a block).

Sparse retention (``coordinator.retention_interval``, which vLLM's tests set after the
manager is built): a Mamba group caches only the blocks vLLM's
``MambaManager.reachable_block_mask`` keeps (called as it is), and the checkpoint rule above
reads the interval.

Without prefix caching ("none" mode) a Mamba group is a window of two tokens with ``spec``
blocks more, which hybrid_state.py serves with its window rules. Partial (sub-block) hash
hits (a block longer than a hash block) are served with checkpoint and speculative blocks
too: ``fine_after_cache`` keys the prompt's last hash boundary inside a state block, or a
reserved checkpoint at its hash boundary (``_fine_checkpoint``), ``copy_on_write`` places
the copy of a block a hit or the request's own tail shares.
EAGLE's checkpoint shift is not served: hybrid.py's ``hybrid_unsupported`` sends those
configurations to vLLM's managers.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import numpy as np
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import (
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)


def unsupported(spec: Any, enable_caching: bool) -> Optional[str]:
    """Why a Mamba group runs on vLLM's managers, or None when the adapter serves it."""
    mode = spec.mamba_cache_mode
    if mode not in ("align", "none"):
        return f"Mamba cache mode {mode!r}"
    if mode != "align" and enable_caching:
        return "Mamba prefix caching outside align mode"
    return None


def has_checkpoints(spec: Any) -> bool:
    """Whether an align-mode group reserves prefill checkpoint blocks (vLLM's
    ``MambaManager.has_prefill_checkpoint_blocks``; exported only with an alignment)."""
    return (
        spec.mamba_cache_mode == "align"
        and spec.num_prefill_checkpoint_blocks > 0
        and spec.prefill_checkpoint_alignment is not None
    )


def is_align(spec: Any) -> bool:
    return type(spec) is MambaSpec and spec.mamba_cache_mode == "align"


class MambaAlign:
    """Per-request state of vLLM's MambaManager in align mode, for the groups ``gids`` of
    one hybrid state (``s``: its tables, pool and caching)."""

    def __init__(self, s: Any, gids: list[int], specs: list[Any]) -> None:
        self.s = s
        self.gids = gids
        self.spec = {g: sp.num_speculative_blocks for g, sp in zip(gids, specs)}
        self.specs = dict(zip(gids, specs))
        # per group: the prefill checkpoint alignment, None without checkpoint blocks
        self.ckpt_align = {
            g: sp.prefill_checkpoint_alignment if has_checkpoints(sp) else None
            for g, sp in zip(gids, specs)
        }
        # per group: request id -> (checkpoint position, table index) of this allocation
        self.checkpoints: dict[int, dict[str, tuple[int, int]]] = {g: {} for g in gids}
        # vLLM's coordinator.retention_interval (None: dense; hybrid.py's view sets it)
        self.retention: Optional[int] = None
        # per group: request id -> table entries already retired (remove_skipped's floor)
        self.retired: dict[int, dict[str, int]] = {g: {} for g in gids}
        # per group: request id -> index of the state block of the step before
        self.last_state: dict[int, dict[str, int]] = {g: {} for g in gids}
        # per group: requests that have been through allocate_new_blocks
        self.allocated: dict[int, set[str]] = {g: set() for g in gids}
        # per group: hashes cached in the current step (hits on them wait a step)
        self.this_step: dict[int, set[bytes]] = {g: set() for g in gids}
        # per group: request id -> (block id, boundary tokens) cached since the last take (a
        # request's first entry fixes its place, as in vLLM's one list of them)
        self.offloads: dict[int, dict[str, list[tuple[int, int]]]] = {g: {} for g in gids}
        # per group: request id -> (block, boundary tokens) of the partial prompt tail it
        # registered itself (vLLM's _producer_partial_tail_reqs)
        self.producer: dict[int, dict[str, tuple[int, int]]] = {g: {} for g in gids}
        self.was = False  # (prepare's: the request had been allocated before)

    # -- counting -----------------------------------------------------------------------------
    def deferred(self, g: int, hit: Any) -> bool:
        """Whether the hit's last block was cached in this step (vLLM defers it)."""
        if not len(hit) or not self.this_step[g]:
            return False
        b = int(hit[-1])
        s = self.s
        h = s.hash_of.get(b) if b else None
        return h is not None and int(s.gid[b]) == g and h in self.this_step[g]

    def _checkpoint(
        self, g: int, rid: str, query_start: int, query_end: int, prefill_end: int
    ) -> int:
        """vLLM's checkpoint position of this allocation (get_num_blocks_to_allocate with
        ``_needs_internal_checkpoint``), 0 when the chunk exports none."""
        align = self.ckpt_align[g]
        if align is None or query_end < prefill_end:
            return 0
        s = self.s
        if s.fine:  # (positions on hash boundaries, the table at the group's block size)
            hbs, bs = s.hbs, s.bsz[g]
        else:
            hbs = bs = s.block_size
        # (vLLM's validity needs start + hbs <= pos < end, pos = (end - 1) // hbs * hbs: a
        # decode step or a chunk within one hash block exports nothing; checked first)
        if query_start + hbs >= query_end:
            return 0
        pos = get_mamba_prefill_checkpoint_position(query_end, hbs, False)
        idx = cdiv(query_end, bs) - 2
        if idx < 0:
            return 0
        if not is_mamba_prefill_checkpoint_valid(
            query_start=query_start,
            query_end=query_end,
            checkpoint_position=pos,
            hash_block_size=hbs,
            mamba_block_size=bs,
            checkpoint_alignment=align,
        ):
            return 0
        t = s.tables.get(rid)
        t = t[g] if t is not None else []
        if (
            idx >= len(t)
            or not t[idx]
            or (rid in self.allocated[g] and idx >= len(t) - self.spec[g])
        ):
            return pos
        return 0

    def to_allocate(
        self,
        g: int,
        rid: str,
        num_tokens_main: int,
        hit: Any,
        have: int,
        query_start: int = 0,
        prefill_end: int = 0,
        record: bool = True,
        num_local: int = -1,
    ) -> int:
        """vLLM's MambaManager.get_num_blocks_to_allocate in align mode: may be negative.
        ``record`` (not under the admission cap): the checkpoint decided here is the one
        the allocation reserves. A hit ending inside a block (``num_local`` tokens, under
        partial hash hits) or a partial tail to copy asks one block more."""
        s = self.s
        if self.deferred(g, hit):
            return s.num_blocks + 1
        spec = self.spec[g]
        bs = s.bsz[g]
        n = -(-num_tokens_main // bs) + spec - len(hit) - have  # (cdiv)
        part = 0
        if s.fine:
            if num_local < 0:
                num_local = query_start
            part = int((len(hit) > 0 and num_local % bs != 0) or rid in s.phit[g])
            if part:
                n = (n if n > 0 else 0) + 1
        cb = 0
        if self.ckpt_align[g] is not None:
            if self.retention != 0:
                prefill_end = 0
            pos = self._checkpoint(g, rid, query_start, num_tokens_main, prefill_end)
            cb = int(pos > 0)
            if record:
                if pos:
                    self.checkpoints[g][rid] = (pos, cdiv(num_tokens_main, bs) - 2)
                else:
                    self.checkpoints[g].pop(rid, None)
        if n > 0:
            cap = (1 if rid in self.allocated[g] else 1 + spec) + cb + part
            if n > cap:
                n = cap
        if len(hit):  # the hit's evictable blocks (a hit is nulls and one block)
            refs = s.refs
            for b in filter(None, hit.tolist() if isinstance(hit, np.ndarray) else hit):
                if refs[b] == 0:
                    n += 1
        return n

    # -- allocation ---------------------------------------------------------------------------
    def prepare(self, g: int, rid: str, t: list[int], num_tokens_main: int) -> tuple[int, list]:
        """vLLM's allocate_new_blocks up to popping: pads t with nulls, moves the
        speculative blocks; returns (blocks to pop, the entries this step returns before
        the new blocks). Under partial hash hits a pending copy (``s.phit``) counts one
        block more, the first popped (``copy_on_write`` places it; ``self.was`` says
        whether the request had been allocated before this call)."""
        spec = self.spec[g]
        required = -(-num_tokens_main // self.s.bsz[g]) + spec  # (cdiv)
        allocated = self.allocated[g]
        cb = int(rid in self.checkpoints[g])  # the checkpoint's index stays unpadded
        ph = self.s.fine and rid in self.s.phit[g]
        self.was = rid in allocated
        if required <= len(t) and not cb and not ph:
            allocated.add(rid)
            return 0, []
        prev = len(t)
        was = rid in allocated
        if was:
            self.last_state[g][rid] = prev - 1 - spec
        elif prev > 0:
            self.last_state[g][rid] = prev - 1
        nsb = required - spec - 1
        if prev < nsb - cb:
            t.extend([0] * (nsb - cb - prev))
        if was:
            for i in range(prev - spec, prev):
                if i >= nsb - cb:
                    break
                t.append(t[i])  # a scratch block moves to the end, a null stays
                t[i] = 0
        allocated.add(rid)
        n = required - len(t)
        return (n if n > 0 else 0) + int(ph), t[prev:]

    def copy_on_write(self, g: int, rid: str, t: list[int], cow: int, was: bool) -> bool:
        """vLLM's allocate_new_blocks with a partial hit (``s.phit``): the copy ``cow`` (the
        first block popped) replaces a new request's shared hit block in its table; a
        running request that registered its own partial tail keeps writing its block, so
        the entries move to the copy instead (and hits on them wait a step). Both ends of
        the copy hold a reference more until the scheduler frees them. Returns whether
        the copy leads the entries this step returns."""
        s = self.s
        idx, src = s.phit[g].pop(rid)
        s.cow[g].append((src, cow))
        if not was:
            t[idx] = cow
            s.pool.incref([cow])
            return True
        s.move(src, cow)
        s.pool.incref([src])
        tail = self.producer[g].pop(rid, None)
        if tail is not None:  # the producer's boundary state, once the copy has run
            self.offloads[g].setdefault(rid, []).append((cow, tail[1]))
        h = s.hash_of.get(cow)
        if h is not None:
            self.this_step[g].add(h)
        return False

    # -- freeing ------------------------------------------------------------------------------
    def remove_skipped(self, g: int, rid: str, t: list[int], processed: int) -> None:
        """vLLM's MambaManager.remove_skipped_blocks in align mode."""
        s = self.s
        bs = s.bsz[g]
        if processed - 1 > 0:
            last = min((processed - 1) // bs, len(t))
            first = self.retired[g].get(rid, 0)
            if first < last:
                seg = t[first:last]  # mostly nulls: slices and filters run in C
                if seg.count(0) < len(seg):
                    t[first:last] = [0] * (last - first)
                    s.free_in_order(list(filter(None, reversed(seg))))
                self.retired[g][rid] = last
        j = self.last_state[g].get(rid)
        if j is not None and j < -(-processed // bs) - 1 and t[j]:  # (cdiv)
            s.free_in_order([t[j]])
            t[j] = 0

    def forget(self, rid: str) -> None:
        """pop_blocks_for_free's bookkeeping: the request leaves every Mamba group."""
        for g in self.gids:
            self.allocated[g].discard(rid)
            self.last_state[g].pop(rid, None)
            self.retired[g].pop(rid, None)
            self.checkpoints[g].pop(rid, None)
            self.offloads[g].pop(rid, None)
            self.producer[g].pop(rid, None)
            self.s.phit[g].pop(rid, None)

    # -- caching ------------------------------------------------------------------------------
    def mask(self, request: Any, g: int, start: int, end: int) -> Optional[list]:
        """vLLM's MambaManager.reachable_block_mask of blocks [start, end) under the
        coordinator's retention interval (None: cache every block)."""
        if self.retention is None:
            return None
        bs = self.s.block_size
        boundaries = [request.num_prompt_tokens - 1]  # vLLM's replay_boundaries, no EAGLE
        if request.shared_prefix_boundary:
            boundaries.append(request.shared_prefix_boundary)
        return MambaManager.reachable_block_mask(
            start,
            end,
            bs,
            self.specs[g],
            False,
            retention_interval=self.retention,
            reachable_boundaries=boundaries,
        )

    def _cache_checkpoint(self, request: Any, g: int, t: list) -> bool:
        """MambaManager._cache_partial_tail_block with a reserved checkpoint: the block
        keeps (or gets) its entry at the checkpoint when that state is reusable, and loses
        every entry when it is transient. False without a checkpoint."""
        ck = self.checkpoints[g].get(request.request_id)
        if ck is None:
            return False
        s = self.s
        bs = s.block_size
        pos, idx = ck
        b = t[idx]
        retained = self.retention is None and pos % bs == 0  # (dense: vLLM's mask is None)
        if not retained and pos % bs == 0:
            i = pos // bs - 1
            m = MambaManager.reachable_block_mask(
                i, i + 1, bs, self.specs[g], False, retention_interval=self.retention
            )
            retained = m is None or m[0]
        if (
            not retained
            and pos != get_mamba_prefill_checkpoint_position(request.num_prompt_tokens, bs, False)
            and pos != request.shared_prefix_boundary
        ):
            if b and s.hash_of.get(b) is not None:
                s.evict([b])  # the transient state overwrites the slot
            return True
        if not b:
            return True
        if s.hash_of.get(b) is not None:
            if s.hash_tokens.get(b) == (g, pos):  # keyed there (the full-block pass)
                return True
            s.evict([b])  # its other entries go (replace_existing_hashes)
        s.cache_ids(request, g, [b], idx, idx + 1)  # vLLM's cache_partial_block
        self.this_step[g].add(request.block_hashes[idx])
        return True

    def idle(self, request: Any, num_tokens: int) -> bool:
        """Whether ``after_cache`` has nothing to do for a request that caches no new
        block: no checkpoint reserved, and num_tokens is not the prompt's last block
        boundary (the re-cached tail)."""
        rid = request.request_id
        for g in self.gids:
            if rid in self.checkpoints[g]:
                return False
        bs = self.s.block_size
        return (
            num_tokens <= 0
            or num_tokens % bs != 0
            or num_tokens != (request.num_prompt_tokens - 1) // bs * bs
        )

    def after_cache(self, request: Any, g: int, num_tokens: int, before: int, after: int) -> None:
        """MambaManager.cache_blocks after the generic caching (blocks [before, after) of
        group g cached just now): the checkpoint block's entry, or the prompt's last
        boundary block again if it has no entry; the step's cached hashes and the
        connector's boundary states."""
        s = self.s
        rid = request.request_id
        t = s.tables.get(rid)
        if t is None:
            return
        t = t[g]
        bs = s.block_size
        if self._cache_checkpoint(request, g, t):
            pass
        elif num_tokens > 0 and num_tokens % bs == 0:
            boundary = (request.num_prompt_tokens - 1) // bs * bs
            i = num_tokens // bs - 1
            if num_tokens == boundary and i < len(t) and t[i] and s.hash_of.get(t[i]) is None:
                s.cache_ids(request, g, [t[i]], i, i + 1)  # vLLM's cache_partial_block
                self.this_step[g].add(request.block_hashes[i])
        if before >= after:
            return
        seg = t[before:after]
        if seg.count(0) == len(seg):
            return
        hash_of = s.hash_of
        this_step = self.this_step[g]
        offloads = None
        for i, b in enumerate(seg, before):
            if b:
                h = hash_of.get(b)
                if h is None:
                    continue
                this_step.add(h)
                if offloads is None:
                    offloads = self.offloads[g].setdefault(rid, [])
                offloads.append((b, (i + 1) * bs))

    def fine_after_cache(self, request: Any, g: int, n: int, before: int, nc: list) -> None:
        """MambaManager.cache_blocks under partial hash hits, after the generic caching of
        blocks [before, nc[g]): the prompt's last hash boundary (vLLM's
        get_mamba_prefill_checkpoint_position at the hash block size) keys the state block
        holding it; inside a block, that block is a partial hit of the request itself (its
        next allocation copies it) and the cached count stops before it. The step's cached
        hashes and the connector's boundary states as in ``after_cache``."""
        s = self.s
        rid = request.request_id
        t = s.tables[rid][g]
        after = nc[g]
        hbs, bs = s.hbs, s.bsz[g]
        ck = self.checkpoints[g].get(rid)
        if ck is not None:  # (vLLM: the reserved checkpoint instead of the prompt's tail)
            self._fine_checkpoint(request, g, t, ck)
        elif (
            n > 0
            and n % hbs == 0
            and n == get_mamba_prefill_checkpoint_position(request.num_prompt_tokens, hbs, False)
        ):
            i = -(-n // bs) - 1  # (cdiv)
            b = t[i] if i < len(t) else 0
            if b and not (s.hashed[b] and int(cast(np.ndarray, s.ntok)[b]) == n):
                h = s.cache_partial(request, g, b, n)
                if n % bs:
                    s.phit[g][rid] = (i, b)
                    nc[g] = i
                    self.producer[g][rid] = (b, n)
                self.this_step[g].add(h)
        if before >= after:
            return
        hash_of = s.hash_of
        ntok = cast(np.ndarray, s.ntok)
        this_step = self.this_step[g]
        for b in t[before:after]:
            if b:
                h = hash_of.get(b)
                if h is None:
                    continue
                this_step.add(h)
                self.offloads[g].setdefault(rid, []).append((b, int(ntok[b])))

    def _fine_checkpoint(self, request: Any, g: int, t: list, ck: tuple[int, int]) -> None:
        """``_cache_checkpoint`` under partial hash hits: the checkpoint position is a hash
        boundary, possibly inside a block and past the reserved block's own tokens. The
        block keeps its entry there when the state is reusable (a block boundary, dense
        retention; the prompt's checkpoint; the shared-prefix boundary), re-keyed at the
        position after its entries go (vLLM's cache_partial_block replacing them); a
        transient state loses every entry."""
        s = self.s
        pos, idx = ck
        b = t[idx]
        hbs = s.hbs
        if (
            pos % s.bsz[g]
            and pos != get_mamba_prefill_checkpoint_position(request.num_prompt_tokens, hbs, False)
            and pos != request.shared_prefix_boundary
        ):
            if b and s.hashed[b]:
                s.drop_entries(b)  # the transient state overwrites the slot
            return
        if not b:
            return
        if s.hashed[b]:
            if int(cast(np.ndarray, s.ntok)[b]) == pos:  # keyed there already
                return
            s.drop_entries(b)
        self.this_step[g].add(s.cache_partial(request, g, b, pos))

    def finalize(self, rid: str, num_computed: int, in_flight: int) -> list:
        """vLLM's finalize_partial_tail_offloads: a finishing request's own partial tail
        not yet copied, (group, block, boundary) when nothing was computed past it."""
        out = []
        for g in self.gids:
            tail = self.producer[g].pop(rid, None)
            if tail is not None and in_flight == 0 and num_computed == tail[1]:
                out.append((g, tail[0], tail[1]))
        return out

    def new_step(self) -> None:
        for g in self.gids:
            self.this_step[g].clear()

    def take_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        out: dict[str, list[tuple[int, int, int]]] = {}
        for g in self.gids:
            for rid, entries in self.offloads[g].items():
                out.setdefault(rid, []).extend((g, b, n) for b, n in entries)
            self.offloads[g] = {}
        return out
