"""One fuzz input = one engine run, checked against kvblocks.testing's executable spec.

Every call is made on the real ``BlockManager`` (through :class:`kvblocks.testing.KVReadback`,
which writes and reads back every token's K/V) and on :class:`kvblocks.testing.ReferenceManager`
side by side: the reference decides success or the error (``same_error``), results must be
equal, and after every call the whole state is compared (block tables, tokens, computed counts,
ref counts, free lists, prefix cache, pending copies), ``check()`` runs and every settled
sequence must read back exactly its own K/V. :class:`PoolEngine` drives a ``BlockPool`` against
a ``ReferencePool``. Hostile ids, scalars and token arrays come from
:mod:`kvblocks.testing.strategies` (hooked int and str subclasses, ``IndexOnly``, ``HUGE``).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np
from decoder import IDS, SALTS, Config, Input

import kvblocks
from kvblocks import BlockManager, BlockPool, KVBlocksError
from kvblocks.testing import (
    KVReadback,
    ReadbackError,
    ReferenceManager,
    ReferenceMetadata,
    ReferencePool,
    same_error,
)
from kvblocks.testing.reference import seq_id_of
from kvblocks.testing.strategies import HUGE, Effect, IndexOnly, _HookInt, _HookStr

_WEIGHTS = """add:5 append:3 step:8 fork:3 free:3 swap_out:2 swap_in:2 reserve:2 truncate:2
drain:1 reset_cache:1 queries:1 commit_bad:1 hostile_id:2 bad_scalar:2 reentrant:1
pool_admit:2 pool_decode:2 pool_free:1 pool_probe:1 pool_bad:1 pool_reset:1"""
MAX_OPS = 80  # calls decoded from one input at most
MAX_TOKENS = 40  # a sequence never grows past this (keeps runs short)
KEY = b"kvblocks-fuzz-k!"


class Finding(AssertionError):
    """A broken rule. ``kind`` names the rule; the message holds the details and the trace."""

    def __init__(self, kind: str, summary: str, op: str = "", sub: str = "", trace: str = ""):
        super().__init__(f"[{kind}] {summary}\n(during {op})\n{trace}")
        self.kind, self.summary = kind, summary
        self.key = " | ".join(x for x in (kind, op, sub) if x)  # one distinct bug, roughly


def _hooked(cls, value):
    """strategies' hostile subclass equal to ``value`` whose hooks raise (a core that hashes
    or compares the subclass, instead of normalizing it first, sees RuntimeError)."""
    obj = cls(value)
    obj._effect, obj._target, obj._log = Effect("raise", RuntimeError), None, []
    return obj


def _as_list(x: Any) -> Any:
    return np.asarray(x).tolist()


class PoolEngine:
    """The block-level engine of a :class:`Harness`: its own BlockPool against a ReferencePool,
    the vLLM way (hash, lookup_and_pin, allocate, cache after the K/V are written, free)."""

    def pcall(self, name: str, *args, sub: str = ""):
        self.sync_free_order()
        ok, want, got = self.do(name, *args, real=self.pool, spec=self.rpool, sub=sub)
        if ok and name in ("allocate", "lookup", "lookup_and_pin", "ref_count"):
            self.same(name, want, got)
        return ok, want

    def op_pool_admit(self) -> None:
        bs, toks, salt = self.cfg.block_size, self.tokens(1, 12), self.inp.pick(SALTS)
        hashes = kvblocks.hash_blocks(toks, bs, salt=salt, key=KEY)
        ok, hits = self.pcall("lookup_and_pin", hashes)
        if not ok:
            return
        ok, new = self.pcall("allocate", -(-len(toks) // bs) - len(hits))
        if not ok:
            self.pcall("free", hits)
            return
        ids = [int(b) for b in hits] + [int(b) for b in new]
        full = len(toks) // bs  # after the K/V are written: the full blocks enter the cache
        if full > len(hits) and self.inp.bool():
            self.pcall("cache", np.asarray(ids[len(hits) : full]), hashes[len(hits) : full])
        self.pseqs.append((ids, toks))

    def op_pool_decode(self) -> None:
        if self.pseqs:
            ids, _ = self.inp.pick(self.pseqs)
            ok, new = self.pcall("allocate", 1)
            if ok:
                ids.append(int(new[0]))

    def op_pool_free(self) -> None:
        if self.pseqs:  # tail first: the longest prefixes are evicted first
            self.pcall("free", self.pseqs.pop(self.inp.int(0, len(self.pseqs) - 1))[0][::-1])

    def op_pool_probe(self) -> None:
        self.pcall("lookup", kvblocks.hash_blocks(self.tokens(1, 12), self.cfg.block_size, key=KEY))

    def op_pool_bad(self) -> None:
        """Block ids that must be refused (null block, out of range, float, bool, huge) or
        normalized (numpy ints), into free / incref / ref_count."""
        n = self.cfg.pool_blocks
        bad = self.inp.pick([0, n, -1, 1.0, True, np.int64(1), 2**63, [1, 1], [2.5], IndexOnly(1)])
        name = self.inp.pick(["free", "incref", "ref_count"])
        arg = bad if name == "ref_count" or isinstance(bad, list) else [bad]
        ok, _ = self.pcall(name, arg, sub=f" {type(bad).__name__}")
        if ok and name != "ref_count":  # a valid block: undo, so that held blocks keep owners
            self.pcall("incref" if name == "free" else "free", arg)

    def op_pool_reset(self) -> None:
        self.pcall("reset_prefix_cache")


class Harness(PoolEngine):
    def __init__(self, inp: Input) -> None:
        self.inp = inp
        self.op, self.changed = "setup", True
        self.trace: List[str] = []
        self.cfg = c = Config(inp)
        kw = dict(enable_prefix_caching=c.caching, watermark=c.watermark, hash_key=KEY)
        kw["num_host_blocks"] = c.num_host_blocks
        self.mgr = BlockManager(c.num_blocks, c.block_size, enable_kv_events=c.events, **kw)
        self.ref = ReferenceManager(c.num_blocks, c.block_size, **kw)
        lay = dict(num_layers=c.layers, num_kv_heads=c.heads, head_dim=c.head_dim)
        self.rb = KVReadback(self.mgr, kind=c.kind, joint=c.joint, **lay)
        self.pool, self.rpool = BlockPool(c.pool_blocks, hash_key=KEY), ReferencePool(c.pool_blocks)
        self.pseqs: List[Tuple[List[int], List[int]]] = []  # block-level engine: (ids, tokens)
        self.recent: List[List[int]] = []  # tokens of freed sequences (prompts come back)
        n, bs = c.num_blocks, c.block_size
        self.trace += [
            f"import kvblocks; from kvblocks.testing import *; kw = {kw!r}; lay = {lay!r}",
            f"mgr = kvblocks.BlockManager({n}, {bs}, enable_kv_events={c.events}, **kw)",
            f"ref = ReferenceManager({n}, {bs}, **kw); pool = kvblocks.BlockPool({c.pool_blocks})",
            f"rb = KVReadback(mgr, kind={c.kind!r}, joint={c.joint}, **lay); rpool = ...",
        ]

    # -- one call on both sides ----------------------------------------------------------------
    def both(self, text: str, ref_call: Callable, real_call: Callable, sub: str = ""):
        """The reference decides; the core must succeed alike or fail alike. Returns (ok,
        reference result, core result)."""
        self.trace.append(text)
        name = text.split("(")[0].split(".")[-1] + sub
        try:
            want = ref_call()
        except KVBlocksError as expected:
            self.trace.append(f"#   -> {type(expected).__name__}: {expected}")
            try:
                real_call()
            except KVBlocksError as got:
                if same_error(expected, got):
                    return False, None, None
                why = f"the spec raises {type(expected).__name__}({expected}), the core {got!r}"
                raise self.finding("wrong-error", f"{text}: {why}", f"{name} {type(got)}")
            except Exception as got:  # noqa: BLE001 - anything but KVBlocksError is a finding
                raise self._unexpected(text, name, got)
            why = f"the spec raises {type(expected).__name__}: {expected}"
            raise self.finding("accepted-misuse", f"{text} succeeded; {why}", name)
        try:
            got = real_call()
            self.changed = True
        except KVBlocksError as e:
            raise self.finding("spurious-error", f"{text} raised {e!r}", f"{name} {type(e)}")
        except Exception as e:  # noqa: BLE001 - anything but KVBlocksError is a finding
            raise self._unexpected(text, name, e)
        if want is not None and not isinstance(want, (np.ndarray, ReferenceMetadata)):
            self.trace.append(f"#   -> {want!r}")
        return True, want, got

    def do(self, name: str, *args, real: Any = None, spec: Any = None, sub: str = "", **kw):
        """``name(*args, **kw)`` on the spec (default the ReferenceManager) and on ``real``
        (default the manager): :meth:`both`."""
        real, spec = (self.mgr if real is None else real), (self.ref if spec is None else spec)
        who = {id(self.rb): "rb", id(self.pool): "pool"}.get(id(real), "mgr")
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kw.items())])
        return self.both(
            f"{who}.{name}({shown})",
            lambda: getattr(spec, name)(*args, **kw),
            lambda: getattr(real, name)(*args, **kw),
            sub,
        )

    def _unexpected(self, text: str, name: str, e: BaseException) -> Finding:
        kind = "kv-readback" if isinstance(e, ReadbackError) else "unexpected-exception"
        return self.finding(kind, f"{text} raised {type(e).__name__}: {e}", f"{name} {type(e)}")

    def same(self, what: str, want: Any, got: Any) -> None:
        if isinstance(want, np.ndarray) or isinstance(got, np.ndarray):
            w, g = np.asarray(want), np.asarray(got)
            if w.shape == g.shape and bool((w == g).all()):
                return
        elif want == got:
            return
        if _as_list(want) != _as_list(got):
            raise self.finding("model-mismatch", f"{what}: spec {want!r}, core {got!r}", what)

    def finding(self, kind: str, detail: str, sub: str = "") -> Finding:
        return Finding(kind, detail, self.op, sub, self.render())

    def render(self) -> str:
        return "\n".join(self.trace[-400:])

    # -- choosing things -----------------------------------------------------------------------
    def live(self, swapped: Optional[bool] = None) -> List[Any]:
        r = self.ref
        return [s for s in r.seq_ids() if swapped is None or r.is_swapped(s) == swapped]

    def pick_any_id(self):
        """Mostly live ids, sometimes unknown ones."""
        ids = self.live()
        if ids and self.inp.int(0, 4):
            return self.inp.pick(ids)
        return self.inp.pick(IDS)

    def new_id(self):
        free = [i for i in IDS if i not in self.ref]
        return self.inp.pick(free) if free else None

    def tokens(self, lo: int = 0, hi: int = 10) -> List[int]:
        sources = [list(self.ref.token_ids(s)) for s in self.ref.seq_ids()] + self.recent
        return self.inp.tokens(sources, lo, hi)

    def real(self, sid):
        """The readback for a sequence it tracks (it writes and checks its K/V), else the
        manager itself (a call that must fail)."""
        return self.rb if sid in self.rb.expected else self.mgr

    def room(self, sid, n: int) -> bool:
        return sid not in self.ref or self.ref.num_tokens(sid) + n <= MAX_TOKENS

    # -- the manager's calls -------------------------------------------------------------------
    def op_add(self) -> None:
        sid = self.pick_any_id() if self.inp.int(0, 5) == 0 else self.new_id()
        toks, salt = self.tokens(0, 14), self.inp.pick(SALTS)
        ok, want, got = self.do("add", sid, toks, salt=salt, real=self.rb)
        if ok:
            self.same("add hits", want, got)

    def op_append(self) -> None:
        sid, toks = self.pick_any_id(), self.tokens(0, 6)
        if self.room(sid, len(toks)):
            self.do("append", sid, toks, real=self.real(sid))

    def op_step(self) -> None:
        """Drain, then one forward over some running sequences (query lengths mostly right,
        sometimes a gap or one too many; drafts into reserved slots), then a decode commit."""
        self.drain()
        live, inp, bs = self.live(swapped=False), self.inp, self.cfg.block_size
        batch = list(dict.fromkeys(inp.pick(live) for _ in range(inp.int(0, 4)))) if live else []
        q, drafts = [], []
        for s in batch:
            n, c = self.ref.num_tokens(s), self.ref.num_computed(s)
            q.append(inp.pick([n - c, n - c, n - c, n, max(0, n - c - 1), n + 1]))
            slack = len(self.ref.block_table(s)) * bs - n
            drafts.append([inp.int(0, 3) for _ in range(inp.pick([0, 0, max(0, slack), 1]))])
        d = drafts if any(drafts) and inp.bool() else None
        ok, want, got = self.both(
            f"rb.forward({batch!r}, {q}, drafts={d})",
            lambda: self.ref.metadata(
                batch, q, draft_lens=None if d is None else list(map(len, d))
            ),
            lambda: self.rb.forward(batch, q, drafts=d),
        )
        if ok:
            for name in ("slot_mapping", "seq_lens", "kv_indptr", "kv_indices", "kv_last_page_len"):
                self.same(f"metadata {name}", getattr(want, name), getattr(got, name))
            for row, table in enumerate(want.block_tables.tolist()):
                used = -(-int(want.seq_lens[row]) // bs)
                self.same("metadata block_tables", table[:used], got.block_tables[row][:used])
        if ok and d is not None and inp.bool():  # accept some drafts (computed=True)
            for s, t in zip(batch, d):
                if t and self.room(s, len(t)):
                    self.do("append", s, t[: inp.int(1, len(t))], computed=True, real=self.rb)
            return
        batch = [s for s in batch if s in self.ref and self.room(s, 1)]
        self.do("append_batch", batch, [inp.int(0, 3) for _ in batch], real=self.rb)

    def op_fork(self) -> None:
        parent, child = self.pick_any_id(), self.new_id()
        if not self.rb.pending_swaps:  # engines fork after the step that ran the swaps
            self.do("fork", parent, child, real=self.real(parent))

    def op_free(self) -> None:
        sid = self.pick_any_id()
        if sid in self.ref:
            self.recent = (self.recent + [list(self.ref.token_ids(sid))])[-4:]
        self.do("free", sid, real=self.real(sid))

    def op_swap_out(self, direction: str = "out") -> None:
        sid = self.pick_any_id()
        ok, want, got = self.do("swap_" + direction, sid, real=self.real(sid))
        if ok:
            self.same(f"swap_{direction} pairs", want, got)

    def op_swap_in(self) -> None:
        self.op_swap_out("in")

    def op_reserve(self) -> None:
        sid, n = self.pick_any_id(), self.inp.int(0, 7)
        if self.room(sid, n):
            self.do("reserve", sid, n, real=self.real(sid))

    def op_truncate(self) -> None:
        sid = self.pick_any_id()
        n = (self.ref.num_tokens(sid) if sid in self.ref else 3) - self.inp.int(-1, 6)
        self.do("truncate", sid, n, real=self.real(sid))

    def drain(self) -> None:
        """swap pairs -> ops.swap_blocks, take_copies -> ops.copy_blocks (the spec's copies)."""
        self.trace.append("rb.drain()")
        self.changed = True
        try:
            got = self.rb.drain()
        except Exception as e:  # noqa: BLE001 - ops refused pairs the manager returned
            raise self._unexpected("rb.drain()", "drain", e)
        self.same("take_copies", self.ref.take_copies(), got)

    op_drain = drain

    def op_reset_cache(self) -> None:
        self.do("reset_prefix_cache", real=self.mgr.pool, spec=self.ref.pool)

    def op_queries(self) -> None:
        inp, sid = self.inp, self.pick_any_id()
        n = inp.int(0, 9)
        ids = list(dict.fromkeys(self.pick_any_id() for _ in range(inp.int(0, 3))))
        for name, args in (
            ("blocks_needed", (sid, n)),
            ("can_append", (ids, n)),
            ("can_add", (n * 4,)),
            ("blocks_for_tokens", (n * 3,)),
        ):
            ok, want, got = self.do(name, *args)
            if ok:
                self.same(name, want, got)

    def op_commit_bad(self) -> None:
        """append_batch misuse: a repeated id, an unknown one, too few or too many tokens."""
        live, inp = self.live(), self.inp
        ids = [inp.pick(live) for _ in range(inp.int(1, 3))] if live else []
        ids += [inp.pick(IDS)] if inp.bool() else []
        toks = [inp.int(0, 3) for _ in range(len(ids) + inp.int(-1, 1))]
        tracked = all(s in self.rb.expected for s in ids) and len(ids) == len(toks)
        if all(self.room(s, 1) for s in ids):
            self.do("append_batch", ids, toks, real=self.rb if tracked else self.mgr)

    # -- hostile arguments (strategies' hostile ints and strs: their hooks raise) --------------
    def disguise(self, sid):
        """An object that may stand for ``sid``: numpy ints alias it, bool / float / None and
        the rest are refused, int and str subclasses must be normalized without running them."""
        i = type(sid) is int
        return self.inp.pick(
            [
                lambda: _hooked(_HookInt, sid) if i else _hooked(_HookStr, sid),
                lambda: np.int64(sid) if i else np.str_(sid),
                lambda: float(sid) if i else sid.encode(),
                lambda: True,
                lambda: np.bool_(False),
                lambda: None,
                lambda: (sid,),
                lambda: np.uint8(sid) if i else _hooked(_HookStr, sid),
            ]
        )()

    def op_hostile_id(self) -> None:
        obj = self.disguise(self.pick_any_id())
        name = self.inp.pick(["num_tokens", "block_table", "is_swapped", "blocks_needed", "free"])
        args = (obj, 1) if name == "blocks_needed" else (obj,)
        ok, want, got = self.do(name, *args, sub=f" {type(obj).__name__}")
        if ok and name == "free":
            del self.rb.expected[seq_id_of(obj)]
        elif ok:
            self.same(name, want, got)

    def op_bad_scalar(self) -> None:
        sid, inp = self.pick_any_id(), self.inp
        val = inp.pick(
            [True, False, 2.5, np.float64(1.0), None, "3", -1, np.int64(2), np.uint8(1)]
            + [IndexOnly(1), inp.pick(HUGE), -(2**63), _hooked(_HookInt, 2)]
        )
        name = inp.pick(["reserve", "truncate", "blocks_needed", "can_add", "blocks_for_tokens"])
        args = (val,) if name in ("can_add", "blocks_for_tokens") else (sid, val)
        if name != "reserve" or self.room(sid, 8):
            ok, want, got = self.do(name, *args, sub=f" {type(val).__name__}")
            if ok and name in ("reserve", "truncate"):
                self.resync(sid)
            elif ok:
                self.same(name, want, got)

    def op_reentrant(self) -> None:
        """Token arrays that must be refused: 2-D, float, object, out of int32, or holding an
        int subclass whose hooks raise (to be read without running them)."""
        arr = self.inp.pick(
            [
                lambda: np.ones((2, 2), dtype=np.int64),
                lambda: np.array([1.5, 2.0]),
                lambda: np.array([1, "a"], dtype=object),
                lambda: np.array([2**40], dtype=np.int64),
                lambda: [1, 2**31],
                lambda: [1, _hooked(_HookInt, 2)],
            ]
        )()
        call = self.inp.pick(["append", "add"])
        sid = self.new_id() if call == "add" else self.pick_any_id()
        if self.do(call, sid, arr)[0]:
            if call == "add":  # accepted alike: the readback never saw it, so it goes
                self.do("free", sid)
            self.resync(sid)

    def resync(self, sid) -> None:
        """After a hostile call both sides accepted, the readback's record of ``sid`` follows
        the spec's tokens (cut where they differ, then the new tokens committed)."""
        e = self.rb.expected.get(sid)
        if e is None:
            return
        want = [int(t) for t in self.ref.token_ids(sid)]
        k = 0
        while k < min(len(want), len(e.tokens)) and want[k] == e.tokens[k]:
            k += 1
        if k < len(e.tokens):
            del e.tokens[k:], e.hashes[k:]
            e.computed, e.drafts = min(e.computed, k), []
        if k < len(want):
            self.rb._commit(e, want[k:])

    # -- the check after every call ------------------------------------------------------------
    def sync_free_order(self) -> None:
        for real, ref in self.pools():
            if not ref.free_order_known:
                ref.adopt_free_order(_as_list(real.free_list()))  # same set, order open

    def pools(self):
        out = [(self.mgr.pool, self.ref.pool), (self.pool, self.rpool)]
        if self.ref.host_pool is not None:
            out.append((self.mgr.host_pool, self.ref.host_pool))
        return out

    def verify(self) -> None:
        mgr, ref = self.mgr, self.ref
        try:
            mgr.check()
            self.pool.check()
        except KVBlocksError as e:
            raise self.finding("corruption", f"check() failed: {e}")
        try:
            self.sync_free_order()
            same = self.same
            live = [sorted(map(repr, m.seq_ids())) for m in (ref, mgr)]
            same("live sequences", *live)
            for sid in ref.seq_ids():
                same(f"block_table({sid!r})", ref.block_table(sid), mgr.block_table(sid))
                same(f"token_ids({sid!r})", ref.token_ids(sid), mgr.token_ids(sid))
                same(f"num_computed({sid!r})", ref.num_computed(sid), mgr.num_computed(sid))
                same(f"is_swapped({sid!r})", ref.is_swapped(sid), mgr.is_swapped(sid))
            for real, rp in self.pools():
                same("ref counts", rp.ref_counts(), real.ref_counts())
                same("free list", rp.free_list(), real.free_list())
                cached = [
                    (b, real.block_hash(b)) for b in range(real.num_blocks) if real.is_cached(b)
                ]
                same("prefix cache", sorted(rp.cached().items()), cached)
            same("pending copies", ref.num_pending_copies, mgr.num_pending_copies)
            same("evictions", ref.pool.evictions, mgr.pool.stats.evictions)
            ref.check()
        except AssertionError as e:
            if isinstance(e, Finding):
                raise
            raise self.finding("model-mismatch", str(e))
        if self.changed and self.rb.settled:  # K/V and tables move only when a call succeeded
            self.changed = False
            try:
                self.rb.assert_all()
            except ReadbackError as e:
                raise self.finding("kv-readback", str(e).splitlines()[0])

    #: (method, weight): the decoder's op byte picks from this table
    OPS = [(f"op_{n}", int(w)) for n, w in (x.split(":") for x in _WEIGHTS.split())]
    TABLE = [name for name, w in OPS for _ in range(w)]

    def run(self) -> int:
        self.verify()
        n = 0
        while self.inp.left() and n < MAX_OPS:
            self.op = name = self.inp.pick(self.TABLE)
            self.trace.append(f"# -- {name}")
            getattr(self, name)()
            self.verify()
            n += 1
        self.op = "final drain"
        self.drain()
        self.verify()
        return n
