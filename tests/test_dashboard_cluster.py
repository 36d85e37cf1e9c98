"""stealer dashboard on a cluster executor: the node rows from the figures its client
publishes (stealer/cluster/snapshot.py), read without Ray, as ``stealer top`` reads them.

A fake client (this process) publishes two snapshots a second apart; the dashboard must
show one row per node with the rates between them, and say the executor is gone once the
snapshot is removed.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import time

import pytest

from stealer.cluster import snapshot
from stealer.dashboard import serve_dashboard


def snap(name: str, t: float, done_a: int, msgs_b: int) -> dict:
    node = {"alive": True, "workers": 1, "queued": 3, "running": 1, "task_s": 0.002,
            "busy": 0.5, "agents": 2, "active": 1, "msgs": 0, "steals": None, "got": 4,
            "given": 0, "latency_ms": {"n": 10, "p50": 1.5, "p99": 9.25}, "pid": None,
            "children": {"shipped": 2, "imported": 0}}
    return {"id": name, "pid": os.getpid(), "time": t, "uptime_s": 12.0, "kind": "cluster",
            "submitted": 500, "done": 400, "outstanding": 100, "resubmitted": 0,
            "duplicates": 0, "moved": 7, "transient": 0, "losses": [], "replayed": 0,
            "state_errors": 0, "agent_moves": 3, "move_s": 0.03, "move_errors": 0,
            "nodes": {"aaaa" * 14: dict(node, done=done_a),
                      "bbbb" * 14: dict(node, done=10, msgs=msgs_b, alive=False)}}


def get(d, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
    c.request("GET", path, headers={"Host": f"127.0.0.1:{d.port}",
                                    "Authorization": f"Bearer {d.token}"})
    r = c.getresponse()
    out = r.status, r.read()
    c.close()
    return out


@pytest.fixture
def name():
    n = f"stealer-{os.getpid()}-cluster-{secrets.token_hex(8)}"
    yield n
    snapshot.remove(n)


def test_the_dashboard_shows_a_cluster_executors_nodes(name):
    t0 = time.time()
    snapshot.write(name, snap(name, t0, done_a=100, msgs_b=0))
    with serve_dashboard(name, interval=0.05) as d:
        status, body = get(d, "/api/snapshot")
        assert status == 200
        first = json.loads(body)["cluster"]
        assert first["id"] == name and [n["id"][:4] for n in first["nodes"]] == ["aaaa", "bbbb"]
        assert first["nodes"][0]["tasks_s"] is None  # no earlier snapshot: no rate yet
        snapshot.write(name, snap(name, t0 + 1.0, done_a=350, msgs_b=40))
        time.sleep(0.1)
        u = json.loads(get(d, "/api/snapshot")[1])["cluster"]
        a, b = u["nodes"]
        assert a["tasks_s"] == 250.0 and b["msgs_s"] == 40.0  # per second, between the two
        assert a["busy"] == 50.0 and a["p99_ms"] == 9.25 and a["children_out"] == 2
        assert b["alive"] is False and u["agent_moves"] == 3 and u["move_ms"] == 30.0
        meta = json.loads(get(d, "/api/meta")[1])
        assert meta["id"] == name and meta["workers"] == 1  # the alive nodes' workers
        assert b'id="p-nodes"' in get(d, "/")[1]
        snapshot.remove(name)  # the client shut down
        time.sleep(0.1)
        assert "gone" in json.loads(get(d, "/api/snapshot")[1])


def test_an_unknown_cluster_id_is_refused(name):
    with pytest.raises(FileNotFoundError, match="no executor with id"):
        serve_dashboard(name)
