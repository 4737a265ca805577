"""Connecting a job to a Ray cluster, and checking the cluster sees what the driver sees.

What: :func:`connect` (``ray.init`` with one-line errors, exit 9: Ray missing, address
unreachable, token refused; the driver's ``VLLM_*``/``HF_*``/… environment forwarded to every
worker), :func:`check_nodes` (a zero-CPU task pinned to every alive node must read back a
random marker the driver wrote into the store, and see the corpus's first file with the
driver's size; otherwise exit 7), and :class:`RayNotices` (Ray's driver-side prints, kept
off stdout).

Why: a store path that exists only on the driver's host, or ``redis://localhost`` that means
another Redis on each node, would make every engine write somewhere no consumer reads; the
check refuses it before any work. Used by :mod:`encache.jobs.ray_precompute`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
import socket

from .errors import EXIT_CLUSTER, EXIT_STORE, EncacheError

#: environment variables forwarded to every Ray worker (the engine and the hasher read them)
FORWARD_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "ENCACHE_",
                        "OMP_NUM_THREADS")


# --------------------------------------------------------------------------- connecting

def import_ray():
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        raise EncacheError("--ray needs Ray on this machine and on every node: "
                           "pip install 'encache-vllm[ray]'", EXIT_CLUSTER) from None
    return ray


def _reachable(address: str, timeout: float = 5.0) -> str | None:
    """A quick TCP check of a ``host:port`` address (ray.init would retry for a minute)."""
    if address in ("auto", "local") or "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except (OSError, ValueError) as e:
        return e.strerror or str(e) or type(e).__name__


def forwarded_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARD_ENV_PREFIXES)}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs inside the actor process
    return env


def connect(address: str):
    """``ray.init(address)`` with one-line errors (exit 9); returns (ray, started_here)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    why = _reachable(address)
    if why:
        raise EncacheError(f"Ray cluster at {address} is unreachable ({why})", EXIT_CLUSTER,
                           hint="start it with `ray start --head`, or pass --ray auto on a node of it")
    try:
        with _quiet_stderr_fd():  # Ray's C++ client logs each failed attempt on fd 2
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False,
                     runtime_env={"env_vars": forwarded_env()})
    except Exception as e:  # ConnectionError, AuthenticationError, RuntimeError...
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        chain, cause = [], e
        while cause is not None and len(chain) < 5:
            chain.append(f"{type(cause).__name__} {cause}".lower())
            cause = cause.__cause__ or cause.__context__
        if any(w in c for c in chain for w in ("authentication", "unauthenticated", "token")):
            raise EncacheError(f"Ray cluster at {address} refused this driver's token "
                               f"({text[:160]})", EXIT_CLUSTER,
                               hint="set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the head's "
                                    "token: `ray get-auth-token` on the head prints it") from None
        raise EncacheError(f"cannot connect to the Ray cluster at {address}: {text[:200]}",
                           EXIT_CLUSTER, hint="is `ray start --head` running? "
                                              "(ray status --address ADDRESS)") from None
    _quiet_ray_data(ray)
    return ray, True


@contextlib.contextmanager
def _quiet_stderr_fd():
    """Send file descriptor 2 to a temporary file for the block (``ENCACHE_DEBUG``: not)."""
    if os.environ.get("ENCACHE_DEBUG"):
        yield
        return
    import sys
    import tempfile
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _quiet_ray_data(ray) -> None:
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the driver draws its own (Rich, stderr)
    ctx.print_on_execution_start = False
    ctx.verbose_stats_logs = False
    for name in ("ray.data", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)


# --------------------------------------------------------------------------- the store check

def write_marker(store, token: str) -> str:
    """Leave ``token`` where every node must find it (a store note); returns where."""
    return store.put_note(f"ray-check-{token}", token)


def remove_marker(store, token: str) -> None:
    try:
        store.delete_note(f"ray-check-{token}")
    except Exception:  # best effort: a Redis note expires, a file note is tiny
        pass


def node_problems(store_url: str, token: str, corpus_file: str | None,
                  corpus_size: int | None) -> list[str]:
    """What this node sees differently from the driver: the store's marker note (a disk
    store's path, or the Redis behind the URL) and the corpus's first file."""
    from ..connectors.store import open_store
    from ..connectors.store import names_local_path

    problems = []
    try:
        try:
            store = open_store(store_url, create=False)
        except Exception:
            if not names_local_path(store_url):
                raise
            store = None  # no store at this path on this node
        try:
            seen = store.get_note(f"ray-check-{token}") if store is not None else None
        finally:
            if store is not None:
                store.close()
        if seen != token and names_local_path(store_url):
            problems.append(f"the store {store_url} is not the driver's store there "
                            "(use a path every node sees, or a Redis URL)")
        elif seen != token:
            problems.append("the Redis URL reaches another Redis there "
                            "(use an address every node resolves to the same server)")
    except Exception as e:
        problems.append(f"the store is unreachable there ({str(e).splitlines()[0][:160]})")
    if corpus_file is not None:
        try:
            size = os.stat(corpus_file).st_size
        except OSError:
            size = None
        if size != corpus_size:
            problems.append(f"the corpus file {corpus_file} is not there "
                            "(the corpus must be on a path every node sees)")
    return problems


def probe_node(*args) -> dict:
    """Runs as a Ray task pinned to one node: :func:`node_problems` there."""
    import ray
    return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(),
            "problems": node_problems(*args)}


def check_nodes(ray, store, store_url: str, files: list, timeout: float = 300.0) -> int:
    """Run :func:`probe_node` on every alive node; refuse (exit 7) if one cannot see the
    store or the corpus. Returns the number of nodes."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    write_marker(store, token)
    try:
        sample = files[0] if files else None
        probe = ray.remote(num_cpus=0, max_retries=2)(probe_node)
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
                .remote(store_url, token, sample.path if sample else None,
                        sample.size if sample else None) for n in nodes]
        try:
            results = ray.get(refs, timeout=timeout)
        except Exception as e:
            raise EncacheError(f"could not check the store from every Ray node: "
                               f"{str(e).strip().splitlines()[0][:200]}", EXIT_CLUSTER) from None
    finally:
        remove_marker(store, token)
    for r in results:
        if r["problems"]:
            raise EncacheError(f"Ray node {r['host']} ({r['node_id'][:8]}): {r['problems'][0]}",
                               EXIT_STORE)
    return len(results)


class RayNotices(io.TextIOBase):
    """Where the Ray driver's own prints go during the job: Ray prints task-retry and
    actor-death notices (multi-line, with tracebacks) to ``sys.stdout``, which is the
    summary's (``--json``). Here they become one ``ray: …`` line each on stderr (all of
    it with ``ENCACHE_DEBUG``)."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        import re
        import sys
        if os.environ.get("ENCACHE_DEBUG"):
            sys.stderr.write(text)
        else:
            first = re.sub(r"\x1b\[[0-9;]*m", "", text.strip().split("\n", 1)[0]).strip()
            if first:
                sys.stderr.write(f"ray: {first[:300]}\n")
        return len(text)
