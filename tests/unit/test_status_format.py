"""`distore status`'s text: a gone node is listed apart, its memory not
counted as used (it showed as "gone 160.6 MiB 62.7%" for good, also after a
replacement joined)."""

from __future__ import annotations

from distore_ucx.status import format_status


def node(node_id: int, state: str, used: int) -> dict:
    return {"node_id": node_id, "name": f"n{node_id}", "address": f"10.0.0.{node_id}:7000",
            "state": state, "alive": state != "gone", "used_bytes": used,
            "arena_size": 256 << 20}


def test_gone_nodes_are_listed_apart_without_their_memory():
    st = {"nodes": [node(1, "live", 64 << 20), node(2, "gone", 160 << 20),
                    node(3, "live", 0)], "tables": [], "leases": 0}
    text = format_status("127.0.0.1:7700", st)
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(("1 ", "2 ", "3 "))]
    assert [r.split()[0] for r in rows] == ["1", "3"], text
    assert "62.5%" not in text and "160.0 MiB" not in text
    assert ("gone (their items left the tables; memory not counted): node 2 (n2, "
            "10.0.0.2:7000)") in text
    assert text.startswith("control plane 127.0.0.1:7700: 2 of 3 nodes alive")
