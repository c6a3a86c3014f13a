"""How many KV cache managers this process built on each path (read by the pytest plugin's
``KVB_VLLM_NATIVE_LOG`` and by tests); a module of its own, so that manager.py and
hybrid.py both count without importing each other."""

from __future__ import annotations

from collections import Counter

# by path: "full" (one full-attention group, native), "hybrid" (the group adapter, native),
# "fallback" (vLLM's managers)
NATIVE_BUILDS: Counter = Counter()
FALLBACK_REASONS: Counter = Counter()  # why the "fallback" ones run on vLLM's managers
