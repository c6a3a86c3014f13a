"""Hash modes: vLLM's sha256_cbor and the SGLang router's sha256 beside SipHash.

Every test vector of ../shared/kv-events-wire.md §6 (H1 a real vLLM capture, H2 vLLM 0.34's
hashing.py, H3 the SGLang router's goldens), chain continuity across add / append /
append_batch / fork / truncate / parent=, salts and LoRA adapters, events through
encode_batch, and the errors (unknown mode, arguments that do not apply, nothing changed).
"""

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import KEY, compute
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import (
    BlockManager,
    BlockPool,
    InvalidArgumentError,
    InvalidTypeError,
    hash_blocks,
)

M64 = (1 << 64) - 1
H1 = json.loads((Path(__file__).parent / "data" / "vllm_h1_capture.json").read_text())
VLLM_MODES = ("vllm_sha256_cbor", "vllm_sha256_cbor_v030")
NONE_HASH_DEFAULT = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"


def wire(hashes):
    """The 64-bit wire values of (n, 2) [lo, hi] hashes: encode_batch's fold."""
    return [int(h[0]) & M64 for h in hashes]


def signed(v):
    return v - (1 << 64) if v >> 63 else v


# -- an independent reference: the modes from their definitions, with hashlib ---------------
def cbor(x):
    def head(major, n):
        if n < 24:
            return bytes([major << 5 | n])
        for add, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * size):
                return bytes([major << 5 | add]) + n.to_bytes(size, "big")
        raise ValueError(n)

    if x is None:
        return b"\xf6"
    if isinstance(x, int):
        return head(0, x) if x >= 0 else head(1, -1 - x)
    if isinstance(x, bytes):
        return head(2, len(x)) + x
    if isinstance(x, str):
        return head(3, len(x.encode())) + x.encode()
    return head(4, len(x)) + b"".join(cbor(e) for e in x)


def ref_vllm(tokens, bs, seed, extra_keys):
    """vLLM: sha256(cbor((parent or NONE_HASH, tuple(tokens), extra_keys(i))))."""
    parent, out = hashlib.sha256(cbor(seed)).digest(), []
    for i in range(len(tokens) // bs):
        parent = hashlib.sha256(
            cbor((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra_keys(i)))
        ).digest()
        out.append(parent)
    return out


def ref_sglang(tokens, bs):
    parent, out = b"", []
    for i in range(len(tokens) // bs):
        chunk = tokens[i * bs : (i + 1) * bs]
        parent = hashlib.sha256(parent + struct.pack(f"<{bs}I", *chunk)).digest()
        out.append(parent)
    return out


# -- test vectors -----------------------------------------------------------------------------
def test_sha256_known_answers():
    for msg in (b"", b"abc", b"a" * 55, b"a" * 56, b"a" * 64, bytes(range(256)) * 5):
        assert kvblocks._core.sha256(msg) == hashlib.sha256(msg).digest()


def test_h1_vllm_capture():
    """A real vLLM capture (Qwen3-0.6B, PYTHONHASHSEED=42): base and LoRA 'Alice' (vLLM's
    untagged (lora_name,) extra key on every block), all 25 hashes each."""
    toks, bs, seed = H1["token_ids"], H1["block_size"], H1["hash_seed"]
    base = hash_blocks(toks, bs, algo="vllm_sha256_cbor_v030", seed=seed)
    assert wire(base) == H1["block_hashes"]
    assert wire(hash_blocks(toks, bs, algo="vllm_sha256_cbor", seed=seed)) == H1["block_hashes"]
    lora = hash_blocks(toks, bs, algo="vllm_sha256_cbor_v030", seed=seed, lora_name=H1["lora_name"])
    assert wire(lora) == H1["lora_block_hashes"]
    assert H1["block_hashes"][:3] == [
        17705339885301241772,
        13360521540053240825,
        1652464311825922890,
    ]
    assert H1["lora_block_hashes"][-1] == 8548534288577952324


def test_h1_seed_from_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", H1["hash_seed"])
    toks = H1["token_ids"][:64]
    assert wire(hash_blocks(toks, 16, algo="vllm_sha256_cbor")) == H1["block_hashes"][:4]
    pool = BlockPool(8, hash_algo="vllm_sha256_cbor", block_size=16)
    assert pool.hash_seed == "42"
    assert wire(pool.hash_blocks(toks)) == H1["block_hashes"][:4]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockPool(8, hash_algo="vllm_sha256_cbor").hash_seed == "vllm-none-hash"
    assert BlockPool(8).hash_seed is None


def test_h2_vllm_hashing_py():
    """vLLM 0.34 hashing.py: NONE_HASH, the CBOR of block 0, digests and wire values."""
    none = bytes.fromhex(NONE_HASH_DEFAULT)
    assert hashlib.sha256(cbor("vllm-none-hash")).digest() == none
    hs, dg = hash_blocks(
        range(32), 16, algo="vllm_sha256_cbor", seed="vllm-none-hash", digests=True
    )
    assert dg.shape == (2, 32) and dg.dtype == np.uint8
    block0 = bytes.fromhex("835820" + NONE_HASH_DEFAULT + "90000102030405060708090a0b0c0d0e0ff6")
    assert dg[0].tobytes() == hashlib.sha256(block0).digest()
    assert dg[0].tobytes().hex().startswith("dc918a88") and dg[0].tobytes().hex().endswith(
        "06ac0749"
    )
    assert dg[1].tobytes().hex().startswith("c300ec27") and dg[1].tobytes().hex().endswith(
        "ef84ef0c"
    )
    assert wire(hs) == [2233398808101521225, 17911472383915781900]
    # the 128 bits kept are the digest's last 16 bytes, read big-endian
    assert [kvblocks.hash_to_int(h) for h in hs] == [
        int.from_bytes(d[16:].tobytes(), "big") for d in dg
    ]


def test_h2_cache_salt_tagged_and_untagged():
    kw = dict(seed="vllm-none-hash", salt="tenant-a")
    assert wire(hash_blocks(range(32), 16, algo="vllm_sha256_cbor", **kw)) == [
        1072837495201822809,
        8035883249497252415,
    ]
    assert wire(hash_blocks(range(32), 16, algo="vllm_sha256_cbor_v030", **kw)) == [
        10721593076989655162,
        8778033878522207248,
    ]
    # vLLM ignores an empty cache_salt (falsy)
    assert wire(
        hash_blocks(range(32), 16, algo="vllm_sha256_cbor", seed="vllm-none-hash", salt="")
    ) == [2233398808101521225, 17911472383915781900]


def test_h3_sglang_router_goldens():
    def sg(tokens, bs):
        return [signed(v) for v in wire(hash_blocks(tokens, bs, algo="sglang_sha256"))]

    assert sg([1, 2, 3, 4], 4) == [-3488128144981237669]
    assert sg([10, 20, 30, 40, 50, 60, 70, 80], 2) == [
        978178666101069530,
        -895308556211281782,
        -8033692805846017938,
        835415944263129316,
    ]
    # [1..5], bs 4: the router also hashes the trailing partial page, chained on page 0's
    # full digest; here as a one-token block after parent=
    _, dg = hash_blocks([1, 2, 3, 4], 4, algo="sglang_sha256", digests=True)
    assert sg_tail(dg[0]) == -3787494577174227566
    assert dg[0].tobytes() == ref_sglang([1, 2, 3, 4], 4)[0]


def sg_tail(parent):
    return signed(wire(hash_blocks([5], 1, algo="sglang_sha256", parent=parent))[0])


# -- the reference agrees on any tokens (CBOR widths, negative ids, block sizes) -------------
token = st.one_of(
    st.integers(0, 30),
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([23, 24, 255, 256, 65535, 65536, 2**31 - 1, -1, -24, -25]),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(token, max_size=80),
    st.integers(1, 30),
    st.sampled_from(["", "t", "x" * 30]),
    st.sampled_from([None, "A", "adapter-" + "z" * 40]),
    st.text(max_size=8),
)
def test_modes_match_the_reference(tokens, bs, salt, lora, seed):
    tagged = hash_blocks(tokens, bs, algo="vllm_sha256_cbor", seed=seed, salt=salt, digests=True)[1]
    want = ref_vllm(
        tokens, bs, seed, lambda i: (("cache_salt", salt),) if salt and i == 0 else None
    )
    assert [d.tobytes() for d in tagged] == want
    untagged = hash_blocks(
        tokens, bs, algo="vllm_sha256_cbor_v030", seed=seed, salt=salt, lora_name=lora, digests=True
    )[1]

    def keys(i):
        k = ([lora] if lora else []) + ([salt] if salt and i == 0 else [])
        return tuple(k) if k else None

    assert [d.tobytes() for d in untagged] == ref_vllm(tokens, bs, seed, keys)
    sg = hash_blocks(tokens, bs, algo="sglang_sha256", digests=True)[1]
    assert [d.tobytes() for d in sg] == ref_sglang([t & 0xFFFFFFFF for t in tokens], bs)


# -- chains continue however they are grown ----------------------------------------------------
MODES = [
    ("siphash", {}),
    ("vllm_sha256_cbor", {"salt": "t"}),
    ("vllm_sha256_cbor_v030", {"salt": "t", "lora_name": "Alice"}),
    ("sglang_sha256", {}),
    ("sglang_sha256", {"salt": "t", "lora_name": "B"}),
]


@pytest.mark.parametrize("algo,kw", MODES)
def test_chain_continues_across_append_fork_truncate_and_parent(algo, kw):
    bs, toks = 4, list(range(100, 150))
    mgr = BlockManager(64, bs, hash_algo=algo, hash_seed="s" if "vllm" in algo else None)
    whole = mgr.pool.hash_blocks(toks, **kw)
    mgr.add("at-once", toks, **kw)
    mgr.add("by-one", toks[:3], **kw)  # shorter than one block: the salt waits for block 0
    for t in toks[3:]:
        mgr.append("by-one", [t])
    mgr.add("batch", toks[:10], **kw)
    for t in toks[10:]:
        mgr.append_batch(["batch"], [t])
    mgr.fork("at-once", "fork")
    mgr.truncate("fork", 9)
    mgr.append("fork", [7, 7, 7])  # diverges
    mgr.truncate("fork", 6)
    mgr.append("fork", toks[6:])
    for s in ("at-once", "by-one", "batch", "fork"):
        assert np.array_equal(mgr.block_hashes(s), whole), s
    mgr.check()
    # parent=: the rest of the chain from block 4's digest
    hs, dg = mgr.pool.hash_blocks(
        toks, lora_name=kw.get("lora_name"), salt=kw.get("salt"), digests=True
    )
    tail = mgr.pool.hash_blocks(toks[20:], parent=dg[4], lora_name=kw.get("lora_name"))
    assert np.array_equal(tail, whole[5:])


@pytest.mark.parametrize("algo", ["vllm_sha256_cbor", "sglang_sha256"])
def test_prefix_hits_and_isolation(algo):
    mgr = BlockManager(64, 4, hash_algo=algo)
    toks = list(range(1, 18))
    mgr.add("a", toks)
    compute(mgr, "a")
    assert mgr.probe(toks) == (16, 5 - 4)
    assert mgr.add("b", toks) == 16
    assert mgr.probe(toks, salt="other")[0] == 0
    assert mgr.add("c", toks, salt="other") == 0
    if algo == "sglang_sha256":
        assert mgr.add("d", toks, lora_name="L") == 0
    mgr.check()


def test_siphash_unchanged_by_the_modes():
    """The default chain's hashes are those of the keyed SipHash root and chain."""
    h = hash_blocks(range(8), 4, key=KEY, salt="s")
    root = kvblocks._core.siphash128(KEY, b"kvb\x01" + b"s" + b"s")
    assert int.from_bytes(root, "little") != 0
    assert np.array_equal(h, hash_blocks(range(8), 4, key=KEY, salt="s", algo="siphash"))
    # a LoRA adapter isolates like a salt, and differs from the same text as a salt
    assert not np.array_equal(h, hash_blocks(range(8), 4, key=KEY, salt="s", lora_name="s"))
    assert not np.array_equal(
        hash_blocks(range(8), 4, key=KEY, lora_name="s"),
        hash_blocks(range(8), 4, key=KEY, salt="s"),
    )
    hs, dg = hash_blocks(range(8), 4, key=KEY, digests=True)
    assert dg.shape == (2, 16)
    assert np.array_equal(hash_blocks(range(4, 8), 4, key=KEY, parent=dg[0].tobytes()), hs[1:])


# -- events -------------------------------------------------------------------------------------
def test_events_carry_vllm_hashes_and_lora_name_on_the_wire():
    msgspec = pytest.importorskip("msgspec")
    from kvblocks.events import encode_batch

    toks = H1["token_ids"]
    mgr = BlockManager(
        64, 16, hash_algo="vllm_sha256_cbor_v030", hash_seed="42", enable_kv_events=True
    )
    mgr.add("alice", toks[:300], lora_name="Alice")
    compute(mgr, "alice")
    _, (st1,), _ = msgspec.msgpack.decode(encode_batch(mgr.pool.take_events(), ts=1.0))
    mgr.fork("alice", "alice2")  # the child keeps the adapter
    mgr.append("alice2", toks[300:])
    mgr.take_copies()
    compute(mgr, "alice2")
    mgr.add("base", toks)
    compute(mgr, "base")
    _, (st2, st3), _ = msgspec.msgpack.decode(encode_batch(mgr.pool.take_events(), ts=2.0))
    assert st1["lora_name"] == st2["lora_name"] == "Alice" and st3["lora_name"] is None
    assert st1["parent_block_hash"] is None and st3["parent_block_hash"] is None
    assert st1["block_hashes"] + st2["block_hashes"] == H1["lora_block_hashes"]
    assert st2["parent_block_hash"] == H1["lora_block_hashes"][17]
    assert st3["block_hashes"] == H1["block_hashes"]
    assert st1["token_ids"] == toks[:288] and st1["block_size"] == 16
    # a removal names the wire hash it was stored under
    mgr.free("base")
    mgr.add("evict", list(range(1000, 1000 + 16 * 30)))
    removed = [
        h
        for e in mgr.pool.take_events()
        if isinstance(e, kvblocks.BlockRemoved)
        for h in e.block_hashes
    ]
    assert set(h & M64 for h in removed) <= set(H1["block_hashes"]) and removed


def test_sglang_events_are_the_routers_int64():
    msgspec = pytest.importorskip("msgspec")
    from kvblocks.events import encode_batch

    mgr = BlockManager(16, 2, hash_algo="sglang_sha256", enable_kv_events=True)
    mgr.add("a", [10, 20, 30, 40, 50, 60, 70, 80, 90])
    compute(mgr, "a")
    _, (stored,), _ = msgspec.msgpack.decode(
        encode_batch(mgr.pool.take_events(), ts=0.0, hash_int="signed")
    )
    assert stored["block_hashes"] == [
        978178666101069530,
        -895308556211281782,
        -8033692805846017938,
        835415944263129316,
    ]


def test_pool_cache_lora_name_reaches_the_event():
    pool = BlockPool(
        8, block_size=4, hash_algo="vllm_sha256_cbor_v030", hash_seed="42", enable_kv_events=True
    )
    ids = pool.allocate(2)
    h = pool.hash_blocks(range(8), lora_name="L")
    pool.cache(ids, h, token_ids=list(range(8)), lora_name="L")
    (ev,) = pool.take_events()
    assert ev.lora_name == "L" and ev.block_hashes == [kvblocks.hash_to_int(x) for x in h]


# -- errors: typed, and nothing changed ---------------------------------------------------------
def test_unknown_hash_mode():
    for bad in ("md5", "SIPHASH", "vllm_xxhash_cbor", ""):
        with pytest.raises(InvalidArgumentError, match="unknown hash mode"):
            hash_blocks(range(4), 4, algo=bad)
        with pytest.raises(InvalidArgumentError, match="unknown hash mode"):
            BlockPool(8, hash_algo=bad)
        with pytest.raises(InvalidArgumentError, match="unknown hash mode"):
            BlockManager(8, 4, hash_algo=bad)
    for bad in (None, 1, b"siphash"):
        with pytest.raises(InvalidTypeError):
            hash_blocks(range(4), 4, algo=bad)
        with pytest.raises(InvalidTypeError):
            BlockManager(8, 4, hash_algo=bad)


def test_arguments_that_do_not_apply():
    with pytest.raises(InvalidArgumentError, match="seed"):
        hash_blocks(range(4), 4, seed="42")
    with pytest.raises(InvalidArgumentError, match="seed"):
        BlockManager(8, 4, hash_algo="sglang_sha256", hash_seed="42")
    with pytest.raises(InvalidTypeError, match="seed"):
        hash_blocks(range(4), 4, algo="vllm_sha256_cbor", seed=42)
    with pytest.raises(InvalidArgumentError, match="key"):
        hash_blocks(range(4), 4, algo="vllm_sha256_cbor", key=KEY)
    with pytest.raises(InvalidArgumentError, match="hash_key"):
        BlockPool(8, hash_algo="sglang_sha256", hash_key=KEY)
    with pytest.raises(InvalidTypeError, match="cache_salt"):
        hash_blocks(range(4), 4, algo="vllm_sha256_cbor", salt=b"x")
    with pytest.raises(InvalidArgumentError, match="path"):
        hash_blocks(range(4), 4, algo="vllm_sha256_cbor", lora_name="A")
    with pytest.raises(InvalidArgumentError, match="empty"):
        hash_blocks(range(4), 4, lora_name="")
    with pytest.raises(InvalidTypeError, match="lora_name"):
        hash_blocks(range(4), 4, lora_name=b"A")
    with pytest.raises(InvalidArgumentError, match="salt"):
        hash_blocks(range(4), 4, parent=1, salt="s")


def test_parent_must_be_the_full_digest_in_256_bit_modes():
    hs, dg = hash_blocks(range(8), 4, algo="vllm_sha256_cbor", digests=True)
    with pytest.raises(InvalidArgumentError, match="full 32-byte digest"):
        hash_blocks(range(4), 4, algo="vllm_sha256_cbor", parent=hs[0])
    with pytest.raises(InvalidArgumentError, match="full 32-byte digest"):
        hash_blocks(range(4), 4, algo="sglang_sha256", parent=kvblocks.hash_to_int(hs[0]))
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        hash_blocks(range(4), 4, algo="vllm_sha256_cbor", parent=dg[0].tobytes()[:16])
    with pytest.raises(InvalidArgumentError, match="16 bytes"):
        hash_blocks(range(4), 4, parent=dg[0].tobytes())


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.add("x", range(9), lora_name=""),
        lambda m: m.add("x", range(9), salt=b"bytes"),
        lambda m: m.add("x", range(9), lora_name=7),
        lambda m: m.probe(range(9), salt=3),
    ],
)
def test_failed_calls_change_nothing(call):
    mgr = BlockManager(16, 4, hash_algo="vllm_sha256_cbor_v030", enable_kv_events=True)
    mgr.add("a", range(9), lora_name="A")
    compute(mgr, "a")
    before = (mgr.pool.num_free, mgr.pool.num_cached, len(mgr), mgr.pool.stats.queries)
    with pytest.raises((InvalidArgumentError, InvalidTypeError)):
        call(mgr)
    assert (mgr.pool.num_free, mgr.pool.num_cached, len(mgr), mgr.pool.stats.queries) == before
    assert "x" not in mgr
    mgr.check()


@pytest.mark.parametrize("algo", ["vllm_sha256_cbor", "sglang_sha256"])
def test_groups_key_the_256_bit_hashes_per_group(algo):
    """The 256-bit modes work with groups, each group's blocks keyed by (hash, group) as
    vLLM keys them: identical tokens in two groups never share a block, each group hits its
    own blocks, and block_hashes shows the engine's own hash in every group.
    ``hash_blocks(..., group=1)`` stays refused: the engine's hash has no group in it."""
    groups = (kvblocks.KVGroup("full"), kvblocks.KVGroup("sliding_window", window=8))
    mgr = BlockManager(16, 4, groups=groups, hash_algo=algo)
    mgr.add("a", list(range(13)))
    compute(mgr, "a")
    ref = hash_blocks(list(range(13)), 4, algo=algo)
    for g in (0, 1):
        assert mgr.block_hashes("a", group=g).tolist() == ref.tolist()
    assert mgr.pool.num_cached == 6  # 3 blocks in each group: none shared
    assert mgr.add("b", list(range(13))) == 12  # each group hits its own blocks
    tables = [set(mgr.block_table("b", group=g).tolist()) - {0} for g in (0, 1)]
    assert not tables[0] & tables[1]
    mgr.check()
    with pytest.raises(InvalidArgumentError, match="group=1"):
        hash_blocks(list(range(8)), 4, algo=algo, group=1)
    assert len(hash_blocks(list(range(8)), 4, algo=algo, group=0)) == 2


def test_lora_name_reaches_every_groups_events():
    groups = (kvblocks.KVGroup("full"), kvblocks.KVGroup("sliding_window", window=4))
    mgr = BlockManager(32, 4, groups=groups, enable_kv_events=True)
    mgr.add("a", list(range(9)), lora_name="adapter-x")
    compute(mgr, "a")
    stored = [e for e in mgr.pool.take_events() if type(e).__name__ == "BlockStored"]
    assert {e.group_idx for e in stored} == {0, 1}
    assert {e.lora_name for e in stored} == {"adapter-x"}
    mgr.check()


@pytest.mark.parametrize("algo", ["vllm_sha256_cbor", "vllm_sha256_cbor_v030", "sglang_sha256"])
def test_groups_share_one_256_bit_chain_through_decode_truncate_and_fork(algo):
    """A later group derives its 256-bit hashes from the first group's chain (one SHA-256 per
    block for all groups). Whatever path grew a table (add, decode steps crossing blocks,
    truncate and regrowth, fork), every group's hashes are the engine's own chain of the
    sequence's tokens, and check() recomputes them from the tokens."""
    groups = (
        kvblocks.KVGroup("full"),
        kvblocks.KVGroup("sliding_window", window=32),
        kvblocks.KVGroup("chunked_local", chunk=8),
    )
    mgr = BlockManager(128, 4, groups=groups, hash_algo=algo)

    def same(seq):
        toks = mgr.token_ids(seq).tolist()
        ref = hash_blocks(toks, 4, algo=algo).tolist()
        for g in range(3):
            assert mgr.block_hashes(seq, group=g).tolist() == ref, (seq, g)
        mgr.check()

    mgr.add("a", list(range(13)))
    compute(mgr, "a")
    same("a")
    for t in range(100, 107):  # decode steps, two block crossings
        mgr.append_batch(["a"], [t])
        compute(mgr, "a")
    same("a")
    mgr.truncate("a", 17)  # into block 4 (the chunk at 16 keeps it): regrown from its parent
    same("a")
    mgr.append("a", [7, 8, 9, 10, 11, 12])
    compute(mgr, "a")
    same("a")
    mgr.fork("a", "b")
    mgr.append_batch(["a", "b"], [1, 2])  # both write into the shared block: copies
    mgr.append_batch(["a", "b"], [3, 4])
    mgr.take_copies()
    compute(mgr, "a")
    compute(mgr, "b")
    same("a")
    same("b")
