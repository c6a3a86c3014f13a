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
        cdef int32_t g = group_of(self._owner(), group)
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
        step_commit(self._owner(), self)

    def metadata(self, group=0, *, out=None):
        """Group ``group``'s attention metadata of the step (``BlockManager.metadata``'s
        result), into ``out`` (an AttentionMetadata from ``AttentionMetadata.allocate``) or
        fresh arrays of the step's size. Writes only (the step is declared by plan_step or
        commit)."""
        return step_metadata(self._owner(), self, group, out)

    def rows(self, group=0, *, stride, offset=0, bint block_tables=False, max_blocks=None,
             out=None):
        """Group ``group``'s per-token cache rows of the step (``BlockManager.row_indices``'
        result, same arguments). Writes only."""
        return step_rows(self._owner(), self, group, stride, offset, block_tables, max_blocks,
                         out)

    def __repr__(self):
        return f"StepPlan({self._B} sequences, {self._ng} group(s))"


cdef StepPlan plan_step(BlockManager mgr, object seq_ids, object query_lens, object draft_lens,
                        bint commit):
    """BlockManager.plan_step: the step checked and sized for every group, released, and
    declared unless ``commit`` is False; the plan owns copies of its arrays and sizes."""
    cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
    cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
        else None
    ids = ids_of(seq_ids)
    cdef Py_ssize_t B
    cdef StepPlan plan = StepPlan.__new__(StepPlan)
    mgr._enter()
    try:
        slots = slots_of(mgr, ids, &B)
        check_step(mgr, slots, q_arr, d_arr, B, "plan_step", -1)
        plan._slots = _i32_copy(slots, B)
        plan._q = _i32_copy(q_arr, B)
        plan._d = _i32_copy(d_arr, B) if d_arr is not None else None
        plan._zs = <kvb_step_size_t *>malloc(mgr.ng * sizeof(kvb_step_size_t))
        if plan._zs is NULL:  # (before anything changes: all or nothing)
            raise MemoryError()
        memcpy(plan._zs, mgr._zs, mgr.ng * sizeof(kvb_step_size_t))
        plan._ng = mgr.ng
        sl, q = i32_data(plan._slots), i32_data(plan._q)
        d = i32_data(plan._d) if plan._d is not None else NULL
        kvb_step_release(mgr.gp, mgr.ng, sl, q, B)
        if commit:
            kvb_step_commit(mgr.gp, mgr.ng, sl, q, d, B)
        plan.committed = commit
        plan.manager = mgr
        plan.seq_ids = ids if type(ids) is SeqBatch else tuple(ids)
        plan._B = B
        plan._epoch = mgr._epoch
        return plan
    finally:
        mgr._leave()


cdef cnp.ndarray _i32_copy(cnp.ndarray a, Py_ssize_t n):
    """An owned int32 copy of a's first n entries."""
    cdef cnp.ndarray out = new_i32(n)
    if n:
        memcpy(cnp.PyArray_DATA(out), cnp.PyArray_DATA(a), n * sizeof(int32_t))
    return out


cdef object step_commit(BlockManager mgr, StepPlan plan):
    if plan.committed:
        raise InvalidStateError("StepPlan.commit: the step was committed already")
    step_enter(mgr, plan, 0, "commit")
    try:
        kvb_step_commit(mgr.gp, mgr.ng, i32_data(plan._slots), i32_data(plan._q),
                        i32_data(plan._d) if plan._d is not None else NULL, plan._B)
        plan.committed = True
        mgr._epoch += 1  # declared: the computed counts changed, the tables did not
        plan._epoch = mgr._epoch
    finally:
        mgr._leave()


cdef int step_enter(BlockManager mgr, StepPlan plan, int32_t g, str what) except -1:
    """Enter a writer of ``plan`` (no table changes): refuse a stale plan; the group's sizes
    become the checked step's."""
    mgr._enter(False)
    if plan.manager is not mgr or plan._epoch != mgr._epoch:
        mgr._leave()
        raise InvalidStateError(f"StepPlan.{what}: the manager changed since plan_step "
                                f"(plan the step again)")
    mgr._zs[g] = plan._zs[g]
    return 0


cdef object step_metadata(BlockManager mgr, StepPlan plan, object group, object out):
    cdef int32_t g = group_of(mgr, group)
    if out is not None:
        if not isinstance(out, AttentionMetadata):
            raise InvalidTypeError(f"StepPlan.metadata: out must be an AttentionMetadata "
                                   f"(from AttentionMetadata.allocate), got "
                                   f"{type(out).__name__}")
        out = out.buffers
    step_enter(mgr, plan, g, "metadata")
    cdef int32_t *d = i32_data(plan._d) if plan._d is not None else NULL
    try:
        return fill_meta(mgr, out, i32_data(plan._slots), i32_data(plan._q), d, plan._B, g,
                         False)
    finally:
        mgr._leave()


cdef object step_rows(BlockManager mgr, StepPlan plan, object group, object stride,
                      object offset, bint block_tables, object max_blocks, object out):
    cdef int32_t g = group_of(mgr, group)
    cdef RowsGeom ra
    rows_args(mgr, g, "StepPlan.rows", stride, offset, block_tables, max_blocks, out, &ra)
    step_enter(mgr, plan, g, "rows")
    cdef int32_t *d = i32_data(plan._d) if plan._d is not None else NULL
    try:
        return fill_rows(mgr, out, &ra, i32_data(plan._slots), i32_data(plan._q), d, plan._B,
                         g, False)
    finally:
        mgr._leave()


cdef int64_t step_need(BlockManager mgr, object seq_ids, object num_new_tokens,
                       object draft_lens, object forks) except? -1:
    """blocks_needed_batch without the watermark: the counts converted, then one C call."""
    ids = ids_of(seq_ids)
    scalar = np.ndim(num_new_tokens) == 0  # one count for every sequence (ints only)
    n_one = as_int(num_new_tokens, "num_new_tokens", 0, INT32_MAX) if scalar else 0
    arrays = []
    if not scalar:
        arrays.append(("num_new_tokens", as_int32(num_new_tokens, "num_new_tokens")))
    if draft_lens is not None:
        arrays.append(("draft_lens", as_int32(draft_lens, "draft_lens")))
    if forks is not None:
        arrays.append(("forks", as_int32(forks, "forks")))
    for name, arr in arrays:
        if len(arr) and arr.min() < 0:
            raise InvalidArgumentError(f"blocks_needed_batch: {name} must be >= 0")
    cdef int64_t need = 0
    cdef Py_ssize_t count
    cdef cnp.ndarray ns, cn, fk = None
    mgr._enter(False)
    try:
        slots = slots_of(mgr, ids, &count)
        for name, arr in arrays:
            if len(arr) != count:
                raise InvalidArgumentError(f"blocks_needed_batch: {count} sequences but "
                                           f"{len(arr)} {name}")
        cn = np.full(count, n_one, dtype=np.int64)
        for name, arr in arrays:
            if name == "num_new_tokens":
                cn += arr
        ns = cn.copy()
        for name, arr in arrays:
            if name == "forks":
                fk = np.ascontiguousarray(arr, dtype=np.int64)
            elif name == "draft_lens":
                ns += arr
        rc = kvb_grp_step_need(mgr.gp, mgr.ng, i32_data(slots),
                               <int64_t *>cnp.PyArray_DATA(ns), <int64_t *>cnp.PyArray_DATA(cn),
                               <int64_t *>cnp.PyArray_DATA(fk) if fk is not None else NULL,
                               count, &need)
        if rc:
            raise_mgr(mgr, rc, "blocks_needed_batch")
    finally:
        mgr._leave()
    return need
