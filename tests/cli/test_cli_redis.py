"""The management commands on a real Redis store (same code paths as disk, via the URL)."""

from __future__ import annotations

import json
import uuid

import pytest

from encache.cli import errors
from encache.connectors.store import open_store
from cli_support import H, invoke, one_line_error
from entries import put_entry

pytestmark = pytest.mark.redis


@pytest.fixture
def rstore(redis_server):
    url = f"{redis_server.url}?prefix=t-cli-{uuid.uuid4().hex}:"
    s = open_store(url)
    put_entry(s, H[0], 64, 0)
    put_entry(s, H[1], 32, 1)
    put_entry(s, "ad1:" + H[2], 64, 2)
    put_entry(s, H[3], 64, 3, model="other")
    yield url, s
    for i in list(s.identifiers()):
        s.delete(i)
    s.reset_counters()
    s.close()


def test_list_stats_size(rstore):
    url, s = rstore
    r = invoke("list", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["count"] == 4
    assert {e["identifier"] for e in d["entries"]} == {H[0], H[1], "ad1:" + H[2], H[3]}
    s.add_counters({"hits": 4, "misses": 1})
    d = json.loads(invoke("stats", "-s", url, "--json").stdout)
    assert d["backend"] == "redis" and d["entries"] == 4 and d["hits"] == 4 and d["misses"] == 1
    assert d["bytes"] == sum(e["size"] for e in json.loads(r.stdout)["entries"])
    assert invoke("size", "-s", url).stdout.strip() == str(d["bytes"])
    assert invoke("list", "-s", url, "-q", "--lora", "ad1").stdout.split() == ["ad1:" + H[2]]


def test_purge(rstore):
    url, s = rstore
    r = invoke("purge", "-s", url, "--model", "m", "--dry-run")
    assert r.exit_code == 0 and "Would delete 3 entries" in r.stdout
    r = invoke("purge", "-s", url, "--model", "m", "-y", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["result"]["deleted"] == 3
    assert set(s.identifiers()) == {H[3]}


def test_verify_and_repair_delete(rstore):
    url, s = rstore
    b = bytearray(s.get(H[1]))
    b[-1] ^= 1
    s.put(H[1], bytes(b))
    r = invoke("verify", "-s", url, "--json")
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert [(f["identifier"], f["reason"]) for f in json.loads(r.stdout)["problems"]] == \
        [(H[1], "checksum")]
    r = invoke("verify", "-s", url, "--repair", "--json")
    d = json.loads(r.stdout)
    assert d["repair"]["deleted"] == 1 and d["repair"]["quarantined"] == 0  # no quarantine
    assert not s.contains(H[1])
    assert invoke("verify", "-s", url).exit_code == 0


def test_password_is_redacted_and_bad_password_is_store_error(redis_factory):
    server = redis_factory(password="s3cret-pw")
    url = server.url_for(password="s3cret-pw")
    r = invoke("stats", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    assert "s3cret-pw" not in r.stdout
    bad = server.url_for(password="wrong")
    r = invoke("list", "-s", bad)
    assert r.exit_code == errors.EXIT_STORE
    assert "s3cret-pw" not in one_line_error(r) and "wrong" not in r.stderr


def test_unreachable_redis_is_store_error():
    from redis_fixture import free_port
    r = invoke("stats", "-s", f"redis://127.0.0.1:{free_port()}/0")
    assert r.exit_code == errors.EXIT_STORE
    one_line_error(r)


def test_stats_table_shows_backend_details(rstore):
    url, s = rstore
    r = invoke("stats", "-s", url)
    assert r.exit_code == 0, r.output
    assert "redis" in r.stdout and "Used memory" in r.stdout and "Prefix" in r.stdout
