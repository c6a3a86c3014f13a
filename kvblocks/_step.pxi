# A forward step planned once (BlockManager.plan_step; included in _core.pyx before the
# manager, which builds and writes it: csrc/step.c).

from collections import namedtuple

#: A group's share of a planned step: the buffer sizes its metadata and rows take.
StepSize = namedtuple("StepSize", "tokens blocks max_blocks context")
StepSize.__doc__ = """Sizes of one KV cache group's part of a planned step.

``tokens``: query slots (``slot_mapping`` / ``write_index`` entries: query tokens plus draft
slots); ``blocks``: table entries of every context (``kv_indices``); ``max_blocks``: the
longest table (``block_tables`` columns); ``context``: context positions (``read_index``
entries)."""


cdef class StepPlan:
    """One forward step of a BlockManager, validated, released and declared once for every
    KV cache group by ``BlockManager.plan_step``; its writers build each group's attention
    metadata and row indices from it without validating again.

    A plan stays valid until the manager next changes (``add``, ``append_batch``, ``free``,
    ``plan_step``, ...): a writer of a stale plan raises InvalidStateError, since the tables
    it would write are no longer the step's. Read-only calls (``probe``, ``check``,
    ``take_events``, ...) leave it valid.

    >>> import numpy as np
    >>> from kvblocks import BlockManager, KVGroup
    >>> mgr = BlockManager(64, 4, groups=(KVGroup("full"), KVGroup("sliding_window", window=8)))
    >>> mgr.add("a", np.arange(10, dtype=np.int32))
    0
    >>> step = mgr.plan_step(["a"], [10])
    >>> step.size(0)
    StepSize(tokens=10, blocks=3, max_blocks=3, context=10)
    >>> step.metadata(0).block_tables.tolist(), step.metadata(1).block_tables.tolist()
    ([[1, 2, 3]], [[4, 5, 6]])
    >>> mgr.num_computed("a")
    10
    """
    cdef readonly object manager
    cdef readonly object seq_ids
    cdef readonly bint committed
    cdef cnp.ndarray _slots
    cdef cnp.ndarray _q
    cdef cnp.ndarray _d
    cdef Py_ssize_t _B
    cdef uint64_t _epoch
    cdef kvb_step_size_t *_zs  # [_ng] each group's sizes (owned)
    cdef int32_t _ng

    def __init__(self):
        raise TypeError("StepPlan is made by BlockManager.plan_step")

    def __dealloc__(self):
        free(self._zs)

    cdef BlockManager _owner(self):
        """The manager; a plan not made by plan_step (StepPlan.__new__) has none."""
        if self.manager is None:
            raise InvalidStateError("this StepPlan was not made by BlockManager.plan_step")
        return <BlockManager>self.manager

    def __len__(self):
        return self._B

    def size(self, group=0):
        """The StepSize of group ``group``'s part of the step."""
        cdef int32_t g = self._owner()._group(group)
        return StepSize(self._zs[g].tokens, self._zs[g].blocks, self._zs[g].max_blocks,
                        self._zs[g].context)

    @property
    def stale(self):
        """True once the manager changed after this plan: its writers would raise."""
        return self._epoch != self._owner()._epoch

    def commit(self):
        """Declare a step planned with ``commit=False``, once its forward wrote the K/V:
        every committed token counts as computed, newly full blocks enter the prefix cache.
        The writers stay valid. Raises InvalidStateError when committed already or stale."""
        self._owner()._step_commit(self)

    def metadata(self, group=0, *, out=None):
        """Group ``group``'s attention metadata of the step (``BlockManager.metadata``'s
        result), into ``out`` (an AttentionMetadata from ``AttentionMetadata.allocate``) or
        fresh arrays of the step's size. Writes only (the step is declared by plan_step or
        commit)."""
        return self._owner()._step_metadata(self, group, out)

    def rows(self, group=0, *, stride, offset=0, bint block_tables=False, max_blocks=None,
             out=None):
        """Group ``group``'s per-token cache rows of the step (``BlockManager.row_indices``'
        result, same arguments). Writes only."""
        return self._owner()._step_rows(self, group, stride, offset, block_tables,
                                        max_blocks, out)

    def __repr__(self):
        return f"StepPlan({self._B} sequences, {self._ng} group(s))"
