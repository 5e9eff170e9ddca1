"""Typed `kubectl create` commands (which send protobuf), `kubectl scale`, `kubectl logs job/NAME` and names a
real API server refuses, against the emulated API server, checked by what kubectl prints."""

from __future__ import annotations

import base64
import json

import pytest
from support import ApiServer


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiServer(tmp_path_factory.mktemp("kubectl-create"))
    yield server
    server.stop()


def test_create_namespace_secret_and_configmap(api):
    assert api.kubectl("create", "namespace", "team-a").stdout == "namespace/team-a created\n"
    out = api.kubectl(
        "create", "secret", "generic", "hf", "-n", "team-a", "--from-literal=HF_TOKEN=hf_abc",
        "--from-literal=empty=",
    ).stdout  # fmt: skip
    assert out == "secret/hf created\n"
    out = api.kubectl(
        "create", "configmap", "settings", "-n", "team-a", "--from-literal=mode=unified", "--from-literal=n=2"
    ).stdout
    assert out == "configmap/settings created\n"
    secret = json.loads(api.kubectl("get", "secret", "hf", "-n", "team-a", "-o", "json").stdout)
    assert secret["type"] == "Opaque"  # defaulted, as a real server does
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {
        "HF_TOKEN": "hf_abc",
        "empty": "",
    }
    config = json.loads(api.kubectl("get", "cm", "settings", "-n", "team-a", "-o", "json").stdout)
    assert config["data"] == {"mode": "unified", "n": "2"} and config["metadata"]["namespace"] == "team-a"
    ns = api.kubectl("get", "ns", "team-a").stdout.split()
    assert ns[:5] == ["NAME", "STATUS", "AGE", "team-a", "Active"]
    secrets = api.kubectl("get", "secrets", "-n", "team-a").stdout.split()
    assert secrets[:7] == ["NAME", "TYPE", "DATA", "AGE", "hf", "Opaque", "2"]
    configmaps = api.kubectl("get", "cm", "-n", "team-a").stdout.split()
    assert configmaps[:5] == ["NAME", "DATA", "AGE", "settings", "2"]
    run = api.kubectl("create", "namespace", "team-a", check=False)
    assert run.returncode != 0 and 'namespaces "team-a" already exists' in run.stderr
    api.kubectl("create", "secret", "docker-registry", "pull", "-n", "team-a", "--docker-server=r.example",
                "--docker-username=u", "--docker-password=p")  # fmt: skip
    assert "kubernetes.io/dockerconfigjson" in api.kubectl("get", "secret", "pull", "-n", "team-a").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("create", "namespace", "S-Bad_Name"),
            'The Namespace "S-Bad_Name" is invalid: metadata.name: Invalid value: "S-Bad_Name": a lowercase '
            "RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
            "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')",
        ),
        (
            ("create", "configmap", "S-Bad_Name"),
            'ConfigMap "S-Bad_Name" is invalid: metadata.name: Invalid value: "S-Bad_Name": a lowercase '
            "RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
            "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')",
        ),
    ],
)
def test_names_a_real_api_server_refuses_are_refused_with_its_message(api, args, message):
    run = api.kubectl(*args, check=False)
    assert run.returncode != 0 and message in run.stderr, run.stderr


def test_a_service_name_must_be_a_dns_1035_label_and_a_custom_resource_a_subdomain(api):
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "1-model"},
           "spec": {"ports": [{"port": 80}]}}  # fmt: skip
    run = api.kubectl("apply", "-f", "-", stdin=json.dumps(svc), check=False)
    assert run.returncode != 0, run.stdout
    assert 'Service "1-model" is invalid: metadata.name: Invalid value: "1-model": a DNS-1035 label must' in (
        run.stderr
    )
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x" * 254}}
    run = api.kubectl("apply", "-f", "-", stdin=json.dumps(cm), check=False)
    assert run.returncode != 0 and "must be no more than 253 characters" in run.stderr, run.stderr


def test_scale_a_deployment_through_the_scale_subresource(api):
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
           "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                    "template": {"metadata": {"labels": {"app": "web"}},
                                 "spec": {"containers": [{"name": "c", "image": "x"}]}}}}  # fmt: skip
    api.kubectl("apply", "-f", "-", stdin=json.dumps(dep))
    assert api.kubectl("scale", "deployment", "web", "--replicas=3").stdout == "deployment.apps/web scaled\n"
    assert api.kubectl("get", "deploy", "web", "-o", "jsonpath={.spec.replicas}").stdout == "3"
    scale = json.loads(
        api.kubectl("get", "--raw", "/apis/apps/v1/namespaces/default/deployments/web/scale").stdout
    )
    assert (scale["kind"], scale["apiVersion"], scale["spec"], scale["status"]["selector"]) == (
        "Scale", "autoscaling/v1", {"replicas": 3}, "app=web",
    )  # fmt: skip
    # --current-replicas is a precondition kubectl checks against the Scale it reads
    run = api.kubectl("scale", "deployment", "web", "--current-replicas=2", "--replicas=5", check=False)
    assert run.returncode != 0 and "Expected replicas to be 2, was 3" in run.stderr, run.stderr
    patch = json.dumps({"spec": {"replicas": -1}})
    run = api.kubectl("patch", "deployment", "web", "--subresource", "scale", "-p", patch, check=False)
    assert run.returncode != 0 and "spec.replicas: Invalid value: -1" in run.stderr, run.stderr
    patch = json.dumps({"spec": {"replicas": 2}})
    out = api.kubectl(
        "patch", "deployment", "web", "--subresource", "scale", "-p", patch, "-o", "json"
    ).stdout
    assert json.loads(out)["kind"] == "Scale"  # a patch of /scale answers with the Scale
    api.kubectl("delete", "deployment", "web")


def test_logs_of_a_job_go_to_the_jobs_pod(api):
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "m-compile"},
           "spec": {"template": {"metadata": {"labels": {"app": "m"}},
                                 "spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "x"}]}}}}  # fmt: skip
    api.kubectl("apply", "-f", "-", stdin=json.dumps(job))
    created = json.loads(api.kubectl("get", "job", "m-compile", "-o", "json").stdout)
    uid = created["metadata"]["uid"]
    assert created["spec"]["selector"] == {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    assert created["spec"]["template"]["metadata"]["labels"] == {
        "app": "m", "batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": "m-compile",
        "controller-uid": uid, "job-name": "m-compile",
    }  # fmt: skip
    # a serving pod that shares the template's own labels, and the Job's pod (created, as the Job controller
    # does, from the template); `kubectl logs job/NAME` must pick the latter
    for name, labels in (
        ("m-unified-1", {"app": "m"}),
        ("m-compile-x", created["spec"]["template"]["metadata"]["labels"]),
    ):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
               "spec": {"containers": [{"name": "c", "image": "x"}]}}  # fmt: skip
        api.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    run = api.kubectl("logs", "job/m-compile", check=False)  # no kubelet here: the log is missing, but whose
    assert "m-compile-x" in run.stderr and "m-unified-1" not in run.stderr, run.stderr


def test_labels_a_real_api_server_refuses_are_refused_and_so_is_a_job_named_past_63_characters(api):
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {"a": "bad value"}}}
    run = api.kubectl("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert run.returncode != 0
    assert (
        'The ConfigMap "x" is invalid: metadata.labels: Invalid value: "bad value": a valid label must'
        in (run.stderr)
    )
    # the Job's pods carry its name in their job-name label, whose value may hold 63 characters at most
    name = "m" * 62 + "-compile-0123456789abcdef"
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
           "spec": {"template": {"spec": {"restartPolicy": "Never",
                                          "containers": [{"name": "c", "image": "x"}]}}}}  # fmt: skip
    run = api.kubectl("apply", "-f", "-", stdin=json.dumps(job), check=False)
    assert run.returncode != 0
    assert f'spec.template.labels: Invalid value: "{name}": must be no more than 63 characters' in run.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("deployment", "web", "--image=nginx", "--replicas=2", "--port=8080", "--", "/bin/server", "--flag"),
        ("service", "clusterip", "svc", "--tcp=80:8080", "--tcp=53:dns"),
        ("service", "nodeport", "np", "--tcp=80:8080", "--node-port=30080"),
        ("job", "once", "--image=busybox", "--", "echo", "hi"),
    ],
)
def test_typed_creates_store_what_kubectl_sends(api, args):
    """What kubectl sends in protobuf is stored as the object kubectl itself renders with --dry-run=client
    (plus the server's own fields and defaults)."""
    if "--" in args:
        cut = args.index("--")
        options, command = args[:cut], args[cut:]
    else:
        options, command = args, ()
    meant = json.loads(api.kubectl("create", *options, "--dry-run=client", "-o", "json", *command).stdout)
    api.kubectl("create", *options, *command)
    name = meant["metadata"]["name"]
    stored = json.loads(api.kubectl("get", meant["kind"].lower(), name, "-o", "json").stdout)

    def contained(want, got, path="") -> None:
        if isinstance(want, dict):
            for key, value in want.items():
                if key == "creationTimestamp" and value is None:
                    continue  # kubectl renders the unset time as null; the server sets it
                assert key in got, f"{path}.{key} lost"
                contained(value, got[key], f"{path}.{key}")
        else:
            assert want == got, f"{path}: {want!r} sent, {got!r} stored"

    contained({k: v for k, v in meant.items() if k != "status"}, stored)
    api.kubectl("delete", meant["kind"].lower(), name)


def test_the_namespaces_a_cluster_starts_with_round_trip_through_kubectl_apply(api):
    """`kubectl get ns default -o yaml | kubectl apply -f -` works on a real cluster: the object carries its
    apiVersion and kind like any other."""
    listed = api.kubectl("get", "ns", "default", "kube-system", "-o", "yaml").stdout
    out = api.kubectl("apply", "-f", "-", stdin=listed).stdout
    assert "namespace/default" in out and "namespace/kube-system" in out, out
    ns = json.loads(api.kubectl("get", "ns", "default", "-o", "json").stdout)
    assert (ns["apiVersion"], ns["kind"]) == ("v1", "Namespace")
