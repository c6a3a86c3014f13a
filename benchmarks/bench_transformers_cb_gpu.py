"""GPU decode with transformers' FlashAttention in-place path, with and without kvblocks.

On CUDA with ``flash_attention_2`` (the ``flash-attn`` package), transformers' continuous batching
runs all-decode batches through ``flash_attn_with_kvcache`` reading K/V in place through block
tables. This runs ``generate_batch`` on a small random Llama (fp16) three ways in one process:
transformers alone, kvblocks stage 1 (allocation) and stage 2 (native indices), checks the tokens
are identical, and reports wall time and tokens/s (median of ``--repeat``). Without CUDA or
flash-attn it prints why and exits 0 (skipped).

    python benchmarks/bench_transformers_cb_gpu.py [--json FILE] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("skipped: torch is not installed")
        return 0
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        print("skipped: flash-attn is not installed (the in-place decode path needs it)")
        return 0
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvblocks.integrations import transformers_cb

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    model.config._attn_implementation = "flash_attention_2"
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 32000, (512,), generator=g).tolist()
    prompts = [
        system + torch.randint(3, 32000, (64 + i,), generator=g).tolist()
        for i in range(args.prompts)
    ]
    gen = GenerationConfig(
        max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )

    def cbc():
        return ContinuousBatchingConfig(
            page_size=256, num_blocks=1024, max_batch_tokens=4096, max_blocks_per_request=32
        )

    def once(mode):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "transformers":
            out, kb = (
                model.generate_batch(
                    prompts, generation_config=gen, continuous_batching_config=cbc()
                ),
                None,
            )
        else:
            with transformers_cb.enabled(native_step=mode == "kvblocks stage 2") as kb:
                out = model.generate_batch(
                    prompts, generation_config=gen, continuous_batching_config=cbc()
                )
        torch.cuda.synchronize()
        toks = {k: list(v.generated_tokens) for k, v in out.items()}
        return time.perf_counter() - t0, toks, kb

    rows, ref = [], None
    for mode in ("transformers", "kvblocks stage 1", "kvblocks stage 2"):
        times = []
        for _ in range(args.repeat):
            wall, toks, kb = once(mode)
            times.append(wall)
        if ref is None:
            ref = toks
        same = sorted(toks.values()) == sorted(ref.values())
        wall = statistics.median(times)
        n = sum(len(v) for v in toks.values())
        row = dict(
            mode=mode,
            wall_s=round(wall, 3),
            tokens_per_s=round(n / wall, 1),
            identical=same,
            native_steps=kb.steps if kb is not None else 0,
        )
        rows.append(row)
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), args=vars(args), rows=rows), f, indent=1
            )
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
