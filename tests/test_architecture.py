"""docs/architecture.md against the tree: every C file, Cython file, API module and package is
named there, and the layering it claims holds (an import scan of kvblocks/, no import run)."""

import ast
import re
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kvblocks"
DOC = (ROOT / "docs" / "architecture.md").read_text()
NAMED = set(re.findall(r"`([^`\s]+)`", DOC))  # every name the page writes as code
ABOVE = ("sim", "integrations", "testing", "bench")  # the packages above the Python API
#: (importer, imported) circles still open, each with its owner (see the page's Layering)
KNOWN_CIRCLES: Set[frozenset] = set()  # none left: the reference is one group-native model


def _modules() -> Dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _targets(mod: str, path: Path, node) -> Set[str]:
    """The kvblocks modules an import statement names (a name imported from a package that is
    a submodule counts as that submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = set()
    for t in names:
        while t not in MODULES and "." in t:
            t = t.rsplit(".", 1)[0]
        if t in MODULES and t != mod:
            out.add(t)
    return out


def _imports(mod: str, path: Path) -> Set[str]:
    """Every kvblocks module ``mod`` imports, inside functions too (not under TYPE_CHECKING)."""
    out: Set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= _targets(mod, path, node)
        todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) > 1 and parts[1] in ABOVE:
        return parts[1]
    if len(parts) > 1 and parts[1] == "__main__":
        return "cli"
    return "api"  # kvblocks/*.py and events/


# -- every part of the tree is on the map -------------------------------------------------------
def test_every_c_and_cython_file_is_listed():
    files = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".c", ".h"))
    files += sorted(p.name for p in PKG.iterdir() if p.suffix in (".pyx", ".pxi", ".pxd", ".pyi"))
    missing = [f for f in files if f not in NAMED]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_every_api_module_and_package_is_listed():
    api = [p.name for p in PKG.glob("*.py")]
    packages = [
        str(p.parent.relative_to(PKG)) + "/" for p in PKG.rglob("__init__.py") if p.parent != PKG
    ]
    packages += [p.name + "/" for p in PKG.iterdir() if p.is_dir() and p.name in ("cuda", "data")]
    missing = [n for n in api + packages if n not in NAMED]
    assert not missing, f"docs/architecture.md does not name {missing} (add a row)"


def test_a_newcomer_start_for_each_part():
    start = DOC.split("## Where a newcomer starts", 1)[1]
    heads = re.findall(r"^### (.+)$", start, re.M)
    assert heads == ["The core", "The Python API", "The simulator", "The integrations", "Testing"]
    for part in re.split(r"^### .+$", start, flags=re.M)[1:]:
        for path in re.findall(r"`((?:csrc|kvblocks|docs|tests|integrations|sim)/[^`\s]+)`", part):
            p = (
                path
                if path.split("/")[0] in ("csrc", "kvblocks", "docs", "tests")
                else ("kvblocks/" + path)
            )
            assert (ROOT / p).exists(), f"the newcomer section names {path}, which is not there"


# -- the layering the page claims ---------------------------------------------------------------
def test_c_core_has_no_python_headers():
    for p in (ROOT / "csrc").iterdir():
        if p.suffix in (".c", ".h"):
            includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)', p.read_text(), re.M)
            assert not [i for i in includes if "Python" in i or i.startswith("numpy")], p.name


def test_cython_layer_imports_only_value_types():
    text = (PKG / "_core.pyx").read_text() + "".join(p.read_text() for p in PKG.glob("*.pxi"))
    used = set(re.findall(r"^\s*from (kvblocks\.[\w.]+) import", text, re.M))
    values = {"errors", "groups", "metadata", "rows", "stats", "events.types"}
    assert used <= {f"kvblocks.{v}" for v in values}, used
    for v in values:
        assert "kvblocks._core" not in GRAPH[f"kvblocks.{v}"], v
        assert "kvblocks" not in GRAPH[f"kvblocks.{v}"], v


def test_imports_point_down():
    wrong = []
    for mod, targets in GRAPH.items():
        src = _layer(mod)
        for t in targets:
            dst = _layer(t)
            if dst == "cli" or (src == "api" and dst != "api"):
                wrong.append(f"{mod} -> {t}")
            elif src in ABOVE and dst in ABOVE and src != dst:
                wrong.append(f"{mod} -> {t}")
            elif t.endswith(".cli") and dst in ABOVE and mod != "kvblocks.__main__" and src != dst:
                wrong.append(f"{mod} -> {t}")
    assert not wrong, "imports against the layering of docs/architecture.md: " + ", ".join(wrong)


def test_no_import_circles():
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack, on, circles = [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(frozenset(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert set(circles) <= KNOWN_CIRCLES, [sorted(c) for c in circles if c not in KNOWN_CIRCLES]


def test_the_scan_sees_imports():
    """The scan itself: relative, lazy and package-level imports are found."""
    assert (
        "kvblocks.integrations.transformers_cb.context"
        in GRAPH["kvblocks.integrations.transformers_cb.pool"]
    )
    assert "kvblocks.bench.cli" in GRAPH["kvblocks.__main__"]
    assert "kvblocks.groups" in GRAPH["kvblocks.integrations.transformers.rows"]


def test_the_c_library_and_the_extension_compile_the_same_core():
    """CMakeLists.txt (libkvblocks) and setup.py (the Python extension) list csrc/ twice: the
    same files, plus capi.c for the C library, and every .c file of csrc/ is in both."""
    import re

    cmake = set(re.findall(r"csrc/\w+\.c", (ROOT / "CMakeLists.txt").read_text()))
    setup = set(re.findall(r'"(csrc/\w+\.c)"', (ROOT / "setup.py").read_text()))
    tree = {f"csrc/{p.name}" for p in (ROOT / "csrc").glob("*.c")}
    assert cmake == tree, sorted(cmake ^ tree)
    assert setup | {"csrc/capi.c"} == tree, sorted((setup | {"csrc/capi.c"}) ^ tree)
