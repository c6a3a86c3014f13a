"""The step protocol of :class:`PagedKVCache`: layer 0 of a forward pass grows every row by the
new tokens (all or nothing, copy-on-write first) and fixes each group's block tables, write slots
and gather sources; every layer writes its K/V into those slots and reads its rows back; after the
last layer the tokens are declared computed, so only written K/V ever enter the prefix cache."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from ... import ops
from ...errors import (
    InvalidArgumentError,
    InvalidStateError,
    NotSupportedError,
    OutOfBlocksError,
)
from .config import PLACEHOLDER_TOKEN
from .rows import PagedRows


class StepProtocol(PagedRows):
    """One forward pass over the rows of a :class:`PagedKVCache` (``_update`` per layer)."""

    def _create_rows(self, key_states: torch.Tensor) -> None:
        """First forward of a cache nobody prepared: one sequence per row, token ids unknown.

        Rows are registered with placeholder ids and a unique salt (no prefix-cache hits). A row
        whose layer-0 keys equal the previous row's (``num_return_sequences`` / beam copies of
        one prompt) becomes a dedup candidate: it is written like any row, and if its K and V
        equal its representative's bit for bit in every layer, its blocks are released at the end
        of the pass and it forks the representative instead (:meth:`_dedupe`).
        """
        B, _, q, _ = key_states.shape
        tokens = np.full(q, PLACEHOLDER_TOKEN, dtype=np.int32)
        rows: List[int] = []
        candidates: Dict[int, int] = {}
        try:
            for r in range(B):
                seq = next(self._shared.ids)
                self.manager.add(seq, tokens, salt=f"kvblocks-anonymous-{seq}-{id(self._shared)}")
                rows.append(seq)
                if r:
                    rep = candidates.get(r - 1, r - 1)
                    if torch.equal(key_states[r], key_states[rep]):
                        candidates[r] = rep
        except BaseException:
            for seq in rows:
                self.manager.free(seq)
            raise
        self._rows = rows
        self._write_from = [0] * B
        self._candidates = candidates

    def _check_candidates(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keep only the dedup candidates whose K and V equal their representative's."""
        for r, rep in list(self._candidates.items()):
            if not (
                torch.equal(key_states[r], key_states[rep])
                and torch.equal(value_states[r], value_states[rep])
            ):
                del self._candidates[r]

    def _dedupe(self) -> None:
        """End of the first pass: candidates equal in every layer fork their representative."""
        candidates, self._candidates = self._candidates, {}
        for r, rep in candidates.items():
            self.manager.free(self._rows[r])
            self._rows[r] = self._fork(self._rows[rep])

    def _commit(self, appends: List[Tuple[int, np.ndarray]], want: int) -> None:
        """Append tokens to sequences, all or nothing: ``want`` (the exact count of blocks the
        appends take, copy-on-write included) is checked first, and if an append still fails
        the ones before it are rolled back."""
        mgr = self.manager
        if want > mgr.num_free_blocks:
            raise OutOfBlocksError(
                f"PagedKVCache: this forward pass needs {want} blocks, {mgr.num_free_blocks} free"
            )
        done: List[Tuple[int, int]] = []
        try:
            for seq, toks in appends:
                before = int(mgr.num_tokens(seq))
                mgr.append(seq, toks)
                done.append((seq, before))
        except BaseException:
            for seq, before in reversed(done):
                mgr.truncate(seq, before)
            raise
        finally:
            copies = mgr.take_copies()
            if len(copies):
                ops.copy_blocks(self._storage, copies)  # before any layer writes this step
                self._stats["copy_on_write_blocks"] += len(copies)

    def _begin_prompt_step(self, B: int, q: int) -> int:
        """Layer 0 of a forward pass that feeds prepared prompt tokens (checked by the hook).

        Each prompt's sequence commits the prompt tokens this pass computes (and placeholders for
        tokens past the prompt, e.g. speculative candidates); its ``num_return_sequences`` /
        beam copies are the same sequence until the prompt's last token is fed, then fork it.
        Returns the first position of the pass.
        """
        pr = self._prompt
        assert pr is not None
        checked, pr["checked"] = pr["checked"], None
        start = self._layer_len[0]
        if checked != (B, q, start):
            raise InvalidStateError(
                "a forward pass fed prepared prompts without going through the model given to "
                "prepare(model=...); call generate on that model (or cache.generate(model, ...))"
            )
        owners = pr["owners"]
        P, L = pr["ids"].shape
        if pr["k"] is None:  # first pass: generate repeated each prompt k times
            k = B // P
            pr["k"] = k
            self._rows = [seq for seq in owners for _ in range(k)]
            self._write_from = [h if j == 0 else L for h in pr["hits"] for j in range(k)]
        k = pr["k"]
        end = start + q
        if end > L and k > 1:
            raise NotSupportedError(
                "tokens past the prompt in the prompt's forward pass (speculative candidates) with "
                f"{k} copies of each prompt (num_return_sequences / num_beams)"
            )
        mgr = self.manager
        appends = []
        want = 0
        for p, seq in enumerate(owners):
            nt = int(mgr.num_tokens(seq))
            if nt < end:
                toks = pr["ids"][p, nt : min(end, L)]
                if end > max(nt, L):
                    toks = np.concatenate(
                        [toks, np.full(end - max(nt, L), PLACEHOLDER_TOKEN, dtype=np.int32)]
                    )
                appends.append((seq, toks))
                # a prompt's last block is never shared while it is being written
                want += int(mgr.blocks_needed(seq, len(toks)))
        self._commit(appends, want)
        if end >= L:  # the prompts are fed: copies become sequences sharing their blocks
            self._drop_hook()
            self._prompt = None
            if k > 1:
                rows = list(self._rows)
                try:
                    for r in range(len(rows)):
                        if r % k:
                            rows[r] = self._fork(rows[r])
                except BaseException:
                    for r in range(len(rows)):
                        if r % k and rows[r] != self._rows[r]:
                            mgr.free(rows[r])
                    raise
                self._rows = rows
        return start

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Layer 0 of a forward pass: grow every row by the new tokens, copy-on-write, slots."""
        self._check_usable()
        if self._step is not None:
            raise InvalidStateError("the previous forward pass stopped before its last layer")
        B, H, q, D = key_states.shape
        if tuple(value_states.shape) != tuple(key_states.shape):
            raise NotSupportedError(
                f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ in "
                "shape: PagedKVCache stores K and V of one head count and head size"
            )
        if (H, D) != (self.num_kv_heads, self.head_dim):
            raise InvalidArgumentError(
                f"key_states have {H} heads of size {D}; the config says "
                f"{self.num_kv_heads} x {self.head_dim}"
            )
        if self.kv is None:
            self._allocate(key_states.dtype)
        mgr = self.manager
        if self._prompt is not None:
            start = self._begin_prompt_step(B, q)
        elif not self._rows:
            if self._layer_len[0] != 0:  # pragma: no cover - defensive
                raise InvalidStateError("cache has a length but no rows")
            self._create_rows(key_states)  # commits the q tokens
            start = 0
        else:
            if B != len(self._rows):
                raise InvalidStateError(
                    f"the cache holds {len(self._rows)} rows but the model fed {B}; call "
                    "cache.prepare(...) or cache.reset() before a new generate call"
                )
            start = self._layer_len[0]
            if q == 1:
                mgr.append_batch(self._rows, np.full(B, PLACEHOLDER_TOKEN, dtype=np.int32))
                copies = mgr.take_copies()
                if len(copies):
                    ops.copy_blocks(self._storage, copies)
                    self._stats["copy_on_write_blocks"] += len(copies)
            else:
                toks = np.full(q, PLACEHOLDER_TOKEN, dtype=np.int32)
                # can_append counts copy-on-write exactly (a block shared by m rows of this
                # step takes m - 1 copies when nothing else holds it)
                need = sum(int(mgr.blocks_needed(s, q)) for s in self._rows)
                if not mgr.can_append(self._rows, q):
                    raise OutOfBlocksError(
                        f"PagedKVCache: {B} rows x {q} new tokens do not fit "
                        f"({mgr.num_free_blocks} blocks free, up to {need} needed)"
                    )
                # with window groups the appends are counted without what the window releases
                # (an upper bound): a failed append could not be rolled back past a release
                self._commit([(s, toks) for s in self._rows], need if self._windowed else 0)
        end = start + q
        # the step planned once for every group (checked, sized, releases applied); its write
        # slots come from the plan, and it is declared computed only after the last layer
        seqs = list(dict.fromkeys(self._rows))
        plan = mgr.plan_step(seqs, np.full(len(seqs), q, dtype=np.int64), commit=False)
        index = {seq: i for i, seq in enumerate(seqs)}
        rows = [index[seq] for seq in self._rows]
        tables = []
        slots = []
        src = []
        for g in range(max(len(self._plan.groups), 1)):
            t, sl, sr = self._step_tables(plan, rows, g, start, end)
            tables.append(t)
            slots.append(sl)
            src.append(sr)
        self._step = {
            "B": B,
            "q": q,
            "start": start,
            "end": end,
            "slots": slots,
            "tables": tables,
            "src": src,
            "plan": plan,
        }

    def _step_tables(
        self, plan: Any, rows: List[int], group: int, start: int, end: int
    ) -> Tuple[List[np.ndarray], np.ndarray, List[int]]:
        """One group's block tables, write slots (the plan's slot mapping; ``rows[r]``: row
        r's sequence in the plan) and gather sources for a pass over positions ``[start,
        end)``. A sliding-window group's layers read from the window of the first query on
        (``[start - W + 1, end)``): the blocks below are never read, released or not."""
        mgr = self.manager
        bs = self.block_size
        groups = self._plan.groups
        window = groups[group].window if groups else None
        first = 0 if window is None else max(start - window + 1, 0)
        tables = [mgr.block_table(seq, group=group) for seq in self._rows]
        q = end - start
        planned = plan.metadata(group).slot_mapping[: len(plan) * q].reshape(len(plan), q)
        pos = np.arange(start, end, dtype=np.int64)
        slots = planned[rows].astype(np.int64)
        for r, table in enumerate(tables):
            if not (table[first // bs : -(-end // bs)] > 0).all():
                raise InvalidStateError(  # the manager released what the window still reads
                    f"PagedKVCache: group {group} released positions in [{first}, {end})"
                )
            slots[r][pos < self._write_from[r]] = -1  # shared: written by its owner
        # rows with the same table read the same K/V: gather them once
        seen: Dict[bytes, int] = {}
        src = []
        for r, table in enumerate(tables):
            key = table[first // bs : -(-end // bs)].tobytes()
            src.append(seen.setdefault(key, r))
        return tables, slots.reshape(-1), src

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._update_layer(key_states, value_states, layer_idx)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _update_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        B, H, q, D = key_states.shape
        if layer_idx == 0 or self._step is None:
            if layer_idx != 0:
                raise InvalidStateError(f"a forward pass started at layer {layer_idx}, not 0")
            self._begin_step(key_states, value_states)
        step = self._step
        assert step is not None
        if (B, q) != (step["B"], step["q"]) or tuple(value_states.shape) != tuple(key_states.shape):
            raise InvalidStateError(
                f"layer {layer_idx} got {B} rows x {q} tokens, layer 0 had {step['B']} x {step['q']}"
            )
        kv = self._storage
        plan = self._plan
        g, slot = plan.layer_group[layer_idx], plan.layer_slot[layer_idx]
        k_new = self._to_storage(key_states.transpose(1, 2).reshape(B * q, H, D))
        v_new = self._to_storage(value_states.transpose(1, 2).reshape(B * q, H, D))
        ops.write_slots(kv, slot, k_new, v_new, step["slots"][g])
        end = step["end"]
        window = plan.windows[layer_idx]
        # a sliding-window layer returns positions [start - W + 1, end) (get_mask_sizes)
        first = 0 if window is None else max(step["start"] - window + 1, 0)
        lo, skip = divmod(first, self.block_size)
        keys: List[torch.Tensor] = []
        values: List[torch.Tensor] = []
        for r in range(B):
            s = step["src"][g][r]
            if s != r:
                keys.append(keys[s])
                values.append(values[s])
                continue
            k, v = ops.gather(kv, slot, step["tables"][g][r][lo:], end - lo * self.block_size)
            keys.append(self._from_storage(k[skip:]))
            values.append(self._from_storage(v[skip:]))
        out_dtype, out_device = key_states.dtype, key_states.device
        k_all = (
            torch.stack(keys).transpose(1, 2).to(device=out_device, dtype=out_dtype).contiguous()
        )
        v_all = (
            torch.stack(values).transpose(1, 2).to(device=out_device, dtype=out_dtype).contiguous()
        )
        self._layer_len[layer_idx] = end
        if self._candidates:
            self._check_candidates(key_states, value_states)
        if layer_idx == self.num_layers - 1:
            # every layer wrote this step's K/V: only now do full blocks enter the prefix
            # cache (a forward that fails half-way leaves nothing cached that was not written)
            step["plan"].commit()
            self._step = None
            if self._candidates:
                self._dedupe()
        return k_all, v_all


def _query_length(q: Any) -> int:
    return int(q) if isinstance(q, (int, np.integer)) else int(q.shape[0])
