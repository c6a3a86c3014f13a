# Hash modes: their names, vLLM's NONE_HASH seed, the chain context of a salt and a LoRA
# adapter, full digests as parents (included in _core.pyx).
#
# kvblocks keys a block on 128 bits. The 256-bit modes keep the half that holds the router's
# 64-bit wire value (so ``h & (2**64 - 1)``, encode_batch's fold, is that value in every mode)
# and hand out the full 32-byte digest on request (hash_blocks(..., digests=True)) to continue
# a chain with ``parent=``; the manager keeps the other half per block itself (csrc/chain.c).

HASH_ALGOS = ("siphash", "vllm_sha256_cbor", "vllm_sha256_cbor_v030", "sglang_sha256")
# the C enum's order (KVB_HASH_*)
_ALGO_IDS = {name: i for i, name in enumerate(HASH_ALGOS)}
_VLLM_DEFAULT_SEED = "vllm-none-hash"
_NO_NONE_HASH = bytes(32)


cdef int32_t as_algo(object algo) except -1:
    """The C mode of a hash mode name; InvalidArgumentError names the modes."""
    if not isinstance(algo, str):
        raise InvalidTypeError(f"hash mode must be a str, one of {HASH_ALGOS}, "
                               f"got {type(algo).__name__}")
    try:
        return _ALGO_IDS[algo]
    except KeyError:
        raise InvalidArgumentError(f"unknown hash mode {algo!r}: one of {HASH_ALGOS}") from None


cdef inline bint is_vllm(int32_t algo):
    return algo == KVB_HASH_VLLM_SHA256_CBOR or algo == KVB_HASH_VLLM_SHA256_CBOR_V030


cdef str effective_seed(int32_t algo, object seed):
    """vLLM's NONE_HASH seed: ``seed``, else PYTHONHASHSEED when set, else vLLM's default
    "vllm-none-hash" (vLLM >= 0.29). None for the modes without a seed (giving one there is
    an error)."""
    if not is_vllm(algo):
        if seed is not None:
            raise InvalidArgumentError(f"seed applies to the vLLM hash modes only, not "
                                       f"{HASH_ALGOS[algo]!r}")
        return None
    if seed is None:
        return os.environ.get("PYTHONHASHSEED", _VLLM_DEFAULT_SEED)
    if not isinstance(seed, str):
        raise InvalidTypeError(f"seed must be a str (vLLM hashes PYTHONHASHSEED as text), "
                               f"got {type(seed).__name__}")
    _utf8(seed, "seed")
    return seed


cdef bytes none_hash_of(int32_t algo, str seed):
    """NONE_HASH of a vLLM mode (sha256 of the CBOR text seed); 32 zero bytes otherwise."""
    if seed is None:
        return _NO_NONE_HASH
    cdef bytes s = _utf8(seed, "seed")
    cdef uint8_t out[32]
    kvb_vllm_none_hash(<const uint8_t *>s, len(s), out)
    return out[:32]


cdef object as_lora(object lora_name):
    """A LoRA adapter name: None or a non-empty str."""
    if lora_name is None:
        return None
    if not isinstance(lora_name, str):
        raise InvalidTypeError(f"lora_name must be a str, got {type(lora_name).__name__}")
    if not lora_name:
        raise InvalidArgumentError("lora_name must not be empty (None: the base model)")
    _utf8(lora_name, "lora_name")
    return str(lora_name)


cdef bytes chain_context(int32_t algo, object salt, object lora_name):
    """The chain context the C core hashes a sequence under (kvb_hasher_init): in SipHash
    and SGLang mode the salt's tagged bytes, prefixed by the adapter name when there is one
    (so adapters never share blocks); in the vLLM modes the CBOR of vLLM's extra keys."""
    lora = as_lora(lora_name)
    cdef bytes s, ln, out
    cdef int64_t n
    if not is_vllm(algo):
        s = as_salt(salt)
        if lora is None:
            return s  # as before the modes: SipHash hashes are unchanged
        ln = _utf8(lora, "lora_name")
        return b"L" + len(ln).to_bytes(4, "little") + ln + s
    if salt is not None and not isinstance(salt, str):
        raise InvalidTypeError(f"salt must be a str in {HASH_ALGOS[algo]!r} mode (vLLM's "
                               f"cache_salt), got {type(salt).__name__}")
    if lora is not None and algo == KVB_HASH_VLLM_SHA256_CBOR:
        raise InvalidArgumentError(
            "vllm_sha256_cbor (vLLM >= 0.31) hashes LoRA blocks with the adapter's path, which "
            "kvblocks does not take; use hash_algo='vllm_sha256_cbor_v030' (vLLM's untagged "
            "(lora_name,) extra key) or leave lora_name None")
    s = _utf8(salt, "salt") if salt is not None else None
    ln = _utf8(lora, "lora_name") if lora is not None else None
    n = kvb_vllm_context(algo, <const uint8_t *>s if s is not None else NULL,
                         len(s) if s is not None else 0,
                         <const uint8_t *>ln if ln is not None else NULL,
                         len(ln) if ln is not None else 0, NULL, 0)
    if n < 0:
        raise_code(<int>n, "hash context", 0, 0)
    if n == 0:
        return b""
    out = bytes(n)
    kvb_vllm_context(algo, <const uint8_t *>s if s is not None else NULL,
                     len(s) if s is not None else 0,
                     <const uint8_t *>ln if ln is not None else NULL,
                     len(ln) if ln is not None else 0, <uint8_t *><const char *>out, n)
    return out


cdef kvb_digest_t parent_digest(int32_t algo, object parent) except *:
    """A chain's parent: in SipHash mode a 128-bit hash (int or [lo, hi] row) or its 16
    digest bytes; in the 256-bit modes the full 32-byte digest (bytes or a uint8 row of
    hash_blocks(..., digests=True)), since the next block hashes all 32 bytes."""
    cdef kvb_digest_t d
    cdef int size = kvb_digest_size(algo)
    cdef bytes raw
    if isinstance(parent, (bytes, bytearray, memoryview)):
        raw = bytes(parent)
    elif (isinstance(parent, np.ndarray) and parent.dtype == np.uint8
            and parent.shape == (size,)):
        raw = parent.tobytes()
    elif algo == KVB_HASH_SIPHASH:
        d.h = _parent_hash(parent)
        d.x.lo = d.x.hi = 0
        return d
    else:
        raise InvalidArgumentError(
            f"parent in {HASH_ALGOS[algo]!r} mode is the previous block's full {size}-byte "
            f"digest (a row of hash_blocks(..., digests=True)): the next block hashes all of "
            f"it, and a 128-bit block hash keeps only half")
    if len(raw) != size:
        raise InvalidArgumentError(f"parent digest in {HASH_ALGOS[algo]!r} mode must be "
                                   f"{size} bytes, got {len(raw)}")
    kvb_digest_from_bytes(algo, <const uint8_t *><const char *>raw, &d)
    return d


def sha256(data) -> bytes:
    """SHA-256 of ``data`` as the C core computes it (the vLLM and SGLang hash modes use it).
    Exposed for known-answer tests.

    >>> sha256(b"abc").hex()[:16]
    'ba7816bf8f01cfea'
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"data must be bytes, got {type(data).__name__}")
    cdef bytes d = bytes(data)
    cdef uint8_t out[32]
    kvb_sha256(<const char *>d, len(d), out)
    return out[:32]
