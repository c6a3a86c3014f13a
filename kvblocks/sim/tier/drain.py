"""One engine step's copy lists: drained in the host tier's order, counted, and priced on PCIe.

The simulator moves no bytes, but it drains the manager's lists exactly as an engine must
(docs/host-tier.md, "The step, in order"): after scheduling (admissions, prefill chunks,
swaps, preemptions) and before ``schedule`` / ``metadata``:

1. ``take_offloads()``: (device, host) copies of demoted blocks, and with write-through the
   copies the previous step's ``schedule`` queued for the blocks it computed;
2. ``take_onloads()``: (host, device) copies of the prefixes served from the host;
3. swap pairs: returned by ``swap_out`` / ``swap_in`` as they happen;
4. ``take_copies()``: copy-on-write pairs.

``take_onloads`` and ``take_copies`` raise ``InvalidStateError`` while an earlier list is
pending, and ``schedule`` while offloads or onloads are, so a replay that broke the order would
fail the same way an engine would.

**Time.** Every copy crosses the host link at ``--pcie-gbps``
(:func:`~kvblocks.sim.tier.host.transfer_seconds`). Demotion offloads, onloads and swaps sit on
the step's critical path: a demoted device block is reused by this step, an onloaded or
swapped-in block is read by its forward pass. They run one after another before it::

    serial  = (demotion offloads + onloads + swapped blocks) x block bytes / PCIe
    overlap = write-through offloads x block bytes / PCIe
    step    = serial + max(forward, overlap)

A write-through offload copies a block the previous forward pass finished: nothing this step
overwrites it unless it is evicted, and its bytes leave on the device-to-host direction, so an
engine runs it on a side stream beside the forward pass (SGLang's HiCache and vLLM's CPU
offloading store asynchronously): it costs time only when it outlasts the forward pass.

>>> copies = StepCopies(block_bytes=2 << 20, bytes_per_s=25e9)
>>> copies.demotions, copies.onloads, copies.write_through = 10, 5, 0
>>> round(copies.step_seconds(forward_s=0.05, swapped_blocks=0), 6)  # 15 x 2 MiB serialized
0.051258
>>> copies.demotions, copies.onloads, copies.write_through = 0, 0, 1000
>>> round(copies.step_seconds(forward_s=0.05, swapped_blocks=0), 6)  # 1000 x 2 MiB > 50 ms
0.083886
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["StepCopies"]


class StepCopies:
    """Drains one manager's lists each step and keeps the counts of the step and the replay.

    ``drain(mgr)`` takes the lists in order; ``after_schedule(mgr)`` notes the write-through
    offloads ``schedule`` queued (they run at the head of the next drain, beside that step's
    forward pass); ``step_seconds`` prices the step's copies."""

    __slots__ = (
        "block_bytes",
        "bytes_per_s",
        "demotions",
        "onloads",
        "write_through",
        "cow",
        "queued_write_through",
        "total_demotions",
        "total_onloads",
        "total_write_through",
        "total_cow",
        "serial_s",
        "overlap_s",
    )

    def __init__(self, block_bytes: int, bytes_per_s: float) -> None:
        self.block_bytes = block_bytes
        self.bytes_per_s = bytes_per_s
        # this step's copies (set by drain)
        self.demotions = 0  # (device, host) copies of blocks evicted since the last drain
        self.onloads = 0  # (host, device) copies of prefixes served from the host
        self.write_through = 0  # (device, host) copies of blocks computed by the last step
        self.cow = 0  # copy-on-write pairs (device to device: no PCIe)
        self.queued_write_through = 0  # write-through offloads pending since schedule
        # the whole replay
        self.total_demotions = 0
        self.total_onloads = 0
        self.total_write_through = 0
        self.total_cow = 0
        self.serial_s = 0.0  # seconds steps waited for demotions, onloads and swaps
        self.overlap_s = 0.0  # seconds write-through copies added beyond the forward pass

    def drain(self, mgr: Any, host_tier: bool, copies: bool) -> None:
        """Take the pending lists in the documented order (offloads, onloads, copies)."""
        if host_tier:
            off = len(mgr.take_offloads())
            wt = min(self.queued_write_through, off)
            self.queued_write_through = 0
            self.write_through = wt
            self.demotions = off - wt
            self.onloads = len(mgr.take_onloads())
            self.total_demotions += self.demotions
            self.total_write_through += wt
            self.total_onloads += self.onloads
        self.cow = len(mgr.take_copies()) if copies else 0
        self.total_cow += self.cow

    def after_schedule(self, mgr: Any) -> None:
        """Note the offloads ``schedule`` queued (write-through: the blocks it computed)."""
        self.queued_write_through = int(mgr.num_pending_offloads)

    def step_seconds(self, forward_s: float, swapped_blocks: int) -> float:
        """The step's duration: its serialized copies, then the forward pass with the
        write-through copies beside it (module docstring)."""
        per_block = self.block_bytes / self.bytes_per_s
        serial = (self.demotions + self.onloads + swapped_blocks) * per_block
        overlap = self.write_through * per_block
        extra = overlap - forward_s if overlap > forward_s else 0.0
        self.serial_s += serial
        self.overlap_s += extra
        return serial + forward_s + extra

    def counters(self) -> Dict[str, Any]:
        """The replay's copy counts and the seconds they added."""
        return {
            "demotion_offload_blocks": self.total_demotions,
            "write_through_offload_blocks": self.total_write_through,
            "offload_blocks": self.total_demotions + self.total_write_through,
            "onload_blocks": self.total_onloads,
            "transfer_s": self.serial_s + self.overlap_s,
        }
