# A step's check and its writers (included by _core.pyx): the v1 step calls of BlockManager
# (schedule, metadata, row_indices) and what they share with StepPlan's writers: the step
# checked and sized once in C (kvb_step_check_for), the caller's buffers checked against the
# sizes (kvb_meta_fits, kvb_rows_fits), the tables written (csrc/meta.c, csrc/rows.c).


cdef int check_step(BlockManager mgr, cnp.ndarray slots, cnp.ndarray q, object d,
                    Py_ssize_t B, str what, int32_t group) except -1:
    """Validate a step for one group (group >= 0) or all (-1), once, and size it
    (mgr._zs[group], or every group's); copies pending in any group refuse it."""
    if cnp.PyArray_DIM(q, 0) != B:
        raise InvalidArgumentError(f"{what}: {B} sequences but {cnp.PyArray_DIM(q, 0)} "
                                   f"query_lens")
    if d is not None and cnp.PyArray_DIM(<cnp.ndarray>d, 0) != B:
        raise InvalidArgumentError(f"{what}: {B} sequences but "
                                   f"{cnp.PyArray_DIM(<cnp.ndarray>d, 0)} draft_lens")
    cdef int32_t *dp = i32_data(<cnp.ndarray>d) if d is not None else NULL
    rc = kvb_step_check_for(mgr.gp, mgr.ng, group, i32_data(slots), i32_data(q), dp, B,
                            mgr._zs)
    if rc:
        raise_mgr(mgr, rc, what, 0, <int32_t *>cnp.PyArray_DATA(slots))
    return 0


cdef object schedule(BlockManager mgr, object seq_ids, object query_lens, object draft_lens):
    cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
    cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
        else None
    ids = ids_of(seq_ids)
    cdef Py_ssize_t B
    mgr._enter()
    try:
        slots = slots_of(mgr, ids, &B)
        check_step(mgr, slots, q_arr, d_arr, B, "schedule", -1)
        kvb_grp_schedule(mgr.gp, mgr.ng, i32_data(slots), i32_data(q_arr),
                         i32_data(d_arr) if d_arr is not None else NULL, B, 1)
    finally:
        mgr._leave()


cdef object metadata(BlockManager mgr, object seq_ids, object query_lens, object draft_lens,
                     object out, object group):
    cdef int32_t g = group_of(mgr, group)
    cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
    cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
        else None
    if out is not None:
        if not isinstance(out, AttentionMetadata):
            raise InvalidTypeError(f"metadata: out must be an AttentionMetadata (from "
                                   f"AttentionMetadata.allocate), got {type(out).__name__}")
        out = out.buffers  # a returned view: fill the buffers it came from
    ids = ids_of(seq_ids)
    cdef Py_ssize_t B
    cdef int32_t *sl
    cdef int32_t *q = i32_data(q_arr)
    cdef int32_t *d = i32_data(d_arr) if d_arr is not None else NULL
    mgr._enter()
    try:
        slots = slots_of(mgr, ids, &B)
        check_step(mgr, slots, q_arr, d_arr, B, "metadata", g)  # sizes: mgr._zs[g]
        sl = i32_data(slots)
        meta = fill_meta(mgr, out, sl, q, d, B, g, True)
        kvb_grp_schedule_one(mgr.gp, g, sl, q, d, B)
        return meta
    finally:
        mgr._leave()


cdef object fill_meta(BlockManager mgr, object out, int32_t *slots, int32_t *q, int32_t *d,
                      Py_ssize_t B, int32_t g, bint release):
    """Validate the buffers of ``out`` (None: fresh buffers of the exact size) against the
    checked step's size (mgr._zs[g]), apply the group's release (``release``: a v1 call; a
    StepPlan released already), write the metadata into them and return an
    AttentionMetadata of views over the used part."""
    cdef kvb_step_size_t *z = &mgr._zs[g]
    if out is None:  # fresh buffers of the exact size (Python code runs, guarded)
        out = AttentionMetadata.allocate(max(B, 1), z.tokens, max(z.blocks, 1),
                                         max(z.max_blocks, 1))
    cdef kvb_meta_t meta
    memset(&meta, 0, sizeof(meta))
    sm, bt, sl = out.slot_mapping, out.block_tables, out.seq_lens
    qo, kvp, kvi, last = out.qo_indptr, out.kv_indptr, out.kv_indices, out.kv_last_page_len
    meta.slot_mapping = <int64_t *>buf_ptr(sm, cnp.NPY_INT64, 1, 0, "slot_mapping")
    meta.seq_lens = <int32_t *>buf_ptr(sl, cnp.NPY_INT32, 1, B, "seq_lens")
    meta.qo_indptr = <int32_t *>buf_ptr(qo, cnp.NPY_INT32, 1, B + 1, "qo_indptr")
    meta.kv_indptr = <int32_t *>buf_ptr(kvp, cnp.NPY_INT32, 1, B + 1, "kv_indptr")
    if kvi is not None:  # None: no FlashInfer page list (block_tables engines)
        meta.kv_indices = <int32_t *>buf_ptr(kvi, cnp.NPY_INT32, 1, 0, "kv_indices")
        meta.cap_indices = cnp.PyArray_DIM(<cnp.ndarray>kvi, 0)
    meta.kv_last_page_len = <int32_t *>buf_ptr(last, cnp.NPY_INT32, 1, B, "kv_last_page_len")
    meta.cap_tokens = cnp.PyArray_DIM(<cnp.ndarray>sm, 0)
    if bt is not None:
        meta.block_tables = <int32_t *>buf_ptr(bt, cnp.NPY_INT32, 2, B, "block_tables")
        meta.max_blocks = <int32_t>cnp.PyArray_DIM(<cnp.ndarray>bt, 1)
    rows, valid = out.row_cache(mgr._gowners[g])
    if rows is not None:
        if not (cnp.PyArray_Check(rows) and cnp.PyArray_TYPE(<cnp.ndarray>rows) ==
                cnp.NPY_INT64 and cnp.PyArray_ISCARRAY(<cnp.ndarray>rows)):
            raise InvalidTypeError("metadata: out has a corrupted row cache")
        meta.row_cache = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>rows)
        meta.cap_rows = cnp.PyArray_DIM(<cnp.ndarray>rows, 0) // 4
        # first use, or another manager's buffers: start afresh
        meta.valid_rows = valid
    rc = kvb_meta_fits(mgr.gp[g], z, &meta)
    if rc:
        raise_mgr(mgr, rc, "metadata", g)
    if release:
        kvb_step_release(&mgr.gp[g], 1, slots, q, B)  # before the tables are written
    kvb_meta_write(mgr.gp[g], slots, q, d, B, &meta)
    if rows is not None:
        out.remember_rows(mgr._gowners[g], meta.valid_rows)
    cdef Py_ssize_t nt = meta.n_tokens, ni = meta.n_indices
    res = AttentionMetadata(sm[:nt], bt[:B] if bt is not None else None, sl[:B],
                            qo[:B + 1], kvp[:B + 1], kvi[:ni] if kvi is not None else None,
                            last[:B], nt, B)
    return res.view_of(out)


cdef struct RowsGeom:  # row_indices' geometry arguments, converted
    int64_t stride, offset, width
    bint block_tables


cdef int rows_args(BlockManager mgr, int32_t g, str what, object stride, object offset,
                   bint block_tables, object max_blocks, object out, RowsGeom *r) except -1:
    """Convert and check row_indices' (or StepPlan.rows') arguments into *r."""
    if kvb_grp_kind(mgr.gp, g) == KVB_G_STATE:
        raise InvalidArgumentError(f"{what}: group {g} is a state group, which has no "
                                   f"per-token rows")
    r.stride = as_int(stride, "stride", 1, INT64_MAX)
    r.offset = as_int(offset, "offset", 0, INT64_MAX)
    r.width = -1
    if max_blocks is not None:
        r.width = as_int(max_blocks, "max_blocks", 0, INT32_MAX)
    r.block_tables = block_tables
    if out is not None and not isinstance(out, RowIndices):
        raise InvalidTypeError(f"{what}: out must be a RowIndices, got {type(out).__name__}")
    return 0


cdef object row_indices(BlockManager mgr, object seq_ids, object query_lens, object stride,
                        object offset, object draft_lens, bint block_tables,
                        object max_blocks, object out, object group):
    cdef int32_t g = group_of(mgr, group)
    cdef RowsGeom ra
    rows_args(mgr, g, "row_indices", stride, offset, block_tables, max_blocks, out, &ra)
    cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
    cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
        else None
    ids = ids_of(seq_ids)
    cdef Py_ssize_t B
    cdef int32_t *sl
    cdef int32_t *q = i32_data(q_arr)
    cdef int32_t *d = i32_data(d_arr) if d_arr is not None else NULL
    mgr._enter()
    try:
        slots = slots_of(mgr, ids, &B)
        check_step(mgr, slots, q_arr, d_arr, B, "row_indices", g)  # sizes: mgr._zs[g]
        sl = i32_data(slots)
        res = fill_rows(mgr, out, &ra, sl, q, d, B, g, True)
        kvb_grp_schedule_one(mgr.gp, g, sl, q, d, B)
        return res
    finally:
        mgr._leave()


cdef object fill_rows(BlockManager mgr, object out, RowsGeom *ra, int32_t *slots, int32_t *q,
                      int32_t *d, Py_ssize_t B, int32_t g, bint release):
    """row_indices' writer: fresh buffers of the checked step's size (mgr._zs[g]) when
    ``out`` is None, the geometry and capacity checked, the group's release applied
    (``release``: a v1 call), the rows written; a RowIndices of views returned."""
    cdef kvb_rows_t r
    memset(&r, 0, sizeof(r))
    r.stride = ra.stride
    r.offset = ra.offset
    cdef kvb_step_size_t *z = &mgr._zs[g]
    if out is None:  # exact sizes (Python code runs, guarded)
        out = RowIndices(np.empty(z.context, dtype=np.int64),
                         np.empty(z.tokens, dtype=np.int64),
                         new_i32(B + 1), new_i32(B + 1),
                         np.empty((B, ra.width if ra.width >= 0 else z.max_blocks),
                                  dtype=np.int32)
                         if ra.block_tables else None)
    ri, wi, ro, wo, bt = (out.read_index, out.write_index, out.read_offsets,
                          out.write_offsets, out.block_tables)
    r.read_offsets = <int32_t *>_rows_buf(ro, cnp.NPY_INT32, 1, B + 1, "read_offsets")
    r.write_offsets = <int32_t *>_rows_buf(wo, cnp.NPY_INT32, 1, B + 1, "write_offsets")
    if ri is not None:
        r.read_index = <int64_t *>_rows_buf(ri, cnp.NPY_INT64, 1, 0, "read_index")
        r.cap_read = cnp.PyArray_DIM(<cnp.ndarray>ri, 0)
    if wi is not None:
        r.write_index = <int64_t *>_rows_buf(wi, cnp.NPY_INT64, 1, 0, "write_index")
        r.cap_write = cnp.PyArray_DIM(<cnp.ndarray>wi, 0)
    if bt is not None:
        r.block_tables = <int32_t *>_rows_buf(bt, cnp.NPY_INT32, 2, B, "block_tables")
        r.max_blocks = <int32_t>cnp.PyArray_DIM(<cnp.ndarray>bt, 1)
    rc = kvb_rows_fits(mgr.gp[g], z, &r)
    if rc:
        raise_mgr(mgr, rc, "row_indices", g, NULL, (
            f"stride={ra.stride}, offset={ra.offset}, "
            f"block_size={kvb_grp_block_size(mgr.gp)}"))
    if release:
        kvb_step_release(&mgr.gp[g], 1, slots, q, B)  # before the rows are written
    kvb_rows_write(mgr.gp[g], slots, q, d, B, &r)
    return RowIndices(ri[:r.n_read] if ri is not None else None,
                      wi[:r.n_write] if wi is not None else None,
                      ro[:B + 1], wo[:B + 1],
                      bt[:B] if bt is not None else None, r.n_read, r.n_write, B)


cdef void *_rows_buf(object arr, int typenum, int ndim, Py_ssize_t rows,
                     str name) except NULL:
    """Data pointer of a writable C-contiguous buffer of row_indices' ``out``."""
    if not cnp.PyArray_Check(arr):
        raise InvalidTypeError(f"row_indices: out.{name} must be a numpy array, got "
                               f"{type(arr).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if (cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != ndim
            or not cnp.PyArray_ISCARRAY(a)):
        want = "int64" if typenum == cnp.NPY_INT64 else "int32"
        raise InvalidTypeError(f"row_indices: out.{name} must be a writable C-contiguous "
                               f"{ndim}-D {want} array, got {arr.dtype} {arr.shape}")
    if cnp.PyArray_DIM(a, 0) < rows:
        raise InvalidArgumentError(f"row_indices: out.{name} holds {cnp.PyArray_DIM(a, 0)} "
                                   f"rows, the batch needs {rows}")
    return cnp.PyArray_DATA(a)
