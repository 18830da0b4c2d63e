"""Fault tests with real processes: SIGKILL at injected points of the directory
swap, and two concurrent `index add` on one index.  The points are set by DML_FAULT
(core.atomic.fault_point), so nothing here depends on timing."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from support import BYTECODE, PRODUCT, run_command

from core.atomic import cleanup_stale
from core.locks import exclusive_lock
from index.backends.store import read_index
from index.build import add_features

# Writes an index of n rows at `path` (index.backends.store only: no torch import, so it starts fast);
# "two-renames" takes the fallback route for systems without renameat2.
WRITE_INDEX = """
import sys
import numpy as np
import core.atomic
from index.backends.store import Items, write_index
path, n, route = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if route == "two-renames":
    core.atomic._exchange = lambda a, b: False
rng = np.random.default_rng(n)
items = Items(np.arange(n), np.arange(n) % 3, [""] * n, ["t"] * n)
write_index(path, rng.normal(size=(n, 6)), items, rng.normal(size=(2, 6)), normalize=True, info={})
"""


def python(*args, cwd, fault: str | None = None, **kw):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(PRODUCT), "HOME": str(cwd),
           "TQDM_DISABLE": "1"} | BYTECODE | ({"DML_FAULT": fault} if fault else {})
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env, text=True, **kw)


def write(path, n, route, fault=None) -> int:
    p = python("-c", WRITE_INDEX, path, n, route, cwd=path.parent, fault=fault)
    return p.wait()


def leftovers(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


@pytest.mark.parametrize("route", ["exchange", "two-renames"])
@pytest.mark.parametrize("point", ["before-swap", "between", "after-swap"])
def test_sigkill_during_the_swap_never_leaves_a_broken_index(tmp_path, point, route):
    idx = tmp_path / "idx"
    assert write(idx, 20, route) == 0
    assert write(idx, 25, route, fault=point) == -signal.SIGKILL
    assert leftovers(idx), "the killed run left its temporary copy behind"
    old_kept = point == "before-swap"
    if route == "two-renames" and point == "between":
        # the one window of the fallback: the old copy waits under .idx.old-PID ...
        assert not idx.exists() and any(".old-" in n for n in leftovers(idx))
        cleanup_stale(idx)  # ... and the next write of the path puts it back first
        old_kept = True
    assert read_index(idx).manifest["count"] == (20 if old_kept else 25)  # complete: checksums verified
    assert write(idx, 30, route) == 0  # the next run cleans up what the killed one left
    assert read_index(idx).manifest["count"] == 30 and leftovers(idx) == []


def test_a_lock_dies_with_its_holder(tmp_path):
    holder = python("-c", f"from core.locks import exclusive_lock\nwith exclusive_lock({str(tmp_path / 'idx')!r}):"
                          f" pass", cwd=tmp_path, fault="pause-in-lock", stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert holder.stderr.readline() == "DML_FAULT: paused at pause-in-lock\n"
    holder.kill()
    holder.wait()
    with exclusive_lock(tmp_path / "idx"):  # the kernel released it
        pass
    assert list(tmp_path.iterdir()) == []


def test_concurrent_index_add_refuses_the_second_and_loses_no_rows(tmp_path):
    idx = tmp_path / "idx"
    assert write(idx, 20, "exchange") == 0
    rng = np.random.default_rng(5)
    np.save(tmp_path / "A.npy", rng.normal(size=(3, 6)))
    np.save(tmp_path / "B.npy", rng.normal(size=(4, 6)))
    first = python("-m", "index", "add", "--index", idx, "--features", "A.npy", "--label", 1, cwd=tmp_path,
                   fault="pause-in-lock", stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    while not lines or lines[-1] not in ("", "DML_FAULT: paused at pause-in-lock\n"):
        lines.append(first.stderr.readline())  # the first writer now holds the lock, mid-change
    assert lines[-1] == "DML_FAULT: paused at pause-in-lock\n", "".join(lines)
    second = run_command("index", "add", "--index", idx, "--features", "B.npy", "--label", 2, cwd=tmp_path)
    assert second.returncode == 2 and second.stderr == \
        f"error: index {idx} is being modified by PID {first.pid}; try again when it finishes\n"
    out, err = first.communicate("\n")
    assert first.returncode == 0, err
    assert read_index(idx).manifest["count"] == 23
    add_features(idx, np.load(tmp_path / "B.npy"), 2)  # the refused change, tried again
    data = read_index(idx)
    assert data.manifest["count"] == 27 and data.items.labels[20:].tolist() == [1] * 3 + [2] * 4
    assert sorted(data.items.ids.tolist()) == list(range(27))
    assert leftovers(idx) == ["A.npy", "B.npy"]
