"""An exclusive lock per output path, for read-modify-write changes (index add, remove, rebuild).

The lock file is the sibling `.NAME.lock`, not a file inside the directory: the directory
itself is swapped out whole by `core.atomic.atomic_dir`, so a lock file inside it would move
away with the old copy, and a second writer opening `DIR/.lock` after the swap would lock a
different file and go ahead.  The sibling stays put across swaps.  Readers never lock: the
swap is atomic, so they see the old directory or the new one.

A held lock is refused at once (no waiting): the second writer worked from a copy that the
first is about to replace, so running it later is the user's decision.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .atomic import fault_point
from .errors import UserError


def lock_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str = "index", wait: bool = False) -> Iterator[None]:
    """Hold an exclusive `flock` on `path`'s lock file, or raise UserError naming the holder's PID
    (`wait`: block until the holder is done instead, for writers that take turns).

    The kernel drops the lock when the holder exits, however it exits: no stale locks.  The
    holder removes the lock file when it is done, so nothing is left beside the output; a
    writer that locked a file just removed that way sees that it is no longer at the path
    (another inode, or none) and starts over on the new one.
    """
    path = Path(path)
    lp = lock_path(path)
    lp.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise UserError(f"{what} {path} is being modified by PID {holder}; try again when it finishes") from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lp).st_ino == os.fstat(fd).st_ino:
                break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        fault_point("pause-in-lock")
        yield
    finally:
        os.unlink(lp)  # while still locked: no one else can hold this inode now
        os.close(fd)
