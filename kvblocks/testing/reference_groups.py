"""The executable specification of a BlockManager with KV cache groups (hybrid models).

The spec is group-native: :class:`~kvblocks.testing.reference.ReferenceManager` takes
``groups=`` and runs one set of rules for any number of groups (one full-attention group, the
default, is G = 1). The rules of the kinds (longest cache hit, blocks needed, the release of
skipped blocks) are stated once each in ``reference.py`` (``_Kind``, ``_StateKind``), written
from ``shared/API.md`` ("Hybrid models: KV cache groups") and ``docs/hybrid-models.md``.

:class:`GroupedReference` is kept as the name the grouped spec had: a ReferenceManager whose
``groups`` argument is required.
"""

from __future__ import annotations

from .reference import ReferenceManager

__all__ = ["GroupedReference"]


class GroupedReference(ReferenceManager):
    """ReferenceManager with KV cache groups: ``groups`` (a sequence of KVGroup) is required."""

    def __init__(self, num_blocks, block_size, *, groups, **kw) -> None:
        super().__init__(num_blocks, block_size, groups=groups, **kw)
