"""The emulated Kubernetes API server, driven by the real kubectl (/usr/bin/kubectl) and by raw HTTP: the
semantics the operator and kubectl depend on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
SAMPLE = ROOT / "crds" / "samples" / "mistral-7b-tgi-inf2.yaml"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"

pytestmark = pytest.mark.skipif(not Path(KUBECTL).exists(), reason="kubectl is not installed")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    state = tmp_path_factory.mktemp("apiserver")
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "neuronfleet.localcluster.apiserver",
         "--kubeconfig", str(state / "kubeconfig"), "--ready-file", str(state / "url")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for _ in range(200):
        if (state / "url").exists() and (state / "url").read_text():
            break
        if proc.poll() is not None:
            pytest.fail("the API server exited: " + proc.stdout.read())
        time.sleep(0.05)
    yield {"url": (state / "url").read_text(), "state": state}
    proc.terminate()
    proc.wait(timeout=10)


def kubectl(api, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        KUBECTL,
        "--kubeconfig",
        str(api["state"] / "kubeconfig"),
        "--cache-dir",
        str(api["state"] / "cache"),
    ]
    run = subprocess.run([*cmd, *args], input=stdin, capture_output=True, text=True, timeout=60)
    if check and run.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {run.stderr}")
    return run


def http(api, method: str, path: str, body=None, content_type: str = "application/json"):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        api["url"] + path, data=data, method=method, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sample(namespace: str = "default", **spec_changes) -> str:
    obj = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"]["namespace"] = namespace
    obj["spec"].update(spec_changes)
    return yaml.safe_dump(obj)


@pytest.fixture(scope="module")
def with_crd(api):
    kubectl(api, "apply", "-f", str(CRD))
    return api


def test_kubectl_applies_the_crd_and_a_sample_and_shows_the_printer_columns(with_crd):
    api = with_crd
    out = kubectl(api, "apply", "-f", "-", stdin=sample()).stdout
    assert "neuronmodel.neuronfleet.dev/mistral-7b created" in out
    table = kubectl(api, "get", "neuronmodels").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "ENGINE", "INSTANCE", "TP", "READY", "ENDPOINT", "AGE"]
    assert table[1].split()[:4] == ["mistral-7b", "tgi", "inf2.xlarge", "2"]
    obj = json.loads(kubectl(api, "get", "nm", "mistral-7b", "-o", "json").stdout)
    meta = obj["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"] and meta["generation"] == 1
    assert obj["spec"]["serving"]["unified"]["replicas"] == 1  # defaults from the schema
    assert obj["spec"]["compile"]["backoffLimit"] == 2
    assert "configured" not in kubectl(api, "apply", "-f", "-", stdin=sample()).stdout  # unchanged
    kubectl(api, "delete", "nm", "mistral-7b")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": "llamacpp"}, "spec.engine: Invalid value: 'llamacpp' is not one of"),
        ({"neuron": {"instanceType": "inf2.xlarge", "tensorParallel": 0}}, "0 is less than the minimum of 1"),
        (
            {"neuron": {"instanceType": "inf2.xlarge", "maxInputLength": 5000, "sequenceLength": 4096}},
            "neuron.maxInputLength must be below neuron.sequenceLength",
        ),
        (
            {"serving": {"mode": "disaggregated"}},
            "mode disaggregated needs serving.prefill and serving.decode",
        ),
        ({"neuron": {"instanceType": "inf2.xlarge", "speed": "fast"}}, 'unknown field "spec.neuron.speed"'),
    ],
)
def test_a_bad_manifest_is_refused_by_the_schema_like_a_real_api_server(with_crd, change, message):
    run = kubectl(with_crd, "apply", "-f", "-", stdin=sample(**change), check=False)
    assert run.returncode != 0
    assert message in run.stderr, run.stderr
    assert "mistral-7b" not in kubectl(with_crd, "get", "nm").stdout


def test_resource_versions_conflicts_generation_and_the_status_subresource(with_crd):
    api = with_crd
    kubectl(api, "apply", "-f", "-", stdin=sample())
    path = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels/mistral-7b"
    _, obj = http(api, "GET", path)
    stale = json.loads(json.dumps(obj))
    obj["spec"]["neuron"]["batchSize"] = 8
    code, updated = http(api, "PUT", path, obj)
    assert code == 200 and updated["metadata"]["generation"] == 2
    assert int(updated["metadata"]["resourceVersion"]) > int(stale["metadata"]["resourceVersion"])
    stale["spec"]["neuron"]["batchSize"] = 2
    code, status = http(api, "PUT", path, stale)
    assert (
        code == 409 and status["reason"] == "Conflict" and "the object has been modified" in status["message"]
    )
    # status through /status only, and it does not bump the generation; spec through the main resource only
    both = {"status": {"phase": "Ready"}, "spec": {"engine": "vllm"}}
    code, after = http(api, "PATCH", path + "/status", both, "application/merge-patch+json")
    assert code == 200 and after["status"]["phase"] == "Ready" and after["spec"]["engine"] == "tgi"
    assert after["metadata"]["generation"] == 2
    code, after = http(api, "PATCH", path, {"status": {"phase": "Failed"}}, "application/merge-patch+json")
    assert code == 200 and after["status"]["phase"] == "Ready"
    code, after = http(api, "PATCH", path, [{"op": "replace", "path": "/spec/neuron/batchSize", "value": 2}],
                       "application/json-patch+json")  # fmt: skip
    assert code == 200 and after["spec"]["neuron"]["batchSize"] == 2 and after["metadata"]["generation"] == 3
    kubectl(api, "delete", "nm", "mistral-7b")


def test_owner_references_are_garbage_collected_and_finalizers_hold_deletion(with_crd):
    api = with_crd
    kubectl(api, "apply", "-f", "-", stdin=sample())
    owner = json.loads(kubectl(api, "get", "nm", "mistral-7b", "-o", "json").stdout)
    ref = {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel", "name": "mistral-7b",
           "uid": owner["metadata"]["uid"], "controller": True}  # fmt: skip
    for name in ("child-a", "child-b"):
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": name, "labels": {"app": name}, "ownerReferences": [ref]}}  # fmt: skip
        kubectl(api, "apply", "-f", "-", stdin=json.dumps(cm))
    assert kubectl(api, "get", "cm", "-l", "app in (child-a)", "-o", "name").stdout.split() == [
        "configmap/child-a"
    ]
    assert kubectl(api, "get", "cm", "-l", "app!=child-a", "-o", "name").stdout.split() == [
        "configmap/child-b"
    ]
    kubectl(
        api, "patch", "nm", "mistral-7b", "--type", "merge", "-p", '{"metadata":{"finalizers":["x/hold"]}}'
    )
    kubectl(api, "delete", "nm", "mistral-7b", "--wait=false")
    held = json.loads(kubectl(api, "get", "nm", "mistral-7b", "-o", "json").stdout)
    assert held["metadata"]["deletionTimestamp"]
    assert len(kubectl(api, "get", "cm", "-o", "name").stdout.split()) == 2  # the owner still exists
    kubectl(api, "patch", "nm", "mistral-7b", "--type", "merge", "-p", '{"metadata":{"finalizers":null}}')
    assert "mistral-7b" not in kubectl(api, "get", "nm").stdout
    assert kubectl(api, "get", "cm", "-o", "name").stdout.split() == []


def test_watch_streams_changes_after_a_resource_version(with_crd):
    api = with_crd
    _, listing = http(api, "GET", "/api/v1/namespaces/default/configmaps")
    since = listing["metadata"]["resourceVersion"]
    kubectl(
        api,
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w"}}),
    )
    kubectl(api, "delete", "cm", "w")
    query = f"watch=true&resourceVersion={since}&timeoutSeconds=1"
    url = f"{api['url']}/api/v1/namespaces/default/configmaps?{query}"
    with urllib.request.urlopen(url, timeout=10) as r:
        events = [json.loads(line) for line in r.read().splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w"),
        ("DELETED", "w"),
    ]


def test_namespaces_must_exist_and_typed_creates_get_a_clear_refusal(with_crd):
    run = kubectl(with_crd, "apply", "-f", "-", stdin=sample(namespace="nowhere"), check=False)
    assert run.returncode != 0 and 'namespaces "nowhere" not found' in run.stderr
    run = kubectl(with_crd, "create", "namespace", "typed", check=False)
    assert run.returncode != 0 and "kubectl apply -f FILE" in run.stderr
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "typed"}}
    kubectl(with_crd, "apply", "-f", "-", stdin=json.dumps(ns))
    assert "typed" in kubectl(with_crd, "get", "ns").stdout
