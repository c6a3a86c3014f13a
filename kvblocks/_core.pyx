# cython: language_level=3
"""Thin Cython wrappers over the C core (csrc/): BlockPool, BlockManager, hash_blocks.

Each cdef class owns exactly one C object. C functions return 0 or a negative code;
``raise_code`` (_convert.pxi) maps codes to the exceptions of kvblocks.errors with a message
saying what was asked and what was there. The module is split the way uvloop and pyroaring
split theirs: _convert.pxi (argument conversion, errors), _pool.pxi (BlockPool),
_manager.pxi (BlockManager, SeqBatch).
"""
import math
import os

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.dict cimport PyDict_GetItem
from cpython.long cimport PyLong_AsLongAndOverflow
from cpython.object cimport PyObject
from libc.stdint cimport (INT32_MAX, INT32_MIN, INT64_MAX, int32_t, int64_t, uint8_t, uint32_t,
                          uint64_t)
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.string cimport memcpy, memset

from kvblocks._core cimport *

from kvblocks.errors import (
    CorruptionError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from kvblocks.events.types import AllBlocksCleared, BlockRemoved, BlockStored, coalesce
from kvblocks.metadata import AttentionMetadata
from kvblocks.stats import CacheStats, HostStats

cnp.import_array()

_DEFAULT_KEY = os.urandom(16)  # per-process secret hash key
BUILD_DEBUG_LEVEL = KVB_DEBUG_LEVEL  # 0 release, 1 assertions, 2 full check after every call
cdef Py_ssize_t _IMAP_LIMIT = 1 << 16  # int ids below this also get an array slot map

include "_convert.pxi"
include "_pool.pxi"
include "_manager.pxi"


def default_hash_key():
    """The per-process random hash key used when ``hash_key``/``key`` is None."""
    return _DEFAULT_KEY


def hash_blocks(token_ids, block_size, *, parent=None, salt=None, key=None):
    """Chained 128-bit keyed hashes of the full blocks of ``token_ids``.

    ``h[i] = SipHash128_key(h[i-1] || tokens of block i)``; ``h[-1]`` is ``parent`` when given,
    else the root of ``salt`` (different salts never share a hash). Returns an ``(n, 2)``
    uint64 array of ``[lo, hi]`` halves; a trailing partial block is not hashed.

    >>> import kvblocks
    >>> h = kvblocks.hash_blocks(list(range(40)), 16, key=b"0123456789abcdef")
    >>> h.shape, h.dtype
    ((2, 2), dtype('uint64'))
    >>> h2 = kvblocks.hash_blocks(list(range(16, 32)), 16, parent=h[0], key=b"0123456789abcdef")
    >>> bool((h2[0] == h[1]).all())
    True
    """
    cdef int32_t bs = <int32_t>as_int(block_size, "block_size", 1, INT32_MAX)
    cdef bytes k = as_key(key)
    cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
    cdef int64_t n = cnp.PyArray_DIM(toks, 0) // bs
    cdef cnp.ndarray out = np.empty((n, 2), dtype=np.uint64)
    cdef kvb_hash_t root
    cdef bytes s
    if parent is not None:
        if salt is not None:
            raise InvalidArgumentError("give either parent or salt: the salt only enters "
                                       "the first block of a chain")
        root = _parent_hash(parent)
    else:
        s = as_salt(salt)
        kvb_hash_root(<const uint8_t *>k, <const uint8_t *>s, len(s), &root)
    if n:
        kvb_hash_chain(<const uint8_t *>k, &root, i32_data(toks), n, bs,
                       <kvb_hash_t *>cnp.PyArray_DATA(out))
    return out


cdef kvb_hash_t _parent_hash(object parent) except *:
    cdef kvb_hash_t h
    if type(parent) is int:
        if parent < 0 or parent >> 128:
            raise InvalidArgumentError("parent hash must be a 128-bit unsigned int")
        h.lo = parent & 0xFFFFFFFFFFFFFFFF
        h.hi = parent >> 64
        return h
    try:
        arr = np.asarray(parent)
    except Exception as exc:
        raise InvalidTypeError(f"parent: {type(exc).__name__}") from None
    if arr.dtype != np.uint64 or arr.shape != (2,):
        raise InvalidArgumentError("parent must be a 128-bit int or a uint64 [lo, hi] pair, "
                                   f"got {arr.dtype} {arr.shape}")
    h.lo = arr[0]
    h.hi = arr[1]
    return h


def hash_to_int(h):
    """A block hash as one 128-bit int, from a ``[lo, hi]`` uint64 pair (a row of
    ``hash_blocks``) or an int (checked). Events and ``block_hash`` use ints; hash_blocks rows.

    >>> h = hash_blocks(list(range(4)), 4, key=b"0123456789abcdef")[0]
    >>> hash_from_int(hash_to_int(h)).tolist() == h.tolist()
    True
    """
    if type(h) is int:
        if h < 0 or h >> 128:
            raise InvalidArgumentError("a block hash is a 128-bit unsigned int")
        return h
    cdef kvb_hash_t v = _parent_hash(h)
    return hash_int(v)


def hash_from_int(h):
    """The ``[lo, hi]`` uint64 pair of a 128-bit int hash (the row format of hash_blocks)."""
    if type(h) is not int or h < 0 or h >> 128:
        raise InvalidArgumentError("a block hash is a 128-bit unsigned int")
    return np.array([h & 0xFFFFFFFFFFFFFFFF, h >> 64], dtype=np.uint64)


def siphash128(key, data) -> bytes:
    """SipHash-2-4 with 128-bit output of ``data`` under a 16-byte ``key`` (16 bytes out,
    the reference implementation's byte order). Exposed for known-answer tests.

    >>> siphash128(bytes(range(16)), b"").hex()
    'a3817f04ba25a8e66df67214c7550293'
    """
    cdef bytes k = as_key(key)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"data must be bytes, got {type(data).__name__}")
    cdef bytes d = bytes(data)
    cdef kvb_hash_t h
    kvb_siphash128(<const uint8_t *>k, <const char *>d, len(d), &h)
    return (<char *>&h)[:16]
