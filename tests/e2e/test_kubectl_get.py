"""`kubectl get` against the emulated API server prints what it prints against a real cluster: the columns
and cells of Kubernetes' printers (v1.32, pkg/printers/internalversion/printers.go), a CRD's printer columns
on every line of `kubectl get -w`, Services with their cluster IP and ports, events with type, reason, object
and message. Expected outputs are written from those printers for the objects each test creates."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import time

import pytest
import yaml
from support import CEILING, ROOT, ApiServer, kubectl_path, wait_until

CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
SAMPLE = ROOT / "crds" / "samples" / "llama-3.2-3b-tgi-inf2.yaml"
AGE = re.compile(r"^\d+s$")  # objects created by the test are seconds old


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiServer(tmp_path_factory.mktemp("kubectl-get"))
    server.kubectl("apply", "-f", str(CRD))
    yield server
    server.stop()


def columns(text: str) -> list[dict[str, str]]:
    """kubectl's table as rows of {HEADER: cell}: columns start where their headers start (tabwriter aligns
    them left), so cells with spaces and empty cells are read right."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"(?<!\S)\S+(?: \S+)*", header)]
    names = [header[s:e].strip() for s, e in zip(starts, [*starts[1:], None], strict=True)]
    out = []
    for line in lines[1:]:
        cells = [line[s:e].strip() for s, e in zip(starts, [*starts[1:], None], strict=True)]
        out.append(dict(zip(names, cells, strict=True)))
    return out


def ago(minutes: int) -> str:
    then = datetime.datetime.now(tz=datetime.UTC) - datetime.timedelta(minutes=minutes, seconds=5)
    return then.strftime("%Y-%m-%dT%H:%M:%SZ")


def apply(api, *objects: dict) -> None:
    api.kubectl("apply", "-f", "-", stdin="\n---\n".join(yaml.safe_dump(o) for o in objects))


def test_services_show_their_cluster_ip_and_ports(api):
    apply(
        api,
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers"},
         "spec": {"clusterIP": "None", "selector": {"app": "web", "role": "decode"},
                  "ports": [{"name": "http", "port": 8000}, {"name": "dns", "port": 53, "protocol": "UDP"}]}},
    )  # fmt: skip
    rows = {r["NAME"]: r for r in columns(api.kubectl("get", "svc", "-o", "wide").stdout)}
    assert list(next(iter(rows.values()))) == [
        "NAME", "TYPE", "CLUSTER-IP", "EXTERNAL-IP", "PORT(S)", "AGE", "SELECTOR"
    ]  # fmt: skip
    web, peers = rows["web"], rows["peers"]
    assert web["TYPE"] == "ClusterIP" and web["EXTERNAL-IP"] == "<none>" and web["PORT(S)"] == "80/TCP"
    ip = web["CLUSTER-IP"]
    assert re.fullmatch(r"10\.(9[6-9]|10[0-9]|11[01])\.\d+\.\d+", ip), ip  # in 10.96.0.0/12
    assert AGE.match(web["AGE"]) and web["SELECTOR"] == "app=web"
    assert {k: v for k, v in peers.items() if k != "AGE"} == {
        "NAME": "peers", "TYPE": "ClusterIP", "CLUSTER-IP": "None", "EXTERNAL-IP": "<none>",
        "PORT(S)": "8000/TCP,53/UDP", "SELECTOR": "app=web,role=decode",
    }  # fmt: skip
    # the address is the Service's for good: a re-apply keeps it, a change is refused as immutable
    labelled = {"name": "web", "labels": {"tier": "front"}}
    spec = {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}
    apply(api, {"apiVersion": "v1", "kind": "Service", "metadata": labelled, "spec": spec})
    assert api.kubectl("get", "svc", "web", "-o", "jsonpath={.spec.clusterIP}").stdout == ip
    patch = json.dumps({"spec": {"clusterIP": "10.96.0.10"}})
    run = api.kubectl("patch", "svc", "web", "-p", patch, check=False)
    assert run.returncode != 0 and "may not change once set" in run.stderr, run.stderr
    api.kubectl("delete", "svc", "web", "peers")


def test_events_list_with_last_seen_type_reason_object_and_message(api):
    apply(
        api,
        {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "m.compile"},
         "involvedObject": {"apiVersion": "neuronfleet.dev/v1alpha1", "kind": "NeuronModel", "name": "m",
                            "namespace": "default"},
         "type": "Normal", "reason": "CompileStarted", "message": "compile job m-compile-abc started ",
         "firstTimestamp": ago(50), "lastTimestamp": ago(30), "count": 2,
         "source": {"component": "neuronfleet-operator"}},
        {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "m.failed"},
         "involvedObject": {"kind": "Pod", "name": "m-unified-0", "namespace": "default",
                            "fieldPath": "spec.containers{server}"},
         "type": "Warning", "reason": "BackOff", "message": "Back-off restarting failed container",
         "firstTimestamp": ago(12)},
    )  # fmt: skip
    out = api.kubectl("get", "events").stdout
    assert columns(out) == [
        {
            "LAST SEEN": "30m",
            "TYPE": "Normal",
            "REASON": "CompileStarted",
            "OBJECT": "neuronmodel/m",
            "MESSAGE": "compile job m-compile-abc started",
        },
        {
            "LAST SEEN": "12m",
            "TYPE": "Warning",
            "REASON": "BackOff",
            "OBJECT": "pod/m-unified-0",
            "MESSAGE": "Back-off restarting failed container",
        },
    ], out  # no lastTimestamp: LAST SEEN is the first timestamp's age
    wide = columns(api.kubectl("get", "events", "-o", "wide").stdout)
    assert list(wide[0]) == [
        "LAST SEEN", "TYPE", "REASON", "OBJECT", "SUBOBJECT", "SOURCE", "MESSAGE", "FIRST SEEN", "COUNT",
        "NAME",
    ]  # fmt: skip
    assert [(r["SUBOBJECT"], r["SOURCE"], r["FIRST SEEN"], r["COUNT"], r["NAME"]) for r in wide] == [
        ("", "neuronfleet-operator", "50m", "2", "m.compile"),
        ("spec.containers{server}", "", "12m", "1", "m.failed"),
    ]
    api.kubectl("delete", "events", "--all")
    # events.k8s.io/v1 names the same things differently (regarding, note, deprecated*): the same columns
    new = {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "m.rolled"},
           "regarding": {"kind": "NeuronModel", "name": "m"}, "type": "Normal", "reason": "RolledOut",
           "note": "2/2 pods ready", "eventTime": ago(40).replace("Z", ".000000Z"),
           "reportingController": "neuronfleet.dev/operator", "reportingInstance": "op-0",
           "action": "Roll", "deprecatedLastTimestamp": ago(20)}  # fmt: skip
    apply(api, new)
    out = api.kubectl("get", "events.events.k8s.io").stdout
    assert columns(out) == [
        {"LAST SEEN": "20m", "TYPE": "Normal", "REASON": "RolledOut", "OBJECT": "neuronmodel/m",
         "MESSAGE": "2/2 pods ready"},
    ], out  # fmt: skip
    api.kubectl("delete", "events.events.k8s.io", "--all")


def test_pods_jobs_and_deployments_print_as_kubectl_prints_them(api):
    apply(
        api,
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "m-compile"},
         "spec": {"template": {"spec": {"restartPolicy": "Never",
                                        "containers": [{"name": "compile", "image": "neuronfleet"}]}}}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "m-unified"},
         "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "m"}},
                  "template": {"metadata": {"labels": {"app": "m"}},
                               "spec": {"containers": [{"name": "server", "image": "neuronfleet"}]}}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "done"},
         "spec": {"containers": [{"name": "c", "image": "x"}]}},
    )  # fmt: skip
    finished = {"phase": "Succeeded", "containerStatuses": [
        {"name": "c", "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}  # fmt: skip
    api.kubectl("patch", "pod", "done", "--subresource", "status", "--type", "merge",
                "-p", json.dumps({"status": finished}))  # fmt: skip
    (pod,) = columns(api.kubectl("get", "pods").stdout)
    assert {k: v for k, v in pod.items() if k != "AGE"} == {
        "NAME": "done",
        "READY": "0/1",
        "STATUS": "Completed",
        "RESTARTS": "0",
    }  # fmt: skip  (a finished pod says Completed, its container's terminated reason, not Succeeded)
    (job,) = columns(api.kubectl("get", "jobs").stdout)
    assert {k: v for k, v in job.items() if k != "AGE"} == {
        "NAME": "m-compile", "STATUS": "Running", "COMPLETIONS": "0/1", "DURATION": ""
    }  # fmt: skip
    (dep,) = columns(api.kubectl("get", "deployments", "-o", "wide").stdout)
    assert {k: v for k, v in dep.items() if k != "AGE"} == {
        "NAME": "m-unified", "READY": "0/2", "UP-TO-DATE": "0", "AVAILABLE": "0", "CONTAINERS": "server",
        "IMAGES": "neuronfleet", "SELECTOR": "app=m",
    }  # fmt: skip
    api.kubectl("delete", "job", "m-compile")
    api.kubectl("delete", "deployment", "m-unified")
    api.kubectl("delete", "pod", "done")


class Watch:
    """`kubectl get ... -w` running, its output read as it comes."""

    def __init__(self, api, *args: str) -> None:
        cmd = [kubectl_path(), "--kubeconfig", str(api.kubectl.kubeconfig), "--cache-dir",
               str(api.kubectl.cache_dir), "get", *args, "-w"]  # fmt: skip
        self.log = api.state / f"watch-{time.monotonic_ns()}.out"
        self.out = self.log.open("w")
        self.popen = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, text=True)

    def lines(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if line.strip()]

    def wait_for_lines(self, count: int) -> list[str]:
        def enough():
            if self.popen.poll() is not None:
                pytest.fail(f"kubectl get -w exited: {self.log.read_text()}")
            return len(self.lines()) >= count and self.lines()

        return wait_until(enough, f"{count} lines from kubectl get -w", ceiling=CEILING)

    def stop(self) -> None:
        self.popen.terminate()
        self.popen.wait()
        self.out.close()


def test_get_watch_prints_the_crds_printer_columns_on_every_line(api):
    sample = yaml.safe_load(SAMPLE.read_text())
    sample["metadata"]["namespace"] = "default"
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(sample))
    watch = Watch(api, "neuronmodels")
    try:
        watch.wait_for_lines(2)  # the header and the model as listed
        for phase, ready in (("Compiling", None), ("Ready", "1/1")):
            status = {"phase": phase, "readyReplicas": ready, "endpoint": "http://m:80" if ready else None}
            api.kubectl("patch", "nm", "llama-3-2-3b", "--subresource", "status", "--type", "merge",
                        "-p", json.dumps({"status": status}))  # fmt: skip
        lines = watch.wait_for_lines(4)
    finally:
        watch.stop()
    assert lines[0].split() == [
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
    rows = [line.split() for line in lines[1:]]  # every event prints all the columns, headers only once
    assert [r[:-1] for r in rows] == [
        ["llama-3-2-3b", "tgi", "inf2.xlarge", "2"],
        ["llama-3-2-3b", "Compiling", "tgi", "inf2.xlarge", "2"],
        ["llama-3-2-3b", "Ready", "tgi", "inf2.xlarge", "2", "1/1", "http://m:80"],
    ]
    assert all(AGE.match(r[-1]) for r in rows)
    api.kubectl("delete", "nm", "llama-3-2-3b")


def test_get_pods_watch_prints_pod_columns_on_every_line(api):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w"},
           "spec": {"containers": [{"name": "c", "image": "x"}]}}  # fmt: skip
    apply(api, pod)
    watch = Watch(api, "pods")
    try:
        watch.wait_for_lines(2)
        running = {"phase": "Running", "containerStatuses": [
            {"name": "c", "ready": True, "restartCount": 1, "state": {"running": {}}}]}  # fmt: skip
        api.kubectl("patch", "pod", "w", "--subresource", "status", "--type", "merge",
                    "-p", json.dumps({"status": running}))  # fmt: skip
        lines = watch.wait_for_lines(3)
    finally:
        watch.stop()
    assert [line.split()[:-1] for line in lines] == [
        ["NAME", "READY", "STATUS", "RESTARTS"],  # (AGE)
        ["w", "0/1", "0"],  # no phase until the kubelet reports (a real API server says Pending)
        ["w", "1/1", "Running", "1"],
    ]
    api.kubectl("delete", "pod", "w")
