r"""The state file's bytes: pinned by a golden file, round-tripping any state, refusing damage.

``golden/state-v1.json`` holds the exact bytes ``encode_state`` writes for ``GOLDEN_STATE``. A
failure here means the state file format changed, so files written by earlier builds may no
longer read back: that takes a new format version and code that still reads the old one, not
a new golden file. To regenerate it deliberately::

    LOGBROKER_REGENERATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/controlplane/test_format.py

In that mode the test rewrites the file and then fails; run again without the variable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from logbroker.controlplane import (
    AclGrant,
    LocalControlPlane,
    Range,
    RangeState,
    StateFileError,
    StateFormatTooNewError,
    Topic,
    User,
)
from logbroker.controlplane._format import FORMAT_VERSION, decode_state, encode_state
from logbroker.controlplane._state import ControlState
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import (
    CONTROL_DIR,
    STATE_PATH,
    active,
    sealed,
)
from tests.unit.controlplane.strategies import states
from tests.unit.storage.helpers import failure_of

GOLDEN = Path(__file__).parent / "golden" / "state-v1.json"
REGENERATE = os.environ.get("LOGBROKER_REGENERATE_GOLDEN") == "1"

# A topic whose first range was split in two: the sealed parent and its active children.
_RANGES = [
    Range("orders.0", "orders", 0, 256, RangeState.SEALED),
    Range("orders.1", "orders", 0, 128, RangeState.ACTIVE, parent="orders.0"),
    Range("orders.2", "orders", 128, 256, RangeState.ACTIVE, parent="orders.0"),
]
_GRANTS = [AclGrant("app@eu", "produce", "orders.*"), AclGrant("app@eu", "consume", "orders")]

GOLDEN_STATE = ControlState(
    topics={"orders": Topic("orders", 8, 1_700_000_000_000, ("orders.0", "orders.1", "orders.2"))},
    ranges={r.range_id: r for r in _RANGES},
    segments={
        "orders.0": {0: sealed("orders.0", 0, count=1000, size=2**33 + 1, epoch=2)},
        "orders.1": {
            0: sealed("orders.1", 0, count=0, size=0, epoch=3),
            7: active("orders.1", 7, epoch=3),
        },
    },
    users={
        "admin": User(
            "admin", "$argon2id$v=19$m=65536,t=3,p=4$c2FsdA$aGFzaA", frozenset({"admin"})
        ),
        # Any string survives, even one that is not valid UTF-8 on its own (a lone surrogate).
        "app@eu": User("app@eu", "h\u00e9\U0001f600\ud800", frozenset({"produce", "consume"})),
    },
    acls={"app@eu": frozenset(_GRANTS)},
    positions={("orders", "billing"): "AQIDBA", ("orders", "gr\u00fcn \n"): ""},
)


def test_golden_file() -> None:
    if REGENERATE:
        GOLDEN.write_bytes(encode_state(GOLDEN_STATE))
        pytest.fail(f"regenerated {GOLDEN}; run again without LOGBROKER_REGENERATE_GOLDEN")
    stored = GOLDEN.read_bytes()

    assert encode_state(GOLDEN_STATE) == stored
    assert decode_state(stored, "golden") == GOLDEN_STATE
    document = json.loads(stored)
    assert document["format"] == FORMAT_VERSION == 1
    assert stored.endswith(b"}\n")
    assert stored.count(b"\n") == 1
    assert stored.isascii()


@given(states())
def test_any_state_round_trips(state: ControlState) -> None:
    data = encode_state(state)

    assert decode_state(data, STATE_PATH) == state
    assert encode_state(decode_state(data, STATE_PATH)) == data


def test_every_single_byte_change_is_refused_or_means_the_same() -> None:
    data = encode_state(GOLDEN_STATE)
    for position in range(len(data)):
        for xor in (0x01, 0x20, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[position] ^= xor
            try:
                decoded = decode_state(bytes(damaged), STATE_PATH)
            except StateFileError:
                continue
            # Say, an upper-case hex digit in a \u escape, or the newline at the end.
            assert decoded == GOLDEN_STATE, (position, xor)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "is not a JSON document"),
        (b"\xff\xfe", "is not a JSON document"),
        (b"[1]", "is not a logbroker control state file"),
        (b'{"format":0,"state":{}}', "is not a logbroker control state file"),
        (b'{"format":"1","state":{}}', "is not a logbroker control state file"),
        (b'{"format":true,"state":{}}', "is not a logbroker control state file"),
        (b'{"format":1,"crc32c":1,"state":{}}', "fails its checksum: it was damaged at rest"),
    ],
)
def test_what_is_not_a_state_file_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(StateFileError, match=message):
        decode_state(data, STATE_PATH)


def test_a_state_with_a_matching_checksum_is_still_checked() -> None:
    body = b'{"topics":[{"name":"../etc"}]}'
    data = b'{"format":1,"crc32c":%d,"state":%s}' % (crc32c(body), body)

    with pytest.raises(StateFileError, match="holds an invalid control state"):
        decode_state(data, STATE_PATH)


@given(st.integers(FORMAT_VERSION + 1, 2**64))
def test_a_newer_format_is_refused_whatever_follows(version: int) -> None:
    data = b'{"format":%d,"something":"new"}' % version

    with pytest.raises(StateFormatTooNewError) as raised:
        decode_state(data, STATE_PATH)

    assert str(raised.value) == (
        f"{STATE_PATH} uses control state format {version}, but this logbroker reads formats "
        "up to 1: upgrade logbroker, or point SVC_DATA_DIR elsewhere"
    )


def test_a_control_plane_refuses_to_start_on_a_newer_or_damaged_file() -> None:
    fs = MemoryFileSystem()
    fs.make_dirs(CONTROL_DIR)
    for data, error in [
        (b'{"format":2}', StateFormatTooNewError),
        (encode_state(GOLDEN_STATE)[:-20], StateFileError),
    ]:
        fs.write_atomic(STATE_PATH, data)
        control = LocalControlPlane(CONTROL_DIR, fs=fs, executor=ImmediateExecutor())
        failure_of(control.start()).trap(error)
        # Refused, not replaced: the file is left for the operator.
        assert fs.read_file(STATE_PATH) == data
