"""Packaging (issue 11): one version source, a changelog entry for it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

import kvblocks

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source():
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = pyproject.split("[project]", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, re.M), "static version in [project]"
    assert re.search(r'^dynamic\s*=\s*\["version"\]', project, re.M)
    assert re.search(r'^version\s*=\s*\{\s*attr\s*=\s*"kvblocks.__version__"\s*\}', pyproject, re.M)
    # setuptools reads the attribute without importing: it must be a literal assignment
    tree = ast.parse((ROOT / "kvblocks" / "__init__.py").read_text())
    literal = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "__version__" for t in n.targets)]  # fmt: skip
    assert literal == [kvblocks.__version__]
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", kvblocks.__version__)


def test_installed_metadata_agrees():
    try:
        dist = importlib.metadata.distribution("kvblocks")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kvblocks is not installed (in-place build)")
    here = Path(kvblocks.__file__).resolve()
    if Path(dist.locate_file("kvblocks/__init__.py")).resolve() != here:
        pytest.skip("the installed kvblocks is not the one imported")
    assert dist.version == kvblocks.__version__


def test_changelog_has_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert re.search(rf"^## \[{re.escape(kvblocks.__version__)}\] - \d{{4}}-\d\d-\d\d$", text, re.M)


def test_every_package_is_in_the_wheel():
    """setuptools ships only the packages ``[tool.setuptools] packages`` lists: every folder of
    kvblocks with an ``__init__.py`` must be there, or the wheel misses it."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = set(
        re.findall(r'"(kvblocks[\w.]*)"', pyproject.split("packages = [", 1)[1].split("]", 1)[0])
    )
    pkg = ROOT / "kvblocks"
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in pkg.rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
