"""The package list in setup.cfg is written out by hand (Twisted's plugin directory is a
namespace portion, so ``find_packages`` cannot be used): every package in the source tree
must be on it, or an installed broker (the Debian package, a wheel) fails to import it."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_logbroker_package_is_listed_in_setup_cfg() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    in_tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "logbroker").rglob("__init__.py")
    }

    assert "logbroker.storage" in in_tree, "the source tree was found"
    assert sorted(in_tree - listed) == []
