"""transformers generation on a kvblocks paged KV cache (kvblocks.integrations.transformers).

Tiny randomly initialised models built from configs (no downloads); every test compares the
tokens generated with :class:`PagedKVCache` against transformers' default ``DynamicCache``.
"""

import numpy as np
import pytest
from helpers import TINY_LM, left_padded

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.cache_utils", reason="needs the transformers Cache API")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvblocks import (  # noqa: E402
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    NotSupportedError,
    OutOfBlocksError,
)
from kvblocks.integrations.transformers import PagedKVCache, dynamic_cache_bytes  # noqa: E402

torch.set_num_threads(1)

VOCAB, PAD, BOS, EOS = 128, 0, 1, 2
BLOCK = 4
# `cache=` in transformers >= 5, `past_key_values=` before
CACHE_KW = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def _common(**kw):
    out = dict(TINY_LM, vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    out.update(kw)
    return out


_TOKENS = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)


def _build(cls, config):
    torch.manual_seed(0)
    model = cls(config).eval()
    # no eos: every row generates exactly max_new_tokens, so rows stay comparable
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def llama():
    return _build(LlamaForCausalLM, LlamaConfig(**_common()))


def _family(model_cls, config_cls, **kw):
    """A pytest param building a tiny model of a transformers family (skipped if absent)."""
    model = getattr(transformers, model_cls, None)
    config = getattr(transformers, config_cls, None)
    if model is None or config is None:  # pragma: no cover - depends on the installed version
        return pytest.param(None, marks=pytest.mark.skip(reason=f"no {model_cls}"))
    return (model, config, kw)


# families whose attention hands the cache K/V in a layout of their own: the support matrix
# of docs/transformers.md lists them
_FAMILIES = {
    "qwen2": _family("Qwen2ForCausalLM", "Qwen2Config", **_common()),
    "mistral": _family("MistralForCausalLM", "MistralConfig", **_common(sliding_window=None)),
    "gpt_neox": _family(
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        **{k: v for k, v in _common().items() if k != "num_key_value_heads"},
    ),
    # Falcon-7B layout: multi-query, one K/V head (num_kv_heads in the config is not it)
    "falcon_multi_query": _family(
        "FalconForCausalLM",
        "FalconConfig",
        **_TOKENS,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=True,
        new_decoder_architecture=False,
    ),
    "falcon_multi_head": _family(
        "FalconForCausalLM",
        "FalconConfig",
        **_TOKENS,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        multi_query=False,
        new_decoder_architecture=False,
    ),
    # Falcon-40B/180B layout: K/V groups broadcast to every head before caching (transformers
    # < 5.25), or cached as groups (5.25+: the config names them in num_key_value_heads)
    "falcon_new_architecture": _family(
        "FalconForCausalLM",
        "FalconConfig",
        **_TOKENS,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        new_decoder_architecture=True,
    ),
    "gpt_bigcode_multi_query": _family(
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        **_TOKENS,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=256,
        multi_query=True,
    ),
    "gpt2": _family(
        "GPT2LMHeadModel", "GPT2Config", **_TOKENS, n_embd=64, n_layer=2, n_head=4, n_positions=256
    ),
    "bloom": _family(
        "BloomForCausalLM", "BloomConfig", **_TOKENS, hidden_size=64, n_layer=2, n_head=4
    ),
}


def _other_families():
    return [pytest.param(v, id=k) for k, v in _FAMILIES.items()]


def _prompts(lengths, seed=0):
    return left_padded(lengths, VOCAB, PAD, seed)


def _generate(model, ids, mask, cache=None, **kw):
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("do_sample", False)
    if cache is not None:
        kw[CACHE_KW] = cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **kw)


def _reference(model, ids, mask, **kw):
    """Output and KV bytes of the default DynamicCache."""
    dyn = DynamicCache(config=model.config)
    out = _generate(model, ids, mask, dyn, **kw)
    return out, dynamic_cache_bytes(dyn)


def _check_invariants(cache):
    cache.manager.pool.check()
    for table in cache.block_tables():
        assert table.dtype == np.int32 and (table > 0).all()  # never the null block


# ---------------------------------------------------------------------------------------------
def test_update_round_trip_and_dedupe(llama):
    """update() returns exactly what a DynamicCache would; copies are shared only when equal
    in every layer."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(llama.config, num_blocks=32, block_size=BLOCK)
    dyn = DynamicCache(config=llama.config)
    k0 = torch.randn(1, 2, 6, 16, generator=g).repeat(3, 1, 1, 1)  # 3 equal rows in layer 0
    k1 = torch.randn(1, 2, 6, 16, generator=g).repeat(3, 1, 1, 1)
    k1[2, 0, 5, 0] += 1.0  # row 2 differs in layer 1
    for layer, k in ((0, k0), (1, k1)):
        got = cache.update(k, -k, layer)
        want = dyn.update(k, -k, layer)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    tables = cache.block_tables()
    assert np.array_equal(tables[0], tables[1])  # row 1 forked row 0
    assert not set(tables[2].tolist()) & set(tables[0].tolist())
    assert cache.stats["forks"] == 1 and cache.num_blocks_held() == 4
    for _step in range(3):  # decode: copy-on-write of block 1
        for layer in (0, 1):
            k = torch.randn(3, 2, 1, 16, generator=g)
            got = cache.update(k, 2 * k, layer)
            want = dyn.update(k, 2 * k, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cache.get_seq_length() == dyn.get_seq_length() == 9
    assert cache.stats["copy_on_write_blocks"] == 1
    _check_invariants(cache)


def test_greedy_single_prompt(llama):
    ids, mask = _prompts([11])
    ref, _ = _reference(llama, ids, mask)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    out = _generate(llama, ids, mask, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == 11 + 8 - 1  # the last token is never fed back
    _check_invariants(cache)


def test_greedy_padded_batch(llama):
    ids, mask = _prompts([5, 13, 9, 1])
    ref, ref_bytes = _reference(llama, ids, mask, max_new_tokens=10)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    out = _generate(llama, ids, mask, cache, max_new_tokens=10)
    assert torch.equal(out, ref)
    # 4 rows x 22 tokens (13 + 10 - 1) -> 6 blocks of 4 each, no sharing
    assert cache.num_blocks_held() == 4 * 6
    assert cache.kv_bytes_held() == 4 * 6 * BLOCK * ref_bytes // (4 * 22)
    _check_invariants(cache)


@pytest.mark.parametrize("family", _other_families())
def test_other_family(family):
    cls, config_cls, kw = family
    model = _build(cls, config_cls(**kw))
    ids, mask = _prompts([7, 12, 3], seed=1)
    ref, _ = _reference(model, ids, mask)
    cache = PagedKVCache(model.config, num_blocks=64, block_size=BLOCK)
    assert torch.equal(_generate(model, ids, mask, cache), ref)
    # beams too
    ref, _ = _reference(model, ids, mask, num_beams=3, max_new_tokens=6)
    cache.reset()
    assert torch.equal(_generate(model, ids, mask, cache, num_beams=3, max_new_tokens=6), ref)
    # prefix hits: the same batch prepared twice
    ref, _ = _reference(model, ids, mask, max_new_tokens=4)
    for hits in (0, 8):  # 12-token rows: at most 2 full blocks, one token left to compute
        assert cache.prepare(ids, mask, model=model) == hits
        assert torch.equal(_generate(model, ids, mask, cache, max_new_tokens=4), ref)
    _check_invariants(cache)


def test_chunked_prefill(llama):
    ids, mask = _prompts([9, 17, 4], seed=10)
    ref, _ = _reference(llama, ids, mask, prefill_chunk_size=5)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    assert torch.equal(_generate(llama, ids, mask, cache, prefill_chunk_size=5), ref)
    _check_invariants(cache)


def test_num_return_sequences_share_prompt_blocks(llama):
    ids, mask = _prompts([10, 6], seed=2)
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=6, top_k=0)
    torch.manual_seed(123)
    ref, ref_bytes = _reference(llama, ids, mask, **kw)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    torch.manual_seed(123)
    out = _generate(llama, ids, mask, cache, **kw)
    assert torch.equal(out, ref)
    stats = cache.stats
    assert stats["rows"] == 6 and stats["forks"] == 4  # 2 prompts, 2 forked copies each
    # 10-token prompts: blocks 0-1 full and shared by the 3 copies, block 2 (2 tokens) copied
    # on write by 2 of the 3 copies
    assert stats["copy_on_write_blocks"] == 4
    assert cache.kv_bytes_held() < ref_bytes
    _check_invariants(cache)


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beam_search(llama, num_beams):
    ids, mask = _prompts([9, 14, 4], seed=3)
    kw = dict(num_beams=num_beams, num_return_sequences=2, max_new_tokens=12)
    ref, ref_bytes = _reference(llama, ids, mask, **kw)
    cache = PagedKVCache(llama.config, num_blocks=128, block_size=BLOCK)
    out = _generate(llama, ids, mask, cache, **kw)
    assert torch.equal(out, ref)
    stats = cache.stats
    assert stats["forks"] > 0 and stats["rows"] == 3 * num_beams
    # beams share the prompt and their common history: fewer bytes than one copy per beam
    assert 0 < cache.kv_bytes_held() < ref_bytes
    _check_invariants(cache)


def test_beam_search_prepared(llama):
    ids, mask = _prompts([8, 8], seed=4)
    kw = dict(num_beams=3, max_new_tokens=7)
    ref, _ = _reference(llama, ids, mask, **kw)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    cache.prepare(ids, mask, model=llama)
    assert torch.equal(_generate(llama, ids, mask, cache, **kw), ref)
    _check_invariants(cache)


def test_prefix_caching_across_calls(llama):
    g = np.random.default_rng(5)
    prefix = g.integers(3, VOCAB, 21)
    first = torch.from_numpy(np.concatenate([prefix, g.integers(3, VOCAB, 4)]))[None]
    second = torch.from_numpy(np.concatenate([prefix, g.integers(3, VOCAB, 6)]))[None]
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)

    assert cache.prepare(first, torch.ones_like(first), model=llama) == 0
    ref, _ = _reference(llama, first, torch.ones_like(first))
    assert torch.equal(_generate(llama, first, torch.ones_like(first), cache), ref)

    n = cache.prepare(second, torch.ones_like(second), model=llama)
    assert n == cache.cached_tokens == 20  # 5 full blocks of the 21-token prefix
    ref, _ = _reference(llama, second, torch.ones_like(second))
    assert torch.equal(_generate(llama, second, torch.ones_like(second), cache), ref)
    assert cache.stats["cached_tokens"] == 20
    _check_invariants(cache)


def test_prefix_caching_batch_and_padding_rule(llama):
    g = np.random.default_rng(6)
    rows = [g.integers(3, VOCAB, 19), g.integers(3, VOCAB, 22)]
    ids = torch.from_numpy(np.stack([np.pad(rows[0], (3, 0)), rows[1]]))  # row 0 left-padded
    mask = (ids != 0).long()
    mask[0, :3] = 0
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    cache.prepare(ids, mask, model=llama)
    ref, _ = _reference(llama, ids, mask)
    assert torch.equal(_generate(llama, ids, mask, cache), ref)

    # same batch again: both rows hit (row 0 only because its padding is the same)
    assert cache.prepare(ids, mask, model=llama) == 20
    assert torch.equal(_generate(llama, ids, mask, cache), ref)

    # the padded row's tokens unpadded: K/V positions differ, so no hit for it
    alone = torch.from_numpy(rows[0])[None]
    assert cache.prepare(alone, torch.ones_like(alone), model=llama) == 0
    ref, _ = _reference(llama, alone, torch.ones_like(alone))
    assert torch.equal(_generate(llama, alone, torch.ones_like(alone), cache), ref)
    # unpadded rows match whatever batch they came from: 4 full blocks of 19 tokens
    assert cache.prepare(alone, torch.ones_like(alone), model=llama) == 16
    assert torch.equal(_generate(llama, alone, torch.ones_like(alone), cache), ref)
    _check_invariants(cache)


def test_continuation_like_dynamic_cache(llama):
    ids, mask = _prompts([6, 9], seed=7)
    dyn = DynamicCache(config=llama.config)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    a = _generate(llama, ids, mask, dyn, max_new_tokens=4)
    b = _generate(llama, ids, mask, cache, max_new_tokens=4)
    assert torch.equal(a, b)
    # feed the output back with the same cache: only the new tokens are computed
    mask2 = torch.cat([mask, torch.ones_like(a[:, mask.shape[1] :])], dim=1)
    a2 = _generate(llama, a, mask2, dyn, max_new_tokens=4)
    b2 = _generate(llama, b, mask2, cache, max_new_tokens=4)
    assert torch.equal(a2, b2)


def test_crop_and_select(llama):
    ids, mask = _prompts([6, 9, 3], seed=8)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    _generate(llama, ids, mask, cache, max_new_tokens=4)
    length = cache.get_seq_length()
    cache.crop(-3)
    assert cache.get_seq_length() == length - 3
    assert all(cache.manager.num_tokens(s) == length - 3 for s in cache._rows)
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert cache.batch_size == 2
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 4
    tables = cache.block_tables()
    assert np.array_equal(tables[0], tables[1]) and np.array_equal(tables[2], tables[3])
    _check_invariants(cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.num_blocks_held() == 0
    assert cache.manager.pool.usage == 0


def test_errors(llama):
    ids, mask = _prompts([30, 30])
    cache = PagedKVCache(llama.config, num_blocks=8, block_size=BLOCK)
    with pytest.raises(OutOfBlocksError):
        _generate(llama, ids, mask, cache)
    assert cache.manager.pool.usage == 0  # the failed prefill left nothing behind
    ids2, mask2 = _prompts([12, 12])  # ... and the cache is still usable
    ref, _ = _reference(llama, ids2, mask2, max_new_tokens=1)
    assert torch.equal(_generate(llama, ids2, mask2, cache, max_new_tokens=1), ref)
    cache.reset()
    # out of blocks while decoding: 2 rows x 3 blocks fit in 7, growing to 4 blocks each does not
    with pytest.raises(OutOfBlocksError):
        _generate(llama, ids2, mask2, cache)
    # the rows stay as they were (all or nothing), but serve nothing until reset()
    assert cache.num_blocks_held() == 6 and cache.stats["rows"] == 2
    _check_invariants(cache)
    with pytest.raises(InvalidStateError, match=r"reset\(\)"):
        cache.get_seq_length()
    cache.reset()
    assert cache.manager.pool.usage == 0

    small = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    small.prepare(ids[:1], mask[:1], model=llama)
    with pytest.raises(InvalidStateError):
        _generate(llama, ids[:, :10], mask[:, :10], small)
    chunked = LlamaConfig(**_common())
    chunked.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(NotSupportedError, match="chunked local attention"):
        PagedKVCache(chunked, num_blocks=8)
    assert issubclass(NotSupportedError, NotImplementedError)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model(dtype):
    model = _build(LlamaForCausalLM, LlamaConfig(**_common())).to(dtype)
    ids, mask = _prompts([5, 10], seed=9)
    ref, ref_bytes = _reference(model, ids, mask)
    cache = PagedKVCache(model.config, num_blocks=64, block_size=BLOCK)
    assert torch.equal(_generate(model, ids, mask, cache), ref)
    assert cache.kv.layout.itemsize == 2


@pytest.mark.parametrize("store", ["bf16", torch.float16, "fp8_e4m3"])
def test_storage_dtype_rounds(llama, store):
    cache = PagedKVCache(llama.config, num_blocks=8, block_size=BLOCK, dtype=store)
    k = torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(1))
    tdtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}.get(store, store)
    for layer in (0, 1):
        got_k, got_v = cache.update(k, -k, layer)
        assert got_k.dtype == torch.float32
        assert torch.equal(got_k, k.to(tdtype).float())
        assert torch.equal(got_v, (-k).to(tdtype).float())
    assert cache.kv.layout.itemsize == torch.empty(0, dtype=tdtype).element_size()


# ---------------------------------------------------------------------------------------------
# issue 18: no silent wrong tokens; each "Found" item compared token for token to DynamicCache
# ---------------------------------------------------------------------------------------------
def _forward_kw(cache):
    return {CACHE_KW: cache}


def test_poison_prepare_reset_prepare(llama):
    """Found 1: prepare() must not put unwritten blocks in the prefix cache."""
    ids, mask = _prompts([13, 13], seed=11)
    ref, _ = _reference(llama, ids, mask)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    assert cache.prepare(ids, mask, model=llama) == 0
    cache.reset()
    assert cache.manager.pool.num_cached == 0  # nothing computed, nothing cached
    assert cache.prepare(ids, mask, model=llama) == 0
    assert torch.equal(_generate(llama, ids, mask, cache), ref)
    assert cache.prepare(ids, mask, model=llama) == 12  # computed now: real hits
    assert torch.equal(_generate(llama, ids, mask, cache), ref)
    _check_invariants(cache)


def test_poison_generate_fails_argument_validation(llama):
    ids, mask = _prompts([13, 13], seed=12)
    ref, _ = _reference(llama, ids, mask)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    cache.prepare(ids, mask, model=llama)
    with pytest.raises(ValueError):  # transformers refuses before any forward
        _generate(llama, ids, mask, cache, num_return_sequences=2)
    assert cache.manager.pool.num_cached == 0
    assert cache.prepare(ids, mask, model=llama) == 0
    assert torch.equal(_generate(llama, ids, mask, cache), ref)
    # the prepared batch survives a refused generate: the next valid call serves it
    cache.prepare(ids, mask, model=llama)
    with pytest.raises(ValueError):
        _generate(llama, ids, mask, cache, max_new_tokens=-1)
    assert torch.equal(_generate(llama, ids, mask, cache), ref)


def test_poison_prepare_out_of_blocks_on_third_row(llama):
    ids, mask = _prompts([13, 13, 13], seed=13)  # 4 blocks per row; 8 usable blocks
    cache = PagedKVCache(llama.config, num_blocks=9, block_size=BLOCK)
    with pytest.raises(OutOfBlocksError):
        cache.prepare(ids, mask, model=llama)
    assert cache.manager.pool.usage == 0 and cache.manager.pool.num_cached == 0
    ref, _ = _reference(llama, ids[:1], mask[:1])
    assert cache.prepare(ids[:1], mask[:1], model=llama) == 0
    assert torch.equal(_generate(llama, ids[:1], mask[:1], cache), ref)
    _check_invariants(cache)


def test_poison_forward_fails_after_layer_0(llama):
    """A forward that raises between layers (a device OOM, an interrupt) commits nothing to
    the prefix cache; the cache then refuses until reset() / prepare()."""
    ids, mask = _prompts([13, 13], seed=14)
    ref, _ = _reference(llama, ids, mask)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)

    def boom(*args):
        raise RuntimeError("injected failure in layer 1")

    cache.prepare(ids, mask, model=llama)
    handle = llama.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            _generate(llama, ids, mask, cache)
    finally:
        handle.remove()
    with pytest.raises(InvalidStateError, match=r"reset\(\)"):
        _generate(llama, ids, mask, cache)
    assert cache.prepare(ids, mask, model=llama) == 0
    assert torch.equal(_generate(llama, ids, mask, cache), ref)
    _check_invariants(cache)


def test_prepare_generate_mismatch_is_detected(llama):
    """Found 2: generate(B) after prepare(A), same shape, raises before any K/V is written."""
    a, am = _prompts([13, 13], seed=15)
    b, bm = _prompts([13, 13], seed=16)
    ref_a, _ = _reference(llama, a, am)
    ref_b, _ = _reference(llama, b, bm)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    assert torch.equal(
        cache.generate(llama, a, attention_mask=am, max_new_tokens=8, do_sample=False), ref_a
    )
    assert cache.cached_tokens == 0

    assert cache.prepare(a, am, model=llama) == 12
    with pytest.raises(InvalidStateError, match="prepare"):
        _generate(llama, b, bm, cache)
    # B equal to A over the cached blocks, different after them
    b2 = a.clone()
    b2[:, -1] = (b2[:, -1] + 1) % VOCAB
    cache.prepare(a, am, model=llama)
    with pytest.raises(InvalidStateError, match="position 12"):
        _generate(llama, b2, am, cache)
    # same tokens, other padding
    pm = am.clone()
    pm[:, 0] = 0
    cache.prepare(a, am, model=llama)
    with pytest.raises(InvalidStateError, match="attention_mask"):
        _generate(llama, a, pm, cache)
    # another model (same shapes) than the one given to prepare()
    other = _build(LlamaForCausalLM, LlamaConfig(**_common()))
    cache.prepare(a, am, model=llama)
    with pytest.raises(InvalidStateError, match="model"):
        _generate(other, a, am, cache)
    with pytest.raises(InvalidArgumentError, match="model"):
        cache.prepare(a, am)
    # none of it reached the prefix cache: both batches still get their own tokens
    assert cache.prepare(a, am, model=llama) == 12
    assert torch.equal(_generate(llama, a, am, cache), ref_a)
    assert cache.prepare(b, bm, model=llama) == 0
    assert torch.equal(_generate(llama, b, bm, cache), ref_b)
    assert not llama._forward_pre_hooks  # the check is gone once the prompts are fed
    _check_invariants(cache)


def test_prepared_rows_wait_for_their_prompts(llama):
    """Between prepare() and the pass that feeds the prompts, row operations are refused
    (and refusing them changes nothing)."""
    import copy

    ids, mask = _prompts([9, 6], seed=22)
    ref, _ = _reference(llama, ids, mask)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    cache.prepare(ids, mask, model=llama)
    for op in (
        lambda: cache.crop(-1),
        lambda: cache.batch_repeat_interleave(2),
        lambda: cache.reorder_cache(torch.tensor([1, 0])),
        lambda: copy.deepcopy(cache),
    ):
        with pytest.raises(InvalidStateError, match="prepared prompts"):
            op()
    assert torch.equal(_generate(llama, ids, mask, cache), ref)


@pytest.mark.parametrize("mode", ["assistant_model", "prompt_lookup_num_tokens"])
def test_speculative_generation_after_prepare(llama, mode):
    """Found 3: assisted generation and prompt lookup after prepare(), with and without hits
    (their first pass feeds the whole prompt again: the hits are shared, not skipped)."""
    if mode == "assistant_model":
        kw = {mode: _build(LlamaForCausalLM, LlamaConfig(**_common(num_hidden_layers=1)))}
    else:
        kw = {mode: 3}
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5, 6, 7]])  # repeats: candidates
    mask = torch.ones_like(ids)
    ref, _ = _reference(llama, ids, mask, **kw)
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    assert torch.equal(_generate(llama, ids, mask, cache, **kw), ref)  # without prepare
    cache.reset()
    for hits in (0, 16):
        assert cache.prepare(ids, mask, model=llama) == hits
        assert torch.equal(_generate(llama, ids, mask, cache, **kw), ref)
        assert cache.cached_tokens == 0
        _check_invariants(cache)


def test_failed_generate_next_use_names_reset(llama):
    """Found 4: after an OutOfBlocksError inside generate, an unrelated request is refused
    (an error naming reset()) instead of continuing the failed rows."""
    ids, mask = _prompts([13, 13], seed=17)
    b, bm = _prompts([5, 9], seed=18)
    ref_b, _ = _reference(llama, b, bm)
    cache = PagedKVCache(llama.config, num_blocks=12, block_size=BLOCK)
    with pytest.raises(OutOfBlocksError):
        _generate(llama, ids, mask, cache, max_new_tokens=20)
    with pytest.raises(InvalidStateError, match=r"reset\(\)"):
        _generate(llama, b, bm, cache)
    for op in (lambda: cache.crop(-1), lambda: cache.reorder_cache(torch.tensor([1, 0]))):
        with pytest.raises(InvalidStateError, match=r"reset\(\)"):
            op()
    cache.reset()
    assert torch.equal(_generate(llama, b, bm, cache), ref_b)
    # prepare() is the other way back
    cache.reset()
    with pytest.raises(OutOfBlocksError):
        _generate(llama, ids, mask, cache, max_new_tokens=20)
    cache.prepare(b, bm, model=llama)
    assert torch.equal(_generate(llama, b, bm, cache), ref_b)
    cache.reset()
    assert cache.manager.pool.usage == 0
    cache.manager.check()


def test_num_return_sequences_after_prepare_fits_exactly(llama):
    """Found 6: copies of a prompt share its partly filled last block; the pool that holds
    what they really take (8 blocks) is enough, one block less is not."""
    ids, mask = _prompts([10], seed=4)
    kw = dict(do_sample=True, num_return_sequences=3, max_new_tokens=6)
    torch.manual_seed(7)
    ref, _ = _reference(llama, ids, mask, **kw)
    # 2 shared full blocks + 3 rows x (own copy of block 2 + block 3) = 8 blocks, + null block
    for num_blocks, fits in ((9, True), (8, False)):
        cache = PagedKVCache(llama.config, num_blocks=num_blocks, block_size=BLOCK)
        cache.prepare(ids, mask, model=llama)
        torch.manual_seed(7)
        if fits:
            assert torch.equal(_generate(llama, ids, mask, cache, **kw), ref)
        else:
            with pytest.raises(OutOfBlocksError):
                _generate(llama, ids, mask, cache, **kw)
        _check_invariants(cache)


def test_multi_token_step_counts_copy_on_write_exactly(llama):
    """A step of q > 1 tokens over rows sharing a partly filled block: m sharers take m - 1
    copies (the last one keeps the block), not m."""
    g = torch.Generator().manual_seed(3)
    k0 = torch.randn(1, 2, 6, 16, generator=g).repeat(3, 1, 1, 1)
    for num_blocks, fits in ((8, True), (7, False)):
        cache = PagedKVCache(llama.config, num_blocks=num_blocks, block_size=BLOCK)
        dyn = DynamicCache(config=llama.config)
        for layer in (0, 1):  # 3 equal rows of 6 tokens: 2 shared blocks, the 2nd partly filled
            cache.update(k0, -k0, layer)
            dyn.update(k0, -k0, layer)
        assert cache.num_blocks_held() == 2
        k = torch.randn(3, 2, 3, 16, generator=g)  # 9 tokens: 2 copies + 3 new blocks = 5
        if fits:
            for layer in (0, 1):
                got = cache.update(k, 2 * k, layer)
                assert all(torch.equal(x, y) for x, y in zip(got, dyn.update(k, 2 * k, layer)))
            assert cache.stats["copy_on_write_blocks"] == 2
        else:
            with pytest.raises(OutOfBlocksError):
                cache.update(k, 2 * k, 0)
            assert cache.num_blocks_held() == 2  # all or nothing
        _check_invariants(cache)


@pytest.mark.parametrize("copies", [1, 2])
def test_prepare_with_chunked_prefill(llama, copies):
    """Found 7: prepare() plus prefill_chunk_size, chunks not aligned to blocks, rows with
    different hits, copies of each prompt that fork once their prompt is fed."""
    ids, mask = _prompts([9, 17, 4], seed=10)
    kw = dict(prefill_chunk_size=5, max_new_tokens=6)
    if copies > 1:
        kw.update(do_sample=True, num_return_sequences=copies)
    torch.manual_seed(5)
    ref, _ = _reference(llama, ids, mask, **kw)
    cache = PagedKVCache(llama.config, num_blocks=96, block_size=BLOCK)
    for _ in range(2):
        cache.prepare(ids, mask, model=llama)
        torch.manual_seed(5)
        assert torch.equal(_generate(llama, ids, mask, cache, **kw), ref)
        _check_invariants(cache)
    assert cache.stats["hit_tokens"] == 3 * 16  # second round: every row hits all it may
    # another prompt sharing the unpadded row's first 3 blocks: hits served chunk by chunk
    row = ids[1:2]
    longer = torch.cat([row[:, :12], row[:, :9]], dim=1)
    torch.manual_seed(5)
    ref, _ = _reference(llama, longer, torch.ones_like(longer), **kw)
    assert cache.prepare(longer, torch.ones_like(longer), model=llama) == 12
    torch.manual_seed(5)
    assert torch.equal(_generate(llama, longer, torch.ones_like(longer), cache, **kw), ref)


def _encoder_decoder_models():
    out = []
    for name, model_cls, config in (
        (
            "bart",
            "BartForConditionalGeneration",
            lambda: transformers.BartConfig(
                **_TOKENS,
                decoder_start_token_id=BOS,
                d_model=64,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=128,
                decoder_ffn_dim=128,
                max_position_embeddings=256,
            ),
        ),
        (
            "t5",
            "T5ForConditionalGeneration",
            lambda: transformers.T5Config(
                **_TOKENS,
                decoder_start_token_id=BOS,
                d_model=64,
                d_kv=16,
                d_ff=128,
                num_layers=1,
                num_decoder_layers=2,
                num_heads=4,
            ),
        ),
    ):
        out.append(pytest.param(model_cls, config, id=name))
    return out


@pytest.mark.parametrize("model_cls, config", _encoder_decoder_models())
def test_encoder_decoder(model_cls, config):
    """Found 8: a bare PagedKVCache is refused for an encoder-decoder model; the
    EncoderDecoderCache form (self-attention paged, cross-attention dynamic) matches."""
    from transformers import EncoderDecoderCache

    model = _build(getattr(transformers, model_cls), config())
    with pytest.raises(NotSupportedError, match="encoder_decoder"):
        PagedKVCache(model.config, num_blocks=64, block_size=BLOCK)
    ids, mask = _prompts([7, 12, 3], seed=1)
    for kw in (dict(), dict(num_beams=3, max_new_tokens=6)):
        ref = _generate(model, ids, mask, EncoderDecoderCache(DynamicCache(), DynamicCache()), **kw)
        cache = PagedKVCache.encoder_decoder(model.config, num_blocks=64, block_size=BLOCK)
        assert isinstance(cache, EncoderDecoderCache)
        assert torch.equal(_generate(model, ids, mask, cache, **kw), ref)
        paged = cache.self_attention_cache
        assert paged.num_layers == 2 and paged.stats["rows"] > 0
        _check_invariants(paged)
    with pytest.raises(NotSupportedError, match="decoder-only"):
        paged.prepare(ids, mask, model=model)


def test_multi_head_latent_attention_refused():
    """Found 9: DeepSeek-V3 style MLA is refused up front."""
    config = getattr(transformers, "DeepseekV3Config", None)
    if config is None:  # pragma: no cover
        pytest.skip("no DeepseekV3Config")
    cfg = config(
        **_common(
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
    )
    with pytest.raises(NotSupportedError, match="latent"):
        PagedKVCache(cfg, num_blocks=8, dtype=torch.float32)


def test_keys_and_values_of_different_shapes_refused(llama):
    cache = PagedKVCache(llama.config, num_blocks=8, block_size=BLOCK)
    k = torch.zeros(1, 2, 3, 16)
    with pytest.raises(NotSupportedError):
        cache.update(k, torch.zeros(1, 2, 3, 8), 0)
    assert cache.kv is None  # refused before the storage was allocated
    with pytest.raises(InvalidArgumentError, match="heads"):
        cache.update(torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16), 0)
    assert cache.kv is None


def test_deepcopy_prompt_reuse_recipe(llama):
    """Found 10: transformers' prompt-reuse recipe (prefill once, copy.deepcopy per request)
    forks the rows onto the same manager."""
    import copy
    import pickle

    prompt = torch.from_numpy(np.random.default_rng(19).integers(3, VOCAB, 10))[None]
    paged = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    dyn = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(prompt, **_forward_kw(paged))
        llama(prompt, **_forward_kw(dyn))
    held = paged.num_blocks_held()
    for seed in (20, 21):
        suffix = torch.from_numpy(np.random.default_rng(seed).integers(3, VOCAB, 5))[None]
        full = torch.cat([prompt, suffix], dim=1)
        ref = _generate(llama, full, torch.ones_like(full), copy.deepcopy(dyn))
        mine = copy.deepcopy(paged) if seed == 20 else copy.copy(paged)
        assert mine.manager is paged.manager and mine.get_seq_length() == 10
        assert torch.equal(_generate(llama, full, torch.ones_like(full), mine), ref)
        # the copy shares the prompt's full blocks; only the partly filled one was copied
        assert np.array_equal(mine.block_tables()[0][:2], paged.block_tables()[0][:2])
        mine.reset()
        assert paged.num_blocks_held() == held
    with pytest.raises(NotSupportedError, match="deepcopy"):
        pickle.dumps(paged)
    paged.reset()
    assert paged.manager.pool.usage == 0
    paged.manager.check()


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(num_blocks=2.5), InvalidTypeError),
        (dict(num_blocks="10"), InvalidTypeError),
        (dict(num_blocks=True), InvalidTypeError),
        (dict(num_blocks=10, block_size=3.7), InvalidTypeError),
        (dict(num_blocks=1), InvalidArgumentError),
        (dict(num_blocks=10, block_size=0), InvalidArgumentError),
        (dict(num_blocks=10, device="tpu"), InvalidArgumentError),
        (dict(num_blocks=10, device=0), InvalidTypeError),
        (dict(num_blocks=10, dtype="int8"), InvalidTypeError),
        (dict(num_blocks=10, enable_prefix_caching="yes"), InvalidTypeError),
    ],
)
def test_constructor_refuses_instead_of_coercing(llama, monkeypatch, kw, exc):
    """Found 11: typed errors, raised before any storage is allocated."""
    import kvblocks.integrations.transformers.storage as integration

    allocated = []
    monkeypatch.setattr(integration, "KVCache", lambda *a, **k: allocated.append(a))
    kw.setdefault("dtype", torch.float32)  # storage would be allocated in the constructor
    with pytest.raises(exc):
        PagedKVCache(llama.config, **kw)
    assert not allocated


def test_constructor_refusals_allocate_nothing(monkeypatch):
    import kvblocks.integrations.transformers.storage as integration

    allocated = []
    monkeypatch.setattr(integration, "KVCache", lambda *a, **k: allocated.append(a))
    recurrent = LlamaConfig(**_common())
    recurrent.layer_types = ["linear_attention", "full_attention"]
    no_window = LlamaConfig(**_common())  # sliding layers, but no sliding_window to size them
    no_window.layer_types = ["sliding_attention", "full_attention"]
    bart = transformers.BartConfig(**_TOKENS, d_model=64, encoder_layers=1, decoder_layers=1)
    for config in (recurrent, no_window, bart):
        with pytest.raises(NotSupportedError):
            PagedKVCache(config, num_blocks=8, dtype=torch.float32)
    with pytest.raises(InvalidTypeError, match="config"):
        PagedKVCache(object(), num_blocks=8)
    with pytest.raises(InvalidTypeError, match="model.config"):
        PagedKVCache(_machine_model(), num_blocks=8)
    if not torch.cuda.is_available():
        with pytest.raises(KVBlocksError):
            PagedKVCache(LlamaConfig(**_common()), num_blocks=8, device="cuda", dtype=torch.float32)
    assert not allocated


def test_constructor_accepts_canonical_spellings(llama):
    for device in ("CPU", " cpu", torch.device("cpu")):
        cache = PagedKVCache(
            llama.config,
            num_blocks=np.int64(8),
            block_size=np.int32(4),
            device=device,
            dtype="fp16",
        )
        assert cache.device == "cpu" and cache.kv.device == "cpu"
        assert cache.num_blocks == 8 and type(cache.num_blocks) is int


# ---------------------------------------------------------------------------------------------
# the property test: random sequences of generate calls, each compared with DynamicCache
# ---------------------------------------------------------------------------------------------
from hypothesis import HealthCheck, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

_MACHINE = {}
# three prompt prefixes, so prompts of different calls share blocks (prefix hits)
_PREFIXES = [np.arange(3, 15), np.arange(40, 49), np.full(8, 77)]
_MODES = {
    "greedy": dict(),
    "sample": dict(do_sample=True, top_k=0),
    "chunked": dict(prefill_chunk_size=3),
    "sample_x2": dict(do_sample=True, top_k=0, num_return_sequences=2),
    "beams": dict(num_beams=2),
    "beams_x2": dict(num_beams=2, num_return_sequences=2),
}
_CONTINUABLE = ("greedy", "sample", "chunked")  # the cache then holds one row per output row


def _machine_model():
    if "model" not in _MACHINE:
        _MACHINE["model"] = _build(LlamaForCausalLM, LlamaConfig(**_common()))
    return _MACHINE["model"]


def _left_pad(rows):
    L = max(len(r) for r in rows)
    ids = np.full((len(rows), L), PAD, dtype=np.int64)
    mask = np.zeros((len(rows), L), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, L - len(r) :] = r
        mask[i, L - len(r) :] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


class GenerateMachine(RuleBasedStateMachine):
    """Drives one PagedKVCache through prepare / generate (every mode) / continuation / crop /
    deepcopy / calls that fail (refused by transformers, out of blocks) / reset. After every
    call the cache either gave DynamicCache's tokens, or raised a typed error, refuses every
    use until reset() or prepare(), and is then usable again."""

    @initialize(num_blocks=st.integers(10, 48))
    def setup(self, num_blocks):
        self.model = _machine_model()
        self.cache = PagedKVCache(self.model.config, num_blocks=num_blocks, block_size=BLOCK)
        self.dyn = None  # a DynamicCache holding what the cache holds, when continuable
        self.held = None  # (tokens, mask): the cache holds K/V of all tokens but the last

    def _batch(self, data):
        rows = []
        for _ in range(data.draw(st.integers(1, 3), label="rows")):
            prefix = _PREFIXES[data.draw(st.integers(0, 2), label="prefix")]
            cut = data.draw(
                st.one_of(st.just(len(prefix)), st.integers(0, len(prefix))), label="cut"
            )
            tail = data.draw(
                st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6), label="tail"
            )
            rows.append(np.concatenate([prefix[:cut], np.array(tail)]))
        if data.draw(st.booleans(), label="same length"):  # unpadded rows: hits across batches
            L = max(len(r) for r in rows)
            rows = [np.concatenate([r, np.full(L - len(r), 5)]) for r in rows]
        return _left_pad(rows)

    def _failed(self, exc, data):
        """A generate call raised: a typed error; the cache refuses until reset / prepare."""
        assert isinstance(exc, KVBlocksError)
        event(f"raised {type(exc).__name__}")
        self.dyn = self.held = None
        if self.cache.stats["rows"]:
            with pytest.raises(InvalidStateError, match=r"reset\(\)"):
                self.cache.get_seq_length()
            ids, mask = self._batch(data)
            with pytest.raises(InvalidStateError, match=r"reset\(\)"):
                _generate(self.model, ids, mask, self.cache)

    def _generate_both(self, data, mode, max_new, prepared):
        ids, mask = self._batch(data)
        kw = dict(_MODES[mode], max_new_tokens=max_new)
        if prepared:
            try:
                self.cache.prepare(ids, mask, model=self.model)
            except OutOfBlocksError:
                assert self.cache.stats["rows"] == 0  # nothing kept, nothing to refuse
                event("prepare raised OutOfBlocksError")
                self.dyn = self.held = None
                return
        else:
            self.cache.reset()
        if data.draw(st.booleans(), label="refused first"):
            # transformers refuses the call before any forward: the prepared batch survives
            with pytest.raises(ValueError):
                _generate(self.model, ids, mask, self.cache, num_return_sequences=2)
        if data.draw(st.integers(0, 5), label="too long") == 0:
            kw["max_new_tokens"] = self.cache.num_blocks * BLOCK  # cannot fit
        dyn = DynamicCache(config=self.model.config)
        torch.manual_seed(0)
        ref = _generate(self.model, ids, mask, dyn, **kw)
        torch.manual_seed(0)
        try:
            out = _generate(self.model, ids, mask, self.cache, **kw)
        except OutOfBlocksError as exc:
            self._failed(exc, data)
            return
        assert torch.equal(out, ref)
        hits = prepared and self.cache.cached_tokens > 0
        event(f"{mode}: tokens equal" + (", prefix hits" if hits else ""))
        if mode in _CONTINUABLE:
            self.dyn = dyn
            self.held = (out, torch.cat([mask, torch.ones_like(out[:, mask.shape[1] :])], dim=1))
        else:
            self.dyn = self.held = None

    @rule(data=st.data(), mode=st.sampled_from(sorted(_MODES)), max_new=st.integers(1, 5))
    def prepared_generate(self, data, mode, max_new):
        self._generate_both(data, mode, max_new, prepared=True)

    @rule(data=st.data(), mode=st.sampled_from(sorted(_MODES)), max_new=st.integers(1, 5))
    def generate_after_reset(self, data, mode, max_new):
        self._generate_both(data, mode, max_new, prepared=False)

    @precondition(lambda self: self.held is not None)
    @rule(
        data=st.data(),
        new=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=3),
        sample=st.booleans(),
        max_new=st.integers(1, 4),
        fork=st.booleans(),
    )
    def continue_generate(self, data, new, sample, max_new, fork):
        import copy

        out, mask = self.held
        ids = torch.cat([out, torch.tensor([new] * out.shape[0])], dim=1)
        mask = torch.cat([mask, torch.ones(out.shape[0], len(new), dtype=mask.dtype)], dim=1)
        kw = dict(max_new_tokens=max_new, do_sample=sample, top_k=0)
        # fork: transformers' prompt-reuse recipe, a deep copy continues; the original stays
        if fork:
            cache, dyn = copy.deepcopy(self.cache), copy.deepcopy(self.dyn)
        else:
            cache, dyn = self.cache, self.dyn
        torch.manual_seed(1)
        ref = _generate(self.model, ids, mask, dyn, **kw)
        torch.manual_seed(1)
        try:
            got = _generate(self.model, ids, mask, cache, **kw)
        except OutOfBlocksError as exc:
            if fork:
                event("deepcopy raised OutOfBlocksError")
                cache.reset()
            else:
                self._failed(exc, data)
            return
        assert torch.equal(got, ref)
        event("continuation: tokens equal" + (" (deepcopy)" if fork else ""))
        if fork:
            cache.reset()
        else:
            self.held = (got, torch.cat([mask, torch.ones_like(got[:, mask.shape[1] :])], dim=1))

    @precondition(lambda self: self.held is not None and self.held[0].shape[1] > 2)
    @rule(n=st.integers(1, 3))
    def crop(self, n):
        out, mask = self.held
        n = min(n, out.shape[1] - 2)
        self.cache.crop(-n)
        self.dyn.crop(-n)
        self.held = (out[:, :-n], mask[:, :-n])
        assert self.cache.get_seq_length() == self.dyn.get_seq_length()

    @rule()
    def reset(self):
        self.cache.reset()
        self.dyn = self.held = None

    @invariant()
    def consistent(self):
        if hasattr(self, "cache"):
            self.cache.manager.check()
            for table in self.cache.block_tables():
                assert (table > 0).all()

    def teardown(self):
        if hasattr(self, "cache"):
            self.cache.reset()
            assert self.cache.manager.pool.num_used == 0  # no block leaked
            self.cache.manager.check()


GenerateMachine.TestCase.settings = settings(
    max_examples=max(8, settings.default.max_examples // 5),
    stateful_step_count=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_generate_state_machine = GenerateMachine.TestCase
