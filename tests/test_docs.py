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
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
