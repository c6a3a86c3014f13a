"""pytest plugin: vLLM's own tests on kvblocks' KV cache manager.

    cd <vllm source> && pytest tests/v1/core --noconftest \
        -p kvblocks.integrations.vllm.pytest_plugin

Provides the two logging fixtures of vLLM's conftest (kvblocks.integrations.vllm.fixtures)
and enables kvblocks' manager before test modules are collected, so their
``from vllm.v1.core.kv_cache_manager import KVCacheManager`` binds kvblocks' class.

With ``KVB_VLLM_NATIVE_LOG=<file>``, each test that builds a KV cache manager gets one line
in that file: its node id and how many managers it built per path (``full`` and ``hybrid``
run on kvblocks' native pool, ``fallback`` on vLLM's own managers; counted by
``builds.NATIVE_BUILDS``), and after ``#`` why the fallback ones fell back.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from .fixtures import caplog_vllm, temporary_enable_log_propagate  # noqa: F401


def pytest_configure(config: Any) -> None:
    from . import enable

    enable()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    path = os.environ.get("KVB_VLLM_NATIVE_LOG")
    if not path:
        yield
        return
    from .builds import FALLBACK_REASONS, NATIVE_BUILDS

    before, why = dict(NATIVE_BUILDS), dict(FALLBACK_REASONS)
    yield
    delta = {k: v - before.get(k, 0) for k, v in NATIVE_BUILDS.items() if v > before.get(k, 0)}
    if delta:
        reasons = sorted(k for k, v in FALLBACK_REASONS.items() if v > why.get(k, 0))
        with open(path, "a") as f:
            kinds = " ".join(f"{k}={v}" for k, v in sorted(delta.items()))
            f.write(f"{item.nodeid} {kinds}{' # ' + '; '.join(reasons) if reasons else ''}\n")
