"""The transformers versions :mod:`kvblocks.integrations.transformers_cb` supports, and the
private continuous-batching names it patches (imported only when the installed version is
supported, so importing the package never fails)."""

from __future__ import annotations

from typing import Optional

from ...errors import NotSupportedError

__all__ = ["SUPPORTED_TRANSFORMERS", "check_version"]

#: the transformers versions this module is written and tested for (``major.minor``)
SUPPORTED_TRANSFORMERS = ("5.24",)


def _version_problem(version: str) -> Optional[str]:
    """Why ``version`` of transformers is not supported, or None."""
    parts = version.split(".")
    if ".".join(parts[:2]) in SUPPORTED_TRANSFORMERS:
        return None
    return (
        f"kvblocks.integrations.transformers_cb supports transformers "
        f"{', '.join(v + '.x' for v in SUPPORTED_TRANSFORMERS)} (its continuous-batching "
        f"internals change between minor versions); found transformers {version}. "
        f"Install a supported one: pip install 'kvblocks[transformers-cb]'"
    )


def _installed_version() -> str:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise NotSupportedError(
            "kvblocks.integrations.transformers_cb needs transformers "
            f"{SUPPORTED_TRANSFORMERS[0]}.x (not installed)"
        ) from exc
    return transformers.__version__


def check_version(version: Optional[str] = None) -> None:
    """Raise :class:`NotSupportedError` unless ``version`` (default: the installed transformers)
    is one this module supports (:data:`SUPPORTED_TRANSFORMERS`)."""
    if version is None:
        version = _installed_version()
    problem = _version_problem(version)
    if problem is not None:
        raise NotSupportedError(problem)


# transformers' classes: imported only when the installed version is supported, so importing this
# module never fails; enabled() refuses unsupported versions before touching anything.
try:
    import transformers as _tf

    _IMPORT_PROBLEM = _version_problem(_tf.__version__)
except ImportError:  # pragma: no cover - depends on the environment
    _IMPORT_PROBLEM = "transformers is not installed"

if _IMPORT_PROBLEM is None:
    from transformers.generation.continuous_batching import cache as _cb_cache
    from transformers.generation.continuous_batching import initialization as _cb_init
    from transformers.generation.continuous_batching.cache_allocators import (
        FULL_ATTENTION,
        SLIDING_ATTENTION,
        CachePool,
        FullAttentionCacheAllocator,
    )
else:  # pragma: no cover - depends on the installed version
    _cb_cache = _cb_init = None  # type: ignore[assignment]
    FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
    CachePool = FullAttentionCacheAllocator = object  # type: ignore[misc,assignment]
