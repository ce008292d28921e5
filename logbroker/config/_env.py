"""Parsing single ``SVC_*`` environment variables: each bad value is a ``ConfigError`` that names
the variable, the value and what was expected. A blank value counts as unset everywhere, so an
env file line ``SVC_X=`` means the default, as it does for most services operators know."""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Mapping
from typing import TypeVar, overload

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

_Choice = TypeVar("_Choice", bound=enum.Enum)


class ConfigError(ValueError):
    """A setting has a bad value, or a required one is missing; the message names the variable
    and the value (``value`` is None when the variable is not set)."""

    def __init__(self, variable: str, value: str | None, expected: str) -> None:
        if value is None:
            message = f"{variable} is not set: expected {expected}"
        else:
            message = f"{variable}={value!r} is invalid: expected {expected}"
        super().__init__(message)
        self.variable = variable
        self.value = value
        #: Warnings gathered before the error (``BrokerConfig.from_env`` fills them in): an
        #: unknown name is often why a required setting is missing, so both are shown.
        self.warnings: list[str] = []


def parse_text(env: Mapping[str, str], variable: str) -> str | None:
    """The value with surrounding blanks removed, or None when unset or blank."""
    raw = env.get(variable)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()


def parse_bool(env: Mapping[str, str], variable: str, default: bool) -> bool:
    """``true``/``false`` and the usual spellings of both, in any case."""
    word = parse_text(env, variable)
    if word is None:
        return default
    if word.lower() in _TRUE:
        return True
    if word.lower() in _FALSE:
        return False
    raise ConfigError(variable, env[variable], "true or false (also 1/0, yes/no, on/off)")


@overload
def parse_int(
    env: Mapping[str, str],
    variable: str,
    default: int,
    minimum: int = 0,
    maximum: int | None = None,
) -> int: ...


@overload
def parse_int(
    env: Mapping[str, str],
    variable: str,
    default: None,
    minimum: int = 0,
    maximum: int | None = None,
) -> int | None: ...


def parse_int(
    env: Mapping[str, str],
    variable: str,
    default: int | None,
    minimum: int = 0,
    maximum: int | None = None,
) -> int | None:
    """A decimal integer from ``minimum`` to ``maximum`` (None: no upper bound)."""
    text = parse_text(env, variable)
    if text is None:
        return default
    raw = env[variable]
    bounds = f"an integer from {minimum}" + (f" to {maximum}" if maximum is not None else " up")
    try:
        value = int(text, 10)
    except ValueError:
        raise ConfigError(variable, raw, bounds) from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(variable, raw, bounds)
    return value


def parse_port(env: Mapping[str, str], variable: str, default: int) -> int:
    """A TCP port; 0 asks the system for any free one (for tests that run many brokers)."""
    return parse_int(env, variable, default, 0, 65535)


def parse_choice(
    env: Mapping[str, str], variable: str, choices: type[_Choice], default: _Choice
) -> _Choice:
    """One of an enum's values, compared without regard to case."""
    text = parse_text(env, variable)
    if text is None:
        return default
    for choice in choices:
        if choice.value == text.lower():
            return choice
    *others, last = (str(choice.value) for choice in choices)
    raise ConfigError(variable, env[variable], f"{', '.join(others)} or {last}")


def parse_address(env: Mapping[str, str], variable: str, default: str) -> str:
    """An IPv4 or IPv6 address literal to listen on (``0.0.0.0`` or ``::`` for every interface).
    Host names are refused: which address a name resolves to at boot is not a setting."""
    text = parse_text(env, variable)
    if text is None:
        return default
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ConfigError(
            variable, env[variable], "an IPv4 or IPv6 address, such as 0.0.0.0"
        ) from None
