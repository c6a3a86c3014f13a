"""Swap vLLM's ``KVCacheManager`` for kvblocks' (and back).

vLLM's scheduler does ``from vllm.v1.core.kv_cache_manager import KVCacheManager``, so the
class is replaced in ``vllm.v1.core.kv_cache_manager`` and in every loaded module that
imported that name (the scheduler, tests); modules imported later pick up the replaced
attribute of ``vllm.v1.core.kv_cache_manager`` when they import it.
"""

from __future__ import annotations

import logging
import sys
from types import TracebackType
from typing import Any, Optional

logger = logging.getLogger(__name__)

_patched: list[tuple[Any, str, Any]] = []  # (module, attribute, vLLM's original)


class _Enabled:
    """enable()'s result: also a context manager that disables on exit."""

    def __enter__(self) -> _Enabled:
        return self

    def __exit__(
        self, et: Optional[type], ev: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        disable()


def is_enabled() -> bool:
    return bool(_patched)


def enable() -> _Enabled:
    """Make every ``KVCacheManager`` vLLM builds from now on kvblocks' (idempotent)."""
    if _patched:
        return _Enabled()
    import vllm.v1.core.kv_cache_manager as vkm
    import vllm.v1.core.sched.scheduler  # noqa: F401  (the scheduler's own binding)

    from .manager import KVCacheManager, VLLMKVCacheManager

    for mod in list(sys.modules.values()):
        d = getattr(mod, "__dict__", None)
        if not d or not getattr(mod, "__name__", "").startswith(("vllm", "tests")):
            continue
        for name, value in list(d.items()):
            if value is VLLMKVCacheManager:
                _patched.append((mod, name, value))
                setattr(mod, name, KVCacheManager)
    if not any(m is vkm for m, _, _ in _patched):
        _patched.append((vkm, "KVCacheManager", VLLMKVCacheManager))
        vkm.KVCacheManager = KVCacheManager
    logger.info("kvblocks: vLLM's KVCacheManager replaced in %d modules", len(_patched))
    return _Enabled()


def disable() -> None:
    """Put vLLM's own ``KVCacheManager`` back everywhere enable() replaced it."""
    while _patched:
        mod, name, value = _patched.pop()
        setattr(mod, name, value)
