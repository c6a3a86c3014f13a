"""vLLM's own ``BlockPool``, timed beside kvblocks when ``vllm`` is importable (never required).

Only calls whose shape has stayed put across vLLM releases are used: the constructor,
``get_new_blocks(n)`` and ``free_blocks(blocks)``. Anything else about the installed version
that does not fit (a new required constructor argument, an import error) skips the vLLM
columns with the reason, and the rest of the run goes on.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["load"]

_FILL = {"hash_block_size": 16, "block_size": 16}  # required arguments of some releases


def load() -> Tuple[Optional[Callable[[int], object]], str]:
    """``(make_pool, description)``; ``make_pool`` is None when vLLM cannot be used."""
    try:
        import vllm  # noqa: F401
        from vllm.v1.core.block_pool import BlockPool
    except ImportError as e:
        if getattr(e, "name", None) == "vllm":
            return None, "vllm not installed (its BlockPool is timed when importable)"
        return None, f"vllm not usable: {type(e).__name__}: {e}"
    except Exception as e:  # vllm's import can fail in many ways without its platform
        return None, f"vllm not usable: {type(e).__name__}: {e}"
    version = getattr(__import__("vllm"), "__version__", "?")
    try:
        params = inspect.signature(BlockPool).parameters
    except (TypeError, ValueError) as e:
        return None, f"vllm {version}: cannot read BlockPool's signature ({e})"
    kwargs: Dict[str, Any] = {}
    first = None
    for name, p in params.items():
        if name == "num_gpu_blocks":
            first = name
        elif name == "enable_caching":
            kwargs[name] = True
        elif name in _FILL and p.default is inspect.Parameter.empty:
            kwargs[name] = _FILL[name]
        elif p.default is inspect.Parameter.empty and p.kind not in (
            p.VAR_POSITIONAL,
            p.VAR_KEYWORD,
        ):
            if first is None and not kwargs:  # the block count, under another name
                first = name
                continue
            return None, f"vllm {version}: BlockPool needs argument {name!r}, not supported here"
    for m in ("get_new_blocks", "free_blocks"):
        if not hasattr(BlockPool, m):
            return None, f"vllm {version}: BlockPool has no {m}()"

    def make(n: int) -> Any:
        if first is None:
            return BlockPool(n, **kwargs)
        return BlockPool(**{first: n}, **kwargs)

    try:
        make(8).get_new_blocks(2)
    except Exception as e:  # an API drift we cannot follow
        return (
            None,
            f"vllm {version}: BlockPool does not work as expected ({type(e).__name__}: {e})",
        )
    return make, f"vllm {version} (vllm.v1.core.block_pool.BlockPool)"
