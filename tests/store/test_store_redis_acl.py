"""Least privilege on Redis: the ACL lines docs/security.md gives, on a real redis-server.

The reader (consumers, read-only CLI commands) reads every entry, its header and the
store's index and journal, records its counters, and cannot write, overwrite or delete an
entry (each refusal one line naming the ACL). The writer (producers, precompute, purge,
verify --repair) does all of that. The lines are read from docs/security.md itself, so
what the page says is what runs here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from encache.connectors.store import encode, open_store
from encache.connectors.store.base import StoreError

pytestmark = pytest.mark.redis

DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"


def acl_line(user: str) -> list[str]:
    """The ``ACL SETUSER <user> ...`` line of docs/security.md, as arguments."""
    [line] = [ln for ln in DOC.read_text().splitlines()
              if ln.startswith(f"ACL SETUSER {user} ")]
    return line.split()


def add_user(server, user: str, password: str) -> str:
    """Create ``user`` on ``server`` with the documented line; its store URL."""
    args = [a if a != ">PASSWORD" else f">{password}" for a in acl_line(user)]
    assert server.client().execute_command(*args) in (b"OK", "OK", True)
    return f"redis://{user}:{password}@{server.host}:{server.port}/0"


def entry(identifier: str, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).standard_normal(256).astype(np.float32)
    return encode(identifier, data.tobytes(), "F32", (16, 16), created=1.0)


def test_the_documented_reader_reads_and_counts_but_cannot_write(redis_factory):
    server = redis_factory()
    reader_url = add_user(server, "encache-reader", "r-secret")
    writer_url = add_user(server, "encache-writer", "w-secret")
    a, b = "a" * 64, "b" * 64
    writer = open_store(writer_url)
    writer.put(a, entry(a))
    reader = open_store(reader_url)
    assert reader.get(a) == entry(a)
    assert reader.read_verified(a) is not None and reader.stat(a).meta.shape == (16, 16)
    assert reader.contains(a) and [i.identifier for i in reader.scan()] == [a]
    assert reader.changes_since(None) is not None and reader.index_version()
    reader.add_counters({"hits": 2})
    assert reader.read_counters()["hits"] == 2
    assert reader.info().backend == "redis"
    for what, act in (("put", lambda: reader.put(b, entry(b))),
                      ("overwrite", lambda: reader.put(a, entry(a, seed=1))),
                      ("delete", lambda: reader.delete(a))):
        with pytest.raises(StoreError, match="permission denied: this user's ACL") as e:
            act()
        assert "\n" not in str(e.value) and "r-secret" not in str(e.value), what
    assert reader.get(a) == entry(a) and not writer.contains(b)
    # the reader's own writes reach only its counters and access times
    admin = server.client()
    assert not admin.exists("encache:note:x")
    with pytest.raises(StoreError, match="permission denied"):
        reader.put_note("x", "planted")


def test_the_documented_writer_writes_purges_and_locks(redis_factory):
    server = redis_factory()
    writer = open_store(add_user(server, "encache-writer", "w-secret"))
    ids = [c * 64 for c in "abc"]
    for n, i in enumerate(ids):
        writer.put(i, entry(i, n))
    writer.put(ids[0], entry(ids[0], 9))  # overwrite
    assert writer.get(ids[0]) == entry(ids[0], 9)
    assert writer.delete(ids[1])
    writer.delete_many([ids[2]])
    assert sorted(writer.identifiers()) == [ids[0]]
    with writer.lock("purge"):
        pass
    writer.add_counters({"saves": 1})
    assert re.match(r"[0-9]", str(writer.read_counters()["saves"]))


def _cluster_users(cluster) -> tuple[str, str]:
    import redis

    for node in cluster.nodes:
        client = redis.Redis(host=node.host, port=cluster.client_port(node))
        for user, password in (("encache-cluster-reader", "r-secret"),
                               ("encache-cluster-writer", "w-secret")):
            args = [a if a != ">PASSWORD" else f">{password}" for a in acl_line(user)]
            client.execute_command(*args)
    first = cluster.nodes[0]
    at = f"{first.host}:{cluster.client_port(first)}"
    return (f"redis+cluster://encache-cluster-reader:r-secret@{at}",
            f"redis+cluster://encache-cluster-writer:w-secret@{at}")


def test_the_documented_cluster_users(redis_cluster_factory):
    """The same on a Redis Cluster (its hash-tagged bookkeeping keys, slot map, a
    listing's read-only script): the reader reads, lists, follows the journal and counts;
    it cannot write or delete; the writer does all of it."""
    cluster = redis_cluster_factory(primaries=3, replicas=0)
    reader_url, writer_url = _cluster_users(cluster)
    writer = open_store(writer_url)
    ids = [c * 64 for c in "abcdef"]
    for n, i in enumerate(ids):
        writer.put(i, entry(i, n))
    assert writer.delete(ids[-1])
    with writer.lock("purge"):
        pass
    reader = open_store(reader_url)
    assert [reader.get(i) for i in ids[:-1]] == [entry(i, n) for n, i in enumerate(ids[:-1])]
    assert sorted(i.identifier for i in reader.scan()) == ids[:-1]
    assert reader.read_verified(ids[0]) is not None and reader.stat(ids[0]) is not None
    assert reader.changes_since(None) is not None and reader.index_version()
    reader.add_counters({"hits": 1})
    assert reader.read_counters()["hits"] == 1
    for act in (lambda: reader.put(ids[-1], entry(ids[-1])), lambda: reader.delete(ids[0])):
        with pytest.raises(StoreError, match="permission denied: this user's ACL") as e:
            act()
        assert "\n" not in str(e.value) and "r-secret" not in str(e.value)
    assert writer.contains(ids[0]) and not writer.contains(ids[-1])
