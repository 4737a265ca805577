#!/usr/bin/env python
"""A real multi-node Ray cluster on this machine, on the loopback address (tests, benchmarks).

``LocalRayCluster([{"num_cpus": 2}, {"num_cpus": 2, "resources": {"b": 1}}])`` runs
``ray start --head`` and one ``ray start --address`` per further node, each in its own
process group and its own private ``--temp-dir``, with free ports and token authentication
on (a fresh ``RAY_AUTH_TOKEN``; ``~/.ray/auth_token`` is never written). ``stop()`` ends
exactly these processes (by process group, then anything left whose command line names the
private temp dir): never a bare ``ray stop``, which would end every Ray on the machine.

Loopback: Ray 2.60 turns ``--node-ip-address 127.0.0.1`` into the host's outward address
(``resolve_ip_for_localhost``) and binds to it. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
it keeps 127.0.0.1, but then ``ray start --address`` refuses to add a node; run as a
script, this file is ``ray start`` with only that refusal lifted, so every node, driver and
worker of a test cluster talks over 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRayCluster:
    def __init__(self, nodes: list[dict], python: str = sys.executable,
                 node_env: dict | None = None):
        self.nodes = nodes
        self.node_env = dict(node_env or {})  # extra environment of every node (and worker)
        self.python = python
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.mkdtemp(prefix="encray-", dir="/tmp")  # short: socket paths
        self.token = secrets.token_hex(32)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def env(self, **extra) -> dict:
        """The environment a driver (or node) of this cluster needs: its token, loopback."""
        env = dict(os.environ)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token,
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        env.update(extra)
        return env

    def _start_node(self, i: int, spec: dict, timeout: float) -> None:
        args = [self.python, os.path.abspath(__file__), "start", "--block",
                "--temp-dir", self.tmp, "--disable-usage-stats",
                "--num-cpus", str(spec.get("num_cpus", 1)), "--num-gpus", "0",
                "--dashboard-agent-listen-port", str(free_port()),
                "--dashboard-agent-grpc-port", str(free_port()),
                "--metrics-export-port", str(free_port()),
                "--runtime-env-agent-port", str(free_port())]
        if spec.get("resources"):
            args += ["--resources", json.dumps(spec["resources"])]
        if spec.get("object_store_memory"):
            args += ["--object-store-memory", str(spec["object_store_memory"])]
        if i == 0:
            args += ["--head", "--port", str(self.port), "--include-dashboard=false",
                     "--ray-client-server-port", str(free_port())]
        else:
            args += ["--address", self.address]
        log = open(os.path.join(self.tmp, f"node{i}.log"), "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                env=self.env(**self.node_env), start_new_session=True,
                                cwd=self.tmp)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout
        path = os.path.join(self.tmp, f"node{i}.log")
        while time.monotonic() < deadline:
            with open(path, "rb") as fh:
                text = fh.read()
            if b"Ray runtime started" in text:
                return
            if proc.poll() is not None:
                raise RuntimeError(f"ray node {i} exited: {text[-2000:].decode(errors='replace')}")
            time.sleep(0.5)
        raise RuntimeError(f"ray node {i} did not start within {timeout} s")

    def start(self, timeout: float = 240.0) -> LocalRayCluster:
        try:
            for i, spec in enumerate(self.nodes):
                self._start_node(i, spec, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def node_pgids(self) -> list[int]:
        return [p.pid for p in self.procs]  # start_new_session: pid == pgid

    def pids_in(self, node: int | None = None) -> list[int]:
        """PIDs of this cluster's processes (of one node if given): its process group and
        every descendant (Ray starts workers in their own sessions)."""
        pgids = set(self.node_pgids() if node is None else [self.procs[node].pid])
        parent, roots = {}, set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parent[int(entry)] = int(fields[1])  # ppid
            if int(fields[2]) in pgids:  # pgrp
                roots.add(int(entry))
        out = set(roots)
        changed = True
        while changed:
            changed = False
            for pid, ppid in parent.items():
                if ppid in out and pid not in out:
                    out.add(pid)
                    changed = True
        return sorted(out)

    @staticmethod
    def cmdline(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        for proc in self.procs:  # SIGTERM: `ray start --block` stops its node cleanly ...
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5  # ... or not within seconds (it waited 20 s): SIGKILL
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        time.sleep(1)
        for pid in self.pids_in():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for entry in os.listdir("/proc"):  # anything else started for this temp dir only
            if entry.isdigit() and self.tmp in self.cmdline(int(entry)):
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


#: how long a node's start waits for its raylet to register with the GCS
REGISTER_WAIT_S = 180.0


def _ray_start_main() -> int:
    """``ray start`` with the multi-node refusal of loopback mode lifted (see above), and
    patient with a slow raylet: Ray's node start gives its raylet 30 s to register with
    the GCS (a constant in ``Node.__init__``), which a test suite's other lanes on two
    CPUs have made it miss ("The current node timed out during startup"); here each look
    for the node waits up to :data:`REGISTER_WAIT_S`."""
    import types

    import ray._private.ray_constants as rc
    import ray._private.services as services
    import ray.scripts.scripts as scripts

    proxy = types.ModuleType("ray_constants_for_cli")
    proxy.__dict__.update(rc.__dict__)
    proxy.ENABLE_RAY_CLUSTER = True  # only the CLI's check; node IPs stay 127.0.0.1
    scripts.ray_constants = proxy
    get_node = services.get_node

    def patient_get_node(*args, **kw):
        deadline = time.monotonic() + REGISTER_WAIT_S
        while True:
            try:
                return get_node(*args, **kw)
            except RuntimeError:  # (not registered yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    services.get_node = patient_get_node
    sys.argv = ["ray", *sys.argv[1:]]
    return scripts.main()


if __name__ == "__main__":
    sys.exit(_ray_start_main())
