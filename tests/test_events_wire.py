"""KV events on the wire (issue 14): vLLM's msgpack encoding byte for byte, and the ZeroMQ
publisher end to end on the loopback address.

The test vectors come from the shared spec kv-events-wire.md, section 6; the structs below are
declared the way vLLM declares them (vllm/distributed/kv_events.py, 0.34 for the map form,
0.23 for the array form), so decoding with them is what a vLLM-compatible router does.
Every socket receive is bounded by a poll timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, List, Optional, Tuple, Union

import pytest

msgspec = pytest.importorskip("msgspec")

from helpers import KEY, compute

import kvblocks
from kvblocks import BlockManager, BlockPool, hash_blocks
from kvblocks.errors import (
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
)
from kvblocks.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
)

M64 = (1 << 64) - 1

W1 = bytes.fromhex(
    "93cb3ff800000000000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "91cffedcba9876543210b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920102aa62"
    "6c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa6578"
    "7472615f6b65797391c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c"
    "6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391"
    "cffedcba9876543210a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f"
    "636b73436c656172656400"
)
W2 = bytes.fromhex(
    "93cb3ff8000000000000939cab426c6f636b53746f72656491cffedcba9876543210c092010202c0a3475055"
    "c091c000ae66756c6c5f617474656e74696f6ec094ac426c6f636b52656d6f76656491cffedcba9876543210"
    "a34750550091b0416c6c426c6f636b73436c656172656400"
)
H = 0xFEDCBA9876543210


def w_events(high=0):
    """The events of W1/W2; ``high`` fills the upper 64 bits that the wire drops."""
    return [
        BlockStored([(high << 64) | H], None, [1, 2], 2),
        BlockRemoved([(high << 64) | H]),
        AllBlocksCleared(),
    ]


# -- vLLM's structs, declared as vLLM declares them ---------------------------------------------
ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
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


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]


# vLLM 0.22 / 0.23: the events were array_like
class KVCacheEvent023(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored023(KVCacheEvent023, tag="BlockStored"):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class VBlockRemoved023(KVCacheEvent023, tag="BlockRemoved"):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class VAllBlocksCleared023(KVCacheEvent023, tag="AllBlocksCleared"):
    pass


class KVEventBatch023(EventBatch):
    events: List[Union[VBlockStored023, VBlockRemoved023, VAllBlocksCleared023]]


decode = msgspec.msgpack.Decoder(KVEventBatch).decode
decode023 = msgspec.msgpack.Decoder(KVEventBatch023).decode
reencode = msgspec.msgpack.Encoder().encode


# -- encoding ------------------------------------------------------------------------------------
def test_vector_w1_map_form():
    assert encode_batch(w_events(), ts=1.5) == W1
    assert len(W1) == 275
    # vLLM's own structs write the same bytes
    vllm = KVEventBatch(
        1.5,
        [
            VBlockStored([H], None, [1, 2], 2, None, "GPU", None, [None], 0, "full_attention"),
            VBlockRemoved([H], "GPU", 0),
            VAllBlocksCleared(),
        ],
        0,
    )
    assert reencode(vllm) == W1


def test_vector_w2_array_form():
    assert encode_batch(w_events(), ts=1.5, fmt="array") == W2
    assert len(W2) == 112


def test_hashes_fold_to_their_low_64_bits_everywhere():
    """kvblocks' 128-bit hashes fold the way vLLM folds a digest: the last 8 bytes."""
    assert encode_batch(w_events(high=0xABCDEF), ts=1.5) == W1
    assert encode_batch(w_events(high=M64), ts=1.5, fmt="array") == W2
    assert kvblocks.events.fold_hash((7 << 64) | 5) == 5
    assert kvblocks.events.fold_hash(M64, "signed") == -1


def test_signed_hashes():
    signed = encode_batch(w_events(high=3), ts=1.5, hash_int="signed")
    assert signed == W1.replace(b"\xcf\xfe\xdc", b"\xd3\xfe\xdc")  # int64, same 8 bytes
    batch = decode(signed)
    assert batch.events[0].block_hashes == [H - (1 << 64)]
    assert batch.events[1].block_hashes == [H - (1 << 64)]
    small = encode_batch([BlockRemoved([(9 << 64) | 5])], ts=0.0, hash_int="signed")
    assert decode(small).events[0].block_hashes == [5]


@pytest.mark.parametrize("vector, dec", [(W1, decode), (W2, decode023)], ids=["map", "array"])
def test_round_trip_through_vllm_structs(vector, dec):
    batch = dec(vector)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 0
    st, rm, cl = batch.events
    assert st.block_hashes == [H] and st.parent_block_hash is None and st.token_ids == [1, 2]
    assert (st.block_size, st.lora_id, st.medium, st.lora_name) == (2, None, "GPU", None)
    assert (st.extra_keys, st.group_idx, st.kv_cache_spec_kind) == ([None], 0, "full_attention")
    assert rm.block_hashes == [H] and rm.medium == "GPU" and rm.group_idx == 0
    assert type(cl).__name__.startswith("VAllBlocksCleared")
    assert reencode(batch) == vector


def test_vllm_decoders_reject_the_other_form():
    with pytest.raises(msgspec.ValidationError):
        decode(W2)
    with pytest.raises(msgspec.ValidationError):
        decode023(W1)


def test_manager_events_on_the_wire():
    """Stored chains link by folded hashes: the first block has a nil parent, an appended
    block's parent is the previous block's wire hash, removals name the stored hashes."""
    mgr = BlockManager(6, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", list(range(9)), salt="tenant")
    compute(mgr, "a")
    step1 = decode(encode_batch(mgr.pool.take_events(), ts=1.0))
    mgr.append("a", [9, 10, 11])
    compute(mgr, "a")
    step2 = decode(encode_batch(mgr.pool.take_events(), ts=2.0))
    full = [int(h[0]) | (int(h[1]) << 64) for h in mgr.block_hashes("a")]
    mgr.free("a")
    mgr.add("b", list(range(100, 120)))  # 5 blocks: evicts the 3 cached
    compute(mgr, "b")
    payload = encode_batch(mgr.pool.take_events(), ts=3.0, data_parallel_rank=3)
    step3 = decode(payload)
    assert step3.data_parallel_rank == 3 and reencode(step3) == payload
    (st1,), (st2,), (rm, st3) = step1.events, step2.events, step3.events
    assert st1.parent_block_hash is None and st1.token_ids == list(range(8))
    assert st1.block_hashes == [h & M64 for h in full[:2]]
    assert st2.parent_block_hash == st1.block_hashes[-1] and st2.token_ids == [8, 9, 10, 11]
    assert sorted(rm.block_hashes) == sorted(st1.block_hashes + st2.block_hashes)
    assert st3.parent_block_hash is None and len(st3.block_hashes) == 5
    assert all(
        len(e.token_ids) == len(e.block_hashes) * e.block_size == 4 * len(e.block_hashes)
        for e in (st1, st2, st3)
    )


def test_lora_and_group_fields_are_written():
    ev = BlockStored([1, 2], 7, list(range(8)), 4, lora_id=3, lora_name="alice", group_idx=1)
    (st,) = decode(encode_batch([ev], ts=0.0)).events
    assert (st.lora_id, st.lora_name, st.group_idx, st.parent_block_hash) == (3, "alice", 1, 7)
    assert st.extra_keys == [None, None]
    (rm,) = decode(encode_batch([BlockRemoved([1], medium="CPU", group_idx=2)], ts=0.0)).events
    assert rm.medium == "CPU" and rm.group_idx == 2


def test_batch_header():
    assert encode_batch([], ts=1.5) == bytes.fromhex("93cb3ff80000000000009000")
    assert decode(encode_batch([], ts=1.5, data_parallel_rank=None)).data_parallel_rank is None
    assert decode(encode_batch([AllBlocksCleared()], ts=2)).ts == 2.0  # float64 always


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda: encode_batch([BlockStored([1], None, [], 0)], ts=0), InvalidArgumentError),
        (
            lambda: encode_batch([BlockStored([1, 2], None, [1, 2, 3], 2)], ts=0),
            InvalidArgumentError,
        ),
        (lambda: encode_batch([BlockStored(["x"], None, [1], 1)], ts=0), InvalidTypeError),
        (lambda: encode_batch([BlockRemoved([1.5])], ts=0), InvalidTypeError),
        (lambda: encode_batch([object()], ts=0), InvalidTypeError),
        (lambda: encode_batch([], ts="now"), InvalidTypeError),
        (lambda: encode_batch([], ts=0, fmt="json"), InvalidArgumentError),
        (lambda: encode_batch([], ts=0, hash_int="u64"), InvalidArgumentError),
        (lambda: encode_batch([], ts=0, data_parallel_rank=-1), InvalidArgumentError),
        (lambda: kvblocks.events.fold_hash("1"), InvalidTypeError),
    ],
    ids=[
        "no-tokens",
        "short-tokens",
        "str-hash",
        "float-hash",
        "non-event",
        "ts",
        "fmt",
        "hash_int",
        "rank",
        "fold",
    ],
)
def test_unrepresentable_events_raise_typed_errors(call, exc):
    with pytest.raises(exc) as info:
        call()
    assert isinstance(info.value, KVBlocksError)


def test_pool_events_with_tokens_encode():
    pool = BlockPool(8, hash_key=KEY, enable_kv_events=True)
    h = hash_blocks(list(range(8)), 4, key=KEY)
    pool.cache(pool.allocate(2), h, token_ids=list(range(8)))
    (st,) = decode(encode_batch(pool.take_events(), ts=0.0)).events
    assert st.block_size == 4 and st.parent_block_hash is None
    assert st.block_hashes == [int(x[0]) for x in h]  # lo half = low 64 bits


# -- the ZeroMQ publisher ------------------------------------------------------------------------
try:
    import zmq

    from kvblocks.events import ZmqEventPublisher, offset_endpoint
    from kvblocks.events.zmq import END_SEQ
except ImportError:  # the encoding tests above still run
    zmq = None

TIMEOUT_MS = 5000


@pytest.fixture
def ctx():
    """A private zmq context (every publisher test takes it: they skip without pyzmq)."""
    if zmq is None:
        pytest.skip("pyzmq is not installed")
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def loopback(endpoint):
    """Where a client on this host reaches a publisher bound to ``endpoint``."""
    return endpoint.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")


def recv(sock, timeout_ms=TIMEOUT_MS):
    assert sock.poll(timeout_ms), "nothing received in time"
    return sock.recv_multipart()


def subscribe(ctx, pub, topic=b""):
    """A SUB socket on ``pub`` that is known to receive: publish markers until one arrives
    (ZeroMQ drops what a PUB sends before the subscription reaches it)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(loopback(pub.endpoint))
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while not sub.poll(20):
        assert time.monotonic() < deadline, "subscription never took"
        pub.publish([AllBlocksCleared()])
    while sub.poll(50):  # drain the markers
        sub.recv_multipart()
    return sub


def free_port_pair():
    """A port p with p and p + 1 free now (bound then released)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("0.0.0.0", p + 1))
            return p
        except OSError:
            continue
    pytest.skip("no two consecutive free ports")


def test_publish_end_to_end_frames_and_sequence(ctx):
    with ZmqEventPublisher(
        "tcp://*:0", topic="kv@10.0.0.1:8000@m", data_parallel_rank=0, context=ctx
    ) as pub:
        assert pub.endpoint.startswith("tcp://") and not pub.endpoint.endswith(":0")
        sub = subscribe(ctx, pub)
        first = pub.next_seq
        sent = []
        for i in range(3):
            ev = w_events()
            sent.append(encode_batch(ev, ts=1.5))
            assert pub.publish(ev, ts=1.5) == first + i
        for i in range(3):
            topic, seq, payload = recv(sub)
            assert topic == b"kv@10.0.0.1:8000@m"
            assert len(seq) == 8 and int.from_bytes(seq, "big") == first + i
            assert payload == sent[i] == W1
        sub.close()


def test_empty_publish_sends_nothing(ctx):
    with ZmqEventPublisher("tcp://*:0", context=ctx) as pub:
        sub = subscribe(ctx, pub)
        seq = pub.next_seq
        assert pub.publish([]) is None and pub.publish(()) is None
        assert pub.next_seq == seq and pub.flush()
        assert not sub.poll(100)
        pub.publish([AllBlocksCleared()])
        assert int.from_bytes(recv(sub)[1], "big") == seq
        sub.close()


def test_connect_mode_and_array_form(ctx):
    """Without a wildcard the publisher connects (llm-d's central mode: the indexer binds)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:0")
    ep = sub.getsockopt(zmq.LAST_ENDPOINT).decode()
    with ZmqEventPublisher(ep, fmt="array", hash_int="signed", context=ctx) as pub:
        assert pub.endpoint == ep
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not sub.poll(20):
            assert time.monotonic() < deadline
            pub.publish(w_events(), ts=1.5)
        _, _, payload = sub.recv_multipart()
        assert payload == W2.replace(b"\xcf\xfe\xdc", b"\xd3\xfe\xdc")
    sub.close()


def test_replay_both_layouts_and_bounded_buffer(ctx):
    for layout in ("topic", "legacy"):
        with ZmqEventPublisher(
            "tcp://*:0",
            replay_endpoint="tcp://*:0",
            topic="t",
            buffer_steps=3,
            replay_layout=layout,
            context=ctx,
        ) as pub:
            for i in range(5):
                assert pub.publish([BlockRemoved([i])], ts=float(i)) == i
            assert pub.flush()
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(loopback(pub.replay_endpoint))
            dealer.send_multipart([b"", b"bad"])  # malformed: ignored
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            while True:
                frames = recv(dealer)
                assert frames[0] == b""
                if layout == "topic":
                    assert len(frames) == 4 and frames[1] == b"t"
                else:
                    assert len(frames) == 3
                seq, payload = frames[-2:]
                if seq == END_SEQ:
                    assert payload == b""
                    break
                got.append((int.from_bytes(seq, "big"), decode(payload).events[0].block_hashes))
            assert got == [(2, [2]), (3, [3]), (4, [4])]  # the last buffer_steps batches
            dealer.send_multipart([b"", (4).to_bytes(8, "big")])
            assert recv(dealer)[-2] == (4).to_bytes(8, "big")
            assert recv(dealer)[-2] == END_SEQ
            dealer.close()


def test_data_parallel_offsets(ctx):
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://10.1.2.3:5557", 1) == "tcp://10.1.2.3:5558"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("tcp://*:0", 5) == "tcp://*:0"  # any free port stays any
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(InvalidArgumentError):
        offset_endpoint("ipc:///tmp/kv", 1)
    with pytest.raises(InvalidArgumentError):
        offset_endpoint("tcp://*:65535", 1)
    # two ranks on one base port: rank r binds base + r and stamps its batches with r
    base = free_port_pair()
    pubs = [
        ZmqEventPublisher(
            f"tcp://*:{base}",
            replay_endpoint="inproc://kv-replay",
            data_parallel_rank=r,
            context=ctx,
        )
        for r in (0, 1)
    ]
    try:
        assert [p.endpoint.rsplit(":", 1)[1] for p in pubs] == [str(base), str(base + 1)]
        assert [p.replay_endpoint for p in pubs] == ["inproc://kv-replay", "inproc://kv-replay_dp1"]
        for r, p in enumerate(pubs):
            sub = subscribe(ctx, p)
            p.publish([AllBlocksCleared()])
            assert decode(recv(sub)[2]).data_parallel_rank == r
            sub.close()
    finally:
        for p in pubs:
            p.close()


def test_burst_larger_than_the_queue_drops_and_counts(ctx, monkeypatch):
    """The background thread is held inside an encode; publish() keeps returning at once,
    queues up to max_queue_size and counts the rest as dropped (their numbers are spent)."""
    import kvblocks.events.zmq as kz

    entered, release = threading.Event(), threading.Event()
    real = kz.to_wire

    def slow_to_wire(*a, **kw):
        entered.set()
        release.wait(TIMEOUT_MS / 1000)
        return real(*a, **kw)

    monkeypatch.setattr(kz, "to_wire", slow_to_wire)
    with ZmqEventPublisher("tcp://*:0", max_queue_size=4, context=ctx) as pub:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(loopback(pub.endpoint))
        pub.publish([BlockRemoved([0])])
        assert entered.wait(TIMEOUT_MS / 1000)  # the thread holds batch 0
        seqs = [pub.publish([BlockRemoved([i])]) for i in range(1, 101)]
        assert seqs[:4] == [1, 2, 3, 4] and seqs[4:] == [None] * 96
        assert pub.dropped == 96 and pub.pending == 4 and pub.next_seq == 101
        release.set()
        assert pub.flush()
        assert pub.sent == 5 and pub.errors == 0
        sub.close()


def test_a_bad_batch_is_counted_and_the_publisher_goes_on(ctx):
    with ZmqEventPublisher("tcp://*:0", context=ctx) as pub:
        sub = subscribe(ctx, pub)
        pub.publish([BlockStored([1], None, [], 0)])  # no tokens: unrepresentable
        seq = pub.publish([AllBlocksCleared()])
        assert int.from_bytes(recv(sub)[1], "big") == seq
        assert pub.errors == 1 and isinstance(pub.last_error, InvalidArgumentError)
        sub.close()


def test_vanished_subscriber_never_blocks(ctx):
    """A SUB that stops reading, then disappears: publish() and close() still return."""
    with ZmqEventPublisher("tcp://*:0", hwm=2, context=ctx) as pub:
        sub = subscribe(ctx, pub)
        for i in range(200):
            pub.publish([BlockRemoved([i])])
        sub.close()
        for i in range(200):
            pub.publish([BlockRemoved([i])])
        assert pub.flush() and pub.errors == 0


def test_close_is_clean(ctx):
    pub = ZmqEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", context=ctx)
    ep, rep = pub.endpoint, pub.replay_endpoint
    for i in range(10):
        pub.publish([BlockRemoved([i])])
    pub.close()
    assert pub.closed and not pub._thread.is_alive() and pub.sent == 10
    pub.close()  # idempotent
    with pytest.raises(InvalidStateError):
        pub.publish([AllBlocksCleared()])
    assert pub.publish([]) is None
    # the ports are released (zmq closes sockets asynchronously: allow it a moment)
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while True:
        try:
            ZmqEventPublisher(
                ep.replace("0.0.0.0", "*"), replay_endpoint=rep.replace("0.0.0.0", "*"), context=ctx
            ).close()
            break
        except InvalidStateError:
            assert time.monotonic() < deadline, "ports still in use after close()"
            time.sleep(0.01)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(endpoint="udp://*:5557"), InvalidArgumentError),
        (dict(endpoint="tcp://*"), InvalidArgumentError),
        (dict(endpoint="tcp://*:99999"), InvalidArgumentError),
        (dict(endpoint="tcp://no_such_interface:5557", bind=True), InvalidArgumentError),
        (dict(endpoint=5557), InvalidTypeError),
        (dict(replay_endpoint="tcp://*"), InvalidArgumentError),
        (dict(topic=b"kv"), InvalidTypeError),
        (dict(fmt="json"), InvalidArgumentError),
        (dict(hash_int="u64"), InvalidArgumentError),
        (dict(replay_layout="new"), InvalidArgumentError),
        (dict(buffer_steps=-1), InvalidArgumentError),
        (dict(max_queue_size=0), InvalidArgumentError),
        (dict(data_parallel_rank=-1), InvalidArgumentError),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(map(str, v.items())),
)
def test_bad_arguments_raise_typed_errors(ctx, kwargs, exc):
    kwargs.setdefault("endpoint", "tcp://*:0")
    with pytest.raises(exc):
        ZmqEventPublisher(kwargs.pop("endpoint"), context=ctx, **kwargs)


def test_port_in_use(ctx):
    with ZmqEventPublisher("tcp://*:0", context=ctx) as pub:
        port = pub.endpoint.rsplit(":", 1)[1]
        with pytest.raises(InvalidStateError, match="in use"):
            ZmqEventPublisher(f"tcp://*:{port}", context=ctx)
        with pytest.raises(InvalidStateError):
            ZmqEventPublisher("tcp://*:0", replay_endpoint=f"tcp://*:{port}", context=ctx)


def test_module_examples_run():
    import doctest

    import kvblocks.events.wire as wire

    mods = [wire]
    if zmq is not None:
        import kvblocks.events.zmq as kz

        mods.append(kz)
    for m in mods:
        result = doctest.testmod(m, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, m.__name__


def test_router_example_runs(ctx, capsys):
    """examples/kv_router.py: replicas publish, a router indexes their events and routes."""
    import runpy
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "kv_router.py"
    main = runpy.run_path(str(path), run_name="kv_router")["main"]
    assert main(["--replicas", "2", "--requests", "40", "--num-blocks", "1200"]) == 0
    out = capsys.readouterr().out
    rates = {
        line.split()[0]: float(line.split()[1].rstrip("%"))
        for line in out.splitlines()
        if line.startswith(("kv ", "round_robin "))
    }
    assert set(rates) == {"kv", "round_robin"} and rates["kv"] >= rates["round_robin"]


def test_cluster_doc_example_runs(ctx):
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(doc), "exec"), {})
