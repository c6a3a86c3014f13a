"""Hypothesis strategies for kvblocks: workloads and hostile inputs.

Workloads: :func:`token_lists`, :func:`prompts` (prompts that share prefixes, so the prefix
cache hits); KV cache group configurations: :func:`group_configs`.

Hostile inputs are *recipes*: a :class:`Hostile` builds the actual argument for one manager
with ``make(target, log)``, so a side-by-side test gives the core and the reference model
each their own argument, and an argument that calls back into "the manager" calls back into
the one it was made for. Callbacks append what they did to ``log``. They cover:

* sequence ids that alias live ones (``1.0``, ``True``, ``np.int64(1)``, ``np.bool_``),
  int and str subclasses whose ``__hash__`` / ``__eq__`` / ``__index__`` raise or call back
  into the manager, unhashable and other wrong types (:func:`seq_ids`);
* iterables of ids: generators (consumed once), generators that call back mid-way or raise,
  numpy arrays of ids, non-iterables (:func:`seq_id_iterables`);
* token arrays whose ``__array__`` re-enters the manager or raises, 2-D, float, bool,
  object, non-contiguous, big-endian and out-of-int32 arrays (:func:`token_arrays`);
* scalars: huge, negative, float, bool, numpy, None, objects with only ``__index__``
  (:func:`scalars`);
* block-hash arrays of the wrong dtype, shape or range (:func:`hash_arrays`).

Needs hypothesis.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import numpy as np
from hypothesis import strategies as st

from ..groups import KVGroup

__all__ = [
    "Hostile",
    "Effect",
    "token_lists",
    "prompts",
    "group_configs",
    "effects",
    "seq_ids",
    "seq_id_iterables",
    "token_arrays",
    "scalars",
    "hash_arrays",
    "HUGE",
]

#: scalars beyond anything a pool can hold
HUGE = (2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 2**100)


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------
def token_lists(*, min_size: int = 0, max_size: int = 24, vocab: int = 50):
    return st.lists(st.integers(0, vocab), min_size=min_size, max_size=max_size)


def group_configs(*, max_span: int = 9, max_state: int = 2):
    """``groups=`` tuples for ``BlockManager``: full + sliding window, full + chunked local,
    full + state, a sliding window alone, and mixes of up to three groups of any kind.
    Windows and chunks take 1..``max_span`` tokens (with blocks of 1 to 4 tokens: smaller and
    larger than a block, and on a block boundary), states 1..``max_state`` blocks.

    >>> from hypothesis import given
    >>> @given(group_configs())
    ... def test(groups):
    ...     assert 1 <= len(groups) <= 3 and all(isinstance(g, KVGroup) for g in groups)
    >>> test()
    """
    spans = st.integers(1, max_span)
    full = st.just(KVGroup("full"))
    window = spans.map(lambda w: KVGroup("sliding_window", window=w))
    chunk = spans.map(lambda c: KVGroup("chunked_local", chunk=c))
    state = st.integers(1, max_state).map(lambda b: KVGroup("state", blocks=b))
    return st.one_of(
        st.tuples(full, window),
        st.tuples(full, chunk),
        st.tuples(full, state),
        st.tuples(window),
        st.lists(st.one_of(window, chunk, state, full), min_size=1, max_size=3).map(tuple),
    )


def prompts(prefixes: Sequence[Sequence[int]], *, max_tail: int = 8, vocab: int = 50):
    """A cut of one of ``prefixes`` plus new tokens."""
    return st.builds(
        lambda p, cut, tail: list(p)[:cut] + tail,
        st.sampled_from(prefixes),
        st.integers(0, max(len(p) for p in prefixes)),
        token_lists(max_size=max_tail, vocab=vocab),
    )


def requests(
    prefixes: Sequence[Sequence[int]],
    *,
    max_tail: int = 32,
    max_output: int = 64,
    vocab: int = 50,
):
    """One request of a serving workload, as a dict: ``prompt`` (a shared prefix, such as a
    system prompt or an earlier turn, plus new tokens), ``output_len`` (skewed short: most
    answers are short, some run to ``max_output``), ``n`` (parallel samples: forks),
    ``drafts`` (speculative tokens proposed per step, 0 for none) and ``preempt`` (None, or
    how the engine preempts it once: ``"free"`` for recompute, ``"swap_out"``, or
    ``"truncate"`` of its last tokens)."""
    return st.fixed_dictionaries(
        {
            "prompt": prompts(prefixes, max_tail=max_tail, vocab=vocab),
            "output_len": st.one_of(
                st.integers(1, max(1, max_output // 8)), st.integers(1, max_output)
            ),
            "n": st.sampled_from([1, 1, 1, 2, 4]),
            "drafts": st.sampled_from([0, 0, 2, 4]),
            "preempt": st.sampled_from([None, None, "free", "swap_out", "truncate"]),
        }
    )


def workloads(prefixes: Sequence[Sequence[int]], *, max_requests: int = 16, **kw):
    """A list of ``requests`` (arrival order), sharing ``prefixes``."""
    return st.lists(requests(prefixes, **kw), min_size=1, max_size=max_requests)


# ---------------------------------------------------------------------------------------------
# recipes and callbacks
# ---------------------------------------------------------------------------------------------
class Effect:
    """What a hostile hook does when the callee runs it: ``Effect("call", (method, args))``
    calls back into the object it was made for (a KVBlocksError of that inner call is
    swallowed, so the core and the reference see the same thing); ``Effect("raise", E)``
    raises ``E``."""

    def __init__(self, kind: str, arg: Any = None) -> None:
        self.kind, self.arg = kind, arg

    def __repr__(self) -> str:
        if self.kind == "call":
            name, args = self.arg
            return f"<calls {name}{tuple(args)!r}>"
        return f"<raises {self.arg.__name__}>"

    def run(self, target, log: List[str]) -> None:
        from ..errors import KVBlocksError

        log.append(repr(self))
        if self.kind == "raise":
            raise self.arg("raised by a hostile hook")
        name, args = self.arg
        try:
            getattr(target, name)(*args)
        except KVBlocksError:
            pass


class Hostile:
    """A recipe: ``make(target, log)`` builds a fresh argument for ``target``."""

    def __init__(
        self,
        label: str,
        build: Callable[[Any, List[str]], Any],
        *,
        huge: bool = False,
        runs_code: bool = False,
    ) -> None:
        #: huge: a size beyond anything a pool holds; runs_code: converting the argument
        #: legitimately runs its own code (``__array__``, a generator's body)
        self.label, self.build, self.huge, self.runs_code = label, build, huge, runs_code

    def make(self, target=None, log: Optional[List[str]] = None):
        return self.build(target, [] if log is None else log)

    def __repr__(self) -> str:
        return self.label


def _plain(value, label=None, **kw) -> Hostile:
    def build(_t, _log):
        return value.copy() if isinstance(value, np.ndarray) else value

    return Hostile(label or repr(value), build, **kw)


def effects(live_ids: Sequence = ("a", 1), new_id: Any = "from-callback", calls=None):
    """Callbacks into the manager (free a live sequence, add one, append to one; or the
    given ``calls``: ``(method, args)`` pairs) or raising hooks (RuntimeError, KeyError,
    TypeError, kvblocks' own UnknownSequenceError)."""
    from ..errors import UnknownSequenceError

    if calls is None:
        calls = (
            [("free", (s,)) for s in live_ids]
            + [("append", (s, [9])) for s in live_ids]
            + [("add", (new_id, [1, 2, 3, 4, 5]))]
        )
    return st.one_of(
        st.sampled_from(list(calls)).map(lambda c: Effect("call", c)),
        st.sampled_from([RuntimeError, KeyError, TypeError, UnknownSequenceError]).map(
            lambda e: Effect("raise", e)
        ),
    )


# -- ids -------------------------------------------------------------------------------------
class _HookInt(int):
    """An int subclass whose dunder methods run an effect first."""

    _effect: Effect
    _target: Any
    _log: List[str]

    def _hook(self):
        self._effect.run(self._target, self._log)

    def __hash__(self):
        self._hook()
        return int.__hash__(self)

    def __eq__(self, other):
        self._hook()
        return int.__eq__(self, other)

    def __ne__(self, other):
        self._hook()
        return int.__ne__(self, other)

    def __index__(self):
        self._hook()
        return int.__index__(self)

    def __int__(self):
        self._hook()
        return int.__int__(self)


class _HookStr(str):
    """A str subclass whose __hash__ / __eq__ run an effect first."""

    _effect: Effect
    _target: Any
    _log: List[str]

    def __hash__(self):
        self._effect.run(self._target, self._log)
        return str.__hash__(self)

    def __eq__(self, other):
        self._effect.run(self._target, self._log)
        return str.__eq__(self, other)

    def __ne__(self, other):
        self._effect.run(self._target, self._log)
        return str.__ne__(self, other)


class IndexOnly:
    """Not an int, but has ``__index__`` (which may run an effect)."""

    def __init__(self, value, effect=None, target=None, log=None):
        self.value, self._effect, self._target, self._log = value, effect, target, log

    def __index__(self):
        if self._effect is not None:
            self._effect.run(self._target, self._log)
        return self.value

    def __repr__(self):
        return f"IndexOnly({self.value})"


def _hooked(cls, value, effect: Effect) -> Hostile:
    def build(target, log):
        obj = cls(value)
        obj._effect, obj._target, obj._log = effect, target, log
        return obj

    return Hostile(f"{cls.__name__.lstrip('_')}({value!r}, {effect!r})", build)


def seq_ids(live_ids: Sequence = ("a", 1), other_ids: Sequence = ("zz", 99), hooks=None):
    """One sequence id: live, unknown, aliases of live ints (float, bool, numpy), hooked int
    and str subclasses (equal to live ids), and wrong types."""
    hooks = effects(live_ids) if hooks is None else hooks
    ints = [s for s in live_ids if type(s) is int] or [1]
    strs = [s for s in live_ids if type(s) is str] or ["a"]
    plain = st.sampled_from(list(live_ids) + list(other_ids)).map(_plain)

    def aliases_of(i):
        out = [
            _plain(float(i)),
            _plain(True),
            _plain(np.bool_(True), "np.bool_(True)"),
            _plain(np.float64(i), f"np.float64({i})"),
            _plain(complex(i)),
        ]
        if i < 2**63:  # numpy integers equal to a live id: the same id
            out += [_plain(np.int64(i), f"np.int64({i})"), _plain(np.uint64(i), f"np.uint64({i})")]
        if i < 256:
            out.append(_plain(np.uint8(i), f"np.uint8({i})"))
        return st.sampled_from(out)

    aliases = st.sampled_from(ints).flatmap(aliases_of)
    wrong = st.sampled_from(
        [
            _plain(None),
            _plain(b"a"),
            _plain(("a",)),
            _plain(1.5),
            _plain(float("nan")),
            Hostile("[1]", lambda _t, _log: [1]),
            Hostile("{'a'}", lambda _t, _log: {"a"}),
        ]
    )
    hooked = st.one_of(
        st.tuples(st.sampled_from(ints), hooks).map(lambda a: _hooked(_HookInt, *a)),
        st.tuples(st.sampled_from(strs), hooks).map(lambda a: _hooked(_HookStr, *a)),
    )
    return st.one_of(plain, aliases, wrong, hooked)


def seq_id_iterables(live_ids: Sequence = ("a", 1), other_ids: Sequence = ("zz", 99), hooks=None):
    """``seq_ids`` arguments: lists, tuples, generators (one pass), generators that call back
    or raise half way, numpy arrays of int ids, and things that are not iterables of ids."""
    hooks = effects(live_ids) if hooks is None else hooks
    one = seq_ids(live_ids, other_ids, hooks)
    plain_ids = st.lists(st.sampled_from(list(live_ids) + list(other_ids)), max_size=3)

    def as_list(items):
        return Hostile(
            f"[{', '.join(map(repr, items))}]", lambda t, log: [i.make(t, log) for i in items]
        )

    def as_tuple(ids):
        return _plain(tuple(ids))

    def as_gen(ids):
        return Hostile(f"gen{tuple(ids)!r}", lambda t, log: (i for i in ids))

    def gen_with(args):
        ids, effect = args

        def build(t, log):
            def g():
                for k, i in enumerate(ids):
                    if k == len(ids) // 2:
                        effect.run(t, log)
                    yield i

            return g()

        return Hostile(f"gen{tuple(ids)!r} with {effect!r}", build, runs_code=True)

    ints = [s for s in live_ids if type(s) is int] or [1]
    return st.one_of(
        st.lists(one, max_size=3).map(as_list),
        plain_ids.map(as_tuple),
        plain_ids.map(as_gen),
        st.tuples(plain_ids.filter(bool), hooks).map(gen_with),
        st.lists(st.sampled_from([i for i in ints if i < 2**63] or [1]), max_size=3).map(
            lambda ids: _plain(np.array(ids, dtype=np.int64), f"np.array({ids})")
        ),
        st.sampled_from([_plain(5), _plain(None), _plain(1.0)]),
    )


# -- tokens ----------------------------------------------------------------------------------
class ArrayLike:
    """``np.asarray`` calls ``__array__``: run an effect (or raise) there, then return the
    tokens."""

    def __init__(self, tokens, effect, target, log):
        self.tokens, self._effect, self._target, self._log = tokens, effect, target, log

    def __array__(self, dtype=None, copy=None):
        self._effect.run(self._target, self._log)
        return np.asarray(self.tokens, dtype=dtype)

    def __len__(self):
        return len(self.tokens)

    def __repr__(self):
        return f"ArrayLike({self.tokens}, {self._effect!r})"


def token_arrays(
    live_ids: Sequence = ("a", 1), *, max_size: int = 5, values=st.integers(0, 50), hooks=None
):
    """Token arguments: good ones (lists, int arrays of several dtypes, ranges, tuples) and
    odd ones (2-D, float, bool, object, non-contiguous, big-endian, beyond int32, strings,
    generators), and array-likes whose ``__array__`` calls back into the manager or raises."""
    hooks = effects(live_ids) if hooks is None else hooks
    small = st.lists(values, max_size=max_size)
    good = st.one_of(
        small.map(lambda t: _plain(list(t))),
        st.tuples(small, st.sampled_from(["int32", "int64", "uint8", "uint64", ">i4"])).map(
            lambda a: _plain(
                np.array([abs(v) for v in a[0]] if "u" in a[1] else a[0], dtype=a[1]),
                f"np.array({a[0]}, {a[1]})",
            )
        ),
        small.map(lambda t: _plain(np.array(t + t, dtype=np.int32)[::2], f"non-contiguous {t}")),
        st.integers(0, max_size).map(lambda n: _plain(range(n))),
        small.map(lambda t: _plain(tuple(t))),
    )
    odd = st.sampled_from(
        [
            _plain(np.zeros((2, 2), dtype=np.int32), "2-D int32"),
            _plain(np.array([1.0, 2.0]), "float64"),
            _plain(np.array([True, False]), "bool array"),
            _plain(np.array([1, 2], dtype=object), "object array"),
            _plain([True, 1], "[True, 1]"),
            _plain([1.5]),
            _plain([1, "x"]),
            _plain([[1, 2], [3]], "ragged"),
            _plain(np.array([1, 2**40]), "beyond int32"),
            _plain(np.array([2**64 - 1], dtype=np.uint64), "uint64 max"),
            _plain([2**70]),
            _plain([-(2**31) - 1]),
            _plain("abc"),
            _plain(b"abc"),
            _plain(None),
            _plain(7),
            _plain(np.int64(7), "np.int64(7)"),
            _plain({1: 2}),
            Hostile("generator", lambda t, log: (i for i in [1, 2])),
            _plain(np.array([], dtype=np.float64), "empty float64"),
            _plain(np.zeros((0, 3), dtype=np.int32), "empty 2-D"),
        ]
    )
    array_like = st.tuples(small, hooks).map(
        lambda a: Hostile(
            f"ArrayLike({a[0]}, {a[1]!r})",
            lambda t, log, a=a: ArrayLike(a[0], a[1], t, log),  # type: ignore[misc]  # mypy cannot type a lambda with defaults
            runs_code=True,
        )
    )
    return st.one_of(good, odd, array_like)


# -- scalars ---------------------------------------------------------------------------------
def scalars(live_ids: Sequence = ("a", 1), small=st.integers(-2, 12), hooks=None):
    """Counts and sizes: small ints (and numpy ints), huge and negative values, floats, bools,
    None, strings, int subclasses with hooks and objects with only ``__index__``."""
    hooks = effects(live_ids) if hooks is None else hooks
    hooked = st.tuples(st.integers(0, 6), hooks)
    return st.one_of(
        small.map(_plain),
        small.map(lambda n: _plain(np.int64(n), f"np.int64({n})")),
        st.sampled_from(HUGE).map(lambda n: _plain(n, huge=True)),
        st.sampled_from(
            [
                _plain(np.uint64(2**64 - 1), "np.uint64(2**64-1)", huge=True),
                _plain(-(2**63)),
                _plain(-(2**100)),
                _plain(np.int64(-1), "np.int64(-1)"),
                _plain(1.0),
                _plain(2.5),
                _plain(float("nan")),
                _plain(float("inf")),
                _plain(True),
                _plain(False),
                _plain(np.bool_(True), "np.bool_(True)"),
                _plain(np.float64(3.0), "np.float64(3.0)"),
                _plain(None),
                _plain("3"),
                _plain(3 + 0j),
            ]
        ),
        hooked.map(lambda a: _hooked(_HookInt, *a)),
        hooked.map(
            lambda a: Hostile(
                f"IndexOnly({a[0]}, {a[1]!r})",
                lambda t, log, a=a: IndexOnly(a[0], a[1], t, log),  # type: ignore[misc]
            )
        ),
    )


def hash_arrays(good: np.ndarray):
    """Block-hash arguments: the good (n, 2) uint64 array and prefixes of it, 128-bit int
    lists, and wrong dtypes, shapes and ranges."""
    ints = [int(lo) | (int(hi) << 64) for lo, hi in good.tolist()]
    return st.one_of(
        st.integers(0, len(good)).map(lambda k: _plain(good[:k].copy(), f"hashes[:{k}]")),
        st.integers(1, max(1, len(ints))).map(lambda k: _plain(ints[:k], f"ints[:{k}]")),
        st.sampled_from(
            [
                _plain(good.astype(np.int64), "int64 hashes"),
                _plain(good.reshape(-1), "1-D"),
                _plain(good.T.copy(), "transposed"),
                _plain(np.zeros((2, 3), dtype=np.uint64), "(2, 3)"),
                _plain([-1]),
                _plain([1 << 128]),
                _plain([1, "x"]),
                _plain([True]),
                _plain(None),
                _plain(good[:, ::-1], "non-contiguous"),
            ]
        ),
    )
