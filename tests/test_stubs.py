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


def stub_params():
    """{(class or None, name): parameter names} of every stubbed function and method."""
    out = {}
    for node in stub_tree().body:
        items = node.body if isinstance(node, ast.ClassDef) else [node]
        owner = node.name if isinstance(node, ast.ClassDef) else None
        for item in items:
            if isinstance(item, ast.FunctionDef):
                a = item.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                out[(owner, item.name)] = [n for n in names if n != "self"]
    return out


def test_stub_parameters_match_the_runtime():
    """Every parameter (group= included) of every function and method whose runtime
    signature is introspectable is in the stub, under the same name."""
    checked, bad = 0, []
    for (owner, name), params in stub_params().items():
        obj = getattr(_core, owner) if owner else _core
        if name.startswith("__") or not hasattr(obj, name):
            continue
        try:
            sig = inspect.signature(getattr(obj, name))
        except (TypeError, ValueError):
            continue
        runtime = [
            p.name
            for p in sig.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        if isinstance(inspect.getattr_static(obj, name), property):
            continue
        if params != runtime:
            bad.append(f"{owner}.{name}: stub {params}, runtime {runtime}")
        checked += 1
    assert not bad, "\n".join(bad)
    assert checked > 40


@pytest.mark.parametrize(
    "owner, name",
    [
        (None, "hash_blocks"),
        ("BlockPool", "cache"),
        ("BlockPool", "lookup"),
        ("BlockPool", "lookup_and_pin"),
        ("BlockManager", "block_table"),
        ("BlockManager", "metadata"),
    ],
)
def test_group_parameters_are_stubbed(owner, name):
    assert "group" in stub_params()[(owner, name)]


def test_manager_init_stub_takes_groups():
    init = stub_params()[("BlockManager", "__init__")]
    assert "groups" in init and "blocks_in_use" in stub_members()["BlockManager"]
