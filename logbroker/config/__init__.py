"""Configuration from ``SVC_*`` environment variables, validated once into frozen objects.

Every bad value is a ``ConfigError`` naming the variable and the value.
"""

from logbroker.config._env import ConfigError, StorageSettings, parse_bool, parse_int

__all__ = ["ConfigError", "StorageSettings", "parse_bool", "parse_int"]
