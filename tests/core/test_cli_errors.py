"""core/cli.run_cli: machine failures (full disk, permissions, memory) are one `error:` line
and exit 2, never a traceback."""
import errno

import pytest

from core.atomic import DiskFullError
from core.cli import run_cli


def failing(exc):
    def main(argv):
        raise exc
    return main


@pytest.mark.parametrize("exc, line", [
    (DiskFullError("/data/idx"), "error: no space left on device: nothing was changed (/data/idx is as it was)"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/x.npy"), "error: no space left on device: /data/x.npy"),
    (PermissionError(errno.EACCES, "Permission denied", "/root/idx"), "error: permission denied: /root/idx"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro"), "error: Read-only file system: /mnt/ro"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "out"), "error: Is a directory: out"),
    (MemoryError("Unable to allocate 3.73 GiB"), "error: out of memory: Unable to allocate 3.73 GiB"),
])
def test_machine_failures_are_one_line_and_exit_2(capsys, exc, line):
    assert run_cli(failing(exc), []) == 2
    err = capsys.readouterr().err
    assert err == line + "\n"


@pytest.mark.parametrize("package, args, line", [
    ("training", ["train", "--image-cache", "maybe"],
     "error: python -m training train: argument --image-cache: invalid choice: 'maybe' (choose from 'auto', 'on', "
     "'off')"),
    ("index", ["search", "--k", "x"], "error: python -m index search: argument --k: invalid int value: 'x'"),
    ("app", ["--port", "x"], "error: python -m app: argument --port: invalid int value: 'x'"),
    ("index", ["search", "--cache-memory", "lots"],
     "error: python -m index search: argument --cache-memory: --cache-memory wants a size such as 512M or 4G, got "
     "'lots'"),
    ("app", ["--cache-memory", "12X"],
     "error: python -m app: argument --cache-memory: --cache-memory wants a size such as 512M or 4G, got '12X'"),
    ("demo", ["--num-classes", "many"], "error: python -m demo: argument --num-classes: invalid int value: 'many'"),
])
def test_a_bad_argument_is_one_line_and_exit_2(tmp_path, package, args, line):
    from support import run_command

    r = run_command(package, *args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == line + "\n" and r.stdout == ""


def test_the_memory_budget_flag_means_one_thing_on_every_command_that_searches():
    """--cache-memory: the same help and default on `index search`, `index evaluate`, `index
    report` and the app, and the sizes it reads."""
    import argparse

    from app.cli import build_parser as app_parser
    from core.flags import parse_size
    from index.cli import build_parser as index_parser

    def flag(parser):
        return next(a for a in parser._actions if "--cache-memory" in a.option_strings)
    sub = next(a for a in index_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = [flag(sub.choices[c]) for c in ("search", "evaluate", "report")] + [flag(app_parser())]
    assert {(a.help, a.default) for a in actions} == {(actions[0].help, None)}
    assert "$DML_CACHE_MEMORY, else 4G" in actions[0].help
    assert [parse_size(t, "x") for t in ("100", "1K", "512M", "4G", "1.5G")] == [
        100, 1024, 512 << 20, 4 << 30, 3 << 29]
