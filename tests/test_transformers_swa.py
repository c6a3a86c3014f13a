"""PagedKVCache on models with sliding-window layers (kvblocks KV cache groups).

Tiny random models whose window (5 tokens) is shorter than the generations, so the window
groups release blocks within every test; generated tokens are compared with transformers'
default cache (``DynamicCache(config=...)``, whose sliding layers keep the last ``W - 1`` tokens).
"""

import copy

import numpy as np
import pytest
from helpers import TINY_LM, left_padded

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.cache_utils", reason="needs the transformers Cache API")

from transformers import DynamicCache  # noqa: E402

from kvblocks import (  # noqa: E402
    InvalidStateError,
    KVGroup,
    NotSupportedError,
    OutOfBlocksError,
)
from kvblocks.groups import plan_groups  # noqa: E402
from kvblocks.integrations.transformers import PagedKVCache, dynamic_cache_bytes  # noqa: E402
from kvblocks.integrations.transformers.config import layer_windows  # noqa: E402

torch.set_num_threads(1)

VOCAB, PAD, BOS, EOS = 128, 0, 1, 2
BLOCK, WINDOW = 4, 5
CACHE_KW = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"
_COMMON = dict(  # every family sets its own num_hidden_layers
    TINY_LM, vocab_size=VOCAB, head_dim=16, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS
)


def _family(model_cls, config_cls, **kw):
    model = getattr(transformers, model_cls, None)
    config = getattr(transformers, config_cls, None)
    if model is None or config is None:  # pragma: no cover - depends on the installed version
        return pytest.param(None, marks=pytest.mark.skip(reason=f"no {model_cls}"))
    return (model, config, dict(_COMMON, **kw))


FAMILIES = {
    # layer_types alternating sliding / full
    "gemma2": _family(
        "Gemma2ForCausalLM", "Gemma2Config", num_hidden_layers=4, sliding_window=WINDOW
    ),
    # every layer windowed (sliding_window, no layer_types)
    "mistral": _family(
        "MistralForCausalLM", "MistralConfig", num_hidden_layers=2, sliding_window=WINDOW
    ),
    # layer_types from use_sliding_window / max_window_layers: full below, sliding above
    "qwen2": _family(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    ),
    # gpt-oss: alternating sliding / full layers, attention sinks, mixture of experts
    "gpt_oss": _family(
        "GptOssForCausalLM",
        "GptOssConfig",
        num_hidden_layers=2,
        intermediate_size=64,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
}
_MODELS = {}


def _model(name):
    if name not in _MODELS:
        cls, config_cls, kw = FAMILIES[name]
        torch.manual_seed(0)
        model = cls(config_cls(**kw)).eval()
        model.generation_config.eos_token_id = None  # every row generates max_new_tokens
        model.generation_config.pad_token_id = PAD
        _MODELS[name] = model
    return _MODELS[name]


def _families(*names):
    return [pytest.param(n, id=n, marks=getattr(FAMILIES[n], "marks", ())) for n in names]


def _prompts(lengths, seed=0):
    return left_padded(lengths, VOCAB, PAD, seed)


def _generate(model, ids, mask, cache, **kw):
    kw.setdefault("max_new_tokens", 10)
    kw.setdefault("do_sample", False)
    kw[CACHE_KW] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **kw)


def _reference(model, ids, mask, **kw):
    dyn = DynamicCache(config=model.config)
    return _generate(model, ids, mask, dyn, **kw), dynamic_cache_bytes(dyn)


def _cache(model, num_blocks=96, **kw):
    return PagedKVCache(model.config, num_blocks=num_blocks, block_size=BLOCK, **kw)


def _window_groups(cache):
    return [g for g, group in enumerate(cache.groups) if group.window is not None]


def _released(cache):
    """Leading null entries of every row's table in every window group."""
    out = []
    for g in _window_groups(cache):
        for t in cache.block_tables(g):
            out.append(int(np.argmax(t != 0)))
    return out


def _tables(cache):
    return [t.tolist() for g in range(len(cache.groups)) for t in cache.block_tables(g)]


# ---------------------------------------------------------------------------------------------
def test_layer_kinds_map_to_groups():
    gemma = _model("gemma2").config
    assert layer_windows(gemma, 4) == [WINDOW, None, WINDOW, None]
    cache = _cache(_model("gemma2"))
    assert cache.groups == (KVGroup("full"), KVGroup("sliding_window", window=WINDOW))
    assert cache.manager.groups == cache.groups and cache.layers_per_block == 2
    assert cache.is_sliding == [True, False, True, False]
    mistral = _cache(_model("mistral"))
    assert mistral.groups == (KVGroup("sliding_window", window=WINDOW),)
    assert mistral.layers_per_block == 2 and mistral.is_sliding == [True, True]
    # Gemma 3's 5 local : 1 global: one block per group holds as many layers as the full
    # group has, so the full-attention K/V waste nothing; the local layers split in 5 groups
    plan = plan_groups([WINDOW] * 5 + [None])
    assert plan.layers_per_block == 1 and len(plan.groups) == 6
    assert plan.layer_group == (1, 2, 3, 4, 5, 0)
    # 2 full, 3 sliding: the third sliding layer takes a group of its own, half used
    plan = plan_groups([None, 8, 8, None, 8])
    assert plan.groups == (KVGroup("full"),) + (KVGroup("sliding_window", window=8),) * 2
    assert plan.layer_group == (0, 1, 1, 0, 2) and plan.layer_slot == (0, 0, 1, 1, 0)
    # two windows: one group each
    assert len(plan_groups([4, 8, 4, 8]).groups) == 2


def test_mask_sizes_follow_the_sliding_layer():
    """get_mask_sizes of a window layer is DynamicSlidingWindowLayer's, at every length."""
    model = _model("gemma2")
    cache, dyn = _cache(model), DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(0)
    for q in (7, 1, 1, 3, 1):
        for layer in range(4):
            assert cache.get_mask_sizes(q, layer) == dyn.get_mask_sizes(q, layer)
            k = torch.randn(2, 2, q, 16, generator=g)
            got = cache.update(k, k + 1, layer)
            want = dyn.update(k, k + 1, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cache.get_seq_length() == dyn.get_seq_length() == 13
    assert max(_released(cache)) > 0
    cache.manager.check()


@pytest.mark.parametrize("name", _families("gemma2", "mistral", "qwen2", "gpt_oss"))
def test_greedy_padded_batch(name):
    model = _model(name)
    ids, mask = _prompts([3, 11, 7], seed=1)  # longer and shorter than the window
    ref, _ = _reference(model, ids, mask, max_new_tokens=12)
    cache = _cache(model)
    assert torch.equal(_generate(model, ids, mask, cache, max_new_tokens=12), ref)
    # 22 tokens per row: the window of position 21 starts at 17, so blocks 0-3 are released
    assert _released(cache) and min(_released(cache)) == (21 - WINDOW + 1) // BLOCK
    cache.manager.check()
    cache.reset()
    assert cache.manager.pool.usage == 0


@pytest.mark.parametrize("name", _families("gemma2", "mistral", "qwen2"))
def test_beam_search(name):
    model = _model(name)
    ids, mask = _prompts([9, 4], seed=2)
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=10)
    ref, ref_bytes = _reference(model, ids, mask, **kw)
    cache = _cache(model)
    assert torch.equal(_generate(model, ids, mask, cache, **kw), ref)
    assert cache.stats["forks"] > 0 and min(_released(cache)) > 0
    cache.manager.check()


def test_chunked_prefill_past_the_window():
    """Multi-token passes after the window moved: each reads [start - W + 1, end)."""
    model = _model("gemma2")
    ids, mask = _prompts([17, 10], seed=3)
    ref, _ = _reference(model, ids, mask, prefill_chunk_size=4)
    cache = _cache(model)
    assert torch.equal(_generate(model, ids, mask, cache, prefill_chunk_size=4), ref)
    cache.manager.check()


def test_prompt_lookup_crops_within_the_window():
    """Speculative candidates are verified in one pass and rejected ones cropped."""
    model = _model("gemma2")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    ref, _ = _reference(model, ids, torch.ones_like(ids), prompt_lookup_num_tokens=3)
    cache = _cache(model)
    out = _generate(model, ids, torch.ones_like(ids), cache, prompt_lookup_num_tokens=3)
    assert torch.equal(out, ref)
    cache.manager.check()


def test_kv_bytes_held_shows_the_window_saving():
    model = _model("gemma2")
    ids, mask = _prompts([30], seed=4)
    cache = _cache(model)
    _, dyn_bytes = _reference(model, ids, mask, max_new_tokens=8)
    _generate(model, ids, mask, cache, max_new_tokens=8)
    n = 30 + 8 - 1  # tokens held (the last one is never fed back)
    full_blocks = -(-n // BLOCK)
    # the last pass computed position n - 1: its window starts at n - W = 32, a block boundary
    # (a window one longer would keep block 7 too)
    window_blocks = full_blocks - (n - 1 - WINDOW + 1) // BLOCK
    assert cache.num_blocks_held() == full_blocks + window_blocks == 10 + 2
    per_layer_block = 2 * BLOCK * 2 * 16 * 4  # K and V, 2 heads x 16, fp32
    assert cache.bytes_per_block == 2 * per_layer_block  # 2 layers per group
    assert cache.kv_bytes_held() == (full_blocks + window_blocks) * 2 * per_layer_block
    # every layer full attention would hold 4 layers x 10 blocks
    all_full = full_blocks * 4 * per_layer_block
    assert cache.kv_bytes_held() < all_full
    # DynamicCache: 2 full layers x 37 tokens + 2 sliding layers x (W - 1) tokens
    assert dyn_bytes == (2 * n + 2 * (WINDOW - 1)) * per_layer_block // BLOCK
    assert cache.stats["kv_bytes_held"] == cache.kv_bytes_held()


def test_prefix_hits_across_calls():
    model = _model("gemma2")
    ids, mask = _prompts([14, 14], seed=5)
    ref, _ = _reference(model, ids, mask, max_new_tokens=6)
    cache = _cache(model)
    for hits in (0, 12):  # 14 tokens: 3 full blocks, one token left to compute
        assert cache.prepare(ids, mask, model=model) == hits
        assert torch.equal(_generate(model, ids, mask, cache, max_new_tokens=6), ref)
        cache.manager.check()
    # rows that could reuse different amounts all reuse the smallest hit
    longer = torch.cat([ids[:1], ids[:1, :6]], 1)  # row 0 extended: hits 12 of its 20
    other, _ = _prompts([20], seed=6)
    batch = torch.cat([longer, other])
    ref, _ = _reference(model, batch, torch.ones_like(batch), max_new_tokens=4)
    assert cache.prepare(batch, torch.ones_like(batch), model=model) == 0
    out = _generate(model, batch, torch.ones_like(batch), cache, max_new_tokens=4)
    assert torch.equal(out, ref)
    cache.manager.check()


def test_whole_prompt_again_after_prefix_hits_refused():
    model = _model("gemma2")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    cache = _cache(model)
    cache.generate(model, ids, max_new_tokens=2, do_sample=False)
    cache.prepare(ids, model=model)
    with pytest.raises(NotSupportedError, match="sliding-window"):
        _generate(model, ids, None, cache, prompt_lookup_num_tokens=3)
    cache.reset()
    cache.manager.check()
    assert cache.manager.pool.usage == 0


def test_out_of_blocks_leaves_every_group_unchanged():
    model = _model("gemma2")
    ids, mask = _prompts([30, 30])
    cache = _cache(model, num_blocks=24)  # 2 rows x (8 full + 8 window) blocks: no
    with pytest.raises(OutOfBlocksError):
        _generate(model, ids, mask, cache)
    assert cache.manager.pool.usage == 0  # the failed prefill left nothing behind
    ids, mask = _prompts([12, 12], seed=7)
    ref, _ = _reference(model, ids, mask, max_new_tokens=1)
    assert torch.equal(_generate(model, ids, mask, cache, max_new_tokens=1), ref)
    cache.reset()
    # decoding runs out: the full groups grow by a block every 4 tokens, the window groups
    # hold at most 3 blocks per row
    small = _cache(model, num_blocks=15)
    with pytest.raises(OutOfBlocksError):
        _generate(model, ids, mask, small, max_new_tokens=40)
    before = _tables(small)
    assert before and small.stats["rows"] == 2
    with pytest.raises(InvalidStateError, match=r"reset\(\)"):
        _generate(model, ids, mask, small)
    assert _tables(small) == before
    small.manager.check()
    small.reset()
    assert small.manager.pool.usage == 0


def test_failure_between_layers_caches_nothing_and_needs_reset():
    """A pass that raises after layer 0 (a device OOM, an interrupt): nothing it wrote enters
    the prefix cache of any group, and the cache refuses until reset() / prepare()."""
    model = _model("gemma2")
    ids, mask = _prompts([13, 13], seed=8)
    ref, _ = _reference(model, ids, mask)
    cache = _cache(model)

    def boom(*args):
        raise RuntimeError("injected failure in layer 2")

    cache.prepare(ids, mask, model=model)
    handle = model.model.layers[2].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            _generate(model, ids, mask, cache)
    finally:
        handle.remove()
    with pytest.raises(InvalidStateError, match=r"reset\(\)"):
        _generate(model, ids, mask, cache)
    cache.manager.check()
    assert cache.prepare(ids, mask, model=model) == 0  # nothing was declared computed
    assert torch.equal(_generate(model, ids, mask, cache), ref)
    cache.reset()
    assert cache.manager.pool.usage == 0


def test_crop_below_the_window_refused_unchanged():
    model = _model("gemma2")
    ids, mask = _prompts([20], seed=9)
    cache = _cache(model)
    _generate(model, ids, mask, cache, max_new_tokens=4)  # 23 tokens
    before = _tables(cache)
    with pytest.raises(InvalidStateError, match="released"):
        cache.crop(-10)
    assert _tables(cache) == before and cache.get_seq_length() == 23
    cache.crop(-2)  # within the window: fine
    assert cache.get_seq_length() == 21
    cache.manager.check()


def test_deepcopy_forks_every_group():
    model = _model("mistral")
    ids, mask = _prompts([13], seed=10)
    prompt_cache = _cache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE_KW: prompt_cache})
    ref, _ = _reference(model, ids, mask, max_new_tokens=6)
    cache = copy.deepcopy(prompt_cache)
    assert cache.is_sliding == [True, True] and cache.groups == prompt_cache.groups
    assert torch.equal(_generate(model, ids, mask, cache, max_new_tokens=6), ref)
    cache.reset()
    prompt_cache.reset()
    assert prompt_cache.manager.pool.usage == 0


def test_unsupported_layers_refused():
    llama = transformers.LlamaConfig(**dict(_COMMON, num_hidden_layers=2))
    for kinds, why in (
        (["chunked_attention", "full_attention"], "chunked local attention"),
        (["linear_attention", "full_attention"], "recurrent state"),
        (["sliding_attention", "full_attention"], "without a positive sliding_window"),
    ):
        llama.layer_types = kinds
        with pytest.raises(NotSupportedError, match=why):
            PagedKVCache(llama, num_blocks=8)
