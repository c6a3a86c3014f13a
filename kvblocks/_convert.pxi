# Argument conversion and error mapping for _core.pyx (included there).
#
# The boundary rule every public call follows:
#   1. convert: ids to exact int/str, tokens and ids to owned int32 arrays, scalars through
#      as_int. Only this phase may run Python code (numpy conversion, __array__, generators);
#   2. validate against the allocator's state;
#   3. mutate, with no Python code running until the call returns.
# A failed call raises a KVBlocksError subclass and changes nothing.

cdef extern from "Python.h":
    object PyNumber_Index(object o)
    object PyUnicode_FromObject(object o)
    bint PyLong_Check(object o)
    bint PyUnicode_Check(object o)
    bint PyBool_Check(object o)

# exact numpy integer scalar types (their __index__ is numpy's C code, never user code)
_NP_INT_TYPES = frozenset({np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                           np.uint32, np.uint64, np.intc, np.uintc, np.intp, np.uintp})


cdef object norm_id(object sid):
    """The exact ``int`` or ``str`` a sequence id stands for.

    int subclasses and numpy integer scalars become the equal ``int`` (``np.int64(1)`` is id
    1); str subclasses the equal ``str``, so their ``__hash__``/``__eq__`` never run inside
    the allocator. ``bool``, ``float`` and anything else are refused: ``True`` and ``1.0``
    would otherwise alias id 1.
    """
    cdef type t = type(sid)
    if t is int or t is str:
        return sid
    if PyBool_Check(sid):
        raise InvalidTypeError("sequence ids must be int or str, got bool")
    if PyLong_Check(sid):
        return PyNumber_Index(sid)  # an exact int copy; no user code runs
    if PyUnicode_Check(sid):
        return PyUnicode_FromObject(sid)  # an exact str copy
    if t in _NP_INT_TYPES:
        return PyNumber_Index(sid)
    raise InvalidTypeError(f"sequence ids must be int or str, got {t.__name__}")


cdef int64_t as_int(object v, str name, int64_t lo, int64_t hi) except? -1:
    """A checked scalar: an int (or numpy integer) in [lo, hi]. Floats and bools are refused
    (no silent truncation), out-of-range values raise InvalidArgumentError (no wrap-around)."""
    cdef int overflow = 0
    cdef long long x
    if type(v) is not int:
        if PyBool_Check(v) or not (PyLong_Check(v) or type(v) in _NP_INT_TYPES):
            raise InvalidTypeError(f"{name} must be an int, got {type(v).__name__}")
        v = PyNumber_Index(v)
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < lo or x > hi:
        raise InvalidArgumentError(f"{name} must be in [{lo}, {hi}], got {v}")
    return x


cdef inline bint is_i32_vector(object obj):
    """True for a 1-D C-contiguous aligned int32 ndarray (the zero-conversion fast path)."""
    if not cnp.PyArray_Check(obj):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>obj
    return (cnp.PyArray_TYPE(a) == cnp.NPY_INT32 and cnp.PyArray_NDIM(a) == 1
            and cnp.PyArray_ISCARRAY_RO(a))


cdef inline int32_t *i32_data(cnp.ndarray a):
    return <int32_t *>cnp.PyArray_DATA(a) if cnp.PyArray_DIM(a, 0) else NULL


cdef void *buf_ptr(object arr, int typenum, int ndim, Py_ssize_t rows, str name) except NULL:
    """Data pointer of a writable C-contiguous buffer of the given dtype, rank and rows."""
    if not cnp.PyArray_Check(arr):
        raise InvalidTypeError(f"metadata: buffer {name} must be a numpy array")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if (cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != ndim
            or not cnp.PyArray_ISCARRAY(a)):
        want = "int64" if typenum == cnp.NPY_INT64 else "int32"
        raise InvalidTypeError(f"metadata: buffer {name} must be a writable C-contiguous "
                               f"{ndim}-D {want} array, got {arr.dtype} {arr.shape}")
    if cnp.PyArray_DIM(a, 0) < rows:
        raise InvalidArgumentError(f"metadata: buffer {name} holds {cnp.PyArray_DIM(a, 0)} "
                                   f"rows, the batch needs {rows}")
    return cnp.PyArray_DATA(a)


cdef inline cnp.ndarray new_i32(Py_ssize_t n):
    cdef cnp.npy_intp dim = n
    return cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)


@cython.boundscheck(False)
@cython.wraparound(False)
cdef cnp.ndarray list_as_int32(list obj, str name):
    """A list of exact ints as int32 in one pass (numpy's asarray of a Python list costs about
    20 ns per item, this about 1); None when an item is not an exact int (bools, numpy
    scalars, anything else): the caller takes numpy's path, which decides. No Python code
    runs, so the list cannot change under the loop."""
    cdef Py_ssize_t n = len(obj), i
    cdef cnp.ndarray out = new_i32(n)
    cdef int32_t *d = <int32_t *>cnp.PyArray_DATA(out)
    cdef object v
    cdef long x
    cdef int overflow = 0
    for i in range(n):
        v = obj[i]
        if type(v) is not int:
            return None
        x = PyLong_AsLongAndOverflow(v, &overflow)
        if overflow or x < INT32_MIN or x > INT32_MAX:
            raise InvalidArgumentError(f"{name} holds values outside int32")
        d[i] = <int32_t>x
    return out


cdef cnp.ndarray as_int32(object obj, str name):
    """A 1-D C-contiguous int32 array from an int array, list or range; checks the range."""
    if is_i32_vector(obj):
        return <cnp.ndarray>obj
    cdef cnp.ndarray fast
    if type(obj) is list:
        fast = list_as_int32(<list>obj, name)
        if fast is not None:
            return fast
    cdef object arr
    if type(obj) is np.ndarray:
        arr = obj
    else:
        try:
            arr = np.asarray(obj)
        except KVBlocksError:
            raise
        except Exception as exc:
            raise InvalidTypeError(f"{name} must be a sequence of ints: "
                                   f"{type(exc).__name__}") from None
        if not cnp.PyArray_Check(arr):
            raise InvalidTypeError(f"{name} must be a sequence of ints")
        if arr.size == 0 and arr.ndim == 1:
            arr = arr.astype(np.int32)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":  # bools, floats and objects are refused
        raise InvalidTypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        raise InvalidArgumentError(f"{name} holds values outside int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef object as_hashes(object obj, str name="hashes"):
    """An (n, 2) C-contiguous uint64 array of [lo, hi] 128-bit hashes."""
    cdef object arr
    if isinstance(obj, (list, tuple)) and obj and type(obj[0]) is int:  # 128-bit ints
        if not all(type(h) is int and 0 <= h < (1 << 128) for h in obj):
            raise InvalidArgumentError(f"{name}: 128-bit unsigned ints expected")
        arr = np.array([[h & 0xFFFFFFFFFFFFFFFF, h >> 64] for h in obj], dtype=np.uint64)
    else:
        try:
            arr = np.asarray(obj)
        except Exception as exc:
            raise InvalidTypeError(f"{name}: {type(exc).__name__}") from None
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    if arr.dtype != np.uint64:
        raise InvalidTypeError(f"{name} must be uint64 [n, 2] (as from hash_blocks), "
                               f"got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise InvalidArgumentError(f"{name} must have shape [n, 2], got {arr.shape}")
    return np.ascontiguousarray(arr)


cdef bytes as_key(object key):
    if key is None:
        return _DEFAULT_KEY
    if isinstance(key, str):
        key = _utf8(key, "hash key")
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"hash key must be 16 bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) != 16:
        raise InvalidArgumentError(f"hash key must be 16 bytes, got {len(key)}")
    return key


cdef bytes _utf8(str s, str what):
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{what} is not valid UTF-8 text (lone surrogate)") from None


cdef bytes as_salt(object salt):
    """The bytes a salt is hashed as: a type tag, then its content.

    ``None`` is no salt. A ``str`` is tagged ``s`` and UTF-8 encoded, bytes-like salts are
    tagged ``b``: ``"7"`` and ``b"7"`` are different salts, ``""`` differs from ``None``.
    Other types (ints included) are refused: pass ``str(salt)`` to mean the text.
    """
    if salt is None:
        return b""
    if isinstance(salt, str):
        return b"s" + _utf8(salt, "salt")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return b"b" + bytes(salt)
    raise InvalidTypeError(f"salt must be str or bytes, got {type(salt).__name__}")


cdef inline object hash_int(kvb_hash_t h):
    return (<object>h.hi << 64) | <object>h.lo


# ---------------------------------------------------------------------------------------------
# errors: the one mapping from C codes to kvblocks.errors
# ---------------------------------------------------------------------------------------------
#: Every C error code of include/kvblocks.h and the exception it raises (docs: kvblocks.errors;
#: KVB_ENOMEM is Python's MemoryError). A code not listed raises KVBlocksError.
ERROR_TYPES = {
    KVB_ENOMEM: MemoryError,
    KVB_EOUTOFBLOCKS: OutOfBlocksError,
    KVB_EINVAL: InvalidArgumentError,
    KVB_ERANGE: InvalidArgumentError,
    KVB_ESTATE: InvalidStateError,
    KVB_ECORRUPT: CorruptionError,
    KVB_EUNKNOWN: UnknownSequenceError,
    KVB_EDUP: InvalidArgumentError,
    KVB_ESWAPPED: InvalidStateError,
    KVB_EPENDING: InvalidStateError,
    KVB_EGAP: InvalidStateError,
}


def error_for(int rc, str what, int64_t a=0, int64_t b=0, str check="", object seq=None,
              str msg=None, str ctx=None):
    """The exception for C code ``rc`` (not raised): its type from ERROR_TYPES, its message
    from the code and the C error detail (a and b, see kvblocks.h; ``check`` the name of a
    failed check or buffer, ``seq`` the sequence concerned, ``ctx`` the call's arguments a
    failed check names), or ``msg`` where a caller words it itself (the type still comes from
    the code). ``what`` is the call (``"truncate('a', 3)"``); a few codes are worded per call
    here, the one place that words them."""
    cls = ERROR_TYPES.get(rc, KVBlocksError)
    if msg is not None:
        return cls(msg)
    cdef str name = check
    cdef str who = f"sequence {seq!r}" if seq is not None else "a sequence"
    cdef str call = what.partition("(")[0]
    if rc == KVB_ENOMEM:
        return cls(f"{what}: out of host memory")
    if rc == KVB_EOUTOFBLOCKS:
        if call == "swap_out":
            return cls(f"{what}: need {a} host blocks, {b} free")
        return cls(f"{what}: need {a} blocks, {b} free")
    if rc == KVB_ERANGE:
        if name:
            return cls(f"{what}: buffer {name} holds {b}, the step needs {a}")
        return cls(f"{what}: value {b} at index {a} is out of range")
    if rc == KVB_EINVAL:
        if call == "truncate":
            return cls(f"{what}: must be in [0, {a}]")
        if name == "query_lens / draft_lens":  # a step's lengths (kvb_step_check_for)
            return cls(f"{what}: query_lens[{a}] / draft_lens[{a}] = {b} is not in "
                       f"[0, num_tokens] / >= 0")
        if name and ctx is not None:  # a geometry check, with the arguments it judged
            return cls(f"{what}: {name} ({ctx})")
        return cls(f"{what}: invalid value {b}" + (f" at index {a}" if a else ""))
    if rc == KVB_ESWAPPED:
        return cls(f"{what}: {who} is swapped out (swap_in first)")
    if rc == KVB_EPENDING:
        if call == "take_copies":
            return cls(f"{what}: {a} offloads and {b} onloads are pending; drain "
                       f"take_offloads() and take_onloads() first (a copy may overwrite a "
                       f"block an offload reads, or read one an onload fills)")
        if call == "take_onloads":
            return cls(f"{what}: {a} offloads are pending; run take_offloads() first (an "
                       f"onload may read a host block an offload writes)")
        if call == "reset_prefix_cache":
            return cls(f"{what}: {a} offloads and {b} onloads are pending; drain "
                       f"take_offloads() and take_onloads() first (they hold cache entries)")
        if name:  # the host tier's pairs
            return cls(f"{what}: {a} {name}; drain them first")
        return cls(f"{what}: {a} copy-on-write copies are pending; drain them "
                   f"with take_copies() and run ops.copy_blocks first")
    if rc == KVB_EGAP:
        return cls(f"{what}: {who} has {b} committed tokens before the query "
                   f"that were never computed; include them in query_lens")
    if rc == KVB_ESTATE:
        if call == "reset_prefix_cache":
            return cls(f"{what}: {a} of {b} {name or 'cached blocks'} (free the sequences "
                       f"holding them, or drain the copies that hold them, first)")
        return cls(f"{what}: not allowed now" + (f": {name}" if name else
                                                 f" (item {b} at index {a})"))
    if rc == KVB_EDUP:
        if seq is not None:
            return cls(f"{what}: {who} appears twice")
        return cls(f"{what}: duplicate or conflicting entry {b} at index {a}")
    if rc == KVB_ECORRUPT:
        return cls(f"{what}: invariant violated: {name or 'unnamed'} "
                   f"(item {b}, slot or index {a})")
    if rc == KVB_EUNKNOWN:
        return cls(f"{what}: unknown {who}")
    return cls(f"{what}: error {rc}")


cdef int raise_code(int rc, str what, int64_t a, int64_t b, const char *check=NULL,
                    object seq=None, str msg=None, str ctx=None) except -1:
    """Raise error_for(...): the one place a C code becomes an exception."""
    raise error_for(rc, what, a, b, check.decode() if check is not NULL else "", seq, msg, ctx)
