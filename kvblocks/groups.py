"""KV cache groups for hybrid models: layers that attend differently keep separate tables.

A model whose layers do not all use full attention (gpt-oss, Gemma 2/3, Mistral with a sliding
window, Llama 4's chunked local attention, Qwen3-Next / Jamba linear-attention state) gives
``BlockManager(groups=...)`` one :class:`KVGroup` per kind of layer. Every group shares the pool
and the block size; each sequence keeps one block table per group.

>>> from kvblocks import BlockManager, KVGroup
>>> mgr = BlockManager(64, 4, groups=(KVGroup("full"), KVGroup("sliding_window", window=8)))
>>> mgr.add("a", list(range(20)))
0
>>> mgr.schedule(["a"], [20])              # the step computes the prompt
>>> mgr.append("a", [7])                    # moving on releases what the window left behind
>>> mgr.block_table("a", group=1).tolist()  # the next query (position 20) reads [13, 20]
[0, 0, 0, 9, 10, 12]
>>> mgr.blocks_in_use("a")
9

See docs/hybrid-models.md for the exact release rule and prefix caching across groups.

The layer -> group mapper of the integrations lives here too (:func:`layer_group`,
:func:`plan_groups`): both transformers integrations turn a model's layer types into these
groups through it.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

from kvblocks.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["KVGroup", "KINDS", "GroupPlan", "layer_group", "plan_groups"]

#: kind -> (the size argument it takes, vLLM's ``kv_cache_spec_kind`` for KV events)
KINDS = {
    "full": (None, "full_attention"),
    "sliding_window": ("window", "sliding_window"),
    "chunked_local": ("chunk", "chunked_local_attention"),
    "state": ("blocks", "mamba"),
}
_CODES = {"full": 0, "sliding_window": 1, "chunked_local": 2, "state": 3}
_LIMIT = 2**31 - 1


def _size(name: str, value: object) -> int:
    if type(value) is bool or not isinstance(value, int):
        raise InvalidTypeError(f"KVGroup: {name} must be an int, got {type(value).__name__}")
    if not 1 <= value <= _LIMIT:
        raise InvalidArgumentError(f"KVGroup: {name} must be in [1, {_LIMIT}], got {value}")
    return int(value)


class KVGroup:
    """One KV cache group: the layers of a model that attend the same way.

    - ``KVGroup("full")``: every position attends to all earlier ones.
    - ``KVGroup("sliding_window", window=W)``: position p attends to ``[p - W + 1, p]``.
    - ``KVGroup("chunked_local", chunk=C)``: position p attends to ``[p - p % C, p]``.
    - ``KVGroup("state", blocks=S)``: S blocks per sequence whatever its length (recurrent
      or linear-attention state); no per-token slots and no prefix hits.

    >>> KVGroup("sliding_window", window=128)
    KVGroup('sliding_window', window=128)
    >>> KVGroup("sliding_window", window=0)
    Traceback (most recent call last):
    ...
    kvblocks.errors.InvalidArgumentError: KVGroup: window must be in [1, 2147483647], got 0
    """

    __slots__ = ("kind", "window", "chunk", "blocks")

    kind: str
    window: Optional[int]
    chunk: Optional[int]
    blocks: Optional[int]

    def __init__(
        self,
        kind: str = "full",
        *,
        window: Optional[int] = None,
        chunk: Optional[int] = None,
        blocks: Optional[int] = None,
    ) -> None:
        if type(kind) is not str:
            raise InvalidTypeError(f"KVGroup: kind must be a str, got {type(kind).__name__}")
        if kind not in KINDS:
            raise InvalidArgumentError(
                f"KVGroup: unknown kind {kind!r} (one of {', '.join(sorted(KINDS))})"
            )
        given = {"window": window, "chunk": chunk, "blocks": blocks}
        wanted = KINDS[kind][0]
        for name, value in given.items():
            if name != wanted and value is not None:
                raise InvalidArgumentError(f"KVGroup({kind!r}) takes no {name}")
        if wanted is not None and given[wanted] is None:
            raise InvalidArgumentError(f"KVGroup({kind!r}) needs {wanted}=")
        object.__setattr__(self, "kind", kind)
        for name in given:
            v = given[name]
            object.__setattr__(self, name, None if v is None else _size(name, v))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KVGroup is immutable")

    @property
    def code(self) -> int:
        """The core's kind code."""
        return _CODES[self.kind]

    @property
    def span(self) -> int:
        """The window, chunk or state blocks (0 for full attention)."""
        return self.window or self.chunk or self.blocks or 0

    @property
    def spec_kind(self) -> str:
        """vLLM's ``kv_cache_spec_kind`` of this group (KV events)."""
        return KINDS[self.kind][1]

    def _key(self) -> tuple:
        return (self.kind, self.window, self.chunk, self.blocks)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVGroup) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        arg = KINDS[self.kind][0]
        return f"KVGroup({self.kind!r}" + (f", {arg}={self.span})" if arg else ")")

    def __reduce__(self):
        return (_rebuild, (self.kind, self.window, self.chunk, self.blocks))


def _rebuild(kind, window, chunk, blocks):
    return KVGroup(kind, window=window, chunk=chunk, blocks=blocks)


# --- layers -> groups (the transformers integrations) ---------------------------------------------
#: transformers' layer type of full-attention and of sliding-window layers
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

#: why a layer type transformers knows cannot be held (the refusal messages say it)
UNSUPPORTED_LAYERS = {
    "chunked_attention": "chunked local attention",
    "linear_attention": "linear-attention / recurrent state",
    "conv": "convolution state",
    "hybrid": "linear-attention state plus attention",
    "hybrid_sliding": "linear-attention state plus sliding-window attention",
    "indexed_attention": "indexed sparse attention",
    "dummy": "no K/V of its own (shared with another layer, or no attention)",
}


def layer_group(window: Optional[int]) -> KVGroup:
    """The group of a layer of this sliding window (None: full attention).

    transformers' default cache gives a ``"sliding_attention"`` layer of window ``W`` the K/V of
    the last ``W - 1`` cached positions plus the new ones (``DynamicSlidingWindowLayer``), and its
    mask lets position ``p`` attend to ``[p - W + 1, p]`` (``kv_idx > q_idx - W``). That is exactly
    what ``KVGroup("sliding_window", window=W)`` keeps.

    >>> layer_group(None), layer_group(4)
    (KVGroup('full'), KVGroup('sliding_window', window=4))
    """
    return KVGroup("full") if window is None else KVGroup("sliding_window", window=window)


class GroupPlan(NamedTuple):
    """How the layers of a model map onto KV cache groups."""

    groups: Tuple[KVGroup, ...]  #: empty when every layer is full attention (default manager)
    layer_group: Tuple[int, ...]  #: group of each layer
    layer_slot: Tuple[int, ...]  #: index of each layer within its group's blocks
    windows: Tuple[Optional[int], ...]  #: sliding window of each layer (None: full attention)
    layers_per_block: int  #: layers one block holds K/V for


def plan_groups(windows: List[Optional[int]]) -> GroupPlan:
    """Groups for layers of these windows (None: full attention), each kind of layer a group.

    One block of the storage holds ``block_size`` tokens of K and V for ``layers_per_block``
    layers of one group. With full-attention layers, ``layers_per_block`` is their count, so the
    full-attention K/V take exactly one block per ``block_size`` tokens; each kind of
    sliding-window layer is split into groups of that many layers (the last one partly used; its
    blocks are bounded by the window). Without full-attention layers, ``layers_per_block`` is the
    largest count of layers of one window.

    >>> plan = plan_groups([4, None, 4, None])          # Gemma 2 style: sliding, full, ...
    >>> plan.groups, plan.layer_group, plan.layer_slot, plan.layers_per_block
    ((KVGroup('full'), KVGroup('sliding_window', window=4)), (1, 0, 1, 0), (0, 0, 1, 1), 2)
    >>> plan_groups([None, None]).groups                # all full: the default single group
    ()
    """
    L = len(windows)
    if all(w is None for w in windows):
        return GroupPlan((), (0,) * L, tuple(range(L)), tuple(windows), L)
    kinds: Dict[Optional[int], List[int]] = {}
    if None in windows:
        kinds[None] = []  # full attention first: group 0
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    per_block = len(kinds[None]) if None in kinds else max(len(v) for v in kinds.values())
    groups: List[KVGroup] = []
    layer_group_ = [0] * L
    layer_slot = [0] * L
    for w, layers in kinds.items():
        for start in range(0, len(layers), per_block):
            g = len(groups)
            groups.append(layer_group(w))
            for j, layer in enumerate(layers[start : start + per_block]):
                layer_group_[layer] = g
                layer_slot[layer] = j
    return GroupPlan(
        tuple(groups), tuple(layer_group_), tuple(layer_slot), tuple(windows), per_block
    )
