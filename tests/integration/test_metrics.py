"""Every process of a running store serves /metrics: parsed with
prometheus_client's own parser, and scraped by a real Prometheus server
whose HTTP API then reports a table's insert count."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import distore_ucx as ds

ITEMS, ITEM_BYTES = 300, 256
SPEC = ((ITEM_BYTES,), "uint8")
PROMETHEUS_HOWTO = ("needs a Prometheus server binary: `apt-get install prometheus` "
                    "(Debian/Ubuntu; .ci/run installs it), or put `prometheus` from "
                    "https://prometheus.io/download/ on PATH")


def scrape(url: str) -> dict:
    """{sample name: {frozenset(labels): value}}, parsed by prometheus_client."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    """Sum of `name` over the samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= k)


def fill(cluster, table: str = "t") -> None:
    with ds.connect(cluster.address) as client:
        client.create_table(table, capacity=1000, spec=SPEC)
        with client.writer(max_items=100) as writer:
            for i in range(ITEMS // 100):
                writer.insert(table, np.full((100, ITEM_BYTES), i, np.uint8))


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_every_process_serves_metrics_that_add_up(make_cluster):
    cluster = make_cluster(metrics=True)
    urls = cluster.metrics_urls()
    assert set(urls) == {"control", "node0", "node1"}
    # A table name of its own: this process's registry also counts learners
    # of earlier tests that the garbage collector has not taken yet.
    fill(cluster, "adds_up")
    with ds.connect(cluster.address) as client, \
            client.learner("adds_up", batch_size=10) as learner:
        for _ in range(4):
            learner.sample()
        learner.update_priorities(learner.sample().keys, np.ones(10), wait=True)
        control = scrape(urls["control"])
        t = {"table": "adds_up"}
        assert total(control, "distore_table_inserts_total", **t) == ITEMS
        assert total(control, "distore_table_size", **t) == ITEMS
        assert total(control, "distore_table_capacity", **t) == 1000
        # 5 batches handed out; samples back to back ask sample_ahead (k)
        # batches a request once two came in a row, and the request after
        # the last one may not be answered yet: 50 to 50 + 10 k sampled.
        k = learner.sample_ahead
        assert k == 8  # 128 items // 10, at most 8
        sampled = total(control, "distore_table_samples_total", **t)
        assert 50 <= sampled <= 50 + 10 * k and sampled % 10 == 0
        assert total(control, "distore_table_priority_updates_total", **t) == 10
        # One decision a request, and a request may carry several batches.
        assert total(control, "distore_table_sample_decision_seconds_count", **t) >= 2
        assert total(control, "distore_leases") >= 1
        assert total(control, "distore_nodes", state="alive") == 2
        assert total(control, "distore_membership_changes_total", change="joined") == 2
        assert total(control, "process_resident_memory_bytes") > 0
        nodes = [scrape(urls[f"node{i}"]) for i in range(2)]
        assert sum(total(n, "distore_node_insert_items_total") for n in nodes) == ITEMS
        assert sum(total(n, "distore_node_insert_batches_total") for n in nodes) == ITEMS // 100
        assert sum(total(n, "distore_node_insert_bytes_total") for n in nodes) == \
            ITEMS * ITEM_BYTES
        assert sum(total(n, "distore_node_items", table="adds_up") for n in nodes) == ITEMS
        assert sum(total(n, "distore_node_insert_seconds_count") for n in nodes) == ITEMS // 100
        for n in nodes:
            assert total(n, "distore_node_arena_bytes") == cluster.arena_bytes
            assert 0 < total(n, "distore_node_arena_used_bytes") <= cluster.arena_bytes
        mine = {k: v for k, v in scrape_registry().items()}
        lv = {"table": "adds_up"}
        assert total(mine, "distore_learner_batches_total", **lv) == 5
        assert total(mine, "distore_learner_fetched_items_total", **lv) == 50
        assert total(mine, "distore_learner_gather_seconds_count", **lv) >= 5


def scrape_registry() -> dict:
    """This process's learner and writer metrics, served and scraped over HTTP."""
    with ds.metrics.serve(0, "127.0.0.1") as server:
        return scrape(server.url)


@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_rate_limiter_holds_and_timeouts_are_counted(make_cluster):
    cluster = make_cluster(nodes=1, metrics=True)
    with ds.connect(cluster.address) as client:
        client.create_table("q", capacity=100, spec=SPEC, rate_limiter=ds.MinSize(50))
        learner = client.learner("q", batch_size=5)
        with pytest.raises(ds.NoData):
            learner.sample(timeout=0.2)
        learner.close()
        control = scrape(cluster.metrics_urls()["control"])
        held = total(control, "distore_table_rate_limiter_holds_total", table="q", op="sample")
        assert held >= 1
        assert total(control, "distore_table_rate_limiter_timeouts_total", table="q",
                     op="sample") == held


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=5).read())


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["tcp"], indirect=True)
def test_a_real_prometheus_scrapes_the_store(make_cluster, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(PROMETHEUS_HOWTO)
    cluster = make_cluster(metrics=True)
    targets = [u.split("/")[2] for u in cluster.metrics_urls().values()]
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: distore\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api/v1"
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path)
    try:
        fill(cluster)
        def query(q: str) -> list:
            return _get_json(f"{api}/query?query={urllib.parse.quote(q)}")["data"]["result"]

        deadline, value, up, nodes = time.monotonic() + 90, None, [], []
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                result = query('sum(distore_table_inserts_total{table="t"})')
                value = float(result[0]["value"][1]) if result else None
                up = query("up")
                nodes = query("distore_node_insert_items_total")
            except OSError:
                pass  # not listening yet
            if (value == ITEMS and len(up) == 3 and len(nodes) == 2
                    and sum(float(r["value"][1]) for r in nodes) == ITEMS):
                break  # every target scraped since the inserts
            time.sleep(0.5)  # polling Prometheus' API with a deadline
        assert value == ITEMS, (value, (tmp_path / "prometheus.log").read_text()[-3000:])
        assert len(up) == 3 and all(r["value"][1] == "1" for r in up), up
        # Per-node insert counters arrive with their node label.
        assert sum(float(r["value"][1]) for r in nodes) == ITEMS, nodes
        assert all(r["metric"]["node"] for r in nodes)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_taken_metrics_port_stops_the_control_plane_with_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "distore_ucx", "--log-level", "WARNING", "control",
             "--port", "0", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env=dict(os.environ, UCX_TLS="tcp"))
    assert out.returncode == 2, out.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr
    assert "--metrics-port" in out.stderr
