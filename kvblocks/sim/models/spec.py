"""Model presets and the memory bill: what a GPU's memory buys in KV-cache blocks.

KV bytes per token:

* standard attention (MHA/GQA): ``2 (K and V) x layers x kv_heads x head_dim x dtype bytes``;
* MLA (DeepSeek-V2/V3): one compressed latent per token and layer, shared by K and V:
  ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes``.

Hybrid models (gpt-oss, Gemma 3, Llama 4 Scout, Qwen3-Next) list their layer kinds
(:class:`~kvblocks.sim.models.hybrid.LayerKind`): a sliding-window or chunked-local layer holds
at most its window or chunk (+1 block) of tokens per sequence, a state layer a fixed size per
sequence. :func:`~kvblocks.sim.models.hybrid.group_layout` maps the layers to kvblocks groups
over one pool of equal blocks; the bill below prices blocks of that layout.

The KV pool is ``GPU memory - weights - reserve``. The reserve defaults to 10% of GPU memory:
the margin vLLM's default ``gpu_memory_utilization=0.9`` leaves for the CUDA context,
activation peaks of a step and allocator slack. Presets use the public ``config.json`` values
of each model on the Hugging Face Hub (parameter counts from the model cards).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...layout import dtype_bytes
from .. import limits
from ..errors import SimulationError
from .hybrid import GroupLayout, LayerKind, group_layout

__all__ = [
    "ModelSpec",
    "LayerKind",
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
# fp4 KV (NVFP4): 4-bit elements plus one fp8 scale per 16 elements, 0.5625 bytes an element
FP4_GROUP = 16
KV_DTYPES = sorted({*DTYPE_BYTES, "fp4"})
# weights: bytes per parameter; int4 (AWQ/GPTQ) carries an fp16 scale and zero per group of
# 128, fp4 (NVFP4/MXFP4) an 8-bit scale per 16 (or 32) elements
WEIGHT_BYTES: Dict[str, float] = {
    "bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "int8": 1.0,
    "int4": 0.5 + 4 / 128, "fp4": 0.5 + 1 / 16,
}  # fmt: skip


def kv_nbytes(dtype: str, elems: int) -> int:
    """Bytes of ``elems`` KV elements of ``dtype`` (fp4: packed nibbles plus the scales)."""
    if dtype == "fp4":
        return -(-elems // 2) + -(-elems // FP4_GROUP)
    return elems * DTYPE_BYTES[dtype]


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
    layer_kinds: Tuple[LayerKind, ...] = ()  # hybrid models; () = every layer full attention
    weights_gib: float = 0.0  # checkpoint size when weights are not params x weight dtype

    @property
    def kinds(self) -> Tuple[LayerKind, ...]:
        """The layer kinds (one full-attention kind for a model that gives none)."""
        return self.layer_kinds or (LayerKind("full", self.num_layers),)

    @property
    def hybrid(self) -> bool:
        return any(k.kind != "full" for k in self.kinds)

    @property
    def attention_layers(self) -> int:
        """Layers holding per-token KV (every layer but state layers)."""
        return sum(k.layers for k in self.kinds if k.kind != "state")

    @property
    def kv_dtype_bytes(self) -> float:
        """Bytes per KV element (fp4: 0.5625, its scales included)."""
        return kv_nbytes(self.kv_dtype, 1 << 20) / (1 << 20)

    def kv_nbytes(self, elems: int) -> int:
        """Bytes of ``elems`` elements in the KV dtype."""
        return kv_nbytes(self.kv_dtype, elems)

    @property
    def weight_bytes(self) -> int:
        if self.weights_gib:
            return int(self.weights_gib * GiB)
        return int(self.params * WEIGHT_BYTES[self.weight_dtype])

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of KV one token occupies in one attention layer."""
        if self.latent_dim:
            return self.kv_nbytes(self.latent_dim)
        return 2 * self.kv_nbytes(self.num_kv_heads * self.head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across all attention layers (window and chunk
        layers included: a token inside every window takes this much)."""
        return self.attention_layers * self.kv_bytes_per_token_layer

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of recurrent state one sequence keeps (before rounding to blocks)."""
        return self.kv_nbytes(sum(k.layers * k.state_elems for k in self.kinds))

    def kv_formula(self) -> str:
        """The per-token KV bill as a readable product."""
        b = f"{self.kv_dtype_bytes:g}"
        layers = f"{self.attention_layers} layers"
        if self.hybrid:
            parts = " + ".join(k.describe() for k in self.kinds if k.kind != "state")
            layers = f"{self.attention_layers} attention layers ({parts})"
        if self.latent_dim:
            return f"{layers} x {self.latent_dim} latent (MLA) x {b} B ({self.kv_dtype})"
        return f"2 (K,V) x {layers} x {self.num_kv_heads} kv heads x {self.head_dim} head dim x {b} B ({self.kv_dtype})"

    def read_weights(self) -> List[Tuple[str, int, float]]:
        """(kind, span, share of :attr:`kv_bytes_per_token`) per attention kind: what a
        decoding token's attention reads, for the time model."""
        total = self.attention_layers
        return [(k.kind, k.span, k.layers / total) for k in self.kinds if k.kind != "state"]

    def with_kv_dtype(self, dtype: Optional[str]) -> "ModelSpec":
        if dtype is None:
            return self
        _check_dtype(dtype)
        return replace(self, kv_dtype=dtype.lower())

    def with_weight_dtype(self, dtype: Optional[str]) -> "ModelSpec":
        """The model with its weights stored as ``dtype`` (params x bytes per parameter, the
        checkpoint size a preset may give replaced)."""
        if dtype is None:
            return self
        d = dtype.lower()
        if d not in WEIGHT_BYTES:
            raise SimulationError(
                f"unknown weight dtype {dtype!r} (known: {', '.join(sorted(WEIGHT_BYTES))})"
            )
        return replace(self, weight_dtype=d, weights_gib=0.0)


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
        # Hybrid models (config.json on the Hugging Face Hub; docs/simulator.md has the table).
        # openai/gpt-oss-20b: num_hidden_layers 24, layer_types alternating sliding_attention /
        # full_attention (12 + 12), sliding_window 128, num_key_value_heads 8, head_dim 64,
        # max_position_embeddings 131072. Model card (OpenAI, 2025-08, table 1): 20.91B
        # parameters, 3.61B active, checkpoint 12.8 GiB (MXFP4 experts, bf16 elsewhere).
        ModelSpec("gpt-oss-20b", 24, 8, 64, 20.91e9, 3.61e9, 131072, source="openai/gpt-oss-20b",
                  layer_kinds=(LayerKind("full", 12), LayerKind("sliding_window", 12, 128)),
                  weights_gib=12.8),
        # openai/gpt-oss-120b: num_hidden_layers 36, the same alternation (18 + 18), window
        # 128, 8 KV heads x 64; model card: 116.83B parameters, 5.13B active, 60.8 GiB.
        ModelSpec("gpt-oss-120b", 36, 8, 64, 116.83e9, 5.13e9, 131072, source="openai/gpt-oss-120b",
                  layer_kinds=(LayerKind("full", 18), LayerKind("sliding_window", 18, 128)),
                  weights_gib=60.8),
        # google/gemma-3-27b-it text_config: num_hidden_layers 62, sliding_window 1024,
        # sliding_window_pattern 6 (layer i is global iff (i + 1) % 6 == 0: 10 full, 52
        # sliding), num_key_value_heads 16, head_dim 128, max_position_embeddings 131072;
        # 27.4B parameters in bf16 (vision tower included).
        ModelSpec("gemma-3-27b", 62, 16, 128, 27.4e9, 27.4e9, 131072, source="google/gemma-3-27b-it",
                  layer_kinds=(LayerKind("full", 10), LayerKind("sliding_window", 52, 1024))),
        # meta-llama/Llama-4-Scout-17B-16E text_config: num_hidden_layers 48, no_rope_layers
        # [1, 1, 1, 0] x 12 (the 12 NoPE layers attend globally, the 36 RoPE layers within
        # attention_chunk_size 8192), num_key_value_heads 8, head_dim 128,
        # max_position_embeddings 10485760; model card: 109B parameters, 17B active (bf16).
        ModelSpec("llama-4-scout", 48, 8, 128, 109e9, 17e9, 10485760,
                  source="meta-llama/Llama-4-Scout-17B-16E",
                  layer_kinds=(LayerKind("full", 12), LayerKind("chunked_local", 36, 8192))),
        # Qwen/Qwen3-Next-80B-A3B-Instruct: num_hidden_layers 48, full_attention_interval 4 (12
        # full-attention layers: num_key_value_heads 2, head_dim 256; 36 Gated DeltaNet
        # layers), linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim =
        # linear_value_head_dim = 128, linear_conv_kernel_dim 4, max_position_embeddings 262144.
        # State per layer and sequence: conv (4 - 1) x (2 x 16 x 128 + 32 x 128) = 24,576 +
        # recurrent 32 x 128 x 128 = 524,288 elements. Model card: 80B parameters, 3B active.
        ModelSpec("qwen3-next-80b-a3b", 48, 2, 256, 80e9, 3e9, 262144,
                  source="Qwen/Qwen3-Next-80B-A3B-Instruct",
                  layer_kinds=(LayerKind("full", 12), LayerKind("state", 36, 0, 548_864))),
    ]
}  # fmt: skip
ALIASES = {
    "llama3-8b": "llama-3.1-8b", "llama-3-8b": "llama-3.1-8b", "llama-8b": "llama-3.1-8b",
    "llama3-70b": "llama-3.1-70b", "llama-3-70b": "llama-3.1-70b", "llama-70b": "llama-3.1-70b",
    "qwen2.5-7b-instruct": "qwen2.5-7b", "mistral-7b-v0.3": "mistral-7b", "mistral-7b-instruct": "mistral-7b",
    "deepseek-v2-lite-chat": "deepseek-v2-lite",
    "openai/gpt-oss-20b": "gpt-oss-20b", "openai/gpt-oss-120b": "gpt-oss-120b",
    "gemma-3-27b-it": "gemma-3-27b", "gemma3-27b": "gemma-3-27b",
    "llama-4-scout-17b-16e": "llama-4-scout", "llama-4-scout-17b-16e-instruct": "llama-4-scout",
    "qwen3-next-80b-a3b-instruct": "qwen3-next-80b-a3b", "qwen3-next": "qwen3-next-80b-a3b",
}  # fmt: skip
DEFAULT_MODEL = "llama-3.1-8b"


def _check_dtype(dtype: str) -> None:
    if dtype.lower() not in KV_DTYPES:
        raise SimulationError(f"unknown KV dtype {dtype!r} (known: {', '.join(KV_DTYPES)})")


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
    layer_kinds: Tuple[LayerKind, ...] = (),
) -> ModelSpec:
    """A model from explicit shapes (``latent_dim`` > 0 for MLA instead of heads x head_dim;
    ``layer_kinds`` for a hybrid model, see :func:`~kvblocks.sim.models.hybrid.parse_layer_kinds`)."""
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
    if layer_kinds and sum(k.layers for k in layer_kinds) != layers:
        raise SimulationError(
            f"the layer kinds hold {sum(k.layers for k in layer_kinds)} layers, not {layers}"
        )
    name = (
        f"custom({layers}L x {kv_heads}H x {head_dim}D)"
        if not latent_dim
        else f"custom({layers}L x {latent_dim} MLA)"
    )
    if layer_kinds and any(k.kind != "full" for k in layer_kinds):
        name = name[:-1] + ", " + " + ".join(k.describe() for k in layer_kinds) + ")"
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
        tuple(layer_kinds),
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
    layout: Optional[GroupLayout] = None  # layers -> kvblocks groups (None: one full group)

    @property
    def groups(self) -> GroupLayout:
        """The layout of the model's layers into kvblocks groups."""
        if self.layout is not None:
            return self.layout
        return group_layout(self.model, self.block_size)

    @property
    def kv_pool_bytes(self) -> int:
        return self.gpu_bytes - self.weight_bytes - self.reserve_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one pool block: ``block_size`` tokens of one group's layers."""
        return self.groups.block_bytes

    @property
    def token_slots(self) -> int:
        """Blocks x block size: token positions of one group the pool holds."""
        return self.num_blocks * self.block_size

    def seq_blocks(self, num_tokens: Any) -> Any:
        """Pool blocks a decoding sequence of ``num_tokens`` tokens holds, all groups
        (window and chunk groups hold only what the next query reads, state groups their
        fixed blocks). Works on numpy arrays too.

        >>> b = memory_bill(get_model("gpt-oss-20b"), 80, 16)
        >>> int(b.seq_blocks(1000)), int(b.seq_blocks(100_000))  # full 63 + 9, 6250 + 8
        (72, 6258)
        """
        out = self.groups.seq_blocks(np.asarray(num_tokens))
        return int(out) if out.ndim == 0 else out

    def seq_bytes(self, num_tokens: int) -> int:
        """Bytes of KV (and state) a decoding sequence of ``num_tokens`` tokens holds."""
        return int(self.seq_blocks(num_tokens)) * self.block_bytes

    def group_bill(self) -> List[Dict[str, Any]]:
        """Per layer kind: its kvblocks groups, bytes per token while a token is within its
        reach, the most tokens (or the state bytes) one sequence holds in it."""
        lay = self.groups
        per_layer = self.model.kv_bytes_per_token_layer
        out: List[Dict[str, Any]] = []
        for sh in lay.shares:
            g = sh.group
            d: Dict[str, Any] = {
                "kind": g.kind,
                "span": g.span,
                "layers": sh.kind.layers,
                "kvblocks_groups": sh.copies,
                "layers_per_group": lay.layers_per_group,
            }
            if g.kind == "state":
                d["bytes_per_token"] = 0
                d["blocks_per_seq"] = g.span * sh.copies
                d["bytes_per_seq"] = g.span * sh.copies * lay.block_bytes
                d["state_bytes_per_seq_exact"] = self.model.kv_nbytes(
                    sh.kind.layers * sh.kind.state_elems
                )
            else:
                d["bytes_per_token"] = sh.kind.layers * per_layer
                if g.kind != "full":
                    blocks = sh.max_blocks(1 << 62, self.block_size)
                    d["max_blocks_per_seq"] = blocks * sh.copies
                    d["max_tokens_held"] = blocks * self.block_size
            out.append(d)
        return out

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
            "kv_dtype": self.model.kv_dtype,
            "weight_dtype": self.model.weight_dtype,
            "gpus_per_replica": int(self.extra.get("gpus_per_replica", 1)),
            "kv_copies": int(self.extra.get("kv_copies", 1)),
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "token_slots": self.token_slots,
            "host_blocks": self.host_blocks,
            "all_full": self.groups.all_full,
            "kvblocks_groups": self.groups.num_groups,
            "groups": self.group_bill(),
        }


def memory_bill(
    model: ModelSpec,
    gpu_mem_gib: float,
    block_size: int,
    reserve_gib: Optional[float] = None,
    num_blocks: Optional[int] = None,
    host_mem_gib: float = 0.0,
    max_blocks: int = limits.MAX_BLOCK_IDS,
    all_full: bool = False,
    gpus: int = 1,
    kv_copies: int = 1,
) -> MemoryBill:
    """Split ``gpu_mem_gib`` into weights, reserve and KV blocks (``num_blocks`` overrides).

    A block holds ``block_size`` tokens of one kvblocks group's layers
    (:func:`~kvblocks.sim.models.hybrid.group_layout`); ``all_full`` prices a hybrid model
    as if its window and chunk layers were full attention (the baseline).

    A pool (or host swap space) of more than ``max_blocks`` blocks is refused, naming the
    flags that give fewer: int32 block ids by default, :data:`~kvblocks.sim.limits.MAX_SIM_BLOCKS`
    for a simulation (which allocates metadata for every block).

    ``gpus`` > 1: one replica spread over that many GPUs (tensor x pipeline parallel); GPU
    memory and reserve are per GPU, the weights and the KV split over them, and the KV is
    stored ``kv_copies`` times (tensor parallelism wider than the KV heads replicates them).
    The bill is then the replica's: ``gpu_bytes`` and ``reserve_bytes`` summed over its GPUs.
    """
    block_size = limits.BLOCK_SIZE.check_int(block_size)
    gpu_mem_gib = limits.GPU_MEM.check_float(gpu_mem_gib)
    host_mem_gib = limits.HOST_MEM.check(host_mem_gib)
    gpus = limits.GPUS_PER_REPLICA.check_int(gpus)
    gpu = int(gpu_mem_gib * GiB) * gpus
    if reserve_gib is None:
        reserve = int(gpu * DEFAULT_RESERVE_FRACTION)
        note = f"{DEFAULT_RESERVE_FRACTION:.0%} of GPU memory (CUDA context, activations, slack)"
    else:
        reserve = int(limits.RESERVE.check(reserve_gib) * GiB) * gpus
        note = "set by --reserve" + (" (per GPU)" if gpus > 1 else "")
    layout = group_layout(model, block_size, all_full)
    per_block = layout.block_bytes * kv_copies
    extra: Dict[str, float] = {}
    if gpus > 1:
        extra = {"gpus_per_replica": gpus, "kv_copies": kv_copies}
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
                          num_blocks, host_blocks, extra, layout=layout)  # fmt: skip
    pool = gpu - model.weight_bytes - reserve
    if pool < per_block:
        on = f"{gpus} x {gpu_mem_gib:g}" if gpus > 1 else f"{gpu_mem_gib:g}"
        raise SimulationError(
            f"{model.name} does not fit: {on} GiB GPU memory - {model.weight_bytes / GiB:.2f} GiB weights"
            f" - {reserve / GiB:.2f} GiB reserve leaves no room for one KV block ({per_block / (1 << 20):.2f} MiB)"
            + ("" if gpus > 1 else "; split it with --tp or --pp")
        )
    if pool // per_block > max_blocks:
        raise SimulationError(
            f"--gpu-mem {gpu_mem_gib:g} GiB leaves a KV pool of {pool // per_block:,} {block_size}-token blocks, "
            f"more than {_cap_words(max_blocks)}; raise --block-size, lower --gpu-mem or set --num-blocks"
        )
    return MemoryBill(model, gpu, model.weight_bytes, reserve, note, block_size, model.kv_bytes_per_token,
                      pool // per_block, host_blocks, extra, layout=layout)  # fmt: skip


def _cap_words(max_blocks: int) -> str:
    if max_blocks == limits.MAX_SIM_BLOCKS:
        return (
            f"the {max_blocks:,} blocks the simulator builds (about 600 MiB of allocator metadata)"
        )
    if max_blocks == limits.MAX_BLOCK_IDS:
        return f"the {max_blocks:,} blocks int32 block ids allow"
    return f"the limit of {max_blocks:,} blocks"
