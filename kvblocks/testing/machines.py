"""EngineMachine: a hypothesis state machine that runs a BlockManager as an engine does and
checks, after every step, that every live sequence reads back exactly its own K/V.

It drives the manager through :class:`~kvblocks.testing.KVReadback` in the documented step
order (``docs/engine-integration.md``): admission (``add``, with prompts that reuse earlier
prompts and whole earlier conversations, so prefix hits happen), preemption (``free``,
``swap_out``, ``truncate``), ``swap_in``, the drain (swap pairs -> ``ops.swap_blocks``, then
``take_copies`` -> ``ops.copy_blocks``), the forward (``metadata`` -> ``write_slots``), commits
(``append_batch``, prefill chunks with ``append``), ``fork``, speculative decoding
(``reserve``, drafts in ``metadata``, ``append(..., computed=True)``) and
``reset_prefix_cache``. Rules come in any order, so preemption lands between a commit and
the step that computes it, and pools are small, so eviction is frequent.

An engine (or another allocator with the BlockManager interface) subclasses it and overrides
:meth:`EngineMachine.make_manager`; ``TestEngine = MyMachine.TestCase`` runs it under pytest.

:class:`GroupsEngineMachine` runs the same workload over a manager with random KV cache
groups (:func:`~kvblocks.testing.strategies.group_configs`): every step builds the metadata
of every group, and after every rule each live sequence reads back, per group, exactly the
history its next step reads (see :class:`~kvblocks.testing.KVReadback`). It adds steps that
recompute from inside the computed positions (allowed only where no group released what the
step reads: the others must be refused), and checks that ``truncate`` refuses exactly the
cuts the release rule forbids. Needs hypothesis.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from .._core import BlockManager
from ..errors import InvalidStateError, OutOfBlocksError
from .readback import KVReadback, ReadbackError, first_needed
from .strategies import group_configs

__all__ = ["EngineMachine", "GroupsEngineMachine", "PREFIXES"]

#: a few shared prefixes (system prompts) so that prompts share blocks and the cache hits
PREFIXES = [list(range(1, 17)), [1, 2, 3, 4, 9, 9, 9, 9, 5, 5], [7] * 16]
TOKENS = st.integers(0, 50)


class EngineMachine(RuleBasedStateMachine):
    """Engine-shaped workload over a real manager and numpy K/V caches (see the module)."""

    seqs = Bundle("seqs")
    layout_kinds = ("NHD", "HND")
    #: drain order: the documented one runs the swap pairs first, the copy-on-write copies last
    swaps_first = True

    def make_manager(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int,
        enable_prefix_caching: bool,
        groups=None,
    ):
        """The manager under test (override to test another one). ``groups`` is given by
        :class:`GroupsEngineMachine` only."""
        return BlockManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host_blocks,
            enable_prefix_caching=enable_prefix_caching,
            groups=groups,
        )

    @initialize(
        num_blocks=st.integers(4, 24),
        bs=st.sampled_from([1, 2, 3, 4]),
        host=st.sampled_from([0, 8, 24]),
        caching=st.sampled_from([True, True, False]),
        kind=st.sampled_from(layout_kinds),
        joint=st.booleans(),
    )
    def setup(self, num_blocks, bs, host, caching, kind, joint):
        self.mgr = self.make_manager(
            num_blocks, bs, num_host_blocks=host, enable_prefix_caching=caching
        )
        self.rb = KVReadback(self.mgr, kind=kind, joint=joint)
        self.next_id = 0
        self.conversations = []  # token histories of finished sequences (next turns)

    # -- helpers ---------------------------------------------------------------------------------
    def _new_id(self):
        self.next_id += 1
        return f"s{self.next_id}" if self.next_id % 2 else self.next_id

    def _running(self):
        return [s for s, e in self.rb.expected.items() if not e.swapped]

    def _is_running(self, sid) -> bool:
        """Live and on the device (a schedule phase may have freed a bundle's sequence)."""
        e = self.rb.expected.get(sid)
        return e is not None and not e.swapped

    def _is_swapped(self, sid) -> bool:
        e = self.rb.expected.get(sid)
        return e is not None and e.swapped

    # -- admission ---------------------------------------------------------------------------------
    @rule(
        target=seqs,
        source=st.integers(0, 63),
        cut=st.integers(0, 40),
        tail=st.lists(TOKENS, max_size=6),
        salt=st.sampled_from([None, None, "t1"]),
    )
    def admit(self, source, cut, tail, salt):
        """A prompt: a prefix of a system prompt, of a live sequence or of a finished
        conversation (the next turn), plus new tokens."""
        bases = PREFIXES + self.conversations + [self.rb.tokens(s) for s in self.rb.expected]
        tokens = bases[source % len(bases)][:cut] + tail
        sid = self._new_id()
        try:
            self.rb.add(sid, tokens, salt=salt)
        except OutOfBlocksError:
            return multiple()
        return sid

    # -- the step ----------------------------------------------------------------------------
    @rule()
    def drain(self):
        """take_copies -> copy_blocks, swap pairs -> swap_blocks."""
        self.rb.drain(swaps_first=self.swaps_first)

    @rule(data=st.data())
    def step(self, data):
        """Drain, then one forward over some running sequences: every committed token not
        computed yet is this step's query."""
        running = self._running()
        batch = data.draw(
            st.lists(st.sampled_from(running), unique=True, max_size=5) if running else st.just([]),
            label="batch",
        )
        self.rb.drain(swaps_first=self.swaps_first)
        self.rb.forward(batch)

    @rule(data=st.data())
    def decode(self, data):
        """Commit one sampled token for some running sequences (one append_batch)."""
        running = self._running()
        if not running:
            return
        batch = data.draw(
            st.lists(st.sampled_from(running), unique=True, min_size=1, max_size=5), label="batch"
        )
        tokens = data.draw(
            st.lists(TOKENS, min_size=len(batch), max_size=len(batch)), label="tokens"
        )
        try:
            self.rb.append_batch(batch, tokens)
        except OutOfBlocksError:
            pass

    @rule(sid=seqs, tokens=st.lists(TOKENS, min_size=1, max_size=6))
    def prefill_chunk(self, sid, tokens):
        """The next chunk of a chunked prefill (append)."""
        if self._is_running(sid):
            try:
                self.rb.append(sid, tokens)
            except OutOfBlocksError:
                pass

    @rule(
        sid=seqs,
        k=st.integers(1, 4),
        accept=st.integers(0, 4),
        drafts=st.lists(TOKENS, min_size=4, max_size=4),
        bonus=st.none() | TOKENS,
    )
    def speculate(self, sid, k, accept, drafts, bonus):
        """Speculative decoding: reserve k slots, drain, a step that computes the uncomputed
        tokens and writes k drafts, commit the accepted drafts as computed, maybe a bonus."""
        if not self._is_running(sid):
            return
        try:
            self.rb.reserve(sid, k)
        except OutOfBlocksError:
            return
        self.rb.drain(swaps_first=self.swaps_first)
        self.rb.forward([sid], drafts=[drafts[:k]])
        try:
            if min(accept, k):
                self.rb.append(sid, drafts[: min(accept, k)], computed=True)
            if bonus is not None:
                self.rb.append(sid, [bonus])
        except OutOfBlocksError:
            pass

    @precondition(lambda self: not self.rb.pending_swaps)
    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        """Parallel sampling: the child shares the parent's blocks. Engines fork right after
        the step that computed the prompt, so every swap of that step has run (a fork between
        swap_in and the swap itself could copy a block before its bytes arrive)."""
        if not self._is_running(parent):
            return multiple()
        child = self._new_id()
        self.rb.fork(parent, child)
        return child

    # -- preemption and finishing ----------------------------------------------------------------
    @rule(sid=seqs, back=st.integers(0, 6))
    def truncate(self, sid, back):
        """Roll back rejected tokens (or the tail of a preempted prefill)."""
        if self._is_running(sid):
            self.rb.truncate(sid, max(0, len(self.rb.tokens(sid)) - back))

    @precondition(lambda self: self.rb.host is not None)
    @rule(sid=seqs)
    def swap_out(self, sid):
        if self._is_running(sid):
            try:
                self.rb.swap_out(sid)
            except OutOfBlocksError:
                pass

    @precondition(lambda self: self.rb.host is not None)
    @rule(sid=seqs)
    def swap_in(self, sid):
        if self._is_swapped(sid):
            try:
                self.rb.swap_in(sid)
            except OutOfBlocksError:
                pass

    @rule(sid=consumes(seqs))
    def free(self, sid):
        """Finish (or preempt by recompute): the conversation may come back as a prompt."""
        if sid in self.rb.expected:
            self._finish(sid)

    def _finish(self, sid) -> None:
        self.conversations = (self.conversations + [self.rb.tokens(sid)])[-6:]
        self.rb.free(sid)

    @rule(target=seqs, data=st.data())
    def schedule_phase(self, data):
        """One schedule phase with no drain in between (the other rules drain often): calls
        that queue pairs (swap_in, swap_out, admission, a copy-on-write append), then calls
        that release their blocks (free, truncate, swap_out, a prompt of new tokens that
        evicts every cached block and ends, reset_prefix_cache), mostly on the sequences the
        first calls touched, then claimants of free blocks (admission, often of a finished
        conversation's next turn whose prefix may be on the host tier, swap_in, append);
        ``check()`` after each call. Every kind of pending pair then meets releases and
        claims before the drain that runs it (docs/host-tier.md, "Pending pairs and released
        blocks")."""
        touched, admitted = [], []
        for phase, calls in (
            ("queue", ["swap_in", "swap_out", "admit", "append"]),
            ("release", ["free", "truncate", "swap_out", "evict", "reset"]),
            ("claim", ["admit", "swap_in", "append"]),
        ):
            for call in data.draw(st.lists(st.sampled_from(calls), max_size=3), label=phase):
                mine = [t for t in touched if t in self.rb.expected]
                pool = mine if mine and data.draw(st.booleans(), label="mine") else None
                pool = pool or sorted(self.rb.expected, key=str)
                sid = data.draw(st.sampled_from(pool), label="seq") if pool else None
                new = self._schedule_call(call, sid, data)
                if new is not None:
                    admitted.append(new)
                if sid is not None:
                    touched.append(sid)
                self.mgr.check()
        return multiple(*[s for s in admitted if s in self.rb.expected])

    def _schedule_call(self, call, sid, data):
        """One call of schedule_phase; returns the id it admitted, if any. A refused call
        changes nothing (the invariant reads every sequence back)."""
        try:
            if call == "admit":
                base = data.draw(st.sampled_from(self.conversations[::-1] + PREFIXES))
                tokens = base[: data.draw(st.integers(0, len(base)), label="cut")]
                new = self._new_id()
                onloads = getattr(self.mgr, "num_pending_onloads", 0)
                self.rb.add(new, tokens + [data.draw(TOKENS, label="tail")])
                if getattr(self.mgr, "num_pending_onloads", 0) > onloads:
                    event("schedule phase: a prompt served from the host")
                return new
            if call == "reset":
                self.mgr.pool.reset_prefix_cache()
            elif call == "evict":  # new tokens take every free block: cached ones demoted
                n = self.mgr.pool.num_free * self.mgr.block_size
                if n:
                    self.rb.add("evictor", [1000 + i for i in range(n)])
                    self.rb.free("evictor")
            elif sid is None:
                pass
            elif call == "swap_in" and self._is_swapped(sid):
                self.rb.swap_in(sid)
                event("schedule phase: swap_in")
            elif call == "swap_out" and self._is_running(sid) and self.rb.host is not None:
                self.rb.swap_out(sid)
            elif call == "free":
                self._finish(sid)
            elif call == "truncate" and self._is_running(sid):
                n = len(self.rb.tokens(sid))
                self.rb.truncate(sid, data.draw(st.integers(0, n), label="keep"))
            elif call == "append" and self._is_running(sid):
                self.rb.append(sid, [data.draw(TOKENS, label="token")])
        except (OutOfBlocksError, InvalidStateError):
            pass
        return None

    @rule()
    def reset_prefix_cache(self):
        try:
            self.mgr.pool.reset_prefix_cache()
        except InvalidStateError:
            pass

    # -- the check ---------------------------------------------------------------------------------
    @invariant()
    def every_sequence_reads_back_its_kv(self):
        if not hasattr(self, "rb"):
            return
        self.mgr.check()
        if self.rb.settled:
            self.rb.assert_all()


class GroupsEngineMachine(EngineMachine):
    """EngineMachine over a manager with random KV cache groups (see the module)."""

    @initialize(
        num_blocks=st.integers(8, 48),
        bs=st.sampled_from([1, 2, 3, 4]),
        host=st.sampled_from([0, 24, 48]),
        caching=st.sampled_from([True, True, False]),
        kind=st.sampled_from(EngineMachine.layout_kinds),
        joint=st.booleans(),
        groups=group_configs(),
    )
    def setup(self, num_blocks, bs, host, caching, kind, joint, groups):
        self.mgr = self.make_manager(
            num_blocks, bs, num_host_blocks=host, enable_prefix_caching=caching, groups=groups
        )
        self.rb = KVReadback(self.mgr, kind=kind, joint=joint)
        self.groups = tuple(groups)
        self.bs = bs
        self.next_id = 0
        self.conversations = []

    # -- what the release rule allows --------------------------------------------------------
    def _tables(self, sid):
        return [self.rb._table(sid, g).tolist() for g in range(len(self.groups))]

    def _released(self, sid, g) -> int:
        """Leading null entries of group g's table: the blocks it released."""
        table = self.rb._table(sid, g)
        return int(np.argmax(table != 0)) if (table != 0).any() else len(table)

    def _reads_released(self, sid, computed, ntokens, query_start=None):
        """The groups whose step (``query_start``) or whose next step after a truncate to
        ``ntokens`` would read a block they released."""
        return [
            g
            for g, group in enumerate(self.groups)
            if group.kind != "state"
            and self._released(sid, g)
            and (
                ntokens == 0
                or first_needed(group, computed, ntokens, query_start) // self.bs
                < self._released(sid, g)
            )
        ]

    @rule(sid=EngineMachine.seqs, back=st.integers(0, 6))
    def truncate(self, sid, back):
        """Roll back: refused (nothing changed) exactly when the shorter sequence's next step
        would read a released block, or a state group would lose computed tokens."""
        if not self._is_running(sid):
            return
        n, nc = len(self.rb.tokens(sid)), self.rb.num_computed(sid)
        k = max(0, n - back)
        refuse = bool(self._reads_released(sid, min(nc, k), k)) or (
            k < nc and any(g.kind == "state" for g in self.groups)
        )
        before = self._tables(sid)
        try:
            self.rb.truncate(sid, k)
        except InvalidStateError:
            if not refuse:
                raise
            assert self._tables(sid) == before and len(self.rb.tokens(sid)) == n
            return
        if refuse:
            raise ReadbackError(f"truncate({sid!r}, {k}) from {n} ({nc} computed) accepted")

    @precondition(lambda self: not self.rb.pending_swaps)
    @rule(target=EngineMachine.seqs, parent=EngineMachine.seqs)
    def fork(self, parent):
        """Fork; a state group copies the parent's state at once (it may not fit)."""
        if not self._is_running(parent):
            return multiple()
        child = self._new_id()
        try:
            self.rb.fork(parent, child)
        except OutOfBlocksError:
            return multiple()
        return child

    @rule(sid=EngineMachine.seqs, back=st.integers(1, 10))
    def recompute(self, sid, back):
        """A step whose query starts ``back`` positions inside the computed ones (an engine
        recomputing a tail): it runs when no group released what it reads; otherwise the
        first such group's metadata refuses it and nothing changes."""
        if not self._is_running(sid):
            return
        n, nc = len(self.rb.tokens(sid)), self.rb.num_computed(sid)
        back = min(back, nc)
        if not back:
            return
        q = n - nc + back
        self.rb.drain(swaps_first=self.swaps_first)
        bad = self._reads_released(sid, nc, n, n - q)
        if not bad:
            self.rb.forward([sid], [q])
            return
        before = self._tables(sid)
        try:
            self.mgr.metadata([sid], [q], group=bad[0])
        except InvalidStateError:
            assert self._tables(sid) == before
            return
        raise ReadbackError(
            f"metadata([{sid!r}], [{q}], group={bad[0]}) reads released blocks but was accepted"
        )

    @rule(data=st.data(), rounds=st.integers(1, 12))
    def decode_steps(self, data, rounds):
        """A few decode steps in a row for some running sequences (commit one token each,
        drain, forward), so that sequences outgrow their windows and chunks."""
        running = self._running()
        if not running:
            return
        batch = data.draw(st.lists(st.sampled_from(running), unique=True, min_size=1, max_size=4))
        for i in range(rounds):
            self.rb.drain(swaps_first=self.swaps_first)
            self.rb.forward(batch)
            try:
                self.rb.append_batch(batch, [(7 * i + len(batch)) % 50] * len(batch))
            except OutOfBlocksError:
                return

    @invariant()
    def every_sequence_reads_back_its_kv(self):
        super().every_sequence_reads_back_its_kv()
        if not hasattr(self, "rb"):
            return
        for sid, e in self.rb.expected.items():
            if e.swapped:
                event("a sequence swapped out")
                continue
            for g, group in enumerate(self.groups):
                if self._released(sid, g):
                    event(f"a {group.kind} group released blocks")
            if e.state is not None and self.rb.settled:
                event("a state read back")
