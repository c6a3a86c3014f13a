# The host tier and the events of a BlockManager's two pools (included by _core.pyx): the
# drains (offloads, onloads, events, events on the wire), the tier's counters and the reset of
# both tiers' caches. BlockManager's methods of those names call these; the drain order is
# checked in C (kvb_tier_take_onloads, kvb_grp_take_copies, kvb_mgr_reset_cache).


cdef int64_t tier_pending(BlockManager mgr, bint offloads):
    """num_pending_offloads (after a flush: evictions since get their offloads) or onloads."""
    cdef kvb_tier_t *t = kvb_grp_tier(mgr.gp)
    cdef int64_t noff, non
    if t is not NULL and offloads:
        kvb_tier_flush(t)
    kvb_tier_pending(t, &noff, &non)
    return noff if offloads else non


cdef object tier_stats(BlockManager mgr):
    cdef kvb_tier_t *t = kvb_grp_tier(mgr.gp)
    if t is NULL:
        return HostStats()
    kvb_tier_flush(t)  # demotions recorded since the last flush are counted
    cdef const kvb_tier_stats_t *s = kvb_tier_stats(t)
    h = mgr.host_pool.p.stats
    return HostStats(hits=s.hit_blocks, hit_tokens=s.hit_tokens,
                     recompute_hit_tokens=s.recompute_hit_tokens,
                     query_tokens=mgr.pool.p.stats.query_tokens,
                     demotions=s.demotions, offloads=s.offloads, onloads=s.onloads,
                     dropped=s.dropped, evictions=h.evictions, stored=h.stored)


cdef object take_offloads(BlockManager mgr):
    cdef kvb_tier_t *t = kvb_grp_tier(mgr.gp)
    cdef int64_t noff, non
    mgr._enter()
    try:
        if t is NULL:
            return np.empty((0, 2), dtype=np.int64)
        while True:  # size the list after a flush (the evictions get their host blocks)
            kvb_tier_flush(t)
            kvb_tier_pending(t, &noff, &non)
            out = np.empty((noff, 2), dtype=np.int64)
            # np.empty may run Python (a GC callback): another thread's pool call may
            # have evicted meanwhile; take only into a list of the exact size
            kvb_tier_pending(t, &noff, &non)
            if kvb_tier_unflushed(t) == 0 and cnp.PyArray_DIM(<cnp.ndarray>out, 0) == noff:
                break
        kvb_tier_take_offloads(t, <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out))
        return out
    finally:
        mgr._leave()


cdef object take_onloads(BlockManager mgr):
    cdef kvb_tier_t *t = kvb_grp_tier(mgr.gp)
    cdef int64_t n = 0, noff, non
    cdef int rc
    mgr._enter()
    try:
        kvb_tier_pending(t, &noff, &non)
        out = np.empty((non, 2), dtype=np.int64)
        if t is not NULL:
            rc = kvb_tier_take_onloads(t, <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out), &n)
            if rc:
                raise_code(rc, "take_onloads", mgr.host_pool.p.err_a, 0)
        return out
    finally:
        mgr._leave()


cdef object take_events(BlockManager mgr):
    cdef kvb_tier_t *t = kvb_grp_tier(mgr.gp)
    if t is NULL:
        return mgr.pool.take_events()
    cdef kvb_events_t a, b, merged
    cdef kvb_events_t *dev = &mgr.pool.p.events
    cdef kvb_events_t *host = &mgr.host_pool.p.events
    cdef int rc
    mgr._enter(False)
    try:
        kvb_tier_flush(t)  # evictions since: their host entries are stored now
        if dev.n == 0 and host.n == 0:
            return []
        src = np.empty(dev.n + host.n, dtype=np.uint8)
        # moved out before Python objects are built (another thread may record meanwhile)
        kvb_events_detach(dev, &a)
        kvb_events_detach(host, &b)
        memset(&merged, 0, sizeof(merged))
        try:
            if cnp.PyArray_DIM(<cnp.ndarray>src, 0) != a.n + b.n:
                src = np.empty(a.n + b.n, dtype=np.uint8)
            rc = kvb_events_merge(&a, &b, &merged, <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src))
            if rc:
                raise MemoryError("take_events: out of memory merging the event logs")
            return mgr.pool._build_events(&merged, <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src),
                                          [mgr.pool._medium, mgr.host_pool._medium])
        finally:
            kvb_events_destroy(&merged)
            kvb_events_reattach(dev, &a)
            kvb_events_reattach(host, &b)
    finally:
        mgr._leave()


cdef bytes take_events_wire(BlockManager mgr, ts, data_parallel_rank, fmt, hash_int):
    cdef kvb_tier_t *t = kvb_grp_tier(mgr.gp)
    cdef kvb_wire_opts_t wd, wh
    cdef kvb_wire_group_t gd[256]
    cdef kvb_wire_group_t gh[256]
    cdef kvb_events_t merged
    cdef kvb_events_t *dev = &mgr.pool.p.events
    cdef kvb_events_t *host
    cdef list keep = []
    cdef bytes out
    mgr._enter(False)
    try:
        if t is NULL:  # the host pool of swapping records no events
            out = mgr.pool._wire_bytes(ts, data_parallel_rank, fmt, hash_int)
            kvb_events_clear(dev)
            return out
        host = &mgr.host_pool.p.events
        kvb_tier_flush(t)  # evictions since: their host entries are stored now
        mgr.pool._wire_opts(&wd, gd, keep, ts, data_parallel_rank, fmt, hash_int)
        mgr.host_pool._wire_opts(&wh, gh, keep, ts, data_parallel_rank, fmt, hash_int)
        src = np.empty(dev.n + host.n, dtype=np.uint8)
        memset(&merged, 0, sizeof(merged))
        try:
            if kvb_events_merge(dev, host, &merged,
                                <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src)):
                raise MemoryError("take_events_wire: out of memory merging the event logs")
            wd.src = <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src)
            wd.alt = &wh
            out = _encode_log(&merged, &wd)
        finally:
            kvb_events_destroy(&merged)
        kvb_events_clear(dev)
        kvb_events_clear(host)
        return out
    finally:
        mgr._leave()


cdef int reset_cache(BlockManager mgr) except -1:
    mgr._enter()
    try:
        rc = kvb_mgr_reset_cache(mgr.gp[0])
        if rc:
            raise_mgr(mgr, rc, "reset_prefix_cache")
    finally:
        mgr._leave()
    return 0
