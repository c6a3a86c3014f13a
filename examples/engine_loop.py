"""A complete continuous-batching engine loop on kvblocks, on the CPU, checked at every step.

    python examples/engine_loop.py [--requests 40] [--num-blocks 26] [--spec 3] ...

Every step follows the order of docs/engine-integration.md ("The step, in order"), and
nothing else (see the walk-through there):

1. schedule: swapped sequences come back (``can_swap_in``, ``swap_in``); running sequences
   get their next prefill chunk (``append``) or their speculative draft slots (``reserve``);
   waiting requests are admitted (``probe`` sizes the first chunk, ``can_add_prompt``,
   ``add``); under memory pressure the lowest-priority sequences are preempted, by
   ``swap_out`` or by ``free`` (recompute);
2. drain: the swap pairs, in the order the calls returned them (``ops.swap_blocks``), then
   ``take_copies()`` -> ``ops.copy_blocks``, last;
3. metadata: ``mgr.metadata(ids, query_lens, draft_lens=..., out=buf)`` into fixed buffers;
4. forward: ``ops.write_slots`` with ``meta.slot_mapping``, then attention, checked;
5. commit: sample (and verify drafts), ``fork`` the children of ``n > 1`` requests,
   ``append(..., computed=True)`` the accepted drafts, ``append_batch`` the sampled tokens,
   ``free`` the finished.

The workload: prompts share three "system prompts", some repeat verbatim, some are the next
turn of an earlier conversation (the earlier prompt + its output + a new message, sent once
the earlier request finished, so that it reuses the earlier turn's blocks through the prefix
cache); ``n`` of 1 to 3 samples; a cache too small for the batch (swaps, recomputes,
evictions). With ``--spec K`` decoding sequences propose up to K draft tokens by prompt lookup
(the continuation of the latest earlier occurrence of their last tokens) and verify them in the
step, with exact-match sampling: the generated tokens are the same as without drafts.

The "model" is a tiny deterministic numpy transformer-like toy: the q/k/v of a token are sums
of rows of fixed random tables indexed by the token id, its position and a rolling hash of
the token prefix up to it. So K/V of a token depend only on the token prefix, identical
prefixes give bitwise identical K/V (as prefix caching requires), and the values are exactly
reproducible whatever the batch. Attention is a small causal numpy softmax attention, one
query row at a time over exactly the keys it sees; the logits add a bigram term (the next
token depends strongly on the last one), so text repeats and drafts get accepted.

The oracle: every sequence also keeps a contiguous K/V copy, as an engine without paging
would. At EVERY step, for every sequence of the batch and every layer, the K/V read back from
the paged cache through the metadata (FlashInfer ``kv_indices``, and ``ops.gather`` over the
padded ``block_tables`` row) must equal that copy bitwise, draft slots included (they must hold
the model's K/V of the drafts), and so must the attention output. Sampling uses one generator
per sequence, so the generated text does not depend on batching, memory pressure, preemption
or speculation: a run with a tiny cache produces the same tokens as a roomy one, and a run
with ``--spec`` the same as one without (tests/test_engine_loop.py checks both).

Hybrid models and the host tier: ``--groups full,window:8`` (or ``full,chunk:8``, or any list
of ``full``, ``window:W``, ``chunk:C``) gives layer l the attention of group l % G, with one
block table per group (docs/hybrid-models.md) in one shared ``KVCache``; the step is planned
once (``plan_step``) and each layer reads and writes through its group's metadata, checked over
exactly the positions its attention sees. ``--host-prefix`` turns the host blocks into the
host tier of the prefix cache too (docs/host-tier.md): evicted blocks are demoted, host hits
onloaded, both drained at the head of the step. The outputs under a tight cache are still
those of a roomy one without the tier.

    python examples/engine_loop.py --groups full,window:8 --num-blocks 40 --host-prefix
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

try:
    import kvblocks  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblocks import AttentionMetadata, BlockManager, KVCache, KVGroup, KVLayout, ops

CTX_BUCKETS = 4096  # rolling prefix hash range


# ---------------------------------------------------------------------------------------------
# the toy model
# ---------------------------------------------------------------------------------------------
class ToyModel:
    """q/k/v = table[token] + table[position] + table[prefix hash];
    logits = out @ W + bigram[last token]."""

    def __init__(
        self, layout: KVLayout, vocab: int, max_len: int, seed: int, bigram: float
    ) -> None:
        rng = np.random.default_rng(seed)
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        f32 = np.float32
        self.layout, self.vocab = layout, vocab
        self.tok = rng.standard_normal((3, L, vocab, H, D)).astype(f32)
        self.pos = (0.1 * rng.standard_normal((3, L, max_len, H, D))).astype(f32)
        self.ctx = (0.5 * rng.standard_normal((3, L, CTX_BUCKETS, H, D))).astype(f32)
        self.w_out = (rng.standard_normal((H * D, vocab)) / np.sqrt(H * D)).astype(f32)
        self.bigram = (bigram * rng.standard_normal((vocab, vocab))).astype(f32)
        self.scale = f32(1.0 / np.sqrt(D))

    @staticmethod
    def extend_ctx(ctx: List[int], tokens: List[int]) -> None:
        """Rolling hash of the token prefix, one entry per token."""
        h = ctx[-1] if ctx else 17
        for t in tokens[len(ctx) :]:
            h = (h * 131 + t + 1) % CTX_BUCKETS
            ctx.append(h)

    def qkv(self, layer: int, tokens, positions, ctx):
        """q, k, v [n, H, D] of tokens at positions with prefix hashes ctx (elementwise only)."""
        return tuple(
            self.tok[i, layer, tokens] + self.pos[i, layer, positions] + self.ctx[i, layer, ctx]
            for i in range(3)
        )

    def kv(self, tokens, positions, ctx) -> np.ndarray:
        """K/V of tokens for every layer: [2, layers, n, H, D] (what the oracle stores)."""
        lay = self.layout
        out = np.empty((2, lay.num_layers, len(tokens)) + lay.token_shape, np.float32)
        for layer in range(lay.num_layers):
            _, out[0, layer], out[1, layer] = self.qkv(layer, tokens, positions, ctx)
        return out

    def attention(self, q, k, v, q_pos, first=lambda p: 0):
        """Causal softmax attention: query i at position p = q_pos[i] over k, v
        [first(p) : p + 1] (``first``: the layer's first visible position, 0 for full
        attention, see ``Engine.first_visible``). Row by row over exactly the visible keys,
        so a row's result does not depend on the rows or keys after it: a token decoded
        alone and the same token verified after a draft give bitwise the same output."""
        out = np.empty(q.shape, np.float32)
        for i, p in enumerate(q_pos):
            lo = first(p)
            s = np.einsum("hd,khd->hk", q[i], k[lo : p + 1]) * self.scale
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
            out[i] = np.einsum("hk,khd->hd", s, v[lo : p + 1])
        return out

    def logits(self, out_row, last_token: int):
        return out_row.reshape(-1) @ self.w_out + self.bigram[last_token]


# ---------------------------------------------------------------------------------------------
# requests and sequences
# ---------------------------------------------------------------------------------------------
WAITING, RUNNING, SWAPPED, DONE = "waiting", "running", "swapped", "done"


@dataclass
class Request:
    rid: int
    prompt: Optional[List[int]]  # a follow-up turn's prompt is known once its parent finished
    n: int
    max_new: int
    arrival: int
    parent: Optional[int] = None  # follow-up of this request: its prompt + its output + tail
    tail: List[int] = field(default_factory=list)


@dataclass
class Seq:
    sid: str
    req: Request
    order: float  # priority: lower runs first, higher is preempted first
    tokens: List[int]  # prompt + generated; a suffix may not be committed yet
    ctx: List[int]  # rolling prefix hash per token
    rng: np.random.Generator
    pending_forks: int = 0  # n - 1 until the prompt is done, then the children exist
    generated: int = 0
    state: str = WAITING
    admitted: bool = False  # added once already (a later add is a recompute re-add)
    ref: Optional[np.ndarray] = None  # contiguous K/V copy [2, layers, n, H, D] (the oracle)


@dataclass
class Entry:
    """One sequence of the step: the last ``q`` committed tokens and ``drafts`` after them."""

    seq: Seq
    q: int
    drafts: List[int]


def parse_groups(spec: str) -> List[KVGroup]:
    """``--groups full,window:8`` -> the KV cache groups; model layer l attends as group
    l % G (so full, window, full, window, ...). Kinds: ``full``, ``window:W`` (sliding window
    of W tokens), ``chunk:C`` (chunked local attention, chunks of C tokens)."""
    groups = []
    for part in spec.split(","):
        kind, _, size = part.partition(":")
        if kind == "full" and not size:
            groups.append(KVGroup("full"))
        elif kind == "window" and size.isdigit() and int(size) > 0:
            groups.append(KVGroup("sliding_window", window=int(size)))
        elif kind == "chunk" and size.isdigit() and int(size) > 0:
            groups.append(KVGroup("chunked_local", chunk=int(size)))
        else:
            raise ValueError(f"--groups: {part!r} is not full, window:W or chunk:C")
    return groups


def make_requests(
    num: int, seed: int, vocab: int, block_size: int, max_prompt: int, max_new: int, turns: float
) -> List[Request]:
    rng = np.random.default_rng(seed + 1)
    systems = [
        rng.integers(0, vocab, size=int(rng.integers(2, 5)) * block_size).tolist() for _ in range(3)
    ]
    reqs: List[Request] = []
    plen: List[int] = []  # prompt lengths (a follow-up's is known before its prompt)
    for i in range(num):
        n = int(rng.choice([1, 1, 1, 2, 3]))
        new = int(rng.integers(2, max_new + 1))
        u = rng.random()
        tail = rng.integers(0, vocab, size=int(rng.integers(1, 7))).tolist()
        parents = [j for j in range(i) if plen[j] + reqs[j].max_new + len(tail) <= max_prompt]
        if i >= 4 and u < 0.15:  # the same prompt again (a retry, a second user)
            j = int(rng.integers(0, i))
            r = Request(i, reqs[j].prompt, n, new, i // 3, reqs[j].parent, reqs[j].tail)
            plen.append(plen[j])
        elif u < 0.15 + turns and parents:  # the next turn of an earlier conversation
            j = parents[int(rng.integers(0, len(parents)))]
            r = Request(i, None, n, new, i // 3, parent=j, tail=tail)
            plen.append(plen[j] + reqs[j].max_new + len(tail))
        else:
            sys_prompt = systems[int(rng.integers(0, len(systems)))] if rng.random() < 0.8 else []
            tail = rng.integers(0, vocab, size=int(rng.integers(1, 13))).tolist()
            r = Request(i, (sys_prompt + tail)[:max_prompt], n, new, i // 3)
            plen.append(len(r.prompt))
        reqs.append(r)
    return reqs


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        bs = args.block_size
        self.layout = KVLayout(args.layers, args.kv_heads, args.head_dim, bs, "fp32")
        self.max_len = args.max_prompt + args.max_new + 1
        # KV cache groups (docs/hybrid-models.md): model layer l attends as group l % G and
        # lives in cache layer "its index among its group's layers" of one shared KVCache
        self.groups = parse_groups(args.groups)
        G = len(self.groups)
        self.group_of = [layer % G for layer in range(args.layers)]
        self.cache_layer = [self.group_of[:i].count(g) for i, g in enumerate(self.group_of)]
        cache_layout = KVLayout(
            max(map(self.group_of.count, range(G))), args.kv_heads, args.head_dim, bs, "fp32"
        )
        self.mgr = BlockManager(
            args.num_blocks,
            bs,
            watermark=args.watermark,
            num_host_blocks=args.host_blocks,
            groups=self.groups if G > 1 or args.groups != "full" else None,
            host_prefix_cache=args.host_prefix,
        )
        self.cache = KVCache(cache_layout, args.num_blocks, "cpu", pin_memory=False)
        self.host = (
            KVCache(cache_layout, args.host_blocks, "cpu", pin_memory=False)
            if args.host_blocks
            else None
        )
        self.model = ToyModel(self.layout, args.vocab, self.max_len, args.seed, args.bigram)
        # fixed metadata buffers, one per group, allocated once and reused by every step
        # (CUDA-graph style)
        self.max_blocks = -(-self.max_len // bs)
        self.bufs = [
            AttentionMetadata.allocate(
                max_batch=args.max_seqs,
                max_tokens=args.max_tokens,
                max_indices=args.max_seqs * self.max_blocks,
                max_blocks_per_seq=self.max_blocks,
            )
            for _ in range(G)
        ]
        self.requests = make_requests(
            args.requests, args.seed, args.vocab, bs, args.max_prompt, args.max_new, args.turns
        )
        self.pending_requests = list(self.requests)
        self.left: Dict[int, int] = {r.rid: r.n for r in self.requests}  # live samples
        self.done_step: Dict[int, int] = {}  # request -> step its last sample finished
        self.running: List[Seq] = []  # sorted by order
        self.waiting: List[Seq] = []  # sorted by order (recompute-preempted keep their rank)
        self.swapped: List[Seq] = []  # sorted by order
        self.outputs: Dict[str, List[int]] = {}
        # this step's schedule: the batch, its token budget, the blocks its commit will take,
        # and the pair lists to drain, in the order the calls returned them
        self.batch: Dict[str, Entry] = {}
        self.budget = 0
        self.commit_need = 0
        self.to_drain: List[Tuple[KVCache, KVCache, np.ndarray]] = []
        self.successor: Dict[int, int] = {}  # the drafter's table: token -> next generated
        self.step_no = 0
        self.stats = dict(
            steps=0,
            query_tokens=0,
            decode_tokens=0,
            prefill_tokens=0,
            prompt_tokens_added=0,
            cached_tokens=0,
            turn_requests=0,
            turn_prompt_tokens=0,
            turn_cached_tokens=0,
            readd_tokens=0,
            readd_cached_tokens=0,
            swap_preemptions=0,
            recompute_preemptions=0,
            blocks_swapped_out=0,
            blocks_swapped_in=0,
            cow_copies=0,
            forks=0,
            drafts_proposed=0,
            drafts_accepted=0,
            peak_usage=0.0,
            checks=0,
            offloads=0,
            onloads=0,
        )

    # -- helpers --------------------------------------------------------------------------
    def first_visible(self, group: int, p: int) -> int:
        """The first position the query at p reads in a layer of this group."""
        g = self.groups[group]
        if g.kind == "sliding_window":
            return max(0, p - g.window + 1)
        if g.kind == "chunked_local":
            return p - p % g.chunk
        return 0

    @staticmethod
    def _insert(queue: List[Seq], s: Seq) -> None:
        bisect.insort(queue, s, key=lambda x: x.order)

    def _slots_in_use(self) -> int:
        return sum(1 + s.pending_forks for s in self.running)

    def _room(self) -> int:
        """Free blocks beyond those this step's commit will take."""
        return self.mgr.num_free_blocks - self.commit_need

    def _commit_blocks(self, s: Seq, ndrafts: int) -> int:
        """Blocks s's commit at the end of this step takes at most, once its step's tokens
        and draft slots are in its table: the bonus token (after the accepted drafts, which
        fill reserved slots), and what each child forked then takes (a copy of the shared
        partial block, or a new block; with KV cache groups, in each group)."""
        if s.generated + 1 >= s.req.max_new:
            return 0  # it finishes: nothing is committed
        # its token after ndrafts reserved draft slots; each child takes its first token
        return self.mgr.blocks_needed_batch(
            [s.sid], 1, draft_lens=[ndrafts], forks=[s.pending_forks]
        )

    def propose(self, s: Seq, limit: int) -> List[int]:
        """A bigram drafter: follow, from the last token, the successor each token had the
        last time the engine generated it (any sequence)."""
        k = min(self.args.spec, limit, s.req.max_new - s.generated - 1)
        drafts: List[int] = []
        t = s.tokens[-1]
        while len(drafts) < k and t in self.successor:
            t = self.successor[t]
            drafts.append(t)
        return drafts

    # -- 1. schedule ---------------------------------------------------------------------
    def arrivals(self) -> None:
        """Requests whose time has come join the waiting queue; a follow-up turn comes only
        after the request it follows finished, with that request's output in its prompt."""
        for r in list(self.pending_requests):
            ready = r.arrival
            if r.parent is not None:
                if r.parent not in self.done_step:
                    continue
                ready = max(ready, self.done_step[r.parent] + 1)
                r.prompt = self.requests[r.parent].prompt + self.outputs[f"{r.parent}.0"] + r.tail
            if ready > self.step_no:
                continue
            self.pending_requests.remove(r)
            s = Seq(
                f"{r.rid}.0",
                r,
                float(r.rid),
                list(r.prompt),
                [],
                np.random.default_rng([self.args.seed, r.rid, 0]),
                pending_forks=r.n - 1,
            )
            self.model.extend_ctx(s.ctx, s.tokens)
            self._insert(self.waiting, s)

    def preempt(self, s: Seq) -> None:
        """Swap the sequence out (its pairs are drained with the step's) or free it to
        recompute it later; it is never in this step's batch (victims have the lowest
        priority, the batch is built in priority order)."""
        assert s.sid not in self.batch
        mgr = self.mgr
        self.running.remove(s)
        mode = self.args.preempt
        if mode == "auto":  # swap what is costly to recompute, while the host has room
            mode = (
                "swap"
                if s.generated > 0 and len(s.tokens) > 2 * self.args.block_size
                else "recompute"
            )
        if mode == "swap" and mgr.can_swap_out(s.sid):
            pairs = mgr.swap_out(s.sid)
            self.to_drain.append((self.cache, self.host, pairs))
            s.state = SWAPPED
            self._insert(self.swapped, s)
            self.stats["swap_preemptions"] += 1
            self.stats["blocks_swapped_out"] += len(pairs)
        else:
            mgr.free(s.sid)  # keep the tokens; their computed full blocks stay cached
            s.state = WAITING
            self._insert(self.waiting, s)
            self.stats["recompute_preemptions"] += 1

    def schedule_running(self, s: Seq) -> None:
        """Put a running sequence into the step: its uncomputed committed tokens (decode: the
        token sampled last step), else its next prefill chunk; draft slots for decoding
        sequences. Preempts the lowest-priority sequences while the blocks are missing."""
        mgr = self.mgr
        committed, computed = mgr.num_tokens(s.sid), mgr.num_computed(s.sid)
        chunk = 0
        if committed == computed:  # chunked prefill: commit the next chunk now
            chunk = min(len(s.tokens) - committed, self.budget)
            if chunk <= 0:
                return
        q = committed + chunk - computed
        if q > self.budget:
            return  # the highest-priority sequence always gets the whole budget
        completes = committed + chunk == len(s.tokens)
        drafts: List[int] = []
        if completes and s.generated > 0 and s.pending_forks == 0:
            drafts = self.propose(s, self.budget - q)
        commits = completes and s.generated + 1 < s.req.max_new

        def need() -> int:  # blocks the chunk, the draft slots and the step's commit take
            take = chunk + len(drafts)
            if not commits:
                return mgr.blocks_needed(s.sid, take)
            return mgr.blocks_needed(s.sid, take + 1) + s.pending_forks * len(self.groups)

        while need() > self._room():
            victim = self.running[-1]
            self.preempt(victim)
            if victim is s:
                return
        if chunk:
            mgr.append(s.sid, s.tokens[committed : committed + chunk])
        if drafts:
            mgr.reserve(s.sid, len(drafts))
            self.stats["drafts_proposed"] += len(drafts)
        if completes:
            self.commit_need += self._commit_blocks(s, len(drafts))
        self.batch[s.sid] = Entry(s, q, drafts)
        self.budget -= q + len(drafts)

    def admit(self, s: Seq) -> bool:
        """Admit a waiting sequence (new, or preempted by recompute) with its first chunk:
        the cached prefix (probe) plus what the budget computes. False if it does not fit."""
        mgr = self.mgr
        cached, _ = mgr.probe(s.tokens)
        chunk = min(len(s.tokens), cached + self.budget)
        toks = s.tokens[:chunk]
        # the chunk's own probe: with the host prefix cache a host hit counts only when its
        # onloads fit in the free blocks, so a chunk may hit more than the whole prompt did
        cached, need = mgr.probe(toks)
        extra = 0
        if chunk == len(s.tokens) and s.generated + 1 < s.req.max_new:
            # its commit: a new block for its token if the prompt fills its last block, one
            # block per child (a copy of the shared partial block, or a new block); in each
            # KV cache group
            extra = ((chunk % mgr.block_size == 0) + s.pending_forks) * len(self.groups)
        # the library's admission rule (hits counted, watermark kept), and room for this
        # step's commit, which may dip into the watermark like any running sequence
        if not mgr.can_add_prompt(toks) or need + extra > self._room():
            return False
        # a re-admission after a recompute preemption: its hits are counted as recompute
        n_cached = mgr.add(s.sid, toks, recompute=s.admitted)
        assert n_cached == cached  # nothing ran between the probe and the add
        st = self.stats
        st["prompt_tokens_added"] += chunk
        st["cached_tokens"] += n_cached
        if s.admitted:
            st["readd_tokens"] += chunk
            st["readd_cached_tokens"] += n_cached
        elif s.req.parent is not None and s.sid.endswith(".0"):
            st["turn_requests"] += 1
            st["turn_prompt_tokens"] += len(s.tokens)
            st["turn_cached_tokens"] += n_cached
        s.admitted = True
        s.state = RUNNING
        self._insert(self.running, s)
        if chunk == len(s.tokens):
            self.commit_need += self._commit_blocks(s, 0)
        self.batch[s.sid] = Entry(s, chunk - n_cached, [])
        self.budget -= chunk - n_cached
        return True

    def schedule(self) -> List[Entry]:
        """Step 1: decide the batch; every call that moves data queues its pairs."""
        args, mgr = self.args, self.mgr
        self.arrivals()
        self.batch, self.budget, self.commit_need = {}, args.max_tokens, 0
        # swapped sequences come back first, in priority order, keeping the watermark free
        while self.swapped:
            s = self.swapped[0]
            if self._slots_in_use() + 1 + s.pending_forks > args.max_seqs:
                break
            if not mgr.can_swap_in(s.sid) or mgr.blocks_needed(s.sid, 1) > self._room():
                break
            pairs = mgr.swap_in(s.sid)
            self.to_drain.append((self.host, self.cache, pairs))
            self.stats["blocks_swapped_in"] += len(pairs)
            self.swapped.pop(0)
            s.state = RUNNING
            self._insert(self.running, s)
        # running sequences, in priority order: decode tokens, drafts, prefill chunks
        for s in list(self.running):
            if s.state == RUNNING:
                self.schedule_running(s)
        # admission, in priority order, when nothing waits in swap (it has priority)
        while self.waiting and not self.swapped and self.budget > 0:
            if self._slots_in_use() + 1 + self.waiting[0].pending_forks > args.max_seqs:
                break
            if not self.admit(self.waiting[0]):
                break
            self.waiting.pop(0)
        return sorted(self.batch.values(), key=lambda e: e.seq.order)

    # -- 2. drain -------------------------------------------------------------------------
    def drain(self) -> None:
        """With the host prefix cache, its offloads (evicted blocks demoted to the host) and
        onloads (host hits copied back) first; then the swap pairs in the order the calls
        returned them, then the copy-on-write copies (docs/host-tier.md, "The step, in
        order")."""
        if self.args.host_prefix:
            offloads = self.mgr.take_offloads()
            ops.swap_blocks(self.cache, self.host, offloads)
            onloads = self.mgr.take_onloads()
            ops.swap_blocks(self.host, self.cache, onloads)
            self.stats["offloads"] += len(offloads)
            self.stats["onloads"] += len(onloads)
        for src, dst, pairs in self.to_drain:
            ops.swap_blocks(src, dst, pairs)
        self.to_drain.clear()
        copies = self.mgr.take_copies()
        if len(copies):
            ops.copy_blocks(self.cache, copies)
            self.stats["cow_copies"] += len(copies)

    # -- 3. metadata and 4. forward -------------------------------------------------------
    def forward(self, batch: List[Entry]) -> Dict[str, np.ndarray]:
        """Declare the step (metadata), compute its tokens and drafts through the paged
        cache, check every read against the contiguous copies; return, per sequence, the
        last layer's attention rows of its last committed token and its drafts (the rows
        that sample). With KV cache groups, each layer reads and writes through its group's
        metadata, and only the positions its attention sees (the window, the chunk) are
        checked: the blocks below them are released (null) in that group."""
        mgr, model, lay = self.mgr, self.model, self.layout
        bs = lay.block_size
        ids = [e.seq.sid for e in batch]
        qlens = [e.q for e in batch]
        dlens = [len(e.drafts) for e in batch]
        if len(self.groups) == 1:
            metas = [mgr.metadata(ids, qlens, draft_lens=dlens, out=self.bufs[0])]
        else:  # the step planned once for every group, then each group's metadata written
            step = mgr.plan_step(ids, qlens, draft_lens=dlens)
            metas = [step.metadata(g, out=buf) for g, buf in enumerate(self.bufs)]
        assert all(m.num_tokens == sum(qlens) + sum(dlens) for m in metas)
        # token ids, positions and prefix hashes of the queries (committed, then drafts)
        toks, pos, ctx, lens, refs = [], [], [], [], []
        for e in batch:
            s, d = e.seq, len(e.drafts)
            L = mgr.num_tokens(s.sid)
            assert mgr.num_computed(s.sid) == L  # metadata declared the step
            dctx = list(s.ctx[:L])
            model.extend_ctx(dctx, s.tokens[:L] + e.drafts)
            self._extend_reference(s, L)  # the contiguous copy covers every committed token
            # what the context must read back: the copy, then the model's K/V of the drafts
            ref = s.ref[:, :, :L]
            if d:
                ref = np.concatenate(
                    [ref, model.kv(np.array(e.drafts), np.arange(L, L + d), np.array(dctx[L:]))],
                    axis=2,
                )
            refs.append(ref)
            lens.append(L + d)
            toks.extend(s.tokens[L - e.q : L] + e.drafts)
            pos.extend(range(L - e.q, L + d))
            ctx.extend(dctx[L - e.q : L + d])
        toks, pos, ctx = np.array(toks), np.array(pos), np.array(ctx)
        assert all(np.array_equal(m.seq_lens, lens) for m in metas)
        rows = {}
        for layer in range(lay.num_layers):
            g, cl = self.group_of[layer], self.cache_layer[layer]
            meta = metas[g]

            def first(p: int, g: int = g) -> int:
                return self.first_visible(g, p)

            q_all, k_new, v_new = model.qkv(layer, toks, pos, ctx)
            ops.write_slots(self.cache, cl, k_new, v_new, meta.slot_mapping)
            k_cache, v_cache = self.cache.kv(cl)  # [num_blocks, block_size, H, D] views
            for i, e in enumerate(batch):
                s, L = e.seq, lens[i]
                a, b = meta.qo_indptr[i], meta.qo_indptr[i + 1]
                lo = first(int(pos[a]))  # what the step's first query reads, and after it
                pages = meta.kv_indices[meta.kv_indptr[i] : meta.kv_indptr[i + 1]]
                assert len(pages) == -(-L // bs)
                assert meta.kv_last_page_len[i] == L - (len(pages) - 1) * bs
                assert (pages[lo // bs :] != 0).all()  # nothing the step reads is released
                # paged read, FlashInfer-style: pages from kv_indices, the last one partial
                kp = k_cache[pages].reshape(-1, *lay.token_shape)[:L]
                vp = v_cache[pages].reshape(-1, *lay.token_shape)[:L]
                # and FlashAttention-style: the padded block_tables row, through ops.gather
                kg, vg = ops.gather(self.cache, cl, meta.block_tables[i], L)
                kr, vr = refs[i][0, layer], refs[i][1, layer]
                if not (
                    np.array_equal(kp[lo:], kr[lo:])
                    and np.array_equal(vp[lo:], vr[lo:])
                    and np.array_equal(kg[lo:], kr[lo:])
                    and np.array_equal(vg[lo:], vr[lo:])
                ):
                    raise AssertionError(
                        f"step {self.step_no}: paged K/V of {s.sid} layer "
                        f"{layer} differ from its contiguous copy"
                    )
                out_paged = model.attention(q_all[a:b], kp, vp, pos[a:b], first)
                out_ref = model.attention(q_all[a:b], kr, vr, pos[a:b], first)
                if not np.array_equal(out_paged, out_ref):
                    raise AssertionError(f"step {self.step_no}: attention of {s.sid} differs")
                self.stats["checks"] += 1
                if layer == lay.num_layers - 1:
                    rows[s.sid] = out_paged[e.q - 1 :]
        return rows

    def _extend_reference(self, s: Seq, upto: int) -> None:
        have = 0 if s.ref is None else s.ref.shape[2]
        if have >= upto:
            return
        new = self.model.kv(
            np.array(s.tokens[have:upto]), np.arange(have, upto), np.array(s.ctx[have:upto])
        )
        s.ref = new if s.ref is None else np.concatenate([s.ref, new], axis=2)

    # -- 5. commit ------------------------------------------------------------------------
    def sample(self, out_row: np.ndarray, last_token: int, rng: np.random.Generator) -> int:
        z = self.model.logits(out_row, last_token).astype(np.float64) / self.args.temperature
        p = np.exp(z - z.max())
        return int(rng.choice(len(p), p=p / p.sum()))

    def sample_and_verify(self, s: Seq, rows: np.ndarray, drafts: List[int]) -> int:
        """Sample position by position, exactly as plain decoding would (one draw of the
        sequence's generator per token): continue while the sampled token equals the draft;
        the first mismatch (or the row after the last draft) gives the bonus token.
        Returns the number of drafts accepted."""
        accepted = 0
        for j in range(len(drafts) + 1):
            tok = self.sample(rows[j], s.tokens[-1], s.rng)
            self.successor[s.tokens[-1]] = tok
            s.tokens.append(tok)
            s.generated += 1
            if s.generated >= s.req.max_new or j == len(drafts) or tok != drafts[j]:
                break
            accepted += 1
        self.model.extend_ctx(s.ctx, s.tokens)
        return accepted

    def finish(self, s: Seq) -> None:
        self.mgr.free(s.sid)
        self.running.remove(s)
        s.state = DONE
        self.outputs[s.sid] = s.tokens[len(s.req.prompt) :]
        self.left[s.req.rid] -= 1
        if not self.left[s.req.rid]:
            self.done_step[s.req.rid] = self.step_no

    def commit(self, batch: List[Entry], rows: Dict[str, np.ndarray]) -> None:
        """Sample (and verify drafts), fork, commit the accepted drafts and the sampled
        tokens, free the finished."""
        mgr, st = self.mgr, self.stats
        to_append: List[Seq] = []
        finished: List[Seq] = []
        for e in batch:
            s = e.seq
            L = mgr.num_tokens(s.sid)
            if L < len(s.tokens):
                st["prefill_tokens"] += e.q
                continue  # more prompt chunks to come
            st["decode_tokens" if e.q == 1 and s.generated > 0 else "prefill_tokens"] += e.q
            family = [s]
            for j in range(1, s.pending_forks + 1):  # n > 1: the children share the prompt
                child = Seq(
                    f"{s.req.rid}.{j}",
                    s.req,
                    s.order + j / 100.0,
                    list(s.tokens),
                    list(s.ctx),
                    np.random.default_rng([self.args.seed, s.req.rid, j]),
                    generated=s.generated,
                    state=RUNNING,
                    admitted=True,
                    ref=s.ref,
                )
                mgr.fork(s.sid, child.sid)
                self._insert(self.running, child)
                family.append(child)
                st["forks"] += 1
            s.pending_forks = 0
            for member in family:
                accepted = self.sample_and_verify(member, rows[s.sid], e.drafts)
                st["drafts_accepted"] += accepted
                if member.generated >= member.req.max_new:
                    finished.append(member)
                    continue
                if accepted:  # their K/V were written by this step: no recompute
                    mgr.append(member.sid, member.tokens[L : L + accepted], computed=True)
                to_append.append(member)
        # one native call commits the sampled tokens; the schedule kept room for it
        mgr.append_batch([s.sid for s in to_append], [s.tokens[-1] for s in to_append])
        for s in finished:
            self.finish(s)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step; False when every request is done."""
        mgr = self.mgr
        self.step_no += 1
        batch = self.schedule()  # 1. schedule
        self.drain()  # 2. drain
        if not batch:
            if not (self.running or self.swapped or self.waiting or self.pending_requests):
                return False
            if not self.running and not self.swapped and self.waiting:
                raise RuntimeError("a request does not fit the cache even when it is empty")
            return True
        self.stats["steps"] += 1
        rows = self.forward(batch)  # 3. metadata, 4. forward
        self.stats["query_tokens"] += sum(e.q + len(e.drafts) for e in batch)
        self.stats["peak_usage"] = max(self.stats["peak_usage"], mgr.pool.usage)
        self.commit(batch, rows)  # 5. commit
        if self.args.check:
            mgr.check()
        return True

    def run(self) -> dict:
        t0 = time.perf_counter()
        while self.step():
            if self.step_no > 100_000:
                raise RuntimeError("no progress")
        elapsed = time.perf_counter() - t0
        mgr = self.mgr
        assert mgr.num_seqs == 0 and mgr.pool.num_used == 0, "blocks leaked"
        assert mgr.host_pool is None or mgr.host_pool.num_used == 0, "host blocks leaked"
        assert mgr.num_pending_copies == 0 and not self.to_drain
        mgr.check()
        st = dict(self.stats)
        st["requests"] = len(self.requests)
        st["sequences"] = len(self.outputs)
        st["generated_tokens"] = sum(len(v) for v in self.outputs.values())
        st["prefix_hit_rate"] = (
            st["cached_tokens"] / st["prompt_tokens_added"] if st["prompt_tokens_added"] else 0.0
        )
        st["acceptance_rate"] = (
            st["drafts_accepted"] / st["drafts_proposed"] if st["drafts_proposed"] else 0.0
        )
        st["evictions"] = mgr.pool.stats.evictions
        hs = mgr.host_stats if self.args.host_prefix else None
        st["host_hit_tokens"] = hs.hit_tokens + hs.recompute_hit_tokens if hs else 0
        st["elapsed_s"] = elapsed
        st["outputs"] = self.outputs
        return st


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=26, help="device blocks (incl. null)")
    ap.add_argument("--host-blocks", type=int, default=32, help="host blocks for swapping (0: off)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--max-seqs", type=int, default=8, help="sequences per step")
    ap.add_argument("--max-tokens", type=int, default=24, help="query tokens per step")
    ap.add_argument("--max-prompt", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=14)
    ap.add_argument(
        "--turns",
        type=float,
        default=0.3,
        help="share of requests that are the next turn of an earlier one",
    )
    ap.add_argument(
        "--spec",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding: up to K prompt-lookup drafts per sequence",
    )
    ap.add_argument(
        "--groups",
        default="full",
        help="KV cache groups, layer l in group l %% G: e.g. full,window:8 or full,chunk:8",
    )
    ap.add_argument(
        "--host-prefix",
        action="store_true",
        help="the host tier of the prefix cache in the --host-blocks (demotion, onloads)",
    )
    ap.add_argument("--watermark", type=float, default=0.04)
    ap.add_argument("--preempt", choices=["auto", "swap", "recompute"], default="auto")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=48)
    ap.add_argument(
        "--bigram",
        type=float,
        default=6.0,
        help="weight of the bigram term of the logits (repetition)",
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip BlockManager.check() after every step",
    )
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        groups = parse_groups(args.groups)
    except ValueError as e:
        ap.error(str(e))
    if args.layers < len(groups):
        ap.error("--layers must be at least the number of --groups")
    if args.host_prefix and not args.host_blocks:
        ap.error("--host-prefix needs --host-blocks")
    need = -(-(args.max_prompt + args.max_new + 1) // args.block_size)
    watermark = BlockManager(args.num_blocks, 1, watermark=args.watermark).watermark_blocks
    # the fork of n = 3 samples commits three tokens after a prompt at once
    family = args.max_prompt // args.block_size + 3
    need = max(need + 1, family) * len(groups)  # every group may hold a whole sequence
    if args.num_blocks - 1 - watermark < need:
        ap.error(f"--num-blocks too small: one sequence may need {need} blocks")
    if args.max_tokens < args.max_seqs:
        ap.error("--max-tokens must be >= --max-seqs (one decode token per sequence)")
    if args.spec < 0:
        ap.error("--spec must be >= 0")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    summary = Engine(args).run()
    if not args.quiet:
        s = summary
        print(
            f"requests {s['requests']} ({s['turn_requests']} follow-up turns), sequences "
            f"{s['sequences']} (forks {s['forks']}), steps {s['steps']}, "
            f"{s['elapsed_s']:.2f} s"
        )
        print(
            f"tokens: computed {s['query_tokens']} (prefill {s['prefill_tokens']}, decode "
            f"{s['decode_tokens']}, drafts {s['drafts_proposed']}), generated "
            f"{s['generated_tokens']}"
        )
        print(
            f"prefix cache: {s['cached_tokens']} of {s['prompt_tokens_added']} prompt tokens "
            f"hit ({100 * s['prefix_hit_rate']:.1f}%); follow-up turns {s['turn_cached_tokens']}"
            f" of {s['turn_prompt_tokens']}, recompute re-adds {s['readd_cached_tokens']} of "
            f"{s['readd_tokens']}; {s['evictions']} evictions"
        )
        if args.spec:
            print(
                f"speculative decoding: {s['drafts_accepted']} of {s['drafts_proposed']} drafts "
                f"accepted ({100 * s['acceptance_rate']:.1f}%)"
            )
        print(
            f"preemptions: {s['swap_preemptions']} swap ({s['blocks_swapped_out']} blocks out, "
            f"{s['blocks_swapped_in']} in), {s['recompute_preemptions']} recompute; "
            f"copy-on-write copies {s['cow_copies']}"
        )
        if args.host_prefix:
            print(
                f"host prefix cache: {s['host_hit_tokens']} prompt tokens hit on the host, "
                f"{s['offloads']} blocks demoted, {s['onloads']} onloaded"
            )
        print(
            f"peak usage {100 * s['peak_usage']:.1f}% of {args.num_blocks - 1} blocks; "
            f"{s['checks']} paged-vs-contiguous attention checks passed"
        )
    return summary


if __name__ == "__main__":
    main()
