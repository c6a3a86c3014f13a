"""Test helper: declare that a step computed every committed token of some sequences."""


def compute(mgr, *seq_ids):
    """Mark all committed tokens of ``seq_ids`` computed, as the engine's step would (it
    must have drained copies): their full blocks enter the prefix cache."""
    ids = list(seq_ids)
    mgr.schedule(ids, [mgr.num_tokens(s) - mgr.num_computed(s) for s in ids])
