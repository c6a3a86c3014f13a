# Sequence ids and slots (included by _core.pyx): the map from a BlockManager's ids to the C
# core's slots, the batch of ids resolved once (SeqBatch), and the id a C error names.
#
# Phase 1 (ids_of) runs before the call guard and may run Python code; phase 2 (slots_of,
# slot_of) runs inside it and runs none, so the ids cannot change under the loop.


cdef class SeqBatch:
    """Pre-resolved sequence handles for append_batch / metadata (a persistent batch).

    Built by BlockManager.batch(seq_ids); it stays valid while those sequences are live
    (a freed sequence is detected through its slot generation).
    """
    cdef readonly tuple seq_ids
    cdef cnp.ndarray _slots_arr
    cdef cnp.ndarray _gens_arr
    cdef int32_t *slots
    cdef uint32_t *gens
    cdef Py_ssize_t n
    cdef object owner

    def __len__(self):
        return self.n


cdef int32_t slot_of(BlockManager mgr, object seq_id) except -1:
    """Slot of a normalized id (inside a call)."""
    cdef PyObject *o = PyDict_GetItem(mgr._slots, seq_id)
    if o is NULL:
        raise UnknownSequenceError(f"unknown sequence {seq_id!r}")
    return <int32_t><object>o


cdef object ids_of(object seq_ids):
    """Phase 1 for a batch of ids: a SeqBatch as is, else a list of normalized ids (a
    generator is consumed once; the caller's list is copied only if an id needs
    normalizing)."""
    cdef Py_ssize_t i, n
    cdef list ids
    if type(seq_ids) is SeqBatch:
        return seq_ids
    if type(seq_ids) is list:
        ids = <list>seq_ids
    elif isinstance(seq_ids, (str, bytes)):
        raise InvalidTypeError("seq_ids must be a list of ids, not one id")
    else:
        try:
            ids = list(seq_ids)
        except KVBlocksError:
            raise
        except Exception as exc:
            raise InvalidTypeError(f"seq_ids must be an iterable of ids: "
                                   f"{type(exc).__name__}") from None
    n = len(ids)
    for i in range(n):
        t = type(ids[i])
        if t is not int and t is not str:
            return [norm_id(x) for x in ids]
    return ids


cdef cnp.ndarray slots_of(BlockManager mgr, object ids, Py_ssize_t *count):
    """Phase 2 (inside a call): slots of the ids from ids_of, written into a reused buffer, or
    those of a SeqBatch; the first *count entries are valid. No Python code runs here, so the
    list cannot change under the loop."""
    cdef SeqBatch sb
    cdef Py_ssize_t i, n
    cdef int64_t stale
    cdef PyObject *o
    cdef int32_t *slots
    if type(ids) is SeqBatch:
        sb = <SeqBatch>ids
        if sb.owner is not mgr:
            raise InvalidArgumentError("this SeqBatch belongs to another BlockManager")
        stale = kvb_grp_stale(mgr.gp, sb.slots, sb.gens, sb.n)
        if stale >= 0:
            raise UnknownSequenceError(
                f"sequence {sb.seq_ids[stale]!r} of this SeqBatch was freed")
        count[0] = sb.n
        return sb._slots_arr
    n = len(<list>ids)
    if cnp.PyArray_DIM(mgr._buf, 0) < n:
        mgr._buf = new_i32(max(n, 2 * cnp.PyArray_DIM(mgr._buf, 0)))
        # that allocation may have run other threads: the caller's list may have changed
        if len(<list>ids) != n:
            raise InvalidArgumentError("seq_ids changed size during the call")
    slots = <int32_t *>cnp.PyArray_DATA(mgr._buf)
    cdef int32_t *imap = <int32_t *>cnp.PyArray_DATA(mgr._imap)
    cdef Py_ssize_t ilen = cnp.PyArray_DIM(mgr._imap, 0)
    cdef long v
    cdef int overflow
    cdef object sid
    for i in range(n):
        sid = (<list>ids)[i]
        if type(sid) is int:  # small int ids: an array lookup instead of a dict probe
            v = PyLong_AsLongAndOverflow(sid, &overflow)
            if not overflow and 0 <= v < ilen and imap[v]:
                slots[i] = imap[v] - 1
                continue
        elif type(sid) is not str:  # normalized in phase 1: only another thread did this
            raise InvalidArgumentError("seq_ids changed during the call")
        o = PyDict_GetItem(mgr._slots, sid)  # exact keys: no Python code runs
        if o is NULL:
            raise UnknownSequenceError(f"unknown sequence {sid!r}")
        slots[i] = <int32_t><object>o
    count[0] = n
    return mgr._buf


cdef SeqBatch make_batch(BlockManager mgr, object seq_ids):
    """BlockManager.batch: the ids resolved once, with their slots' generations."""
    ids = ids_of(seq_ids)
    if type(ids) is SeqBatch:
        return ids
    ids = tuple(ids)
    cdef Py_ssize_t n
    cdef SeqBatch sb = SeqBatch.__new__(SeqBatch)
    sb._gens_arr = np.empty(len(ids), dtype=np.uint32)
    mgr._enter(False)
    try:
        slots = slots_of(mgr, list(ids), &n)
        sb.seq_ids = ids
        sb.n = n
        sb._slots_arr = new_i32(n)
        if n:
            memcpy(cnp.PyArray_DATA(sb._slots_arr), cnp.PyArray_DATA(slots),
                   n * sizeof(int32_t))
        sb.slots = <int32_t *>cnp.PyArray_DATA(sb._slots_arr)
        sb.gens = <uint32_t *>cnp.PyArray_DATA(sb._gens_arr)
        kvb_grp_gens(mgr.gp, sb.slots, n, sb.gens)
        sb.owner = mgr
        return sb
    finally:
        mgr._leave()


cdef register(BlockManager mgr, object seq_id, int32_t slot):
    """Map a new sequence's id to its slot (the dict, the small-int array, the slot's id)."""
    mgr._slots[seq_id] = slot
    cdef Py_ssize_t cap
    if type(seq_id) is int and 0 <= seq_id < _IMAP_LIMIT:
        cap = cnp.PyArray_DIM(mgr._imap, 0)
        if seq_id >= cap:
            while cap <= seq_id:
                cap *= 2
            grown = np.zeros(cap, dtype=np.int32)
            grown[:cnp.PyArray_DIM(mgr._imap, 0)] = mgr._imap
            mgr._imap = grown
        (<int32_t *>cnp.PyArray_DATA(mgr._imap))[<Py_ssize_t>seq_id] = slot + 1
    while len(mgr._ids) <= slot:
        mgr._ids.append(None)
    mgr._ids[slot] = seq_id


cdef unregister(BlockManager mgr, object seq_id, int32_t slot):
    del mgr._slots[seq_id]
    if type(seq_id) is int and 0 <= seq_id < cnp.PyArray_DIM(mgr._imap, 0):
        (<int32_t *>cnp.PyArray_DATA(mgr._imap))[<Py_ssize_t>seq_id] = 0
    mgr._ids[slot] = None


cdef int raise_mgr(BlockManager mgr, int rc, str what, int32_t g=0, const int32_t *slots=NULL,
                   str ctx=None) except -1:
    """Raise the exception of code rc with the error detail of group g (the lead's for a call
    over all groups) and the sequence it names: a slot (err_b) for an unknown, repeated or
    swapped sequence; the batch index (err_a) into ``slots`` for a gap before a query."""
    cdef int64_t a, b, slot = -1
    cdef const char *check = kvb_mgr_err(mgr.gp[g], &a, &b)
    cdef object seq = None
    if rc == KVB_ESWAPPED or rc == KVB_EDUP or rc == KVB_EUNKNOWN:
        slot = b
    elif rc == KVB_EGAP and slots is not NULL:
        slot = slots[a]
    if 0 <= slot < len(mgr._ids):
        seq = mgr._ids[slot]
    return raise_code(rc, what, a, b, check, seq, None, ctx)
