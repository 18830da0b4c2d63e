"""`python -m index` and the `dml-index` console script."""
import sys

from core.cli import run_cli

from .cli import main


def console() -> int:
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(console())
