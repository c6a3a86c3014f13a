"""What the roofline step model needs beyond the memory bill: each model's shapes and experts,
and how tensor / pipeline parallelism splits them (docs/simulator.md, "The step-time model").

``Arch`` holds the numbers of a preset's ``config.json`` that the KV bill does not use:
hidden size (all-reduce bytes), query heads (attention FLOPs, what ``--tp`` must divide),
the per-head dimensions attention multiplies over, and the routed experts of a
mixture-of-experts model. Routed and dense parameters are split from the model card's total
and active counts: ``active = dense + routed x top_k / experts`` and ``total = dense + routed``.

With ``T`` tokens in a step and routing spread evenly, one layer touches
``experts x (1 - (1 - top_k / experts) ^ T)`` distinct experts, so the step reads that share
of the routed weights (all of them from a few dozen tokens on, for a big batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from ..errors import SimulationError
from ..models.spec import ModelSpec

__all__ = ["Arch", "ARCH", "arch_of", "Parallel", "parallel_layout"]


@dataclass(frozen=True)
class Arch:
    """Shapes the time model uses (``config.json`` values of the preset)."""

    hidden: int  # hidden_size: activation elements per token (all-reduce, pipeline sends)
    q_heads: int  # num_attention_heads
    qk_dim: int  # elements one query-key dot product multiplies (head_dim; MLA: latent)
    v_dim: int  # elements of one value row (head_dim; MLA: kv_lora_rank)
    experts: int = 0  # routed experts per MoE layer (0: dense model)
    top_k: int = 0  # routed experts per token


# (hidden_size, num_attention_heads, qk, v, n_routed_experts, experts per token)
ARCH: Dict[str, Arch] = {
    "llama-3.1-8b": Arch(4096, 32, 128, 128),
    "llama-3.1-70b": Arch(8192, 64, 128, 128),
    "qwen2.5-7b": Arch(3584, 28, 128, 128),
    "mistral-7b": Arch(4096, 32, 128, 128),
    # MLA, weights absorbed (as engines decode it): q . latent (512 + 64 rope), p . latent (512)
    "deepseek-v2-lite": Arch(2048, 16, 576, 512, 64, 6),
    "gpt-oss-20b": Arch(2880, 64, 64, 64, 32, 4),
    "gpt-oss-120b": Arch(2880, 64, 64, 64, 128, 4),
    "gemma-3-27b": Arch(5376, 32, 128, 128),
    "llama-4-scout": Arch(5120, 40, 128, 128, 16, 1),
    "qwen3-next-80b-a3b": Arch(2048, 16, 256, 256, 512, 10),
}


def arch_of(model: ModelSpec) -> Arch:
    """The preset's shapes; a custom model is taken as multi-head attention
    (query heads = KV heads, hidden = heads x head dim; MLA: 16 heads over a 2048 hidden)."""
    a = ARCH.get(model.name.lower())
    if a is not None:
        return a
    if model.latent_dim:
        return Arch(2048, 16, model.latent_dim, model.latent_dim)
    h = max(1, model.num_kv_heads)
    return Arch(h * model.head_dim, h, model.head_dim, model.head_dim)


def expert_split(model: ModelSpec, a: Arch) -> Tuple[float, float]:
    """(dense, routed) shares of the weights by parameter count (0 routed for a dense model)."""
    if not a.experts or model.active_params >= model.params:
        return 1.0, 0.0
    routed = (model.params - model.active_params) / (1.0 - a.top_k / a.experts)
    routed = min(routed, model.params)
    return 1.0 - routed / model.params, routed / model.params


@dataclass(frozen=True)
class Parallel:
    """How one replica splits the model over ``tp x pp`` GPUs."""

    tp: int = 1
    pp: int = 1
    kv_copies: int = 1  # times each KV element is stored (TP wider than the KV heads; MLA)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def kv_share(self) -> float:
        """Share of a token's KV one GPU holds and reads."""
        return self.kv_copies / (self.tp * self.pp)

    def describe(self) -> str:
        return f"TP {self.tp} x PP {self.pp} = {self.gpus} GPU{'s' if self.gpus > 1 else ''}"


def parallel_layout(model: ModelSpec, tp: int = 1, pp: int = 1) -> Parallel:
    """Check that ``tp`` and ``pp`` split ``model`` the way engines do, and say how the KV
    splits: TP divides the query heads and either divides the KV heads or is a multiple of
    them (each KV head then stored ``tp / kv_heads`` times); an MLA latent is stored whole on
    every TP rank; PP divides the layers."""
    from .. import limits

    tp = limits.TP.check_int(tp)
    pp = limits.PP.check_int(pp)
    a = arch_of(model)
    if a.q_heads % tp:
        raise SimulationError(
            f"--tp {tp} does not divide the {a.q_heads} attention heads of {model.name}"
        )
    copies = 1
    if model.latent_dim:
        copies = tp
    elif model.num_kv_heads % tp:
        if tp % model.num_kv_heads:
            raise SimulationError(
                f"--tp {tp} neither divides nor is a multiple of the {model.num_kv_heads} KV heads "
                f"of {model.name}"
            )
        copies = tp // model.num_kv_heads
    if model.num_layers % pp:
        raise SimulationError(
            f"--pp {pp} does not divide the {model.num_layers} layers of {model.name}"
        )
    return Parallel(tp, pp, copies)
