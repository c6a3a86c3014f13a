"""Build of the C core and its Cython wrapper (metadata lives in pyproject.toml).

KVBLOCKS_DEBUG=1     -O0 -g, C assertions (KVB_ASSERT, KVB_MUST) and Cython bounds checks on.
KVBLOCKS_DEBUG=2     the same, plus the full invariant check after every BlockManager call.
KVBLOCKS_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (run python with
                     LD_PRELOAD=$(gcc -print-file-name=libasan.so)).
"""
import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG_LEVEL = os.environ.get("KVBLOCKS_DEBUG", "") or "0"
DEBUG = DEBUG_LEVEL != "0"
SANITIZE = os.environ.get("KVBLOCKS_SANITIZE", "") not in ("", "0")

C_SOURCES = ["csrc/hash.c", "csrc/pool.c", "csrc/cache.c", "csrc/table.c", "csrc/meta.c"]

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
        compile_args += flags
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
    depends=["csrc/kvblocks.h", "csrc/internal.h", "kvblocks/_core.pxd"],
)

setup(ext_modules=cythonize([ext], compiler_directives=directives, force=DEBUG or SANITIZE))
