"""vLLM's ``KVEventBatch`` msgpack encoding, byte for byte (needs msgspec).

KV-aware routers (NVIDIA Dynamo's KV router, llm-d's KV-cache indexer, the SGLang router)
subscribe to the events vLLM publishes; this module writes kvblocks' events in exactly that
encoding, so an engine built on kvblocks joins such a fleet with no router-side code.

The batch is a 3-element array ``[ts (float64), events, data_parallel_rank]``. Each event is
a msgspec tagged struct, in one of two forms:

- ``fmt="map"`` (vLLM >= 0.24, the default): ``{"type": "BlockStored", field: value, ...}``
  in declaration order, fields with a default dropped when they hold it. The structs below
  declare every field of vLLM 0.34 so that msgspec picks the same map header (BlockStored:
  15 declared fields + the tag, hence map16 ``de 00 0b``);
- ``fmt="array"`` (vLLM 0.22 and 0.23): ``["BlockStored", f1, f2, ...]``, every field.

Hashes: kvblocks keeps 128 bits per block, ``(hi << 64) | lo``. vLLM sends
``int.from_bytes(digest, "big") & (2**64 - 1)``, the digest's last 8 bytes; read as 16
big-endian bytes a kvblocks hash ends in ``lo``, so the wire value is ``h & (2**64 - 1)``,
the same fold for stored, removed and parent hashes (a router links a stored chain to its
parent by comparing them). ``hash_int="unsigned"`` (vLLM's value, msgpack ``cf`` from 2**63)
or ``"signed"`` (the same 64 bits as an int64, for consumers that only read int64).

Fields written as vLLM 0.33/0.34 write them: ``lora_id`` and ``lora_name`` of the request's
adapter, ``extra_keys`` vLLM's untagged event keys per block (nil, or ``[lora_name]`` on every
block of a LoRA request plus the cache salt on a chain's first block), ``group_idx``,
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` from the event (``0``,
``"full_attention"`` and nil for a model with one full-attention group).

``encode_batch(pool, ...)`` (a BlockPool, or a BlockManager: its device pool, then its host
pool) drains the pool's log and writes the same bytes in C (``pool.take_events_wire``),
without building Python events: several times faster than msgspec on prebuilt structs.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import msgspec

from ..errors import InvalidArgumentError, InvalidTypeError, KVBlocksError
from .types import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["FORMATS", "HASH_INTS", "encode_batch", "fold_hash", "to_wire"]

FORMATS = ("map", "array")
HASH_INTS = ("unsigned", "signed")

_M64 = (1 << 64) - 1
_S64 = 1 << 63

_WireHash = Union[bytes, int]  # vLLM's ExternalBlockHash


# -- vLLM >= 0.24 (map form); fields as declared in vLLM 0.34 ---------------------------------
class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: List[_WireHash]
    parent_block_hash: Optional[_WireHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[List[List[int]]] = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: List[_WireHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


# -- vLLM 0.22 / 0.23 (array form): every declared field, in order -----------------------------
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: List[_WireHash]
    parent_block_hash: Optional[_WireHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class _ArrayRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: List[_WireHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class _ArrayCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


_FORMS = {
    "map": (_Stored, _Removed, _Cleared()),
    "array": (_ArrayStored, _ArrayRemoved, _ArrayCleared()),
}


def fold_hash(h: int, hash_int: str = "unsigned") -> int:
    """The 64-bit wire value of one block hash: ``h mod 2**64``, as an unsigned or a signed
    (two's complement) int. Any int folds, as in vLLM (whose sha256 ints are 256-bit)."""
    if hash_int not in HASH_INTS:
        raise InvalidArgumentError(f"hash_int must be one of {HASH_INTS}, got {hash_int!r}")
    if type(h) is not int:
        raise InvalidTypeError(f"a block hash must be an int, got {type(h).__name__}")
    h &= _M64
    return h - ((h & _S64) << 1) if hash_int == "signed" else h


def to_wire(events: Sequence[Any], fmt: str = "map", hash_int: str = "unsigned") -> List[Any]:
    """kvblocks events as vLLM's msgspec structs (for ``fmt``), hashes folded, validated.

    Raises InvalidArgumentError for an event vLLM's consumers cannot take (a BlockStored
    whose token_ids are not ``len(block_hashes) * block_size`` tokens, as from
    ``pool.cache()`` without token_ids) and InvalidTypeError for a non-event or a hash that
    is not an int.
    """
    try:
        Stored, Removed, cleared = _FORMS[fmt]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"fmt must be one of {FORMATS}, got {fmt!r}") from None
    if hash_int not in HASH_INTS:
        raise InvalidArgumentError(f"hash_int must be one of {HASH_INTS}, got {hash_int!r}")
    signed = hash_int == "signed"
    M, S = _M64, _S64
    out: List[Any] = []
    append = out.append
    try:
        for ev in events:  # the hot loop: no per-event call but the struct's
            t = type(ev)
            if t is BlockStored:
                hs = ev.block_hashes
                n = len(hs)
                bs = ev.block_size
                toks = ev.token_ids
                if type(toks) is not list:
                    toks = [int(x) for x in toks]
                if len(toks) != n * bs or type(bs) is not int or bs <= 0:
                    raise InvalidArgumentError(
                        f"BlockStored of {n} blocks, block_size {bs!r}, needs {n} * "
                        f"block_size token_ids, got {len(toks)} (give token_ids to "
                        f"pool.cache())"
                    )
                ek = ev.extra_keys
                if ek is None:
                    ek = [None] * n
                elif type(ek) is not list or len(ek) != n:
                    raise InvalidArgumentError(
                        f"BlockStored of {n} blocks needs one extra_keys entry per block (None "
                        f"or a tuple), got {ek!r}"
                    )
                par = ev.parent_block_hash
                if signed:
                    w = [(h & M) - ((h & S) << 1) for h in hs]
                    if par is not None:
                        par = (par & M) - ((par & S) << 1)
                else:
                    w = [hs[0] & M] if n == 1 else [h & M for h in hs]
                    if par is not None:
                        par &= M
                append(
                    Stored(
                        w,
                        par,
                        toks,
                        bs,
                        ev.lora_id,
                        ev.medium,
                        ev.lora_name,
                        ek,
                        ev.group_idx,
                        ev.kv_cache_spec_kind,
                        ev.kv_cache_spec_sliding_window,
                    )
                )
            elif t is BlockRemoved:
                hs = ev.block_hashes
                if signed:
                    w = [(h & M) - ((h & S) << 1) for h in hs]
                else:
                    w = [hs[0] & M] if len(hs) == 1 else [h & M for h in hs]
                append(Removed(w, ev.medium, ev.group_idx))
            elif t is AllBlocksCleared:
                append(cleared)
            else:
                raise InvalidTypeError(f"not a KV event: {t.__name__}")
    except KVBlocksError as exc:  # name the event: every event before it was appended
        raise type(exc)(f"event {len(out)}: {exc}") from None
    except TypeError as exc:
        raise InvalidTypeError(
            f"event {len(out)}: {exc} (block hashes must be ints, token_ids a list of ints)"
        ) from None
    return out


_encoder = msgspec.msgpack.Encoder()


def encode_batch(
    events: Sequence[Any],
    *,
    ts: float,
    data_parallel_rank: Optional[int] = 0,
    fmt: str = "map",
    hash_int: str = "unsigned",
) -> bytes:
    """vLLM's msgpack ``KVEventBatch`` of ``events`` (kvblocks BlockStored, BlockRemoved,
    AllBlocksCleared), byte for byte: ``fmt="map"`` for vLLM >= 0.24 consumers, ``"array"``
    for vLLM 0.22/0.23 ones; ``hash_int`` "unsigned" (vLLM) or "signed" (int64 readers).

    ``events`` may also be a ``BlockPool`` or a ``BlockManager``: its recorded events are
    drained (``take_events``) and written in C from the event log, the same bytes several
    times faster; a manager's batch holds both pools' events in the order they were
    recorded, as ``mgr.take_events()`` gives them (see docs/host-tier.md, "Events").

    >>> from kvblocks.events import BlockRemoved, encode_batch
    >>> encode_batch([BlockRemoved([(1 << 64) | 7])], ts=1.5).hex()[:24]  # [ts, [event...
    '93cb3ff80000000000009184'
    """
    from .. import _core

    if isinstance(events, (_core.BlockPool, _core.BlockManager)):
        return events.take_events_wire(
            ts=ts, data_parallel_rank=data_parallel_rank, fmt=fmt, hash_int=hash_int
        )
    batch = _batch(events, ts, data_parallel_rank, fmt, hash_int)
    try:
        return _encoder.encode(batch)
    except TypeError as exc:  # a value msgpack cannot carry (in extra_keys)
        raise InvalidTypeError(f"encode_batch: {exc}") from None


def _batch(events, ts, dp, fmt, hash_int) -> _Batch:
    if dp is not None and (type(dp) is not int or dp < 0):
        raise InvalidArgumentError(f"data_parallel_rank must be an int >= 0, got {dp!r}")
    try:
        ts = float(ts)
    except (TypeError, ValueError):
        raise InvalidTypeError(f"ts must be a number (seconds), got {ts!r}") from None
    return _Batch(ts, to_wire(events, fmt, hash_int), dp)
