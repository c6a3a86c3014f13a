"""Layers of a transformers model config -> kvblocks KV cache groups (for :mod:`.transformers`).

transformers' default cache gives a ``"sliding_attention"`` layer of window ``W`` the K/V of the
last ``W - 1`` cached positions plus the new ones (``DynamicSlidingWindowLayer``), and its mask
lets position ``p`` attend to ``[p - W + 1, p]`` (``masking_utils.sliding_window_overlay``:
``kv_idx > q_idx - W``). That is exactly what ``KVGroup("sliding_window", window=W)`` keeps, so
each kind of layer becomes a group of one :class:`kvblocks.BlockManager`.

One block of the storage holds ``block_size`` tokens of K and V for ``layers_per_block`` layers
of one group. With full-attention layers, ``layers_per_block`` is their count, so the
full-attention K/V take exactly one block per ``block_size`` tokens; each kind of sliding-window
layer is split into groups of that many layers (the last one partly used; its blocks are bounded
by the window). Without full-attention layers, ``layers_per_block`` is the largest count of
layers of one window.

>>> plan = plan_groups([4, None, 4, None])          # Gemma 2 style: sliding, full, ...
>>> plan.groups, plan.layer_group, plan.layer_slot, plan.layers_per_block
((KVGroup('full'), KVGroup('sliding_window', window=4)), (1, 0, 1, 0), (0, 0, 1, 1), 2)
>>> plan_groups([None, None]).groups                # all full: the default single group
()
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from ..errors import NotSupportedError
from ..groups import KVGroup

__all__ = ["GroupPlan", "layer_windows", "plan_groups"]

_FULL = "full_attention"
_SLIDING = "sliding_attention"

# why a layer type transformers knows cannot be held (the refusal message says it)
_WHY = {
    "chunked_attention": "chunked local attention",
    "linear_attention": "linear-attention / recurrent state",
    "conv": "convolution state",
    "hybrid": "linear-attention state plus attention",
    "hybrid_sliding": "linear-attention state plus sliding-window attention",
    "indexed_attention": "indexed sparse attention",
    "dummy": "no K/V of its own (shared with another layer, or no attention)",
}


class GroupPlan(NamedTuple):
    """How the layers of a model map onto KV cache groups."""

    groups: Tuple[KVGroup, ...]  #: empty when every layer is full attention (default manager)
    layer_group: Tuple[int, ...]  #: group of each layer
    layer_slot: Tuple[int, ...]  #: index of each layer within its group's blocks
    windows: Tuple[Optional[int], ...]  #: sliding window of each layer (None: full attention)
    layers_per_block: int  #: layers one block holds K/V for


def _types_and_kwargs(text: Any, num_layers: int) -> Tuple[List[str], List[Dict[str, Any]]]:
    """Layer types and their cache arguments as transformers' ``DynamicCache(config=...)`` sees
    them (its own helper when the installed version has it), else from the config fields."""
    from transformers import cache_utils

    getter = getattr(cache_utils, "get_layer_types_and_kwargs", None)  # transformers >= 5
    if getter is not None:
        try:
            types, kwargs = getter(text)
        except (AttributeError, TypeError, ValueError, IndexError):  # pragma: no cover
            types = None
        if types is not None and len(types) == num_layers:
            return list(types), [dict(k) for k in kwargs]
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is None:
        if window is not None and getattr(text, "use_sliding_window", True):
            kind = _SLIDING
        elif getattr(text, "attention_chunk_size", None) is not None:
            kind = "chunked_attention"
        else:
            kind = _FULL
        types = [kind] * num_layers
    types = list(types)
    if len(types) != num_layers:
        raise NotSupportedError(
            f"the config lists {len(types)} layer_types for {num_layers} decoder layers"
        )
    return types, [{"sliding_window": window} if t == _SLIDING else {} for t in types]


def layer_windows(text: Any, num_layers: int) -> List[Optional[int]]:
    """The sliding window of every decoder layer of a text config (None: full attention).

    Full-attention and sliding-window layers are served; any other layer type raises
    :class:`~kvblocks.NotSupportedError` naming it.
    """
    types, kwargs = _types_and_kwargs(text, num_layers)
    bad = sorted({t for t in types if t not in (_FULL, _SLIDING)})
    if bad:
        why = "; ".join(f"{t}: {_WHY.get(t, 'unknown to kvblocks')}" for t in bad)
        raise NotSupportedError(
            "PagedKVCache supports full-attention and sliding-window layers only; this model "
            f"has {bad} layers ({why}), which it cannot hold yet"
        )
    out: List[Optional[int]] = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        if t == _FULL:
            out.append(None)
            continue
        w = kw.get("sliding_window")
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise NotSupportedError(
                f"layer {i} is a sliding-window layer without a positive sliding_window ({w!r})"
            )
        out.append(int(w))
    return out


def plan_groups(windows: List[Optional[int]]) -> GroupPlan:
    """Groups for layers of these windows (see the module docstring for the block layout)."""
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
    layer_group = [0] * L
    layer_slot = [0] * L
    for w, layers in kinds.items():
        for start in range(0, len(layers), per_block):
            g = len(groups)
            groups.append(KVGroup("full") if w is None else KVGroup("sliding_window", window=w))
            for j, layer in enumerate(layers[start : start + per_block]):
                layer_group[layer] = g
                layer_slot[layer] = j
    return GroupPlan(
        tuple(groups), tuple(layer_group), tuple(layer_slot), tuple(windows), per_block
    )
