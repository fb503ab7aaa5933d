"""Metrics: histogram semantics, exposition parsed by prometheus_client's own
parser, naming conventions, settings, and the learner/writer registry."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from distore_ucx import metrics
from distore_ucx.config import resolve
from distore_ucx.errors import ConfigError


def parse(text: str) -> dict:
    """{sample name: {frozenset(labels): value}} with prometheus_client's parser."""
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[frozenset(s.labels.items())] = s.value
    return out


def test_histogram_buckets_are_cumulative_and_le_is_inclusive():
    h = metrics.Histogram((0.001, 0.01, 0.1))
    for v in (0.0005, 0.001, 0.002, 0.01, 0.05, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.001", 2), ("0.01", 4), ("0.1", 5), ("+Inf", 6)]
    assert h.count == 6 and h.sum == pytest.approx(3.0635)


def test_catalog_follows_prometheus_naming():
    cat = metrics.catalog()
    assert len(cat) > 40
    for name, (kind, doc) in cat.items():
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", name), name
        assert name.startswith(("distore_", "process_")), name
        assert doc, f"{name} has no help text"
        if kind == "counter":
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        if "bytes" in name and kind != "counter":
            assert name.endswith("_bytes"), name
    # What the issue asks for, by name.
    for name in ("distore_table_size", "distore_table_capacity", "distore_table_inserts_total",
                 "distore_table_samples_total", "distore_table_evictions_total",
                 "distore_table_rate_limiter_holds_total",
                 "distore_table_rate_limiter_timeouts_total", "distore_leases",
                 "distore_table_priority_updates_total", "distore_table_sample_decision_seconds",
                 "distore_node_arena_used_bytes", "distore_node_arena_bytes",
                 "distore_node_items", "distore_node_insert_batches_total",
                 "distore_node_insert_bytes_total", "distore_node_insert_seconds",
                 "process_cpu_seconds_total", "process_resident_memory_bytes",
                 "distore_membership_changes_total", "distore_checkpoint_duration_seconds",
                 "distore_checkpoint_size_bytes", "distore_learner_fetched_bytes_total",
                 "distore_learner_gather_seconds", "distore_learner_resampled_items_total",
                 "distore_learner_data_wait_ratio", "distore_writer_batch_seconds"):
        assert name in cat, name


class _Plane:
    """Stand-in for the ControlPlane attributes control_snapshot reads (public
    ones only: whether it is restoring, the control plane passes in)."""


def test_control_exposition_parses_and_carries_table_labels():
    from distore_ucx.control.tables import Table
    from distore_ucx.table_definition import TableDefinition

    plane = _Plane()
    t = Table(TableDefinition.make("replay", 100, ((8,), "uint8")), seed=1)
    t.inserts, t.samples, t.deletes = 7, 5, 2
    t.stats.holds["insert"] += 3
    t.stats.timeouts["sample"] += 1
    t.stats.decision.observe(0.0002)
    plane.tables = {"replay": t}
    plane.leases = []
    plane.members = type("M", (), {"nodes": {}})()
    plane.stats = metrics.ControlStats()
    plane.stats.membership["joined"] += 2
    plane.last_checkpoint = None
    fams = metrics.control_families(metrics.control_snapshot(plane, restoring=True))
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(type("C", (), {"collect": lambda self: iter(fams), "describe": lambda self: []})())
    got = parse(generate_latest(reg).decode())
    table = frozenset({("table", "replay")})
    assert got["distore_table_inserts_total"][table] == 7
    assert got["distore_table_samples_total"][table] == 5
    assert got["distore_table_evictions_total"][table] == 2
    assert got["distore_table_capacity"][table] == 100
    assert got["distore_table_rate_limiter_holds_total"][table | {("op", "insert")}] == 3
    assert got["distore_table_rate_limiter_timeouts_total"][table | {("op", "sample")}] == 1
    assert got["distore_table_sample_decision_seconds_count"][table] == 1
    assert got["distore_table_sample_decision_seconds_bucket"][table | {("le", "0.00025")}] == 1
    assert got["distore_membership_changes_total"][frozenset({("change", "joined")})] == 2
    assert "distore_checkpoint_duration_seconds" not in got  # no checkpoint yet
    assert got["distore_restoring"][frozenset()] == 1  # as the control plane said


def test_loop_collector_takes_its_snapshot_on_the_loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    seen = []

    def snapshot(obj):
        seen.append(threading.current_thread() is thread)
        return obj

    def families(snap):
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("distore_test_value", "a value")
        g.add_metric([], snap["v"])
        return [g]

    try:
        reg = metrics.new_registry(metrics.LoopCollector(loop, {"v": 4}, snapshot, families))
        assert parse(generate_latest(reg).decode())["distore_test_value"][frozenset()] == 4
        assert seen == [True]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_serve_answers_on_a_free_port_and_closes():
    with metrics.serve(0, "127.0.0.1") as server:
        text = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert "process_cpu_seconds_total" in parse(text)
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_a_taken_port_is_a_clear_error():
    with metrics.serve(0, "127.0.0.1") as server:
        with pytest.raises(ConfigError, match=rf"127.0.0.1:{server.port}.*--metrics-port"):
            metrics.start_server(server.port, "127.0.0.1", role="storage node")


def test_metrics_port_settings():
    s = resolve({}, {"DISTORE_CONTROL": "127.0.0.1:7700"})
    assert s.control().metrics_port == 9770 and s.control().metrics_optional
    assert s.node().metrics_port == 9771 and s.node().metrics_optional
    s = resolve({"control.metrics_port": "auto", "node.metrics_port": "0"},
                {"DISTORE_CONTROL": "127.0.0.1:7700"})
    assert s.control().metrics_port == metrics.AUTO_PORT and not s.control().metrics_optional
    assert s.node().metrics_port == 0
    assert resolve({}, {"DISTORE_NODE_METRICS_PORT": "9999"})["node.metrics_port"] == 9999
    with pytest.raises(ConfigError, match="a metrics port is 0-65535"):
        resolve({"control.metrics_port": "http"}, {})


def test_metrics_port_in_distore_toml(tmp_path):
    from distore_ucx.config import check_file

    path = tmp_path / "distore.toml"
    path.write_text("[control]\nmetrics_port = 9100\n[node]\nmetrics_port = \"auto\"\n")
    assert check_file(str(path)) == []
    s = resolve({}, {"DISTORE_CONTROL": "h:1"}, str(path))
    assert s.control().metrics_port == 9100 and s.node().metrics_port == metrics.AUTO_PORT
    path.write_text("[node]\nmetrics_port = 70000\n")
    (problem,) = check_file(str(path))
    assert "[node] metrics_port" in str(problem)


def test_learner_and_writer_stats_reach_the_registry():
    class FakeLearner:
        table = "replay"
        resampled, torn, expired, priority_updates_missing = 3, 1, 2, 0

        def __init__(self):
            self.stats = metrics.LearnerStats()

    learner = FakeLearner()
    name = metrics.track("learner", learner)
    learner.stats.fetched("mapped", 32, 32 * 100)
    learner.stats.fetched("ucx", 8, 800)
    learner.stats.gather.observe(0.003)
    got = parse(generate_latest(metrics.registry()).decode())
    lv = frozenset({("table", "replay"), ("learner", name)})
    assert got["distore_learner_fetched_bytes_total"][lv | {("path", "mapped")}] == 3200
    assert got["distore_learner_fetched_items_total"][lv | {("path", "ucx")}] == 8
    assert got["distore_learner_resampled_items_total"][lv] == 3
    assert got["distore_learner_expired_batches_total"][lv] == 2
    assert got["distore_learner_gather_seconds_count"][lv] == 1
    del learner  # tracked weakly: gone from the registry with the learner
    got = parse(generate_latest(metrics.registry()).decode())
    assert lv not in got.get("distore_learner_resampled_items_total", {})


def test_operations_guide_lists_every_metric():
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "operations.md"), encoding="utf-8") as fh:
        text = fh.read()
    missing = [name for name in metrics.catalog() if f"`{name}`" not in text]
    assert not missing, f"docs/operations.md does not describe {missing}"


def test_serve_listens_on_loopback_unless_asked():
    # /metrics names tables, nodes and hosts: not for every interface by default.
    with metrics.serve(0) as server:
        assert server.host == "127.0.0.1"
    s = resolve({"control.host": "0.0.0.0"}, {"DISTORE_CONTROL": "127.0.0.1:7700"})
    assert s.control().metrics_host == "127.0.0.1" and s.node().metrics_host == "127.0.0.1"
    s = resolve({"control.metrics_host": "0.0.0.0"}, {})
    assert s.control().metrics_host == "0.0.0.0"


def test_slow_scrapers_hold_a_bounded_number_of_threads(monkeypatch):
    monkeypatch.setattr(metrics.exposition, "SCRAPE_IO_TIMEOUT", 0.3)
    with metrics.serve(0) as server:
        before = threading.active_count()
        # Clients that connect and never send a request: three times as many
        # as may be served at once.
        idle = [socket.create_connection(("127.0.0.1", server.port))
                for _ in range(3 * getattr(metrics, "MAX_SCRAPERS", 8))]
        try:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                assert threading.active_count() - before <= getattr(metrics, "MAX_SCRAPERS", 8)
                time.sleep(0.05)
            # The silent ones time out; a real scrape is served again.
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    text = urllib.request.urlopen(server.url, timeout=2).read().decode()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "/metrics never served again"
                    time.sleep(0.1)
            assert "process_cpu_seconds_total" in text
        finally:
            for sock in idle:
                sock.close()


def test_a_taken_default_port_says_what_to_do_in_one_readable_line(caplog):
    # Two nodes on one host: the second finds the default port taken.
    import asyncio
    import logging

    from distore_ucx.metrics.exposition import serve_process

    with metrics.serve(0, "127.0.0.1") as taken:
        loop = asyncio.new_event_loop()
        try:
            with caplog.at_level(logging.WARNING):
                got = serve_process(taken.port, "127.0.0.1", loop, object(), lambda o: {}, (),
                                    "storage node", optional=True)
        finally:
            loop.close()
    assert got is None
    (line,) = [r.getMessage() for r in caplog.records if "metrics" in r.getMessage()]
    assert f"default metrics port {taken.port} on 127.0.0.1 is taken" in line
    assert "--metrics-port auto" in line and line.count("(") == 1, line
