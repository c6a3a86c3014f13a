"""KV cache events for cluster routers: the types, vLLM's wire encoding and a ZMQ publisher.

- :mod:`kvblocks.events.types`: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``
  (what ``pool.take_events()`` returns) and ``coalesce``; no dependency.
- :mod:`kvblocks.events.wire`: ``encode_batch``, vLLM's msgpack ``KVEventBatch`` byte for
  byte (needs msgspec: ``pip install "kvblocks[events]"``).
- :mod:`kvblocks.events.zmq`: ``ZmqEventPublisher``, vLLM's ZeroMQ transport with replay
  (needs pyzmq and msgspec).

The wire modules load on first use, so importing kvblocks never needs msgspec or pyzmq.
"""

from .types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, coalesce

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "ZmqEventPublisher",
    "coalesce",
    "encode_batch",
    "offset_endpoint",
]

_LAZY = {
    "encode_batch": "wire",
    "to_wire": "wire",
    "fold_hash": "wire",
    "ZmqEventPublisher": "zmq",
    "offset_endpoint": "zmq",
}


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    try:
        m = importlib.import_module(f"{__name__}.{mod}")
    except ImportError as exc:
        if exc.name not in ("msgspec", "zmq"):
            raise
        raise ImportError(
            f'kvblocks.events.{name} needs {exc.name}: pip install "kvblocks[events]"',
            name=exc.name,
        ) from exc
    return getattr(m, name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
