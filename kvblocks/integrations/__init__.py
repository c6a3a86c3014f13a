"""Adapters between kvblocks and inference frameworks.

Each submodule imports its framework lazily (only when the submodule itself is imported), so
``import kvblocks`` never needs torch or transformers:

* :mod:`kvblocks.integrations.transformers` - :class:`PagedKVCache`, a Hugging Face
  ``transformers`` ``Cache`` whose K/V live in kvblocks blocks (needs ``kvblocks[transformers]``);
* :mod:`kvblocks.integrations.transformers_cb` - ``enabled()``: kvblocks as the block allocator of
  transformers' continuous batching (``generate_batch``; needs ``kvblocks[transformers-cb]``).
"""

__all__ = ["transformers", "transformers_cb"]
