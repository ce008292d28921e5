"""The standard produce load (``logbroker.benchmark``): keyed records by default, as users
produce them, keyless as a variant."""

from __future__ import annotations

import pytest

from logbroker import wire
from logbroker.benchmark import DEFAULT_KEYS, ProduceLoad, produce_frame


def keys_sent(load: ProduceLoad) -> list[bytes | None]:
    request = wire.decode_request(produce_frame(load)[4:]).request
    assert isinstance(request, wire.Produce)
    return [record.key for record in wire.decode_wire_records(request.records)]


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
