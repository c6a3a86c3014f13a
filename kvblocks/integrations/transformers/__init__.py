"""``model.generate`` on a kvblocks paged KV cache (:class:`PagedKVCache`)."""

from .cache import PLACEHOLDER_TOKEN, PagedKVCache, dynamic_cache_bytes

__all__ = ["PLACEHOLDER_TOKEN", "PagedKVCache", "dynamic_cache_bytes"]
