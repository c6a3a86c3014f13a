"""kvblocks as the block allocator of transformers' continuous batching (transformers_cb).

Tiny random models on the CPU. Every test compares the generated tokens with transformers' own
continuous batching on the same model, generation config and cache geometry (greedy), and ends
with the kvblocks side checked: ``kb.check()`` (kvblocks' invariants and ref counts equal to the
block tables' references) and no block left in use once every request finished.
"""

import logging
import time

import pytest
from helpers import TINY_LM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvblocks.errors import InvalidStateError, NotSupportedError  # noqa: E402
from kvblocks.integrations import transformers_cb  # noqa: E402
from kvblocks.integrations.transformers_cb import step as transformers_cb_step  # noqa: E402

if transformers_cb._IMPORT_PROBLEM is not None:  # pragma: no cover - depends on the environment
    pytest.skip(transformers_cb._IMPORT_PROBLEM, allow_module_level=True)

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil noise on CPU

PAGE = 4
SYSTEM = list(range(3, 40))  # 37 tokens: 9 full pages shared by the prompts below
PROMPTS = [SYSTEM + [50 + i, 60 + i, 70 + i] for i in range(5)] + [[7, 8, 9, 10, 11]]


def _tiny(family="llama", attn="sdpa", **extra):
    torch.manual_seed(0)
    common = dict(TINY_LM, **extra)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    model.config._attn_implementation = attn
    return model.eval()


@pytest.fixture(scope="module")
def llama():
    return _tiny("llama")


def _gen(n=8, **kw):
    kw.setdefault("do_sample", False)
    return GenerationConfig(max_new_tokens=n, eos_token_id=-1, pad_token_id=0, **kw)


def _cbc(num_blocks=64, **kw):
    kw.setdefault("max_batch_tokens", 64)
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, **kw)


def _run(model, prompts, *, gen=None, cbc=None):
    out = model.generate_batch(
        prompts,
        generation_config=gen or _gen(),
        continuous_batching_config=cbc or _cbc(),
        warmup=False,
    )
    return {k: list(v.generated_tokens) for k, v in out.items()}


def _tokens(out):
    """Generated tokens in request order (request ids are per-manager counters)."""
    return [out[k] for k in sorted(out, key=lambda k: (int(k.split("_")[1].split("__")[0]), k))]


def _assert_clean(kb):
    kb.check()
    assert kb.blocks_in_use == 0, f"{kb.blocks_in_use} blocks leaked"


@pytest.fixture(params=[True, False], ids=["native_step", "stage1"])
def native(request):
    """Stage 2 (kvblocks builds the step's indices natively) and stage 1 (allocation only)."""
    return request.param


def _alloc_class(native):
    return (
        transformers_cb_step.KVBlocksStepAllocator if native else transformers_cb.KVBlocksAllocator
    )


def _check_stage(kb, native):
    """Stage 2 built every step's indices natively; stage 1 none."""
    assert (kb.steps > 0) is native and (kb.block_manager is not None) is native


@pytest.fixture(scope="module")
def reference(llama):
    """transformers' own continuous batching on the prompts, roomy cache."""
    return _tokens(_run(llama, PROMPTS))


# --- equivalence ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
def test_same_tokens_as_transformers_cb(llama, reference, prefix, native):
    with transformers_cb.enabled(enable_prefix_caching=prefix, native_step=native) as kb:
        out = _tokens(_run(llama, PROMPTS))
    assert out == reference
    assert kb.manager is not None and kb.manager.enable_prefix_caching is prefix
    if prefix:  # 5 prompts share 9 full pages: the 4 admitted after the first one hit them
        assert kb.stats.hit_blocks > 0 and kb.manager.num_cached > 0
        assert kb.hit_tokens == kb.stats.hit_blocks * PAGE
    else:
        assert kb.stats.hit_blocks == 0 and kb.manager.num_cached == 0
    _check_stage(kb, native)
    _assert_clean(kb)


def test_same_tokens_as_per_prompt_generate(llama, reference):
    for prompt, toks in zip(PROMPTS[:2], reference[:2]):
        ids = torch.tensor([prompt])
        ref = llama.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
        assert ref[0, len(prompt) :].tolist() == toks


def test_paged_eager_and_second_family(native):
    """``paged|eager`` attention on Llama, and Qwen2 (another family), against transformers' CB
    and against per-prompt greedy ``generate`` (sdpa)."""
    sdpa = {"llama": _tiny("llama"), "qwen2": _tiny("qwen2")}
    for family, model in (("llama", _tiny("llama", attn="paged|eager")), ("qwen2", sdpa["qwen2"])):
        ref = _tokens(_run(model, PROMPTS[:4]))
        with transformers_cb.enabled(native_step=native) as kb:
            out = _tokens(_run(model, PROMPTS[:4]))
        assert out == ref
        for prompt, toks in zip(PROMPTS[:4:3], out[::3]):
            ids = torch.tensor([prompt])
            greedy = sdpa[family].generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=_gen()
            )
            assert greedy[0, len(prompt) :].tolist() == toks
        assert kb.stats.hit_blocks > 0
        _check_stage(kb, native)
        _assert_clean(kb)


def test_block_ids_flow_unchanged_and_trash_reserved(llama, native):
    """kvblocks' ids are transformers' block ids: the trash sectors' blocks are held, never handed
    out, and every id in a block table is a block kvblocks allocated."""
    seen = []
    cls = _alloc_class(native)
    orig = cls.allocate_cache_to_request

    def spy(self, request_id, past_length, query_length):
        orig(self, request_id, past_length, query_length)
        seen.append((self.kv.ref_counts().copy(), list(self.block_table[request_id])))

    cls.allocate_cache_to_request = spy
    try:
        with transformers_cb.enabled(native_step=native) as kb:
            _run(llama, PROMPTS[:3])
    finally:
        cls.allocate_cache_to_request = orig
    pool = kb.cache_pool
    trash = pool.num_reserved_sectors * pool.blocks_per_sector[0]
    assert kb.reserved_blocks == trash - 1  # kvblocks' null block 0 is the first trash block
    assert seen
    for refs, table in seen:
        assert all(trash <= b < kb.manager.num_blocks and refs[b] >= 1 for b in table)
    _assert_clean(kb)


# --- prefix cache, pressure, forks, cancel ----------------------------------------------------


def test_prefix_hits_under_pressure_lazy_eviction(llama, reference, native):
    """Few blocks: kvblocks evicts cached blocks one at a time, when an allocation needs them
    (transformers drops them all at once), and the tokens stay the same."""
    cbc = _cbc(num_blocks=20)
    ref = _tokens(_run(llama, PROMPTS, cbc=cbc))
    assert ref == reference
    with transformers_cb.enabled(native_step=native) as kb:
        out = _tokens(_run(llama, PROMPTS, cbc=cbc))
    assert out == reference
    assert kb.stats.evictions > 0 and kb.stats.hit_blocks > 0
    assert kb.manager.num_cached > 0  # lazy: what was not needed stayed cached
    _assert_clean(kb)


def test_identical_prompts_in_one_step_held_once(llama, reference, native):
    """Two requests computing the same blocks in one step. Stage 1: the second one's copies are
    replaced by the first one's cached blocks (transformers de-duplicates the same way). Stage 2:
    kvblocks keeps the first entry of a hash, the second request's blocks stay uncached."""
    prompts = [PROMPTS[0], PROMPTS[0][:-1] + [99]]
    ref = _tokens(_run(llama, prompts, cbc=_cbc(max_batch_tokens=128)))
    with transformers_cb.enabled(native_step=native) as kb:
        out = _tokens(_run(llama, prompts, cbc=_cbc(max_batch_tokens=128)))
    assert out == ref and out[0] == reference[0]
    assert kb.deduplicated == (0 if native else len(SYSTEM) // PAGE)
    assert kb.stats.hit_blocks == 0
    if native:  # each request's computed full blocks, the shared 9 pages once
        full, shared = (len(SYSTEM) + 3 + 8 - 1) // PAGE, len(SYSTEM) // PAGE
        assert kb.manager.num_cached == 2 * full - shared
    _assert_clean(kb)


def test_allow_block_sharing_false_means_no_prefix_cache(llama, reference):
    with transformers_cb.enabled() as kb:
        out = _tokens(_run(llama, PROMPTS[:3], cbc=_cbc(allow_block_sharing=False)))
    assert out == reference[:3]
    assert kb.stats.hit_blocks == 0 and kb.manager.num_cached == 0
    _assert_clean(kb)


def test_prefix_hits_across_calls_persistent_manager(llama, reference, native):
    """With a persistent manager, the second ``generate_batch`` hits blocks the first computed."""
    with transformers_cb.enabled(native_step=native) as kb:
        first = _tokens(_run(llama, PROMPTS[:1]))
        out = llama.generate_batch(
            PROMPTS[1:3],
            generation_config=_gen(),
            continuous_batching_config=_cbc(),
            warmup=False,
            persistent_manager=True,
        )
        hits = kb.stats.hit_blocks
        out2 = llama.generate_batch(
            PROMPTS[3:5],
            generation_config=_gen(),
            continuous_batching_config=_cbc(),
            warmup=False,
            persistent_manager=True,
        )
        llama.destroy_cached_continuous_batching_manager()
    assert first == reference[:1]
    assert _tokens({k: list(v.generated_tokens) for k, v in out.items()}) == reference[1:3]
    assert _tokens({k: list(v.generated_tokens) for k, v in out2.items()}) == reference[3:5]
    assert len(kb.pools) == 2  # one pool per cache built: the persistent one served both calls
    assert kb.stats.hit_blocks >= hits + 2 * (len(SYSTEM) // PAGE)  # both requests of call 2 hit
    _assert_clean(kb)


def test_num_return_sequences_forks(llama, reference, native):
    # sampling with top_k=1 is deterministic: every child repeats the greedy tokens
    gen = _gen(num_return_sequences=3, do_sample=True, top_k=1)
    ref = _run(llama, PROMPTS[:2], gen=gen)
    increfs = []
    cls = _alloc_class(native)
    orig = cls.fork_blocks

    def spy(self, src, dst, past_length):
        pair = orig(self, src, dst, past_length)
        increfs.append(len(self.block_table[dst]) - len(pair[1]))
        return pair

    cls.fork_blocks = spy
    try:
        with transformers_cb.enabled(native_step=native) as kb:
            out = _run(llama, PROMPTS[:2], gen=gen)
    finally:
        cls.fork_blocks = orig
    assert out == ref and len(out) == 6
    assert sorted(out.values()) == sorted(reference[:2] * 3)
    assert len(increfs) == 4 and all(n > 0 for n in increfs)  # children share full blocks
    _assert_clean(kb)


def _wait(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_manager_api_and_cancel(llama, reference, native):
    """init_continuous_batching / start / add_request / get_result / cancel_request / stop."""
    with transformers_cb.enabled(native_step=native) as kb:
        mgr = llama.init_continuous_batching(
            generation_config=_gen(), continuous_batching_config=_cbc()
        )
        mgr.start()
        try:
            rid = mgr.add_request(PROMPTS[0], max_new_tokens=8)
            res = None
            while res is None or not res.is_finished():
                res = mgr.get_result(request_id=rid, timeout=10)
                assert res is not None, "no result"
            assert list(res.generated_tokens) == reference[0]
            # a long request, cancelled mid-way, gives its blocks back
            long_id = mgr.add_request(PROMPTS[1], max_new_tokens=150, streaming=True)
            assert _wait(lambda: kb.blocks_in_use > 0)
            mgr.cancel_request(long_id)
            assert _wait(lambda: kb.blocks_in_use == 0)
        finally:
            mgr.stop(block=True, timeout=10)
    _assert_clean(kb)


# --- the context manager --------------------------------------------------------------------------


def test_restores_transformers_classes_also_on_error(llama):
    saved = (cb_cache.ATTN_TYPE_TO_ALLOCATOR, cb_cache.CachePool)
    io_cls = transformers_cb_step.ContinuousBatchingIOs
    saved_prepare = io_cls.prepare_batch_tensors
    for native in (True, False):
        with transformers_cb.enabled(native_step=native):
            assert cb_cache.CachePool is transformers_cb.KVBlocksCachePool
            table = cb_cache.ATTN_TYPE_TO_ALLOCATOR
            assert table["full_attention"] is _alloc_class(native)
            assert io_cls.prepare_batch_tensors is transformers_cb_step.prepare_batch_tensors
        assert io_cls.prepare_batch_tensors is saved_prepare
    assert (cb_cache.ATTN_TYPE_TO_ALLOCATOR, cb_cache.CachePool) == saved
    assert cb_cache.ATTN_TYPE_TO_ALLOCATOR is saved[0]
    with pytest.raises(ZeroDivisionError):
        with transformers_cb.enabled():
            raise ZeroDivisionError("the body raised")
    assert cb_cache.ATTN_TYPE_TO_ALLOCATOR is saved[0] and cb_cache.CachePool is saved[1]
    assert io_cls.prepare_batch_tensors is saved_prepare
    # a cache built after the block is transformers' own
    mgr = llama.init_continuous_batching(
        generation_config=_gen(), continuous_batching_config=_cbc()
    )
    mgr.warmup()
    assert type(mgr.batch_processor.cache.pool) is saved[1]
    mgr.stop()


def test_nested_contexts_refused():
    with transformers_cb.enabled():
        with pytest.raises(InvalidStateError, match="nest"):
            with transformers_cb.enabled():
                pass
        assert cb_cache.CachePool is transformers_cb.KVBlocksCachePool  # the outer one holds
    assert cb_cache.CachePool is not transformers_cb.KVBlocksCachePool


def test_unsupported_version_refused(monkeypatch):
    saved = cb_cache.CachePool
    monkeypatch.setattr(transformers_cb.compat, "_installed_version", lambda: "5.25.0")
    with pytest.raises(NotSupportedError, match=r"5\.24\.x.*found transformers 5\.25\.0"):
        with transformers_cb.enabled():
            pass
    assert cb_cache.CachePool is saved
    for v in ("4.57.1", "5.23.2", "6.0.0"):
        with pytest.raises(NotSupportedError):
            transformers_cb.check_version(v)
    transformers_cb.check_version("5.24.0")
    transformers_cb.check_version("5.24.3.dev0")


def test_docs_example_runs():
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "transformers-cb.md"
    (code,) = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    exec(compile(code, str(doc), "exec"), {})
