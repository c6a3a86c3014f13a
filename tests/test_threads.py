"""Threads hammering one BlockManager, each on its own sequences.

docs/engine-integration.md (*Threads and callbacks*): each public call is atomic with respect
to other Python threads. Each worker adds, appends (one call and batched), builds metadata
(directly or from a plan_step, whose writer refuses once another worker changed the manager),
forks and frees its own sequences,
passing ids and tokens as Python lists (their conversion runs Python code, so the GIL can
switch threads in the middle of a call). Every call's result is checked against the worker's
own model; at the end every sequence holds exactly its own tokens, no block is shared between
two workers (their tokens differ, so neither forks nor the prefix cache may share one) and
mgr.check() passes.
"""

import random
import sys
import threading

import numpy as np

from kvblocks import BlockManager, InvalidStateError

WORKERS = 4
STEPS = 3000
BLOCK_SIZE = 4


def _worker(mgr, w, errors, models, barrier):
    rng = random.Random(w)
    model = {}  # seq id -> committed tokens
    family = {}  # seq id -> the id of the prompt it was forked from (itself for a prompt)
    models[w] = (model, family)
    base = 1000 * (w + 1)  # this worker's token values: no prefix is shared between workers
    serial = 0

    def new_id():
        nonlocal serial
        serial += 1
        # int ids and str ids both; ints far apart per worker
        return w * 100000 + serial if serial % 2 else f"w{w}-{serial}"

    barrier.wait()
    try:
        for _ in range(STEPS):
            op = rng.randrange(10)
            ids = list(model)
            if op < 2 or not ids:
                sid = new_id()
                toks = [base + rng.randrange(50) for _ in range(rng.randrange(1, 10))]
                mgr.add(sid, toks)
                model[sid] = toks
                family[sid] = sid
            elif op < 4:
                sid = rng.choice(ids)
                toks = [base + rng.randrange(50) for _ in range(rng.randrange(1, 6))]
                mgr.append(sid, toks)
                model[sid] = model[sid] + toks
            elif op < 7:
                batch = rng.sample(ids, rng.randrange(1, len(ids) + 1))
                toks = [base + rng.randrange(50) for _ in batch]
                mgr.append_batch(batch, toks)
                for sid, t in zip(batch, toks):
                    model[sid] = model[sid] + [t]
            elif op < 8:
                batch = rng.sample(ids, rng.randrange(1, len(ids) + 1))
                # a step computes at least every uncomputed token (only this worker touches
                # its sequences); other workers' forks may leave copy-on-write pairs pending
                qlens = [
                    rng.randrange(len(model[s]) - mgr.num_computed(s), len(model[s]) + 1)
                    for s in batch
                ]
                mgr.take_copies()
                try:
                    if rng.random() < 0.5:
                        meta = mgr.metadata(batch, qlens)
                    else:  # the plan: another worker's call in between makes it stale
                        meta = mgr.plan_step(batch, qlens).metadata()
                except InvalidStateError as exc:
                    if "copy-on-write" not in str(exc) and "since plan_step" not in str(exc):
                        raise
                    continue  # another worker changed the manager in between: legal refusals
                lens = [len(model[s]) for s in batch]
                if meta.seq_lens.tolist() != lens:
                    raise AssertionError(
                        f"metadata({batch}).seq_lens = {meta.seq_lens.tolist()}, expected {lens}"
                    )
                want = np.concatenate(
                    [mgr.block_table(s)[: -(-len(model[s]) // BLOCK_SIZE)] for s in batch]
                )
                if not np.array_equal(meta.kv_indices, want):
                    raise AssertionError(
                        f"metadata({batch}).kv_indices are not the batch's block tables"
                    )
            elif op < 9:
                parent = rng.choice(ids)
                child = new_id()
                mgr.fork(parent, child)
                model[child] = list(model[parent])
                family[child] = family[parent]
            else:
                sid = rng.choice(ids)
                mgr.free(sid)
                del model[sid], family[sid]
            for sid in [s for s in model if len(model[s]) > 40]:  # keep sequences short
                mgr.free(sid)
                del model[sid], family[sid]
    except Exception as e:  # noqa: BLE001 - reported by the main thread
        errors.append(f"worker {w}: {type(e).__name__}: {e}")


def test_threads_own_their_sequences():
    mgr = BlockManager(20000, BLOCK_SIZE)
    errors, models = [], [None] * WORKERS
    barrier = threading.Barrier(WORKERS)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [
            threading.Thread(target=_worker, args=(mgr, w, errors, models, barrier))
            for w in range(WORKERS)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, "\n".join(errors[:5])

    owner = {}  # block -> worker
    live = 0
    for w, (model, family) in enumerate(models):
        for sid, toks in model.items():
            live += 1
            assert mgr.token_ids(sid).tolist() == toks, f"sequence {sid!r} of worker {w}"
            assert mgr.num_tokens(sid) == len(toks)
            table = mgr.block_table(sid)
            assert len(table) == -(-len(toks) // BLOCK_SIZE)
            for b in table.tolist():
                assert owner.setdefault(b, w) == w, (
                    f"block {b} is held by workers {owner[b]} and {w}"
                )
        # within a worker, only a prompt and its forks may share blocks
        seen = {}
        for sid in model:
            for b in mgr.block_table(sid).tolist():
                assert seen.setdefault(b, family[sid]) == family[sid], (
                    f"block {b} is shared by unrelated sequences of worker {w}"
                )
    assert mgr.num_seqs == live
    assert sorted(map(repr, mgr.seq_ids())) == sorted(repr(s) for model, _ in models for s in model)
    mgr.check()
