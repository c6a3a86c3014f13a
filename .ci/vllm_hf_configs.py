"""Write an offline Hugging Face cache (hub layout) with config.json and
generation_config.json for the text models vLLM's tests/v1/core name, for .ci/vllm.

    python .ci/vllm_hf_configs.py HF_HOME

The configs are built from transformers' config classes with the architecture fields of the
public model cards (no weights, no tokenizer: the scheduler tests run no model). The
multimodal ids (llava-1.5-7b-hf, Qwen2.5-VL-3B) and Qwen3-Next / Qwen3.5 are not written:
they need tokenizers, processor configs or newer config classes, so their tests fail on both
sides alike.
"""

from __future__ import annotations

import json
import os
import sys

from transformers import LlamaConfig, OPTConfig, Qwen2Config, Qwen3Config

COMMIT = "0" * 40


def put(home: str, repo: str, cfg, gen: dict) -> None:
    root = os.path.join(home, "hub", "models--" + repo.replace("/", "--"))
    snap = os.path.join(root, "snapshots", COMMIT)
    os.makedirs(snap, exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(COMMIT)
    cfg.save_pretrained(snap)
    with open(os.path.join(snap, "generation_config.json"), "w") as f:
        json.dump(gen, f)


def main(home: str) -> None:
    opt = dict(
        bos_token_id=2,
        eos_token_id=2,
        pad_token_id=1,
        architectures=["OPTForCausalLM"],
        max_position_embeddings=2048,
        vocab_size=50272,
        torch_dtype="float16",
    )
    put(
        home,
        "facebook/opt-125m",
        OPTConfig(
            hidden_size=768,
            num_hidden_layers=12,
            ffn_dim=3072,
            num_attention_heads=12,
            word_embed_proj_dim=768,
            do_layer_norm_before=True,
            **opt,
        ),
        {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1},
    )
    put(
        home,
        "facebook/opt-350m",
        OPTConfig(
            hidden_size=1024,
            num_hidden_layers=24,
            ffn_dim=4096,
            num_attention_heads=16,
            word_embed_proj_dim=512,
            do_layer_norm_before=False,
            **opt,
        ),
        {"bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1},
    )
    put(
        home,
        "Qwen/Qwen3-0.6B",
        Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            max_position_embeddings=40960,
            rope_theta=1000000,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
            max_window_layers=28,
            torch_dtype="bfloat16",
            architectures=["Qwen3ForCausalLM"],
        ),
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643]},
    )
    put(
        home,
        "Qwen/Qwen1.5-7B",
        Qwen2Config(
            vocab_size=151936,
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            max_position_embeddings=32768,
            rope_theta=1000000,
            tie_word_embeddings=False,
            bos_token_id=151643,
            eos_token_id=151643,
            torch_dtype="bfloat16",
            architectures=["Qwen2ForCausalLM"],
        ),
        {"bos_token_id": 151643, "eos_token_id": 151643},
    )
    put(
        home,
        "vllm-project/tiny-random-LlamaForCausalLM",
        LlamaConfig(
            vocab_size=32000,
            hidden_size=16,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            bos_token_id=1,
            eos_token_id=2,
            torch_dtype="float32",
            architectures=["LlamaForCausalLM"],
        ),
        {"bos_token_id": 1, "eos_token_id": 2},
    )


if __name__ == "__main__":
    main(sys.argv[1])
