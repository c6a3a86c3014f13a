"""A complete continuous-batching engine loop on kvblocks, on the CPU, checked at every step.

    python examples/engine_loop.py [--requests 40] [--num-blocks 56] [--preempt auto] ...

What it drives (see docs/engine-integration.md for the walk-through):

* BlockManager: admission with ``can_add`` (watermark), chunked prefill (``add`` the first
  chunk, ``append`` the rest in later steps), decode with ``append_batch`` (one native call
  per step), ``n > 1`` sampling through ``fork`` with copy-on-write, preemption under memory
  pressure by recompute (``free``, later ``add`` again: full blocks come back from the prefix
  cache) or by swap (``swap_out`` / ``swap_in``), finishing with ``free``;
* KVCache + ops: ``copy_blocks`` for the pairs of ``take_copies()``, ``swap_blocks`` between the
  device cache and a host cache, ``write_slots`` with ``meta.slot_mapping``, ``gather``;
* ``mgr.metadata(ids, query_lens, out=buf)`` into fixed buffers allocated once.

The "model" is a tiny deterministic numpy transformer-like toy: the q/k/v of a token are sums
of rows of fixed random tables indexed by the token id, its position and a rolling hash of
the token prefix up to it. So K/V of a token depend only on the token prefix, identical
prefixes give bitwise identical K/V (as prefix caching requires), and the values are exactly
reproducible whatever the batch. Attention is a small causal numpy softmax attention.

The oracle: every sequence also keeps a contiguous K/V copy, as an engine without paging
would. At EVERY step, for every sequence of the batch and every layer, the K/V read back from
the paged cache through the metadata (FlashInfer ``kv_indices``, and ``ops.gather`` over the
padded ``block_tables`` row) must equal that copy bitwise, and so must the attention output.
Sampling uses one generator per sequence, so the generated text does not depend on batching,
memory pressure or preemption: a run with a tiny cache produces the same tokens as a roomy
one (tests/test_engine_loop.py checks this).
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

try:
    import kvblocks  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvblocks import (AttentionMetadata, BlockManager, KVCache, KVLayout,
                      hash_blocks, ops)

CTX_BUCKETS = 4096  # rolling prefix hash range


# ---------------------------------------------------------------------------------------------
# the toy model
# ---------------------------------------------------------------------------------------------
class ToyModel:
    """q/k/v = table[token] + table[position] + table[prefix hash]; logits = out @ W."""

    def __init__(self, layout: KVLayout, vocab: int, max_len: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        f32 = np.float32
        self.layout, self.vocab = layout, vocab
        self.tok = rng.standard_normal((3, L, vocab, H, D)).astype(f32)
        self.pos = (0.1 * rng.standard_normal((3, L, max_len, H, D))).astype(f32)
        self.ctx = (0.5 * rng.standard_normal((3, L, CTX_BUCKETS, H, D))).astype(f32)
        self.w_out = rng.standard_normal((H * D, vocab)).astype(f32)
        self.scale = f32(1.0 / np.sqrt(D))

    @staticmethod
    def extend_ctx(ctx: List[int], tokens: List[int]) -> None:
        """Rolling hash of the token prefix, one entry per token."""
        h = ctx[-1] if ctx else 17
        for t in tokens[len(ctx):]:
            h = (h * 131 + t + 1) % CTX_BUCKETS
            ctx.append(h)

    def qkv(self, layer: int, tokens, positions, ctx):
        """q, k, v [n, H, D] of tokens at positions with prefix hashes ctx (elementwise only)."""
        return tuple(self.tok[i, layer, tokens] + self.pos[i, layer, positions]
                     + self.ctx[i, layer, ctx] for i in range(3))

    def attention(self, q, k, v, q_pos):
        """Causal softmax attention of queries at positions q_pos over k, v [L, H, D]."""
        s = np.einsum("qhd,khd->hqk", q, k) * self.scale
        s = np.where(np.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], -np.inf, s)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        return np.einsum("hqk,khd->qhd", s, v)

    def logits(self, out_last):
        return out_last.reshape(-1) @ self.w_out


# ---------------------------------------------------------------------------------------------
# requests and sequences
# ---------------------------------------------------------------------------------------------
WAITING, RUNNING, SWAPPED, DONE = "waiting", "running", "swapped", "done"


@dataclass
class Request:
    rid: int
    prompt: List[int]
    n: int
    max_new: int
    arrival: int


@dataclass
class Seq:
    sid: str
    req: Request
    order: float                 # priority: lower runs first, higher is preempted first
    tokens: List[int]            # prompt + generated; the last may not be committed yet
    ctx: List[int]               # rolling prefix hash per token
    rng: np.random.Generator
    pending_forks: int = 0       # n - 1 until the prompt is done, then the children exist
    ncomputed: int = 0           # tokens whose K/V are in the paged cache
    generated: int = 0
    state: str = WAITING
    ref: Optional[np.ndarray] = None  # contiguous K/V copy [2, layers, n, H, D] (the oracle)


def make_requests(num: int, seed: int, vocab: int, block_size: int, max_prompt: int,
                  max_new: int) -> List[Request]:
    rng = np.random.default_rng(seed + 1)
    systems = [rng.integers(0, vocab, size=int(rng.integers(2, 5)) * block_size).tolist()
               for _ in range(3)]
    reqs: List[Request] = []
    for i in range(num):
        if i >= 4 and rng.random() < 0.15:  # the same prompt again (a retry, a second user)
            prompt = list(reqs[int(rng.integers(0, i))].prompt)
        else:
            sys_prompt = systems[int(rng.integers(0, len(systems)))] if rng.random() < 0.8 else []
            tail = rng.integers(0, vocab, size=int(rng.integers(1, 13))).tolist()
            prompt = (sys_prompt + tail)[:max_prompt]
        n = int(rng.choice([1, 1, 1, 2, 3]))
        reqs.append(Request(i, prompt, n, int(rng.integers(2, max_new + 1)), arrival=i // 3))
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
        self.mgr = BlockManager(args.num_blocks, bs, watermark=args.watermark,
                                num_host_blocks=args.host_blocks)
        self.cache = KVCache(self.layout, args.num_blocks, "cpu", pin_memory=False)
        self.host = (KVCache(self.layout, args.host_blocks, "cpu", pin_memory=False)
                     if args.host_blocks else None)
        self.model = ToyModel(self.layout, args.vocab, self.max_len, args.seed)
        # fixed metadata buffers, allocated once and reused by every step (CUDA-graph style)
        self.max_blocks = -(-self.max_len // bs)
        self.buf = AttentionMetadata.allocate(
            max_batch=args.max_seqs, max_tokens=args.max_tokens,
            max_indices=args.max_seqs * self.max_blocks, max_blocks_per_seq=self.max_blocks)
        self.watermark_blocks = int(args.watermark * (args.num_blocks - 1))
        self.requests = make_requests(args.requests, args.seed, args.vocab, bs,
                                      args.max_prompt, args.max_new)
        self.pending_requests = list(self.requests)
        self.running: List[Seq] = []   # sorted by order
        self.waiting: List[Seq] = []   # sorted by order (recompute-preempted keep their rank)
        self.swapped: List[Seq] = []   # sorted by order
        self.outputs: Dict[str, List[int]] = {}
        self.step_no = 0
        self.stats = dict(steps=0, query_tokens=0, decode_tokens=0, prefill_tokens=0,
                          prompt_tokens_added=0, cached_tokens=0, swap_preemptions=0,
                          recompute_preemptions=0, blocks_swapped_out=0, blocks_swapped_in=0,
                          cow_copies=0, forks=0, peak_usage=0.0, checks=0)

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _insert(queue: List[Seq], s: Seq) -> None:
        bisect.insort(queue, s, key=lambda x: x.order)

    def _slots_in_use(self) -> int:
        return sum(1 + s.pending_forks for s in self.running)

    def flush_copies(self) -> None:
        """Execute pending copy-on-write copies. Done at the canonical point of the step and
        before any free / swap, so that no pending copy names a block that changes hands."""
        pairs = self.mgr.take_copies()
        if len(pairs):
            ops.copy_blocks(self.cache, pairs)
            self.stats["cow_copies"] += len(pairs)

    def preempt(self, s: Seq) -> None:
        self.flush_copies()
        self.running.remove(s)
        nblocks = len(self.mgr.block_table(s.sid))
        mode = self.args.preempt
        if mode == "auto":  # swap what is costly to recompute, while the host has room
            mode = "swap" if s.generated > 0 and len(s.tokens) > 2 * self.args.block_size \
                else "recompute"
        if (mode == "swap" and self.host is not None
                and self.mgr.host_pool.num_free >= nblocks):
            pairs = self.mgr.swap_out(s.sid)
            ops.swap_blocks(self.cache, self.host, pairs)
            s.state = SWAPPED
            self._insert(self.swapped, s)
            self.stats["swap_preemptions"] += 1
            self.stats["blocks_swapped_out"] += len(pairs)
        else:
            self.mgr.free(s.sid)  # keep the tokens; their full blocks stay in the prefix cache
            s.ncomputed = 0
            s.state = WAITING
            self._insert(self.waiting, s)
            self.stats["recompute_preemptions"] += 1

    def finish(self, s: Seq) -> None:
        self.flush_copies()
        self.mgr.free(s.sid)
        self.running.remove(s)
        s.state = DONE
        self.outputs[s.sid] = s.tokens[len(s.req.prompt):]

    def cached_prefix_blocks(self, s: Seq) -> int:
        """Full blocks of s.tokens in the prefix cache now (a lookup, nothing pinned)."""
        h = hash_blocks(s.tokens, self.mgr.block_size, key=self.mgr.pool.hash_key)
        return len(self.mgr.pool.lookup(h))

    def first_chunk(self, s: Seq, budget: int) -> int:
        """Largest first chunk whose uncached part fits the token budget. ``add`` reuses the
        cached full blocks of the chunk (at most (chunk - 1) // block_size of them)."""
        bs = self.mgr.block_size
        hit_blocks = self.cached_prefix_blocks(s)
        c = min(len(s.tokens), hit_blocks * bs + budget)
        while c > 0 and c - bs * min(hit_blocks, (c - 1) // bs) > budget:
            c -= 1
        return c, (bs * min(hit_blocks, (c - 1) // bs) if c > 0 else 0)

    # -- one step ------------------------------------------------------------------------
    def schedule(self):
        """Decide this step's batch: [(seq, query_len)], every query token committed."""
        args, mgr = self.args, self.mgr
        budget = args.max_tokens
        batch: Dict[str, list] = {}

        # 1. swapped sequences come back first (FIFO by priority), keeping the watermark free
        while self.swapped and self._slots_in_use() + 1 + self.swapped[0].pending_forks \
                <= args.max_seqs:
            s = self.swapped[0]
            if mgr.blocks_needed(s.sid, 1) > mgr.pool.num_free - self.watermark_blocks:
                break
            self.flush_copies()
            pairs = mgr.swap_in(s.sid)
            ops.swap_blocks(self.host, self.cache, pairs)
            self.stats["blocks_swapped_in"] += len(pairs)
            self.swapped.pop(0)
            s.state = RUNNING
            self._insert(self.running, s)

        # 2. running sequences with committed, uncomputed tokens (decode): no allocation
        for s in self.running:
            q = mgr.num_tokens(s.sid) - s.ncomputed
            if 0 < q <= budget:
                batch[s.sid] = [s, q]
                budget -= q

        # 3. running sequences with tokens left to commit: the next prefill chunk (or the
        #    sampled token of a swapped-in sequence); preempt the lowest priority if needed
        for s in list(self.running):
            if s.state != RUNNING or s.sid in batch:
                continue
            committed = mgr.num_tokens(s.sid)
            chunk = min(len(s.tokens) - committed, budget)
            if chunk <= 0 or committed > s.ncomputed:
                continue
            while mgr.blocks_needed(s.sid, chunk) > mgr.pool.num_free:
                victim = self.running[-1]
                if victim.sid in batch:
                    budget += batch.pop(victim.sid)[1]
                self.preempt(victim)
                if victim is s:
                    break
            if s.state != RUNNING:
                continue
            mgr.append(s.sid, s.tokens[committed:committed + chunk])
            batch[s.sid] = [s, chunk]
            budget -= chunk

        # 4. admission: new requests and recompute-preempted sequences, in priority order,
        #    only when nothing waits in swap (it has priority), within slots, budget and watermark
        for r in [r for r in self.pending_requests if r.arrival <= self.step_no]:
            self.pending_requests.remove(r)
            s = Seq(f"{r.rid}.0", r, float(r.rid), list(r.prompt), [],
                    np.random.default_rng([self.args.seed, r.rid, 0]), pending_forks=r.n - 1)
            self.model.extend_ctx(s.ctx, s.tokens)
            self._insert(self.waiting, s)
        while self.waiting and not self.swapped and budget > 0:
            s = self.waiting[0]
            if self._slots_in_use() + 1 + s.pending_forks > args.max_seqs:
                break
            chunk, expect_cached = self.first_chunk(s, budget)
            if chunk <= 0 or not mgr.can_add(chunk):
                break
            n_cached = mgr.add(s.sid, s.tokens[:chunk])  # can_add guarantees it fits
            assert n_cached == expect_cached  # nothing ran between the probe and the add
            self.waiting.pop(0)
            self.stats["prompt_tokens_added"] += chunk
            self.stats["cached_tokens"] += n_cached
            s.ncomputed = n_cached
            s.state = RUNNING
            self._insert(self.running, s)
            batch[s.sid] = [s, chunk - n_cached]
            budget -= chunk - n_cached
        order = sorted(batch.values(), key=lambda e: e[0].order)
        return [(s, q) for s, q in order]

    def forward(self, batch) -> Dict[str, np.ndarray]:
        """Compute the batch's query tokens through the paged cache; check against the
        contiguous copies; return the last-token attention output of each sequence."""
        mgr, model, lay = self.mgr, self.model, self.layout
        bs = lay.block_size
        ids = [s.sid for s, _ in batch]
        qlens = [q for _, q in batch]
        meta = mgr.metadata(ids, qlens, out=self.buf)
        assert meta.num_tokens == sum(qlens)
        # token ids, positions and prefix hashes of the query tokens, in batch order
        toks, pos, ctx, lens = [], [], [], []
        for s, q in batch:
            L = mgr.num_tokens(s.sid)
            lens.append(L)
            toks.extend(s.tokens[L - q:L])
            pos.extend(range(L - q, L))
            ctx.extend(s.ctx[L - q:L])
        toks, pos, ctx = np.array(toks), np.array(pos), np.array(ctx)
        assert np.array_equal(meta.seq_lens, lens)
        # the oracle's contiguous copies cover every committed token
        for s, _ in batch:
            self._extend_reference(s, lens[ids.index(s.sid)])
        last_out = {}
        for layer in range(lay.num_layers):
            q_all, k_new, v_new = model.qkv(layer, toks, pos, ctx)
            ops.write_slots(self.cache, layer, k_new, v_new, meta.slot_mapping)
            k_cache, v_cache = self.cache.kv(layer)  # [num_blocks, block_size, H, D] views
            for i, (s, q) in enumerate(batch):
                L = lens[i]
                a, b = meta.qo_indptr[i], meta.qo_indptr[i + 1]
                pages = meta.kv_indices[meta.kv_indptr[i]:meta.kv_indptr[i + 1]]
                assert len(pages) == -(-L // bs)
                assert meta.kv_last_page_len[i] == L - (len(pages) - 1) * bs
                # paged read, FlashInfer-style: pages from kv_indices, the last one partial
                kp = k_cache[pages].reshape(-1, *lay.token_shape)[:L]
                vp = v_cache[pages].reshape(-1, *lay.token_shape)[:L]
                # and FlashAttention-style: the padded block_tables row, through ops.gather
                kg, vg = ops.gather(self.cache, layer, meta.block_tables[i], L)
                kr, vr = s.ref[0, layer, :L], s.ref[1, layer, :L]
                if not (np.array_equal(kp, kr) and np.array_equal(vp, vr)
                        and np.array_equal(kg, kr) and np.array_equal(vg, vr)):
                    raise AssertionError(f"step {self.step_no}: paged K/V of {s.sid} layer "
                                         f"{layer} differ from its contiguous copy")
                out_paged = model.attention(q_all[a:b], kp, vp, pos[a:b])
                out_ref = model.attention(q_all[a:b], kr, vr, pos[a:b])
                if not np.array_equal(out_paged, out_ref):
                    raise AssertionError(f"step {self.step_no}: attention of {s.sid} differs")
                self.stats["checks"] += 1
                if layer == lay.num_layers - 1:
                    last_out[s.sid] = out_paged[-1]
        return last_out

    def _extend_reference(self, s: Seq, upto: int) -> None:
        have = 0 if s.ref is None else s.ref.shape[2]
        if have >= upto:
            return
        lay = self.layout
        new = np.empty((2, lay.num_layers, upto - have) + lay.token_shape, np.float32)
        pos = np.arange(have, upto)
        toks, ctx = np.array(s.tokens[have:upto]), np.array(s.ctx[have:upto])
        for layer in range(lay.num_layers):
            _, new[0, layer], new[1, layer] = self.model.qkv(layer, toks, pos, ctx)
        s.ref = new if s.ref is None else np.concatenate([s.ref, new], axis=2)

    def sample(self, s: Seq, out_last: np.ndarray, rng: np.random.Generator) -> int:
        z = self.model.logits(out_last).astype(np.float64) / self.args.temperature
        p = np.exp(z - z.max())
        return int(rng.choice(len(p), p=p / p.sum()))

    def step(self) -> bool:
        """One engine step; False when every request is done."""
        mgr = self.mgr
        self.step_no += 1
        batch = self.schedule()
        if not batch:
            if not (self.running or self.swapped or self.waiting or self.pending_requests):
                return False
            if not self.running and not self.swapped and self.waiting and \
                    not self.pending_requests:
                raise RuntimeError("a request does not fit the cache even when it is empty")
            return True
        self.stats["steps"] += 1
        # copy-on-write copies queued by append / append_batch, before anything is written
        self.flush_copies()
        last_out = self.forward(batch)
        nq = sum(q for _, q in batch)
        self.stats["query_tokens"] += nq
        usage = mgr.pool.usage
        self.stats["peak_usage"] = max(self.stats["peak_usage"], usage)

        # sample, fork, finish
        to_append: List[Seq] = []
        for s, q in batch:
            s.ncomputed = mgr.num_tokens(s.sid)
            if s.ncomputed < len(s.tokens):
                self.stats["prefill_tokens"] += q
                continue  # more prompt chunks to come
            if q == 1 and s.generated > 0:
                self.stats["decode_tokens"] += 1
            else:
                self.stats["prefill_tokens"] += q
            family = [s]
            for j in range(1, s.pending_forks + 1):  # n > 1: the children share the prompt
                child = Seq(f"{s.req.rid}.{j}", s.req, s.order + j / 100.0, list(s.tokens),
                            list(s.ctx), np.random.default_rng([self.args.seed, s.req.rid, j]),
                            ncomputed=s.ncomputed, generated=s.generated, state=RUNNING,
                            ref=s.ref)
                mgr.fork(s.sid, child.sid)
                self._insert(self.running, child)
                family.append(child)
                self.stats["forks"] += 1
            s.pending_forks = 0
            for member in family:
                member.tokens.append(self.sample(member, last_out[s.sid], member.rng))
                self.model.extend_ctx(member.ctx, member.tokens)
                member.generated += 1
                if member.generated >= member.req.max_new:
                    self.finish(member)
                else:
                    to_append.append(member)

        # commit the sampled tokens: one native call; preempt the lowest priority until it fits
        while to_append and not mgr.can_append([s.sid for s in to_append]):
            victim = self.running[-1]
            self.preempt(victim)
            if victim in to_append:
                to_append.remove(victim)
        mgr.append_batch([s.sid for s in to_append], [s.tokens[-1] for s in to_append])
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
        mgr.check()
        st = dict(self.stats)
        st["requests"] = len(self.requests)
        st["sequences"] = len(self.outputs)
        st["generated_tokens"] = sum(len(v) for v in self.outputs.values())
        st["prefix_hit_rate"] = (st["cached_tokens"] / st["prompt_tokens_added"]
                                 if st["prompt_tokens_added"] else 0.0)
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
    ap.add_argument("--max-prompt", type=int, default=28)
    ap.add_argument("--max-new", type=int, default=14)
    ap.add_argument("--watermark", type=float, default=0.04)
    ap.add_argument("--preempt", choices=["auto", "swap", "recompute"], default="auto")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip BlockManager.check() after every step")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    need = -(-(args.max_prompt + args.max_new + 1) // args.block_size)
    if args.num_blocks - 1 - int(args.watermark * (args.num_blocks - 1)) < need + 1:
        ap.error(f"--num-blocks too small: one sequence may need {need} blocks")
    if args.max_tokens < args.max_seqs:
        ap.error("--max-tokens must be >= --max-seqs (one decode token per sequence)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    summary = Engine(args).run()
    if not args.quiet:
        s = summary
        print(f"requests {s['requests']}, sequences {s['sequences']} (forks {s['forks']}), "
              f"steps {s['steps']}, {s['elapsed_s']:.2f} s")
        print(f"tokens: computed {s['query_tokens']} (prefill {s['prefill_tokens']}, decode "
              f"{s['decode_tokens']}), generated {s['generated_tokens']}")
        print(f"prefix cache: {s['cached_tokens']} of {s['prompt_tokens_added']} prompt tokens "
              f"hit ({100 * s['prefix_hit_rate']:.1f}%)")
        print(f"preemptions: {s['swap_preemptions']} swap ({s['blocks_swapped_out']} blocks out, "
              f"{s['blocks_swapped_in']} in), {s['recompute_preemptions']} recompute; "
              f"copy-on-write copies {s['cow_copies']}")
        print(f"peak usage {100 * s['peak_usage']:.1f}% of {args.num_blocks - 1} blocks; "
              f"{s['checks']} paged-vs-contiguous attention checks passed")
    return summary


if __name__ == "__main__":
    main()
