"""The GPU catalog: what the roofline step model and the memory bill need to know about a chip.

Every figure is the vendor's datasheet number for one GPU, dense (no 2:4 sparsity):

* ``mem_gib``: the memory the driver reports (nvidia-smi / rocm-smi total), which is what a
  memory bill can use: an "80 GB" H100 reports 81,559 MiB;
* ``hbm_tb_s``: peak memory bandwidth, TB/s (10^12 bytes/s);
* ``bf16_tflops`` / ``fp8_tflops``: dense tensor-core peaks, TFLOP/s (``fp8_tflops`` = the
  bf16 figure on a chip without fp8 tensor cores: fp8 weights then run weight-only);
* ``link_gb_s``: GPU-to-GPU bandwidth, one direction, GB/s (NVLink / Infinity Fabric /
  PCIe) -- what a ring all-reduce moves its bytes over;
* ``usd_per_hour``: a default on-demand price per GPU-hour (public cloud list prices of 2025,
  rounded; ``--usd-per-hour`` overrides it: prices move, the model does not).

Sources: NVIDIA A100 (2021), H100 (2023), H200 (2024), B200 (HGX B200, 2025), L40S (2023)
datasheets; AMD Instinct MI300X datasheet (2023).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

from ..errors import SimulationError

__all__ = ["GpuSpec", "GPUS", "DEFAULT_GPU", "get_gpu", "parse_gpus"]


@dataclass(frozen=True)
class GpuSpec:
    """One GPU: memory, bandwidths, peaks and a default price."""

    name: str
    mem_gib: float  # memory the driver reports, GiB
    hbm_tb_s: float  # peak HBM bandwidth, 10^12 B/s
    bf16_tflops: float  # dense bf16 tensor-core peak, 10^12 FLOP/s
    fp8_tflops: float  # dense fp8 peak (= bf16 where the chip has no fp8 tensor cores)
    link_gb_s: float  # GPU-to-GPU bandwidth, one direction, 10^9 B/s
    usd_per_hour: float  # default on-demand price per GPU-hour
    link: str = "NVLink"  # what the link is

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops > self.bf16_tflops

    def peak_flops(self, weight_dtype: str) -> float:
        """GEMM peak in FLOP/s for weights of ``weight_dtype``: fp8 weights use fp8 tensor
        cores where the chip has them (W8A8); int4/fp4 weights are dequantized to bf16."""
        return (self.fp8_tflops if weight_dtype == "fp8" else self.bf16_tflops) * 1e12

    def as_dict(self) -> Dict[str, object]:
        return asdict(self)


GPUS: Dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("a100-40gb", 39.39, 1.555, 312.0, 312.0, 300.0, 1.3),
        GpuSpec("a100-80gb", 80.0, 2.039, 312.0, 312.0, 300.0, 1.8),
        GpuSpec("h100-pcie", 79.65, 2.0, 756.0, 1513.0, 64.0, 2.2, "PCIe Gen5"),
        GpuSpec("h100-sxm", 79.65, 3.35, 989.0, 1979.0, 450.0, 2.5),
        GpuSpec("h200", 140.4, 4.8, 989.0, 1979.0, 450.0, 3.5),
        GpuSpec("b200", 179.06, 8.0, 2250.0, 4500.0, 900.0, 5.5),
        GpuSpec("mi300x", 192.0, 5.3, 1307.0, 2615.0, 448.0, 2.5, "Infinity Fabric"),
        GpuSpec("l40s", 44.99, 0.864, 362.0, 733.0, 32.0, 1.0, "PCIe Gen4"),
        GpuSpec("a10", 22.49, 0.6, 125.0, 125.0, 32.0, 0.8, "PCIe Gen4"),
    ]
}
ALIASES = {
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm", "h100-80gb": "h100-sxm", "h200-sxm": "h200", "h200-141gb": "h200",
    "l40": "l40s", "mi300": "mi300x", "a10g": "a10",
}  # fmt: skip
DEFAULT_GPU = "h100-sxm"


def get_gpu(name: str, usd_per_hour: Optional[float] = None) -> GpuSpec:
    """A catalog GPU by (case-insensitive) name or alias; SimulationError when unknown."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in GPUS:
        raise SimulationError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    g = GPUS[key]
    return g if usd_per_hour is None else replace(g, usd_per_hour=usd_per_hour)


def parse_gpus(text: str, usd_per_hour: Optional[float] = None) -> List[GpuSpec]:
    """``"h100-sxm,h200"`` -> the catalog entries, in order, each once."""
    out: List[GpuSpec] = []
    for part in str(text).split(","):
        if not part.strip():
            raise SimulationError(f"--gpu: empty name in {text!r}")
        g = get_gpu(part, usd_per_hour)
        if g not in out:
            out.append(g)
    return out
