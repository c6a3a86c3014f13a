"""KV events against vLLM's own code (issue 24, finding 2), read from the PyPI sdists of vLLM
0.33.0 and 0.34.0 at test time; nothing of vLLM is copied into this repository.

From each sdist: the event structs of ``vllm/distributed/kv_events.py`` and, from
``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys`` (with its LoRA helper)
and ``to_event_extra_keys``, taken out with ``ast`` and run standalone (the multimodal and
prompt-embeds helpers they call are stubbed: a text request has neither). For requests with
a salt, an adapter, both and neither, the test builds vLLM's BlockStored the way vLLM's block
pool does (``_build_block_stored_event``, then ``take_events`` sets the spec kind) and
compares msgspec's bytes with kvblocks' from both paths, ``encode_batch(pool.take_events())``
and the C writer ``encode_batch(pool)``.

Hashes: a salt alone is hashed as vLLM >= 0.31 hashes it (mode ``vllm_sha256_cbor``, block
0's tagged ``("cache_salt", salt)``), checked here against an independent sha256/CBOR
reference fed with vLLM's own extra keys. vLLM >= 0.31 hashes an adapter with its path, which
kvblocks does not take; requests with an adapter use ``vllm_sha256_cbor_v030`` (vLLM <= 0.30's
untagged keys) and the test feeds the reference those keys. The event bytes are 0.33/0.34's
either way.

The sdists are fetched with pip (``pip download --no-binary :all:``; its metadata step, which
needs vLLM's build requirements, is skipped by keeping pip's unpacked source) and the files
needed are cached in $KVBLOCKS_VLLM_CACHE or the temp dir. Without network the test skips.
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, List, Optional, Union

import pytest

msgspec = pytest.importorskip("msgspec")

from helpers import compute
from test_hash_modes import ref_vllm

from kvblocks import BlockManager
from kvblocks.events import encode_batch

VERSIONS = ("0.33.0", "0.34.0")
FILES = ("vllm/distributed/kv_events.py", "vllm/v1/core/kv_cache_utils.py")
M64 = (1 << 64) - 1


def _cache_root() -> Path:
    return Path(os.environ.get("KVBLOCKS_VLLM_CACHE") or tempfile.gettempdir()) / (
        "kvblocks-vllm-sdist"
    )


def _fetch(version: str) -> Optional[Path]:
    """The directory holding FILES of vLLM ``version``'s sdist, or None when unavailable."""
    root = _cache_root() / version
    if all((root / f).is_file() for f in FILES):
        return root
    work = Path(tempfile.mkdtemp(prefix="kvb-vllm-"))
    try:
        env = dict(os.environ, TMPDIR=str(work / "tmp"))
        (work / "tmp").mkdir()
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            "--no-clean",
            "-q",
            "-d",
            str(work / "dl"),
            f"vllm=={version}",
        ]
        try:
            subprocess.run(cmd, env=env, capture_output=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired):
            return None
        trees = glob.glob(str(work / "tmp" / "pip-download-*" / "vllm_*"))
        tars = glob.glob(str(work / "dl" / f"vllm-{version}.tar.gz"))
        got = {}
        if tars:
            with tarfile.open(tars[0]) as tf:
                for f in FILES:
                    m = tf.extractfile(f"vllm-{version}/{f}")
                    if m is not None:
                        got[f] = m.read()
        elif trees:
            for f in FILES:
                p = Path(trees[0]) / f
                if p.is_file():
                    got[f] = p.read_bytes()
        if len(got) != len(FILES):
            return None
        for f, data in got.items():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).write_bytes(data)
        return root
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _defs(path: Path, names, ns):
    """Run the top-level definitions ``names`` of a source file in namespace ns."""
    tree = ast.parse(path.read_text())
    body = [
        n
        for n in tree.body
        if (isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name in names)
        or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in names for t in n.targets))
    ]
    found = {getattr(n, "name", None) or n.targets[0].id for n in body}
    assert found == set(names), f"{path.name}: missing {set(names) - found}"
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns


@pytest.fixture(scope="module", params=VERSIONS)
def vllm(request):
    root = _fetch(request.param)
    if root is None:
        pytest.skip(f"vLLM {request.param}'s sdist is unavailable (no network?)")
    # a module of its own, so that msgspec resolves the structs' annotations in it
    mod = ModuleType(f"_vllm_{request.param.replace('.', '_')}_sdist")
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns.update(
        {
            "msgspec": msgspec,
            "Any": Any,
            "List": List,
            "Optional": Optional,
            "Union": Union,
            "ExternalBlockHash": Union[bytes, int],
        }
    )
    _defs(
        root / FILES[0],
        [
            "EventBatch",
            "KVCacheEvent",
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "KVEventBatch",
        ],
        ns,
    )
    ns.update(
        {
            "_gen_mm_extra_hash_keys": lambda req, s, e, i: ([], i),  # a text request
            "_gen_prompt_embeds_extra_hash_keys": lambda req, s, e: [],
            "Request": object,
            "Iterable": Any,
        }
    )
    _defs(
        root / FILES[1],
        ["_gen_lora_extra_hash_keys", "generate_block_hash_extra_keys", "to_event_extra_keys"],
        ns,
    )
    return SimpleNamespace(version=request.param, **ns)


def vllm_request(salt, lora):
    lr = (
        None
        if lora is None
        else SimpleNamespace(
            lora_name=lora[0],
            name=lora[0],
            adapter_id=lora[1],
            lora_int_id=lora[1],
            lora_path=f"/adapters/{lora[0]}",
        )
    )
    return SimpleNamespace(
        cache_salt=salt, lora_request=lr, mm_features=[], prompt_embeds=None, session_id=None
    )


CASES = {
    "neither": (None, None),
    "salt": ("tenant-a", None),
    "lora": (None, ("alice", 3)),
    "both": ("tenant-b", ("bob", 12)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["take_events", "c_writer"])
def test_bytes_equal_vllms_own_structs(vllm, case, path):
    salt, lora = CASES[case]
    bs, toks = 16, list(range(1000, 1000 + 16 * 5 + 3))
    algo = "vllm_sha256_cbor" if lora is None else "vllm_sha256_cbor_v030"
    mgr = BlockManager(64, bs, hash_algo=algo, hash_seed="42", enable_kv_events=True)
    kw = {"salt": salt} if salt else {}
    if lora:
        kw.update(lora_name=lora[0], lora_id=lora[1])
    mgr.add("r", toks[: 16 * 3 + 5], **kw)  # 3 full blocks, then 2 more in a later step
    compute(mgr, "r")
    first = mgr.pool.take_events()
    mgr.append("r", toks[16 * 3 + 5 :])
    compute(mgr, "r")
    if path == "take_events":
        ours = [encode_batch(first, ts=1.25), encode_batch(mgr.pool.take_events(), ts=1.25)]
    else:
        ours = [encode_batch(first, ts=1.25), encode_batch(mgr.pool, ts=1.25)]

    # vLLM: the request's extra keys per block, its hashes, its events
    req = vllm_request(salt, lora)
    keys = [vllm.generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, 0)[0] for i in range(5)]
    if lora is None:
        hash_keys = keys  # >= 0.31: tagged, what vllm_sha256_cbor hashes
    else:  # <= 0.30: untagged (lora_name, salt), what vllm_sha256_cbor_v030 hashes
        hash_keys = [tuple(k[1] for k in ks) if ks else None for ks in keys]
    digests = ref_vllm(toks, bs, "42", lambda i: hash_keys[i])
    wire = [int.from_bytes(d, "big") & M64 for d in digests]

    def stored(lo, hi, parent):
        ev = vllm.BlockStored(
            block_hashes=wire[lo:hi],
            parent_block_hash=parent,
            token_ids=toks[lo * bs : hi * bs],
            block_size=bs,
            lora_id=lora[1] if lora else None,
            medium="GPU",
            lora_name=lora[0] if lora else None,
            extra_keys=vllm.to_event_extra_keys(keys[lo:hi]),
            group_idx=0,
            session_id=None,
            lookahead_token_ids=None,
        )
        ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = "full_attention", None
        return vllm.KVEventBatch(ts=1.25, events=[ev], data_parallel_rank=0)

    enc = msgspec.msgpack.Encoder()
    theirs = [enc.encode(stored(0, 3, None)), enc.encode(stored(3, 5, wire[2]))]
    assert ours == theirs
    # and vLLM's typed decoder reads them back
    dec = msgspec.msgpack.Decoder(vllm.KVEventBatch)
    ev = dec.decode(ours[0]).events[0]
    if salt:
        assert ev.extra_keys[0][-1] == salt and all(
            salt not in (k or ()) for k in ev.extra_keys[1:]
        )
    if lora:
        assert all(k[0] == lora[0] for k in ev.extra_keys) and ev.lora_id == lora[1]
    if case == "neither":
        assert ev.extra_keys == [None, None, None]
