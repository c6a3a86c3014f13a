"""The release boundary of sliding-window and chunked-local groups, at every offset of the
newest token (or of the step's first query) inside its block, for spans around the block
size: exactly which blocks are released after append / append_batch, after a step whose
query starts inside the prompt (chunked prefill), and while speculative drafts are verified.

The expected boundary is computed here from the documented rule (docs/hybrid-models.md): the
step's first query q0 reads from q0 - W + 1 (window W) or q0 - q0 % C (chunk C); every whole
block below that is released (null entry, its reference dropped), none at or above it.
"""

import pytest

from kvblocks import BlockManager, KVGroup

BS = 4
KINDS = ("sliding_window", "chunked_local")
SPANS = (1, BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1)
PROMPT_END = 4 * BS + 3


def first_read(kind, span, q):
    """The first position the query at q reads."""
    return max(0, q - span + 1) if kind == "sliding_window" else q - q % span


def manager(kind, span, **kw):
    g = KVGroup(kind, window=span) if kind == "sliding_window" else KVGroup(kind, chunk=span)
    return BlockManager(256, BS, groups=(KVGroup("full"), g), enable_prefix_caching=False, **kw)


class Boundary:
    """Checks group 1's table of one sequence against the released count the rule gives."""

    def __init__(self, mgr, sid, kind, span):
        self.mgr, self.sid, self.kind, self.span = mgr, sid, kind, span
        self.seen = dict(enumerate(mgr.block_table(sid, group=1).tolist()))  # index -> block

    def expect(self, q0, why):
        lo = first_read(self.kind, self.span, q0) // BS
        table = self.mgr.block_table(self.sid, group=1).tolist()
        for i, b in enumerate(table):
            if b:
                self.seen[i] = b
        assert table[:lo] == [0] * lo, (why, q0, table)
        assert 0 not in table[lo:], (why, q0, table)
        now = {b for g in (0, 1) for b in self.mgr.block_table(self.sid, group=g).tolist()}
        for i in range(lo):  # released: the reference dropped (unless reused since)
            if self.seen.get(i, 0) not in now:
                assert self.mgr.pool.ref_count(self.seen[i]) == 0, (why, i)
        for b in table[lo:]:
            assert self.mgr.pool.ref_count(b) == 1, (why, b)
        assert 0 not in self.mgr.block_table(self.sid, group=0).tolist()  # full: never
        held = len(table) - lo + len(self.mgr.block_table(self.sid, group=0))
        assert self.mgr.blocks_in_use(self.sid) == held
        self.mgr.check()
        return lo


def assert_reads_held(meta, row, kind, span, queries):
    """Every position a query of the step reads has a real block in the metadata's table."""
    table = meta.block_tables[row].tolist()
    for q in queries:
        for p in range(first_read(kind, span, q), q + 1):
            assert table[p // BS] != 0, (q, p, table)


@pytest.mark.parametrize("offset", range(BS))
@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("kind", KINDS)
def test_release_after_append_at_every_offset(kind, span, offset):
    """The newest token lands at p = k * BS + offset: append (or append_batch) releases
    exactly the blocks below what the query at p reads; the step that computes it (query
    start p) releases nothing more."""
    for k in range(4):
        p = k * BS + offset
        if p == 0:
            continue
        mgr = manager(kind, span)
        for sid, batch in (("a", False), ("b", True)):
            mgr.add(sid, list(range(p)))
            mgr.schedule([sid], [p])
            chk = Boundary(mgr, sid, kind, span)
            chk.expect(0, "after the prompt's step")
            if batch:
                mgr.append_batch([sid], [99])
            else:
                mgr.append(sid, [99])
            chk.expect(p, "append")
            meta = mgr.metadata([sid], [1], group=1)
            assert_reads_held(meta, 0, kind, span, [p])
            assert meta.slot_mapping.tolist() == [
                mgr.block_table(sid, group=1)[p // BS] * BS + p % BS
            ]
            chk.expect(p, "the step")
            mgr.metadata([sid], [1], group=0)


@pytest.mark.parametrize("offset", range(BS))
@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_keeps_what_the_next_chunks_read(kind, span, offset):
    """A prompt prefilled from s = k * BS + offset on (the first chunk computed): appending
    the rest and the step whose query starts at s release only what the query at s cannot
    read; every position any query of the chunk reads is held; the decode after it moves
    the boundary to the newest token."""
    prompt = list(range(PROMPT_END))
    for k in range(4):
        s = k * BS + offset
        if s == 0:
            continue
        mgr = manager(kind, span)
        mgr.add("a", prompt[:s])
        mgr.schedule(["a"], [s])
        chk = Boundary(mgr, "a", kind, span)
        mgr.append("a", prompt[s:])  # the rest of the prompt, not computed yet
        chk.expect(s, "append of the remaining chunk")
        meta = mgr.metadata(["a"], [PROMPT_END - s], group=1)
        assert_reads_held(meta, 0, kind, span, range(s, PROMPT_END))
        chk.expect(s, "the step whose query starts at s")
        mgr.metadata(["a"], [PROMPT_END - s], group=0)
        mgr.append("a", [7])
        chk.expect(PROMPT_END, "the first decode")


@pytest.mark.parametrize("offset", range(BS))
@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunk_after_chunk(kind, span, offset):
    """Chunks of BS - 1 tokens starting at every offset: each append of a chunk and each step
    releases exactly what the chunk's first query cannot read."""
    prompt = list(range(PROMPT_END))
    mgr = manager(kind, span)
    first = BS + offset
    mgr.add("a", prompt[:first])
    mgr.schedule(["a"], [first])
    chk = Boundary(mgr, "a", kind, span)
    s = first
    while s < PROMPT_END:
        end = min(PROMPT_END, s + BS - 1)
        mgr.append("a", prompt[s:end])
        chk.expect(s, f"append of chunk [{s}, {end})")
        meta = mgr.metadata(["a"], [end - s], group=1)
        assert_reads_held(meta, 0, kind, span, range(s, end))
        chk.expect(s, f"step of chunk [{s}, {end})")
        mgr.metadata(["a"], [end - s], group=0)
        s = end


@pytest.mark.parametrize("offset", range(BS))
@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("kind", KINDS)
def test_speculative_verify_keeps_what_it_reads(kind, span, offset):
    """The newest committed token at p = k * BS + offset, d drafts reserved and verified:
    the verify step releases only below what the query at p reads and every position the
    d + 1 queries read is held; accepting a drafts (append computed=True) releases by the
    computed count before the call (p + 1), the next step up to the newest draft, a bonus
    token one further."""
    for k in range(1, 4):
        p = k * BS + offset
        for d in (1, 2, BS + 1):
            for a in sorted({0, 1, d}):
                mgr = manager(kind, span)
                mgr.add("a", list(range(p)))
                mgr.schedule(["a"], [p])
                mgr.append("a", [50])  # the newest committed token, at p
                chk = Boundary(mgr, "a", kind, span)
                chk.expect(p, "append")
                mgr.reserve("a", d)
                chk.expect(p, "reserve")
                meta = mgr.metadata(["a"], [1], draft_lens=[d], group=1)
                assert_reads_held(meta, 0, kind, span, range(p, p + d + 1))
                assert len(meta.slot_mapping) == d + 1
                chk.expect(p, "the verify step")
                mgr.metadata(["a"], [1], draft_lens=[d], group=0)
                if a:
                    mgr.append("a", list(range(60, 60 + a)), computed=True)
                    # released by the computed count before the call (p + 1): the drafts'
                    # positions are kept one step longer, never less
                    chk.expect(p + 1, f"accepting {a} of {d} drafts")
                    mgr.metadata(["a"], [1], group=1)  # the step recomputing the newest
                    chk.expect(p + a, "the step after accepting")
                    mgr.metadata(["a"], [1], group=0)
                else:
                    mgr.truncate("a", p + 1)  # all rejected: roll back, nothing moves
                    chk.expect(p, "rejecting every draft")
                mgr.append("a", [70])  # the bonus token, not computed
                chk.expect(p + a + 1, "the bonus token")
