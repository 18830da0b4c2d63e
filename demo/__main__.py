"""`python -m demo` and the `dml-demo` console script."""
import sys

from core.cli import run_cli

from .pipeline import main


def console() -> int:
    return run_cli(main)


if __name__ == "__main__":
    sys.exit(console())
