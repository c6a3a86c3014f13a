"""The forward-argument guard of :meth:`PagedKVCache.prepare`: a cache sees K/V, never token ids,
so a forward pre-hook on the model checks that each pass feeding prompt tokens feeds the prepared
ones (same ids, same padding, the positions the cache holds), before the model computes anything."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Tuple

import numpy as np
import torch

from ...errors import InvalidStateError, NotSupportedError
from .rows import PagedRows


class _ForwardCheck:
    """A forward pre-hook on the model given to :meth:`PagedKVCache.prepare`: checks that each
    forward pass feeding prompt tokens to the cache feeds the prepared ones, before the model
    computes anything. It holds the cache weakly and is removed once the prompts are fed."""

    def __init__(self, cache: PagedRows) -> None:
        self.cache = weakref.ref(cache)
        self.detach: Any = None

    @classmethod
    def attach(cls, cache: PagedRows, model: torch.nn.Module) -> "_ForwardCheck":
        check = cls(cache)
        handle = model.register_forward_pre_hook(check, with_kwargs=True)
        check.detach = weakref.finalize(cache, handle.remove)  # also if the cache is dropped
        return check

    def remove(self) -> None:
        self.detach()

    def __call__(self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        alive = self.cache()
        if alive is None:
            return None
        cache: PagedRows = alive
        passed = kwargs.get("cache")
        if passed is None:
            passed = kwargs.get("past_key_values")  # transformers 4.x name
        if passed is not cache:
            return None
        if cache._prompt is None or cache._failed is not None:
            return None  # the cache refuses or serves this pass itself
        try:
            self._check(cache, args, kwargs)
        except BaseException as exc:
            cache._fail(exc)
            raise
        return None

    @staticmethod
    def _check(cache: PagedRows, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        pr = cache._prompt
        assert pr is not None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise NotSupportedError(
                "after prepare(), generate must feed input_ids (inputs_embeds cannot be checked "
                "against the prepared prompts)"
            )
        fed = ids.detach().to("cpu").numpy()
        prompts, pmask = pr["ids"], pr["mask"]
        P, L = prompts.shape
        if fed.ndim != 2:
            raise NotSupportedError(f"after prepare(), input_ids of shape {tuple(fed.shape)}")
        B, q = fed.shape
        rows = len(cache._rows) if pr["k"] is not None else None
        if B % P or (rows is not None and B != rows) or q == 0:
            raise InvalidStateError(
                f"generate fed {B} rows, but prepare() registered {P} prompts: pass generate the "
                "input_ids and attention_mask given to prepare()"
            )
        k = B // P
        start = cache._layer_len[0]
        # where the model puts these tokens: a 2-D attention mask covers every position up to
        # the end of this pass; without one (no padding), position ids or the cache length say
        mask = kwargs.get("attention_mask")
        pos = kwargs.get("position_ids")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            s = int(mask.shape[1]) - q
        elif isinstance(pos, torch.Tensor) and pos.ndim == 2 and pos.shape[1] == q:
            s = int(pos[0, 0])
        else:
            s = start
        if s != start and not (s == 0 and pr["k"] is None):
            raise InvalidStateError(
                f"generate fed positions {s}..{s + q - 1} of the prepared prompts, but the cache "
                f"holds {start} tokens per row: pass generate the input_ids and attention_mask "
                "given to prepare()"
            )
        n = min(s + q, L) - s
        if n <= 0:
            raise InvalidStateError("generate fed tokens past the prepared prompts' end")
        want = np.repeat(prompts[:, s : s + n], k, axis=0)
        bad = np.nonzero((fed[:, :n] != want).any(axis=1))[0]
        if bad.size:
            r = int(bad[0])
            j = int(np.nonzero(fed[r, :n] != want[r])[0][0])
            raise InvalidStateError(
                f"generate was not fed the prompts given to prepare(): row {r} has token "
                f"{int(fed[r, j])} at position {s + j} where the prepared prompt has "
                f"{int(want[r, j])}. Call prepare() with the input_ids passed to generate "
                "(or cache.generate(model, input_ids, ...))"
            )
        want_mask = None if pmask is None else np.repeat(pmask, k, axis=0)
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            m = mask.detach().to("cpu").numpy() != 0
            w = min(m.shape[1], L)
            exp = np.ones((B, w), dtype=bool) if want_mask is None else want_mask[:, :w] != 0
            if not np.array_equal(m[:, :w], exp) or not m[:, w:].all():
                raise InvalidStateError(
                    "generate was fed an attention_mask other than the one given to prepare(); "
                    "the prefix cache keys padded rows by their padding"
                )
        elif want_mask is not None and mask is None:
            raise InvalidStateError(
                "prepare() was given a padded attention_mask but generate was fed none"
            )
        if s == 0 and start > 0 and cache._windowed:
            raise NotSupportedError(
                "a pass feeding the whole prompt again after prepare() found prefix hits "
                "(assisted generation, prompt lookup) on a model with sliding-window layers: "
                "their blocks before the hit point were never held; call cache.reset() instead "
                "of prepare() for this generate call"
            )
        if s == 0 and start > 0:
            # the whole prompt again (assisted generation's first pass): nothing is skipped,
            # rows still share the blocks they found (positions below a row's hit are not written)
            cache._layer_len = [0] * cache.num_layers
            cache._stats["cached_tokens"] -= P * cache.cached_tokens
            cache.cached_tokens = 0
        pr["checked"] = (B, q, s)
