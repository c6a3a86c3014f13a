"""The documentation runs: README code blocks and the docstring examples of the modules."""

import doctest
import re
from pathlib import Path

import pytest

import kvblocks
import kvblocks._core
import kvblocks.layout
import kvblocks.metadata
import kvblocks.ops
import kvblocks.sim.group_report
import kvblocks.sim.hybrid_models
import kvblocks.sim.models
import kvblocks.storage
import kvblocks.testing.readback
import kvblocks.testing.reference

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize(
    "module",
    [
        kvblocks._core,
        kvblocks.metadata,
        kvblocks.ops,
        kvblocks.layout,
        kvblocks.storage,
        kvblocks.testing.readback,
        kvblocks.testing.reference,
        kvblocks.sim.hybrid_models,
        kvblocks.sim.group_report,
        kvblocks.sim.models,
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
    assert len(blocks) == 4
    for code in blocks:
        ns: dict = {"__name__": "docs_testing"}
        exec(compile(code, "docs/testing.md", "exec"), ns)
        for name, obj in list(ns.items()):
            if name.startswith("test_") and callable(obj):
                obj()
            elif name.startswith("Test") and hasattr(obj, "runTest"):
                obj("runTest").runTest()


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
