"""ZmqEventPublisher: vLLM's ZeroMQ transport for KV events (needs pyzmq and msgspec).

Wire, as vLLM publishes it (shared spec: kv-events-wire.md section 1):

- one PUB socket; it binds when the endpoint holds ``*`` or ``::`` or is ``ipc://`` or
  ``inproc://``, and connects otherwise (``bind=`` overrides the rule);
- every message is 3 frames ``[topic, seq, payload]``: the UTF-8 topic, the batch's sequence
  number as 8 big-endian bytes (0, 1, 2, ... per publisher) and the msgpack ``KVEventBatch``;
- data parallelism: rank r shifts the TCP port of both endpoints by r (port 0 stays 0) and
  suffixes an ``inproc`` name with ``_dp{r}``; the batch carries the rank;
- replay (``replay_endpoint``): a ROUTER socket keeps the last ``buffer_steps`` batches. A
  DEALER client sends ``[b"", start]`` (8 big-endian bytes); for each kept batch with
  ``seq >= start`` it gets ``[b"", topic, seq, payload]`` (``replay_layout="topic"``, vLLM
  >= 0.26) or ``[b"", seq, payload]`` (``"legacy"``, vLLM <= 0.25), then the end marker with
  seq ``ff``*8 and an empty payload.

Threading: :meth:`ZmqEventPublisher.publish` only stamps the batch (time, sequence number)
and appends it to a bounded queue; a background thread encodes, sends and answers replay
requests, so the engine step never waits on the network. When the queue is full the batch
is dropped and counted (``dropped``); its sequence number is spent, so a subscriber sees the
gap. The PUB socket drops messages for a subscriber past its high-water mark instead of
blocking, and a replay client that disappears costs nothing.
"""

from __future__ import annotations

import collections
import errno
import threading
import time
from typing import Any, Optional, Sequence

import msgspec
import zmq

from ..errors import InvalidArgumentError, InvalidStateError, InvalidTypeError
from .wire import FORMATS, HASH_INTS, _Batch, to_wire

__all__ = ["ZmqEventPublisher", "offset_endpoint", "END_SEQ", "REPLAY_LAYOUTS"]

END_SEQ = b"\xff" * 8
"""Sequence frame of the replay end marker: -1 as 8 big-endian bytes."""

REPLAY_LAYOUTS = ("topic", "legacy")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_endpoint(endpoint: Any, what: str) -> str:
    if not isinstance(endpoint, str):
        raise InvalidTypeError(
            f"{what} must be a str such as 'tcp://*:5557', got {type(endpoint).__name__}"
        )
    if not endpoint.startswith(_SCHEMES) or endpoint.endswith("//"):
        raise InvalidArgumentError(
            f"{what} {endpoint!r}: expected tcp://host:port, ipc://path or inproc://name"
        )
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise InvalidArgumentError(
                f"{what} {endpoint!r}: expected tcp://host:port with a port in 0..65535"
            )
    return endpoint


def offset_endpoint(endpoint: Optional[str], data_parallel_rank: int) -> Optional[str]:
    """The endpoint of data-parallel rank ``data_parallel_rank``, by vLLM's rule: the TCP
    port plus the rank (port 0, "any free port", stays 0), an ``inproc`` name plus
    ``_dp{rank}``; rank 0 and None are returned unchanged.

    >>> offset_endpoint("tcp://*:5557", 2), offset_endpoint("inproc://kv", 1)
    ('tcp://*:5559', 'inproc://kv_dp1')
    """
    if type(data_parallel_rank) is not int or data_parallel_rank < 0:
        raise InvalidArgumentError(
            f"data_parallel_rank must be an int >= 0, got {data_parallel_rank!r}"
        )
    if endpoint is None:
        return None
    _check_endpoint(endpoint, "endpoint")
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        p = int(port)
        if p == 0:
            return endpoint
        if p + data_parallel_rank > 65535:
            raise InvalidArgumentError(
                f"endpoint {endpoint!r}: port {p} + rank {data_parallel_rank} is past 65535"
            )
        return f"{base}:{p + data_parallel_rank}"
    raise InvalidArgumentError(
        f"endpoint {endpoint!r}: an ipc endpoint cannot be shifted "
        f"per data-parallel rank; give each rank its own path"
    )


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local-transport endpoint, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _zmq_error(exc: zmq.ZMQError, what: str, endpoint: str) -> Exception:
    if exc.errno == errno.EADDRINUSE:
        return InvalidStateError(f"{what} {endpoint!r}: address already in use ({exc})")
    return InvalidArgumentError(f"{what} {endpoint!r}: {exc}")


class ZmqEventPublisher:
    """Publish kvblocks KV events the way vLLM does, for KV-aware routers.

    ``publish(pool.take_events())`` once per engine step, after the step's K/V writes;
    nothing is sent for an empty list. ``close()`` (or a ``with`` block) sends what is
    queued, up to ``timeout`` seconds, and closes the sockets.

    ``endpoint``, ``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm`` and
    ``max_queue_size`` mean what they mean in vLLM's ``KVEventsConfig``. ``fmt`` and
    ``hash_int`` select the payload encoding (see :func:`kvblocks.events.encode_batch`);
    ``replay_layout`` the replay reply frames; ``bind`` overrides the bind-or-connect rule;
    ``context`` is the zmq Context (default: the process-wide instance; ``inproc``
    subscribers must share it).

    Bad endpoints raise InvalidArgumentError and an address in use InvalidStateError, from
    the constructor (the sockets are bound or connected there).
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        fmt: str = "map",
        hash_int: str = "unsigned",
        replay_layout: str = "topic",
        bind: Optional[bool] = None,
        context: Optional[zmq.Context] = None,
    ) -> None:
        if not isinstance(topic, str):
            raise InvalidTypeError(f"topic must be a str, got {type(topic).__name__}")
        for name, v, lo in (
            ("buffer_steps", buffer_steps, 0),
            ("hwm", hwm, 0),
            ("max_queue_size", max_queue_size, 1),
        ):
            if type(v) is not int or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        if fmt not in FORMATS:
            raise InvalidArgumentError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        if hash_int not in HASH_INTS:
            raise InvalidArgumentError(f"hash_int must be one of {HASH_INTS}, got {hash_int!r}")
        if replay_layout not in REPLAY_LAYOUTS:
            raise InvalidArgumentError(
                f"replay_layout must be one of {REPLAY_LAYOUTS}, got {replay_layout!r}"
            )
        pub_endpoint = offset_endpoint(endpoint, data_parallel_rank)
        assert pub_endpoint is not None  # endpoint is a str (checked above)
        self._endpoint: str = pub_endpoint
        self._replay_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank)
        self._rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._fmt = fmt
        self._hash_int = hash_int
        self._legacy = replay_layout == "legacy"
        self._max_queue = max_queue_size
        self._queue: collections.deque = collections.deque()
        self._buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self._wake = threading.Event()
        self._next_seq = 0
        self._closed = False
        self.dropped = 0
        """Batches dropped because the queue was full (their sequence numbers are skipped)."""
        self.sent = 0
        """Batches handed to the PUB socket."""
        self.errors = 0
        """Batches the background thread failed to encode or send (see ``last_error``)."""
        self.last_error: Optional[BaseException] = None

        self._ctx = context if context is not None else zmq.Context.instance()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(hwm)  # SNDHWM and RCVHWM
            do_bind = _binds(self._endpoint) if bind is None else bool(bind)
            try:
                if do_bind:
                    self._pub.bind(self._endpoint)
                else:
                    self._pub.connect(self._endpoint)
            except zmq.ZMQError as exc:
                raise _zmq_error(exc, "endpoint", self._endpoint) from exc
            if self._replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                try:
                    self._replay.bind(self._replay_endpoint)
                except zmq.ZMQError as exc:
                    raise _zmq_error(exc, "replay_endpoint", self._replay_endpoint) from exc
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvblocks-kv-events", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------
    def publish(self, events: Sequence[Any], ts: Optional[float] = None) -> Optional[int]:
        """Queue one batch (one engine step's events); returns its sequence number, or None
        when ``events`` is empty (nothing is sent) or the batch was dropped (queue full).

        ``ts`` defaults to ``time.time()``. The list is taken over: do not modify it after.
        Call it from one thread (the engine's): the sequence numbers are assigned here.
        Encoding happens on the background thread; an event it cannot encode (see
        :func:`kvblocks.events.encode_batch`) is counted in ``errors``. Check a batch
        upfront with ``encode_batch`` when the events come from elsewhere than take_events.
        """
        if not events:
            return None
        if self._closed:
            raise InvalidStateError("publish: the publisher is closed")
        seq = self._next_seq
        self._next_seq = seq + 1
        if len(self._queue) >= self._max_queue:
            self.dropped += 1
            return None
        self._queue.append((seq, time.time() if ts is None else ts, events))
        self._wake.set()
        return seq

    @property
    def endpoint(self) -> str:
        """The PUB endpoint in use: after a bind, the address zmq reports (the real port
        when bound to port 0)."""
        return self._last_endpoint(self._pub, self._endpoint)

    @property
    def replay_endpoint(self) -> Optional[str]:
        """The replay ROUTER endpoint in use, or None without replay."""
        if self._replay_endpoint is None:
            return None
        return self._last_endpoint(self._replay, self._replay_endpoint)

    @property
    def topic(self) -> str:
        """The topic frame of every message (llm-d expects ``kv@<pod-ip>:<port>@<model>``)."""
        return self._topic.decode("utf-8")

    @property
    def next_seq(self) -> int:
        """The sequence number the next published batch gets."""
        return self._next_seq

    @property
    def pending(self) -> int:
        """Batches queued and not yet sent."""
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch is sent (True) or ``timeout`` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while self._queue or self._busy:
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return not self._queue and not self._busy
            time.sleep(0.0005)
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), stop the thread and close
        the sockets. Idempotent; ``publish`` raises InvalidStateError afterwards."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # still sending: let it notice the flag, drop the rest
            self._queue.clear()
            self._thread.join(timeout)
        self._close_sockets()

    def __enter__(self) -> "ZmqEventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"next_seq={self._next_seq}"
        return (
            f"ZmqEventPublisher({self._endpoint!r}, topic={self._topic.decode()!r}, "
            f"rank={self._rank}, {state}, sent={self.sent}, dropped={self.dropped})"
        )

    # -- background thread -----------------------------------------------------------------
    _busy = False

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        pub, replay, queue, buf = self._pub, self._replay, self._queue, self._buffer
        assert pub is not None  # the constructor succeeded
        # a replay request waits at most this long when no batch wakes the thread
        wait = 0.005 if replay is not None else 0.1
        while True:
            if replay is not None:
                self._serve_replay(replay)
            if not queue:
                if self._closed:
                    return
                self._wake.wait(wait)
                self._wake.clear()
                continue
            self._busy = True
            seq, ts, events = queue.popleft()
            try:
                payload = encoder.encode(
                    _Batch(float(ts), to_wire(events, self._fmt, self._hash_int), self._rank)
                )
                seq_b = seq.to_bytes(8, "big")
                pub.send_multipart((self._topic, seq_b, payload), flags=zmq.NOBLOCK)
                self.sent += 1
                buf.append((seq_b, payload))
            except Exception as exc:  # never let one batch stop the publisher
                self.errors += 1
                self.last_error = exc
            finally:
                self._busy = False

    def _serve_replay(self, replay: zmq.Socket) -> None:
        try:
            while replay.poll(0):
                frames = replay.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    continue  # not [id, b"", start]: ignored, as vLLM does
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                head = (ident, b"") if self._legacy else (ident, b"", self._topic)
                for seq_b, payload in list(self._buffer):
                    if int.from_bytes(seq_b, "big") >= start:
                        replay.send_multipart(head + (seq_b, payload), flags=zmq.NOBLOCK)
                replay.send_multipart(head + (END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # e.g. the client's queue is full: it re-asks
            self.errors += 1
            self.last_error = exc

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _last_endpoint(sock, fallback: str) -> str:
        if sock is None or sock.closed:
            return fallback
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if last else fallback

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None and not s.closed:
                s.close(linger=0)
