"""A registry parameter field: its default and the help that `--help` and `list` show."""
from dataclasses import field


def param(default, help_: str):
    return field(default=default, metadata={"help": help_})
