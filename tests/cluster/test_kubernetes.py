"""cluster/kubernetes: the rendered manifests validate against the Kubernetes
schemas, offline (the schemas ship in the kubernetes-validate package)."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest

kv = pytest.importorskip("kubernetes_validate", reason="pip install '.[test]' brings it")
yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate")

from distore_ucx.config import check_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RENDER = os.path.join(ROOT, "cluster", "kubernetes", "render.py")
K8S_VERSIONS = ["1.29.0", "1.33.0"]


def _render_module():
    spec = importlib.util.spec_from_file_location("distore_k8s_render", RENDER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


render = _render_module()


def docs(**params) -> list[dict]:
    text = render.render(params)
    assert "${" not in text
    return list(yaml.safe_load_all(text))


def by_kind(documents, kind):
    return next(d for d in documents if d["kind"] == kind)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(version):
    documents = docs()
    assert {d["kind"] for d in documents} == {
        "Namespace", "ConfigMap", "Deployment", "Service", "DaemonSet", "Job"}
    for d in documents:
        kv.validate(d, version, strict=True)  # raises on any schema violation


def test_storage_nodes_use_host_network_hugepages_and_the_rdma_resource_given():
    documents = docs(RDMA_RESOURCE="rdma/hca_shared_devices_a", RDMA_COUNT="2", ARENA_GIB="16")
    for d in documents:
        kv.validate(d, K8S_VERSIONS[-1], strict=True)
    pod = by_kind(documents, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    res = pod["containers"][0]["resources"]
    for part in ("requests", "limits"):
        assert res[part]["rdma/hca_shared_devices_a"] == "2"
        assert res[part]["hugepages-2Mi"] == "16Gi"
    assert "rdma/rdma_shared_device_a" not in yaml.safe_dump(documents)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hugepages"]["emptyDir"]["medium"] == "HugePages-2Mi"
    service = by_kind(documents, "Service")
    assert service["spec"]["selector"] == by_kind(documents, "Deployment")["spec"]["selector"][
        "matchLabels"]


def test_the_configmaps_distore_toml_passes_config_check(tmp_path):
    config = by_kind(docs(NAMESPACE="rl"), "ConfigMap")
    path = tmp_path / "distore.toml"
    path.write_text(config["data"]["distore.toml"])
    token = tmp_path / "token"  # the pods' DISTORE_TOKEN_FILE, from the Secret
    token.write_text("t" * 32)
    token.chmod(0o600)
    assert check_file(str(path), {"DISTORE_TOKEN_FILE": str(token)}) == []
    assert 'address = "distore-control.rl.svc:7700"' in path.read_text()
    # Without it, the check says what the control plane would refuse.
    (problem,) = check_file(str(path))
    assert "[control] host: the control plane would listen on 0.0.0.0" in str(problem)


@pytest.mark.parametrize("breakage", [
    ("a misspelt field", lambda ds: ds["spec"]["template"]["spec"].update(hostNetwrk=True)),
    ("a port that is not a number",
     lambda ds: ds["spec"]["template"]["spec"]["containers"][0].update(
         ports=[{"containerPort": "seventy"}])),
    ("a container without a name",
     lambda ds: ds["spec"]["template"]["spec"]["containers"][0].pop("name")),
])
def test_a_broken_manifest_fails_validation(breakage):
    what, breaks = breakage
    daemonset = copy.deepcopy(by_kind(docs(), "DaemonSet"))
    breaks(daemonset)
    with pytest.raises(kv.ValidationError):
        kv.validate(daemonset, K8S_VERSIONS[-1], strict=True)


def test_unknown_parameters_are_refused():
    with pytest.raises(KeyError, match="unknown parameter 'RDMA'"):
        render.render({"RDMA": "x"})
    out = subprocess.run([sys.executable, RENDER, "--set", "NOPE"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "expected NAME=VALUE" in out.stderr
    listed = subprocess.run([sys.executable, RENDER, "--list"], capture_output=True, text=True,
                            timeout=60).stdout
    assert "RDMA_RESOURCE=rdma/rdma_shared_device_a" in listed


def test_every_process_proves_the_token_secret_which_is_required():
    """The control plane and storage nodes listen beyond loopback, which
    distore refuses without a token: each container gets DISTORE_TOKEN_FILE
    on a mounted Secret that is not optional (so is the learner)."""
    documents = docs(TOKEN_SECRET="my-secret")
    pods = {d["kind"]: d["spec"]["template"]["spec"] for d in documents
            if d["kind"] in ("Deployment", "DaemonSet", "Job")}
    assert set(pods) == {"Deployment", "DaemonSet", "Job"}
    for kind, pod in pods.items():
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert env["DISTORE_TOKEN_FILE"] == mounts["token"] + "/token", kind
        secret = volumes["token"]["secret"]
        assert secret["secretName"] == "my-secret" and not secret.get("optional"), kind
    toml = by_kind(documents, "ConfigMap")["data"]["distore.toml"]
    assert 'host = "0.0.0.0"' in toml and "insecure" not in toml


def test_control_plane_and_storage_pods_carry_prometheus_scrape_annotations():
    """Prometheus' kubernetes_sd finds both by the usual prometheus.io
    annotations, on the ports distore.toml tells the processes to serve."""
    documents = docs(CONTROL_METRICS_PORT="9100", NODE_METRICS_PORT="9101")
    toml = by_kind(documents, "ConfigMap")["data"]["distore.toml"]
    for kind, port in (("Deployment", "9100"), ("DaemonSet", "9101")):
        template = by_kind(documents, kind)["spec"]["template"]
        notes = template["metadata"]["annotations"]
        assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": port,
                         "prometheus.io/path": "/metrics"}, kind
        (container,) = template["spec"]["containers"]
        assert {"name": "metrics", "containerPort": int(port), "protocol": "TCP"} in \
            container["ports"], kind
        assert f"metrics_port = {port}" in toml
