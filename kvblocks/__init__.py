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
