"""Shared CLI plumbing: user errors print one clear line and exit 2, no traceback."""
from __future__ import annotations

import sys

from .errors import UserError


def run_cli(main, argv=None) -> int:
    try:
        rc = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)
