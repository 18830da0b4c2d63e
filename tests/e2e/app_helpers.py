"""Helpers the end-to-end tests share: a free port and the browser they drive."""
import os
import shutil
import socket

import pytest


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chromium_path():
    """Debian's chromium, which the browser tests drive through playwright; None where it is missing."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    return path if os.path.exists(path) else None


needs_chromium = pytest.mark.skipif(chromium_path() is None, reason="Debian's chromium is not installed "
                                    "(make setup-test installs it as root; elsewhere: apt-get install chromium)")
