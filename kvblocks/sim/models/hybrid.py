"""Hybrid models in the simulator: layer kinds, the published presets, and their KV cache groups.

A hybrid model's layers come in *kinds* (:class:`LayerKind`): full attention, sliding-window
attention (window ``W``), chunked-local attention (chunk ``C``) and layers that keep a fixed
recurrent state per sequence (linear attention, Mamba, Gated DeltaNet). A
:class:`~kvblocks.BlockManager` runs one table per :class:`~kvblocks.KVGroup` over one pool of
equal blocks, so the layers must be cut into groups that all take the same bytes per block.

**The layout** (:func:`group_layout`). Every group holds the same number ``L`` of layers: the
greatest common divisor of the per-kind layer counts. A kind of ``n`` layers becomes ``n / L``
identical kvblocks groups, and one pool block stores ``block_size`` tokens of ``L`` layers:
``block bytes = L x per-layer bytes per token x block_size``. The layer count is exact: no
padding layers (vLLM forms groups of ``min`` layers per kind and pads the short ones, which
costs Gemma-3-27B 8 of 60 sliding-window slots, 15% of that memory). The price is more groups
when the counts share only a small divisor (Gemma-3-27B: ``gcd(10, 52) = 2``, 31 groups).

**State layers.** A state layer's bytes per sequence are rounded up to whole pool blocks:
``blocks = ceil(L x state bytes per layer / block bytes)``, so a state group takes that many
blocks per sequence whatever its length (Qwen3-Next at 16-token blocks: 1,097,728 B per layer
in 393,216 B-per-layer-slice blocks of 12 layers, 34 blocks, 1.5% rounding; vLLM pads the same
way). The state is billed in the KV dtype.

**The all-full baseline** (``all_full=True``) treats every sliding-window and chunked-local
layer as full attention (vLLM's ``--disable-hybrid-kv-cache-manager``); state layers keep their
state, since they have no per-token KV to extend.

>>> from kvblocks.sim.models.spec import get_model
>>> lay = group_layout(get_model("gpt-oss-20b"), 16)
>>> lay.layers_per_group, [str(g) for g in lay.kvgroups]
(12, ["KVGroup('full')", "KVGroup('sliding_window', window=128)"])
>>> lay.block_bytes == 12 * 2 * 8 * 64 * 2 * 16
True
>>> group_layout(get_model("gpt-oss-20b"), 16, all_full=True).kvgroups
(KVGroup('full'),)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING, Any, List, Tuple

import numpy as np

from ...groups import KVGroup
from ..errors import SimulationError

if TYPE_CHECKING:  # models.py imports this module
    from .spec import ModelSpec

__all__ = [
    "LayerKind",
    "GroupShare",
    "GroupLayout",
    "group_layout",
    "parse_layer_kinds",
    "MAX_KV_GROUPS",
    "KIND_NAMES",
]

#: the kinds a model's layers can be of, and the size each takes (KVGroup's kinds)
KIND_NAMES = ("full", "sliding_window", "chunked_local", "state")
MAX_KV_GROUPS = 255  # BlockManager takes at most this many groups


@dataclass(frozen=True)
class LayerKind:
    """Layers of one model that attend (or keep state) the same way.

    ``span`` is the window (``sliding_window``) or chunk (``chunked_local``) in tokens;
    ``state_elems`` the elements one ``state`` layer keeps per sequence.
    """

    kind: str
    layers: int
    span: int = 0
    state_elems: int = 0

    def describe(self) -> str:
        if self.kind == "full":
            return f"{self.layers} full"
        if self.kind == "state":
            return f"{self.layers} state ({self.state_elems:,} elements each)"
        return f"{self.layers} {self.kind} {self.span:,}"


@dataclass(frozen=True)
class GroupShare:
    """One layer kind in the layout: its kvblocks group and how many copies of it."""

    kind: LayerKind
    group: KVGroup  # the KVGroup each of its copies is
    copies: int  # identical kvblocks groups (kind.layers / layers_per_group)

    def held_blocks(self, ntok: np.ndarray, q0: np.ndarray, block_size: int) -> np.ndarray:
        """Blocks one copy holds for sequences of ``ntok`` tokens whose next query starts at
        ``q0`` (the core's release rule, csrc/table.c: blocks wholly below what ``q0`` reads
        are released to the null block)."""
        g = self.group
        if g.kind == "state":
            return np.full(ntok.shape, g.span, dtype=np.int64)
        held = -(-ntok // block_size)
        if g.kind == "sliding_window":
            return held - np.maximum(q0 - g.span + 1, 0) // block_size
        if g.kind == "chunked_local":
            return held - (q0 - q0 % g.span) // block_size
        return held

    def max_blocks(self, ntok: int, block_size: int) -> int:
        """The most blocks one copy holds for a sequence of up to ``ntok`` tokens."""
        g = self.group
        full = -(-ntok // block_size)
        if g.kind == "state":
            return g.span
        if g.kind == "sliding_window":  # W positions starting anywhere in a block
            return min(full, -(-(g.span - 1) // block_size) + 1)
        if g.kind == "chunked_local":  # a chunk starts at a multiple of C
            aligned = g.span % block_size == 0
            return min(
                full, g.span // block_size if aligned else -(-(g.span - 1) // block_size) + 1
            )
        return full


@dataclass(frozen=True)
class GroupLayout:
    """How a model's layers map to kvblocks groups over one pool of equal blocks."""

    layers_per_group: int  # L: layers one group (and one block) holds
    shares: Tuple[GroupShare, ...]  # full attention first, then the model's order
    block_size: int
    block_bytes: int  # L x per-layer bytes per token x block_size
    all_full: bool  # window and chunk layers treated as full attention

    @property
    def kvgroups(self) -> Tuple[KVGroup, ...]:
        """The ``groups=`` argument of BlockManager (each share's group, ``copies`` times)."""
        return tuple(s.group for s in self.shares for _ in range(s.copies))

    @property
    def num_groups(self) -> int:
        return sum(s.copies for s in self.shares)

    @property
    def hybrid(self) -> bool:
        """More than one kvblocks group (the simulator then tracks usage per group)."""
        return self.num_groups > 1

    def seq_blocks(self, ntok: np.ndarray) -> np.ndarray:
        """Blocks a sequence of ``ntok`` tokens holds while it decodes (the next query reads
        position ``ntok - 1``), all groups together."""
        n = np.asarray(ntok, dtype=np.int64)
        q0 = np.maximum(n - 1, 0)
        out = np.zeros(n.shape, dtype=np.int64)
        for s in self.shares:
            out += s.copies * s.held_blocks(n, q0, self.block_size)
        return out

    def reserve_slots(self, max_len: int) -> int:
        """Token slots (of L layers) a contiguous reservation for ``max_len`` tokens takes:
        full layers ``max_len``, window and chunk layers a ring of ``min(span, max_len)``, a
        state layer its blocks."""
        return self.live_slots(max_len)

    def live_slots(self, ntok: Any) -> Any:
        """Token slots (of L layers) a sequence of ``ntok`` tokens needs with no rounding: every
        token in a full group, at most the span in a window or chunk group (a contiguous
        ring), the blocks of a state group. ``ntok`` may be a numpy array."""
        total: Any = 0
        for s in self.shares:
            g = s.group
            if g.kind == "state":
                per: Any = g.span * self.block_size
            elif g.kind == "full":
                per = ntok
            else:
                per = np.minimum(g.span, ntok)
            total = total + s.copies * per
        return total

    def as_list(self) -> List[dict]:
        return [
            {
                "kind": s.group.kind,
                "span": s.group.span,
                "layers": s.kind.layers,
                "kvblocks_groups": s.copies,
                "layers_per_group": self.layers_per_group,
            }
            for s in self.shares
        ]


def group_layout(model: "ModelSpec", block_size: int, all_full: bool = False) -> GroupLayout:
    """The exact layout of ``model``'s layers into kvblocks groups (see the module docstring)."""
    kinds = list(model.kinds)
    if all_full:
        n_full = sum(k.layers for k in kinds if k.kind != "state")
        kinds = [LayerKind("full", n_full)] + [k for k in kinds if k.kind == "state"]
    kinds.sort(key=lambda k: k.kind != "full")  # full attention first (group 0)
    L = reduce(math.gcd, (k.layers for k in kinds))
    per_layer = model.kv_bytes_per_token_layer
    block_bytes = L * per_layer * block_size
    n_groups = sum(k.layers // L for k in kinds)
    if n_groups > MAX_KV_GROUPS:
        counts = ", ".join(str(k.layers) for k in kinds)
        raise SimulationError(
            f"{model.name}: layer counts {counts} share only a group size of {L} layers, "
            f"{n_groups} kvblocks groups (at most {MAX_KV_GROUPS})"
        )
    shares = []
    for k in kinds:
        if k.kind == "state":
            state_bytes = model.kv_nbytes(L * k.state_elems)
            group = KVGroup("state", blocks=max(1, -(-state_bytes // block_bytes)))
        elif k.kind == "sliding_window":
            group = KVGroup("sliding_window", window=k.span)
        elif k.kind == "chunked_local":
            group = KVGroup("chunked_local", chunk=k.span)
        else:
            group = KVGroup("full")
        shares.append(GroupShare(k, group, k.layers // L))
    return GroupLayout(L, tuple(shares), block_size, block_bytes, all_full)


def parse_layer_kinds(text: str, layers: int) -> Tuple[LayerKind, ...]:
    """``--layer-groups``: ``COUNT:KIND[:SIZE],...`` for a custom model of ``layers`` layers.

    SIZE is the window or chunk in tokens, or a state layer's elements per sequence; ``full``
    takes none. The counts must add up to ``layers`` and name each kind (and size) once.

    >>> parse_layer_kinds("12:full,12:sliding_window:128", 24)[1]
    LayerKind(kind='sliding_window', layers=12, span=128, state_elems=0)
    >>> parse_layer_kinds("12:full,10:sliding_window:128", 24)
    Traceback (most recent call last):
    ...
    kvblocks.sim.errors.SimulationError: --layer-groups: the counts add up to 22 layers, not --layers 24
    """
    out: List[LayerKind] = []
    seen = set()
    for part in str(text).split(","):
        fields = [f.strip() for f in part.strip().split(":")]
        if len(fields) < 2 or len(fields) > 3:
            raise SimulationError(
                f"--layer-groups: {part.strip()!r} is not COUNT:KIND[:SIZE] "
                "(e.g. 12:full,12:sliding_window:128)"
            )
        count_s, kind = fields[0], fields[1].lower()
        if kind not in KIND_NAMES:
            raise SimulationError(
                f"--layer-groups: unknown kind {fields[1]!r} (one of {', '.join(KIND_NAMES)})"
            )
        if (kind == "full") != (len(fields) == 2):
            what = "takes no size" if kind == "full" else "needs a size (COUNT:KIND:SIZE)"
            raise SimulationError(f"--layer-groups: {kind} {what}, got {part.strip()!r}")
        try:
            count = int(count_s)
            size = int(fields[2]) if len(fields) == 3 else 0
        except ValueError:
            raise SimulationError(
                f"--layer-groups: not a whole number in {part.strip()!r}"
            ) from None
        if count < 1 or (kind != "full" and not 1 <= size <= 2**31 - 1):
            raise SimulationError(
                f"--layer-groups: {part.strip()!r} needs COUNT >= 1 and SIZE in [1, 2^31-1]"
            )
        if (kind, size) in seen:
            raise SimulationError(
                f"--layer-groups: {kind}{':' + str(size) if size else ''} listed twice"
            )
        seen.add((kind, size))
        if kind == "state":
            out.append(LayerKind(kind, count, 0, size))
        else:
            out.append(LayerKind(kind, count, size))
    total = sum(k.layers for k in out)
    if total != layers:
        raise SimulationError(
            f"--layer-groups: the counts add up to {total} layers, not --layers {layers}"
        )
    if all(k.kind == "state" for k in out):
        raise SimulationError("--layer-groups: a model needs at least one attention kind")
    return tuple(out)
