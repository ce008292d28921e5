"""``SVC_*`` storage settings: defaults, the roll-size rule, and errors naming the variable."""

from __future__ import annotations

import pytest

from logbroker.config import ConfigError, StorageSettings


def test_defaults_match_the_spec() -> None:
    settings = StorageSettings.from_env({}, cwd="/srv")

    assert settings.data_dir == "/srv/data"
    assert settings.log.roll_bytes == 67108864
    assert settings.log.group_commit is False
    assert settings.log.group_commit_interval_ms == 5
    assert settings.log.flush_max_records == 8000
    assert settings.log.max_inflight_records == 200000


@pytest.mark.parametrize(
    ("segment_max", "roll_max", "expected"),
    [
        ("1048576", None, 1048576),
        (None, "65536", 65536),
        ("65536", "1048576", 65536),
        ("1048576", "65536", 65536),
    ],
)
def test_the_smaller_of_the_two_roll_sizes_wins(
    segment_max: str | None, roll_max: str | None, expected: int
) -> None:
    env = {}
    if segment_max is not None:
        env["SVC_SEGMENT_MAX_BYTES"] = segment_max
    if roll_max is not None:
        env["SVC_LOG_ROLL_MAX_BYTES"] = roll_max

    assert StorageSettings.from_env(env).log.roll_bytes == expected


@pytest.mark.parametrize("spelling", ["true", "TRUE", "1", "yes", "on", " True "])
def test_group_commit_accepts_the_usual_true_spellings(spelling: str) -> None:
    assert StorageSettings.from_env({"SVC_GROUP_COMMIT": spelling}).log.group_commit is True


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SVC_GROUP_COMMIT", "maybe"),
        ("SVC_SEGMENT_MAX_BYTES", "64MB"),
        ("SVC_SEGMENT_MAX_BYTES", "-1"),
        ("SVC_SEGMENT_MAX_BYTES", "5000000000"),
        ("SVC_LOG_ROLL_MAX_BYTES", "12.5"),
        ("SVC_GROUP_COMMIT_INTERVAL_MS", "0"),
        ("SVC_GROUP_COMMIT_FLUSH_MAX_RECORDS", "zero"),
        ("SVC_GROUP_COMMIT_MAX_INFLIGHT", "0"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable_and_the_value(
    variable: str, value: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        StorageSettings.from_env({variable: value})

    assert raised.value.variable == variable
    assert f"{variable}={value!r} is invalid" in str(raised.value)


def test_relative_data_dir_is_resolved_against_the_working_directory() -> None:
    assert StorageSettings.from_env({"SVC_DATA_DIR": "var/lb"}, cwd="/srv").data_dir == (
        "/srv/var/lb"
    )
    assert StorageSettings.from_env({"SVC_DATA_DIR": "/abs"}, cwd="/srv").data_dir == "/abs"
