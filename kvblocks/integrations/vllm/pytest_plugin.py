"""pytest plugin: vLLM's own tests on kvblocks' KV cache manager.

    cd <vllm source> && pytest tests/v1/core --noconftest \
        -p kvblocks.integrations.vllm.pytest_plugin

Provides the two logging fixtures of vLLM's conftest (kvblocks.integrations.vllm.fixtures)
and enables kvblocks' manager before test modules are collected, so their
``from vllm.v1.core.kv_cache_manager import KVCacheManager`` binds kvblocks' class.
"""

from __future__ import annotations

from typing import Any

from .fixtures import caplog_vllm, temporary_enable_log_propagate  # noqa: F401


def pytest_configure(config: Any) -> None:
    from . import enable

    enable()
