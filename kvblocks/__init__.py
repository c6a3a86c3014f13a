"""kvblocks: a fast, exact paged KV-cache memory manager for LLM inference engines."""

from .errors import (
    CorruptionError,
    DeviceError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    OutOfBlocksError,
    UnknownSequenceError,
)

__version__ = "0.1.0"

# device side (issue 4): KV storage and block operations; CuPy is imported only on use
from .layout import KVLayout
from .storage import KVCache
from . import ops

from ._core import BlockManager, BlockPool, SeqBatch, default_hash_key, hash_blocks
from .events import AllBlocksCleared, BlockRemoved, BlockStored
from .metadata import AttentionMetadata
from .stats import CacheStats
