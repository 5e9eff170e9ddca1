"""The emulated Kubernetes API server, driven by the real kubectl (/usr/bin/kubectl) and by raw HTTP: the
semantics the operator and kubectl depend on, and what closes it to other users of the machine and to web
pages (a bearer token, the API's media types, its own Host)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from http.client import HTTPSConnection

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, ApiServer, Kubectl

from neuronfleet.localcluster.guard import set_token
from neuronfleet.localcluster.tls import Access

CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
SAMPLE = ROOT / "crds" / "samples" / "llama-3.2-3b-tgi-inf2.yaml"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiServer(tmp_path_factory.mktemp("apiserver"))
    yield server
    server.stop()


def http(api, method: str, path: str, body=None, content_type: str = "application/json", headers=None):
    """(status, JSON answer) of a request as the admin (`headers` instead of the admin's token, if given)."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    if headers is None:
        headers = api.headers(content_type)
    req = urllib.request.Request(api.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT, context=api.context) as r:
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
    api.kubectl("apply", "-f", str(CRD))
    return api


def test_kubectl_applies_the_crd_and_a_sample_and_shows_the_printer_columns(with_crd):
    api = with_crd
    out = api.kubectl("apply", "-f", "-", stdin=sample()).stdout
    assert "neuronmodel.neuronfleet.dev/llama-3-2-3b created" in out
    table = api.kubectl("get", "neuronmodels").stdout.splitlines()
    assert table[0].split() == [
        "NAME",
        "PHASE",
        "ENGINE",
        "INSTANCE",
        "TP",
        "READY",
        "PROGRESS",
        "ENDPOINT",
        "AGE",
    ]
    assert table[1].split()[:4] == ["llama-3-2-3b", "tgi", "inf2.xlarge", "2"]
    obj = json.loads(api.kubectl("get", "nm", "llama-3-2-3b", "-o", "json").stdout)
    meta = obj["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"] and meta["generation"] == 1
    assert obj["spec"]["serving"]["unified"]["replicas"] == 1  # defaults from the schema
    assert obj["spec"]["compile"]["backoffLimit"] == 2
    assert "configured" not in api.kubectl("apply", "-f", "-", stdin=sample()).stdout  # unchanged
    api.kubectl("delete", "nm", "llama-3-2-3b")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine": "llamacpp"}, "spec.engine: Invalid value: 'llamacpp' is not one of"),
        ({"neuron": {"instanceType": "inf2.xlarge", "tensorParallel": 0}}, "0 is less than the minimum of 1"),
        (
            {"neuron": {"instanceType": "inf2.xlarge", "maxInputLength": 5000, "sequenceLength": 4096}},
            "neuron.maxInputLength 5000 must be below neuron.sequenceLength 4096 (room is needed to "
            "generate)",
        ),
        (
            {"serving": {"mode": "disaggregated"}},
            "mode disaggregated needs serving.prefill and serving.decode",
        ),
        (  # the real server's words (apiextensions-apiserver's strict decoding, kubectl apply's default)
            {"neuron": {"instanceType": "inf2.xlarge", "speed": "fast"}},
            'Error from server (BadRequest): error when creating "STDIN": NeuronModel in version "v1alpha1" '
            'cannot be handled as a NeuronModel: strict decoding error: unknown field "spec.neuron.speed"',
        ),
    ],
)
def test_a_bad_manifest_is_refused_by_the_schema_like_a_real_api_server(with_crd, change, message):
    run = with_crd.kubectl("apply", "-f", "-", stdin=sample(**change), check=False)
    assert run.returncode != 0
    assert message in run.stderr, run.stderr
    assert "llama-3-2-3b" not in with_crd.kubectl("get", "nm").stdout


def test_resource_versions_conflicts_generation_and_the_status_subresource(with_crd):
    api = with_crd
    api.kubectl("apply", "-f", "-", stdin=sample())
    path = "/apis/neuronfleet.dev/v1alpha1/namespaces/default/neuronmodels/llama-3-2-3b"
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
    api.kubectl("delete", "nm", "llama-3-2-3b")


def test_owner_references_are_garbage_collected_and_finalizers_hold_deletion(with_crd):
    api = with_crd
    api.kubectl("apply", "-f", "-", stdin=sample())
    owner = json.loads(api.kubectl("get", "nm", "llama-3-2-3b", "-o", "json").stdout)
    ref = {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel", "name": "llama-3-2-3b",
           "uid": owner["metadata"]["uid"], "controller": True}  # fmt: skip
    for name in ("child-a", "child-b"):
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": name, "labels": {"app": name}, "ownerReferences": [ref]}}  # fmt: skip
        api.kubectl("apply", "-f", "-", stdin=json.dumps(cm))
    assert api.kubectl("get", "cm", "-l", "app in (child-a)", "-o", "name").stdout.split() == [
        "configmap/child-a"
    ]
    assert api.kubectl("get", "cm", "-l", "app!=child-a", "-o", "name").stdout.split() == [
        "configmap/child-b"
    ]
    api.kubectl(
        "patch", "nm", "llama-3-2-3b", "--type", "merge", "-p", '{"metadata":{"finalizers":["x/hold"]}}'
    )
    api.kubectl("delete", "nm", "llama-3-2-3b", "--wait=false")
    held = json.loads(api.kubectl("get", "nm", "llama-3-2-3b", "-o", "json").stdout)
    assert held["metadata"]["deletionTimestamp"]
    assert len(api.kubectl("get", "cm", "-o", "name").stdout.split()) == 2  # the owner still exists
    api.kubectl("patch", "nm", "llama-3-2-3b", "--type", "merge", "-p", '{"metadata":{"finalizers":null}}')
    assert "llama-3-2-3b" not in api.kubectl("get", "nm").stdout
    assert api.kubectl("get", "cm", "-o", "name").stdout.split() == []


def test_watch_streams_changes_after_a_resource_version(with_crd):
    api = with_crd
    _, listing = http(api, "GET", "/api/v1/namespaces/default/configmaps")
    since = listing["metadata"]["resourceVersion"]
    api.kubectl(
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w"}}),
    )
    api.kubectl("delete", "cm", "w")
    query = f"watch=true&resourceVersion={since}&timeoutSeconds=1"
    url = f"{api.url}/api/v1/namespaces/default/configmaps?{query}"
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=api.headers()), timeout=HTTP_TIMEOUT, context=api.context
    ) as r:
        events = [json.loads(line) for line in r.read().splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "w"),
        ("DELETED", "w"),
    ]


def test_namespaces_must_exist_and_unreadable_typed_creates_get_a_clear_refusal(with_crd):
    run = with_crd.kubectl("apply", "-f", "-", stdin=sample(namespace="nowhere"), check=False)
    assert run.returncode != 0 and 'namespaces "nowhere" not found' in run.stderr
    # typed creates send protobuf: namespaces, secrets, configmaps, services, deployments and jobs are read
    # (test_kubectl_create.py);
    # a kind whose protobuf form this server does not read is refused, saying what to do instead
    run = with_crd.kubectl("create", "pdb", "typed", "--selector=app=x", "--min-available=1", check=False)
    assert run.returncode != 0 and "kubectl apply -f FILE" in run.stderr, run.stderr


def test_a_watch_from_a_resource_version_older_than_the_history_gets_410_expired(tmp_path):
    """The history of changes is bounded (--watch-history events a kind, dropped in blocks): a watch from
    before it ends at once with an ERROR event holding a 410 Expired Status, as a real API server's watch
    cache answers, so clients list again; a recent resourceVersion still resumes."""
    history = 20
    api = ApiServer(tmp_path, "--watch-history", str(history))
    try:
        path = "/api/v1/namespaces/default/configmaps"
        _, listing = http(api, "GET", path)
        first = int(listing["metadata"]["resourceVersion"])
        code, _ = http(api, "POST", path, {"metadata": {"name": "c"}, "data": {"n": "0"}})
        assert code == 201
        for n in range(2 * history + 1):  # enough changes to drop the oldest block
            code, _ = http(
                api, "PATCH", path + "/c", {"data": {"n": str(n + 1)}}, "application/merge-patch+json"
            )
            assert code == 200
        url = f"{api.url}{path}?watch=true&resourceVersion={first}&timeoutSeconds=60"
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=api.headers()), timeout=HTTP_TIMEOUT, context=api.context
        ) as r:
            assert r.status == 200
            events = [json.loads(line) for line in r.read().splitlines() if line.strip()]
        assert [e["type"] for e in events] == ["ERROR"]
        status = events[0]["object"]
        assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
        assert status["message"].startswith(f"too old resource version: {first} (")
        _, now = http(api, "GET", path)
        recent = int(now["metadata"]["resourceVersion"]) - 1
        url = f"{api.url}{path}?watch=true&resourceVersion={recent}&timeoutSeconds=1"
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=api.headers()), timeout=HTTP_TIMEOUT, context=api.context
        ) as r:
            events = [json.loads(line) for line in r.read().splitlines() if line.strip()]
        assert [(e["type"], e["object"]["data"]["n"]) for e in events] == [("MODIFIED", str(2 * history + 1))]
    finally:
        api.stop()


def test_the_server_stops_at_once_on_sigterm_with_watches_open(tmp_path):
    """Open watches (30 minutes long) end cleanly when the server is told to stop; it exits 0."""
    import signal

    api = ApiServer(tmp_path)
    host, port = api.url.removeprefix("https://").split(":")
    streams = []
    for path in ("/api/v1/pods", "/api/v1/namespaces/default/configmaps", "/apis/apps/v1/deployments"):
        conn = HTTPSConnection(host, int(port), timeout=HTTP_TIMEOUT, context=api.context)
        conn.request("GET", f"{path}?watch=true&timeoutSeconds=1800", headers=api.headers())
        response = conn.getresponse()
        assert response.status == 200
        streams.append((conn, response))
    http(api, "POST", "/api/v1/namespaces/default/configmaps", {"metadata": {"name": "seen"}})
    for _, response in streams[1:2]:
        assert json.loads(response.readline())["object"]["metadata"]["name"] == "seen"
    api.process.signal(signal.SIGTERM)
    assert api.process.wait() == 0, api.process.output()
    for conn, response in streams:
        # each stream ended with its final chunk: the server closed the watch (a watch cancelled after the
        # grace period, or a server killed, cuts the stream off: IncompleteRead)
        assert response.read() == b""
        conn.close()


@pytest.mark.parametrize("path", sorted((ROOT / "crds" / "samples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_sample_as_the_api_server_stores_it_is_accepted_by_the_operators_validation(with_crd, path):
    """What the operator reads is the object after the API server applied the CRD's defaults: a default
    there that fits no engine (a fixed prompt limit, a fixed KV transport) would refuse a sample that
    `neuronfleet validate` accepts on the file."""
    from neuronfleet.operator import validation

    obj = yaml.safe_load(path.read_text())
    obj["metadata"]["namespace"] = "default"
    with_crd.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    stored = json.loads(with_crd.kubectl("get", "nm", obj["metadata"]["name"], "-o", "json").stdout)
    report = validation.check(stored)
    assert report.ok, report.errors
    with_crd.kubectl("delete", "nm", obj["metadata"]["name"])


def test_kubectl_get_all_lists_the_all_category_and_sort_by_sorts(api):
    """`kubectl get all` (the kinds a real server puts in the `all` category: pods, services, deployments,
    replicasets, jobs; not ConfigMaps, nor NeuronModels, which `delete all --all` would otherwise delete) and
    `kubectl get events --sort-by=.lastTimestamp` (kubectl asks for the rows' whole objects to sort them)."""
    docs = [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "all-ns"},
         "spec": {"ports": [{"port": 80}], "selector": {"app": "web"}}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "namespace": "all-ns"},
         "data": {"a": "1"}},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "once", "namespace": "all-ns"},
         "spec": {"template": {"spec": {"restartPolicy": "Never",
                                        "containers": [{"name": "c", "image": "busybox"}]}}}},
    ]  # fmt: skip
    for i, (name, when) in enumerate(
        [("b-late", "12:00:30"), ("a-early", "12:00:10"), ("c-middle", "12:00:20")]
    ):
        docs.append({"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "all-ns"},
                     "involvedObject": {"kind": "Job", "name": "once", "namespace": "all-ns"},
                     "reason": f"R{i}", "message": name, "type": "Normal",
                     "lastTimestamp": f"2026-12-04T{when}Z",
                     "firstTimestamp": f"2026-12-04T{when}Z"})  # fmt: skip
    api.kubectl("create", "namespace", "all-ns")
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))
    listed = set(api.kubectl("get", "all", "-n", "all-ns", "-o", "name").stdout.split())
    assert {"service/web", "job.batch/once"} <= listed and not any("configmap" in n for n in listed), listed
    rows = api.kubectl("get", "events", "-n", "all-ns", "--sort-by=.lastTimestamp").stdout.splitlines()
    messages = [row.split()[-1] for row in rows[1:]]
    assert messages == ["a-early", "c-middle", "b-late"], rows


# ---- closed to other users of the machine and to web pages (localcluster/guard.py) ----

JOBS = "/apis/batch/v1/namespaces/default/jobs"
INTRUDER = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "intruder"},
            "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [
                {"name": "c", "image": "busybox", "command": ["touch", "/tmp/intruded"]}]}}}}  # fmt: skip


def raw(api, method: str, path: str, headers: dict, body: bytes | None = None) -> tuple[int, bytes]:
    """A request with exactly these headers (Host too, where given; no Content-Type unless given)."""
    host, port = api.url.removeprefix("https://").split(":")
    conn = HTTPSConnection(host, int(port), timeout=HTTP_TIMEOUT, context=api.context)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def status_of(answer: bytes) -> tuple[str, int, str]:
    status = json.loads(answer)
    assert status["kind"] == "Status" and status["status"] == "Failure", status
    return status["reason"], status["code"], status["message"]


def job_names(api) -> list[str]:
    return [j["metadata"]["name"] for j in api.kubectl.get("jobs", "-A")["items"]]


def test_without_the_kubeconfigs_token_a_request_is_refused_401_and_changes_nothing(api):
    """Any user of the machine reaches the port: without the kubeconfig's token (none, another scheme, a
    wrong or empty one, one that is not UTF-8), a Job that the kubelet would run as the user who started the
    server is refused 401 Unauthorized, the Status kube-apiserver answers, and nothing is created. Only what a
    real cluster opens to system:unauthenticated answers without a token; a wrong one is refused there too."""
    body = json.dumps(INTRUDER).encode()
    for authorization in (None, "Bearer wrong", "Basic YWRtaW46YWRtaW4=", f"Bearer {api.token}x", "Bearer ",
                          "Bearer caf\u00e9".encode()):  # fmt: skip
        headers = {"Content-Type": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        code, answer = raw(api, "POST", JOBS, headers, body)
        assert code == 401 and status_of(answer)[:2] == ("Unauthorized", 401), (authorization, answer)
    code, answer = raw(api, "GET", "/api/v1/secrets", {})
    assert code == 401 and "bearer token" in status_of(answer)[2]
    assert "intruder" not in job_names(api)
    for path in ("/version", "/healthz", "/livez", "/readyz"):
        assert raw(api, "GET", path, {})[0] == 200, path
    assert raw(api, "GET", "/version", {"Authorization": "Bearer wrong"})[0] == 401


def test_a_body_not_in_the_apis_media_types_is_refused_415_even_with_the_token(api):
    """A web page can have the browser post text/plain, a form or multipart to 127.0.0.1 without a CORS
    preflight: such a body is refused 415 UnsupportedMediaType naming the types accepted, with a valid token
    too, and nothing is created. A PATCH takes the patch types only."""
    body = json.dumps(INTRUDER).encode()
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x"):  # fmt: skip
        code, answer = raw(api, "POST", JOBS, api.headers(content_type), body)
        reason, _, message = status_of(answer)
        assert (code, reason) == (415, "UnsupportedMediaType"), (content_type, answer)
        assert "application/json, application/yaml" in message
    assert "intruder" not in job_names(api)
    configmaps = "/api/v1/namespaces/default/configmaps"
    code, _ = raw(api, "POST", configmaps, api.headers("application/yaml"), b"metadata: {name: typed}\n")
    assert code == 201  # YAML is one of the API's types
    patch = json.dumps({"data": {"a": "1"}}).encode()
    code, answer = raw(api, "PATCH", f"{configmaps}/typed", api.headers("application/json"), patch)
    assert code == 415 and "application/merge-patch+json" in status_of(answer)[2]
    code, _ = raw(api, "PATCH", f"{configmaps}/typed", api.headers("application/merge-patch+json"), patch)
    assert code == 200
    api.kubectl("delete", "cm", "typed")


def test_a_host_header_other_than_the_servers_own_is_refused(api):
    """DNS rebinding: a page whose own name its author re-points at 127.0.0.1 reaches the port with that name
    in Host. Any Host but the server's own names with its port is refused 421, a valid token or not."""
    port = int(api.url.rsplit(":", 1)[1])
    for host in (f"rebound.example:{port}", "rebound.example", f"127.0.0.1:{port + 1}",
                 f"localhost.rebound.example:{port}"):  # fmt: skip
        code, answer = raw(api, "POST", JOBS, {**api.headers(), "Host": host}, json.dumps(INTRUDER).encode())
        reason, _, message = status_of(answer)
        assert (code, reason) == (421, "MisdirectedRequest") and host in message, (host, answer)
    assert "intruder" not in job_names(api)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LocalHost:{port}", f"[::1]:{port}"):
        assert raw(api, "GET", "/api/v1/namespaces", {**api.headers(), "Host": host})[0] == 200, host


def test_a_token_rotated_while_the_server_runs_is_refused_from_the_next_request_on(api):
    """The token file is read again when it changes: a user's token replaced in it is refused from the next
    request on (on a connection kept alive since before, too), the new one and other users' tokens are
    accepted, and kubectl with the old kubeconfig says Unauthorized."""
    kubeconfig = api.kubeconfig_for("rotating")
    old = Access.read(kubeconfig).token
    host, port = api.url.removeprefix("https://").split(":")
    conn = HTTPSConnection(
        host, int(port), timeout=HTTP_TIMEOUT, context=api.context
    )  # one for every request

    def answer(token: str) -> int:
        conn.request("GET", "/api/v1/namespaces", headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        response.read()
        return response.status

    try:
        kubectl = Kubectl(kubeconfig, api.state / "cache-rotating")
        assert answer(old) == 200 and "default" in kubectl("get", "namespaces", "-o", "name").stdout
        new = set_token(api.tokens, "rotating")
        assert (answer(old), answer(new), answer(api.token)) == (401, 200, 200)
        run = kubectl("get", "namespaces", check=False)
        assert run.returncode != 0 and "Unauthorized" in run.stderr, run.stderr
    finally:
        conn.close()
