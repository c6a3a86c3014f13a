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
#: (importer, imported) package pairs above the API that the page allows: a bench of an
#: integration imports it (`kvblocks bench vllm`); nothing imports bench/ back
BENCHED = {("bench", "integrations")}
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
            elif src in ABOVE and dst in ABOVE and src != dst and (src, dst) not in BENCHED:
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


# -- the C core: calls between csrc/*.c files point down ---------------------------------------
#: C file circles still open, each with its owner (see the page's "Layering")
KNOWN_C_CIRCLES: Set[frozenset] = set()  # none left: one group's add / probe live in groups.c


def _c_strip(text: str) -> str:
    """C source without comments and string literals (line count kept)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


_C_DEF = re.compile(r"^[A-Za-z_][\w \t*]*?\b(kvb_\w+)\s*\([^;{]*\)\s*\{", re.M | re.S)


def c_call_graph(texts: Dict[str, str]) -> Dict[str, Set[str]]:
    """file -> the other files whose kvb_* functions it calls (a function belongs to the file
    that defines it; calls through function pointers are not edges: the pool's policy)."""
    owner: Dict[str, str] = {}
    for f, t in texts.items():
        for m in _C_DEF.finditer(t):
            owner.setdefault(m.group(1), f)
    graph: Dict[str, Set[str]] = {f: set() for f in texts}
    for f, t in texts.items():
        for name in set(re.findall(r"\b(kvb_\w+)\s*\(", t)):
            o = owner.get(name)
            if o is not None and o != f:
                graph[f].add(o)
    return graph


def circles(graph: Dict[str, Set[str]]) -> Set[frozenset]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack, on, out = [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.add(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


C_TEXTS = {p.name: _c_strip(p.read_text()) for p in sorted((ROOT / "csrc").glob("*.c"))}
C_GRAPH = c_call_graph(C_TEXTS)


def test_no_call_circles_among_c_files():
    found = circles(C_GRAPH)
    new = [sorted(c) for c in found - KNOWN_C_CIRCLES]
    assert not new, f"csrc/ files call each other in a circle: {new}"
    gone = [sorted(c) for c in KNOWN_C_CIRCLES - found]
    assert not gone, f"known circle {gone} is gone: drop it from KNOWN_C_CIRCLES"


def test_nothing_below_the_tier_names_it():
    """pool.c, cache.c and policy.c are plain data structures and a policy: they call nothing
    of tier.c (or above) and never read the pool's tier pointer; the tier drains their log."""
    below = {"pool.c", "cache.c", "policy.c", "events.c", "hash.c", "sha256.c"}
    for f in below:
        assert C_GRAPH[f] <= below, f"{f} calls up into {sorted(C_GRAPH[f] - below)}"
        assert not re.search(r"\bkvb_tier\w*|->tier\b", C_TEXTS[f]), f"{f} names the host tier"
    assert not re.search(
        r"\bkvb_twins_t\b|->policy\b", C_TEXTS["pool.c"].replace("free(p->policy)", "")
    ), "pool.c names a policy (it is given one: p->victim)"


def test_the_c_scan_sees_calls_and_circles():
    """The scanner itself: a definition is found, a call makes an edge, a circle is found."""
    assert "cache.c" in C_GRAPH["pool.c"] and "pool.c" in C_GRAPH["tier.c"]
    texts = {
        "a.c": "int kvb_a(int x) {\n  return kvb_b(x);\n}\n",
        "b.c": "/* kvb_c() */ static int g;\nint kvb_b(int x)\n{\n  return kvb_c(x);\n}\n",
        "c.c": 'KVB_NOINLINE void kvb_c(int *p) { (void)"kvb_a("; }\n',
    }
    g = c_call_graph({f: _c_strip(t) for f, t in texts.items()})
    assert g == {"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": set()}
    assert circles(g) == set()
    texts["c.c"] = "KVB_NOINLINE void kvb_c(int *p) { kvb_a(*p); }\n"
    assert circles(c_call_graph(texts)) == {frozenset({"a.c", "b.c", "c.c"})}
