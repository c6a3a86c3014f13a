"""transformers generation on a kvblocks paged KV cache (kvblocks.integrations.transformers).

Tiny randomly initialised models built from configs (no downloads); every test compares the
tokens generated with :class:`PagedKVCache` against transformers' default ``DynamicCache``.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.cache_utils", reason="needs the transformers Cache API")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvblocks import InvalidStateError, OutOfBlocksError  # noqa: E402
from kvblocks.integrations.transformers import PagedKVCache, dynamic_cache_bytes  # noqa: E402

torch.set_num_threads(1)

VOCAB, PAD, BOS, EOS = 128, 0, 1, 2
BLOCK = 4
# `cache=` in transformers >= 5, `past_key_values=` before
CACHE_KW = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def _common(**kw):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, **kw)


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


def _other_families():
    out = []
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        out.append(pytest.param((Qwen2ForCausalLM, Qwen2Config(**_common())), id="qwen2"))
    except ImportError:  # pragma: no cover
        pass
    try:
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(**_common(sliding_window=None))  # full attention
        out.append(pytest.param((MistralForCausalLM, config), id="mistral"))
    except ImportError:  # pragma: no cover
        pass
    try:
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        kw = _common()
        kw.pop("num_key_value_heads")
        out.append(pytest.param((GPTNeoXForCausalLM, GPTNeoXConfig(**kw)), id="gpt_neox"))
    except ImportError:  # pragma: no cover
        pass
    return out


def _prompts(lengths, seed=0):
    """Left-padded batch (transformers' convention for decoder-only generation)."""
    g = np.random.default_rng(seed)
    L = max(lengths)
    ids = np.full((len(lengths), L), PAD, dtype=np.int64)
    mask = np.zeros((len(lengths), L), dtype=np.int64)
    for r, n in enumerate(lengths):
        ids[r, L - n:] = g.integers(3, VOCAB, n)
        mask[r, L - n:] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


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
    k1[2, 0, 5, 0] += 1.0                                           # row 2 differs in layer 1
    for layer, k in ((0, k0), (1, k1)):
        got = cache.update(k, -k, layer)
        want = dyn.update(k, -k, layer)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    tables = cache.block_tables()
    assert np.array_equal(tables[0], tables[1])             # row 1 forked row 0
    assert not set(tables[2].tolist()) & set(tables[0].tolist())
    assert cache.stats["forks"] == 1 and cache.num_blocks_held() == 4
    for step in range(3):                                   # decode: copy-on-write of block 1
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
    cls, config = family
    model = _build(cls, config)
    ids, mask = _prompts([7, 12, 3], seed=1)
    ref, _ = _reference(model, ids, mask)
    cache = PagedKVCache(model.config, num_blocks=64, block_size=BLOCK)
    assert torch.equal(_generate(model, ids, mask, cache), ref)
    # beams too
    ref, _ = _reference(model, ids, mask, num_beams=3, max_new_tokens=6)
    cache.reset()
    assert torch.equal(_generate(model, ids, mask, cache, num_beams=3, max_new_tokens=6), ref)
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
    cache.prepare(ids, mask)
    assert torch.equal(_generate(llama, ids, mask, cache, **kw), ref)
    _check_invariants(cache)


def test_prefix_caching_across_calls(llama):
    g = np.random.default_rng(5)
    prefix = g.integers(3, VOCAB, 21)
    first = torch.from_numpy(np.concatenate([prefix, g.integers(3, VOCAB, 4)]))[None]
    second = torch.from_numpy(np.concatenate([prefix, g.integers(3, VOCAB, 6)]))[None]
    cache = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)

    assert cache.prepare(first, torch.ones_like(first)) == 0
    ref, _ = _reference(llama, first, torch.ones_like(first))
    assert torch.equal(_generate(llama, first, torch.ones_like(first), cache), ref)

    n = cache.prepare(second, torch.ones_like(second))
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
    cache.prepare(ids, mask)
    ref, _ = _reference(llama, ids, mask)
    assert torch.equal(_generate(llama, ids, mask, cache), ref)

    # same batch again: both rows hit (row 0 only because its padding is the same)
    assert cache.prepare(ids, mask) == 20
    assert torch.equal(_generate(llama, ids, mask, cache), ref)

    # the padded row's tokens unpadded: K/V positions differ, so no hit for it
    alone = torch.from_numpy(rows[0])[None]
    assert cache.prepare(alone, torch.ones_like(alone)) == 0
    ref, _ = _reference(llama, alone, torch.ones_like(alone))
    assert torch.equal(_generate(llama, alone, torch.ones_like(alone), cache), ref)
    # unpadded rows match whatever batch they came from: 4 full blocks of 19 tokens
    assert cache.prepare(alone, torch.ones_like(alone)) == 16
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
    mask2 = torch.cat([mask, torch.ones_like(a[:, mask.shape[1]:])], dim=1)
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
    # out of blocks while decoding: 2 rows x 3 blocks fit in 7, growing to 4 blocks each does not
    ids2, mask2 = _prompts([12, 12])
    with pytest.raises(OutOfBlocksError):
        _generate(llama, ids2, mask2, cache)
    assert cache.get_seq_length() == 12 and cache.num_blocks_held() == 6
    _check_invariants(cache)
    cache.reset()
    assert cache.manager.pool.usage == 0

    small = PagedKVCache(llama.config, num_blocks=64, block_size=BLOCK)
    small.prepare(ids[:1], mask[:1])
    with pytest.raises(InvalidStateError):
        _generate(llama, ids[:, :10], mask[:, :10], small)
    sliding = LlamaConfig(**_common())
    sliding.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(NotImplementedError):
        PagedKVCache(sliding, num_blocks=8)


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
