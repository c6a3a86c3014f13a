"""libkvblocks, the C library, as the wheel vendors it: where its header and shared object
are, and the compiler flags that build an engine against them (``kvblocks config``).

The wheel carries ``kvblocks/include/kvblocks.h`` and ``kvblocks/_libkvblocks*.so``: the same
core as ``kvblocks._core`` with only the public C API exported (docs/c-api.md). An engine in
C, C++ or Rust links it by path with an rpath, so no install step is needed::

    cc engine.c $(python -m kvblocks config --cflags --libs)

A system install (CMake, ``libkvblocks.so.1`` and pkg-config's ``kvblocks.pc``) is the other
way; this module only describes the vendored copy.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import List, Optional

from .errors import InvalidStateError

__all__ = ["include_dir", "library_path", "cflags", "libs"]

_PKG = Path(__file__).resolve().parent


def include_dir() -> Path:
    """The folder holding ``kvblocks.h``."""
    d = _PKG / "include"
    if not (d / "kvblocks.h").is_file():
        raise InvalidStateError(
            f"no kvblocks.h in {d}: this kvblocks was not built with its C library (build the "
            "package, or use a CMake install and pkg-config: docs/c-api.md)"
        )
    return d


def library_path() -> Path:
    """The vendored shared library (``_libkvblocks*.so``)."""
    found = sorted(_PKG.glob("_libkvblocks*.so")) + sorted(_PKG.glob("_libkvblocks*.dylib"))
    if not found:
        raise InvalidStateError(
            f"no _libkvblocks shared library in {_PKG}: build the package, or use a CMake "
            "install and pkg-config (docs/c-api.md)"
        )
    return found[0]


def cflags() -> List[str]:
    """Compiler flags: the include folder."""
    return [f"-I{include_dir()}"]


def libs() -> List[str]:
    """Linker flags: the library by file name in its folder, and an rpath to that folder."""
    lib = library_path()
    return [f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"]


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="compiler flags for the C library this package vendors (libkvblocks)",
        description="Print the flags that build a C, C++ or Rust engine against the libkvblocks "
        "this package carries: cc engine.c $(python -m kvblocks config --cflags --libs).",
    )
    p.add_argument("--cflags", action="store_true", help="the include flag")
    p.add_argument("--libs", action="store_true", help="the library and an rpath to it")
    p.add_argument("--include-dir", action="store_true", help="the folder of kvblocks.h")
    p.add_argument("--lib", action="store_true", help="the shared library's path")


def run(args: argparse.Namespace, out: Optional[List[str]] = None) -> int:
    """Print what the flags ask for (all of --cflags and --libs when none is given)."""
    parts: List[str] = []
    if not (args.cflags or args.libs or args.include_dir or args.lib):
        args.cflags = args.libs = True
    if args.include_dir:
        parts.append(str(include_dir()))
    if args.lib:
        parts.append(str(library_path()))
    if args.cflags:
        parts += cflags()
    if args.libs:
        parts += libs()
    print(" ".join(shlex.quote(p) for p in parts))
    return 0
