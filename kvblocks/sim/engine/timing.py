"""The per-step time model of a continuous-batching engine: a roofline per step.

One engine step runs every scheduled token (``T = prefill + decode`` tokens) through the model
once. On each GPU of a replica (``--tp`` ways tensor parallel, ``--pp`` pipeline stages run
one after the other), the step lasts::

    step = host
         + max(weight bytes read / (HBM x bandwidth_eff),  2 x active params x T / (peak x compute_eff))
         + max(KV bytes read and written / (HBM x bandwidth_eff),  attention FLOPs / (bf16 peak x attention_eff))
         + all-reduces (TP) + activation sends (PP) + swap / host-tier copies

* **GEMMs** are a roofline, not a sum: a small batch is bound by reading the weights once (the
  decode tokens ride on that read), a large prefill chunk by FLOPs. A mixture-of-experts model
  reads its dense weights and the routed experts its ``T`` tokens are expected to touch
  (:mod:`kvblocks.sim.engine.roofline`). fp8 weights on an fp8 GPU use its fp8 peak.
* **Attention** reads each decoding sequence's cached KV once (a window layer at most its
  window, a chunk layer its current chunk, a state layer its state: :meth:`kv_tokens_read`),
  reads the prefix of each prefill chunk once and writes the KV of every computed token. Its
  FLOPs are ``2 x (qk + v) x query heads x layers`` per (query, key) pair: linear in the
  context for a decode token, quadratic in the prompt for a prefill (:meth:`prefill_attention`).
* **Tensor parallelism**: each GPU reads ``1/tp`` of the weights and its share of the KV, and
  every layer ends in two all-reduces of ``T x hidden`` bf16 activations (ring:
  ``2 (tp - 1) / tp`` of the bytes over the link, plus ``--collective-us`` each).
* **Pipeline parallelism**: a step's batch passes the ``pp`` stages in turn (one batch in
  flight, as the simulator runs one engine loop), so the stages' times add up to the unsplit
  model's plus ``pp - 1`` activation sends; each GPU idles ``(pp - 1) / pp`` of the time (the
  bubble). PP buys memory, not speed, in this model.
* **host**: scheduling, sampling and kernel launches, per step (``--step-overhead-ms``).

Every constant is overridable (``--compute-eff``, ``--bandwidth-eff``, ``--attention-eff``,
``--link-eff``, ``--collective-us``, ``--peak-tflops``, ``--hbm-tbs``, ``--link-gbs``) and
``--calibrate FILE`` fits the efficiencies and the host overhead to measured steps
(:mod:`kvblocks.sim.engine.calibrate`). The old per-token knobs remain: ``--prefill-us`` /
``--decode-us`` replace the FLOP side of the GEMM roofline by that many microseconds a token,
``--kv-read-ns`` the cost of each cached token a decode reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import numpy as np

from .. import limits
from ..models.gpus import DEFAULT_GPU, GpuSpec, get_gpu
from ..models.spec import ModelSpec
from .roofline import Parallel, arch_of, expert_split, parallel_layout

__all__ = ["TimeModel", "Efficiency", "PEAK_FLOPS", "HBM_BYTES_PER_S"]

_H100 = get_gpu(DEFAULT_GPU)
PEAK_FLOPS = _H100.bf16_tflops * 1e12
HBM_BYTES_PER_S = _H100.hbm_tb_s * 1e12
SWAP_BYTES_PER_S = 25e9
ACT_BYTES = 2  # activations travel as bf16


@dataclass(frozen=True)
class Efficiency:
    """The fraction of each peak a step reaches, and the fixed costs (the calibrated constants)."""

    compute: float = 0.6  # GEMM FLOP/s over the datasheet peak
    bandwidth: float = 0.8  # HBM bytes/s over the datasheet peak
    attention: float = 0.5  # attention-kernel FLOP/s over the bf16 peak
    link: float = 0.7  # all-reduce bus bandwidth over the link's
    host_ms: float = 1.0  # host work per step, ms
    collective_us: float = 8.0  # latency of one all-reduce or pipeline send, us

    def check(self) -> "Efficiency":
        for lim, v in ((limits.COMPUTE_EFF, self.compute), (limits.BANDWIDTH_EFF, self.bandwidth),
                       (limits.ATTENTION_EFF, self.attention), (limits.LINK_EFF, self.link),
                       (limits.STEP_OVERHEAD_MS, self.host_ms), (limits.COLLECTIVE_US, self.collective_us)):  # fmt: skip
            lim.check(v)
        return self


def _window_pairs(n: np.ndarray, span: int, kind: str) -> np.ndarray:
    """Sum over query positions ``0..n-1`` of the keys each attends to."""
    if kind == "sliding_window":
        m = np.minimum(n, span)
        return m * (m + 1) / 2.0 + (n - m) * float(span)
    if kind == "chunked_local":
        q, r = np.divmod(n, span)
        return q * (span * (span + 1) / 2.0) + r * (r + 1) / 2.0
    return n * (n + 1) / 2.0


@dataclass(frozen=True)
class TimeModel:
    """Seconds per engine step as a roofline of the work in it (see the module docstring)."""

    host_s: float = 1e-3  # per step
    dense_bytes: float = 0.0  # weight bytes one step reads on one GPU, experts aside
    expert_bytes: float = 0.0  # routed-expert bytes on one GPU (all experts)
    expert_skip: float = 1.0  # chance that one token does not route to a given expert
    flops_per_token: float = 0.0  # GEMM FLOPs per token on one GPU
    prefill_pair_flops: float = 0.0  # attention FLOPs per (query, key) pair on one GPU
    decode_pair_flops: float = 0.0
    kv_bytes_per_token: float = 0.0  # KV bytes one GPU holds (reads, writes) per token
    mem_bytes_per_s: float = HBM_BYTES_PER_S * 0.8
    gemm_flops_per_s: float = PEAK_FLOPS * 0.6
    attn_flops_per_s: float = PEAK_FLOPS * 0.5
    comm_s_per_step: float = 0.0  # collective latencies of one step (TP all-reduces, PP sends)
    comm_s_per_token: float = 0.0  # their bytes, per token of the step
    prefill_s_per_token: float = 0.0  # > 0: GEMM FLOP side fixed per prefill token (--prefill-us)
    decode_s_per_token: float = 0.0  # > 0: ... per decode token (--decode-us)
    kv_read_s_per_token: float = 0.0  # seconds per cached token a decode reads (KV bytes / bw)
    swap_bytes_per_s: float = SWAP_BYTES_PER_S
    # hybrid models: (kind, span, share of the per-token bytes) per attention kind, and the
    # state a decoding token reads, in tokens' worth of KV (see kv_tokens_read); () = full
    read_kinds: Tuple[Tuple[str, int, float], ...] = ()
    state_read_tokens: float = 0.0
    parallel: Parallel = Parallel()
    gpu: str = DEFAULT_GPU
    eff: Efficiency = field(default_factory=Efficiency)

    @property
    def windowed_reads(self) -> bool:
        """Whether reads depend on more than the context length (hybrid models)."""
        return bool(self.read_kinds)

    @property
    def step_overhead_s(self) -> float:
        """The cost of an empty step: host work, the dense weights' read, the collectives."""
        return self.host_s + self.dense_bytes / self.mem_bytes_per_s + self.comm_s_per_step

    def kv_tokens_read(self, ctx: Any) -> float:
        """Tokens' worth of KV the decoding sequences of context lengths ``ctx`` read in one
        step: a full layer reads the whole context, a window layer at most its window, a
        chunk layer the current chunk so far, a state layer its state."""
        if not self.read_kinds:
            return int(np.sum(ctx))
        c = np.asarray(ctx, dtype=np.int64)
        total = self.state_read_tokens * c.size
        for kind, span, share in self.read_kinds:
            if kind == "sliding_window":
                total += share * float(np.minimum(c, span).sum())
            elif kind == "chunked_local":
                total += share * float(((c - 1) % span + 1).sum())
            else:
                total += share * float(c.sum())
        return total

    def prefill_attention(self, chunks: Iterable[Tuple[int, int]]) -> Tuple[float, float]:
        """(query-key pairs, KV tokens read) of prefill chunks ``(start, length)``: a chunk's
        queries attend to every earlier token of their sequence (a window layer to at most
        its window, a chunk layer within its chunk); the chunk reads its prefix once."""
        if not self.read_kinds:
            chunks = chunks if isinstance(chunks, list) else list(chunks)
            if len(chunks) < 8:  # the common case in plain floats, bit for bit numpy's sum below
                pairs = reads = 0.0  # (numpy adds fewer than 8 values one by one, in order)
                for p0, c0 in chunks:
                    a, b = float(p0), float(p0 + c0)
                    pairs += b * (b + 1) / 2.0 - a * (a + 1) / 2.0
                    reads += b
                return pairs, reads
        ch = np.asarray(list(chunks), dtype=np.float64).reshape(-1, 2)
        if not ch.size:
            return 0.0, 0.0
        p, c = ch[:, 0], ch[:, 1]
        kinds = self.read_kinds or (("full", 0, 1.0),)
        pairs = reads = 0.0
        for kind, span, share in kinds:
            pr = _window_pairs(p + c, span, kind) - _window_pairs(p, span, kind)
            rd = np.minimum(p + c, span + c) if kind != "full" else p + c
            pairs += share * float(pr.sum())
            reads += share * float(rd.sum())
        return pairs, reads

    def step(
        self,
        prefill_tokens: int,
        decode_tokens: int,
        kv_tokens_read: float,
        swap_bytes: int = 0,
        prefill_pairs: float = 0.0,
        prefill_reads: float = 0.0,
    ) -> float:
        """Seconds one step takes (``prefill_pairs`` / ``prefill_reads``: from
        :meth:`prefill_attention` of the step's chunks)."""
        t = prefill_tokens + decode_tokens
        wbytes = self.dense_bytes
        if self.expert_bytes and t:
            wbytes += self.expert_bytes * (1.0 - self.expert_skip**t)
        if self.prefill_s_per_token or self.decode_s_per_token:
            flop_s = prefill_tokens * (
                self.prefill_s_per_token or self.flops_per_token / self.gemm_flops_per_s
            )
            flop_s += decode_tokens * (
                self.decode_s_per_token or self.flops_per_token / self.gemm_flops_per_s
            )
        else:
            flop_s = t * self.flops_per_token / self.gemm_flops_per_s
        read_s = wbytes / self.mem_bytes_per_s
        gemm = read_s if read_s > flop_s else flop_s
        kv_s = (kv_tokens_read * self.kv_read_s_per_token
                + (prefill_reads + t) * self.kv_bytes_per_token / self.mem_bytes_per_s)  # fmt: skip
        attn_f = (
            kv_tokens_read * self.decode_pair_flops + prefill_pairs * self.prefill_pair_flops
        ) / self.attn_flops_per_s
        attn = kv_s if kv_s > attn_f else attn_f
        return (
            self.host_s
            + gemm
            + attn
            + self.comm_s_per_step
            + t * self.comm_s_per_token
            + swap_bytes / self.swap_bytes_per_s
        )

    def decode_step(self, n: int) -> Callable[[int], float]:
        """``step(0, n, kv, 0, 0.0, 0.0)`` as a function of ``kv`` alone, bit for bit (the
        same operations in the same order; what does not depend on ``kv`` is computed once):
        the duration of a step in which ``n`` sequences decode and nothing else happens."""
        if type(self).step is not TimeModel.step:  # a subclass prices steps its own way
            return lambda kv: self.step(0, n, kv, 0, 0.0, 0.0)
        t = 0 + n
        wbytes = self.dense_bytes
        if self.expert_bytes and t:
            wbytes += self.expert_bytes * (1.0 - self.expert_skip**t)
        if self.prefill_s_per_token or self.decode_s_per_token:
            flop_s = 0 * (self.prefill_s_per_token or self.flops_per_token / self.gemm_flops_per_s)
            flop_s += n * (self.decode_s_per_token or self.flops_per_token / self.gemm_flops_per_s)
        else:
            flop_s = t * self.flops_per_token / self.gemm_flops_per_s
        read_s = wbytes / self.mem_bytes_per_s
        head = self.host_s + (read_s if read_s > flop_s else flop_s)  # host + gemm
        ks = self.kv_read_s_per_token
        kb = (0.0 + t) * self.kv_bytes_per_token / self.mem_bytes_per_s
        dpf, ppf0, afs = (
            self.decode_pair_flops,
            0.0 * self.prefill_pair_flops,
            self.attn_flops_per_s,
        )
        comm, tc, sw = self.comm_s_per_step, t * self.comm_s_per_token, 0 / self.swap_bytes_per_s

        def step(kv: int) -> float:
            kv_s = kv * ks + kb
            attn_f = (kv * dpf + ppf0) / afs
            return head + (kv_s if kv_s > attn_f else attn_f) + comm + tc + sw

        return step

    @classmethod
    def for_model(
        cls,
        model: ModelSpec,
        step_overhead_ms: Optional[float] = None,
        prefill_us: Optional[float] = None,
        decode_us: Optional[float] = None,
        kv_read_ns: Optional[float] = None,
        gpu: Optional[GpuSpec] = None,
        tp: int = 1,
        pp: int = 1,
        eff: Optional[Efficiency] = None,
        peak_tflops: Optional[float] = None,
        hbm_tbs: Optional[float] = None,
        link_gbs: Optional[float] = None,
    ) -> "TimeModel":
        """The roofline of ``model`` on ``gpu`` (H100-SXM by default) split ``tp`` x ``pp``;
        every constant overridable (see the module docstring)."""
        for lim, v in ((limits.STEP_OVERHEAD_MS, step_overhead_ms), (limits.PREFILL_US, prefill_us),
                       (limits.DECODE_US, decode_us), (limits.KV_READ_NS, kv_read_ns),
                       (limits.PEAK_TFLOPS, peak_tflops), (limits.HBM_TBS, hbm_tbs),
                       (limits.LINK_GBS, link_gbs)):  # fmt: skip
            if v is not None:
                lim.check(v)
        g = gpu or _H100
        e = (eff or Efficiency()).check()
        if step_overhead_ms is not None:
            e = replace(e, host_ms=step_overhead_ms)
        par = parallel_layout(model, tp, pp)
        a = arch_of(model)
        peak = peak_tflops * 1e12 if peak_tflops is not None else g.peak_flops(model.weight_dtype)
        bf16 = peak_tflops * 1e12 if peak_tflops is not None else g.bf16_tflops * 1e12
        mem = (hbm_tbs if hbm_tbs is not None else g.hbm_tb_s) * 1e12 * e.bandwidth
        link = (link_gbs if link_gbs is not None else g.link_gb_s) * 1e9 * e.link
        dense, routed = expert_split(model, a)
        wbytes = model.weight_bytes / par.tp  # the pp stages run in turn: their reads add up
        kv_tok = model.kv_bytes_per_token * par.kv_copies / par.tp
        pair = 2.0 * (a.qk_dim + a.v_dim) * a.q_heads * model.attention_layers / par.tp
        comm_step = comm_tok = 0.0
        if par.tp > 1:  # two all-reduces per layer (attention out, MLP out)
            n = 2 * model.num_layers
            comm_step += n * e.collective_us * 1e-6
            comm_tok += n * 2.0 * (par.tp - 1) / par.tp * a.hidden * ACT_BYTES / link
        if par.pp > 1:
            comm_step += (par.pp - 1) * e.collective_us * 1e-6
            comm_tok += (par.pp - 1) * a.hidden * ACT_BYTES / link
        kinds: Tuple[Tuple[str, int, float], ...] = ()
        state = 0.0
        if model.hybrid:
            kinds = tuple(model.read_weights())
            state = model.state_bytes_per_seq / model.kv_bytes_per_token
        return cls(
            host_s=e.host_ms * 1e-3,
            dense_bytes=wbytes * dense,
            expert_bytes=wbytes * routed,
            expert_skip=1.0 - a.top_k / a.experts if a.experts and routed else 1.0,
            flops_per_token=2.0 * model.active_params / par.tp,
            prefill_pair_flops=pair,
            decode_pair_flops=pair,
            kv_bytes_per_token=kv_tok,
            mem_bytes_per_s=mem,
            gemm_flops_per_s=peak * e.compute,
            attn_flops_per_s=bf16 * e.attention,
            comm_s_per_step=comm_step,
            comm_s_per_token=comm_tok,
            prefill_s_per_token=prefill_us * 1e-6 if prefill_us is not None else 0.0,
            decode_s_per_token=decode_us * 1e-6 if decode_us is not None else 0.0,
            kv_read_s_per_token=kv_read_ns * 1e-9 if kv_read_ns is not None else kv_tok / mem,
            read_kinds=kinds,
            state_read_tokens=state,
            parallel=par,
            gpu=g.name,
            eff=e,
        )

    def describe(self) -> str:
        """One line: the step's fixed part and its per-token slopes."""
        p = self.parallel
        flop_us = self.flops_per_token / self.gemm_flops_per_s * 1e6
        read_us = (self.dense_bytes + self.expert_bytes) / self.mem_bytes_per_s * 1e6
        ridge = (
            f" (compute-bound above {read_us / flop_us:,.0f} tokens/step)" if flop_us > 0 else ""
        )
        return (
            f"roofline on {p.describe()} {self.gpu}: {self.host_s * 1e3:.2f} ms host + "
            f"max({read_us * 1e-3:.2f} ms weights, {flop_us:.2f} us/token){ridge} + "
            f"{self.kv_read_s_per_token * 1e9:.1f} ns/KV token read"
            + (
                f" + {self.comm_s_per_step * 1e3:.2f} ms collectives"
                if self.comm_s_per_step
                else ""
            )
        )

    def as_dict(self) -> Dict[str, Any]:
        e = self.eff
        return {
            "model": "roofline",
            "gpu": self.gpu,
            "tp": self.parallel.tp,
            "pp": self.parallel.pp,
            "kv_copies": self.parallel.kv_copies,
            "pipeline_bubble": (self.parallel.pp - 1) / self.parallel.pp,
            "host_ms": self.host_s * 1e3,
            "step_overhead_ms": self.step_overhead_s * 1e3,
            "weight_bytes_per_gpu_step": self.dense_bytes + self.expert_bytes,
            "dense_weight_bytes": self.dense_bytes,
            "expert_weight_bytes": self.expert_bytes,
            "gemm_flops_per_token": self.flops_per_token,
            "attention_flops_per_pair": self.prefill_pair_flops,
            "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token,
            "mem_bytes_per_s": self.mem_bytes_per_s,
            "gemm_flops_per_s": self.gemm_flops_per_s,
            "attention_flops_per_s": self.attn_flops_per_s,
            "collectives_ms_per_step": self.comm_s_per_step * 1e3,
            "collectives_ns_per_token": self.comm_s_per_token * 1e9,
            "prefill_us_per_token": self.prefill_s_per_token * 1e6 or None,
            "decode_us_per_token": self.decode_s_per_token * 1e6 or None,
            "kv_read_ns_per_token": self.kv_read_s_per_token * 1e9,
            "swap_gb_per_s": self.swap_bytes_per_s / 1e9,
            "efficiency": {
                "compute": e.compute,
                "bandwidth": e.bandwidth,
                "attention": e.attention,
                "link": e.link,
                "host_ms": e.host_ms,
                "collective_us": e.collective_us,
            },
        }
