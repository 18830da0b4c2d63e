"""`python -m training` and the `dml-train` console script."""
import sys

from core.cli import run_cli

from .cli import main


def console() -> int:
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(console())
