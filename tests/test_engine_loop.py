"""Runs examples/engine_loop.py: a continuous-batching loop over BlockManager + KVCache + ops
that checks paged attention against contiguous K/V copies at every step."""

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"


@pytest.fixture(scope="module")
def engine_loop():
    spec = importlib.util.spec_from_file_location("engine_loop", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["engine_loop"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_default_run(engine_loop, capsys):
    s = engine_loop.main(["--requests", "24"])
    out = capsys.readouterr().out
    assert "prefix cache" in out and "preemptions" in out
    assert s["sequences"] > s["requests"]  # n > 1 sampling forked children
    assert s["forks"] > 0 and s["cow_copies"] > 0
    assert s["cached_tokens"] > 0 and 0 < s["prefix_hit_rate"] < 1
    assert s["swap_preemptions"] > 0 and s["recompute_preemptions"] > 0
    assert s["checks"] > 0


@pytest.mark.parametrize("argv", [
    ["--preempt", "swap"],
    ["--preempt", "recompute", "--host-blocks", "0"],
    ["--block-size", "1", "--num-blocks", "50", "--host-blocks", "40"],
    ["--block-size", "8", "--num-blocks", "10", "--max-tokens", "40", "--seed", "3"],
    ["--watermark", "0.0", "--seed", "1"],
])
def test_outputs_do_not_depend_on_memory_pressure(engine_loop, argv):
    """Tight caches preempt, swap and recompute; the generated tokens must be the same as
    with a cache where everything fits (sampling is per sequence, K/V are exact)."""
    common = ["--quiet", "--requests", "20"]
    tight = engine_loop.main(common + argv)
    bs = argv[argv.index("--block-size") + 1] if "--block-size" in argv else "4"
    seed = argv[argv.index("--seed") + 1] if "--seed" in argv else "0"
    roomy = engine_loop.main(common + ["--num-blocks", "400", "--block-size", bs,
                                       "--seed", seed])
    assert roomy["swap_preemptions"] == roomy["recompute_preemptions"] == 0
    assert tight["swap_preemptions"] + tight["recompute_preemptions"] > 0
    assert tight["outputs"] == roomy["outputs"]
    if "--host-blocks" in argv and "0" in argv:
        assert tight["swap_preemptions"] == 0


def test_rejects_a_cache_too_small(engine_loop):
    with pytest.raises(SystemExit):
        engine_loop.main(["--quiet", "--num-blocks", "8"])
