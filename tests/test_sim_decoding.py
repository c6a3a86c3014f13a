"""The paged engine's decode set (kvblocks.sim.engine.sequences.Decoding): the generated
tokens it precomputes per sequence are the ones tokens_at gives step by step, through joins,
finishes, preemptions and buffer compactions."""

import numpy as np
import pytest

from kvblocks.sim.engine.sequences import Decoding, Seq
from kvblocks.sim.workload.tokens import seed_keys, tokens_at
from kvblocks.sim.workload.traces import Request


def _seq(uid, rng):
    out = int(rng.integers(1, 300))
    req = Request(index=uid, arrival=0.0, prompt_len=10, output_len=out)
    s = Seq(uid, req, 0)
    s.gen = int(rng.integers(1, out + 1))  # prefill done: at least its first token
    s.ctx = 10 + s.gen - 1
    return s


def test_decode_tokens_equal_tokens_at_through_joins_finishes_and_compaction():
    rng = np.random.default_rng(7)
    d = Decoding()
    uid = 0
    compactions = 0
    for _ in range(3000):
        size = d.tok.shape[0]
        if rng.random() < 0.3:
            new = [_seq(uid + k, rng) for k in range(int(rng.integers(1, 5)))]
            uid += len(new)
            d.extend([s for s in new if s.gen < s.output_len])
        if d.seqs and rng.random() < 0.02:  # a preemption takes one out
            victim = d.seqs[int(rng.integers(len(d.seqs)))]
            d.remove(victim)
            assert victim.gen < victim.output_len
        if not d.seqs:
            continue
        keys = seed_keys([s.seed for s in d.seqs])
        np.testing.assert_array_equal(d.tokens(), tokens_at(keys, d.gen - 1))
        assert d.left <= int((d.out - d.gen).min())
        d.gen += 1
        d.left -= 1
        if d.left <= 0:
            d.keep(d.gen < d.out)
            assert not d.seqs or d.left == int((d.out - d.gen).min())
        compactions += d.tok.shape[0] != size
        d.ctx += 1
    assert uid > 1000 and compactions > 0


def _one_step_a_call(monkeypatch):
    from kvblocks.sim.engine.paged import PagedEngine

    monkeypatch.setattr(PagedEngine, "_only_decoding", lambda self: False)


def _same(a, b):
    drop = ("wall_s", "allocator_s", "allocator_share", "check_s")
    assert {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }


@pytest.mark.parametrize(
    "gpu_mem, block_size", [(80.0, 16), (22.0, 16), (40.0, 7), (40.0, 1), (40.0, 256)]
)  # 22 GiB: preemptions under pressure; block sizes: the waste kept from residues
def test_decode_steps_in_a_row_equal_one_step_a_call(monkeypatch, gpu_mem, block_size):
    """The decode-only run (PagedEngine._decode_only) gives exactly the figures and the
    per-step samples of one step a call."""
    from kvblocks.sim import SchedulerConfig, TimeModel, builtin_workload, get_model
    from kvblocks.sim.engine.paged import PagedEngine
    from kvblocks.sim.models.spec import memory_bill

    model = get_model("llama-3.1-8b")
    bill = memory_bill(model, gpu_mem, block_size)
    w = builtin_workload().head(300)
    tm = TimeModel.for_model(model)
    runs, fed = [], []
    inner = PagedEngine._decode_only

    def counted(self):
        queued = len(self.waiting)
        k, dt = inner(self)
        runs.append(k)
        fed.append(queued and len(self.waiting) > queued)  # arrivals queued behind a blocked head
        return k, dt

    cfg = dict(num_blocks=bill.num_blocks, block_size=block_size, block_bytes=bill.block_bytes)
    fast_engine = PagedEngine(w, SchedulerConfig(**cfg), tm)
    monkeypatch.setattr(fast_engine, "_decode_only", lambda: counted(fast_engine))
    fast = fast_engine.run()
    assert sum(runs) > 100 and max(runs) > 10  # the decode-only path ran
    with monkeypatch.context() as m:
        _one_step_a_call(m)
        slow = PagedEngine(w, SchedulerConfig(**cfg), tm).run()
    _same(fast.summary, slow.summary)
    for name in ("t", "used", "running", "waiting"):
        assert getattr(fast.recorder, name) == getattr(slow.recorder, name)
    if gpu_mem < 40:
        assert fast.summary["preemptions"] > 0 and any(fed)


def test_cluster_decode_steps_in_a_row_equal_one_step_a_call(monkeypatch):
    """In a cluster an engine runs its decode-only steps up to the next arrival: routing,
    figures and every replica's summary are those of one step a call."""
    from kvblocks.sim import SchedulerConfig, TimeModel, builtin_workload, get_model
    from kvblocks.sim.cluster.cluster import Cluster

    w = builtin_workload().head(300)
    tm = TimeModel.for_model(get_model("llama-3.1-8b"))
    for router in ("prefix_aware", "least_loaded"):
        fast = Cluster(w, SchedulerConfig(num_blocks=6000), tm, 3, router).run()
        with monkeypatch.context() as m:
            _one_step_a_call(m)
            slow = Cluster(w, SchedulerConfig(num_blocks=6000), tm, 3, router).run()
        _same(fast.summary, slow.summary)
        for a, b in zip(fast.replicas, slow.replicas):
            _same(a, b)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "gpt-oss-20b", "deepseek-v2-lite"])
def test_decode_step_is_step_bit_for_bit(name):
    """TimeModel.decode_step(n)(kv) is step(0, n, kv, 0, 0.0, 0.0) exactly (the decode-only
    run uses it), dense, MoE and MLA, with and without per-token costs and collectives."""
    import dataclasses

    from kvblocks.sim import TimeModel, get_model

    base = TimeModel.for_model(get_model(name))
    rng = np.random.default_rng(3)
    variants = [
        base,
        dataclasses.replace(base, decode_s_per_token=3.1e-5, comm_s_per_token=1.7e-7),
        dataclasses.replace(base, prefill_s_per_token=2.9e-5, comm_s_per_step=4.1e-5),
    ]
    for tm in variants:
        for n in (1, 2, 7, 64, 255):
            f = tm.decode_step(n)
            for kv in rng.integers(n, 40_000_000, 50).tolist():
                assert f(kv) == tm.step(0, n, kv, 0, 0.0, 0.0)


def test_queue_head_too_long_for_an_empty_pool_is_rejected_not_decoded():
    """Regression: with nothing running, a queued prompt longer than the whole pool is rejected
    by the step; the decode-only run (no decoding sequence) must not take that step."""
    from kvblocks.sim import SchedulerConfig, TimeModel, get_model
    from kvblocks.sim.engine.paged import PagedEngine
    from kvblocks.sim.workload.traces import Workload

    reqs = [Request(0, 0.0, 5000, 4), Request(1, 0.0, 100, 30), Request(2, 1.0, 50, 8)]
    w = Workload("tiny", reqs, "azure")
    e = PagedEngine(
        w, SchedulerConfig(num_blocks=64), TimeModel.for_model(get_model("llama-3.1-8b"))
    )
    res = e.run()
    assert res.summary["rejected"] == 1 and res.summary["completed"] == 2
