"""Several engines behind a router: the cluster replay, the routers, the prefix index a
prefix-aware router reads, and the cluster report."""
