"""Build of the C core and its Cython wrapper (metadata lives in pyproject.toml).

KVBLOCKS_DEBUG=1     -O0 -g, C assertions (KVB_ASSERT, KVB_MUST) and Cython bounds checks on.
KVBLOCKS_DEBUG=2     the same, plus the full invariant check after every BlockManager call.
KVBLOCKS_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer, -fno-wrapv so that signed
                     overflow is reported (run python with
                     LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
KVBLOCKS_SANITIZE=preload  the same instrumentation, but no sanitizer runtime is linked: the
                     process preloads one, gcc's (LD_PRELOAD="libasan.so libubsan.so") or
                     atheris's asan_with_fuzzer.so, which keeps the fuzzer's coverage working
                     (fuzz/README.md).
"""

import os
import shutil
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG_LEVEL = os.environ.get("KVBLOCKS_DEBUG", "") or "0"
DEBUG = DEBUG_LEVEL != "0"
SANITIZE = os.environ.get("KVBLOCKS_SANITIZE", "") not in ("", "0")
PRELOAD = os.environ.get("KVBLOCKS_SANITIZE", "") == "preload"

# the headers every C file may include: a change rebuilds both extensions
C_HEADERS = [
    "csrc/core.h",
    "csrc/internal.h",
    "csrc/table.h",
    "csrc/manager.h",
    "include/kvblocks.h",
]
C_SOURCES = [
    "csrc/hash.c",
    "csrc/sha256.c",
    "csrc/chain.c",
    "csrc/events.c",
    "csrc/wire.c",
    "csrc/pool.c",
    "csrc/cache.c",
    "csrc/policy.c",
    "csrc/debug.c",
    "csrc/table.c",
    "csrc/manager.c",
    "csrc/admit.c",
    "csrc/append.c",
    "csrc/tier.c",
    "csrc/meta.c",
    "csrc/groups.c",
    "csrc/hosthits.c",
    "csrc/rows.c",
    "csrc/step.c",
    "csrc/query.c",
]

compile_args = ["-std=c11"] if sys.platform != "win32" else []
link_args = []
macros = []
if sys.platform != "win32":
    compile_args += ["-Wall", "-Wno-unused-function"]
    if DEBUG or SANITIZE:
        compile_args += ["-O0", "-g", "-UNDEBUG"]
        macros.append(("KVB_DEBUG", "2" if DEBUG_LEVEL == "2" else "1"))
    else:
        compile_args += ["-O3"]
    if SANITIZE:
        flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
        # Python's CFLAGS carry -fwrapv, which defines signed overflow and so turns UBSan's
        # check for it off; extra_compile_args come after CFLAGS on the command line, and the
        # last of -fwrapv / -fno-wrapv wins
        compile_args += flags + ["-fno-wrapv"]
        if not PRELOAD:
            link_args += flags

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
}

ext = Extension(
    "kvblocks._core",
    sources=["kvblocks/_core.pyx"] + C_SOURCES,
    include_dirs=["csrc", numpy.get_include()],
    define_macros=macros + [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    depends=C_HEADERS + ["kvblocks/_core.pxd"],
)

# libkvblocks vendored in the wheel (docs/c-api.md, `kvblocks config --cflags --libs`): the same
# sources and csrc/capi.c as a plain shared object beside _core, exporting only the public API
# (hidden visibility, the version script); engines link it by path, with an rpath
lib_compile = compile_args + (["-fvisibility=hidden"] if sys.platform != "win32" else [])
lib_link = link_args + (
    ["-Wl,--version-script=cmake/libkvblocks.map"] if sys.platform.startswith("linux") else []
)
lib = Extension(
    "kvblocks._libkvblocks",
    sources=C_SOURCES + ["csrc/capi.c"],
    include_dirs=["csrc", "include"],
    define_macros=macros + [("KVBLOCKS_BUILD", "1")],
    extra_compile_args=lib_compile,
    extra_link_args=lib_link,
    depends=C_HEADERS + ["cmake/libkvblocks.map"],
)


class BuildExt(build_ext):
    """build_ext that also puts the public header in the package (kvblocks/include/)."""

    def get_export_symbols(self, ext):
        return [] if ext.name == "kvblocks._libkvblocks" else super().get_export_symbols(ext)

    def run(self):
        super().run()
        base = "" if self.inplace else self.build_lib
        dst = os.path.join(base, "kvblocks", "include")
        os.makedirs(dst, exist_ok=True)
        shutil.copyfile(os.path.join("include", "kvblocks.h"), os.path.join(dst, "kvblocks.h"))


setup(
    ext_modules=cythonize([ext], compiler_directives=directives, force=DEBUG or SANITIZE) + [lib],
    cmdclass={"build_ext": BuildExt},
)
