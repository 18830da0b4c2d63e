"""`python -m index <command>`: build, change, search and evaluate indices under refined metrics."""
from __future__ import annotations

import argparse

from core.cli import command_parser
from core.config import parse_with_config_file
from core.logs import setup_logging

from ..build_config import BuildConfig
from . import build, evaluate, export, graph, info, report, search

# the commands in --help's order, each module holding its parsers beside its commands
PARSERS = (build.merge_parser, build.add_parser, build.remove_parser, search.search_parser, graph.graph_parser,
           export.ivf_build_parser,
           export.export_parser, info.info_parser, info.list_parser, evaluate.evaluate_parser,
           evaluate.select_parser, report.report_parser)


def build_parser(defaults: dict | None = None) -> argparse.ArgumentParser:
    """`defaults`: {command: values} from a --config file, replacing the field defaults."""
    p, sub, defaults = command_parser("python -m index", __doc__, defaults)
    build.build_index_parser(sub, defaults)  # the one command a --config file sets
    for add in PARSERS:
        add(sub)
    return p


def main(argv=None) -> int:
    args = parse_with_config_file(build_parser, argv, {"build": BuildConfig})
    setup_logging(args.verbose)
    return args.func(args)
