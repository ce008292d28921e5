"""The real file system layer: exclusive creation, directories made by racing threads, listings,
and the mapped read a seal reads a segment back with, held to the in-memory one's answers; and
the in-memory one's crash keeping only the files whose directory was synced."""

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


@pytest.fixture(params=["os", "memory"])
def fs(request: pytest.FixtureRequest) -> FileSystem:
    """The real file system, then the in-memory one: each test holds both to the same answers."""
    return OsFileSystem() if request.param == "os" else MemoryFileSystem()


def test_a_mapped_read_sees_the_files_first_bytes_until_its_block_ends(
    tmp_path: Path, fs: FileSystem
) -> None:
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


def test_a_directory_lists_its_own_files_and_directories_as_they_come_and_go(
    tmp_path: Path, fs: FileSystem
) -> None:
    root = str(tmp_path / "ranges")
    fs.make_dirs(f"{root}/orders/0")
    fs.make_dirs(f"{root}/orders/1")
    fs.create_append(f"{root}/orders/0/00000000000000000000.log").close()
    fs.write_atomic(f"{root}/orders/0/EPOCH", b"1")
    fs.write_atomic(f"{root}/orders/0/EPOCH", b"2")
    fs.create_append(f"{root}/orders/1/00000000000000000000.log").close()

    assert fs.list_dir(root) == ["orders"]
    assert fs.list_dir(f"{root}/orders") == ["0", "1"]
    assert fs.list_dir(f"{root}/orders/0") == ["00000000000000000000.log", "EPOCH"]
    fs.remove(f"{root}/orders/0/00000000000000000000.log")
    assert fs.list_dir(f"{root}/orders/0") == ["EPOCH"]
    assert fs.list_dir(f"{root}/orders/1") == ["00000000000000000000.log"]
    with pytest.raises(FileNotFoundError):
        fs.list_dir(f"{root}/orders/2")


def test_a_crash_keeps_the_new_files_of_the_synced_directory_only() -> None:
    fs = MemoryFileSystem()
    fs.make_dirs("/data/ranges/orders/0")
    fs.make_dirs("/data/ranges/orders/1")
    for directory in ("/data/ranges/orders/0", "/data/ranges/orders/1"):
        writer = fs.create_append(f"{directory}/00000000000000000000.log")
        writer.write(b"record")
        writer.sync()
        writer.close()
    fs.sync_dir("/data/ranges/orders/0")

    after = fs.crash()

    assert after.list_dir("/data/ranges/orders/0") == ["00000000000000000000.log"]
    assert after.read_file("/data/ranges/orders/0/00000000000000000000.log") == b"record"
    assert after.list_dir("/data/ranges/orders/1") == []
