"""Prefix caching for :class:`PagedKVCache`: :meth:`prepare` registers a batch of prompts (token
ids and padding) and shares the blocks already in the prefix cache; each row is hashed salted with
its padding (see the package docstring)."""

from __future__ import annotations

import hashlib
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from ...errors import InvalidArgumentError, InvalidTypeError, NotSupportedError
from .config import _CACHE_KW, PLACEHOLDER_TOKEN
from .guard import _ForwardCheck
from .step import StepProtocol


class PromptCache(StepProtocol):
    """:class:`PagedKVCache`'s prompts: registered by :meth:`prepare`, fed by ``generate``."""

    def prepare(self, input_ids: Any, attention_mask: Any = None, *, model: Any = None) -> int:
        """Start a new batch of prompts: free the rows, look the prompts up in the prefix cache.

        Call it right before ``model.generate(input_ids, attention_mask=..., cache=cache)`` with
        the same (unexpanded) ``input_ids`` and ``attention_mask`` and the ``model`` that will
        generate (or call :meth:`generate`, which does both). The cache checks, on every forward
        pass of ``model`` that feeds prompt tokens, that they are the prepared ones (a hook on
        ``model``, removed once the prompts are fed): a cache sees K/V, not token ids, so without
        this check a different prompt of the same shape would silently be given the cached K/V
        of the prepared one.

        Prompt blocks already in the prefix cache are shared; the returned count of leading
        tokens per row (the minimum over rows, a multiple of ``block_size``) is what ``generate``
        will not recompute; it is also ``cache.cached_tokens``. ``num_return_sequences`` /
        ``num_beams`` copies of each prompt share its blocks. A prompt's own blocks are taken,
        and enter the prefix cache, as the forward passes compute them (chunked prefill too).

        Raises OutOfBlocksError when the prompts do not fit the pool (nothing is kept).
        """
        if self._encoder_decoder:
            raise NotSupportedError(
                "prepare() is for decoder-only models: an encoder-decoder decoder's K/V depend on "
                "the encoder input, so they cannot be reused by decoder token ids"
            )
        if model is None or not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                "prepare(input_ids, attention_mask, model=model): the model that will generate is "
                "needed to check that generate is fed these prompts (or call "
                "cache.generate(model, input_ids, attention_mask=..., ...))"
            )
        ids = _as_2d_int(input_ids, "input_ids")
        mask = None if attention_mask is None else _as_2d_int(attention_mask, "attention_mask")
        if mask is not None and mask.shape != ids.shape:
            raise InvalidArgumentError(
                f"attention_mask shape {mask.shape} does not match input_ids {ids.shape}"
            )
        P, L = ids.shape
        if P == 0 or L == 0:
            raise InvalidArgumentError("prepare: empty prompts")
        if ids.min() < 0 or ids.max() >= PLACEHOLDER_TOKEN:
            raise InvalidArgumentError("prepare: token ids must be in [0, 2**31 - 1)")
        if mask is not None and ((mask != 0) & (mask != 1)).any():
            raise InvalidArgumentError("prepare: attention_mask must hold 0 and 1 only")
        self.reset()
        ids32 = ids.astype(np.int32)
        salts = [_padding_salt(None if mask is None else mask[r]) for r in range(P)]
        if self._windowed:
            seqs, hits = self._add_prompts_windowed(ids32, salts)
        else:
            seqs, hits = self._add_prompts(ids32, salts)
        common = min(hits)
        self._rows = seqs
        self._write_from = list(hits)
        self._layer_len = [common] * self.num_layers
        self._prompt = {
            "ids": ids32,
            "mask": None if mask is None or mask.all() else mask.astype(np.int8),
            "owners": seqs,
            "hits": hits,
            "k": None,
            "checked": None,
            "hook": None,
        }
        self._prompt["hook"] = _ForwardCheck.attach(self, model)
        self.cached_tokens = common
        st = self._stats
        st["prompts"] += P
        st["prompt_tokens"] += P * L
        st["cached_tokens"] += P * common
        st["hit_tokens"] += sum(hits)
        return common

    def _add_prompts(
        self, ids: np.ndarray, salts: List[Optional[str]]
    ) -> Tuple[List[int], List[int]]:
        """One sequence per prompt holding its prefix-cache hit; returns (sequences, hits)."""
        mgr = self.manager
        seqs: List[int] = []
        hits: List[int] = []
        try:
            # add() takes every prompt's blocks at once (all of them fit, or OutOfBlocksError);
            # only the hits stay committed: the rest is committed by the forward passes that
            # compute it, so no block ever enters the prefix cache before its K/V are written
            for r in range(ids.shape[0]):
                seq = next(self._shared.ids)
                n = int(mgr.add(seq, ids[r], salt=salts[r]))
                seqs.append(seq)
                hits.append(n)
            for seq, n in zip(seqs, hits):
                mgr.truncate(seq, n)
        except BaseException:
            for seq in seqs:
                mgr.free(seq)
            raise
        return seqs, hits

    def _add_prompts_windowed(
        self, ids: np.ndarray, salts: List[Optional[str]]
    ) -> Tuple[List[int], List[int]]:
        """:meth:`_add_prompts` for a model with sliding-window layers: every row gets the same
        hit. The first pass recomputes from the smallest hit on, and its queries read the window
        before that point, which a window group holds only for a row's own hit point; so each row
        is added with its prompt cut one token past a common hit (lowered until every row finds
        it), then grown by the rest of its prompt (all of them fit, or OutOfBlocksError) and cut
        back, leaving the hit and the next token committed."""
        mgr = self.manager
        P, L = ids.shape
        target = min(int(mgr.probe(ids[r], salt=salts[r])[0]) for r in range(P))
        seqs: List[int] = []
        try:
            while True:
                hits = []
                for r in range(P):
                    seq = next(self._shared.ids)
                    hits.append(int(mgr.add(seq, ids[r, : target + 1], salt=salts[r])))
                    seqs.append(seq)
                if min(hits) == target:
                    break
                for seq in seqs:  # a row found less (a window block was evicted): retry lower
                    mgr.free(seq)
                seqs, target = [], min(hits)
            if target + 1 < L:
                for r, seq in enumerate(seqs):
                    mgr.append(seq, ids[r, target + 1 :])
                for seq in seqs:
                    mgr.truncate(seq, target + 1)
        except BaseException:
            for seq in seqs:
                mgr.free(seq)
            raise
        return seqs, hits

    def generate(
        self, model: Any, input_ids: Any, attention_mask: Any = None, **kwargs: Any
    ) -> Any:
        """``prepare(input_ids, attention_mask, model=model)`` then ``model.generate`` on this cache
        with the same inputs (and ``kwargs``): prefix caching without passing the prompts twice."""
        self.prepare(input_ids, attention_mask, model=model)
        kwargs[_CACHE_KW] = self
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return model.generate(input_ids, **kwargs)


def _as_2d_int(a: Any, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().to("cpu").numpy()
    a = np.asarray(a)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.dtype.kind not in "iub":
        raise InvalidTypeError(
            f"{name} must be a 2-D integer array/tensor, got {a.dtype} {a.shape}"
        )
    return a.astype(np.int64)


def _padding_salt(mask: Optional[np.ndarray]) -> Optional[str]:
    """Prefix-cache salt of one row (see the module docstring): None when unpadded."""
    if mask is None:
        return None
    m = mask != 0
    if m.all():
        return None
    npad = int(np.argmax(m)) if m.any() else m.size
    if m[npad:].all():
        return f"kvblocks-leftpad-{npad}"
    return (
        "kvblocks-mask-"
        + hashlib.sha256(np.packbits(m).tobytes() + str(m.size).encode()).hexdigest()
    )
