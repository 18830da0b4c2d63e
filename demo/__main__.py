import sys

from core.cli import run_cli

from .pipeline import main

sys.exit(run_cli(main))
