"""What several test files share: the hash key of deterministic tests, the transformers tests'
tiny model config (kvblocks.testing.TINY_LM), left-padded prompt batches, and a step declared
without building metadata. Hash conversions are public (kvblocks.hash_to_int /
hash_from_int); state snapshots live with the tests that define what they compare. Fixtures
are in conftest.py."""

from kvblocks import hash_from_int, hash_to_int  # noqa: F401  (re-exported for tests)
from kvblocks.testing import TINY_LM  # noqa: F401  (the transformers tests' tiny model)

KEY = b"0123456789abcdef"  # the 16-byte hash key of tests that compare hashes or events


def compute(mgr, *seq_ids):
    """Mark all committed tokens of ``seq_ids`` computed, as the engine's step would (it
    must have drained copies): their full blocks enter the prefix cache."""
    ids = list(seq_ids)
    mgr.schedule(ids, [mgr.num_tokens(s) - mgr.num_computed(s) for s in ids])


def left_padded(lengths, vocab, pad, seed=0):
    """A left-padded batch of random prompts of these lengths (transformers' convention for
    decoder-only generation): (input_ids, attention_mask) as torch tensors."""
    import numpy as np
    import torch

    g = np.random.default_rng(seed)
    L = max(lengths)
    ids = np.full((len(lengths), L), pad, dtype=np.int64)
    mask = np.zeros((len(lengths), L), dtype=np.int64)
    for r, n in enumerate(lengths):
        ids[r, L - n :] = g.integers(3, vocab, n)
        mask[r, L - n :] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)
