import sys

from core.cli import run_cli

from .cli import main

sys.exit(run_cli(main))
