"""Testing tools for kvblocks and for engines built on it.

* :class:`ReferenceManager` / :class:`ReferencePool`: the executable specification of
  BlockManager / BlockPool (pure Python, same methods), for side-by-side model tests;
* :class:`KVReadback`: device and host K/V caches next to a manager, checking that every
  sequence reads back exactly its own K/V;
* :mod:`kvblocks.testing.strategies`: hypothesis strategies (workloads, hostile inputs);
* :class:`EngineMachine`: a hypothesis state machine that runs a manager as an engine does;
  :class:`GroupsEngineMachine` the same over random KV cache groups;
* :func:`tiny_config` / :data:`TINY_LM`: the tiny random transformers model of the tests,
  examples and benchmarks (transformers is imported only when a config is built).

The last two need hypothesis; importing this package does not.
"""

from .readback import KVReadback, ReadbackError
from .reference import ReferenceManager, ReferenceMetadata, ReferencePool, same_error
from .tiny import TINY_LM, tiny_config, tiny_lm

__all__ = [
    "EngineMachine",
    "GroupsEngineMachine",
    "KVReadback",
    "ReadbackError",
    "ReferenceManager",
    "ReferenceMetadata",
    "ReferencePool",
    "same_error",
    "strategies",
    "TINY_LM",
    "tiny_config",
    "tiny_lm",
]


def __getattr__(name):  # hypothesis only when these are used
    import importlib

    if name in ("EngineMachine", "GroupsEngineMachine"):
        return getattr(importlib.import_module(__name__ + ".machines"), name)
    if name == "strategies":
        return importlib.import_module(__name__ + ".strategies")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
