"""The real file system layer: exclusive creation, directories made by racing threads, and the
mapped read a seal reads a segment back with, held to the in-memory one's answers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from logbroker.storage import FileSystem, OsFileSystem
from logbroker.testing import MemoryFileSystem


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


@pytest.mark.parametrize("kind", ["os", "memory"])
def test_a_mapped_read_sees_the_files_first_bytes_until_its_block_ends(
    tmp_path: Path, kind: str
) -> None:
    fs: FileSystem = OsFileSystem() if kind == "os" else MemoryFileSystem()
    path = str(tmp_path / "segment.log")
    fs.make_dirs(str(tmp_path))
    writer = fs.create_append(path)
    writer.write(b"0123456789")
    writer.sync()
    writer.close()
    empty = str(tmp_path / "empty.log")
    fs.create_append(empty).close()

    with fs.read_mapped(path, 4) as prefix, fs.read_mapped(path, 64) as whole:
        assert bytes(prefix) == b"0123"
        assert bytes(whole) == b"0123456789", "a shorter file gives what it holds"
        kept = whole
    with fs.read_mapped(empty, 64) as nothing:
        assert bytes(nothing) == b""

    with pytest.raises(ValueError, match="released"):
        bytes(kept)  # released with its block
