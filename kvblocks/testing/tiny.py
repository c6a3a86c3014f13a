"""The tiny random transformers language model of the tests, the examples and the benchmarks.

>>> tiny_lm(num_hidden_layers=4)["num_hidden_layers"], TINY_LM["hidden_size"]
(4, 64)
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["TINY_LM", "tiny_config", "tiny_lm"]

#: a config's keyword arguments: 2 layers, 4 heads over 2 K/V heads of size 16, 128 tokens
TINY_LM: Dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_lm(**overrides: Any) -> Dict[str, Any]:
    """:data:`TINY_LM` with ``overrides`` (keyword arguments for any transformers config)."""
    return {**TINY_LM, **overrides}


def tiny_config(config_class: Any = None, **overrides: Any) -> Any:
    """A transformers config (``LlamaConfig`` unless ``config_class`` is given) of the tiny
    model, with ``overrides``. Needs transformers."""
    if config_class is None:
        from transformers import LlamaConfig as config_class
    return config_class(**tiny_lm(**overrides))
