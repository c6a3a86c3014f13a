# A BlockManager's construction (included by _core.pyx): its KV cache groups on the heap
# (csrc/groups.c: kvb_grp_new), their kinds, hash mode and links, and the checks of the
# groups and host-tier keywords.


cdef int _init_groups(BlockManager mgr, tuple gs, int32_t bs, bytes key) except -1:
    """The manager's G groups over its pools (csrc/groups.c): kinds, hash mode, links."""
    cdef int32_t G = <int32_t>len(gs), j
    cdef int64_t a, b
    rc = kvb_grp_new(&mgr.gp, G, &mgr.pool.p,
                     &mgr.host_pool.p if mgr.host_pool is not None else NULL, bs,
                     <const uint8_t *>key)
    if rc:
        raise_code(rc, "BlockManager", 0, bs)
    mgr.ng = G
    mgr.groups = gs
    mgr._gowners = [mgr] + [object() for j in range(1, G)]  # metadata row caches
    mgr._zs = <kvb_step_size_t *>calloc(G, sizeof(kvb_step_size_t))
    if mgr._zs is NULL:
        raise MemoryError()
    for j in range(G):
        rc = kvb_mgr_set_kind(mgr.gp[j], (<object>gs[j]).code, (<object>gs[j]).span,
                              <uint8_t>j)
        if rc:
            kvb_mgr_err(mgr.gp[j], &a, &b)
            raise_code(rc, f"groups[{j}]", 0, b)
    mgr.pool._groups = gs
    rc = kvb_grp_set_hash(mgr.gp, G, mgr.pool._algo,  # and the groups' links
                          <const uint8_t *><const char *>mgr.pool._none_hash)
    if rc:
        raise_code(rc, "BlockManager", 0, mgr.pool._algo)
    return 0


cdef bint _host_tier_args(object cache, object write_through, int64_t num_host_blocks,
                          bint device_caching) except -1:
    """Validate the host-tier keywords of BlockManager; True when the tier is on."""
    for name, v in (("host_prefix_cache", cache), ("host_write_through", write_through)):
        if type(v) is not bool:
            raise InvalidTypeError(f"{name} must be a bool, got {type(v).__name__}")
    if write_through and not cache:
        raise InvalidArgumentError("host_write_through needs host_prefix_cache=True")
    if cache and num_host_blocks == 0:
        raise InvalidArgumentError("host_prefix_cache needs host blocks: num_host_blocks >= 2 "
                                   "(block 0 is the host pool's null block)")
    if cache and not device_caching:
        raise InvalidArgumentError("host_prefix_cache needs enable_prefix_caching=True")
    return cache


cdef tuple _group_tuple(object groups):
    """The groups argument of BlockManager as a tuple of KVGroup (default: one full group)."""
    if groups is None:
        return (KVGroup("full"),)
    if isinstance(groups, (str, bytes, KVGroup)):
        raise InvalidTypeError("groups must be a sequence of KVGroup")
    try:
        gs = tuple(groups)
    except TypeError:
        raise InvalidTypeError(f"groups must be a sequence of KVGroup, got "
                               f"{type(groups).__name__}") from None
    if not gs:
        raise InvalidArgumentError("groups must hold at least one KVGroup")
    if len(gs) > 255:
        raise InvalidArgumentError(f"at most 255 groups, got {len(gs)}")
    for g in gs:
        if type(g) is not KVGroup:
            raise InvalidTypeError(f"groups must hold KVGroup, got {type(g).__name__}")
    return gs
