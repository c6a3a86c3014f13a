"""Workloads: the requests a simulation replays, and the loaders that read them.

Three sources, one :class:`Workload`:

* **Mooncake JSONL** (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``):
  each hash id stands for 512 deterministic tokens (:mod:`kvblocks.sim.workload.tokens`); a prompt is
  its ids' tokens cut to ``input_length``, so equal ids at equal positions share content.
* **Azure LLM inference CSV** (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``): lengths
  only, so every prompt is unique content (no prefix sharing is possible).
* **kvblocks workload JSONL** (the built-in default, see :mod:`kvblocks.sim.workload.builtin`): each
  prompt is a list of ``[segment_id, length]`` pieces (shared system prompts, earlier turns,
  earlier replies), ``n`` parallel samples, and an optional ``output_id`` naming the segment
  whose tokens the first sample generates (so a later turn can quote the reply exactly).

Every loader validates as it reads and raises :class:`WorkloadError` naming file and line.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import json
import math
import os
from typing import Dict, Generator, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import WorkloadError
from ..limits import MAX_SAMPLES, MAX_TOKENS, TIME_SCALE, shown
from .tokens import ID_BITS, NS_OUTPUT, NS_PROMPT, NS_SEGMENT, TokenBook, seed_of, stream

__all__ = [
    "Request",
    "Workload",
    "MAX_TOKENS",
    "MAX_SAMPLES",
    "load_workload",
    "load_mooncake",
    "load_azure_csv",
    "load_kvblocks_jsonl",
    "builtin_workload",
    "detect_format",
]

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id
MAX_TIMESTAMP_MS = 1e15  # JSONL arrival times (ms; epoch milliseconds fit)
MAX_TIMESTAMP_S = 1e12  # CSV arrival times (s; any date-time fits)


class Request:
    """One request: arrival (seconds from the workload start), lengths and prompt content."""

    __slots__ = (
        "index",
        "arrival",
        "prompt_len",
        "output_len",
        "n",
        "hash_ids",
        "segments",
        "output_id",
    )

    def __init__(
        self,
        index: int,
        arrival: float,
        prompt_len: int,
        output_len: int,
        n: int = 1,
        hash_ids: Optional[Tuple[int, ...]] = None,
        segments: Optional[Tuple[Tuple[int, int], ...]] = None,
        output_id: Optional[int] = None,
    ) -> None:
        self.index = index
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.n = n
        self.hash_ids = hash_ids
        self.segments = segments
        self.output_id = output_id

    def __repr__(self) -> str:
        return (
            f"Request(index={self.index}, arrival={self.arrival:.3f}, prompt_len={self.prompt_len}, "
            f"output_len={self.output_len}, n={self.n})"
        )

    def output_seed(self, sample: int) -> int:
        """Seed of the token stream sample ``sample`` generates."""
        if sample == 0 and self.output_id is not None:
            return seed_of(NS_SEGMENT, self.output_id)
        return seed_of(NS_OUTPUT, self.index * MAX_SAMPLES + sample)


class Workload:
    """An ordered list of requests plus the content (token ids) of their prompts."""

    def __init__(self, name: str, requests: List[Request], kind: str) -> None:
        self.name = name
        self.kind = kind
        self.requests = requests
        self._book = TokenBook()
        self._segments: Dict[int, np.ndarray] = {}
        self._memo: Dict[object, Dict[object, object]] = {}  # derived per-prompt data (hashes)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def head(self, count: int) -> "Workload":
        """The first ``count`` requests (shares the token caches)."""
        w = Workload(self.name, self.requests[:count], self.kind)
        w._book, w._segments, w._memo = self._book, self._segments, self._memo
        return w

    def scaled(self, factor: float) -> "Workload":
        """The same requests with arrival times multiplied by ``factor`` (0 = all at once)."""
        factor = TIME_SCALE.check(factor)
        reqs = [
            Request(
                r.index,
                r.arrival * factor,
                r.prompt_len,
                r.output_len,
                r.n,
                r.hash_ids,
                r.segments,
                r.output_id,
            )
            for r in self.requests
        ]
        w = Workload(self.name, reqs, self.kind)
        w._book, w._segments, w._memo = self._book, self._segments, self._memo
        return w

    def _segment(self, ident: int, length: int) -> np.ndarray:
        arr = self._segments.get(ident)
        if arr is None or arr.shape[0] < length:
            arr = stream(seed_of(NS_SEGMENT, ident), 0, length)
            self._segments[ident] = arr
        return arr[:length]

    def memo(self, name: object) -> Dict[object, object]:
        """A cache of per-prompt data keyed by :meth:`content_key`, shared by the workloads
        derived from this one (``head``, ``scaled``): e.g. the router's prompt hashes, computed
        once for every replay of a plan."""
        return self._memo.setdefault(name, {})

    @staticmethod
    def content_key(req: Request) -> object:
        """What a prompt's tokens are a function of (equal keys, equal tokens)."""
        if req.hash_ids is not None:
            return (req.hash_ids, req.prompt_len)
        if req.segments is not None:
            return req.segments
        return (req.index, req.prompt_len)

    def prompt_tokens(self, req: Request) -> np.ndarray:
        """The prompt's token ids (int32, contiguous)."""
        if req.hash_ids is not None:
            if not self._book.sized:  # size the book once for every id of the workload
                self._book.reserve(len({h for r in self.requests for h in r.hash_ids or ()}))
            return self._book.prompt(req.hash_ids, req.prompt_len)
        if req.segments is not None:
            parts = [self._segment(i, n) for i, n in req.segments]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        return stream(seed_of(NS_PROMPT, req.index), 0, req.prompt_len)

    def stats(self) -> Dict[str, float]:
        """Counts and mean lengths (for reports)."""
        p = np.fromiter(
            (r.prompt_len for r in self.requests), dtype=np.int64, count=len(self.requests)
        )
        o = np.fromiter(
            (r.output_len for r in self.requests), dtype=np.int64, count=len(self.requests)
        )
        n = np.fromiter((r.n for r in self.requests), dtype=np.int64, count=len(self.requests))
        span = self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0
        return {
            "requests": len(self.requests),
            "sequences": int(n.sum()),
            "prompt_tokens": int(p.sum()),
            "output_tokens": int((o * n).sum()),
            "mean_prompt": float(p.mean()) if len(p) else 0.0,
            "mean_output": float(o.mean()) if len(o) else 0.0,
            "max_total": int((p + o).max()) if len(p) else 0,
            "span_s": float(span),
        }


# ---------------------------------------------------------------- validation helpers


def _int_field(obj: dict, key: str, path: str, line: int, lo: int = 0, hi: int = MAX_TOKENS) -> int:
    if key not in obj:
        raise WorkloadError(f"missing field {key!r}", path, line)
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):  # 12.0, 1e400, NaN, Infinity, "12"
        raise WorkloadError(f"field {key!r} must be an integer, got {shown(v)}", path, line)
    if v < lo:
        raise WorkloadError(f"field {key!r} is {shown(v)}, must be >= {lo}", path, line)
    if v > hi:
        raise WorkloadError(
            f"field {key!r} is {shown(v)}, absurdly large (limit {hi:,})", path, line
        )
    return v


def _time_field(obj: dict, key: str, path: str, line: int) -> float:
    """A timestamp in ms: a finite number in [0, MAX_TIMESTAMP_MS] (fractions allowed)."""
    if key not in obj:
        raise WorkloadError(f"missing field {key!r}", path, line)
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise WorkloadError(
            f"field {key!r} must be a non-negative number of ms, got {shown(v)}", path, line
        )
    if v > MAX_TIMESTAMP_MS:
        raise WorkloadError(
            f"field {key!r} is {shown(v)}, absurdly large (limit {MAX_TIMESTAMP_MS:g} ms)",
            path,
            line,
        )
    return float(v)


def _open_lines(path: str) -> Generator[Tuple[int, str], None, None]:
    """(line number, text) of a UTF-8 file, decoded line by line so that a bad byte is named
    with its line (a leading byte-order mark is dropped); WorkloadError when it cannot be read."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise WorkloadError(f"cannot open: {e.strerror or e}", path) from None
    with f:
        lineno = 0
        try:
            for chunk in f:
                # \n, \r\n and a lone \r end lines, as in text mode (and csv's own reading)
                for raw in chunk.splitlines(keepends=True) if b"\r" in chunk else (chunk,):
                    lineno += 1
                    try:
                        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                    except UnicodeDecodeError as e:
                        raise WorkloadError(
                            f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                            f"save the trace as UTF-8",
                            path,
                            lineno,
                        ) from None
                    yield lineno, text
        except OSError as e:
            raise WorkloadError(f"read error: {e.strerror or e}", path, lineno + 1) from None


def _json_lines(path: str) -> Iterator[Tuple[int, dict]]:
    for lineno, text in _open_lines(path):
        text = text.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkloadError(
                f"malformed JSON ({e.msg} at column {e.colno})", path, lineno
            ) from None
        except (ValueError, RecursionError) as e:  # an integer of > 4300 digits; deep nesting
            raise WorkloadError(f"malformed JSON ({str(e).split(':')[0]})", path, lineno) from None
        if not isinstance(obj, dict):
            raise WorkloadError("each line must be a JSON object", path, lineno)
        yield lineno, obj


def _timed_records(path: str, limit: Optional[int]) -> Iterator[Tuple[int, dict, float]]:
    """(line number, object, arrival in seconds) of each request line of a JSONL trace, up to
    ``limit`` requests; ``timestamp`` is in milliseconds."""
    for count, (lineno, obj) in enumerate(_json_lines(path)):
        if limit is not None and count >= limit:
            break
        yield lineno, obj, _time_field(obj, "timestamp", path, lineno) / 1000.0


def _finish(name: str, kind: str, reqs: List[Request], path: str) -> Workload:
    if not reqs:
        raise WorkloadError("no requests in file", path)
    reqs.sort(key=lambda r: r.arrival)  # stable: equal times keep file order
    for i, r in enumerate(reqs):
        r.index = i
    return Workload(name, reqs, kind)


# ---------------------------------------------------------------- loaders


def load_mooncake(path: str, limit: Optional[int] = None) -> Workload:
    """Read a Mooncake trace (JSONL, timestamps in ms, 512-token hash ids)."""
    reqs: List[Request] = []
    for lineno, obj, t in _timed_records(path, limit):
        n_in = _int_field(obj, "input_length", path, lineno, lo=1)
        n_out = _int_field(obj, "output_length", path, lineno, lo=1)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not ids:
            raise WorkloadError(
                "field 'hash_ids' must be a non-empty list of integers", path, lineno
            )
        for h in ids:
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < (1 << ID_BITS):
                raise WorkloadError(
                    f"bad hash id {shown(h)} (must be an integer in [0, 2^{ID_BITS}))", path, lineno
                )
        if not MOONCAKE_BLOCK * (len(ids) - 1) < n_in <= MOONCAKE_BLOCK * len(ids):
            raise WorkloadError(
                f"input_length {n_in} does not match {len(ids)} hash ids of {MOONCAKE_BLOCK} tokens",
                path,
                lineno,
            )
        reqs.append(Request(len(reqs), t, n_in, n_out, hash_ids=tuple(ids)))
    return _finish(os.path.basename(path), "mooncake", reqs, path)


def _parse_timestamp(text: str) -> float:
    """Seconds: a plain number, or an ISO-like date-time (Azure: '2023-11-16 18:15:46.6805900')."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    frac = 0.0
    main = text
    if "." in text:
        main, tail = text.split(".", 1)
        digits = "".join(c for c in tail if c.isdigit())
        if not digits or not tail.startswith(digits):
            raise ValueError(text)
        frac = float("0." + digits)
        rest = tail[len(digits) :]
        main = main + rest  # keep a trailing zone (e.g. '+00:00')
    d = _dt.datetime.fromisoformat(main.replace("Z", "+00:00"))
    if d.tzinfo is None:
        d = d.replace(tzinfo=_dt.timezone.utc)
    return d.timestamp() + frac


def load_azure_csv(path: str, limit: Optional[int] = None) -> Workload:
    """Read an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens).

    A ``GeneratedTokens`` of 0 is treated as 1 (the prefill still produces one token).
    """
    lines = _open_lines(path)
    reqs: List[Request] = []
    t0: Optional[float] = None
    with contextlib.closing(lines):
        reader = csv.reader(text for _, text in lines)
        try:
            header = next(reader)
        except StopIteration:
            raise WorkloadError("empty file", path) from None
        except csv.Error as e:
            raise WorkloadError(f"malformed CSV ({e})", path, 1) from None
        cols = {c.strip(): i for i, c in enumerate(header)}
        need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
        absent = [c for c in need if c not in cols]
        if absent:
            raise WorkloadError(
                f"missing column(s) {', '.join(absent)} (need {', '.join(need)})", path, 1
            )
        it, ic, ig = (cols[c] for c in need)
        width = max(it, ic, ig) + 1
        while True:
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise WorkloadError(f"malformed CSV ({e})", path, reader.line_num) from None
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if limit is not None and len(reqs) >= limit:
                break
            if len(row) < width:
                raise WorkloadError(f"expected {len(header)} columns, got {len(row)}", path, lineno)
            try:
                t = _parse_timestamp(row[it])
            except (ValueError, OverflowError):
                raise WorkloadError(f"bad TIMESTAMP {shown(row[it])}", path, lineno) from None
            if (
                not math.isfinite(t) or abs(t) > MAX_TIMESTAMP_S
            ):  # nan never compares: replay would hang
                raise WorkloadError(
                    f"bad TIMESTAMP {shown(row[it])} (need a date-time or a finite number of seconds "
                    f"within +-{MAX_TIMESTAMP_S:g})",
                    path,
                    lineno,
                )
            vals = []
            for name, i, lo in (("ContextTokens", ic, 1), ("GeneratedTokens", ig, 0)):
                try:
                    v = int(row[i].strip())
                except ValueError:
                    raise WorkloadError(
                        f"{name} must be an integer, got {shown(row[i])}", path, lineno
                    ) from None
                if v < lo:
                    raise WorkloadError(f"{name} is {v}, must be >= {lo}", path, lineno)
                if v > MAX_TOKENS:
                    raise WorkloadError(
                        f"{name} is {v}, absurdly large (limit {MAX_TOKENS:,})", path, lineno
                    )
                vals.append(v)
            if t0 is None:
                t0 = t
            if t < t0:
                t0_shift = t0 - t
                for r in reqs:
                    r.arrival += t0_shift
                t0 = t
            reqs.append(Request(len(reqs), t - t0, vals[0], max(1, vals[1])))
    return _finish(os.path.basename(path), "azure", reqs, path)


def load_kvblocks_jsonl(
    path: str, limit: Optional[int] = None, name: Optional[str] = None
) -> Workload:
    """Read a kvblocks workload JSONL (segments, parallel samples; see module docstring)."""
    reqs: List[Request] = []
    for lineno, obj, t in _timed_records(path, limit):
        n_out = _int_field(obj, "output_length", path, lineno, lo=1)
        n = _int_field(obj, "n", path, lineno, lo=1, hi=MAX_SAMPLES) if "n" in obj else 1
        segs = obj.get("segments")
        if not isinstance(segs, list) or not segs:
            raise WorkloadError(
                "field 'segments' must be a non-empty list of [id, length] pairs", path, lineno
            )
        pieces = []
        for s in segs:
            ok = (
                isinstance(s, list)
                and len(s) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
            )
            if not ok or not 0 <= s[0] < (1 << ID_BITS) or not 1 <= s[1] <= MAX_TOKENS:
                raise WorkloadError(
                    f"bad segment {shown(s)} (need [id in [0, 2^{ID_BITS}), length in [1, {MAX_TOKENS:,}]])",
                    path,
                    lineno,
                )
            pieces.append((s[0], s[1]))
        total = sum(p[1] for p in pieces)
        if total > MAX_TOKENS:
            raise WorkloadError(f"prompt of {total} tokens is absurdly long", path, lineno)
        out_id = obj.get("output_id")
        if out_id is not None and (
            isinstance(out_id, bool)
            or not isinstance(out_id, int)
            or not 0 <= out_id < (1 << ID_BITS)
        ):
            raise WorkloadError(f"bad output_id {shown(out_id)} (must be an integer in [0, 2^{ID_BITS}))",
                                path, lineno)  # fmt: skip
        reqs.append(
            Request(len(reqs), t, total, n_out, n=n, segments=tuple(pieces), output_id=out_id)
        )
    return _finish(name or os.path.basename(path), "kvblocks", reqs, path)


def builtin_workload(limit: Optional[int] = None) -> Workload:
    """The default workload shipped in ``kvblocks/data/default_workload.jsonl``."""
    from .builtin import data_path

    return load_kvblocks_jsonl(str(data_path()), limit=limit, name="builtin:default")


def detect_format(path: str) -> str:
    """'mooncake', 'azure' or 'kvblocks' from the extension and the first line."""
    low = path.lower()
    if low.endswith(".csv"):
        return "azure"
    first = ""
    lines = _open_lines(path)
    with contextlib.closing(lines):
        for _, first in lines:
            if first.strip():
                break
    if first.lstrip().startswith("{"):
        return "kvblocks" if '"segments"' in first else "mooncake"
    if "TIMESTAMP" in first:
        return "azure"
    raise WorkloadError(
        "unknown trace format (expected Mooncake JSONL, kvblocks JSONL or Azure CSV)", path, 1
    )


def load_workload(
    path: Optional[str] = None, fmt: str = "auto", limit: Optional[int] = None
) -> Workload:
    """Load a workload file (or the built-in default when ``path`` is None)."""
    if limit is not None and limit < 1:
        raise WorkloadError(f"--limit must be >= 1, got {limit}")
    if path is None:
        return builtin_workload(limit)
    if not os.path.exists(path):
        raise WorkloadError("no such file", path)
    if os.path.isdir(path):
        raise WorkloadError("is a directory, not a trace file", path)
    if fmt == "auto":
        fmt = detect_format(path)
    loaders = {"mooncake": load_mooncake, "azure": load_azure_csv, "kvblocks": load_kvblocks_jsonl}
    if fmt not in loaders:
        raise WorkloadError(f"unknown format {fmt!r} (choose from {', '.join(loaders)})", path)
    return loaders[fmt](path, limit=limit)


def prefix_reuse(requests: Sequence[Request], block_size: int) -> np.ndarray:
    """Exact prompt tokens a prefix cache with unbounded memory serves, per request (Mooncake).

    Requests are taken in order. For each, the longest token prefix it shares with any
    earlier prompt is found from hash ids: whole 512-token ids match while the id *path*
    (all ids up to and including this position) was seen before; in the last, partial id the
    match is the shorter of the two cut lengths. Generated tokens never match a prompt. The
    count is then capped at ``prompt_len - 1`` and rounded down to whole blocks, which is what
    :meth:`BlockManager.add` reports. Needs ``block_size`` to divide 512 only for the
    partial-block case to be exact; it is exact for any size since matching is per token.
    """
    seen: Dict[
        Tuple[int, int], Tuple[int, int]
    ] = {}  # (parent node, id) -> (node, max tokens in block)
    out = np.zeros(len(requests), dtype=np.int64)
    for k, r in enumerate(requests):
        if r.hash_ids is None:
            raise ValueError("prefix_reuse needs Mooncake requests (hash ids)")
        node = 0
        match = 0
        counting = True
        for j, h in enumerate(r.hash_ids):
            mine = min(MOONCAKE_BLOCK, r.prompt_len - MOONCAKE_BLOCK * j)
            key = (node, h)
            got = seen.get(key)
            if counting:
                if got is None:
                    counting = False
                else:
                    match += min(got[1], mine)
                    if got[1] < mine:
                        counting = False
            if got is None:
                child = len(seen) + 1
                seen[key] = (child, mine)
            else:
                child = got[0]
                if mine > got[1]:
                    seen[key] = (child, mine)
            node = child
        capped = min(match, r.prompt_len - 1)
        out[k] = capped - capped % block_size
    return out
