"""``twistd logbroker``: options and ``makeService``. Flags override ``SVC_*`` variables."""

from __future__ import annotations

import os
import sys
from datetime import UTC, datetime

from twisted.application.service import IService
from twisted.python import usage

from logbroker import exitcodes
from logbroker.config import VARIABLES, BrokerConfig, ConfigError, check_built
from logbroker.security.tls import server_tls
from logbroker.storage import FormatTooNewError, OsFileSystem, StorageError
from logbroker.storage.store import DataDirectory

#: The variable each flag stands for. A flag's value goes through the same parsing as the
#: variable's, so a bad one is reported under the variable's name like any other bad setting.
FLAG_VARIABLES = {
    "data-dir": "SVC_DATA_DIR",
    "port": "SVC_TCP_PORT",
    "dashboard-port": "SVC_DASHBOARD_PORT",
    "peer-port": "SVC_PEER_PORT",
    "env": "SVC_ENV",
}

_DEFAULTS = {variable.name: variable.default for variable in VARIABLES}


def _flag(name: str, short: str | None, meaning: str) -> list[str | None]:
    """A ``--name`` option whose help names its variable and the documented default."""
    variable = FLAG_VARIABLES[name]
    return [name, short, None, f"{meaning} (overrides {variable}; default {_DEFAULTS[variable]})"]


class Options(usage.Options):
    optParameters = [
        _flag("data-dir", "d", "data directory"),
        _flag("port", None, "client port"),
        _flag("dashboard-port", None, "dashboard port"),
        _flag("peer-port", None, "peer replication port"),
        _flag("env", None, "environment mode: prod, dev or test"),
    ]


def _exit(status: int, message: str) -> SystemExit:
    print(f"logbroker: {message}", file=sys.stderr)
    return SystemExit(status)


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"logbroker: warning: {line}", file=sys.stderr)


def makeService(options: Options) -> IService:
    env = dict(os.environ)
    for flag, variable in FLAG_VARIABLES.items():
        if options[flag] is not None:
            env[variable] = options[flag]
    try:
        config, warnings = BrokerConfig.from_env(env)
        tls = server_tls(config.tls, config.mode, datetime.now(UTC), warnings)
        warnings += check_built(config)
    except ConfigError as error:
        _warn(error.warnings)
        raise _exit(exitcodes.CONFIG_ERROR, str(error)) from None
    _warn(warnings)
    try:
        data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())
    except FormatTooNewError as error:
        raise _exit(exitcodes.FORMAT_TOO_NEW, str(error)) from None
    except (StorageError, OSError) as error:
        raise _exit(exitcodes.FAILURE, str(error)) from None

    from twisted.internet import reactor

    from logbroker.service import build_service

    try:
        return build_service(reactor, config, data_dir, tls)
    except ConfigError as error:
        raise _exit(exitcodes.CONFIG_ERROR, str(error)) from None
    except (StorageError, OSError) as error:
        raise _exit(exitcodes.FAILURE, f"storage recovery failed: {error}") from None
