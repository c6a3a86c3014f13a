"""Suite ``groups``: what KV cache groups (docs/hybrid-models.md) cost the decode step.

Every operation is timed twice in the same run: on a manager with a full and a
sliding-window group (``kvblocks``) and as the same call on a manager with the one default
full group (``single-group``), at the same context length, so the ``x single-group`` column
is the groups' overhead factor inverted (0.50x: the grouped call takes twice as long). Block
size 16, 256 sequences decoding in lock step; their contexts are staggered by one token
each, so about 16 sequences cross a block boundary, and with a window about 16 release a
block, at every step.

- ``append_batch/w=128/ctx=2k``: one decode step's ``append_batch`` of a token to each of the
  256 sequences at about 2K tokens of context (window 128 tokens, gpt-oss style). The step is
  scheduled (untimed) before each call, so each call moves the window on and releases what it
  left behind. Target (issue 12): at most 2x the single-group call.
- ``append_batch/w=W/ctx=C``: the same step at C = 1K, 8K and 32K tokens and windows of 128
  and 1,024 tokens. Release is O(1) amortised per sequence per step when the cost per
  sequence stays flat as C grows (``release_scaling`` in the JSON: the largest over the
  smallest per-sequence p50 of each window).
- ``metadata/group0``: ``metadata(..., group=0, out=buf)`` for a 256 x 2K decode on the
  two-group manager against today's single-group ``metadata(..., out=buf)``: target "as
  fast" (a ratio within ``METADATA_TOLERANCE`` of 1). ``metadata/group0/advancing`` does the
  same with a real decode step (``append_batch``, untimed) before every call, and
  ``metadata/group1`` builds the window group's metadata (no target).

Sequences grow by one token per sample; every ``SPAN`` steps they are freed and added again
(untimed), so contexts stay within ``[C, C + SPAN + 16)``. Each grouped case's check asserts
after the timing that the timed call really released: over 16 more steps every sequence's
window group releases exactly one block inside ``append_batch`` (none in ``schedule``) and
holds no more than the window needs, so the suite cannot silently time a step that releases
nothing.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from .._core import BlockManager
from ..groups import KVGroup
from ..metadata import AttentionMetadata
from .timing import Case, Op, Settings

__all__ = ["build", "release_scaling"]

BS = 16
NSEQ = 256
SPAN = 512  # decode steps between rebuilds
CONTEXT = 2048
WINDOW = 128
SCALING = {128: (1024, 8192, 32768), 1024: (1024, 8192, 32768)}
TARGETS = {"append_batch": 2.0, "metadata/group0": 1.1}
METADATA_TOLERANCE = 0.1


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k"


class _Decoding:
    """NSEQ sequences decoding in lock step at about ``context`` tokens, on one manager."""

    def __init__(self, context: int, window: Optional[int], seed: int) -> None:
        groups = [KVGroup("full")]
        if window:
            groups.append(KVGroup("sliding_window", window=window))
        self.context, self.window = context, window
        per_seq = -(-(context + BS + SPAN + 2) // BS)  # a prompt takes blocks in every group
        self.mgr = BlockManager(NSEQ * len(groups) * (per_seq + 1) + 64, BS, groups=tuple(groups))
        self.ids = list(range(NSEQ))
        self.rng = np.random.default_rng(seed)
        self.toks = self.rng.integers(0, 32000, NSEQ, dtype=np.int32)
        self.ones = np.ones(NSEQ, dtype=np.int32)
        self.live = False
        nb = per_seq + 1
        self.other = AttentionMetadata.allocate(NSEQ, NSEQ, NSEQ * nb, nb) if window else None
        self.rebuild()

    def rebuild(self) -> None:
        """Fresh prompts, computed, then one step: the window's bulk release after the prompt
        is paid here, untimed; the timed steps see the steady state."""
        mgr = self.mgr
        if self.live:
            for i in self.ids:
                mgr.free(i)
        mgr.pool.reset_prefix_cache()
        for i in self.ids:
            n = self.context + i % BS
            mgr.add(i, self.rng.integers(0, 32000, n, dtype=np.int32))
        self.live = True
        self.sb = mgr.batch(self.ids)
        mgr.schedule(self.sb, [mgr.num_tokens(i) for i in self.ids])
        mgr.append_batch(self.sb, self.toks)
        mgr.schedule(self.sb, self.ones)
        self.steps = 0

    def before_append(self) -> None:
        """Untimed: the previous step's token computed (the engine's forward), or a rebuild."""
        if self.steps >= SPAN:
            self.rebuild()
        else:
            self.mgr.schedule(self.sb, self.ones)

    def append(self) -> None:
        self.mgr.append_batch(self.sb, self.toks)
        self.steps += 1

    def before_metadata(self) -> None:
        """Untimed: the decode step's append_batch, and the window group's metadata (each
        ``metadata(group=g)`` declares the step for its group; the timed call is group 0's)."""
        if self.steps >= SPAN:
            self.rebuild()
        self.append()
        if self.window:
            self.mgr.metadata(self.sb, self.ones, group=1, out=self.other)

    def window_held(self) -> List[int]:
        """Per sequence, the blocks its window group holds (0 without one)."""
        mgr = self.mgr
        full = [-(-mgr.num_tokens(i) // BS) for i in self.ids]
        return [mgr.blocks_in_use(i) - f for i, f in zip(self.ids, full)]

    def check_releases(self) -> None:
        """The timed step really releases. Runs BS more steps exactly as the timed case does
        (``before_append``, then ``append``): over them each sequence's window group must
        release exactly one block, inside ``append`` (the untimed ``before_append`` releases
        nothing), and never hold more than its window needs. Without a window group: nothing
        held beyond the full table."""
        mgr = self.mgr
        mgr.check()
        if self.steps + BS >= SPAN:
            self.rebuild()
        if not self.window:
            assert len(mgr.groups) == 1 and set(self.window_held()) == {0}
            return
        bound = self.window // BS + 2  # [q0 - W + 1, q0] spans at most W // BS + 2 blocks
        held = start = self.window_held()
        for _ in range(BS):
            self.before_append()
            assert self.window_held() == held, "the untimed part of the step released blocks"
            self.append()
            held = self.window_held()
            assert max(held) <= bound, f"a window group holds {max(held)} blocks (> {bound})"
        assert held == start, "append_batch did not release one block per sequence in BS steps"
        table = mgr.block_table(0, group=1)
        assert table[0] == 0 and np.count_nonzero(table) <= bound
        mgr.check()


def _append_case(d: _Decoding, impl: str) -> Case:
    return Case(impl, d.append, inner=1, setup=d.before_append, check=d.check_releases)


def _append_ops() -> List[Op]:
    single: Dict[int, Case] = {}
    ops = []

    def op(window: int, context: int, target: bool) -> Op:
        if context not in single:
            single[context] = _append_case(_Decoding(context, None, 1), "single-group")
        grouped = _append_case(_Decoding(context, window, 2), "kvblocks")
        text = f"append_batch {NSEQ} seqs x {_k(context)}, full + window {window}"
        note = (
            "decode step, scheduled (untimed) before each call; the window group releases "
            f"about 16 blocks per call; target <= {TARGETS['append_batch']:g}x the "
            "single-group call"
            if target
            else "window release: the cost per sequence stays flat as the context grows"
        )
        return Op(
            f"append_batch/w={window}/ctx={_k(context)}",
            text,
            "seq",
            NSEQ,
            [grouped, single[context]],
            note=note,
        )

    ops.append(op(WINDOW, CONTEXT, True))
    for window, contexts in SCALING.items():
        ops += [op(window, c, False) for c in contexts]
    return ops


def _metadata_ops() -> List[Op]:
    nb = -(-(CONTEXT + BS + SPAN + 2) // BS)

    def buf() -> AttentionMetadata:
        return AttentionMetadata.allocate(NSEQ, NSEQ, NSEQ * nb, nb)

    grouped, single = _Decoding(CONTEXT, WINDOW, 3), _Decoding(CONTEXT, None, 4)
    adv_g, adv_s = _Decoding(CONTEXT, WINDOW, 5), _Decoding(CONTEXT, None, 6)
    bufs = [buf() for _ in range(5)]

    def meta(d: _Decoding, out: AttentionMetadata, group: Optional[int]) -> Callable[[], object]:
        if group is None:  # today's call, no group argument
            return lambda: d.mgr.metadata(d.sb, d.ones, out=out)
        return lambda: d.mgr.metadata(d.sb, d.ones, out=out, group=group)

    def agree(d: _Decoding, out: AttentionMetadata, group: int) -> Callable[[], None]:
        def check() -> None:  # the reused buffer holds the fresh result: group g's table
            fresh = d.mgr.metadata(d.sb, d.ones, group=group)
            inc = d.mgr.metadata(d.sb, d.ones, out=out, group=group)
            for key, v in fresh.as_dict().items():
                got = getattr(inc, key)
                if key == "block_tables":
                    assert not got[:, v.shape[1] :].any()
                    got = got[:, : v.shape[1]]
                assert np.array_equal(got, v), key
            rows = [d.mgr.block_table(i, group=group) for i in d.ids]
            assert np.array_equal(inc.kv_indices, np.concatenate(rows))
            if group == 1:
                assert (inc.block_tables[:, 0] == 0).all()  # released: the null block
            d.check_releases()

        return check

    base = Case("single-group", meta(single, bufs[0], None), inner=1)
    base_adv = Case(
        "single-group", meta(adv_s, bufs[1], None), inner=1, setup=adv_s.before_metadata
    )
    label = f"metadata decode {NSEQ}x{_k(CONTEXT)}"
    return [
        Op(
            "metadata/group0",
            f"{label}, group=0 of full + window {WINDOW}, out=",
            "block",
            NSEQ * (CONTEXT // BS),
            [
                Case(
                    "kvblocks", meta(grouped, bufs[2], 0), inner=1, check=agree(grouped, bufs[2], 0)
                ),
                base,
            ],
            note=f"target: as fast as the single-group call (within {METADATA_TOLERANCE:.0%})",
        ),
        Op(
            "metadata/group0/advancing",
            f"{label}, group=0, decode advancing",
            "block",
            NSEQ * (CONTEXT // BS),
            [
                Case(
                    "kvblocks",
                    meta(adv_g, bufs[3], 0),
                    inner=1,
                    setup=adv_g.before_metadata,
                    check=agree(adv_g, bufs[3], 0),
                ),
                base_adv,
            ],
            note="one append_batch (untimed, releasing in the window group) before each call",
        ),
        Op(
            "metadata/group1",
            f"{label}, group=1 (window {WINDOW}), out=",
            "block",
            NSEQ * (CONTEXT // BS),
            [
                Case(
                    "kvblocks", meta(grouped, bufs[4], 1), inner=1, check=agree(grouped, bufs[4], 1)
                ),
                base,
            ],
            note="the window group's tables: released positions read the null block 0",
        ),
    ]


def build(s: Settings, vllm=None) -> Tuple[List[Op], dict]:
    facts = {
        "block_size": BS,
        "num_seqs": NSEQ,
        "groups": f"full + sliding_window (window {WINDOW}; scaling: {', '.join(map(str, SCALING))})",
        "target_ratio": dict(TARGETS),
    }
    return _append_ops() + _metadata_ops(), facts


def release_scaling(ops: List[dict]) -> dict:
    """Per window: the grouped append_batch's p50 ns per sequence at each context, and
    ``spread``, the largest over the smallest (flat, near 1: O(1) amortised release)."""
    out: Dict[str, dict] = {}
    for o in ops:
        parts = o["id"].split("/")
        if parts[0] != "append_batch":
            continue
        window, ctx = parts[1], parts[2].split("=")[1]
        row = out.setdefault(window, {"ns_per_seq": {}})
        row["ns_per_seq"][ctx] = round(o["results"]["kvblocks"]["ns_per_unit"], 2)
    for row in out.values():
        row["ns_per_seq"] = dict(sorted(row["ns_per_seq"].items(), key=lambda kv: int(kv[0][:-1])))
        v = list(row["ns_per_seq"].values())
        row["spread"] = round(max(v) / min(v), 3) if min(v) > 0 else None
    return out
