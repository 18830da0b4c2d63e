"""A real Milvus server (the `milvus` package's standalone build, requirements-milvus.txt) for the
tests, beside Milvus Lite: one per test process (each pytest-xdist worker starts its own, on its
own ports, so workers never see each other's collections), started on the first test that asks,
its data in a temporary folder, stopped with its whole process group at the end of the session.

Everything the server offers is reached over 127.0.0.1: its components advertise 127.0.0.1 to one
another and its embedded etcd listens on 127.0.0.1 only.  (Milvus 2.3's gRPC and metrics servers
bind every interface, and have no setting for the address they listen on.)

Where the package is missing or the server does not start (another platform, no free ports), the
tests that need it are skipped with one line saying why.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT = 120.0    # seconds; it answers in about 3 s on 2 cores
COMPONENTS = ("rootCoord", "proxy", "queryCoord", "queryNode", "indexNode", "dataCoord", "dataNode")
# A test server's pace (ms): a flush waits for the segment's insert allocations to expire (2 s by
# default: flush took 3 s, now 1 s), a load for the query coordinator's checks (1 s and 0.5 s by
# default).  A shorter expiry is safe here: each session's server is new, with an empty data folder
# (Milvus asks only that the value never shrinks over data written before), and an export's inserts
# have all returned before it flushes.
SETTINGS = {
    "queryCoord.checkInterval": 100,
    "queryCoord.distPullInterval": 100,
    "dataCoord.segment.assignmentExpiration": 200,
}


class NoServer(Exception):
    """Why no server could be started: one line, the tests' skip reason."""


class _PortTaken(Exception):
    """A port chosen for the server was taken before it could listen on it."""


def _free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now (all held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def binaries() -> Path:
    """The server's binaries, unpacked once per version into the user's cache (246 MB; 6 s to
    unpack): the package ships them xz-compressed and unpacks them before each start otherwise.
    A lock keeps two test processes from unpacking into the same folder at once."""
    try:
        import milvus
    except ImportError:
        raise NoServer("the Milvus server tests need the milvus package: "
                       "pip install -r requirements-milvus.txt") from None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    home = cache / "dml-retrieval" / f"milvus-server-{milvus.__version__}"
    home.mkdir(parents=True, exist_ok=True)
    unpack = getattr(milvus, "_initialize_data_files", None)   # the pinned package's own unpacking
    if unpack is None:
        raise NoServer(f"the milvus package {milvus.__version__} does not unpack its server as 2.3.5 does: "
                       f"pip install -r requirements-milvus.txt")
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        unpack(str(home))   # only the files whose checksum differs from the last unpacking's
    return home / "bin"


def _write_config(data: Path, ports: dict[str, int], etcd: tuple[int, int]) -> Path:
    """milvus.yaml from the package's template, with our ports and folders, every component's
    advertised address 127.0.0.1, and the embedded etcd on two free loopback ports (its own
    defaults, 2379/2380, would clash with a second server or a local etcd)."""
    import milvus

    cfg = milvus.MilvusServerConfig(data_dir=str(data), **ports)
    for key, value in {**{f"{c}.ip": "127.0.0.1" for c in COMPONENTS}, **SETTINGS}.items():
        cfg.set(key, value)
    cfg.resolve()   # fills in the storage folders and writes configs/milvus.yaml
    path = data / "configs" / "milvus.yaml"
    client, peer = (f"http://127.0.0.1:{p}" for p in etcd)
    (data / "configs" / "etcd.yaml").write_text(
        f"name: default\nlisten-client-urls: {client}\nadvertise-client-urls: {client}\n"
        f"listen-peer-urls: {peer}\ninitial-advertise-peer-urls: {peer}\n"
        f"initial-cluster: default={peer}\n")
    text, n = re.subn(r"(?m)^etcd:\n", f"etcd:\n  config:\n    path: {data / 'configs' / 'etcd.yaml'}\n",
                      path.read_text())
    if n != 1:
        raise NoServer("the milvus package's config template has changed: it has no etcd section")
    path.write_text(text)
    return path


@dataclass
class MilvusServer:
    """One running server: `uri` (http://127.0.0.1:PORT, the default database) and
    `database(...)` (a new, empty database of its own, as a URI)."""
    data: Path
    proc: subprocess.Popen | None = None
    port: int = 0
    _names: itertools.count = field(default_factory=itertools.count)

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.data / "logs" / "milvus.log"

    def start(self, timeout: float = START_TIMEOUT, tries: int = 3) -> MilvusServer:
        """Start it on free ports and wait until it answers; new ports (and a clean folder) when
        another process took one of them between their choice and the server's start."""
        bin_dir = binaries()   # first: a missing package is a skip, with its reason
        for attempt in range(tries):
            try:
                return self._start(bin_dir, timeout)
            except _PortTaken as e:
                shutil.rmtree(self.data, ignore_errors=True)
                if attempt == tries - 1:
                    raise NoServer(f"the Milvus server found no free ports in {tries} tries: {e}") from None
        raise AssertionError("unreachable")

    def _start(self, bin_dir: Path, timeout: float) -> MilvusServer:
        import milvus

        self.data.mkdir(parents=True, exist_ok=True)
        keys = [k for k in milvus.MilvusServerConfig().configurable_items if k.endswith("_port")]
        free = _free_ports(len(keys) + 3)
        ports = dict(zip(keys, free, strict=False))
        self.port = ports["proxy_port"]
        try:
            _write_config(self.data, ports, (free[-3], free[-2]))
        except RuntimeError as e:   # the package's check that each port binds
            raise _PortTaken(str(e)) from None
        env = dict(os.environ, DEPLOY_MODE="STANDALONE", METRICS_PORT=str(free[-1]),
                   MILVUS_RUN_DIR=str(self.data / "run"),
                   LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(bin_dir), os.environ.get("LD_LIBRARY_PATH")])))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # killed when the test process ends, even one killed by a timeout (util-linux's setpriv sets
        # the parent-death signal, then runs the server: no stray servers; no preexec_fn, which is
        # unsafe in a process with threads, as a test process with Milvus Lite or gRPC clients is)
        setpriv = shutil.which("setpriv")
        cmd = [str(bin_dir / "milvus"), "run", "standalone"]
        with open(self.log, "wb") as out:
            # its own process group (start_new_session): stopped as a whole, never by name
            self.proc = subprocess.Popen([setpriv, "--pdeathsig", "KILL", "--", *cmd] if setpriv else cmd,
                                         cwd=self.data, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait(free[-1], timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, metrics_port: int, timeout: float) -> None:
        """Until the health check says OK and a client lists the collections."""
        from pymilvus import MilvusClient

        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                log = self.log.read_text(errors="replace")
                if "address already in use" in log:
                    raise _PortTaken(f"exited with code {self.proc.returncode}: address already in use")
                tail = log.strip().splitlines()[-1:] or [""]
                raise NoServer(f"the Milvus server exited with code {self.proc.returncode} while starting: "
                               f"{tail[0][:200]} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=2) as r:
                    healthy = b"OK" in r.read()
                if healthy:
                    client = MilvusClient(uri=self.uri, timeout=5)
                    try:
                        client.list_collections()
                        return
                    finally:
                        client.close()
            except Exception as e:   # not up yet: refused, reset, not ready
                last = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            time.sleep(0.2)
        raise NoServer(f"the Milvus server did not answer within {timeout:.0f} s ({last}; log: {self.log})")

    def database(self, what: str = "t") -> str:
        """A URI to a new, empty database on this server (dropped with its collections by
        `drop_databases`): each fixture its own, so collection names never meet."""
        from pymilvus import MilvusClient

        name = f"{re.sub(r'[^A-Za-z0-9_]', '_', what)[:40]}_{os.getpid()}_{next(self._names)}"
        client = MilvusClient(uri=self.uri)
        try:
            client.create_database(name)
        finally:
            client.close()
        return f"{self.uri}/{name}"

    def drop_database(self, uri: str) -> None:
        """Drop a database `database` made, its collections first (Milvus refuses a non-empty one)."""
        from pymilvus import MilvusClient

        name = uri.rsplit("/", 1)[1]
        client = MilvusClient(uri=uri)
        try:
            for c in client.list_collections():
                client.drop_collection(c)
            client.drop_database(name)
        finally:
            client.close()

    def stop(self) -> None:
        """SIGKILL to the server's process group, then reap it, and delete its storage (etcd,
        message queue, segments: 270 MB on disk); its configs and logs stay in the folder.  The
        data is thrown away, so there is nothing to shut down cleanly (SIGTERM takes it 3 s+)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:   # once reaped, its id may be another's
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:   # it had gone already
                pass
            proc.wait()
        shutil.rmtree(self.data / "data", ignore_errors=True)
