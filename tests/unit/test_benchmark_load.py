"""The standard produce load (``logbroker.benchmark``): keyed records by default, as users
produce them, keyless as a variant."""

from __future__ import annotations

from typing import Any, cast

import pytest
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.benchmark import (
    DEFAULT_KEYS,
    ProduceLoad,
    _ProduceDriver,
    produce_frame,
    produce_frames,
)


def keys_of(frame: bytes) -> list[bytes | None]:
    request = wire.decode_request(frame[4:]).request
    assert isinstance(request, wire.Produce)
    return [record.key for record in wire.decode_wire_records(request.records)]


def keys_sent(load: ProduceLoad) -> list[bytes | None]:
    return keys_of(produce_frame(load))


def test_the_load_is_keyed_by_default_taking_its_keys_in_turn() -> None:
    assert keys_sent(ProduceLoad("t", batch=DEFAULT_KEYS + 2)) == [
        *(b"key-%d" % index for index in range(DEFAULT_KEYS)),
        b"key-0",
        b"key-1",
    ]


def test_no_keys_is_the_keyless_variant() -> None:
    assert keys_sent(ProduceLoad("t", batch=3, keys=0)) == [None, None, None]


def test_a_negative_number_of_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="keys"):
        ProduceLoad("t", keys=-1)


def test_each_connection_s_keys_go_on_from_the_last_one_s() -> None:
    load = ProduceLoad("t", connections=3, batch=2, keys=5)

    assert [keys_of(frame) for frame in produce_frames(load)] == [
        [b"key-0", b"key-1"],
        [b"key-2", b"key-3"],
        [b"key-4", b"key-0"],
    ]


def test_one_record_a_request_from_many_connections_takes_as_many_keys() -> None:
    load = ProduceLoad("t", connections=32, batch=1)

    assert len({key for frame in produce_frames(load) for key in keys_of(frame)}) == 32


def test_without_keys_every_connection_sends_keyless_records() -> None:
    load = ProduceLoad("t", connections=2, batch=2, keys=0)

    assert [keys_of(frame) for frame in produce_frames(load)] == [[None, None], [None, None]]


class _RecordingConnection:
    """A load connection that keeps what it is asked to send and answers nothing."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, frame: bytes, due: float, answered: object) -> None:
        self.sent.append(frame)


def test_the_driver_keeps_each_connection_to_its_own_frame() -> None:
    first, second = _RecordingConnection(), _RecordingConnection()
    load = ProduceLoad("t", connections=2, in_flight=3, batch=1)
    driver = _ProduceDriver(Clock(), cast(Any, [first, second]), [b"first", b"second"], load)

    driver.run()

    assert first.sent == [b"first"] * 3
    assert second.sent == [b"second"] * 3


def test_the_driver_refuses_a_frame_count_other_than_its_connections() -> None:
    connections = cast(Any, [_RecordingConnection(), _RecordingConnection()])

    with pytest.raises(ValueError, match="1 frames for 2 connections"):
        _ProduceDriver(Clock(), connections, [b"only"], ProduceLoad("t", connections=2))
