"""Versioned artifacts: every artifact we write names its format and version, and every reader
refuses another format, another version, or a file that is not one of ours, with the reason."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError


def check_versioned(doc, fmt: str, version: int, what: str, kind: str = "manifest") -> dict:
    """`doc` if it is a dict of format `fmt` at `version`; else a one-line refusal naming `what`
    (the file) and `kind` (what it should have been: "manifest", "checkpoint")."""
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise UserError(f"{what} is not a {kind} of this project ({fmt})")
    if doc.get("version") != version:
        raise UserError(f"{what} has {fmt} version {doc.get('version')}, which this version of the project does "
                        f"not read (it reads version {version})")
    return doc


def read_manifest(path, fmt: str, version: int, what: str | None = None) -> dict:
    """A JSON manifest at `path`, checked as `check_versioned` does."""
    path = Path(path)
    what = what or str(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what}: {path.name} is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt manifest {path}: {e}") from None
    return check_versioned(doc, fmt, version, what)
