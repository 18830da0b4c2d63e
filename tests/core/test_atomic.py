"""core/atomic.py and core/locks.py in-process: the directory swap (exchange rename and the
two-rename fallback), stale-leftover clean-up and recovery, guarded outputs, a full disk,
and the exclusive lock.  The SIGKILL fault tests run in tests/e2e/test_reliability.py."""
import errno
import os
import subprocess
import sys
import time

import pytest

import core.atomic as atomic
from core.atomic import DiskFullError, atomic_dir, cleanup_stale, guard_output, write_json, write_text
from core.errors import UserError
from core.locks import exclusive_lock, lock_path


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def write_version(path, v: str) -> None:
    with atomic_dir(path) as tmp:
        (tmp / "a").write_text(v)
        (tmp / "b").write_text(v)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_atomic_dir_replaces_a_directory_and_leaves_nothing_beside_it(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    for v in ("1", "2", "3"):
        write_version(tmp_path / "d", v)
    assert (tmp_path / "d" / "a").read_text() == (tmp_path / "d" / "b").read_text() == "3"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_exchange_rename_swaps_two_paths_in_one_step(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").write_text("file")
    assert atomic._exchange(tmp_path / "x", tmp_path / "y") is True  # Linux, ext4/tmpfs
    assert (tmp_path / "y").is_dir() and (tmp_path / "x").read_text() == "file"


def test_temporaries_carry_the_writers_pid(tmp_path):
    with atomic_dir(tmp_path / "d") as tmp:
        assert tmp.name.startswith(f".d.{os.getpid()}.") and tmp.name.endswith(".tmp")


def test_cleanup_removes_dead_writers_leftovers_and_keeps_everything_else(tmp_path):
    write_version(tmp_path / "d", "1")
    dead, me = dead_pid(), os.getpid()
    stale = [tmp_path / f".d.{dead}.abcd_123.tmp", tmp_path / f".d.{dead}.zzzzzzzz.tmp"]
    stale[0].mkdir()
    stale[1].write_text("half a file")
    keep = [tmp_path / f".d.{me}.abcdefgh.tmp",      # a live writer's (this process)
            tmp_path / ".d.lock",                     # the lock file
            tmp_path / f".dx.{dead}.abcdefgh.tmp",    # another path's
            tmp_path / f".d.1.{dead}.abcdefgh.tmp",   # the path "d.1"'s, not ours
            tmp_path / "notes.txt"]
    for p in keep:
        p.write_text("x")
    assert sorted(cleanup_stale(tmp_path / "d")) == sorted(stale)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in stale)


def test_cleanup_removes_old_leftovers_of_a_live_pid_and_pidless_ones(tmp_path):
    old_live = tmp_path / f".d.{os.getpid()}.abcdefgh.tmp"   # PID reused by now: age decides
    legacy = tmp_path / ".d.k3j4h5g6.tmp"                    # written before PIDs were recorded
    young_legacy = tmp_path / ".d.a1b2c3d4.tmp"
    for p in (old_live, legacy, young_legacy):
        p.write_text("x")
    day_ago = time.time() - 2 * atomic.STALE_AFTER_S
    os.utime(old_live, (day_ago, day_ago))
    os.utime(legacy, (day_ago, day_ago))
    assert sorted(cleanup_stale(tmp_path / "d")) == sorted([old_live, legacy])
    assert young_legacy.exists()


def test_cleanup_puts_back_the_old_copy_a_killed_two_rename_swap_left(tmp_path):
    write_version(tmp_path / "d", "1")
    dead = dead_pid()
    os.replace(tmp_path / "d", tmp_path / f".d.old-{dead}")  # killed between the two renames
    (tmp_path / f".d.{dead}.abcdefgh.tmp").mkdir()           # its complete new copy, never swapped in
    cleanup_stale(tmp_path / "d")
    assert (tmp_path / "d" / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_write_cleans_up_before_it_starts(tmp_path):
    write_json(tmp_path / "r.json", {"v": 1})
    leftover = tmp_path / f".r.json.{dead_pid()}.abcdefgh.tmp"
    leftover.write_text("{")
    write_json(tmp_path / "r.json", {"v": 2})
    assert not leftover.exists()


def test_guard_output(tmp_path):
    def is_ours(p):
        return (p / "OURS").exists()

    guard_output(tmp_path / "missing", is_ours, overwrite=False)
    (tmp_path / "empty").mkdir()
    guard_output(tmp_path / "empty", is_ours, overwrite=False)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "thesis.tex").write_text("years of work")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "OURS").write_text("")
    for overwrite in (False, True):  # --overwrite never replaces what is not ours
        with pytest.raises(UserError, match=r"user is a directory that is not an index: refusing to replace"):
            guard_output(tmp_path / "user", is_ours, overwrite)
        with pytest.raises(UserError, match=r"file.txt is a file that is not a run folder"):
            guard_output(tmp_path / "file.txt", is_ours, overwrite, what="run folder")
    with pytest.raises(UserError, match=r"ours already holds an index; give --overwrite to replace it"):
        guard_output(tmp_path / "ours", is_ours, overwrite=False)
    guard_output(tmp_path / "ours", is_ours, overwrite=True)
    assert (tmp_path / "user" / "thesis.tex").read_text() == "years of work"


def test_a_file_output_onto_a_directory_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match=r"out is a directory; give a file name to write"):
        write_json(tmp_path / "out", {})


@pytest.mark.parametrize("target", ["file", "dir"])
def test_a_full_disk_changes_nothing_and_says_so(tmp_path, monkeypatch, target):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "out"
    if target == "file":
        write_text(path, "old")
        monkeypatch.setattr(atomic.os, "fsync", full)
        with pytest.raises(DiskFullError, match=r"^no space left on device: nothing was changed \(.*out is as it"):
            write_text(path, "new")
        assert path.read_text() == "old"
    else:
        write_version(path, "old")
        with pytest.raises(DiskFullError, match="no space left on device: nothing was changed"):
            with atomic_dir(path) as tmp:
                (tmp / "a").write_text("new")
                full()
        assert (path / "a").read_text() == "old"
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_exclusive_lock_refuses_a_second_holder_with_the_pid_and_leaves_no_file(tmp_path):
    with exclusive_lock(tmp_path / "idx"):
        assert lock_path(tmp_path / "idx").read_text() == f"{os.getpid()}\n"
        # another open file description, as another process would have: refused at once
        with pytest.raises(UserError, match=rf"index .*idx is being modified by PID {os.getpid()}; try again"):
            with exclusive_lock(tmp_path / "idx"):
                pass
    assert list(tmp_path.iterdir()) == []
    with exclusive_lock(tmp_path / "idx"):  # free again
        pass


def test_a_waiting_lock_blocks_until_the_holder_is_done(tmp_path):
    import threading

    order = []
    with exclusive_lock(tmp_path / "res", "results"):
        def second():
            with exclusive_lock(tmp_path / "res", "results", wait=True):  # another open file description
                order.append("second")
        t = threading.Thread(target=second)
        t.start()
        t.join(0.5)
        assert t.is_alive() and order == []  # blocked, not refused
        order.append("first done")
    t.join(10)
    assert order == ["first done", "second"] and list(tmp_path.iterdir()) == []


def test_the_lock_file_is_a_sibling_that_survives_the_directory_swap(tmp_path):
    write_version(tmp_path / "idx", "1")
    with exclusive_lock(tmp_path / "idx"):
        lp = lock_path(tmp_path / "idx")
        ino = lp.stat().st_ino
        write_version(tmp_path / "idx", "2")
        assert lp.stat().st_ino == ino and lp.parent == tmp_path
        with pytest.raises(UserError, match="being modified"):
            with exclusive_lock(tmp_path / "idx"):
                pass
