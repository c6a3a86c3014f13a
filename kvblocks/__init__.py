"""kvblocks: a fast, exact paged KV-cache memory manager for LLM inference engines.

Block level: :class:`BlockPool` and :func:`hash_blocks`. Sequence level: :class:`BlockManager`
with :class:`AttentionMetadata`. Device side: :class:`KVLayout`, :class:`KVCache` and
:mod:`kvblocks.ops`. Every error derives from :class:`KVBlocksError`.
"""

__version__ = "0.1.0"  # the one version source: pyproject.toml reads it ([tool.setuptools.dynamic])

from . import ops
from ._core import (
    HASH_ALGOS,
    BlockManager,
    BlockPool,
    SeqBatch,
    StepPlan,
    StepSize,
    default_hash_key,
    hash_blocks,
    hash_from_int,
    hash_to_int,
)
from .errors import (
    CorruptionError,
    DeviceError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    NotSupportedError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from .events import AllBlocksCleared, BlockRemoved, BlockStored
from .groups import KVGroup
from .layout import KVLayout
from .metadata import AttentionMetadata
from .rows import RowIndices
from .stats import CacheStats, HostStats
from .storage import KVCache

__all__ = [
    "HASH_ALGOS",
    "KVGroup",
    "AllBlocksCleared",
    "AttentionMetadata",
    "BlockManager",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "CorruptionError",
    "DeviceError",
    "DuplicateSequenceError",
    "HostStats",
    "InvalidArgumentError",
    "InvalidStateError",
    "InvalidTypeError",
    "KVBlocksError",
    "KVCache",
    "KVLayout",
    "NotSupportedError",
    "OutOfBlocksError",
    "RowIndices",
    "SeqBatch",
    "StepPlan",
    "StepSize",
    "UnknownSequenceError",
    "default_hash_key",
    "hash_blocks",
    "hash_from_int",
    "hash_to_int",
    "ops",
    "__version__",
]
