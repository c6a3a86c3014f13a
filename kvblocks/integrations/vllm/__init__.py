"""kvblocks as vLLM's KV cache manager (vllm==0.34.0, ``vllm.v1.core``).

    import kvblocks.integrations.vllm as kvb_vllm
    kvb_vllm.enable()            # every Scheduler built from now on uses kvblocks' manager
    with kvb_vllm.enable(): ...  # or only inside the block
    kvb_vllm.disable()

``KVBLOCKS_VLLM=1`` turns it on in a vLLM process through vLLM's general-plugin entry point
(``kvblocks.integrations.vllm.plugin:register``); ``pytest -p
kvblocks.integrations.vllm.pytest_plugin`` runs vLLM's own tests on it. docs/vllm.md says what
runs natively and what falls back to vLLM's Python managers.
"""

from __future__ import annotations

from typing import Any

from .patch import disable, enable, is_enabled

SUPPORTED_VLLM = "0.34.0"

__all__ = ["KVCacheManager", "SUPPORTED_VLLM", "disable", "enable", "is_enabled"]


def __getattr__(name: str) -> Any:  # vLLM is imported only when the manager is asked for
    if name == "KVCacheManager":
        from .manager import KVCacheManager

        return KVCacheManager
    raise AttributeError(name)
