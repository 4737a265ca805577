"""The verify job as library code (``encache.connectors.store.ops.verify``), called without the
CLI: a Python user or a cron script gets the same findings and the same repair."""

from __future__ import annotations

import json

from encache.connectors.store import open_store
from encache.connectors.store.ops.verify import repair_plan, repair_store, verify_store
from cli_support import H, invoke, populated


def _truncate(store, ident):
    p = store.entry_path(ident)
    p.write_bytes(p.read_bytes()[:-100])


def test_verify_store_matches_the_cli(tmp_path):
    st = populated(tmp_path / "s", legacy=False)
    _truncate(st, H[0])
    rep = verify_store(st, display_url=str(st.root))
    cli = json.loads(invoke("verify", "-s", st.root, "--json").stdout)
    assert not rep.clean and rep.checked == 8
    assert [(f.identifier, f.reason) for f in rep.problems] == [(H[0], "truncated")]
    assert {**rep.to_dict(), "repair": None} == cli
    assert rep.repair is None  # no repair asked for


def test_verify_store_repair_quarantines_and_leaves_the_rest(tmp_path):
    st = populated(tmp_path / "s", legacy=False)
    _truncate(st, H[0])
    with open_store(str(st.root), create=False) as opened:
        rep = verify_store(opened, repair=True)
        assert rep.store == opened.url
    assert rep.repair is not None and rep.repair.ok
    assert rep.repair.quarantined == [H[0]] and rep.repair.freed_bytes > 0
    assert not st.contains(H[0]) and st.count() == 7 and st.contains(H[1])
    again = verify_store(st)
    assert again.clean and again.checked == 7


def test_repair_plan_then_repair_store_with_delete(tmp_path):
    st = populated(tmp_path / "s", legacy=False)
    _truncate(st, H[1])
    rep = verify_store(st)
    plan = repair_plan(st, rep, quarantine=False)
    assert [(i.identifier, i.action) for i in plan.items] == [(H[1], "delete")]
    seen = []
    res = repair_store(st, rep, plan=plan, progress=seen.append)
    assert res is rep.repair and res.deleted == [H[1]] and seen[-1] == 1
    assert not st.contains(H[1])


def test_repair_of_a_clean_store_does_nothing(tmp_path):
    st = populated(tmp_path / "s", legacy=False)
    rep = verify_store(st, repair=True)
    assert rep.clean and rep.repair is not None
    assert rep.repair.to_dict()["deleted"] == 0 and st.count() == 8
