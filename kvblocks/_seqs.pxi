# A BlockManager's per-sequence queries and swaps (included by _core.pyx): counts and copies
# read through csrc/query.c under the call guard, and swap_out / swap_in.


cdef int64_t seq_count(BlockManager mgr, object seq_id, int which) except? -1:
    """A sequence's committed tokens (0), computed tokens (1), swapped state (2) or blocks
    held in all groups (3)."""
    seq_id = norm_id(seq_id)
    cdef int32_t slot
    mgr._enter(False)
    try:
        slot = slot_of(mgr, seq_id)
        if which == 0:
            return kvb_grp_num_tokens(mgr.gp, slot)
        if which == 1:
            return kvb_grp_num_computed(mgr.gp, mgr.ng, slot)
        if which == 2:
            return kvb_grp_swapped(mgr.gp, slot)
        return kvb_grp_held(mgr.gp, mgr.ng, slot)
    finally:
        mgr._leave()


cdef object read_seq(BlockManager mgr, object seq_id, int32_t what, int32_t group):
    """A copy of a sequence's block table, tokens or hashes (KVB_READ_*) in a group."""
    seq_id = norm_id(seq_id)
    cdef int32_t slot
    cdef Py_ssize_t n
    mgr._enter(False)
    try:
        slot = slot_of(mgr, seq_id)
        n = kvb_grp_read(mgr.gp, group, slot, what, NULL)
        out = np.empty((n, 2), dtype=np.uint64) if what == KVB_READ_HASHES else new_i32(n)
        if n:  # guarded: the same sequence, the same count
            kvb_grp_read(mgr.gp, group, slot, what, cnp.PyArray_DATA(<cnp.ndarray>out))
        return out
    finally:
        mgr._leave()


cdef object swap(BlockManager mgr, object seq_id, bint back):
    """swap_out (back False) or swap_in: the (source, destination) pairs."""
    seq_id = norm_id(seq_id)
    cdef str what = "swap_in" if back else "swap_out"
    if mgr.host_pool is None:
        raise InvalidStateError(f"{what}: no host pool (num_host_blocks=0)")
    cdef int64_t npairs = 0
    cdef int64_t *pairs
    cdef int32_t slot
    cdef int rc
    mgr._enter()
    try:
        slot = slot_of(mgr, seq_id)
        if back and not kvb_grp_swapped(mgr.gp, slot):
            raise InvalidStateError(f"swap_in: sequence {seq_id!r} is not swapped out")
        out = np.empty((kvb_grp_held(mgr.gp, mgr.ng, slot), 2), dtype=np.int64)
        pairs = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out)
        if back:
            rc = kvb_grp_swap_in(mgr.gp, mgr.ng, slot, pairs, &npairs)
        else:
            rc = kvb_grp_swap_out(mgr.gp, mgr.ng, slot, pairs, &npairs)
        if rc:
            raise_mgr(mgr, rc, f"{what}({seq_id!r})")
        return out[:npairs]
    finally:
        mgr._leave()
