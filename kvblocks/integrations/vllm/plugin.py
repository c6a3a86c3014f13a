"""vLLM general plugin (entry point group ``vllm.general_plugins``): with
``KVBLOCKS_VLLM=1`` in the environment, vLLM's processes use kvblocks' KV cache manager."""

from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("KVBLOCKS_VLLM", "0").strip().lower() in ("1", "true", "yes", "on"):
        from . import enable

        enable()
