"""``model.generate`` on a kvblocks paged KV cache: a Hugging Face ``transformers`` ``Cache``.

:class:`PagedKVCache` is a ``transformers`` ``Cache`` whose keys and values live in the blocks of
a :class:`kvblocks.KVCache`, with block tables kept by a :class:`kvblocks.BlockManager`:

* every batch row of ``generate`` is one kvblocks sequence;
* ``update(k, v, layer)`` scatters the new tokens' K/V into their slots (:func:`kvblocks.ops.write_slots`)
  and returns each row's whole K/V read back from its blocks (:func:`kvblocks.ops.gather`);
* beam search and ``num_return_sequences`` reorder, select and repeat rows with
  :meth:`BlockManager.fork` / ``free`` (block-table moves): rows share blocks, and a row that writes
  into a shared, partly filled block first gets a private copy (copy-on-write through
  :meth:`BlockManager.take_copies` and :func:`kvblocks.ops.copy_blocks`). No K/V tensor is copied
  to reorder beams;
* prefix caching across ``generate`` calls: :meth:`PagedKVCache.prepare` registers the prompts
  (token ids and attention mask) and the model before ``generate`` (or :meth:`PagedKVCache.generate`
  does both); full blocks already in the prefix cache are reused and ``generate`` computes only
  the rest (``cache.cached_tokens``, ``cache.stats``). A hook on the model checks that the forward
  passes feed the prepared prompts, since a cache sees K/V, never token ids;
* tokens are committed by the forward pass that computes them and declared computed after its
  last layer, so only written K/V ever enter the prefix cache; a step's blocks are counted
  exactly before anything changes (all or nothing), and after a forward pass that raised the
  cache refuses every use but ``reset()`` / ``prepare()``;
* sliding-window layers (Gemma 2/3, Mistral, Qwen2, gpt-oss): each kind of layer is a
  :class:`kvblocks.KVGroup` of one manager; a window layer is handed the K/V of the window of
  the step's first query plus the new tokens, as transformers' ``DynamicSlidingWindowLayer``,
  and the blocks the window left behind are released (``kv_bytes_held`` shows it);
* ``copy.deepcopy`` forks the rows into a new cache on the same manager (prompt reuse);
  :meth:`PagedKVCache.encoder_decoder` serves encoder-decoder models' self-attention.

Left padding is stored like any other token (its positions are masked by the attention mask),
so generated tokens are the same as with transformers' default ``DynamicCache``.

Prefix-cache rule for padded rows: a row's blocks are hashed from its token ids, salted with its
padding. A row without padding (attention mask all ones) is hashed unsalted, so it matches any
earlier unpadded prompt with the same leading tokens, whatever batch it came in. A left-padded row
is salted with its number of pad tokens and matches only rows with the same padding and the same
tokens (pad positions included), because the K/V of a padded row depend on where its real tokens
start. Any other mask pattern gets a salt derived from the whole mask. Generated tokens are not
seen by the cache (transformers passes it K/V, not token ids): their blocks are hashed from a
placeholder id that no real prompt contains, so they never serve prefix hits.

Needs ``torch`` and ``transformers`` (the layered ``Cache`` API, transformers >= 4.56).

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from kvblocks.integrations.transformers import PagedKVCache
>>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
>>> cache = PagedKVCache(model.config, num_blocks=64, block_size=16)
>>> out = model.generate(torch.tensor([[5, 6, 7]]), cache=cache, max_new_tokens=4, do_sample=False)
>>> cache.get_seq_length()
6

Modules: :mod:`.cache` (the ``Cache`` API), :mod:`.prompts` (prefix caching: ``prepare``),
:mod:`.guard` (the forward-argument guard), :mod:`.step` (the step protocol: one forward pass's
block tables, slots and K/V), :mod:`.rows` (rows as sequences, failure state), :mod:`.storage`
(storage conversion), :mod:`.config` (what a model config asks of the cache). Layers map onto
KV cache groups through :func:`kvblocks.groups.plan_groups`.
"""

from .cache import PagedKVCache
from .config import PLACEHOLDER_TOKEN
from .storage import dynamic_cache_bytes

__all__ = ["PLACEHOLDER_TOKEN", "PagedKVCache", "dynamic_cache_bytes"]
