"""The range of every number ``kvblocks simulate`` and ``kvblocks plan`` accept, and one check.

A :class:`Limit` names a quantity by its command-line flag and gives its type and range. The
command line parses each flag with :meth:`Limit.parse` (an ``argparse`` ``type=``), so a bad
value stops the parse with one line naming the flag; the library functions behind it
(:func:`~kvblocks.sim.memory_bill`, :func:`~kvblocks.sim.custom_model`, ...) check the same
limits with :meth:`Limit.check`, so a NaN passed from Python is refused there too. NaN, the
infinities and values that only overflow later (``1e400``, a 20-digit block count) are out of
range for every limit.

The largest pool the simulator builds is :data:`MAX_SIM_BLOCKS` blocks (about 600 MiB of
allocator metadata at 37 bytes per block); a bigger ``--gpu-mem`` asks for a larger
``--block-size``, a smaller ``--gpu-mem`` or an explicit ``--num-blocks``. ``kvblocks plan``
only does arithmetic and allows block counts up to int32, the range of block ids.
"""

from __future__ import annotations

import argparse
import math
import numbers
from dataclasses import dataclass
from typing import Union

from .errors import SimulationError

__all__ = ["Limit", "shown", "MAX_TOKENS", "MAX_SAMPLES", "MAX_SIM_BLOCKS", "MAX_BLOCK_IDS"]

Number = Union[int, float]

MAX_TOKENS = 10_000_000  # longer prompts or outputs are rejected as absurd
MAX_SAMPLES = 64  # parallel samples per request
MAX_BLOCK_IDS = (1 << 31) - 2  # int32 block ids, less the null block
MAX_SIM_BLOCKS = 1 << 24  # blocks the simulator allocates metadata for (device or host)
MAX_GIB = 1e6  # GPU, host, reserve memory
MAX_STEP_COST = 1e9  # any time-model constant, in its own unit


@dataclass(frozen=True)
class Limit:
    """A flag's type and range: ``kind`` values in ``[lo, hi]`` (``(lo`` / ``hi)`` when open)."""

    flag: str  # the command-line flag that sets the quantity
    kind: type  # int or float
    lo: Number
    hi: Number
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""  # printed after "a number", e.g. "of GiB"

    def describe(self) -> str:
        """The accepted values in words: ``an integer in [1, 65536]``."""
        what = "an integer" if self.kind is int else "a number"
        if self.unit:
            what += f" {self.unit}"
        lo = f"{self.lo:g}" if isinstance(self.lo, float) else str(self.lo)
        hi = f"{self.hi:g}" if isinstance(self.hi, float) else str(self.hi)
        return f"{what} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    def _ok(self, v: Number) -> bool:
        if not isinstance(v, numbers.Integral) and not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def check(self, value: object) -> Number:
        """``value`` as an int or float when in range; SimulationError naming the flag otherwise."""
        v: Number
        if isinstance(value, bool):
            v = float("nan")  # refused below
        elif self.kind is float and isinstance(value, numbers.Real):
            v = float(value)
        elif self.kind is int and isinstance(value, numbers.Integral):
            v = int(value)
        else:
            v = float("nan")
        if math.isnan(v) or not self._ok(v):
            raise SimulationError(f"{self.flag} must be {self.describe()}, got {shown(value)}")
        return v

    def check_int(self, value: object) -> int:
        """``check`` for an integer limit, typed as such."""
        v = self.check(value)
        assert isinstance(v, int), f"{self.flag} is not an integer limit"
        return v

    def check_float(self, value: object) -> float:
        """``check`` for a real limit, typed as such."""
        return float(self.check(value))

    def parse(self, text: str) -> Number:
        """Command-line text to a value: the ``type=`` of the flag's argparse argument."""
        try:
            v: Number = int(text, 10) if self.kind is int else float(text)
        except ValueError:
            v = math.nan
        if not self._ok(v):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {shown(text)}")
        return v


def shown(value: object, keep: int = 40) -> str:
    """``repr(value)`` for an error message, its middle elided when longer than ``keep``
    characters (so a 4000-digit number stays one short line)."""
    text = repr(value)
    return (
        text
        if len(text) <= keep
        else f"{text[: keep // 2]}...{text[-(keep // 2) :]} ({len(text)} chars)"
    )


# model and memory (simulate and plan)
LAYERS = Limit("--layers", int, 1, 10_000)
KV_HEADS = Limit("--kv-heads", int, 0, 1 << 16)
HEAD_DIM = Limit("--head-dim", int, 0, 1 << 16)
LATENT_DIM = Limit("--latent-dim", int, 0, 1 << 20)
PARAMS = Limit("--params", float, 0.0, 1e6, unit="of billions")
PARAM_COUNT = Limit(
    "params", float, 0.0, 1e15, unit="of parameters"
)  # custom_model's, not in billions
GPU_MEM = Limit("--gpu-mem", float, 0.0, MAX_GIB, lo_open=True, unit="of GiB")
RESERVE = Limit("--reserve", float, 0.0, MAX_GIB, unit="of GiB")
HOST_MEM = Limit("--host-mem", float, 0.0, MAX_GIB, unit="of GiB")
BLOCK_SIZE = Limit("--block-size", int, 1, 65536)
GPUS_PER_REPLICA = Limit("--tp x --pp", int, 1, 4096)
NUM_BLOCKS = Limit("--num-blocks", int, 1, MAX_BLOCK_IDS)
SIM_NUM_BLOCKS = Limit("--num-blocks", int, 1, MAX_SIM_BLOCKS)

# simulate: workload and engine
LIMIT = Limit("--limit", int, 1, (1 << 31) - 1)
TIME_SCALE = Limit("--time-scale", float, 0.0, 1e6)
WATERMARK = Limit("--watermark", float, 0.0, 1.0, hi_open=True)
MAX_NUM_SEQS = Limit("--max-num-seqs", int, 1, 1 << 20)
TOKEN_BUDGET = Limit("--token-budget", int, 1, 1 << 30)
MAX_MODEL_LEN = Limit("--max-model-len", int, 1, 2 * MAX_TOKENS)
STEP_OVERHEAD_MS = Limit("--step-overhead-ms", float, 0.0, MAX_STEP_COST, hi_open=True)
PREFILL_US = Limit("--prefill-us", float, 0.0, MAX_STEP_COST, hi_open=True)
DECODE_US = Limit("--decode-us", float, 0.0, MAX_STEP_COST, hi_open=True)
KV_READ_NS = Limit("--kv-read-ns", float, 0.0, MAX_STEP_COST, hi_open=True)
EFFICIENCY = Limit("efficiency", float, 0.0, 1.0, lo_open=True)
COMPUTE_EFF = Limit("--compute-eff", float, 0.0, 1.0, lo_open=True)
BANDWIDTH_EFF = Limit("--bandwidth-eff", float, 0.0, 1.0, lo_open=True)
ATTENTION_EFF = Limit("--attention-eff", float, 0.0, 1.0, lo_open=True)
LINK_EFF = Limit("--link-eff", float, 0.0, 1.0, lo_open=True)
COLLECTIVE_US = Limit("--collective-us", float, 0.0, MAX_STEP_COST, hi_open=True)
TP = Limit("--tp", int, 1, 1024)
PP = Limit("--pp", int, 1, 1024)
USD_PER_HOUR = Limit("--usd-per-hour", float, 0.0, 1e6)
PEAK_TFLOPS = Limit("--peak-tflops", float, 0.0, 1e9, lo_open=True, unit="of TFLOP/s")
HBM_TBS = Limit("--hbm-tbs", float, 0.0, 1e6, lo_open=True, unit="of TB/s")
LINK_GBS = Limit("--link-gbs", float, 0.0, 1e9, lo_open=True, unit="of GB/s")
TTFT_SLO = Limit("--ttft-slo", float, 0.0, 1e9, lo_open=True, unit="of seconds")
TPOT_SLO = Limit("--tpot-slo", float, 0.0, 1e9, lo_open=True, unit="of seconds")

# cluster (simulate and plan)
REPLICAS = Limit("--replicas", int, 1, 1024)
OVERLAP_WEIGHT = Limit("--overlap-weight", float, 0.0, 1e6)
HOST_CACHE = Limit("--host-cache", float, 0.0, MAX_GIB, unit="of GiB")
PCIE_GBPS = Limit("--pcie-gbps", float, 0.0, 1e6, lo_open=True, unit="of GB/s")
TTFT_P99 = Limit("--ttft-p99", float, 0.0, 1e9, lo_open=True, unit="of seconds")
TPOT_P99 = Limit("--tpot-p99", float, 0.0, 1e9, lo_open=True, unit="of seconds")

# plan
MAX_LEN = Limit("--max-len", int, 1, 2 * MAX_TOKENS)
SAMPLES = Limit("--samples", int, 1, 10_000_000)
SEED = Limit("--seed", int, 0, (1 << 64) - 1)
