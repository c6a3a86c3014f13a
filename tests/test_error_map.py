"""One map from the core's C error codes to exceptions (kvblocks._core.ERROR_TYPES and
error_for, which every raise in the Cython layer goes through): every KVB_E* code of the
public header has a documented exception type, and the messages say the call and the detail."""

import re
from pathlib import Path

import pytest

import kvblocks
from kvblocks import _core, errors

ROOT = Path(__file__).resolve().parents[1]
CODES = {
    name: int(value)
    for name, value in re.findall(
        r"^\s*(KVB_E[A-Z]+)\s*=\s*(-\d+)", (ROOT / "include" / "kvblocks.h").read_text(), re.M
    )
}
DOCUMENTED = {getattr(errors, n) for n in errors.__all__} | {MemoryError}


def test_the_header_defines_the_codes():
    assert len(CODES) >= 11 and CODES["KVB_ENOMEM"] == -1, CODES
    core_h = (ROOT / "csrc" / "core.h").read_text()
    assert not re.findall(r"\bKVB_E[A-Z]+\s*=\s*-\d+", core_h), "a code outside the header"


@pytest.mark.parametrize("name", sorted(CODES))
def test_every_code_maps_to_a_documented_exception(name):
    rc = CODES[name]
    assert rc in _core.ERROR_TYPES, f"{name} has no exception in ERROR_TYPES"
    cls = _core.ERROR_TYPES[rc]
    assert cls in DOCUMENTED, f"{name} -> {cls.__name__}, not in kvblocks.errors"
    assert cls is MemoryError or issubclass(cls, kvblocks.KVBlocksError)
    exc = _core.error_for(rc, "somecall", 3, 7)
    assert type(exc) is cls
    assert str(exc).startswith("somecall: ")
    assert f"error {rc}" not in str(exc), f"{name} has no message of its own"


def test_the_map_matches_what_calls_raise():
    assert _core.ERROR_TYPES[CODES["KVB_EOUTOFBLOCKS"]] is kvblocks.OutOfBlocksError
    assert _core.ERROR_TYPES[CODES["KVB_EUNKNOWN"]] is kvblocks.UnknownSequenceError
    assert _core.ERROR_TYPES[CODES["KVB_ECORRUPT"]] is kvblocks.CorruptionError
    assert str(_core.error_for(CODES["KVB_EOUTOFBLOCKS"], "allocate", 5, 2)) == (
        "allocate: need 5 blocks, 2 free"
    )
    pool = kvblocks.BlockPool(4)
    with pytest.raises(kvblocks.OutOfBlocksError, match="need 9 blocks, 3 free"):
        pool.allocate(9)
    mgr = kvblocks.BlockManager(4, 2)
    with pytest.raises(kvblocks.UnknownSequenceError):
        mgr.free("nobody")


def test_a_call_words_its_message_the_code_picks_the_type():
    exc = _core.error_for(CODES["KVB_EPENDING"], "x", msg="x: 2 offloads are pending")
    assert type(exc) is kvblocks.InvalidStateError and str(exc) == "x: 2 offloads are pending"
    unknown = _core.error_for(-99, "x")
    assert type(unknown) is kvblocks.KVBlocksError and str(unknown) == "x: error -99"
