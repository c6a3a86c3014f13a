"""The documentation runs: README code blocks and the docstring examples of the modules."""

import doctest
import re
from pathlib import Path

import pytest

import kvblocks
import kvblocks._core
import kvblocks.groups
import kvblocks.layout
import kvblocks.metadata
import kvblocks.ops
import kvblocks.rows
import kvblocks.sim.models.hybrid
import kvblocks.sim.models.spec
import kvblocks.sim.report.groups
import kvblocks.stats
import kvblocks.storage
import kvblocks.testing.readback
import kvblocks.testing.reference
import kvblocks.testing.strategies
import kvblocks.testing.tiny

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize(
    "module",
    [
        kvblocks._core,
        kvblocks.groups,
        kvblocks.metadata,
        kvblocks.ops,
        kvblocks.rows,
        kvblocks.stats,
        kvblocks.layout,
        kvblocks.storage,
        kvblocks.testing.readback,
        kvblocks.testing.reference,
        kvblocks.testing.strategies,
        kvblocks.testing.tiny,
        kvblocks.sim.models.hybrid,
        kvblocks.sim.report.groups,
        kvblocks.sim.models.spec,
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_testing_guide_examples_run(tmp_path, monkeypatch):
    """docs/testing.md: its code blocks run (the hypothesis ones as tests)."""
    root = README.parent
    monkeypatch.chdir(root)
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "testing.md").read_text(), re.S)
    assert len(blocks) == 5
    for code in blocks:
        ns: dict = {"__name__": "docs_testing"}
        exec(compile(code, "docs/testing.md", "exec"), ns)
        for name, obj in list(ns.items()):
            if name.startswith("test_") and callable(obj):
                obj()
            elif name.startswith("Test") and hasattr(obj, "runTest"):
                obj("runTest").runTest()


def test_host_tier_example_runs():
    """docs/host-tier.md: the engine loop with a host tier runs and reads its K/V back."""
    text = (README.parent / "docs" / "host-tier.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/host-tier.md", "exec"), {})


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_hybrid_models_guide_examples_run():
    """docs/hybrid-models.md: its code blocks run in order, in one namespace."""
    root = README.parent
    blocks = re.findall(
        r"```python\n(.*?)```", (root / "docs" / "hybrid-models.md").read_text(), re.S
    )
    assert len(blocks) == 7
    ns: dict = {"__name__": "docs_hybrid_models"}
    for code in blocks:
        exec(compile(code, "docs/hybrid-models.md", "exec"), ns)


def test_docs_are_linked_from_the_readme():
    for doc in ("hybrid-models.md",):
        assert f"(docs/{doc})" in README.read_text()
