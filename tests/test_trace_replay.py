"""Real traffic: both Mooncake traces replayed through BlockManager with ample blocks.

Each prompt is added, checked and freed; with no eviction, the prefix-cache hit of every
request must equal the exact reuse computed directly from ``hash_ids`` by an independent
trie over id paths (the longest token prefix shared with any earlier prompt, capped at
len - 1 and rounded down to whole blocks).
"""

import json
from pathlib import Path

import pytest

from kvblocks import BlockManager
from kvblocks.sim.workload.tokens import TokenBook

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
FILES = ["mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"]
ID_TOKENS = 512


def load(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def expected_hits(reqs, bs):
    """Per request: cached tokens an unbounded prefix cache serves, from hash_ids alone."""
    trie = {}  # node id -> {hash id: [child node, longest cut of this id seen]}
    nodes = [trie]
    out = []
    for r in reqs:
        n = r["input_length"]
        node, shared, matching = 0, 0, True
        for j, h in enumerate(r["hash_ids"]):
            mine = min(ID_TOKENS, n - ID_TOKENS * j)
            edge = nodes[node].get(h)
            if matching:
                if edge is None:
                    matching = False
                else:
                    shared += min(edge[1], mine)
                    matching = edge[1] >= mine
            if edge is None:
                nodes.append({})
                edge = nodes[node][h] = [len(nodes) - 1, mine]
            edge[1] = max(edge[1], mine)
            node = edge[0]
        capped = min(shared, n - 1)
        out.append(capped - capped % bs)
    return out


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("bs", [16])
def test_hit_rate_equals_exact_reuse(name, bs):
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    reqs = load(path)
    want = expected_hits(reqs, bs)
    ample = sum(-(-r["input_length"] // bs) for r in reqs) - sum(want) // bs + 2
    book = TokenBook()
    mgr = BlockManager(ample, bs, hash_key=b"trace-replay-key")
    got = []
    for i, r in enumerate(reqs):
        toks = book.prompt(r["hash_ids"], r["input_length"])
        got.append(mgr.add(i, toks))
        mgr.schedule([i], [len(toks) - got[-1]])  # the prompt is computed, then finishes
        mgr.free(i)
    stats = mgr.pool.stats
    assert stats.evictions == 0
    assert got == want
    assert stats.hit_tokens == sum(want)
    assert stats.hit_rate == pytest.approx(sum(want) / sum(r["input_length"] for r in reqs))
    assert mgr.pool.num_free == mgr.pool.num_blocks - 1
    mgr.check()
