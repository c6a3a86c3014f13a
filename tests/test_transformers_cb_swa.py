"""transformers_cb with sliding-window layers: KV cache groups under transformers' continuous batching.

Two tiny random models on the CPU: a Gemma 2 style one (``layer_types`` sliding, full) and a
Mistral style one (every layer sliding, ``sliding_window`` only), window 8 over pages of 4 tokens,
so requests run several windows long and their window blocks are released. Every test compares
the generated tokens with transformers' own continuous batching on the same model and config, in
stage 2 (kvblocks builds the indices) and stage 1 (transformers' loop builds them from kvblocks'
tables), and ends with ``check()`` clean and no block held.
"""

import functools
import logging

import numpy as np
import pytest
from helpers import TINY_LM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvblocks import KVGroup  # noqa: E402
from kvblocks.errors import InvalidStateError, NotSupportedError  # noqa: E402
from kvblocks.integrations import transformers_cb  # noqa: E402
from kvblocks.integrations.transformers_cb import window as transformers_cb_window  # noqa: E402

if transformers_cb._IMPORT_PROBLEM is not None:  # pragma: no cover - depends on the environment
    pytest.skip(transformers_cb._IMPORT_PROBLEM, allow_module_level=True)

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402
from transformers.generation.continuous_batching import initialization as cb_init  # noqa: E402

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil noise on CPU

PAGE, WINDOW, NEW = 4, 8, 16
SYSTEM = list(range(3, 24))  # 21 tokens: 5 full pages shared by the first prompts
PROMPTS = [SYSTEM + [50 + i, 60 + i] for i in range(3)] + [[7, 8, 9]]
COMMON = TINY_LM


def _model(family):
    torch.manual_seed(0)
    if family == "gemma2":  # layer 0 sliding, layer 1 full
        cfg = transformers.Gemma2Config(
            **COMMON, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=None
        )
        model = transformers.Gemma2ForCausalLM(cfg)
    else:  # mistral: no layer_types, every layer slides
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
        )
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _gen(n=NEW, **kw):
    kw.setdefault("do_sample", False)
    return GenerationConfig(max_new_tokens=n, eos_token_id=-1, pad_token_id=0, **kw)


def _cbc(num_blocks=64):
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=num_blocks, max_batch_tokens=64)


def _run(model, prompts, *, gen=None, cbc=None, **kw):
    out = model.generate_batch(
        prompts,
        generation_config=gen or _gen(),
        continuous_batching_config=cbc or _cbc(),
        warmup=False,
        **kw,
    )
    return _tokens({k: list(v.generated_tokens) for k, v in out.items()})


def _tokens(out):
    """Generated tokens in request order (request ids are per-manager counters)."""
    return [out[k] for k in sorted(out, key=lambda k: (int(k.split("_")[1].split("__")[0]), k))]


def _assert_clean(kb):
    kb.check()
    assert kb.blocks_in_use == 0, f"{kb.blocks_in_use} blocks leaked"


@functools.lru_cache(maxsize=None)
def _family(name):
    """The model and transformers' own continuous batching on PROMPTS (the reference)."""
    model = _model(name)
    return name, model, _run(model, PROMPTS)


@pytest.fixture(scope="module", params=["gemma2", "mistral"])
def family(request):
    return _family(request.param)


# (family, native_step) pairs of the longer tests: both stages, both families, not every product
PAIRS_A = [("gemma2", True), ("gemma2", False), ("mistral", True)]
PAIRS_B = [("mistral", True), ("mistral", False), ("gemma2", True)]


@pytest.fixture(params=[True, False], ids=["native_step", "stage1"])
def native(request):
    return request.param


def _groups(name):
    window = KVGroup("sliding_window", window=WINDOW)
    return (window, KVGroup("full")) if name == "gemma2" else (window,)


# --- equivalence ----------------------------------------------------------------------------------


def test_same_tokens_reading_only_rows_the_window_holds(family, monkeypatch, native):
    """Same tokens as transformers' own continuous batching. Every row a window layer reads lies
    in a block the request holds (never the null block of a released entry), and each request
    reads ``min(past, W - 1) + q`` rows, as transformers' own sliding allocator does."""
    name, model, reference = family
    seen = []
    cls = transformers_cb_window.KVBlocksWindowAllocator
    if native:
        orig = cls.build_indices

        def spy(self, io, step, context=0):
            orig(self, io, step, context)
            n = io.true_read_sizes[self.index]
            seen.append((io.read_index_storage[self.index, :n].clone(), self))

    else:
        orig = cls.get_read_indices

        def spy(self, rid, past, q):
            rows = orig(self, rid, past, q)
            assert len(rows) == q + min(past, WINDOW - 1)
            seen.append((torch.tensor(rows, dtype=torch.int64), self))
            return rows

    monkeypatch.setattr(cls, "build_indices" if native else "get_read_indices", spy)
    with transformers_cb.enabled(native_step=native) as kb:
        out = _run(model, PROMPTS)
    assert out == reference
    assert kb.groups == _groups(name)  # one group per transformers allocator, in its order
    assert (kb.steps > 0) is native and kb.block_manager is not None
    assert sum(len(rows) for rows, _ in seen) > 0
    for rows, alloc in seen:
        first_data_row = (len(kb.cache_pool.reserved) + 1) * alloc.block_physical_stride
        assert bool((rows >= first_data_row).all())
    _assert_clean(kb)


def test_reference_is_per_prompt_greedy_generate(family):
    """transformers' continuous batching, the reference above, is plain greedy ``generate``."""
    _, model, reference = family
    for prompt, toks in zip(PROMPTS[::3], reference[::3]):
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False
        )
        assert ref[0, len(prompt) :].tolist() == toks


# --- memory -----------------------------------------------------------------------------------------


def test_window_blocks_released_as_requests_advance(native):
    """Short prompts, long generation: a window group holds a bounded number of blocks per
    request, where full attention holds one per page of context."""
    window_model = _model("mistral")
    full_model = _model("mistral")
    full_model.config.sliding_window = None  # same weights, every layer full attention
    prompts = [[5 + i, 9, 11] for i in range(4)]
    n = 40  # 43 positions: 11 pages
    with transformers_cb.enabled(native_step=native) as kb:
        out = _run(window_model, prompts, gen=_gen(n))
        _assert_clean(kb)
        windowed, block_bytes = kb.peak_blocks_in_use, kb.block_bytes
        assert (
            block_bytes == 2 * PAGE * 2 * 2 * 16 * 4
        )  # K, V x page x 2 layers x 2 heads x 16 fp32
        assert _run(full_model, prompts, gen=_gen(n)) != out  # the window changes attention
        assert kb.groups == ((KVGroup("full"),) if native else ())  # stage 1: a plain pool
        full = kb.peak_blocks_in_use
        assert kb.block_bytes == block_bytes  # same layers per block: block counts compare
    assert out == _run(window_model, prompts, gen=_gen(n))
    per_request = -(-(WINDOW - 1 + 1) // PAGE) + 1  # last W - 1 positions + the query token
    assert windowed <= len(prompts) * per_request
    assert full == len(prompts) * -(-(3 + n - 1) // PAGE)  # the last token is never written
    assert windowed * 3 < full


@pytest.mark.parametrize("name,native", PAIRS_B)
def test_block_pressure_evicts_lazily_and_leaks_nothing(name, native):
    name, model, reference = _family(name)
    with transformers_cb.enabled(native_step=native) as kb:
        out = _run(model, PROMPTS + PROMPTS[:2], cbc=_cbc(num_blocks=12))
    assert out == reference + reference[:2]
    assert kb.stats.evictions > 0 and kb.stats.hit_blocks > 0
    _assert_clean(kb)


@pytest.mark.parametrize("name,native", PAIRS_A)
def test_prefix_hits_across_calls(name, native):
    """With a persistent manager the second call's prompts hit the blocks the first computed:
    the full group's whole prefix, the window group's blocks the first query reads."""
    name, model, reference = _family(name)
    with transformers_cb.enabled(native_step=native) as kb:
        first = _run(model, PROMPTS[:1], persistent_manager=True)
        hits = kb.stats.hit_blocks
        second = _run(model, PROMPTS[1:3], persistent_manager=True)
        model.destroy_cached_continuous_batching_manager()
    assert first + second == reference[:3]
    assert kb.hit_tokens >= 2 * (len(SYSTEM) // PAGE) * PAGE  # both requests of call 2 hit
    assert kb.stats.hit_blocks > hits
    _assert_clean(kb)


def test_forks_share_window_blocks():
    model = _model("gemma2")
    gen = _gen(8, do_sample=True, top_k=1, num_return_sequences=3)
    ref = _run(model, PROMPTS[:1], gen=gen)
    with transformers_cb.enabled() as kb:
        out = _run(model, PROMPTS[:1], gen=gen)
    assert out == ref and len(out) == 3 and out[0] == out[1] == out[2]
    _assert_clean(kb)


# --- what the window rows are ---------------------------------------------------------------------


def test_keep_window_rows_per_sequence():
    # three sequences: context 10 (query 2), 3 (query 3, a first prefill), 12 (query 1)
    lens, queries = [10, 3, 12], [2, 3, 1]
    ro = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    wo = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    rows = np.arange(ro[-1], dtype=np.int64) * 10
    out = np.full(25, -1, dtype=np.int64)
    n = transformers_cb_window.keep_window_rows(rows, ro, wo, 4, out)
    want = [rows[s:e][-min(e - s, q + 3) :] for s, e, q in zip(ro[:-1], ro[1:], queries)]
    assert out[:n].tolist() == np.concatenate(want).tolist() and n == 5 + 3 + 4
    assert (out[n:] == -1).all()
    with pytest.raises(InvalidStateError, match="overflow"):
        transformers_cb_window.keep_window_rows(rows, ro, wo, 4, out[: n - 1])


# --- refused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,why", [("chunked_attention", "chunked local"), ("linear_attention", "linear-attention")]
)
def test_unservable_layers_refused_by_name(kind, why):
    model = _model("gemma2")
    model.config.layer_types = [kind, "full_attention"]
    tables = (cb_cache.ATTN_TYPE_TO_ALLOCATOR, cb_init.ATTN_TYPE_TO_ALLOCATOR, cb_cache.CachePool)
    with pytest.raises(NotSupportedError, match=f"'{kind}' layers \\({why}"):
        with transformers_cb.enabled():
            _run(model, PROMPTS[:1], gen=_gen(2))
    assert (cb_cache.ATTN_TYPE_TO_ALLOCATOR, cb_init.ATTN_TYPE_TO_ALLOCATOR) == tables[:2]
    assert cb_cache.CachePool is tables[2]


def test_bad_sliding_window_refused():
    model = _model("gemma2")
    model.config.sliding_window = 0
    with pytest.raises(NotSupportedError, match="positive config.sliding_window"):
        with transformers_cb.enabled():
            _run(model, PROMPTS[:1], gen=_gen(2))


def test_window_module_docstring_examples():
    import doctest

    result = doctest.testmod(transformers_cb_window, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
