"""The two logging fixtures vLLM's ``tests/v1/core`` take from vLLM's top-level conftest.

vLLM's ``tests/conftest.py`` imports the whole engine, so the core tests run with
``--noconftest``; these fixtures (written from what the tests use: propagate vLLM's log
records to the root logger so ``caplog`` sees them, at INFO) stand in for it. Load with
``pytest -p kvblocks.integrations.vllm.fixtures`` (vLLM's own manager) or through
``kvblocks.integrations.vllm.pytest_plugin`` (kvblocks' manager).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import pytest


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let vLLM's logger propagate to the root logger for the test (and keep it on if vLLM
    reapplies its default logging config mid-test)."""
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate: None, caplog: Any) -> Iterator[Any]:
    """``caplog`` that sees vLLM's records at INFO and above."""
    with caplog.at_level(logging.INFO):
        yield caplog
