"""`encache precompute --ray` on a real two-node Ray cluster on this machine.

The cluster (tests/ray_local_cluster.py) is `ray start --head` plus a second
`ray start --address` node, each with 2 logical CPUs and its own custom resource, on
127.0.0.1, with token authentication; started and stopped (by process group) here. Engines
ask for 1.5 CPUs each, so two engines land one per node. One scenario, in order:

1. a single-host precompute of the corpus (the reference store);
2. a Ray run whose *driver* is killed (SIGKILL) once some entries are written;
3. the re-run: does only the rest, while one engine actor process is SIGKILLed mid-run;
   it still completes and the store equals the reference (same identifiers, same tensor
   bytes);
4. a fault-free run re-encoding everything under another ``--tag``: work lands on both
   nodes;
5. one more run: everything present, no engine starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")

from engine_support import ROOT  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.engine]

ENGINE = ["--max-model-len", "256", "--dtype", "float32",
          "--engine-arg", "enforce_eager=true", "--engine-arg", "max_num_seqs=4",
          "--engine-arg", "max_num_batched_tokens=256", "--engine-arg", "seed=0"]
PAGES = 16
BATCH = 2
ENCACHE = [sys.executable, "-m", "encache.cli"]


@pytest.fixture(scope="module")
def cluster():
    from ray_local_cluster import LocalRayCluster
    # the encoder probe on every worker's path: inert unless a run sets its variables
    c = LocalRayCluster([{"num_cpus": 2, "resources": {"encache_node_0": 1}},
                         {"num_cpus": 2, "resources": {"encache_node_1": 1}}],
                        node_env={"PYTHONPATH": str(ROOT / "tests" / "encoder_probe")})
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from demo_corpus import make_corpus
    root = tmp_path_factory.mktemp("raycorpus") / "corpus"
    make_corpus(str(root), pages=PAGES, seed=5)
    (root / "README.txt").write_text("not media: skipped and listed, never a failure\n")
    return root


def _env(cluster=None):
    env = cluster.env() if cluster else dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="ERROR")
    return env


def _entries(store_dir) -> int:
    from encache.connectors.store import open_store
    if not os.path.isdir(store_dir):
        return 0
    return sum(1 for _ in open_store(str(store_dir), create=False).identifiers())


def _tensors(store_dir) -> dict:
    from encache.connectors.store import decode, open_store
    store = open_store(str(store_dir), create=False)
    out = {}
    for ident in store.identifiers():
        meta, data = decode(store.get(ident), identifier=ident)
        out[ident] = (meta.dtype, tuple(meta.shape), bytes(data))
    return out


def _ray_cmd(cluster, corpus, tiny_model, store, *extra):
    return [*ENCACHE, "precompute", str(corpus), "-m", tiny_model, "-s", str(store),
            "--ray", cluster.address, "--engines", "2", "--cpus-per-engine", "1.5",
            "--batch", str(BATCH), "--json", *ENGINE, *extra]


def _engine_actor_pids(cluster, node: int) -> list[int]:
    return [p for p in cluster.pids_in(node) if "_EngineActor" in cluster.cmdline(p)]


def _wait_for_entries(proc, store, n: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return -1
        count = _entries(store)
        if count >= n:
            return count
        time.sleep(0.2)
    return -2


def test_no_ray_import_on_the_single_host_path(tmp_path):
    code = ("import sys\n"
            "from typer.testing import CliRunner\n"
            "from encache.cli.app import app\n"
            "r = CliRunner().invoke(app, ['precompute', sys.argv[1], '-m', 'org/m', '-s', "
            "sys.argv[2], '--dry-run', '-q'])\n"
            "assert r.exit_code == 0, r.output\n"
            "print('ray' in sys.modules)\n")
    from demo_corpus import make_corpus
    make_corpus(str(tmp_path / "c"), pages=2, seed=1)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c"), str(tmp_path / "s")],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_missing_ray_is_exit_9(tmp_path):
    code = ("import sys; sys.modules['ray'] = None\n"  # as if Ray were not installed
            "from encache.cli.app import main\n"
            "sys.argv = ['encache', 'precompute', sys.argv[1], '-m', 'org/m', '-s', sys.argv[2],"
            " '--ray', 'auto']\n"
            "main()\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "s")],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 9, out.stderr
    assert "pip install 'encache-vllm[ray]'" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_unreachable_address_is_exit_9(tmp_path):
    from ray_local_cluster import free_port
    out = subprocess.run([*ENCACHE, "precompute", str(tmp_path), "-m", "org/m", "-s",
                          str(tmp_path / "s"), "--ray", f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 9, out.stderr
    assert "unreachable" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_wrong_token_is_exit_9(cluster, tmp_path, corpus):
    env = _env(cluster)
    env["RAY_AUTH_TOKEN"] = "0" * 64
    out = subprocess.run([*ENCACHE, "precompute", str(corpus), "-m", "org/m", "-s",
                          str(tmp_path / "s"), "--ray", cluster.address],
                         capture_output=True, text=True, env=env, timeout=400)
    assert out.returncode == 9, out.stderr[-2000:]
    assert "Error:" in out.stderr and "Traceback" not in out.stderr
    assert "RAY_AUTH_TOKEN" in out.stderr


def test_node_check_refuses_a_store_another_node_sees_differently(tmp_path, redis_factory):
    """The marker check itself, as each node runs it: a disk path whose marker is not
    there (another machine's directory) and a Redis URL reaching another server."""
    from encache.connectors.store import open_store
    from encache.jobs.ray_cluster import node_problems, remove_marker, write_marker

    assert "not the driver's store" in node_problems(str(tmp_path / "absent"), "tok0",
                                                     None, None)[0]  # no store at that path
    disk = open_store(str(tmp_path / "s"), create=True)
    write_marker(disk, "tok1")
    assert node_problems(str(disk.url), "tok1", None, None) == []
    other = open_store(str(tmp_path / "elsewhere"), create=True)  # "the same path, another node"
    assert "not the driver's store" in node_problems(str(other.url), "tok1", None, None)[0]
    remove_marker(disk, "tok1")
    assert node_problems(str(disk.url), "tok1", None, None)

    a, b = redis_factory(), redis_factory()
    store_a = open_store(a.url_for(0), create=True)
    write_marker(store_a, "tok2")
    assert node_problems(a.url_for(0), "tok2", None, None) == []
    assert "another Redis" in node_problems(b.url_for(0), "tok2", None, None)[0]
    f = next(iter(os.scandir(ROOT / "scripts")))
    assert node_problems(a.url_for(0), "tok2", f.path, f.stat().st_size + 1)  # corpus
    remove_marker(store_a, "tok2")


def test_cluster_run_survives_killed_driver_and_killed_engine(cluster, corpus, tiny_model,
                                                              tmp_path):
    env = _env(cluster)
    # 1. the reference: single-host precompute of the same corpus, same batch
    ref = tmp_path / "single"
    out = subprocess.run([*ENCACHE, "precompute", str(corpus), "-m", tiny_model, "-s", str(ref),
                          "--batch", str(BATCH), "--json", "-q", *ENGINE],
                         capture_output=True, text=True, env=_env(), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["encoded"] == PAGES
    assert json.loads(out.stdout)["skipped_non_media"] == 1

    # 2. a Ray run whose driver is SIGKILLed once an entry is in the store: the encoder
    #    probe's gate lets exactly one tower run through, the other batches wait at it
    store = tmp_path / "ray"
    gate = tmp_path / "gate-driver"
    gate.mkdir()
    driver = subprocess.Popen(_ray_cmd(cluster, corpus, tiny_model, store),
                              env={**env, "ENCACHE_TEST_ENCODER_GATE": str(gate)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 900
        while not list(gate.glob("*.running")) and driver.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        first = sorted(gate.glob("*.running"))
        assert first, driver.communicate()[1][-3000:]
        (gate / (first[0].name[:-len(".running")] + ".go")).touch()
        got = _wait_for_entries(driver, store, 1, timeout=900)
        assert got > 0, driver.communicate()[1][-3000:]
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.kill()
        driver.wait()
        (gate / "release").touch()  # actors left at the gate finish (their job is gone)
    before = _entries(store)
    assert 0 < before < PAGES

    # 3. the re-run does only the rest; one engine actor is SIGKILLed while it is inside a
    #    batch: the encoder probe holds every tower run at a gate until the test releases it
    gate = tmp_path / "gate-engine"
    gate.mkdir()
    rerun = subprocess.Popen(_ray_cmd(cluster, corpus, tiny_model, store),
                             env={**env, "ENCACHE_TEST_ENCODER_GATE": str(gate)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 900
        while killed is None and rerun.poll() is None and time.monotonic() < deadline:
            running = sorted(int(p.name.split("-")[0]) for p in gate.glob("*.running"))
            if running:
                killed = running[0]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        (gate / "release").touch()
        stdout, stderr = rerun.communicate(timeout=900)
    finally:
        (gate / "release").touch()
        rerun.kill()
    assert killed is not None, "no engine reached its vision tower during the re-run"
    assert rerun.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout)
    assert summary["failed"] == 0 and summary["engine_started"] is True
    assert summary["present"] >= before  # what the killed run wrote is not done again
    assert summary["present"] + summary["encoded"] == PAGES
    assert summary["nodes"] == 2
    pids = [p for e in summary["engines"] for p in e["pids"]]
    # the killed actor died inside its first batch: that batch was retried (by its restarted
    # process or the other engine), and nothing came back from the killed pid
    assert killed not in pids, summary["engines"]

    # the store equals the single-host one: same identifiers, same tensor bytes
    mine, theirs = _tensors(store), _tensors(ref)
    assert sorted(mine) == sorted(theirs) and len(mine) == PAGES
    for ident in theirs:
        assert mine[ident] == theirs[ident], ident

    # 4. a fault-free run over everything (another --tag: every entry is re-encoded):
    #    the batches land on both nodes, one engine per node
    out = subprocess.run(_ray_cmd(cluster, corpus, tiny_model, store, "--tag", "v2"),
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    full = json.loads(out.stdout)
    assert full["other_config"] == PAGES and full["encoded"] == PAGES, full
    nodes = {e["node_id"] for e in full["engines"] if e["images"]}
    assert len(nodes) == 2, full["engines"]  # work landed on both nodes
    assert sum(e["images"] for e in full["engines"]) == PAGES

    # 5. nothing left to do: no engine starts
    out = subprocess.run(_ray_cmd(cluster, corpus, tiny_model, store, "--tag", "v2"),
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    again = json.loads(out.stdout)
    assert again["present"] == PAGES and again["encoded"] == 0
    assert again["engine_started"] is False and again["engines"] == []
    # media found by content on the cluster as on one host: the text file is skipped, listed
    assert again["skipped_non_media"] == 1
    assert [m["path"] for m in again["non_media"]] == ["README.txt"]


def test_ray_hashes_request_mm_processor_kwargs_as_single_host(cluster, corpus, tiny_model,
                                                               tmp_path):
    """--request-mm-processor-kwargs on Ray: the identify tasks hash each file with the
    requests' kwargs exactly as single-host (identify_file) does, so entries made for such
    requests are "present" and plain ones are not."""
    import numpy as np

    from encache.jobs.corpus import non_media_reason, walk
    from encache.connectors.store import encode, open_store
    from encache.connectors.vllm.hashing import identify_file

    env = _env(cluster)
    kw = {"max_pixels": 50176}
    store = tmp_path / "kw"
    args = ("--dry-run", "--request-mm-processor-kwargs", json.dumps(kw))
    out = subprocess.run(_ray_cmd(cluster, corpus, tiny_model, store, *args),
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    first = json.loads(out.stdout)
    assert first["hashed"] == PAGES and first["present"] == 0
    assert first["engine_started"] is False
    st = open_store(str(store), create=False)
    for f in walk(corpus):
        if non_media_reason(f) is None:
            ident = identify_file(f.path, tiny_model, mm_processor_kwargs=kw).identifier
            arr = np.zeros((4, 8), np.float16)
            st.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=tiny_model))
    out = subprocess.run(_ray_cmd(cluster, corpus, tiny_model, store, *args),
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    again = json.loads(out.stdout)
    assert again["present"] == PAGES and again["engine_started"] is False, again
    out = subprocess.run(_ray_cmd(cluster, corpus, tiny_model, store, "--dry-run"),
                         capture_output=True, text=True, env=env, timeout=900)
    assert json.loads(out.stdout)["present"] == 0  # plain requests: other identifiers


def test_ray_skip_fills_free_room_and_evicts_nothing(cluster, corpus, tiny_model, tmp_path):
    """--over-capacity skip on Ray, two engines, from an empty store under a cap that
    holds about half the corpus: each engine checks the room before each batch (holding
    back the other engine's batch in flight), so some entries are encoded, the rest
    counted as skipped, and the store never evicts or goes over its cap."""
    from encache.connectors.store import open_store

    cap = 30_000  # ~12 tiny-LLaVA entries of ~2.4 KB; 16 pages in the corpus
    store = tmp_path / "skip"
    out = subprocess.run(_ray_cmd(cluster, corpus, tiny_model, store, "--over-capacity",
                                  "skip", "--max-bytes", str(cap)),
                         capture_output=True, text=True, env=_env(cluster), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout)
    st = open_store(str(store), create=False)
    kept = list(st.identifiers())
    assert s["failed"] == 0 and s["encoded"] == len(kept) > 0, s
    assert s["skipped_capacity"] == PAGES - s["encoded"] > 0, s
    assert s["evicted"] == 0 and st.read_counters().get("evictions", 0) == 0
    assert st.used_bytes() <= cap
    assert s["capacity"] is not None and "skipped" in s["capacity"]["message"]
