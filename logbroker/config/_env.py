"""Parsing ``SVC_*`` environment variables: each bad value is a ``ConfigError`` that names the
variable, the value and what was expected. (Warnings about unknown ``SVC_*`` names come with the
full broker configuration, once every variable of the spec is parsed.)"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from logbroker.storage import LogConfig
from logbroker.storage.log import DEFAULT_SEGMENT_MAX_BYTES, MAX_SEGMENT_BYTES

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A setting has a bad value; the message names the variable and the value."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        super().__init__(f"{variable}={value!r} is invalid: expected {expected}")
        self.variable = variable
        self.value = value


def parse_bool(env: Mapping[str, str], variable: str, default: bool) -> bool:
    raw = env.get(variable)
    if raw is None or raw.strip() == "":
        return default
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(variable, raw, "true or false (also 1/0, yes/no, on/off)")


def parse_int(
    env: Mapping[str, str],
    variable: str,
    default: int | None,
    minimum: int = 0,
    maximum: int | None = None,
) -> int | None:
    raw = env.get(variable)
    if raw is None or raw.strip() == "":
        return default
    bounds = f"an integer from {minimum}" + (f" to {maximum}" if maximum is not None else " up")
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(variable, raw, bounds) from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(variable, raw, bounds)
    return value


def _required_int(
    env: Mapping[str, str], variable: str, default: int, minimum: int, maximum: int | None = None
) -> int:
    value = parse_int(env, variable, default, minimum, maximum)
    assert value is not None
    return value


@attrs.frozen
class StorageSettings:
    """Where data lives and how range logs roll and commit."""

    data_dir: str
    log: LogConfig

    @classmethod
    def from_env(cls, env: Mapping[str, str], cwd: str | None = None) -> StorageSettings:
        data_dir = env.get("SVC_DATA_DIR", "").strip() or "data"
        data_dir = os.path.abspath(os.path.join(cwd or os.getcwd(), data_dir))
        segment_max = _required_int(
            env, "SVC_SEGMENT_MAX_BYTES", DEFAULT_SEGMENT_MAX_BYTES, 1024, MAX_SEGMENT_BYTES
        )
        roll_max = parse_int(env, "SVC_LOG_ROLL_MAX_BYTES", None, 1024, MAX_SEGMENT_BYTES)
        log_config = LogConfig(
            roll_bytes=min(segment_max, roll_max) if roll_max is not None else segment_max,
            group_commit=parse_bool(env, "SVC_GROUP_COMMIT", False),
            group_commit_interval_ms=_required_int(
                env, "SVC_GROUP_COMMIT_INTERVAL_MS", 5, 1, 60_000
            ),
            flush_max_records=_required_int(env, "SVC_GROUP_COMMIT_FLUSH_MAX_RECORDS", 8000, 1),
            max_inflight_records=_required_int(env, "SVC_GROUP_COMMIT_MAX_INFLIGHT", 200_000, 1),
        )
        return cls(data_dir, log_config)
