"""Stage 2 of :mod:`kvblocks.integrations.transformers_cb`: a :class:`kvblocks.BlockManager` holds
every request's block table, and each step's index tensors come from one native call.

transformers 5.24 builds a step's ``write_index`` / ``read_index`` (one int64 cache row per query
and per context token) or, on the decode fast path, its block table in a Python loop over the
requests (``ContinuousBatchingIOs.prepare_batch_tensors`` calling the cache's
``extend_read_and_write_indices`` / ``fill_block_table``): tens of milliseconds per step for a
batch of long requests. Here the loop still runs for everything else (input ids, positions,
sequence lengths, masks), the two index calls are skipped, and
:meth:`kvblocks.BlockManager.plan_step` plans the step once for every group and each group's
:meth:`kvblocks.StepPlan.rows` writes its rows straight into transformers' own index
storage (numpy views of its CPU tensors, no copy; through one staged copy on a GPU).

The step, in the order transformers calls it:

1. scheduling (``can_store_request_tokens`` → :meth:`KVBlocksStepAllocator.allocate_cache_to_request`):
   ``reserve`` the slots the step will write: token ids are not needed to allocate;
2. batch preparation (:func:`prepare_batch_tensors`): commit the query's token ids that are known
   (``append`` / ``append_batch``), run the pending copy-on-write copies, plan the step once with
   ``plan_step`` (validated for every group, declared: its full blocks enter the prefix cache, hashed
   on their real token ids) and build each group's rows from the plan. A query token whose id is not known yet (asynchronous batching
   schedules a step before the last one's sampled ids are back: ``TMP_TOKEN_ID``) is a *draft*
   slot of that step and is committed with ``append(..., computed=True)`` at the next step, once
   the id has arrived, so prefix hashes always cover real ids.

Prefix hits: ``match_prefix_blocks`` probes (nothing pinned); ``acquire_prefix_blocks`` adds the
request with the matched prefix plus its next token (``add`` pins the hits atomically). Forks
share every block (``fork``), copies happen lazily on the first write into a shared partial
block. transformers' de-duplication of identical blocks computed in one step is not done: the
later block stays uncached (kvblocks keeps the first entry of a hash).

Several allocators (a model with sliding-window layers): each reads the block tables of its own
KV cache group (group ``i`` is allocator ``i``); allocator 0 makes every manager call for the
request (``reserve``, ``add``, ``fork``, ``free``: the manager moves all groups in lock step) and
the others answer transformers' per-allocator questions with nothing to add. A model with
sliding-window layers keeps its tables here in stage 1 too; transformers' loop then builds the
indices from them and the step is declared with ``schedule``.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from ... import BlockManager, RowIndices, StepPlan
from ...errors import InvalidStateError
from .allocator import KVBlocksAllocator
from .pool import TRASH_SEQ

try:  # the names of the supported transformers version (checked by transformers_cb)
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
    from transformers.generation.continuous_batching.requests import TMP_TOKEN_ID
except ImportError:  # pragma: no cover - depends on the environment
    ContinuousBatchingIOs = None  # type: ignore[assignment,misc]
    TMP_TOKEN_ID = -1

__all__ = ["KVBlocksStepAllocator", "prepare_batch_tensors"]


_WARMUP_SALT = b"transformers-cb warmup"  # warmup requests hash apart from every real prompt


class _Tables:
    """transformers' ``allocator.block_table`` (request id -> list of block ids), read from the
    kvblocks manager: transformers' own code reads table lengths and ids through it."""

    def __init__(self, alloc: "KVBlocksStepAllocator") -> None:
        self._alloc = alloc

    def _mgr(self) -> Optional[BlockManager]:
        return self._alloc.pool_mgr

    def __contains__(self, rid: object) -> bool:
        m = self._mgr()
        return m is not None and rid != TRASH_SEQ and rid in m

    def __getitem__(self, rid: str) -> List[int]:
        if rid not in self:
            raise KeyError(rid)
        m = self._mgr()
        assert m is not None
        return m.block_table(rid, group=self._alloc.index).tolist()

    def get(self, rid: str, default: Any = None) -> Any:
        return self[rid] if rid in self else default

    def keys(self) -> List[Any]:
        m = self._mgr()
        return [] if m is None else [s for s in m.seq_ids() if s != TRASH_SEQ]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def values(self) -> List[List[int]]:
        return [self[k] for k in self.keys()]

    def items(self) -> List[Tuple[Any, List[int]]]:
        return [(k, self[k]) for k in self.keys()]

    def __setitem__(self, rid: str, table: Any) -> None:
        raise InvalidStateError("transformers_cb: block tables are kvblocks'; not assignable")


class KVBlocksStepAllocator(KVBlocksAllocator):
    """The full-attention allocator of stage 2 (and of stage 1 beside sliding-window layers): one
    kvblocks sequence per request, this allocator's block tables in KV cache group ``index``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.block_table = _Tables(self)  # type: ignore[assignment]  # the manager's tables
        self._pending_prompt: Optional[List[int]] = None
        self._buffers: dict = {}  # scratch of the step: offsets, staged host copies
        self.steps = 0  # steps whose indices this allocator built from a plan
        self.step_context = 0  # context rows of the step being built (commit_step)

    @property
    def pool_mgr(self) -> Optional[BlockManager]:
        pool = getattr(self, "pool", None)
        return getattr(pool, "mgr", None)

    @property
    def mgr(self) -> BlockManager:
        m = self.pool_mgr
        assert m is not None, "the manager is built with the cache tensor"
        return m

    def _after_cache_tensor_init(self, non_trash_bytes, bytes_per_sector, cache_tensor, pool):
        pool.page_size = self.tokens_per_page  # the pool builds a BlockManager of this size
        pool.sharing = self.use_block_sharing  # allow_block_sharing=False: no prefix cache
        super()._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    def _caching(self) -> bool:
        return self.use_block_sharing and self.mgr.pool.enable_prefix_caching

    @property
    def native(self) -> bool:
        """Whether kvblocks builds the step's indices (stage 2) or transformers does (stage 1)."""
        return bool(self.pool.kb.native_step)  # type: ignore[attr-defined]

    def _lead(self) -> "KVBlocksStepAllocator":
        """Allocator 0, which makes the manager calls for every group."""
        for a in self.pool.allocators:  # type: ignore[attr-defined]
            if a.index == 0:
                return a
        raise InvalidStateError("transformers_cb: the cache has no allocator 0")

    # -- allocation ----------------------------------------------------------------------------
    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        """Blocks the request's step takes in every group, copy-on-write of a shared last block
        included (allocator 0 counts them all; the others answer 0)."""
        if self.index:
            return 0
        m, end = self.mgr, past_length + query_length
        if request_id not in m:  # nothing computed yet: every group holds all its blocks
            return len(m.groups) * -(-end // self.tokens_per_page)
        return m.blocks_needed(request_id, max(0, end - m.num_tokens(request_id)))

    def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int):
        """Reserve the slots the step writes (ids are committed when the batch is built)."""
        if self.index:
            return
        m = self.mgr
        if request_id not in m:
            salt = _WARMUP_SALT if request_id.startswith("__warmup_") else None
            m.add(request_id, [], salt=salt)
        n = past_length + query_length - m.num_tokens(request_id)
        if n > 0:
            m.reserve(request_id, n)
        self.pool.note_usage()  # type: ignore[attr-defined]

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        m = self.pool_mgr
        if m is not None and request_id != TRASH_SEQ and request_id in m:
            m.free(request_id)

    def count_non_shareable_blocks(self, source_request_id: str, past_length: int) -> int:
        """Blocks a fork may need, over every group (allocator 0 counts them, the others 0)."""
        if self.index:
            return 0
        m, full = self.mgr, past_length // self.tokens_per_page
        return sum(
            max(0, len(m.block_table(source_request_id, group=g)) - full)
            for g in range(len(m.groups))
        )

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int):
        """The child shares every block; the first write into a shared partial block copies it
        (drained when the step is built), so there is nothing to copy now."""
        if not self.index:
            self.mgr.fork(source_request_id, dest_request_id)
        return [], []

    # -- prefix cache --------------------------------------------------------------------------
    def match_prefix_blocks(self, prompt_ids: List[int]) -> List[int]:
        """How much of the prompt is cached (nothing pinned yet): the hit is taken only if adding
        the prefix and its next token fits now, so acquiring it cannot fail."""
        if not self._caching() or len(prompt_ids) < 2:
            return []
        if self.index:  # allocator 0 probed every group just before
            pending = self._lead()._pending_prompt
            return (
                [] if pending is None else list(range((len(pending) - 1) // self.tokens_per_page))
            )
        self._pending_prompt = None
        m = self.mgr
        cached, _ = m.probe(prompt_ids)
        if cached == 0:
            return []
        _, need = m.probe(prompt_ids[: cached + 1])
        if need > m.num_free_blocks:
            return []
        self._pending_prompt = list(prompt_ids[: cached + 1])
        return list(range(cached // self.tokens_per_page))  # transformers only counts them

    def acquire_prefix_blocks(self, request_id: str, prefix_len: int, block_ids: List[int]):
        if self.index:  # allocator 0 (called first) added the request to every group
            if request_id not in self.mgr:
                raise InvalidStateError(f"prefix hit for request {request_id!r} not acquired")
            return
        prompt, self._pending_prompt = self._pending_prompt, None
        m = self.mgr
        if prompt is None or request_id in m or prefix_len != len(prompt) - 1:
            raise InvalidStateError(
                f"prefix hit for request {request_id!r} does not match the prompt just probed"
            )
        cached = m.add(request_id, prompt)
        if cached != prefix_len:  # the pool changed between probe and add: impossible here
            m.free(request_id)
            raise InvalidStateError(f"prefix hit for {request_id!r}: {cached} != {prefix_len}")
        self.hit_tokens += cached

    def mark_complete_blocks(self, request_id, token_ids, new_new_blocks) -> None:
        """Nothing to do: ``plan_step`` registered the step's full blocks."""

    # -- the step ------------------------------------------------------------------------------
    def commit_step(self, requests_in_batch: List[Any]) -> Tuple[List[str], np.ndarray, np.ndarray]:
        """Commit the query ids that are known, before transformers' loop moves the positions
        on; returns the batch's ids, committed query lengths and draft lengths."""
        m = self.mgr
        n = len(requests_in_batch)
        context = 0  # rows of the step's context, drafts included (sum of past + query lengths)
        ids: List[str] = []
        q = np.empty(n, dtype=np.int32)
        d = np.zeros(n, dtype=np.int32)
        one_ids: List[str] = []
        one_toks: List[int] = []
        for i, fs in enumerate(requests_in_batch):
            state = fs.state
            rid, past, ql = state.request_id, state.position_offset, fs.query_length
            ids.append(rid)
            context += past + ql
            ntok = m.num_tokens(rid)
            if ntok < past:
                self._catch_up(state, ntok, past)
                ntok = past
            toks = state.tokens_to_process
            if ql and toks[-1] == TMP_TOKEN_ID:  # ids sampled by a step not back yet: drafts
                q[i], d[i] = 0, ql
                continue
            q[i] = ql
            new = toks[ntok - past :] if ntok > past else toks
            if len(new) == 1 and ntok == past:
                one_ids.append(rid)
                one_toks.append(new[0])
            elif new:
                m.append(rid, new)
        if one_ids:
            m.append_batch(one_ids, one_toks)
        if m.num_pending_copies:
            pairs = m.take_copies()
            self.copy_blocks(pairs[:, 0].tolist(), pairs[:, 1].tolist())
        self.step_context = context
        self.pool.note_usage()  # type: ignore[attr-defined]
        return ids, q, d

    def _catch_up(self, state: Any, ntok: int, past: int) -> None:
        """Positions before the query that kvblocks has not committed: draft slots of an earlier
        step whose ids have arrived since (asynchronous batching), or warmup's made-up past."""
        m, rid, k = self.mgr, state.request_id, past - ntok
        if rid.startswith("__warmup_"):
            m.append(rid, [0] * k)
            m.schedule([rid], [k])
            return
        known = list(state.initial_tokens) + list(state.generated_tokens)
        if len(known) < past:
            raise InvalidStateError(
                f"transformers_cb: request {rid!r} has {past - ntok} positions whose token ids "
                f"are not known yet (more than one step in flight)"
            )
        m.append(rid, known[ntok:past], computed=True)

    def build_indices(self, io: Any, step: StepPlan, context: int = 0) -> None:
        """Write this group's rows of the planned step (or its decode block table) into
        transformers' index storage. ``context``: the step's context rows (for a window
        group's scratch)."""
        B = len(step)
        ro, wo = self._scratch("ro", (B + 1,), np.int32), self._scratch("wo", (B + 1,), np.int32)
        stride = self.block_physical_stride
        if io.use_block_table:
            bt_t = io.block_table[self.index]
            bt, stage = self._host(bt_t, "bt")
            step.rows(self.index, stride=stride, out=RowIndices(None, None, ro, wo, bt[:B]))
            if stage:
                bt_t[:B].copy_(stage[:B])
        else:
            w_t = io.write_index_storage[self.index]
            w, w_stage = self._host(w_t, "w")
            r_t = io.read_index_storage[self.index] if io.max_kv_read > 0 else None
            r, r_stage = self._host(r_t, "r") if r_t is not None else (None, None)
            rows = step.rows(self.index, stride=stride, out=RowIndices(r, w, ro, wo))
            io.true_write_sizes[self.index] = rows.num_write
            if r_t is not None:
                io.true_read_sizes[self.index] = rows.num_read
            if w_stage is not None:
                w_t[: rows.num_write].copy_(w_stage[: rows.num_write])
            if r_stage is not None and r_t is not None:
                r_t[: rows.num_read].copy_(r_stage[: rows.num_read])
        self.steps += 1

    def _scratch(self, name: str, shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < shape[0]:
            buf = self._buffers[name] = np.empty((max(shape[0], 64),) + shape[1:], dtype=dtype)
        return buf[: shape[0]]

    def _host(self, tensor: Any, name: str) -> Tuple[np.ndarray, Any]:
        """A numpy view of a CPU tensor (no copy), or of a host staging tensor for a device one
        (then returned too, to be copied to the device after the rows are written)."""
        if tensor.device.type == "cpu":
            return tensor.numpy(), None
        import torch

        stage = self._buffers.get("stage_" + name)
        if stage is None or stage.shape != tensor.shape:
            stage = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers["stage_" + name] = stage
        return stage.numpy(), stage


_ORIGINAL_PREPARE: Any = (
    ContinuousBatchingIOs.prepare_batch_tensors if ContinuousBatchingIOs is not None else None
)


KVBlocksAllocator.grouped = KVBlocksStepAllocator  # what a model with several kinds builds


def _step_allocators(cache: Any) -> Optional[List[KVBlocksStepAllocator]]:
    """The cache's allocators in index order when kvblocks' manager holds their tables."""
    allocs = sorted(getattr(cache, "cache_allocators", {}).values(), key=lambda a: a.index)
    if allocs and all(isinstance(a, KVBlocksStepAllocator) for a in allocs):
        return allocs
    return None


def _skip(*args: Any, **kwargs: Any) -> None:
    """Stands in for the cache's per-request index calls while kvblocks builds the indices."""


def prepare_batch_tensors(self: Any, requests_in_batch: List[Any], *args: Any, **kwargs: Any):
    """``ContinuousBatchingIOs.prepare_batch_tensors`` with the indices built by kvblocks.

    For a cache whose allocators are :class:`KVBlocksStepAllocator`, the known ids are committed,
    transformers' loop runs without its index calls, and one ``plan_step`` fills the index storage
    of each allocator from its group. In stage 1 (a model with sliding-window layers built with
    ``native_step=False``) transformers' loop builds the indices from kvblocks' tables and the
    step is declared with ``schedule``. Any other cache gets transformers' method unchanged. The
    first call binds this function to the IO object, so a persistent manager keeps it after
    ``enabled()`` restored the class.
    """
    allocs = _step_allocators(self.cache)
    if allocs is None or not requests_in_batch:
        return _ORIGINAL_PREPARE(self, requests_in_batch, *args, **kwargs)
    if "prepare_batch_tensors" not in self.__dict__:
        self.prepare_batch_tensors = prepare_batch_tensors.__get__(self)
    lead = allocs[0]
    ids, q, d = lead.commit_step(requests_in_batch)
    if not lead.native:
        _ORIGINAL_PREPARE(self, requests_in_batch, *args, **kwargs)
        lead.mgr.schedule(ids, q, draft_lens=d if d.any() else None)
        return
    cache = self.cache
    cache.extend_read_and_write_indices = _skip
    cache.fill_block_table = _skip
    try:
        _ORIGINAL_PREPARE(self, requests_in_batch, *args, **kwargs)
    finally:
        del cache.extend_read_and_write_indices, cache.fill_block_table
    # one plan for every group: validated, released and declared once; each group's allocator
    # writes its rows from it
    step = lead.mgr.plan_step(ids, q, draft_lens=d if d.any() else None)
    for alloc in allocs:
        alloc.build_indices(self, step, lead.step_context)
