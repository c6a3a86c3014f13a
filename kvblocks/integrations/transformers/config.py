"""What :class:`PagedKVCache` asks of a model config: decoder self-attention layers (full or
sliding-window), K/V heads and head size; a model the cache cannot hold is refused here, before
anything is allocated. Also the argument checks made before any storage exists."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import transformers

from ...errors import DeviceError, InvalidTypeError, NotSupportedError
from ...groups import FULL_ATTENTION, SLIDING_ATTENTION, UNSUPPORTED_LAYERS
from ...storage import parse_device

#: token id recorded for generated tokens (int32 max: never a real vocabulary id)
PLACEHOLDER_TOKEN = 2**31 - 1

# the keyword generate() takes a Cache by: `cache` in transformers >= 5, `past_key_values` before
_CACHE_KW = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


class _ModelSpec:
    """What a cache needs from a model config: decoder self-attention layers, K/V heads and
    head size; a model the cache cannot hold is refused here, before anything is allocated."""

    def __init__(self, config: Any) -> None:
        if isinstance(config, torch.nn.Module):
            raise InvalidTypeError(
                "PagedKVCache takes the model's config (model.config), not the model"
            )
        if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
            raise InvalidTypeError(
                f"PagedKVCache needs a transformers model config, got {type(config).__name__}"
            )
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        self.model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        if getattr(text, "kv_lora_rank", None) is not None:
            raise NotSupportedError(
                "PagedKVCache does not support multi-head latent attention "
                f"({self.model_type or 'MLA'}: kv_lora_rank is set): it caches a compressed "
                "latent and a rotary key of different sizes, not K and V of one head size"
            )
        layers = getattr(text, "num_decoder_layers", None) if self.encoder_decoder else None
        self.num_layers = int(layers or text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        self.num_kv_heads = _kv_heads(text, heads, self.model_type)
        self.head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
        # full-attention and sliding-window layers (anything else is refused here)
        self.windows = layer_windows(text, self.num_layers)


def _kv_heads(text: Any, heads: int, model_type: str) -> int:
    """K/V heads the attention of this family hands the cache (not always
    ``num_key_value_heads``)."""
    if model_type == "falcon" and not getattr(text, "num_key_value_heads", None):
        # FalconAttention before transformers 5.25 (whose config names the cached heads in
        # num_key_value_heads): the new decoder architecture broadcasts its K/V groups to
        # every head before caching; multi-query (Falcon-7B) caches one head
        if getattr(text, "new_decoder_architecture", False):
            return heads
        if getattr(text, "multi_query", False):
            return 1
        return int(getattr(text, "num_kv_heads", None) or heads)
    kv = getattr(text, "num_key_value_heads", None)
    if kv:
        return int(kv)
    if getattr(text, "multi_query", False):  # GPT-BigCode and other multi-query layouts
        return 1
    return heads


def _types_and_kwargs(text: Any, num_layers: int) -> Tuple[List[str], List[Dict[str, Any]]]:
    """Layer types and their cache arguments as transformers' ``DynamicCache(config=...)`` sees
    them (its own helper when the installed version has it), else from the config fields."""
    from transformers import cache_utils

    getter = getattr(cache_utils, "get_layer_types_and_kwargs", None)  # transformers >= 5
    if getter is not None:
        try:
            types, kwargs = getter(text)
        except (AttributeError, TypeError, ValueError, IndexError):  # pragma: no cover
            types = None
        if types is not None and len(types) == num_layers:
            return list(types), [dict(k) for k in kwargs]
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is None:
        if window is not None and getattr(text, "use_sliding_window", True):
            kind = SLIDING_ATTENTION
        elif getattr(text, "attention_chunk_size", None) is not None:
            kind = "chunked_attention"
        else:
            kind = FULL_ATTENTION
        types = [kind] * num_layers
    types = list(types)
    if len(types) != num_layers:
        raise NotSupportedError(
            f"the config lists {len(types)} layer_types for {num_layers} decoder layers"
        )
    return types, [{"sliding_window": window} if t == SLIDING_ATTENTION else {} for t in types]


def layer_windows(text: Any, num_layers: int) -> List[Optional[int]]:
    """The sliding window of every decoder layer of a text config (None: full attention).

    Full-attention and sliding-window layers are served; any other layer type raises
    :class:`~kvblocks.NotSupportedError` naming it.
    """
    types, kwargs = _types_and_kwargs(text, num_layers)
    bad = sorted({t for t in types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
    if bad:
        why = "; ".join(f"{t}: {UNSUPPORTED_LAYERS.get(t, 'unknown to kvblocks')}" for t in bad)
        raise NotSupportedError(
            "PagedKVCache supports full-attention and sliding-window layers only; this model "
            f"has {bad} layers ({why}), which it cannot hold yet"
        )
    out: List[Optional[int]] = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        if t == FULL_ATTENTION:
            out.append(None)
            continue
        w = kw.get("sliding_window")
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise NotSupportedError(
                f"layer {i} is a sliding-window layer without a positive sliding_window ({w!r})"
            )
        out.append(int(w))
    return out


def _count(value: Any, name: str) -> int:
    """An int argument, refused (not coerced) when it is a float, str or bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _device(device: Any) -> str:
    """The canonical storage device (``"cpu"`` or ``"cuda:N"``), checked before any allocation."""
    if isinstance(device, torch.device):
        device = str(device)
    kind, index = parse_device(device)
    if kind == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r}: torch sees no CUDA device")
    return f"cuda:{index}"
