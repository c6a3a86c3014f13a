"""The simulator's side of the host tier: feature detection, sizing and the PCIe time model.

A host tier makes host memory a second prefix-cache level (``BlockManager(...,
num_host_blocks=H, host_prefix_cache=True)``): an evicted cached device block is demoted to a
host block instead of dropped, and a prompt whose prefix continues on the host gets fresh
device blocks plus (host, device) copies from ``take_onloads()``. ``kvblocks simulate
--host-cache GiB`` gives every replica that much host memory for it.

**Feature detection.** The tier lives in the core; a build without it has no
``BlockManager.take_onloads``. :func:`host_tier_available` checks that, and asking for a host
cache then raises :class:`~kvblocks.sim.errors.SimulationError` ("host tier not available in
this build"), which the command line prints as one error line with exit status 2.

**Transfer time.** Copies between the tiers cross PCIe. The step order is offloads (device to
host, before the device block is reused), then onloads (host to device, before attention reads
them), then the forward pass, so the copies of one step are serialized in front of it::

    transfer_s = (offloaded + onloaded + swapped blocks) x block bytes / PCIe bandwidth

The default bandwidth, :data:`DEFAULT_PCIE_GBPS` = 25 GB/s, is the effective rate of a PCIe
Gen4 x16 link: 16 GT/s x 16 lanes x 128b/130b encoding = 31.5 GB/s raw per direction (PCI-SIG,
PCIe 4.0 base specification), of which pinned-memory DMA copies reach about 80% (the usual
``bandwidthTest`` / ``nvbandwidth`` figure, 24-26 GB/s). A Gen5 x16 host link (H100 SXM) doubles
both: pass ``--pcie-gbps 50``. The same bandwidth prices swap preemption.

>>> transfer_seconds(1000, 2 << 20, 25.0)   # 1000 blocks of 2 MiB at 25 GB/s
0.08388608
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Dict

from ... import BlockManager
from ..errors import SimulationError
from ..limits import MAX_SIM_BLOCKS

__all__ = [
    "DEFAULT_PCIE_GBPS",
    "HOST_TIER_MISSING",
    "host_tier_available",
    "host_cache_blocks",
    "host_manager_kwargs",
    "host_stats_dict",
    "transfer_seconds",
]

DEFAULT_PCIE_GBPS = 25.0  # GB/s (1e9 bytes), effective PCIe Gen4 x16, one direction
HOST_TIER_MISSING = "--host-cache: host tier not available in this build"


def host_tier_available() -> bool:
    """Whether this build's ``BlockManager`` has the host prefix-cache tier."""
    return hasattr(BlockManager, "take_onloads") and hasattr(BlockManager, "take_offloads")


def host_cache_blocks(gib: float, block_bytes: int) -> int:
    """Host-tier blocks that ``gib`` GiB hold (SimulationError beyond the simulator's cap).

    >>> host_cache_blocks(1.0, 2 << 20)
    512
    """
    blocks = int(gib * (1 << 30)) // max(1, block_bytes)
    if gib > 0 and blocks == 0:
        raise SimulationError(
            f"--host-cache {gib:g} GiB holds no block of {block_bytes:,} bytes; give 0 for no "
            "host tier, or more"
        )
    if blocks > MAX_SIM_BLOCKS:
        raise SimulationError(
            f"--host-cache {gib:g} GiB makes {blocks:,} host blocks, more than the simulator's "
            f"{MAX_SIM_BLOCKS:,}; lower --host-cache or raise --block-size"
        )
    return blocks


def host_manager_kwargs(cfg: Any) -> Dict[str, Any]:
    """The host-memory arguments of the engine's ``BlockManager`` for a SchedulerConfig.

    Swap space (``--preemption swap``) and the host cache share one host pool (plus its null
    block); the cache needs the core's host tier.

    >>> from kvblocks.sim import SchedulerConfig
    >>> host_manager_kwargs(SchedulerConfig(num_blocks=10))
    {'num_host_blocks': 0}
    """
    swap = cfg.host_blocks if cfg.preemption == "swap" else 0
    if cfg.host_cache_blocks <= 0:
        return {"num_host_blocks": swap}
    if not host_tier_available():
        raise SimulationError(HOST_TIER_MISSING)
    return {
        "num_host_blocks": swap + cfg.host_cache_blocks + 1,
        "host_prefix_cache": True,
        "host_write_through": cfg.host_write_through,
    }


def transfer_seconds(blocks: int, block_bytes: int, pcie_gbps: float) -> float:
    """Seconds to move ``blocks`` blocks of ``block_bytes`` over a ``pcie_gbps`` GB/s link."""
    return blocks * block_bytes / (pcie_gbps * 1e9)


def host_stats_dict(mgr: Any) -> Dict[str, int]:
    """``mgr.host_stats`` (a :class:`kvblocks.HostStats`) as a plain dict of its counters."""
    return {k: int(v) for k, v in asdict(mgr.host_stats).items()}
