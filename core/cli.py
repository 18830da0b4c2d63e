"""Shared CLI plumbing: user errors print one clear line and exit 2, no traceback.

Failures of the machine rather than the input (a full disk, a permission, memory) get one
line too.  A full disk inside an atomic write already says that nothing was changed
(core.atomic.DiskFullError); one met elsewhere cannot promise that, so it does not.
"""
from __future__ import annotations

import argparse
import errno
import sys

from .errors import UserError


def os_error_message(e: OSError) -> str:
    """One line for an OSError: what failed, and on which path."""
    where = " ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    where = f": {where}" if where else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on device{where}"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied{where}"
    return f"{e.strerror or e}{where}"


class Parser(argparse.ArgumentParser):
    """argparse's parser, answering a bad argument with one line, `error: PROG: …`, and exit 2
    instead of the whole usage (`--help` shows that); its subcommands' parsers are Parsers too."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message}\n")


def run_cli(main, argv=None) -> int:
    try:
        rc = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except MemoryError as e:
        print(f"error: out of memory{': ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


def command_parser(prog: str, description: str | None, defaults: dict | None = None):
    """(parser, subparsers) of a `python -m PACKAGE COMMAND` CLI, with -v; every package's CLI
    starts the same way.  `defaults` (from a --config file) are returned as {} when None."""
    p = Parser(prog=prog, description=description)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p, p.add_subparsers(dest="command", required=True), defaults or {}
