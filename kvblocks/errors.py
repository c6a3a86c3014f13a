"""Exceptions raised by kvblocks.

Every exception the library raises on purpose derives from :class:`KVBlocksError`.
A call that raises leaves the allocator exactly as it was (all-or-nothing).
"""

__all__ = [
    "KVBlocksError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "InvalidStateError",
    "CorruptionError",
    "DeviceError",
    "NotSupportedError",
]


class KVBlocksError(Exception):
    """Base class of every error kvblocks raises on purpose."""


class OutOfBlocksError(KVBlocksError):
    """Not enough allocatable blocks (never-cached free plus evictable cached)."""


class UnknownSequenceError(KVBlocksError, KeyError):
    """The sequence id is not live in this manager."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(KVBlocksError, ValueError):
    """The sequence id is already live in this manager."""


class InvalidArgumentError(KVBlocksError, ValueError):
    """An argument has a bad value (out of range, wrong shape, duplicated...)."""


class InvalidTypeError(KVBlocksError, TypeError):
    """An argument has the wrong type or dtype."""


class InvalidStateError(KVBlocksError, RuntimeError):
    """The call is not allowed in the current state (e.g. freeing a free block)."""


class CorruptionError(KVBlocksError, RuntimeError):
    """An internal invariant does not hold; raised by ``check()``."""


class DeviceError(KVBlocksError, RuntimeError):
    """The requested device is unavailable (no CuPy, no CUDA device) or mismatched."""


class NotSupportedError(KVBlocksError, NotImplementedError):
    """A valid request that kvblocks does not serve (yet), refused before anything changes:
    e.g. a model whose attention layout a cache cannot hold."""
