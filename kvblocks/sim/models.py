"""Model presets and the memory bill: what a GPU's memory buys in KV-cache blocks.

KV bytes per token:

* standard attention (MHA/GQA): ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes``;
* MLA (DeepSeek-V2/V3): one compressed latent per token and layer, shared by K and V:
  ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes``.

The KV pool is ``GPU memory - weights - reserve``. The reserve defaults to 10% of GPU memory:
the margin vLLM's default ``gpu_memory_utilization=0.9`` leaves for the CUDA context,
activation peaks of a step and allocator slack. Presets use the public ``config.json`` values
of each model on the Hugging Face Hub (parameter counts from the model cards).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Optional

from ..layout import dtype_bytes
from . import limits
from .errors import SimulationError

__all__ = [
    "ModelSpec",
    "MemoryBill",
    "PRESETS",
    "DTYPE_BYTES",
    "get_model",
    "custom_model",
    "memory_bill",
    "GiB",
]

GiB = 1 << 30
# the one dtype table (kvblocks.layout.DTYPES), plus int8: a KV format the memory bill can
# price (quantized caches) but that KVCache does not store
DTYPE_BYTES: Dict[str, int] = {**dtype_bytes(), "int8": 1}
DEFAULT_RESERVE_FRACTION = 0.10


@dataclass(frozen=True)
class ModelSpec:
    """What the memory bill and the time model need to know about a model."""

    name: str
    num_layers: int  # transformer layers holding KV
    num_kv_heads: int  # KV heads (GQA); 0 for MLA
    head_dim: int  # elements per head; 0 for MLA
    params: float  # total parameters (weights resident on the GPU)
    active_params: float  # parameters used per token (differs for mixture-of-experts)
    max_context: int  # max_position_embeddings
    kv_dtype: str = "bf16"  # KV cache element type
    weight_dtype: str = "bf16"  # weight element type
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim elements per token and layer
    source: str = ""  # where the numbers come from

    @property
    def kv_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def weight_bytes(self) -> int:
        return int(self.params * DTYPE_BYTES[self.weight_dtype])

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies across all layers."""
        if self.latent_dim:
            return self.num_layers * self.latent_dim * self.kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def kv_formula(self) -> str:
        """The per-token KV bill as a readable product."""
        b = self.kv_dtype_bytes
        if self.latent_dim:
            return f"{self.num_layers} layers x {self.latent_dim} latent (MLA) x {b} B ({self.kv_dtype})"
        return f"2 (K,V) x {self.num_layers} layers x {self.num_kv_heads} kv heads x {self.head_dim} head dim x {b} B ({self.kv_dtype})"

    def with_kv_dtype(self, dtype: Optional[str]) -> "ModelSpec":
        if dtype is None:
            return self
        _check_dtype(dtype)
        return replace(self, kv_dtype=dtype.lower())


PRESETS: Dict[str, ModelSpec] = {
    m.name.lower(): m
    for m in [
        ModelSpec("Llama-3.1-8B", 32, 8, 128, 8.03e9, 8.03e9, 131072, source="meta-llama/Llama-3.1-8B"),
        ModelSpec("Llama-3.1-70B", 80, 8, 128, 70.55e9, 70.55e9, 131072, source="meta-llama/Llama-3.1-70B"),
        ModelSpec("Qwen2.5-7B", 28, 4, 128, 7.62e9, 7.62e9, 32768, source="Qwen/Qwen2.5-7B"),
        ModelSpec("Mistral-7B", 32, 8, 128, 7.25e9, 7.25e9, 32768, source="mistralai/Mistral-7B-v0.3"),
        # MLA: kv_lora_rank 512 + qk_rope_head_dim 64; 15.7B total, 2.4B active (MoE).
        ModelSpec("DeepSeek-V2-Lite", 27, 0, 0, 15.7e9, 2.4e9, 163840, latent_dim=576,
                  source="deepseek-ai/DeepSeek-V2-Lite"),
    ]
}  # fmt: skip
ALIASES = {
    "llama3-8b": "llama-3.1-8b", "llama-3-8b": "llama-3.1-8b", "llama-8b": "llama-3.1-8b",
    "llama3-70b": "llama-3.1-70b", "llama-3-70b": "llama-3.1-70b", "llama-70b": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b", "mistral-7b-v0.3": "mistral-7b", "mistral-7b-instruct": "mistral-7b",
    "deepseek-v2-lite-chat": "deepseek-v2-lite",
}  # fmt: skip
DEFAULT_MODEL = "llama-3.1-8b"


def _check_dtype(dtype: str) -> None:
    if dtype.lower() not in DTYPE_BYTES:
        raise SimulationError(
            f"unknown dtype {dtype!r} (known: {', '.join(sorted(set(DTYPE_BYTES)))})"
        )


def get_model(name: str) -> ModelSpec:
    """A preset by (case-insensitive) name or alias; raises SimulationError when unknown."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise SimulationError(
            f"unknown model {name!r} (known: {', '.join(m.name for m in PRESETS.values())})"
        )
    return PRESETS[key]


def custom_model(
    layers: int,
    kv_heads: int = 0,
    head_dim: int = 0,
    dtype: str = "bf16",
    params: float = 0.0,
    latent_dim: int = 0,
    max_context: int = 131072,
) -> ModelSpec:
    """A model from explicit shapes (``latent_dim`` > 0 for MLA instead of heads x head_dim)."""
    _check_dtype(dtype)
    layers = limits.LAYERS.check_int(layers)
    kv_heads = limits.KV_HEADS.check_int(kv_heads)
    head_dim = limits.HEAD_DIM.check_int(head_dim)
    latent_dim = limits.LATENT_DIM.check_int(latent_dim)
    params = limits.PARAM_COUNT.check_float(params)
    if not latent_dim and (kv_heads < 1 or head_dim < 1):
        raise SimulationError(
            "a custom model needs --kv-heads and --head-dim (or --latent-dim for MLA)"
        )
    name = (
        f"custom({layers}L x {kv_heads}H x {head_dim}D)"
        if not latent_dim
        else f"custom({layers}L x {latent_dim} MLA)"
    )
    d = dtype.lower()
    return ModelSpec(
        name,
        layers,
        kv_heads,
        head_dim,
        params,
        params,
        max_context,
        d,
        d,
        latent_dim,
        "command line",
    )


@dataclass(frozen=True)
class MemoryBill:
    """How GPU memory splits into weights, reserve and a KV pool of blocks."""

    model: ModelSpec
    gpu_bytes: int
    weight_bytes: int
    reserve_bytes: int
    reserve_note: str
    block_size: int
    kv_bytes_per_token: int
    num_blocks: int  # usable KV blocks (BlockManager gets one more: the null block)
    host_blocks: int = 0  # blocks of host (swap) memory
    extra: Dict[str, float] = field(default_factory=dict)

    @property
    def kv_pool_bytes(self) -> int:
        return self.gpu_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def token_slots(self) -> int:
        return self.num_blocks * self.block_size

    def as_dict(self) -> Dict[str, object]:
        return {
            "model": self.model.name,
            "gpu_gib": self.gpu_bytes / GiB,
            "weights_gib": self.weight_bytes / GiB,
            "reserve_gib": self.reserve_bytes / GiB,
            "reserve_note": self.reserve_note,
            "kv_pool_gib": self.kv_pool_bytes / GiB,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_formula": self.model.kv_formula(),
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "token_slots": self.token_slots,
            "host_blocks": self.host_blocks,
        }


def memory_bill(
    model: ModelSpec,
    gpu_mem_gib: float,
    block_size: int,
    reserve_gib: Optional[float] = None,
    num_blocks: Optional[int] = None,
    host_mem_gib: float = 0.0,
    max_blocks: int = limits.MAX_BLOCK_IDS,
) -> MemoryBill:
    """Split ``gpu_mem_gib`` into weights, reserve and KV blocks (``num_blocks`` overrides).

    A pool (or host swap space) of more than ``max_blocks`` blocks is refused, naming the
    flags that give fewer: int32 block ids by default, :data:`~kvblocks.sim.limits.MAX_SIM_BLOCKS`
    for a simulation (which allocates metadata for every block).
    """
    block_size = limits.BLOCK_SIZE.check_int(block_size)
    gpu_mem_gib = limits.GPU_MEM.check_float(gpu_mem_gib)
    host_mem_gib = limits.HOST_MEM.check(host_mem_gib)
    gpu = int(gpu_mem_gib * GiB)
    if reserve_gib is None:
        reserve = int(gpu * DEFAULT_RESERVE_FRACTION)
        note = f"{DEFAULT_RESERVE_FRACTION:.0%} of GPU memory (CUDA context, activations, slack)"
    else:
        reserve = int(limits.RESERVE.check(reserve_gib) * GiB)
        note = "set by --reserve"
    per_block = model.kv_bytes_per_token * block_size
    host_blocks = int(host_mem_gib * GiB) // per_block
    if host_blocks > max_blocks:
        raise SimulationError(
            f"--host-mem {host_mem_gib:g} GiB makes {host_blocks:,} {block_size}-token host blocks, more than "
            f"{_cap_words(max_blocks)}; lower --host-mem or raise --block-size"
        )
    if num_blocks is not None:
        num_blocks = limits.NUM_BLOCKS.check_int(num_blocks)
        if num_blocks > max_blocks:
            raise SimulationError(
                f"--num-blocks {num_blocks:,} is more than {_cap_words(max_blocks)}"
            )
        return MemoryBill(model, gpu, model.weight_bytes, reserve, note, block_size, model.kv_bytes_per_token,
                          num_blocks, host_blocks)  # fmt: skip
    pool = gpu - model.weight_bytes - reserve
    if pool < per_block:
        raise SimulationError(
            f"{model.name} does not fit: {gpu_mem_gib:g} GiB GPU memory - {model.weight_bytes / GiB:.2f} GiB weights"
            f" - {reserve / GiB:.2f} GiB reserve leaves no room for one KV block ({per_block / (1 << 20):.2f} MiB)"
        )
    if pool // per_block > max_blocks:
        raise SimulationError(
            f"--gpu-mem {gpu_mem_gib:g} GiB leaves a KV pool of {pool // per_block:,} {block_size}-token blocks, "
            f"more than {_cap_words(max_blocks)}; raise --block-size, lower --gpu-mem or set --num-blocks"
        )
    return MemoryBill(model, gpu, model.weight_bytes, reserve, note, block_size, model.kv_bytes_per_token,
                      pool // per_block, host_blocks)  # fmt: skip


def _cap_words(max_blocks: int) -> str:
    if max_blocks == limits.MAX_SIM_BLOCKS:
        return (
            f"the {max_blocks:,} blocks the simulator builds (about 600 MiB of allocator metadata)"
        )
    if max_blocks == limits.MAX_BLOCK_IDS:
        return f"the {max_blocks:,} blocks int32 block ids allow"
    return f"the limit of {max_blocks:,} blocks"
