"""cluster/grafana: the dashboard loads, every query names metrics we export
(with labels they carry), and every query is valid PromQL (promtool)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from distore_ucx.metrics import catalog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "cluster", "grafana", "distore-dashboard.json")
# Labels our metrics carry, plus those Prometheus adds (job, instance) and le.
LABELS = {"table", "node", "op", "path", "learner", "writer", "state", "change", "le",
          "job", "instance"}
METRIC = re.compile(r"\b((?:distore|process)_[a-z0-9_]+)")


def _queries() -> list[tuple[str, str]]:
    with open(DASHBOARD) as fh:
        dash = json.load(fh)
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _exported(name: str, cat: dict) -> bool:
    if name in cat:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and cat.get(base, ("",))[0] == "histogram":
            return True
    return False


def test_every_query_names_metrics_we_export():
    cat = catalog()
    queries = _queries()
    assert len(queries) >= 20
    used = set()
    for title, expr in queries:
        names = METRIC.findall(expr)
        assert names, f"panel {title!r}: {expr!r} names no distore metric"
        for name in names:
            assert _exported(name, cat), f"panel {title!r}: {name} is not exported"
            used.add(name)
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in group.split(","):
                assert label.strip() in LABELS, f"panel {title!r}: no label {label.strip()!r}"
    # The four things the dashboard is for.
    text = " ".join(e for _, e in queries)
    for needed in ("distore_table_inserts_total", "histogram_quantile",
                   "distore_node_arena_used_bytes", "distore_table_rate_limiter_holds_total"):
        assert needed in text


def test_every_query_is_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (Debian's prometheus package: apt-get install prometheus)")
    rules = []
    for i, (_, expr) in enumerate(_queries()):
        expr = (expr.replace("$__rate_interval", "1m").replace("$table", ".*")
                .replace("$job", ".*"))
        rules.append({"record": f"distore:dashboard_query:{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
