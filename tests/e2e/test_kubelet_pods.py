"""The process kubelet as the real kubectl sees it: the emulated API server with `--kubelet-state` runs small
Python pods, and `kubectl logs` (follow, tail, since, since-time, timestamps, limit-bytes, previous,
refusals),
`kubectl get pods` (Completed, Error, restarts), probes at their declared periods, the TTL-after-finished
controller and garbage collection by owner references behave as on a real cluster (kubectl v1.32 against
Kubernetes 1.32: the expected texts are the kubelet's and kubectl's, cited where they are checked)."""

from __future__ import annotations

import datetime
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from support import ApiServer, kubectl_path, wait_until

STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z) (.*)$")  # RFC3339NanoFixed, as kubelet writes

# prints three lines, waits for a file `go` in its folder, prints two more (one on stderr), exits 0
COUNTER = """
import os, sys, time
for word in ("one", "two", "three"):
    print(word)
while not os.path.exists("go"):
    time.sleep(0.05)
print("four")
time.sleep(0.2)
print("five", file=sys.stderr)
"""
# its first run prints "run 1" and exits 1; later runs print "run N" and stay up
CRASHER = """
import os, time
runs = int(open("runs").read()) + 1 if os.path.exists("runs") else 1
open("runs", "w").write(str(runs))
print("run", runs, flush=True)
if runs == 1:
    raise SystemExit(1)
time.sleep(3600)
"""
# an HTTP server that logs each request with its own clock ("<seconds> <path> <code>"): /startup fails for
# its first 2 s, /health fails once a file `sick` exists in its folder, /ready always answers
WEB = """
import http.server, os, sys, time
began = time.monotonic()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200
        if self.path == "/startup" and time.monotonic() - began < 2:
            code = 503
        if self.path == "/health" and os.path.exists("sick"):
            code = 500
        print(f"{time.time():.6f} {self.path} {code}", flush=True)
        self.send_response(code)
        self.end_headers()
    def log_message(self, *args):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
# the same server, which also writes "<seconds> SIGTERM" to a file `sigterm` in its folder when it gets one
LINGERING = WEB.replace(
    "port = int(",
    "import signal\n"
    "def term(*_):\n"
    "    open('sigterm', 'w').write(f'{time.time():.6f} SIGTERM')\n"
    "    raise SystemExit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "port = int(",
)


class Node:
    """The emulated API server with the process kubelet, and kubectl against it."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.api = ApiServer(state, "--kubelet-state", str(state / "node"))
        self.kubectl = self.api.kubectl

    def wait(self, what: str, check):
        return self.api.process.wait_until(check, what, interval=0.2)

    def apply(self, obj: dict) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))

    def get(self, *args: str) -> dict | None:
        return self.kubectl.get(*args)

    def pods(self, selector: str) -> list[dict]:
        return self.get("pods", "-l", selector)["items"]

    def pod(self, selector: str) -> dict:
        """The one pod with these labels, once there is exactly one."""
        return self.wait(f"one pod {selector}", lambda: (p := self.pods(selector)) and len(p) == 1 and p[0])

    def folder(self, pod: dict) -> Path:
        return self.state / "node" / "pods" / f"default_{pod['metadata']['name']}"

    def logs(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.kubectl("logs", *args, check=check)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    node = Node(tmp_path_factory.mktemp("kubelet"))
    yield node
    node.api.stop()


def container(script: str, **extra) -> dict:
    return {"name": "main", "image": "python", "command": [sys.executable, "-u", "-c", script], **extra}


def job(name: str, script: str, **spec) -> dict:
    template = {"spec": {"restartPolicy": "Never", "containers": [container(script)]}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": "default"},
            "spec": {"backoffLimit": 0, "template": template, **spec}}  # fmt: skip


def deployment(name: str, main: dict, owner: dict | None = None) -> dict:
    meta: dict = {"name": name, "namespace": "default"}
    if owner is not None:
        ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"]}
        meta["ownerReferences"] = [{**ref, "uid": owner["metadata"]["uid"]}]
    labels = {"app": name}
    template = {"metadata": {"labels": labels}, "spec": {"containers": [main]}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": template}}  # fmt: skip


def state(pod: dict) -> dict:
    return ((pod.get("status") or {}).get("containerStatuses") or [{}])[0]


def pod_row(node: Node, name: str) -> list[str]:
    """`kubectl get pod NAME`'s row: NAME READY STATUS RESTARTS AGE (RESTARTS may read "1 (5s ago)")."""
    header, row = node.kubectl("get", "pod", name).stdout.splitlines()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    return row.split()


def stamped(text: str) -> list[tuple[float, str]]:
    """(seconds since the epoch, line) of `kubectl logs --timestamps` output."""
    out = []
    for line in text.splitlines():
        match = STAMP.match(line)
        assert match, f"not an RFC3339NanoFixed-stamped line: {line!r}"
        when = datetime.datetime.fromisoformat(match[1][:26] + "+00:00").timestamp()
        out.append((when, match[2]))
    return out


def events(node: Node, name: str) -> dict[str, dict]:
    """The Events about an object, by reason (`kubectl get events -o json`)."""
    items = node.get("events")["items"]
    return {e["reason"]: e for e in items if e["involvedObject"]["name"] == name}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_logs_follow_tail_since_timestamps_limit_and_completed(node):
    node.apply(job("counter", COUNTER))
    pod = node.pod("job-name=counter")
    name = pod["metadata"]["name"]
    node.wait("the counter running", lambda: "running" in state(node.get("pod", name)).get("state", {}))
    followed = node.state / "followed.txt"
    with followed.open("w") as out:  # kubectl logs -f streams while the container runs, ends when it exits
        follower = subprocess.Popen(
            [kubectl_path(), "--kubeconfig", str(node.kubectl.kubeconfig), "--cache-dir",
             str(node.kubectl.cache_dir), "logs", "-f", name], stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        node.wait("the first lines followed", lambda: followed.read_text() == "one\ntwo\nthree\n")
        assert follower.poll() is None
        (node.folder(pod) / "go").touch()
        node.wait("the follower to end with the container", lambda: follower.poll() is not None)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0 and followed.read_text() == "one\ntwo\nthree\nfour\nfive\n"

    node.wait("the Job complete", lambda: node.get("job", "counter")["status"].get("succeeded") == 1)
    assert pod_row(node, name)[1:4] == ["0/1", "Completed", "0"]
    # what the Job controller and the kubelet say, in their words
    about_job = {r: (e["type"], e["message"]) for r, e in events(node, "counter").items()}
    assert about_job == {"SuccessfulCreate": ("Normal", f"Created pod: {name}"),
                         "Completed": ("Normal", "Job completed")}  # fmt: skip
    about_pod = {
        r: (e["type"], e["message"], e["source"]["component"]) for r, e in events(node, name).items()
    }
    assert about_pod == {"Created": ("Normal", "Created container main", "kubelet"),
                         "Started": ("Normal", "Started container main", "kubelet")}  # fmt: skip
    terminated = state(node.get("pod", name))["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")

    assert node.logs(name).stdout == "one\ntwo\nthree\nfour\nfive\n"
    assert node.logs(name, "--tail=2").stdout == "four\nfive\n"
    assert node.logs(name, "--limit-bytes=6").stdout == "one\ntw"
    lines = stamped(node.logs(name, "--timestamps").stdout)
    assert [text for _, text in lines] == ["one", "two", "three", "four", "five"]
    times = [when for when, _ in lines]
    assert times == sorted(times) and times[3] - times[2] > 0  # per-line times, as they were written
    four = node.logs(name, "--timestamps", "--tail=2").stdout.split()[0]
    # sinceTime travels as a metav1.Time, whole seconds: lines from the start of line four's second on
    since = int(times[3])
    expected = "".join(f"{text}\n" for when, text in lines if when >= since)
    assert expected.endswith("four\nfive\n")
    assert node.logs(name, f"--since-time={four}").stdout == expected
    assert node.logs(name, "--since=1h").stdout == "one\ntwo\nthree\nfour\nfive\n"
    node.wait("a second after the last line", lambda: time.time() > times[-1] + 2)
    assert node.logs(name, "--since=1s").stdout == ""

    # refusals in the kubelet's and API server's words (kubelet_pods.go validateContainerLogStatus;
    # registry/core/pod/strategy.go LogLocation), as kubectl prints a 400
    previous = node.logs(name, "--previous", check=False)
    assert previous.returncode == 1
    assert previous.stderr.strip() == (
        f'Error from server (BadRequest): previous terminated container "main" in pod "{name}" not found'
    )
    other = node.logs(name, "-c", "other", check=False)  # kubectl checks the container name itself
    assert other.stderr.strip() == f"error: container other is not valid for pod {name}"
    missing = node.logs("no-such-pod", check=False)
    assert missing.stderr.strip() == (  # kubectl's own words around the API server's 404
        'error: error from server (NotFound): pods "no-such-pod" not found in namespace "default"'
    )


def test_a_failed_container_shows_error_and_its_exit_code(node):
    node.apply(job("failer", "print('bad input'); raise SystemExit(3)"))
    pod = node.pod("job-name=failer")
    name = pod["metadata"]["name"]
    node.wait("the Job failed", lambda: any(
        c["type"] == "Failed" for c in node.get("job", "failer")["status"].get("conditions", [])
    ))  # fmt: skip
    assert pod_row(node, name)[1:4] == ["0/1", "Error", "0"]
    terminated = state(node.get("pod", name))["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    assert node.logs(name).stdout == "bad input\n"


def test_a_restarted_container_keeps_its_previous_log_and_last_state(node):
    node.apply(deployment("crasher", container(CRASHER)))
    pod = node.pod("app=crasher")
    name = pod["metadata"]["name"]
    node.wait("the restart", lambda: (s := state(node.get("pod", name))).get("restartCount") == 1
              and "running" in s.get("state", {}))  # fmt: skip
    status = state(node.get("pod", name))
    terminated = status["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (1, "Error")
    assert terminated["finishedAt"] and terminated["startedAt"]
    assert node.logs(name, "--previous").stdout == "run 1\n"
    node.wait("the second run's line", lambda: node.logs(name).stdout == "run 2\n")
    backoff = events(node, name)["BackOff"]
    uid = node.get("pod", name)["metadata"]["uid"]
    assert backoff["type"] == "Warning"
    assert backoff["message"] == f"Back-off restarting failed container main in pod {name}_default({uid})"
    assert events(node, name)["Started"]["count"] == 2  # each instance, counted on one event
    row = pod_row(node, name)
    assert row[2] == "Running" and row[3] == "1" and re.fullmatch(r"\(\d+[smh]", row[4]) and row[5] == "ago)"


def test_probes_run_at_their_declared_periods_and_liveness_restarts(node):
    def probe(path: str, period: int, failures: int) -> dict:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "failureThreshold": failures,
        }

    web = container(
        WEB,
        args=["--port", "8080"],
        ports=[{"name": "http", "containerPort": 8080}],
        startupProbe=probe("/startup", 1, 30),
        readinessProbe=probe("/ready", 2, 3),
        livenessProbe=probe("/health", 3, 2),
    )
    node.apply(deployment("web", web))
    pod = node.pod("app=web")
    name = pod["metadata"]["name"]
    node.wait("the web pod ready", lambda: state(node.get("pod", name)).get("ready"))

    def requests(*args: str) -> list[tuple[float, str, int]]:
        """(when, path, status) of each request the pod served, by the server's own clock."""
        lines = [line.split() for line in node.logs(name, *args).stdout.splitlines()]
        return [(float(when), path, int(code)) for when, path, code in lines]

    node.wait("six readiness probes", lambda: sum(p == "/ready" for _, p, _ in requests()) >= 6)
    seen = requests()
    started = next(when for when, path, code in seen if path == "/startup" and code == 200)
    assert all(when >= started for when, path, _ in seen if path != "/startup"), "probed before started"
    assert all(when <= started for when, path, _ in seen if path == "/startup"), "startup probed once started"
    assert next(code for _, path, code in seen if path == "/startup") == 503  # it did fail first
    for path, period in (("/startup", 1), ("/ready", 2), ("/health", 3)):
        times = [when for when, p, _ in seen if p == path]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        if path == "/ready":
            assert times[0] - started < 1.0, "readiness runs at once when the startup probe succeeds"
        assert gaps and min(gaps) >= period * 0.85, (
            f"{path} probed every {min(gaps):.2f} s, declared {period} s"
        )
        print(f"{path}: {len(times)} probes, gaps {min(gaps):.2f}..{max(gaps):.2f} s (period {period} s)")

    # liveness: two failures in a row (3 s apart) and the container is killed (SIGTERM: exit 143), restarted
    (node.folder(pod) / "sick").touch()
    node.wait("the liveness restart", lambda: state(node.get("pod", name)).get("restartCount") == 1)
    terminated = state(node.get("pod", name))["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (143, "Error")
    health = [code for _, path, code in requests("--previous") if path == "/health"]
    assert health[-2:] == [500, 500]  # killed after failureThreshold failures in a row
    (node.folder(pod) / "sick").unlink()
    node.wait("ready again", lambda: state(node.get("pod", name)).get("ready"))
    said = {
        (e["reason"], e["message"]): e
        for e in node.get("events")["items"]
        if e["involvedObject"]["name"] == name
    }
    startup = said[("Unhealthy", "Startup probe failed: HTTP probe failed with statuscode: 503")]
    assert startup["type"] == "Warning" and startup["count"] >= 1
    liveness = said[("Unhealthy", "Liveness probe failed: HTTP probe failed with statuscode: 500")]
    assert liveness["type"] == "Warning" and liveness["count"] == 2
    assert said[("Killing", "Container main failed liveness probe, will be restarted")]["type"] == "Normal"
    described = node.kubectl("describe", "pod", name).stdout  # kubectl describe lists them by field selector
    assert "Liveness probe failed: HTTP probe failed with statuscode: 500" in described


def test_a_finished_job_is_deleted_after_its_ttl_with_its_pods(node):
    ttl = 8
    node.apply(job("short", "print('done')", ttlSecondsAfterFinished=ttl))
    pod = node.pod("job-name=short")
    done = node.wait(
        "the Job complete", lambda: (j := node.get("job", "short")) and j["status"].get("succeeded")
    )
    assert done and node.get("pod", pod["metadata"]["name"]) is not None  # not at once: after the TTL
    condition = next(c for c in node.get("job", "short")["status"]["conditions"] if c["type"] == "Complete")
    finished = datetime.datetime.fromisoformat(condition["lastTransitionTime"].replace("Z", "+00:00"))
    node.wait("the Job deleted", lambda: node.get("job", "short") is None)
    after = time.time() - finished.timestamp()
    assert ttl - 1 <= after <= ttl + 30, f"deleted {after:.1f} s after it finished (ttl {ttl} s)"
    node.wait("its pod deleted with it", lambda: node.get("pod", pod["metadata"]["name"]) is None)


@pytest.mark.parametrize("cascade", ["background", "orphan"])
def test_deleting_an_owner_deletes_its_dependents_and_their_processes(node, cascade):
    owner_name, child = f"owner-{cascade}", f"child-{cascade}"
    node.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": owner_name}})
    sleeper = container("import time; print('up', flush=True); time.sleep(3600)")
    node.apply(deployment(child, sleeper, node.get("configmap", owner_name)))
    pid_file = node.folder(node.pod(f"app={child}")) / "pid"
    pid = int(node.wait("the child's process", lambda: pid_file.exists() and pid_file.read_text()))
    node.kubectl("delete", "configmap", owner_name, f"--cascade={cascade}")
    if cascade == "orphan":  # the dependent stays, without the reference
        left = node.get("deployment", child)
        assert left is not None and not left["metadata"].get("ownerReferences")
        assert alive(pid)
        node.kubectl("delete", "deployment", child)
    else:  # the garbage collector deletes it, with no operator running
        assert node.get("deployment", child) is None
    node.wait("the pods gone", lambda: node.pods(f"app={child}") == [])
    node.wait("the process gone", lambda: not alive(pid))


@pytest.mark.parametrize("selector", ["manual", "defaulted"])
def test_kubectl_logs_job_picks_the_jobs_pod(node, selector):
    """`kubectl logs job/NAME` lists pods by the Job's spec.selector: the pods carry the template's labels.
    A manual selector works on any API server; a defaulted one needs the API server to default it (batch/v1
    Job strategy: batch.kubernetes.io/controller-uid) and the template's labels."""
    name = f"named-{selector}"
    manifest = job(name, f"print('from {name}')")
    if selector == "manual":
        manifest["spec"]["manualSelector"] = True
        manifest["spec"]["selector"] = {"matchLabels": {"picked": name}}
        manifest["spec"]["template"]["metadata"] = {"labels": {"picked": name}}
    node.apply(manifest)
    spec = node.get("job", name)["spec"]
    if "selector" not in spec:
        pytest.skip("this API server does not default a Job's spec.selector (the apiserver branch does)")
    node.apply(deployment(f"decoy-{selector}", container("import time; print('decoy'); time.sleep(3600)")))
    node.wait("the Job complete", lambda: node.get("job", name)["status"].get("succeeded") == 1)
    assert node.logs(f"job/{name}").stdout == f"from {name}\n"
    labels = node.pod(f"job-name={name}")["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    node.kubectl("delete", "deployment", f"decoy-{selector}")


def test_a_follower_that_leaves_is_let_go(node):
    """`kubectl logs -f` ends on the server side when its client leaves, not only when the container exits:
    the API server's process then holds the log file open once (the kubelet writing it), not twice."""
    # two lines, then silence: nothing written to the gone client tells the server it left
    ticker = container("import time; print('tick'); print('tick', flush=True); time.sleep(3600)")
    node.apply(deployment("ticker", ticker))
    pod = node.pod("app=ticker")
    name = pod["metadata"]["name"]
    node.wait("the ticker running", lambda: "running" in state(node.get("pod", name)).get("state", {}))
    log = next((node.state / "node" / "logs").glob(f"default_{name}_*/0.log"))

    def opened() -> int:
        fds = Path(f"/proc/{node.api.process.pid}/fd")
        return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(log.resolve()))

    followed = node.state / "ticks.txt"
    with followed.open("w") as out:
        follower = subprocess.Popen(
            [kubectl_path(), "--kubeconfig", str(node.kubectl.kubeconfig), "--cache-dir",
             str(node.kubectl.cache_dir), "logs", "-f", name], stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        node.wait("ticks followed", lambda: followed.read_text().count("tick") >= 2)
        assert opened() == 2  # the kubelet writing, the follower reading
    finally:
        follower.kill()
        follower.wait()
    node.wait("the follower let go", lambda: opened() == 1)
    node.kubectl("delete", "deployment", "ticker")


def test_a_scale_down_deletes_the_pods_with_the_lowest_deletion_cost_first(node):
    """The ReplicaSet controller's order among ready pods: the lower `controller.kubernetes.io/
    pod-deletion-cost` goes first (what the autoscaler sets so that a scale-down takes the idle pods)."""
    ready = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}
    web = container(WEB, args=["--port", "8080"], ports=[{"name": "http", "containerPort": 8080}],
                    readinessProbe=ready)  # fmt: skip
    body = deployment("costly", web)
    body["spec"]["replicas"] = 3
    node.apply(body)
    pods = node.wait("three ready pods", lambda: (p := node.pods("app=costly")) and len(p) == 3
                     and all(state(x).get("ready") for x in p) and p)  # fmt: skip
    names = sorted(p["metadata"]["name"] for p in pods)
    costs = dict(zip(names, ("5", "-2", "100"), strict=True))  # the busiest keeps its pod
    for name, cost in costs.items():
        node.kubectl("annotate", "pod", name, f"controller.kubernetes.io/pod-deletion-cost={cost}")
    node.kubectl("scale", "deployment", "costly", "--replicas", "1")
    left = node.wait("one pod left", lambda: (p := [x for x in node.pods("app=costly")
                     if not x["metadata"].get("deletionTimestamp")]) and len(p) == 1 and p)  # fmt: skip
    assert left[0]["metadata"]["name"] == names[2]
    node.kubectl("delete", "deployment", "costly")


def test_a_deleted_pod_leaves_its_service_then_sleeps_its_prestop_hook_then_gets_sigterm(node):
    """What neuronfleet's serving pods rely on (a preStop `sleep`, KEP-3960): the pod leaves the Service's
    endpoints at once, keeps serving what was already routed to it through the hook, and only then gets
    SIGTERM, within its grace period."""
    hook = 6
    ready = {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1}
    web = container(LINGERING, args=["--port", "8080"], ports=[{"name": "http", "containerPort": 8080}],
                    readinessProbe=ready, lifecycle={"preStop": {"sleep": {"seconds": hook}}})  # fmt: skip
    node.apply(deployment("lingering", web))
    service = {"selector": {"app": "lingering"}, "ports": [{"port": 80, "targetPort": "http"}]}
    node.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "lingering"}, "spec": service})
    pod = node.pod("app=lingering")
    name, folder = pod["metadata"]["name"], node.folder(pod)

    def slice_ports() -> list[int]:
        slices = node.get("endpointslices", "-l", "kubernetes.io/service-name=lingering")["items"]
        return [p["port"] for s in slices for p in s.get("ports") or []]

    (port,) = node.wait("the pod in the Service's endpoints", slice_ports)
    pid = int((folder / "pid").read_text())
    deleted = time.time()
    node.kubectl("delete", "pod", name, "--wait=false")
    node.wait("the pod out of the Service's endpoints", lambda: not slice_ports())
    left_service = time.time()
    inside = left_service - deleted < hook - 1  # seen inside the hook (a very busy machine may be past it)
    if inside:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as r:
            assert r.status == 200  # still serving: no SIGTERM yet
    marks = folder / "sigterm"
    term = float(node.wait("the SIGTERM", lambda: marks.exists() and marks.read_text()).split()[0])
    assert term >= deleted + hook - 0.1, f"SIGTERM {term - deleted:.1f} s after the deletion, inside the hook"
    assert term > left_service or not inside, "SIGTERM before the pod left its Service"
    node.wait("the process gone", lambda: not alive(pid))
    out, sigterm = left_service - deleted, term - deleted
    print(f"after the deletion: out of the Service at {out:.1f} s, SIGTERM at {sigterm:.1f} s")
    node.kubectl("delete", "deployment,service", "lingering")


def test_a_prestop_hook_the_local_kubelet_does_not_run_is_reported(node):
    sleeper = container(
        "import time; time.sleep(3600)", lifecycle={"preStop": {"exec": {"command": ["/bin/true"]}}}
    )
    node.apply(deployment("hooked", sleeper))
    name = node.pod("app=hooked")["metadata"]["name"]
    node.wait("the pod running", lambda: state(node.get("pod", name)).get("state", {}).get("running"))
    node.kubectl("delete", "deployment", "hooked")
    failed = node.wait("FailedPreStopHook", lambda: events(node, name).get("FailedPreStopHook"))
    assert failed["type"] == "Warning" and "not exec" in failed["message"], failed


def test_a_node_that_stops_stops_the_pods_still_in_their_prestop_hook(tmp_path):
    node = Node(tmp_path)
    try:
        sleeper = container(
            "import time; time.sleep(3600)", lifecycle={"preStop": {"sleep": {"seconds": 50}}}
        )
        body = deployment("unhooked", sleeper)
        body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 60
        node.apply(body)
        pod = node.pod("app=unhooked")
        pid_file = node.folder(pod) / "pid"
        pid = int(node.wait("the process", lambda: pid_file.exists() and pid_file.read_text()))
        node.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=false")
        node.wait("the pod deleted", lambda: node.get("pod", pod["metadata"]["name"]) is None)
        assert alive(pid)  # in its 50 s hook
    finally:
        node.api.stop()
    try:
        wait_until(lambda: not alive(pid), "the process gone with the node")
    finally:  # an orphan left behind is not left running
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
