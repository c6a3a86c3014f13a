"""The paged engine's decode set (kvblocks.sim.engine.sequences.Decoding): the generated
tokens it precomputes per sequence are the ones tokens_at gives step by step, through joins,
finishes, preemptions and buffer compactions."""

import numpy as np

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
