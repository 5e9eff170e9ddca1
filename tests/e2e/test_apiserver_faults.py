"""The operator against what real API servers do, injected with the emulated API server's fault switches
(`--fault-switches`, localcluster/apiserver.py `Faults`), with no kubelet (nothing here needs a pod): the
NeuronModel CRD missing at the start (the operator waits, never exits, and serves models once the CRD is
installed); requests refused with 429 and Retry-After, as API Priority and Fairness does (sent again, the
work done once); every watch ended with 410 after a compaction (kopf lists again, nothing lost or
doubled), an object deleted while no watch ran made again; the API server restarted mid-work, its objects
kept as etcd keeps them (the operator stays up and goes on the moment it answers); kopf's liveness probe."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import yaml
from support import HTTP_TIMEOUT, OPERATOR_USER, ROOT, ApiServer, Process, free_port, neuronfleet_command

from neuronfleet.operator import kube, login, triggers

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
JOBS = "/apis/batch/v1/namespaces/default/jobs"


class Faulty:
    """The emulated API server on a fixed port, its objects in a file (so it can restart), with its fault
    switches and an audit log; an operator against it as its own user."""

    def __init__(self, state) -> None:
        self.state, self.port = state, free_port()
        self.args = ("--port", str(self.port), "--audit-log", str(state / "audit.jsonl"), "--fault-switches",
                     "--data-file", str(state / "objects.json"))  # fmt: skip
        self.api = ApiServer(state, *self.args)
        kubeconfig = self.api.kubeconfig_for(OPERATOR_USER)  # (its token kept over the restarts)
        self.health = f"http://127.0.0.1:{free_port()}/healthz"  # kopf's liveness endpoint
        args = [
            *neuronfleet_command(),
            "operator",
            "--kubeconfig",
            str(kubeconfig),
            "--liveness",
            self.health,
        ]
        self.operator = Process([*args, "--standalone", "--verbose"], state / "operator.log")

    def restart(self) -> None:
        self.api.stop()
        (self.state / "url").unlink()
        self.api = ApiServer(self.state, *self.args)

    def switch(self, **faults) -> dict:
        request = urllib.request.Request(
            self.api.url + "/neuronfleet/faults", data=json.dumps(faults).encode(), method="POST",
            headers=self.api.headers(),
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=self.api.context) as r:
            return json.loads(r.read())

    def create_model(self, name: str) -> None:
        manifest = yaml.safe_load(SAMPLE.read_text())
        manifest["metadata"]["name"] = name
        self.api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def jobs(self, model: str) -> list[dict]:
        return self.api.kubectl.get("jobs", "-l", f"neuronfleet.dev/model={model}")["items"]

    def wait_job(self, model: str) -> None:
        self.operator.wait_until(lambda: self.jobs(model), f"the compile Job of {model}")

    def stop(self) -> None:
        if self.operator.poll() is None:
            assert self.operator.stop() == 0, self.operator.output()[-3000:]
        self.api.stop()


async def refused_read(kubeconfig) -> kube.KubeError:
    client = kube.Kube(login.Login(kubeconfig))
    try:
        await client.get("ConfigMap", "default", "any", live=True)
    except kube.KubeError as e:
        return e
    finally:
        await client.close()
    raise AssertionError("the read was not refused")


def test_the_operator_rides_out_a_missing_crd_refusals_expired_watches_and_a_restart(tmp_path):
    faulty = Faulty(tmp_path)
    try:
        # no CRD yet: the operator waits for it (kopf says so, does not exit, and watches the CRDs)
        waiting = "Unresolved resources cannot be served (try creating their CRDs)"
        faulty.operator.wait_until(lambda: waiting in faulty.operator.output(), "the wait for the CRD")
        assert faulty.operator.poll() is None
        faulty.api.kubectl("apply", "-f", str(CRD))
        faulty.create_model("m1")
        faulty.wait_job("m1")
        with urllib.request.urlopen(faulty.health, timeout=HTTP_TIMEOUT) as live:  # --liveness: kopf's probe
            assert live.status == 200

        # 429 with Retry-After, 5 in a row for the operator (its Lease's calls too, so fewer than its renew
        # deadline lasts: a longer refusal makes the leader step down, tests/e2e/test_leader_election.py),
        # then 503: each request sent again after its Retry-After, the work done once
        faulty.switch(refuse=5, status=429, retryAfter=1, user=OPERATOR_USER)
        faulty.create_model("m2")
        faulty.wait_job("m2")
        assert faulty.switch()["refused"] == 5
        faulty.switch(refuse=3, status=503, retryAfter=1, user=OPERATOR_USER)
        faulty.create_model("m2b")
        faulty.wait_job("m2b")
        # refused past the client's own tries: its error carries the answer's Retry-After, which the model's
        # retry then waits (tests/unit/test_triggers.py)
        faulty.switch(refuse=kube.RETRIES + 1, status=429, retryAfter=1, user="probe")
        error = asyncio.run(refused_read(faulty.api.kubeconfig_for("probe")))
        assert error.status == 429 and triggers.server_delay(error) == 1

        # every watch ends with 410 and no resourceVersion resumes: kopf lists again
        faulty.switch(expireWatches=True)
        faulty.create_model("m3")
        faulty.wait_job("m3")

        # an object deleted while no watch of the operator ran (its watches expired and its LISTs refused a
        # moment) is not in kopf's next LIST and stays in its index: found out after that re-list (read live:
        # gone) and made again
        selector = ("configmaps", "-l", "neuronfleet.dev/model=m3")
        (config,) = faulty.api.kubectl.get(*selector)["items"]
        faulty.switch(refuse=10_000, status=429, retryAfter=1, user=OPERATOR_USER, expireWatches=True)
        faulty.api.kubectl("delete", "configmap", config["metadata"]["name"])
        faulty.switch(refuse=0)
        uids = lambda: [c["metadata"]["uid"] for c in faulty.api.kubectl.get(*selector)["items"]]  # noqa: E731
        faulty.operator.wait_until(
            lambda: uids() and uids() != [config["metadata"]["uid"]], "the ConfigMap again"
        )

        # the API server restarts (its objects kept): the operator goes on once it answers
        faulty.restart()
        faulty.create_model("m4")
        faulty.wait_job("m4")
        assert faulty.operator.poll() is None
        assert [len(faulty.jobs(m)) for m in ("m1", "m2", "m2b", "m3", "m4")] == [1] * 5  # none doubled
        assert "Traceback" not in faulty.operator.output(), faulty.operator.output()[-3000:]
    finally:
        faulty.stop()
