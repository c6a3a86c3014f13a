"""The type stubs (kvblocks/_core.pyi) name exactly the public API of the compiled core."""

import ast
import inspect
from pathlib import Path

import pytest

from kvblocks import _core

STUB = Path(_core.__file__).with_name("_core.pyi")
if not STUB.exists():  # an installed wheel without sources: the stub sits beside the package
    STUB = Path(__file__).resolve().parents[1] / "kvblocks" / "_core.pyi"


def stub_tree():
    return ast.parse(STUB.read_text())


def public(names):
    return {n for n in names if not n.startswith("_") or n in ("__len__", "__contains__")}


def stub_members():
    out = {}
    for node in stub_tree().body:
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            out[node.name] = public(names) - {"__init__"}
    return out


def test_stub_functions_match_the_module():
    stubbed = {n.name for n in stub_tree().body if isinstance(n, ast.FunctionDef)}
    runtime = {
        n
        for n, v in vars(_core).items()
        if not n.startswith("_")
        and inspect.isbuiltin(v)
        or (
            callable(v)
            and not isinstance(v, type)
            and getattr(v, "__module__", "") == "kvblocks._core"
            and not n.startswith("_")
        )
    }
    assert stubbed == runtime


@pytest.mark.parametrize("cls", ["BlockPool", "BlockManager", "SeqBatch"])
def test_stub_classes_match_the_runtime(cls):
    runtime = public(
        n
        for n in dir(getattr(_core, cls))
        if n not in dir(object) or n in ("__len__", "__contains__")
    )
    runtime -= {"__reduce__", "__reduce_cython__", "__setstate_cython__", "__pyx_vtable__"}
    assert stub_members()[cls] == runtime
