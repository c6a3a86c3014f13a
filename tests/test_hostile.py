"""Hostile inputs at every public BlockManager and BlockPool call.

Each call either does what the reference model (kvblocks.testing.ReferenceManager) does, or
raises a KVBlocksError the reference allows, with the whole state unchanged: block tables,
tokens, ref counts, the free list, the prefix cache, its statistics, pending copies. Only the
conversion phase may run the arguments' own code (``__array__``, a generator), and only as
the reference runs it; int and str subclasses are read without running their methods.
``check()`` passes after every call, and nothing but a KVBlocksError escapes.

Arguments are recipes (kvblocks.testing.strategies): each side gets its own instance, and a
hook that calls back into "the manager" calls back into the one it was made for.
"""

import sys
import threading

import numpy as np
import pytest
from helpers import KEY
from hypothesis import assume, given
from hypothesis import strategies as st

import kvblocks
from kvblocks import BlockManager, BlockPool, InvalidArgumentError, KVBlocksError, OutOfBlocksError
from kvblocks.testing import ReferenceManager, ReferencePool, same_error
from kvblocks.testing import strategies as ks
from kvblocks.testing.reference import hashes_of, scalar_of, seq_id_of, seq_ids_of, tokens_of

LIVE = ("a", 1, "s", 2**70)  # "s" is swapped out; 1 is a fork of "a"
OTHER = ("zz", 99, "new")
CONVERT = {
    "id": seq_id_of,
    "ids": seq_ids_of,
    "tokens": tokens_of,
    "hashes": hashes_of,
    "n": lambda x: scalar_of(x, "n"),
}


def build_manager(cls, pending):
    """A manager with a cached evictable block, a computed sequence with cached blocks, a
    swapped-out one, a huge int id and (if ``pending``) a fork with a pending copy."""
    m = cls(16, 4, num_host_blocks=8, hash_key=KEY)
    m.add(7, list(range(100, 104)))
    m.metadata([7], [4])
    m.free(7)
    m.add("a", list(range(10)))
    m.metadata(["a"], [10])
    m.add("s", [1, 2])
    m.swap_out("s")
    m.add(2**70, [3])
    m.fork("a", 1)
    if pending:
        m.append(1, [5])  # copy-on-write of a's partial block
    return m


def manager_state(m):
    pool, host = m.pool, m.host_pool
    return {
        "seqs": {
            repr(s): (
                np.asarray(m.block_table(s)).tolist(),
                np.asarray(m.token_ids(s)).tolist(),
                bool(m.is_swapped(s)),
            )
            for s in m.seq_ids()
        },
        "ref_counts": np.asarray(pool.ref_counts()).tolist(),
        "free_list": np.asarray(pool.free_list()).tolist(),
        "cached": {b: pool.block_hash(b) for b in range(pool.num_blocks) if pool.is_cached(b)},
        "pending_copies": m.num_pending_copies,
        "host": (np.asarray(host.ref_counts()).tolist(), np.asarray(host.free_list()).tolist()),
    }


def pool_state(p):
    return {
        "ref_counts": np.asarray(p.ref_counts()).tolist(),
        "free_list": np.asarray(p.free_list()).tolist(),
        "cached": {b: p.block_hash(b) for b in range(p.num_blocks) if p.is_cached(b)},
    }


def result(x):
    """A comparable form of what a call returned."""
    if hasattr(x, "slot_mapping"):
        return tuple(
            np.asarray(getattr(x, f)).tolist()
            for f in ("slot_mapping", "seq_lens", "kv_indptr", "kv_indices")
        )
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).tolist()
    return x


def same_state(real, ref, ordered):
    if not ordered:  # the documents leave the free-list order open here: compare the sets
        real, ref = dict(real), dict(ref)
        real["free_list"], ref["free_list"] = sorted(real["free_list"]), sorted(ref["free_list"])
    return real == ref


def conversion_error(kind, recipe):
    """The error converting this argument on its own raises (phase 1 of a call), or None.
    The spec orders conversion before validation but not the arguments among themselves, so
    a core may report any argument that fails to convert."""
    if recipe.runs_code:
        return None
    try:
        value = CONVERT[kind](recipe.make(None, []))
        if kind == "n" and not 0 <= value <= 2**63 - 1:
            raise InvalidArgumentError(f"{value} out of range")
    except KVBlocksError as exc:
        return exc
    return None


def draw_args(data, kinds, table):
    recipes = [data.draw(table[k], label=k) for k in kinds]
    errors = [conversion_error(k, r) for k, r in zip(kinds, recipes)]
    coders = sum(r.runs_code for r in recipes)
    # an argument whose conversion runs code (and may call back) goes with valid ones only:
    # whether it runs at all when another argument is bad is not specified
    assume(coders == 0 or (coders == 1 and not any(errors)))
    return recipes, [e for e in errors if e is not None]


def check_call(ref, real, name, recipes, state, stats, conversion_errors=()):
    """Run ``name`` on both with arguments made from ``recipes``; compare as the module
    docstring says."""
    ref_log, real_log = [], []
    ref_args = [r.make(ref, ref_log) for r in recipes]
    real_args = [r.make(real, real_log) for r in recipes]
    where = f"{name}({', '.join(map(repr, recipes))})"
    before, stats_before = state(real), stats(real)
    ref_exc = real_exc = None
    try:
        want = getattr(ref, name)(*ref_args)
    except KVBlocksError as exc:
        ref_exc = exc
    try:
        got = getattr(real, name)(*real_args)
    except BaseException as exc:  # noqa: BLE001 - anything but a KVBlocksError fails below
        real_exc = exc
    if real_exc is not None:
        assert isinstance(real_exc, KVBlocksError), (
            f"{where} raised {type(real_exc).__name__}: {real_exc} (not a KVBlocksError)"
        )
        if not real_log:
            assert state(real) == before and stats(real) == stats_before, (
                f"{where} raised {real_exc!r} and changed the state"
            )
        huge = any(r.huge for r in recipes) and isinstance(
            real_exc, (InvalidArgumentError, OutOfBlocksError)
        )
        if ref_exc is None:
            assert huge, f"{where}: the reference returned {result(want)!r}, the core {real_exc!r}"
        else:
            allowed = [ref_exc] + list(conversion_errors)
            assert huge or any(same_error(e, real_exc) for e in allowed), (
                f"{where}: the reference raised {ref_exc!r}, the core {real_exc!r}"
            )
    else:
        assert ref_exc is None, (
            f"{where}: the reference raised {ref_exc!r}, the core returned {result(got)!r}"
        )
        assert result(got) == result(want), f"{where}: {result(got)!r} != {result(want)!r}"
    assert real_log == ref_log, (
        f"{where}: the arguments' hooks ran {real_log} in the core, {ref_log} in the spec"
    )
    ordered = ref.pool.free_order_known if hasattr(ref, "host_pool") else ref.free_order_known
    assert same_state(state(real), state(ref), ordered), (
        f"{where}: the state differs from the reference's\n core {state(real)}\n spec {state(ref)}"
    )
    real.check()


# ---------------------------------------------------------------------------------------------
# BlockManager
# ---------------------------------------------------------------------------------------------
KINDS = {
    "id": ks.seq_ids(LIVE, OTHER),
    "ids": ks.seq_id_iterables(LIVE, OTHER),
    "tokens": ks.token_arrays(LIVE),
    "n": ks.scalars(LIVE),
}
MANAGER_CALLS = {
    "add": ("id", "tokens"),
    "append": ("id", "tokens"),
    "append_batch": ("ids", "tokens"),
    "reserve": ("id", "n"),
    "truncate": ("id", "n"),
    "fork": ("id", "id"),
    "free": ("id",),
    "block_table": ("id",),
    "num_tokens": ("id",),
    "num_computed": ("id",),
    "token_ids": ("id",),
    "is_swapped": ("id",),
    "blocks_needed": ("id", "n"),
    "can_append": ("ids", "n"),
    "can_add": ("n",),
    "blocks_for_tokens": ("n",),
    "swap_out": ("id",),
    "swap_in": ("id",),
    "take_copies": (),
    "metadata": ("ids", "tokens"),
    "schedule": ("ids", "tokens"),
}


@pytest.mark.parametrize("call", sorted(MANAGER_CALLS))
@given(data=st.data())
def test_manager_call(call, data):
    pending = data.draw(st.booleans(), label="pending copy")
    recipes, errors = draw_args(data, MANAGER_CALLS[call], KINDS)
    check_call(
        build_manager(ReferenceManager, pending),
        build_manager(BlockManager, pending),
        call,
        recipes,
        manager_state,
        lambda m: getattr(m.pool, "stats", None),
        errors,
    )


# ---------------------------------------------------------------------------------------------
# BlockPool
# ---------------------------------------------------------------------------------------------
HASHES = kvblocks.hash_blocks(np.arange(16, dtype=np.int32), 4, key=KEY)
POOL_HOOKS = ks.effects(
    calls=[("free", ([2],)), ("allocate", (1,)), ("incref", ([1],)), ("reset_prefix_cache", ())]
)
POOL_KINDS = {
    "ids": ks.token_arrays(values=st.integers(-1, 13), hooks=POOL_HOOKS),
    "n": ks.scalars(hooks=POOL_HOOKS),
    "hashes": ks.hash_arrays(HASHES),
}
POOL_CALLS = {
    "allocate": ("n",),
    "free": ("ids",),
    "incref": ("ids",),
    "ref_count": ("n",),
    "is_cached": ("n",),
    "block_hash": ("n",),
    "cache": ("ids", "hashes"),
    "lookup": ("hashes",),
    "lookup_and_pin": ("hashes",),
    "reset_prefix_cache": (),
}


def build_pool(cls, evictable_only):
    """12 blocks: 1 and 2 cached, 1 shared; 3 cached and evictable; 4 free (never cached)."""
    p = BlockPool(12, hash_key=KEY) if cls is BlockPool else ReferencePool(12)
    ids = p.allocate(4)
    p.cache(ids[:3], HASHES[:3])
    p.free(ids[::-1][:2])
    p.incref(ids[:1])
    if evictable_only:  # then reset_prefix_cache can succeed
        p.free([1, 1, 2])
    return p


@pytest.mark.parametrize("call", sorted(POOL_CALLS))
@given(data=st.data())
def test_pool_call(call, data):
    evictable_only = data.draw(st.booleans(), label="only evictable cached blocks")
    recipes, errors = draw_args(data, POOL_CALLS[call], POOL_KINDS)
    check_call(
        build_pool(ReferencePool, evictable_only),
        build_pool(BlockPool, evictable_only),
        call,
        recipes,
        pool_state,
        lambda p: getattr(p, "stats", None),
        errors,
    )


# ---------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------
def test_threads_on_disjoint_sequences_keep_their_own_tokens():
    """Each public call is atomic with respect to other Python threads: 4 threads, each
    committing to and scheduling its own sequences with list arguments, many times.
    Afterwards every sequence holds exactly its own tokens."""
    threads, per_thread, steps = 4, 6, 1500
    mgr = BlockManager(threads * per_thread * (steps // 4 + 1) + 1, 4)  # room for every token
    ids = [
        [f"t{t}/{i}" if i % 2 else t * 100 + i for i in range(per_thread)] for t in range(threads)
    ]
    for mine in ids:
        for sid in mine:
            mgr.add(sid, [])
    errors = []
    start = threading.Barrier(threads)

    def worker(t):
        start.wait()
        for step in range(steps):
            try:
                mgr.append_batch(ids[t], [t * 1000 + step] * per_thread)  # list tokens
                mgr.metadata(ids[t], [1] * per_thread)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    finally:
        sys.setswitchinterval(old)
    wrong = [
        sid
        for t, mine in enumerate(ids)
        for sid in mine
        if mgr.token_ids(sid).tolist() != [t * 1000 + s for s in range(steps)]
    ]
    assert not errors and not wrong, (
        f"{len(errors)} calls raised (first: {errors[:2]}); {len(wrong)} sequences do not "
        f"hold exactly their own tokens: {wrong[:6]}"
    )
    mgr.check()
