"""A real local Redis Cluster for tests (never a mock): N primaries + replicas.

Each node is a :class:`redis_fixture.RedisServer` started with ``--cluster-enabled yes``
(its own temp dir and ``nodes.conf``, a free client port and a free cluster-bus port, no
persistence), joined with ``redis-cli --cluster create … --cluster-replicas R
--cluster-yes``; the fixture waits until every node reports ``cluster_state:ok`` with all
16384 slots assigned and every replica is in sync. Nodes are stopped by PID.

Fixtures
--------
``redis_cluster`` (session scope)
    One shared 3 primaries + 3 replicas cluster. Tests sharing it must namespace their keys
    (``?prefix=t-…:``), and must not kill nodes, reshard or change settings.
``redis_cluster_factory`` (function scope)
    ``redis_cluster_factory(primaries=3, replicas=1, password=None, config=None,
    tls=False)`` — a private cluster for tests that kill a primary, reshard, or need special
    settings (``tls=True``: TLS for clients, the bus and replication, one self-signed
    certificate; ``url`` is then ``rediss+cluster://…?ssl_ca_certs=…``).
``valkey_cluster`` (session scope)
    The same as ``redis_cluster`` on ``valkey-server`` nodes (3 primaries + 3 replicas,
    joined by the same ``redis-cli``); skipped without ``valkey-server``
    (:mod:`redis_fixture`).

:class:`LocalCluster`: ``url`` (``redis+cluster://host:port,host:port…``), ``nodes``
(the RedisServer objects), ``client()`` (redis-py ``RedisCluster``), ``primaries()`` /
``replicas()`` (live nodes by role, from ``CLUSTER NODES``), ``node_id(server)``,
``slots_of(server)``, ``reshard(src, dst, slots)`` (``redis-cli --cluster reshard``),
``slot_owner(slot)`` / ``begin_slot_move`` / ``move_slot_keys`` / ``finish_slot_move`` (one
slot moved by hand, each state held as long as a test needs), ``wait_ok()``, ``kill(server)`` (SIGKILL by PID), ``stop()``.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from urllib.parse import quote

import pytest

from redis_fixture import HOST, MISSING, REDIS_SERVER, SERVERS, RedisServer, free_port

REDIS_CLI = shutil.which("redis-cli") or ("/usr/bin/redis-cli" if REDIS_SERVER else None)
NODE_TIMEOUT_MS = 2000  # quick failover in tests (production: 5000-15000)


class LocalCluster:
    """A Redis Cluster of ``primaries`` x (1 + ``replicas``) local redis-server processes."""

    def __init__(self, primaries: int = 3, replicas: int = 1, *, password: str | None = None,
                 config: dict | None = None, node_timeout_ms: int = NODE_TIMEOUT_MS,
                 start_timeout: float = 60.0, tls: bool = False, kind: str = "redis"):
        if REDIS_SERVER is None or REDIS_CLI is None:
            pytest.skip("redis-server / redis-cli not installed (scripts/setup installs them)")
        if SERVERS[kind] is None:
            pytest.skip(MISSING[kind])
        self.kind = kind
        self.password = password
        self.tls_cert: str | None = None
        self._tls_dir = None
        if tls:  # one self-signed certificate for every node: the bus verifies its peers
            if shutil.which("openssl") is None:
                pytest.skip("openssl command not available for a TLS cluster")
            self._tls_dir = tempfile.mkdtemp(prefix="encache-cluster-tls-")
            self.tls_cert = f"{self._tls_dir}/tls.crt"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                            f"{self._tls_dir}/tls.key", "-out", self.tls_cert, "-days", "2",
                            "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=IP:{HOST}"],
                           check=True, capture_output=True)
        self.expected = (primaries, primaries * replicas)
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(primaries * (1 + replicas)):
                bus = free_port()
                cfg = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                       "cluster-node-timeout": str(node_timeout_ms), "cluster-port": str(bus),
                       "repl-diskless-sync-delay": "0", **(config or {})}
                if password:
                    cfg["masterauth"] = password
                if tls:
                    cfg.update({"tls-port": str(free_port()), "tls-cluster": "yes",
                                "tls-replication": "yes", "tls-cert-file": self.tls_cert,
                                "tls-key-file": f"{self._tls_dir}/tls.key",
                                "tls-ca-cert-file": self.tls_cert, "tls-auth-clients": "no"})
                self.nodes.append(RedisServer(password=password, config=cfg, kind=kind))
            addrs = [f"{HOST}:{self.client_port(n)}" for n in self.nodes]
            tls_cli = ["--tls", "--cacert", self.tls_cert] if tls else []
            argv = [REDIS_CLI, *self._auth(), *tls_cli, "--cluster", "create", *addrs,
                    "--cluster-replicas", str(replicas), "--cluster-yes"]
            if primaries < 3:  # redis-cli refuses fewer than 3 primaries: assign by hand
                self._create_small(primaries, replicas)
            else:
                out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
                if out.returncode != 0:
                    raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-800:]}"
                                       f"{out.stderr[-800:]}")
            self.wait_ok(start_timeout)
        except BaseException:
            self.stop()
            raise

    # -- addresses ------------------------------------------------------------------------
    def _auth(self) -> list[str]:
        return ["-a", self.password, "--no-auth-warning"] if self.password else []

    def client_port(self, node: RedisServer) -> int:
        """The port clients use: the TLS port of a TLS cluster."""
        return int(node.config["tls-port"]) if self.tls_cert else node.port

    def url_for(self, password: str | None | bool = True, nodes: int = 2) -> str:
        """``redis+cluster://[:pw@]host:port,host:port`` naming the first ``nodes`` nodes
        (``rediss+cluster://…?ssl_ca_certs=…`` for a TLS cluster)."""
        pw = self.password if password is True else (password or None)
        auth = f":{quote(pw, safe='')}@" if pw else ""
        hosts = ",".join(f"{HOST}:{self.client_port(n)}" for n in self.nodes[:nodes])
        if self.tls_cert:
            return f"rediss+cluster://{auth}{hosts}?ssl_ca_certs={quote(self.tls_cert)}"
        return f"redis+cluster://{auth}{hosts}"

    @property
    def url(self) -> str:
        return self.url_for()

    def client(self, **kw):
        from redis.cluster import ClusterNode, RedisCluster
        return RedisCluster(startup_nodes=[ClusterNode(HOST, n.port) for n in self.nodes
                                           if n.alive],
                            password=self.password, socket_timeout=5, **kw)

    # -- topology ------------------------------------------------------------------------
    def cli(self, node: RedisServer, *args: str, timeout: float = 30) -> str:
        out = subprocess.run([REDIS_CLI, "-h", HOST, "-p", str(node.port), *self._auth(), *args],
                             capture_output=True, text=True, timeout=timeout)
        return out.stdout

    def _view(self, node: RedisServer) -> list[dict]:
        """``node``'s own CLUSTER NODES, one dict per node it knows (empty if it answers
        nothing)."""
        rows = []
        for line in self.cli(node, "cluster", "nodes").strip().splitlines():
            f = line.split()
            rows.append({"id": f[0], "addr": f[1].split("@")[0], "flags": f[2].split(","),
                         "master": f[3], "slots": f[8:]})
        return rows

    def _cluster_nodes(self) -> list[dict]:
        for n in self.nodes:
            if n.alive:
                rows = self._view(n)
                if rows:
                    return rows
        raise RuntimeError("no live cluster node")

    def _by_addr(self, addr: str) -> RedisServer | None:
        port = addr.rpartition(":")[2]  # (a lone node does not know its own IP: ":port")
        return next((n for n in self.nodes if str(n.port) == port), None)

    def role(self, node: RedisServer) -> str:
        """``master`` / ``slave`` as the node itself says (ROLE), or ``down``."""
        if not node.alive:
            return "down"
        out = self.cli(node, "role").split()
        return out[0] if out else "down"

    def primaries(self) -> list[RedisServer]:
        """Live primaries (by their own ROLE) in node order."""
        return [n for n in self.nodes if self.role(n) == "master"]

    def replicas(self) -> list[RedisServer]:
        return [n for n in self.nodes if self.role(n) == "slave"]

    def node_id(self, node: RedisServer) -> str:
        return self.cli(node, "cluster", "myid").strip()

    def slots_of(self, node: RedisServer) -> int:
        for r in self._cluster_nodes():
            if self._by_addr(r["addr"]) is node:
                total = 0
                for s in r["slots"]:
                    if s.startswith("["):
                        continue  # a slot being migrated/imported
                    a, _, b = s.partition("-")
                    total += int(b or a) - int(a) + 1
                return total
        return 0

    def wait_agreed_primary(self, node: RedisServer, timeout: float = 30.0) -> None:
        """Until every live node's own view (CLUSTER NODES) names ``node`` a primary that
        serves slots: a client that re-reads the slot map from any node then routes to it
        (right after a failover some nodes' gossip still names the dead primary)."""
        deadline = time.monotonic() + timeout
        while True:
            agreed = True
            for n in self.nodes:
                if not n.alive:
                    continue
                row = next((r for r in self._view(n) if self._by_addr(r["addr"]) is node), None)
                if row is None or "master" not in row["flags"] or not row["slots"]:
                    agreed = False
            if agreed:
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the nodes do not agree that {node.port} is a primary")
            time.sleep(0.1)

    def replica_of(self, primary: RedisServer) -> RedisServer | None:
        pid = self.node_id(primary)
        for r in self._cluster_nodes():
            if "slave" in r["flags"] and r["master"] == pid:
                return self._by_addr(r["addr"])
        return None

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says cluster_state:ok, 16384 slots are served and every
        live replica's link to its primary is up."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.alive]
            infos = [self.cli(n, "cluster", "info") for n in live]
            ok = all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos)
            if ok:
                reps = [self.cli(n, "info", "replication") for n in live]
                synced = all("master_link_status:up" in r for r in reps if "role:slave" in r)
                n_rep = sum("role:slave" in r for r in reps)
                # and every node's gossip view agrees on the replicas
                views = [self.cli(n, "cluster", "nodes").count("slave") for n in live]
                if synced and (len(live) < len(self.nodes) or
                               (n_rep == self.expected[1] and set(views) == {n_rep})):
                    return
            last = infos[0][:300] if infos else "no live node"
            time.sleep(0.1)
        raise RuntimeError(f"cluster not ok after {timeout:g}s: {last}")

    def _create_small(self, primaries: int, replicas: int) -> None:
        """1-2 primaries (below redis-cli's minimum of 3): ADDSLOTSRANGE + MEET + REPLICATE."""
        first = self.nodes[0]
        for n in self.nodes[1:]:
            self.cli(n, "cluster", "meet", HOST, str(first.port),
                     str(int(first.config["cluster-port"])))
        per = 16384 // primaries
        for i in range(primaries):
            lo, hi = i * per, (16383 if i == primaries - 1 else (i + 1) * per - 1)
            self.cli(self.nodes[i], "cluster", "addslotsrange", str(lo), str(hi))
        deadline = time.monotonic() + 30
        ids = [self.node_id(n) for n in self.nodes[:primaries]]
        for k, n in enumerate(self.nodes[primaries:]):
            while True:  # the replica must know the primary before REPLICATE works
                if "OK" in self.cli(n, "cluster", "replicate", ids[k % primaries]):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("replica could not attach")
                time.sleep(0.2)

    # -- operations --------------------------------------------------------------------------
    def reshard(self, src: RedisServer, dst: RedisServer, slots: int,
                timeout: float = 300) -> subprocess.CompletedProcess:
        """Move ``slots`` slots (and their keys) from ``src`` to ``dst`` with redis-cli.

        redis-cli refuses to start a reshard while the nodes' views of the slot map still
        differ ("Nodes don't agree about configuration!"), which on a loaded machine happens
        for a while after the previous reshard or failover: it then moves nothing, so wait
        for gossip to converge (``--cluster check``) and try again."""
        argv = [REDIS_CLI, *self._auth(), "--cluster", "reshard", f"{HOST}:{src.port}",
                "--cluster-from", self.node_id(src), "--cluster-to", self.node_id(dst),
                "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline", "20"]
        deadline = time.monotonic() + timeout
        while True:
            self.wait_agreement(src, deadline)
            out = subprocess.run(argv, capture_output=True, text=True,
                                 timeout=max(5.0, deadline - time.monotonic()))
            if "agree about configuration" not in out.stdout + out.stderr \
                    or time.monotonic() > deadline:
                return out
            time.sleep(0.5)

    # -- one slot by hand: the states a reshard passes through, held as long as a test likes --
    def slot_owner(self, slot: int) -> RedisServer:
        """The primary serving ``slot`` (from CLUSTER SLOTS of a live node)."""
        for n in self.nodes:
            if n.alive:
                for lo, hi, primary, *_ in n.client().execute_command("CLUSTER SLOTS"):
                    if lo <= slot <= hi:
                        return self._by_addr(f":{primary[1]}")
        raise RuntimeError(f"slot {slot} is not served")

    def begin_slot_move(self, slot: int, src: RedisServer, dst: RedisServer) -> None:
        """Open ``slot`` for migration (``dst`` IMPORTING, ``src`` MIGRATING): keys still on
        ``src`` are served there; a key ``src`` no longer has gets an ASK to ``dst``."""
        dst.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(src))
        src.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(dst))

    def move_slot_keys(self, slot: int, src: RedisServer, dst: RedisServer) -> int:
        """MIGRATE every key of an open ``slot`` from ``src`` to ``dst``; the count moved."""
        r, moved = src.client(), 0
        auth = ["AUTH", self.password] if self.password else []
        while keys := r.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
            r.execute_command("MIGRATE", HOST, dst.port, "", 0, 5000, *auth, "KEYS", *keys)
            moved += len(keys)
        return moved

    def finish_slot_move(self, slot: int, src: RedisServer, dst: RedisServer) -> None:
        """Close the migration: every primary says ``dst`` owns ``slot`` (MOVED from now on)."""
        dst_id = self.node_id(dst)
        for n in [dst, src, *(p for p in self.primaries() if p not in (dst, src))]:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    def wait_agreement(self, node: RedisServer, deadline: float) -> None:
        """Until ``redis-cli --cluster check`` says every node agrees on the slot map (or
        the deadline passes: the caller's command then reports the disagreement)."""
        argv = [REDIS_CLI, *self._auth(), "--cluster", "check", f"{HOST}:{node.port}"]
        while time.monotonic() < deadline:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if "All nodes agree about slots configuration" in out.stdout \
                    and "Nodes don't agree" not in out.stdout:
                return
            time.sleep(0.5)

    def wait_replicated(self, primary: RedisServer, timeout: float = 10.0) -> None:
        """Until every replica of ``primary`` has acknowledged its whole replication
        stream (so a failover after ``kill`` loses no entry)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = primary.client().info("replication")
            offs = [v["offset"] for k, v in info.items()
                    if k.startswith("slave") and isinstance(v, dict)]
            if offs and min(offs) >= info["master_repl_offset"]:
                return
            time.sleep(0.05)
        raise AssertionError("replica did not catch up")

    def kill(self, node: RedisServer) -> None:
        node.kill()  # SIGKILL by PID

    def stop(self) -> None:
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.stop()
        if self._tls_dir:
            shutil.rmtree(self._tls_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self) -> str:
        return f"LocalCluster(kind={self.kind}, ports={[n.port for n in self.nodes]})"


@pytest.fixture(scope="session")
def redis_cluster():
    """A shared 3 primaries + 3 replicas cluster for the session (namespace your keys)."""
    cluster = LocalCluster(3, 1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def valkey_cluster():
    """A shared 3 primaries + 3 replicas Valkey cluster for the session."""
    cluster = LocalCluster(3, 1, kind="valkey")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster_factory():
    """Private clusters: ``redis_cluster_factory(primaries=3, replicas=1, ...)``; all stopped."""
    made: list[LocalCluster] = []

    def make(primaries: int = 3, replicas: int = 1, **kw) -> LocalCluster:
        c = LocalCluster(primaries, replicas, **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.stop()
