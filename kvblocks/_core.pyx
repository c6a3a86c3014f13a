# cython: language_level=3
"""Thin Cython wrappers over the C core (csrc/): BlockPool, BlockManager, hash_blocks.

Each cdef class owns exactly one C object. C functions return 0 or a negative code;
``raise_code`` (_convert.pxi) maps codes to the exceptions of kvblocks.errors with a message
saying what was asked and what was there. The module is split the way uvloop and pyroaring
split theirs: _convert.pxi (argument conversion, errors), _hash.pxi (hash modes), _pool.pxi
(BlockPool), _seqmap.pxi (ids and slots, SeqBatch), _writers.pxi (the step calls and their
writers), _step.pxi (StepPlan), _tier.pxi (host tier, events), _seqs.pxi (per-sequence
queries, swap), _groups.pxi (construction), _manager.pxi (BlockManager: convert, guard, call,
raise).
"""
import math
import os

import numpy as np

cimport cython
cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.dict cimport PyDict_GetItem
from cpython.long cimport PyLong_AsLongAndOverflow
from cpython.object cimport PyObject
from libc.stdint cimport (INT32_MAX, INT32_MIN, INT64_MAX, int32_t, int64_t, uint8_t, uint32_t,
                          uint64_t)
from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memcpy, memset
from cpython.bytes cimport PyBytes_FromStringAndSize

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
from kvblocks.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvblocks.groups import KVGroup
from kvblocks.metadata import AttentionMetadata
from kvblocks.rows import RowIndices
from kvblocks.stats import CacheStats, HostStats

cnp.import_array()

_DEFAULT_KEY = os.urandom(16)  # per-process secret hash key
BUILD_DEBUG_LEVEL = KVB_DEBUG_LEVEL  # 0 release, 1 assertions, 2 full check after every call
cdef Py_ssize_t _IMAP_LIMIT = 1 << 16  # int ids below this also get an array slot map

include "_convert.pxi"
include "_hash.pxi"
include "_pool.pxi"
include "_seqmap.pxi"
include "_writers.pxi"
include "_step.pxi"
include "_tier.pxi"
include "_seqs.pxi"
include "_groups.pxi"
include "_manager.pxi"


def default_hash_key():
    """The per-process random hash key used when ``hash_key``/``key`` is None."""
    return _DEFAULT_KEY


def hash_blocks(token_ids, block_size, *, parent=None, salt=None, key=None, algo="siphash",
                seed=None, lora_name=None, bint digests=False, group=0):
    """Chained hashes of the full blocks of ``token_ids``, in one of the hash modes.

    Returns an ``(n, 2)`` uint64 array of ``[lo, hi]`` 128-bit hashes (a trailing partial
    block is not hashed); with ``digests=True``, ``(hashes, digests)`` where ``digests`` is
    ``(n, 16)`` (SipHash) or ``(n, 32)`` uint8: each block's full digest, the ``parent`` to
    continue the chain with. ``parent`` continues a chain after that block (no salt then:
    the salt enters block 0 only); otherwise the chain starts under ``salt`` and
    ``lora_name`` (the adapter, isolating like a salt; on every block).

    Modes (``algo``):

    - ``"siphash"`` (default): ``h[i] = SipHash128_key(h[i-1] || tokens of block i)`` under
      the secret 16-byte ``key``; ``h[-1]`` is the root of salt and adapter.
    - ``"vllm_sha256_cbor"``: vLLM's ``sha256_cbor`` block hash (vLLM >= 0.31), the salt as
      vLLM's ``("cache_salt", salt)`` extra key on block 0; ``seed`` is vLLM's NONE_HASH seed
      (None: PYTHONHASHSEED if set, else ``"vllm-none-hash"``). No ``lora_name``: vLLM >=
      0.31 hashes the adapter's path.
    - ``"vllm_sha256_cbor_v030"``: the same with vLLM 0.11.1-0.30's untagged extra keys
      (``(lora_name, salt)`` on block 0, ``(lora_name,)`` after).
    - ``"sglang_sha256"``: the SGLang router's page hash, sha256 of the previous page's
      digest and the tokens as little-endian uint32. A salt or adapter starts the chain
      from a digest of them (the router has neither, so such chains never match it).

    In the 256-bit modes the 128 bits kept are the digest's half that holds the router's
    wire value: ``int(h) & (2**64 - 1)`` is what vLLM (last 8 bytes) or SGLang (first 8
    bytes) publishes, which is what ``kvblocks.events.encode_batch`` sends.

    ``group`` (a KV cache group index, see KVGroup) gives that group's hashes, as a
    BlockManager with groups keeps them: group 0's XOR the group's secret 128-bit tag
    ``SipHash-128(key, b"kvblocks:group:" + bytes([group]))`` (little-endian ``[lo, hi]``),
    so identical tokens in two groups never share a block, while a block is SipHashed once
    for all groups. A ``parent`` is then a row of the same group. Only the siphash mode has
    per-group hashes (the 256-bit modes are engines' own hashes, which key a group's blocks
    by (hash, group) outside the hash, as a BlockManager with groups in those modes does;
    its events carry the engine's hash and ``group_idx``).

    >>> import kvblocks
    >>> h = kvblocks.hash_blocks(list(range(40)), 16, key=b"0123456789abcdef")
    >>> h.shape, h.dtype
    ((2, 2), dtype('uint64'))
    >>> h2 = kvblocks.hash_blocks(list(range(16, 32)), 16, parent=h[0], key=b"0123456789abcdef")
    >>> bool((h2[0] == h[1]).all())
    True
    >>> v, d = kvblocks.hash_blocks(list(range(32)), 16, algo="vllm_sha256_cbor",
    ...                             seed="vllm-none-hash", digests=True)
    >>> [int(lo) for lo in v[:, 0]]  # vLLM's wire values
    [2233398808101521225, 17911472383915781900]
    >>> w = kvblocks.hash_blocks(list(range(16, 32)), 16, algo="vllm_sha256_cbor",
    ...                          seed="vllm-none-hash", parent=d[0])
    >>> bool((w[0] == v[1]).all())
    True
    """
    cdef int32_t a = as_algo(algo)
    cdef int32_t bs = <int32_t>as_int(block_size, "block_size", 1, INT32_MAX)
    if key is not None and a != KVB_HASH_SIPHASH:
        raise InvalidArgumentError(f"key applies to the siphash mode only, not {algo!r}")
    cdef bytes k = as_key(key)
    cdef bytes none = none_hash_of(a, effective_seed(a, seed))
    cdef kvb_hash_t tag
    cdef int64_t g = as_int(group, "group", 0, 254)
    if g and a != KVB_HASH_SIPHASH:
        raise InvalidArgumentError(f"group={g} needs the siphash mode, not {algo!r}")
    kvb_group_tag(<const uint8_t *>k, <uint8_t>g, &tag)
    cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
    cdef int64_t n = cnp.PyArray_DIM(toks, 0) // bs
    cdef cnp.ndarray out = np.empty((n, 2), dtype=np.uint64)
    cdef int size = kvb_digest_size(a)
    cdef cnp.ndarray dig
    cdef cnp.ndarray ext = np.empty((n, 2), dtype=np.uint64)
    cdef kvb_digest_t par, dg
    cdef kvb_hasher_t hs
    cdef bytes ctx
    cdef int64_t i
    if parent is not None:
        if salt is not None:
            raise InvalidArgumentError("give either parent or salt: the salt only enters "
                                       "the first block of a chain")
        par = parent_digest(a, parent)
        par.h.lo ^= tag.lo  # the group-0 chain continues under the parent
        par.h.hi ^= tag.hi
        ctx = chain_context(a, None, lora_name)
    else:
        ctx = chain_context(a, salt, lora_name)
    rc = kvb_hasher_init(&hs, a, <const uint8_t *>k, <const uint8_t *>none,
                         <const uint8_t *>ctx, len(ctx))
    if rc:
        raise_code(rc, "hash_blocks", 0, a)
    if n:
        kvb_hash_blocks(&hs, &par if parent is not None else NULL, 1 if parent is not None else 0,
                        i32_data(toks), n, bs, <kvb_hash_t *>cnp.PyArray_DATA(out),
                        <kvb_hash_t *>cnp.PyArray_DATA(ext))
    cdef kvb_hash_t *hv = <kvb_hash_t *>cnp.PyArray_DATA(out)
    if g:
        for i in range(n):
            hv[i].lo ^= tag.lo
            hv[i].hi ^= tag.hi
    if not digests:
        return out
    dig = np.empty((n, size), dtype=np.uint8)
    for i in range(n):
        dg.h = (<kvb_hash_t *>cnp.PyArray_DATA(out))[i]
        dg.x = (<kvb_hash_t *>cnp.PyArray_DATA(ext))[i]
        kvb_digest_to_bytes(a, &dg, <uint8_t *>cnp.PyArray_DATA(dig) + i * size)
    return out, dig


cdef kvb_hash_t _key_of(object key, str what, type dtype_error) except *:
    """A 128-bit key from an int in [0, 2**128) or a ``[lo, hi]`` uint64 pair; an array of
    another dtype raises ``dtype_error``, of another shape InvalidArgumentError."""
    cdef kvb_hash_t h
    if isinstance(key, int) and not PyBool_Check(key):
        if key < 0 or key >> 128:
            raise InvalidArgumentError(f"{what} must be a 128-bit unsigned int, got {key}")
        h.lo = key & 0xFFFFFFFFFFFFFFFF
        h.hi = key >> 64
        return h
    try:
        arr = np.asarray(key)
    except Exception as exc:
        raise InvalidTypeError(f"{what}: {type(exc).__name__}") from None
    if arr.dtype != np.uint64:
        raise dtype_error(f"{what} must be a 128-bit int or a uint64 [lo, hi] pair, got "
                          f"dtype {arr.dtype}")
    if arr.shape != (2,):
        raise InvalidArgumentError(f"{what} must be a uint64 [lo, hi] pair, got shape "
                                   f"{arr.shape}")
    h.lo = arr[0]
    h.hi = arr[1]
    return h


cdef kvb_hash_t _parent_hash(object parent) except *:
    """A parent (or looked-up) hash: ``_key_of``, any non-uint64 array refused as a value."""
    return _key_of(parent, "parent hash", InvalidArgumentError)


cdef kvb_hash_t _one_key(object key, str what) except *:
    """One 128-bit key: an int in [0, 2**128) (numpy integers too) or a ``[lo, hi]`` uint64
    pair. Bools, floats and arrays of another dtype are refused (InvalidTypeError), as
    as_int refuses them."""
    if PyBool_Check(key) or isinstance(key, float):
        raise InvalidTypeError(f"{what} must be a 128-bit int or a uint64 [lo, hi] pair, got "
                               f"{type(key).__name__}")
    if type(key) in _NP_INT_TYPES:
        key = int(key)
    return _key_of(key, what, InvalidTypeError)


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
