"""Runs examples/engine_loop.py: a continuous-batching loop over BlockManager + KVCache + ops,
in the documented step order, that checks every paged read (K/V and attention, draft slots
included) against contiguous K/V copies at every step."""

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


def run(engine_loop, *argv):
    return engine_loop.main(["--quiet", *map(str, argv)])


def roomy_args(argv):
    """The same workload with a cache where everything fits."""
    keep = []
    for opt in ("--block-size", "--seed", "--requests"):
        if opt in argv:
            keep += [opt, argv[argv.index(opt) + 1]]
    return keep + ["--num-blocks", "600"]


def test_default_run(engine_loop, capsys):
    s = engine_loop.main(["--requests", "24"])
    out = capsys.readouterr().out
    assert "prefix cache" in out and "preemptions" in out
    assert s["sequences"] > s["requests"]  # n > 1 sampling forked children
    assert s["forks"] > 0 and s["cow_copies"] > 0
    assert s["cached_tokens"] > 0 and 0 < s["prefix_hit_rate"] < 1
    assert s["swap_preemptions"] > 0 and s["recompute_preemptions"] > 0
    assert s["evictions"] > 0
    assert s["turn_requests"] > 0 and s["turn_cached_tokens"] > 0  # multi-turn reuse
    assert s["drafts_proposed"] == 0
    assert s["checks"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--preempt", "swap"],
        ["--preempt", "recompute", "--host-blocks", "0"],
        ["--block-size", "1", "--num-blocks", "70", "--host-blocks", "60"],
        ["--block-size", "8", "--num-blocks", "10", "--max-tokens", "40", "--seed", "3"],
        ["--watermark", "0.0", "--seed", "1"],
    ],
)
def test_outputs_do_not_depend_on_memory_pressure(engine_loop, argv):
    """Tight caches preempt, swap and recompute; the generated tokens must be the same as
    with a cache where everything fits (sampling is per sequence, K/V are exact)."""
    argv = ["--requests", "20"] + argv
    tight = run(engine_loop, *argv)
    roomy = run(engine_loop, *roomy_args(argv))
    assert roomy["swap_preemptions"] == roomy["recompute_preemptions"] == 0
    assert tight["swap_preemptions"] + tight["recompute_preemptions"] > 0
    assert tight["outputs"] == roomy["outputs"]
    if "--host-blocks" in argv and "0" in argv:
        assert tight["swap_preemptions"] == 0


def test_speculative_decoding_changes_nothing_but_the_steps(engine_loop, capsys):
    """Exact-match verification draws each sequence's generator as plain decoding does:
    the outputs with drafts are the outputs without; drafts are accepted, steps saved."""
    plain = run(engine_loop)
    spec = engine_loop.main(["--spec", "3"])
    assert "drafts accepted" in capsys.readouterr().out
    assert spec["outputs"] == plain["outputs"]
    assert spec["drafts_proposed"] > 0 and spec["drafts_accepted"] > 0
    assert 0 < spec["acceptance_rate"] < 1
    assert spec["steps"] < plain["steps"]
    assert spec["query_tokens"] == (
        spec["prefill_tokens"] + spec["decode_tokens"] + spec["drafts_proposed"]
    )


# tight configurations, cycled over the seeds: swaps, recomputes, forks, evictions and
# follow-up turns under a cache far smaller than the batch
TIGHT = [
    [],
    ["--preempt", "swap", "--host-blocks", "12"],
    ["--preempt", "recompute", "--host-blocks", "0", "--watermark", "0"],
    ["--block-size", "2", "--num-blocks", "32", "--max-seqs", "12", "--max-tokens", "30"],
    ["--block-size", "8", "--num-blocks", "10", "--max-tokens", "40"],
    ["--block-size", "16", "--num-blocks", "6", "--max-tokens", "64", "--watermark", "0"],
]


@pytest.mark.parametrize("seed", range(12))
def test_many_seeds(engine_loop, seed):
    """Under heavy preemption, with and without speculative decoding, every read is exact
    (the engine checks each one) and the outputs are those of a roomy cache."""
    argv = ["--seed", seed, "--requests", 30] + TIGHT[seed % len(TIGHT)]
    argv = [str(a) for a in argv]
    roomy = run(engine_loop, *roomy_args(argv))
    assert roomy["turn_cached_tokens"] > 0  # follow-up turns hit their earlier turn
    for k in (0, 1 + seed % 4):
        tight = run(engine_loop, *argv, "--spec", k)
        assert tight["outputs"] == roomy["outputs"], f"--spec {k}"
        assert tight["swap_preemptions"] + tight["recompute_preemptions"] > 0
        assert tight["evictions"] > 0 and tight["forks"] > 0
        if k:
            assert tight["drafts_accepted"] > 0


@pytest.mark.parametrize("skip", ["copies", "swaps"])
def test_the_oracle_catches_a_skipped_drain(engine_loop, monkeypatch, skip):
    """The checks have teeth: an engine that drops the copy-on-write copies or the swap
    pairs reads K/V that are not its own, and the run fails."""

    def drain(self):
        if skip != "swaps":
            for src, dst, pairs in self.to_drain:
                engine_loop.ops.swap_blocks(src, dst, pairs)
        self.to_drain.clear()
        copies = self.mgr.take_copies()
        if skip != "copies" and len(copies):
            engine_loop.ops.copy_blocks(self.cache, copies)

    monkeypatch.setattr(engine_loop.Engine, "drain", drain)
    with pytest.raises(AssertionError, match="differ"):
        run(engine_loop, "--spec", 3)


def test_rejects_a_cache_too_small(engine_loop):
    with pytest.raises(SystemExit):
        engine_loop.main(["--quiet", "--num-blocks", "8"])


# KV cache groups with the host tier of the prefix cache (docs/hybrid-models.md,
# docs/host-tier.md): layers alternate their groups' attention, every read is checked over
# what the layer's attention sees, and a tight cache demotes, onloads, swaps and recomputes
GROUPED = [
    ["--groups", "full,window:8"],
    ["--groups", "full,chunk:8"],
    ["--groups", "window:6,full,chunk:4", "--layers", "3", "--block-size", "2"],
]
GROUPED_BLOCKS = ["40", "40", "100"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", range(len(GROUPED)))
def test_groups_with_the_host_prefix_cache(engine_loop, case, seed):
    """A hybrid engine with the host tier: the outputs under demotion, onloads, swaps and
    recomputes are those of a roomy cache without the tier, drafts or not."""
    base = ["--seed", seed, "--requests", 30] + GROUPED[case]
    roomy = run(engine_loop, *base, "--num-blocks", 600)
    tight_argv = base + ["--num-blocks", GROUPED_BLOCKS[case], "--host-blocks", 24]
    for k in (0, 2):
        tight = run(engine_loop, *tight_argv, "--host-prefix", "--spec", k)
        assert tight["outputs"] == roomy["outputs"], f"--spec {k}"
        assert tight["offloads"] > 0 and tight["onloads"] > 0 and tight["host_hit_tokens"] > 0
        assert tight["swap_preemptions"] + tight["recompute_preemptions"] > 0
        assert tight["evictions"] > 0 and tight["forks"] > 0 and tight["checks"] > 0


def test_groups_change_what_the_model_computes(engine_loop):
    """The windows are real: the same workload with full attention generates other tokens
    (so the test above compares outputs that depend on each group's attention)."""
    argv = ["--requests", 20, "--num-blocks", 600]
    full = run(engine_loop, *argv)
    window = run(engine_loop, *argv, "--groups", "full,window:4")
    assert full["outputs"].keys() == window["outputs"].keys()
    assert full["outputs"] != window["outputs"]


def test_the_oracle_catches_a_skipped_onload(engine_loop, monkeypatch):
    """An engine that takes the onloads but does not copy them reads host hits that are not
    there: the run fails."""

    def drain_without_onloads(self):
        offloads = self.mgr.take_offloads()
        engine_loop.ops.swap_blocks(self.cache, self.host, offloads)
        self.mgr.take_onloads()  # dropped
        for src, dst, pairs in self.to_drain:
            engine_loop.ops.swap_blocks(src, dst, pairs)
        self.to_drain.clear()
        copies = self.mgr.take_copies()
        if len(copies):
            engine_loop.ops.copy_blocks(self.cache, copies)

    monkeypatch.setattr(engine_loop.Engine, "drain", drain_without_onloads)
    with pytest.raises(AssertionError, match="differ"):
        run(
            engine_loop,
            "--groups",
            "full,window:8",
            "--num-blocks",
            40,
            "--host-blocks",
            24,
            "--host-prefix",
            "--requests",
            30,
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["--groups", "full,ring:4"],
        ["--groups", "window:0"],
        ["--groups", "full,window:8", "--layers", "1"],
        ["--host-prefix", "--host-blocks", "0"],
    ],
)
def test_rejects_bad_groups(engine_loop, argv):
    with pytest.raises(SystemExit):
        engine_loop.main(["--quiet", *argv])
