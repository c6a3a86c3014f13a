"""What several test files share: the hash key of deterministic tests, the transformers tests'
tiny model config, and a step declared without building metadata. Hash conversions are public (kvblocks.hash_to_int / hash_from_int);
state snapshots live with the tests that define what they compare."""

from kvblocks import hash_from_int, hash_to_int  # noqa: F401  (re-exported for tests)

KEY = b"0123456789abcdef"  # the 16-byte hash key of tests that compare hashes or events

#: the tiny random language model of the transformers tests (a config's keyword arguments)
TINY_LM = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def compute(mgr, *seq_ids):
    """Mark all committed tokens of ``seq_ids`` computed, as the engine's step would (it
    must have drained copies): their full blocks enter the prefix cache."""
    ids = list(seq_ids)
    mgr.schedule(ids, [mgr.num_tokens(s) - mgr.num_computed(s) for s in ids])
