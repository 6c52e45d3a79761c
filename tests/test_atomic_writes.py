"""Atomic file and directory writes: all or nothing, and ordinary permissions once in place."""

import os
import stat

import pytest

from blockspec.io import save_atomically, write_file_atomically, write_text_atomically


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_written_file_and_directory_get_the_processes_default_modes(tmp_path, umask_022):
    write_text_atomically(tmp_path / "latest", "step-3")
    save_atomically(lambda staging: (staging / "config.json").write_text("{}"), tmp_path / "draft")
    assert mode(tmp_path / "latest") == 0o644
    assert mode(tmp_path / "draft") == 0o755
    assert (tmp_path / "latest").read_text() == "step-3"


def test_a_failed_write_keeps_the_old_file_and_leaves_no_staging_file(tmp_path):
    write_text_atomically(tmp_path / "latest", "old")

    def fail(staging):
        open(staging, "w").write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_atomically(tmp_path / "latest", fail)
    assert (tmp_path / "latest").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_directory_is_replaced_whole(tmp_path):
    save_atomically(lambda staging: (staging / "a").write_text("1"), tmp_path / "draft")
    save_atomically(lambda staging: (staging / "b").write_text("2"), tmp_path / "draft")
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
