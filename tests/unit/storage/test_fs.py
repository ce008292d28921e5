"""The real file system layer: exclusive creation, and directories made by racing threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from logbroker.storage import OsFileSystem


def test_create_append_never_opens_an_existing_file(tmp_path: Path) -> None:
    fs = OsFileSystem()
    path = str(tmp_path / "segment.log")
    writer = fs.create_append(path)
    writer.write(b"first")
    writer.sync()
    writer.close()

    with pytest.raises(FileExistsError):
        fs.create_append(path)
    assert (tmp_path / "segment.log").read_bytes() == b"first"


def test_make_dirs_tolerates_a_directory_another_thread_just_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "ranges" / "orders"
    target.mkdir(parents=True)
    real_isdir = os.path.isdir
    # As if another writer thread created it between our check and our mkdir.
    monkeypatch.setattr(os.path, "isdir", lambda p: p != str(target) and real_isdir(p))

    OsFileSystem().make_dirs(str(target / "0"))

    assert (target / "0").is_dir()
