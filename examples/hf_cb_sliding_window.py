"""Sliding-window models under transformers' continuous batching with kvblocks: the saving, measured.

Runs tiny randomly initialised models (nothing is downloaded), 4 layers, window 32, page 16:
Gemma 2 (sliding and full layers alternating: two KV cache groups) and Mistral (every layer
windowed: one window group). 8 requests of a 200-token prompt generate 56 tokens each through
``generate_batch`` inside ``transformers_cb.enabled()``; the script checks the tokens against
transformers' own continuous batching and prints the most K/V bytes the requests held at once
(``peak_blocks_in_use * block_bytes``), next to the same model run with every layer as full
attention (``sliding_window=None``: its blocks hold every layer, so they are larger).

    pip install kvblocks[transformers-cb]
    python examples/hf_cb_sliding_window.py [--window 32] [--page 16]
"""

from __future__ import annotations

import argparse
import logging

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvblocks.integrations import transformers_cb
from kvblocks.testing import tiny_lm


def _model(family: str, window, layers: int = 4):
    torch.manual_seed(0)
    kw = tiny_lm(head_dim=16, num_hidden_layers=layers, max_position_embeddings=512)
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**kw, sliding_window=window, attn_logit_softcapping=None)
        if window is None:
            cfg.layer_types = ["full_attention"] * layers
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**kw, sliding_window=window)
        )
    model.config._attn_implementation = "sdpa"
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--page", type=int, default=16)
    args = ap.parse_args()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    prompts = [[(7 * i + j) % 120 + 3 for j in range(200)] for i in range(8)]
    gen = GenerationConfig(max_new_tokens=56, eos_token_id=-1, pad_token_id=0, do_sample=False)

    def run(model):
        cbc = ContinuousBatchingConfig(page_size=args.page, num_blocks=256, max_batch_tokens=512)
        out = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cbc, warmup=False
        )
        return [list(out[k].generated_tokens) for k in sorted(out)]

    print(f"8 requests x (200 prompt + 56 new tokens), window {args.window}, page {args.page}")
    print(f"{'model':8} {'groups':30} {'same tokens':>11} {'peak KiB':>9} {'all full':>9}")
    for family in ("gemma2", "mistral"):
        model = _model(family, args.window)
        reference = run(model)  # transformers' own continuous batching
        with transformers_cb.enabled() as kb:
            same = run(model) == reference
            groups, peak = kb.groups, kb.peak_blocks_in_use * kb.block_bytes >> 10
            run(_model(family, None))
            full = kb.peak_blocks_in_use * kb.block_bytes >> 10
        kb.check()
        names = ", ".join(g.kind + (f"({g.window})" if g.window else "") for g in groups)
        print(f"{family:8} {names:30} {str(same):>11} {peak:>9} {full:>9}")


if __name__ == "__main__":
    main()
