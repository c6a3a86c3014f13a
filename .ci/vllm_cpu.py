"""pytest plugin for .ci/vllm: vLLM's scheduler tests on a CPU-only machine, both sides.

vLLM's tests/v1/core scheduler tests build a full ``VllmConfig``; with
``VLLM_TARGET_DEVICE=cpu`` its CPU platform's config check then (1) refuses x86 without
triton-cpu, which none of these tests uses (no model runs), and (2) forces
``scheduler_config.async_scheduling`` off, which the tests (written for CUDA, which leaves it
alone) set on purpose. For that one call only: report triton present, and keep the test's
``async_scheduling``. Nothing else of vLLM changes.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    import vllm.triton_utils as tu
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        sched = vllm_config.scheduler_config
        keep = getattr(sched, "async_scheduling", None)
        had = tu.HAS_TRITON
        tu.HAS_TRITON = True
        try:
            orig(cls, vllm_config)
        finally:
            tu.HAS_TRITON = had
            if sched is not None and keep is not None:
                sched.async_scheduling = keep

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
