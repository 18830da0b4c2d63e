"""Atomic outputs: write to a temporary sibling, fsync, then rename into place.

A run killed at any moment leaves either the previous file or directory or the
new one under the final name, never a half-written one and never nothing: a
directory is swapped in with one `renameat2(RENAME_EXCHANGE)` on Linux.  What a
killed run leaves next to the path (`.NAME.PID.xxxxxxxx.tmp`, `.NAME.old-PID`)
is recovered or removed by the next write of that path (`cleanup_stale`).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UserError

STALE_AFTER_S = 24 * 3600  # leftovers of a live PID older than this are stale too (the PID was reused)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def fault_point(name: str) -> None:
    """Test hook for the fault tests; a no-op unless the environment sets DML_FAULT=`name`.

    `pause-*` points print one line to stderr and wait for a line on stdin (a test holds
    the process there, deterministically); every other point kills the process with
    SIGKILL, as a power cut or the OOM killer would.
    """
    if os.environ.get("DML_FAULT") != name:
        return
    if name.startswith("pause-"):
        print(f"DML_FAULT: paused at {name}", file=sys.stderr, flush=True)
        sys.stdin.readline()
    else:
        os.kill(os.getpid(), signal.SIGKILL)


class DiskFullError(UserError):
    def __init__(self, path):
        super().__init__(f"no space left on device: nothing was changed ({path} is as it was)")


@contextlib.contextmanager
def _disk_full_is_user_error(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(path) from None
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def cleanup_stale(path: str | os.PathLike, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Recover or remove what killed writes of `path` left next to it; returns what was removed.

    Only our own names count: `.NAME.PID.xxxxxxxx.tmp` (a temporary, or the old copy after an
    exchange) and `.NAME.old-PID` (the old copy of the two-rename fallback).  One is stale when
    its PID is dead or it is older than `max_age_s`.  If `path` is missing but a stale
    `.NAME.old-PID` exists, the fallback was killed between its renames: the old copy is put
    back.  Temporaries without a PID (written before PIDs were recorded) go by age alone.
    """
    path = Path(path)
    parent, name = path.parent, path.name
    if not parent.is_dir():
        return []
    pat = re.compile(r"\.(?:(\d+)\.)?[a-z0-9_]{8}\.tmp|\.old-(\d+)")
    removed = []
    now = time.time()
    for p in parent.iterdir():
        if not p.name.startswith(f".{name}."):
            continue
        m = pat.fullmatch(p.name[len(name) + 1:])
        if m is None:
            continue
        pid = m.group(1) or m.group(2)
        try:
            age = now - p.lstat().st_mtime
        except FileNotFoundError:
            continue
        if not ((pid is not None and not _pid_alive(int(pid))) or age > max_age_s):
            continue
        if m.group(2) and not os.path.lexists(path):
            with contextlib.suppress(FileNotFoundError):  # another writer got there first
                os.replace(p, path)
            continue
        _remove(p)
        removed.append(p)
    return removed


def _tmp_prefix(path: Path) -> str:
    """Temporary names carry the writer's PID, so `cleanup_stale` can tell a dead writer's."""
    return f".{path.name}.{os.getpid()}."


def check_file_target(path: str | os.PathLike) -> None:
    """Refuse a file output (e.g. --json FILE) that names an existing directory; CLIs call it
    before any work so that nothing is computed for an output that cannot be written."""
    if Path(path).is_dir():
        raise UserError(f"{path} is a directory; give a file name to write")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it to `path`."""
    path = Path(path)
    check_file_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cleanup_stale(path)
    fd, name = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with _disk_full_is_user_error(path):
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes(path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path, obj, indent: int | None = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent, sort_keys=False, ensure_ascii=False) + "\n")


def write_with(path, writer: Callable[[Path], None]) -> None:
    """Call `writer(tmp_path)` (e.g. np.save, torch.save, faiss.write_index) atomically."""
    with atomic_path(path) as tmp:
        writer(tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported
    (another OS, an old kernel or C library, a file system without it)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _swap_in(tmp: Path, path: Path) -> None:
    """Put the complete directory `tmp` at `path`; `path` is never missing on the way."""
    fault_point("before-swap")
    if not os.path.lexists(path):
        os.replace(tmp, path)
        old = None
    elif _exchange(tmp, path):
        fault_point("between")  # one step did both renames: nothing is in between
        old = tmp               # the old copy now sits at the temporary name
    else:
        # no exchange rename here: a kill between these two renames leaves the old copy at
        # .NAME.old-PID, and the next write of the path puts it back (cleanup_stale)
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
        fault_point("between")
        os.replace(tmp, path)
    fault_point("after-swap")
    _fsync_dir(path.parent)
    if old is not None:
        _remove(old)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a whole directory in a temporary sibling, then swap it into place.

    The previous directory (if any) stays intact, under `path`, until the new one is
    complete and takes its place in one step.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cleanup_stale(path)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        with _disk_full_is_user_error(path):
            yield tmp
            for f in tmp.rglob("*"):
                if f.is_file():
                    with open(f, "rb+") as fh:
                        os.fsync(fh.fileno())
            _swap_in(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def guard_output(path: str | os.PathLike, is_ours: Callable[[Path], bool], overwrite: bool,
                 what: str = "index", flag: str = "--overwrite") -> None:
    """Refuse to write an output over something that is not ours, or over ours without `overwrite`.

    Call it before any work, with `is_ours(path)` telling whether an existing path is one of our
    own artifacts of this kind (e.g. an index directory with our manifest).  A missing path or
    an empty directory is always fine.  Any other existing path (a folder of the user's files,
    a regular file) is refused, even with `overwrite`; one of ours is replaced only with
    `overwrite` (the CLI flag named `flag`).  Raises UserError with a one-line reason.
    """
    path = Path(path)
    if not os.path.lexists(path) or (path.is_dir() and not path.is_symlink() and not any(path.iterdir())):
        return
    if not is_ours(path):
        kind = "a directory" if path.is_dir() else "a file"
        raise UserError(f"{path} is {kind} that is not {_article(what)} {what}: refusing to replace it "
                        f"(choose another output path)")
    if not overwrite:
        raise UserError(f"{path} already holds {_article(what)} {what}; give {flag} to replace it")


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"
