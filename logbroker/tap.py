"""``twistd logbroker``: options and ``makeService``. Flags override ``SVC_*`` variables."""

from __future__ import annotations

import os
import sys

from twisted.application.service import IService
from twisted.python import usage

from logbroker import exitcodes
from logbroker.config import BrokerConfig, ConfigError
from logbroker.storage import FormatTooNewError, OsFileSystem, StorageError
from logbroker.storage.store import DataDirectory


class Options(usage.Options):
    optParameters = [
        ["data-dir", "d", None, "data directory (overrides SVC_DATA_DIR; default ./data)"],
    ]


def _exit(status: int, message: str) -> SystemExit:
    print(f"logbroker: {message}", file=sys.stderr)
    return SystemExit(status)


def _warn(lines: list[str]) -> None:
    for line in lines:
        print(f"logbroker: warning: {line}", file=sys.stderr)


def makeService(options: Options) -> IService:
    env = dict(os.environ)
    if options["data-dir"] is not None:
        env["SVC_DATA_DIR"] = options["data-dir"]
    try:
        config, warnings = BrokerConfig.from_env(env)
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
        return build_service(reactor, config, data_dir)
    except (StorageError, OSError) as error:
        raise _exit(exitcodes.FAILURE, f"storage recovery failed: {error}") from None
