"""Chaos benchmark of the operator's control plane: NeuronModels created, changed and deleted while the
leading operator replica is killed (SIGKILL) every few seconds, the API server is restarted and every watch is
expired; then the figures: how long each change waited for a reconcile, how long the models took to converge
after the chaos and after an API-server restart, failover times, and what the operator does at rest (requests
and writes per model while idle, its memory and its requests at rest with `--memory-models` models).

It runs real `neuronfleet operator` processes (several replicas, leader election on, each process its own user
so that the API server's audit log tells them apart; a replica that exits is started again under a new name,
as a Deployment's pod would be) against the emulated API server (its objects kept in a data file, so that it
can restart as a real one does over etcd; its fault switches on). No kubelet runs: the script plays the Job
controller (each compile Job succeeds with a pod's termination message, as tests/support.py `finish_compile`
does), so models go on to their Deployments and Services; no pod serves.

At the end it checks what tests/e2e/test_chaos.py asserts: every model converged (its status at its
generation, its Job, Deployment and Service as its spec says), no child duplicated or left without its owner,
and no write from a replica that did not hold the Lease (audit log).

    .venv/bin/python bench/chaos.py [--models 300] [--seconds 300] [--kill-every 15] [--idle-seconds 60]
        [--memory-models 1000] [--chart-timing] [--out chaos.json] [--keep DIR]   # --seconds 0: at rest only

Prints the figures and writes bench/results/chaos.json with the CPU it ran on. Not a test: numbers depend on
the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
from machine import cpu_name  # bench/machine.py

from neuronfleet.localcluster.guard import set_token, write_private
from neuronfleet.localcluster.ports import loopback_port
from neuronfleet.localcluster.tls import Access

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
NS = "/apis/{group}/{version}/namespaces/default/{plural}"
MODELS = NS.format(group="neuronfleet.dev", version="v1alpha1", plural="neuronmodels")
LEASE = "/apis/coordination.k8s.io/v1/namespaces/default/leases/neuronfleet-operator"
JOBS = NS.format(group="batch", version="v1", plural="jobs")
CHILDREN = {  # the kinds the operator makes, by their list paths (every child carries the model label)
    "Job": JOBS,
    "Deployment": NS.format(group="apps", version="v1", plural="deployments"),
    "Service": "/api/v1/namespaces/default/services",
    "ConfigMap": "/api/v1/namespaces/default/configmaps",
    "Secret": "/api/v1/namespaces/default/secrets",
    "PersistentVolumeClaim": "/api/v1/namespaces/default/persistentvolumeclaims",
    "PodDisruptionBudget": NS.format(group="policy", version="v1", plural="poddisruptionbudgets"),
    "Pod": "/api/v1/namespaces/default/pods",
}
MODEL_LABEL, HASH_LABEL = "neuronfleet.dev/model", "neuronfleet.dev/compile-hash"
ROLE_LABEL = "neuronfleet.dev/role"
WRITES = ("create", "update", "patch", "delete")
UNREACHABLE_SECONDS = 120  # the longest the script waits for the API server to answer again


class Unreachable(RuntimeError):
    """The API server did not answer for UNREACHABLE_SECONDS."""


@dataclass
class Timing:
    lease: float = 4.0  # the tests' short timings; the chart's are 15 / 10 / 2
    renew: float = 3.0
    retry: float = 1.0

    def flags(self) -> list[str]:
        return [
            "--lease-duration",
            f"{self.lease:g}",
            "--renew-deadline",
            f"{self.renew:g}",
            "--retry-period",
            f"{self.retry:g}",
        ]


class ControlPlane:
    """The emulated API server (restartable on its port, objects in a data file, audit log, fault switches,
    the NeuronModel CRD; with `kubelet`, the process kubelet beside it) and a set of operator replicas kept at
    `replicas` by `supervise` (one that exits is replaced)."""

    def __init__(self, state: Path, timing: Timing, replicas: int = 3, kubelet: bool = False) -> None:
        self.state, self.timing, self.replicas, self.kubelet = state, timing, replicas, kubelet
        self.port = loopback_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.access: Access | None = None  # (the kubeconfig's: the CA and the admin's token)
        self.api: subprocess.Popen | None = None
        self.operators: dict[str, subprocess.Popen] = {}
        self.exits: list[tuple[str, int]] = []  # (user, code) of every replica that ended
        self.started = 0
        self.lock = threading.Lock()
        self.start_api()
        self.call(
            "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(CRD.read_text())
        )

    # ---- the API server ----

    def start_api(self) -> None:
        ready = self.state / "url"
        ready.unlink(missing_ok=True)
        self.api = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "neuronfleet.localcluster.apiserver",
                "--port",
                str(self.port),
                "--kubeconfig",
                str(self.state / "kubeconfig"),
                "--token-auth-file",  # (its tokens and certificate kept over restarts)
                str(self.state / "tokens.csv"),
                "--tls-cert-file",
                str(self.state / "apiserver.crt"),
                "--tls-private-key-file",
                str(self.state / "apiserver.key"),
                "--ready-file",
                str(ready),
                "--audit-log",
                str(self.state / "audit.jsonl"),
                "--data-file",
                str(self.state / "objects.json"),
                "--fault-switches",
                *(["--kubelet-state", str(self.state / "node")] if self.kubelet else []),
            ],
            stdout=(self.state / "apiserver.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + UNREACHABLE_SECONDS
        while not (ready.exists() and ready.read_text()):
            if self.api.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the API server did not start: {(self.state / 'apiserver.log').read_text()}"
                )
            time.sleep(0.05)
        self.access = Access.read(self.state / "kubeconfig")

    def restart_api(self) -> tuple[float, float]:
        """Stop the API server (SIGTERM: it writes its objects) and start it again on its port: (when it
        stopped answering, when it answered again), monotonic."""
        assert self.api is not None
        down = time.monotonic()
        self.api.terminate()
        self.api.wait()
        self.start_api()
        return down, time.monotonic()

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        wait: bool = True,
    ) -> tuple[int, Any]:
        """One request: (status, the answer's JSON). While the API server does not answer (a restart), the
        request is sent again until it does (`wait`), else Unreachable."""
        data = json.dumps(body).encode() if body is not None else None
        deadline = time.monotonic() + UNREACHABLE_SECONDS
        while True:
            request = urllib.request.Request(
                self.url + path, data=data, method=method, headers=self.access.headers(content_type)
            )
            try:
                with urllib.request.urlopen(request, timeout=30, context=self.access.context) as r:
                    return r.status, json.loads(r.read() or b"null")
            except urllib.error.HTTPError as e:
                answer = e.read()
                with contextlib.suppress(ValueError):
                    return e.code, json.loads(answer)
                return e.code, None
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if not wait or time.monotonic() > deadline:
                    raise Unreachable(f"{method} {path}: {e}") from e
                time.sleep(0.1)

    def items(self, path: str, selector: str = "") -> list[dict]:
        query = f"?labelSelector={urllib.request.quote(selector)}" if selector else ""
        code, body = self.call("GET", path + query)
        assert code == 200, (code, body)
        return body["items"]

    def switch(self, **faults: Any) -> dict:
        return self.call("POST", "/neuronfleet/faults", faults)[1]

    def audit(self) -> list[dict]:
        return [json.loads(x) for x in (self.state / "audit.jsonl").read_text().splitlines()]

    # ---- the operator replicas ----

    def start_operator(self) -> str:
        """A new replica: user (and pod name) operator-N, leader election on with `timing`."""
        with self.lock:
            self.started += 1
            user = f"operator-{self.started}"
        config = yaml.safe_load((self.state / "kubeconfig").read_text())
        config["users"][0]["user"]["token"] = set_token(self.state / "tokens.csv", user)  # (its audit user)
        kubeconfig = self.state / f"{user}.kubeconfig"
        write_private(kubeconfig, yaml.safe_dump(config))
        cli = str(Path(sys.executable).parent / "neuronfleet")
        proc = subprocess.Popen(
            [cli, "operator", "--kubeconfig", str(kubeconfig), "--standalone", *self.timing.flags()],
            stdout=(self.state / f"{user}.log").open("ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "POD_NAME": user},
        )
        with self.lock:
            self.operators[user] = proc
        return user

    def supervise(self) -> None:
        """Replace each replica that ended (recording how), as a Deployment starts its pod again."""
        with self.lock:
            ended = [(u, p) for u, p in self.operators.items() if p.poll() is not None]
            for user, proc in ended:
                del self.operators[user]
                self.exits.append((user, proc.returncode))
        for _ in ended:
            self.start_operator()
        while len(self.operators) < self.replicas:
            self.start_operator()

    def holder(self) -> str:
        """The user whose identity holds the Lease ("" for none, or while the API server does not answer)."""
        try:
            code, lease = self.call("GET", LEASE, wait=False)
        except Unreachable:
            return ""
        identity = ((lease or {}).get("spec") or {}).get("holderIdentity") or "" if code == 200 else ""
        return identity.rsplit("_", 1)[0]

    def kill(self, user: str) -> bool:
        with self.lock:
            proc = self.operators.get(user)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True

    def rss_bytes(self, user: str) -> int:
        pid = self.operators[user].pid
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        with self.lock:
            procs = list(self.operators.values())
            self.operators.clear()
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.api is not None and self.api.poll() is None:
            self.api.terminate()
            self.api.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.state.glob("*.log")))


def manifest(name: str, batch: int = 4, replicas: int = 1) -> dict:
    """The local sample as `name`, routed by load, behind the front door every unified model has."""
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"]["name"] = name
    body["spec"]["neuron"]["batchSize"] = batch
    body["spec"]["serving"]["unified"]["replicas"] = replicas
    body["spec"]["serving"]["routing"] = {"policy": "least-loaded"}
    return body


# ---- the players: the Job controller, the lease and status watcher, the workload ----------------------


class JobController:
    """Plays the Job controller and kubelet for compile Jobs: each new Job gets a pod that ends Succeeded with
    an artifacts manifest as its termination message (owned by the Job, so garbage collection takes it with
    the Job), then the Job's Complete condition."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane, self.done = plane, set()

    def step(self) -> None:
        for job in self.plane.items(JOBS, MODEL_LABEL):
            meta = job["metadata"]
            if meta["uid"] in self.done or (job.get("status") or {}).get("succeeded"):
                continue
            if self.finish(job):
                self.done.add(meta["uid"])

    def finish(self, job: dict) -> bool:
        """Whether the Job was finished (or is gone); False: a write failed, tried again at the next step."""
        meta, plane = job["metadata"], self.plane
        name = f"{meta['name']}-{meta['uid'][:5]}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "labels": {**job["spec"]["template"]["metadata"]["labels"], "job-name": meta["name"]},
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {"restartPolicy": "Never", "containers": [{"name": "compile", "image": "runtime"}]},
        }
        code, _ = plane.call("POST", CHILDREN["Pod"], pod)
        if code == 404:
            return True  # (the Job is gone: its owner was deleted)
        if code not in (201, 409):
            return False
        terminated = {"exitCode": 0, "reason": "Completed", "message": json.dumps({"bytes": 1})}
        status = {
            "phase": "Succeeded",
            "containerStatuses": [{"name": "compile", "state": {"terminated": terminated}}],
        }
        merge = "application/merge-patch+json"
        if plane.call("PATCH", f"{CHILDREN['Pod']}/{name}/status", {"status": status}, merge)[0] >= 300:
            return False
        done = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True", "reason": "Emulated"}]}
        code, _ = plane.call("PATCH", f"{JOBS}/{meta['name']}/status", {"status": done}, merge)
        return code < 300 or code == 404


@dataclass
class Watcher:
    """Reads the Lease holder and every model's observedGeneration a few times a second: when each write to
    a model was first seen reconciled, and when the Lease changed hands."""

    plane: ControlPlane
    pending: dict[str, list[tuple[str, int, float]]] = field(
        default_factory=dict
    )  # name: (uid, gen, written)
    lags: list[tuple[float, float]] = field(default_factory=list)  # (written at, seconds until reconciled)
    seen: list[tuple[str, int, float, float]] = field(default_factory=list)  # (name, generation, as lags)
    holders: list[tuple[float, str]] = field(default_factory=list)  # (first seen, user)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrote(self, name: str, uid: str, generation: int, at: float) -> None:
        with self.lock:
            self.pending.setdefault(name, []).append((uid, generation, at))

    def deleted(self, name: str) -> None:
        with self.lock:
            self.pending.pop(name, None)

    def step(self) -> None:
        holder = self.plane.holder()
        if holder and (not self.holders or self.holders[-1][1] != holder):
            self.holders.append((time.monotonic(), holder))
        try:
            code, body = self.plane.call("GET", MODELS, wait=False)
        except Unreachable:
            return
        if code != 200:
            return
        seen = time.monotonic()
        with self.lock:
            for model in body["items"]:
                meta, status = model["metadata"], model.get("status") or {}
                waiting = self.pending.get(meta["name"])
                if not waiting:
                    continue
                observed = status.get("observedGeneration") or 0
                left = []
                for uid, generation, written in waiting:
                    if uid == meta["uid"] and observed >= generation:
                        self.lags.append((written, seen - written))
                        self.seen.append((meta["name"], generation, written, seen - written))
                    elif uid == meta["uid"]:
                        left.append((uid, generation, written))
                self.pending[meta["name"]] = left

    def unreconciled(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.pending.values())


class Workload:
    """Creates `models` NeuronModels and, until told to stop, changes (a compile setting, or replicas),
    deletes and creates again random ones: about `rate` writes a second, from a seeded random."""

    def __init__(self, plane: ControlPlane, watcher: Watcher, models: int, rate: float, seed: int) -> None:
        self.plane, self.watcher, self.rate = plane, watcher, rate
        self.rng = random.Random(seed)
        self.names = [f"m{i:04d}" for i in range(models)]
        self.live: dict[str, dict] = {}  # name: the spec values it was given last
        self.gone: list[str] = []
        self.writes = Counter()

    def create(self, name: str) -> None:
        values = {"batch": self.rng.choice((2, 4)), "replicas": 1}
        code, body = self.plane.call("POST", MODELS, manifest(name, **values))
        if code == 409:  # (sent again after a restart that had taken it)
            code, body = self.plane.call("GET", f"{MODELS}/{name}")
        assert code in (200, 201), (code, body)
        self.live[name] = values
        self.watcher.wrote(name, body["metadata"]["uid"], body["metadata"]["generation"], time.monotonic())
        self.writes["create"] += 1

    def change(self, name: str) -> None:
        values = dict(self.live[name])
        if self.rng.random() < 0.5:
            values["batch"] = 6 - values["batch"]  # 2 <-> 4: a new compile
        else:
            values["replicas"] = 3 - values["replicas"]  # 1 <-> 2: no compile
        patch = {
            "spec": {
                "neuron": {"batchSize": values["batch"]},
                "serving": {"unified": {"replicas": values["replicas"]}},
            }
        }
        code, body = self.plane.call("PATCH", f"{MODELS}/{name}", patch, "application/merge-patch+json")
        assert code == 200, (code, body)
        self.live[name] = values
        self.watcher.wrote(name, body["metadata"]["uid"], body["metadata"]["generation"], time.monotonic())
        self.writes["change"] += 1

    def delete(self, name: str) -> None:
        code, body = self.plane.call("DELETE", f"{MODELS}/{name}")
        assert code in (200, 202, 404), (code, body)
        del self.live[name]
        self.gone.append(name)
        self.watcher.deleted(name)
        self.writes["delete"] += 1

    def one(self) -> None:
        """The next write: a creation while models are still to be made (more often than the rest), else a
        change, deletion or re-creation."""
        fresh = [n for n in self.names if n not in self.live and n not in self.gone]
        roll = self.rng.random()
        if fresh and (roll < 0.6 or len(self.live) < 10):
            self.create(fresh[0])
        elif roll < 0.85 or not self.live:
            self.change(self.rng.choice(sorted(self.live)))
        elif roll < 0.93 and len(self.live) > len(self.names) // 2:
            self.delete(self.rng.choice(sorted(self.live)))
        elif self.gone:
            name = self.gone.pop(self.rng.randrange(len(self.gone)))
            self.create(name)
        else:
            self.change(self.rng.choice(sorted(self.live)))

    def created_all(self) -> bool:
        return all(n in self.live or n in self.gone for n in self.names)


def background(step, stop: threading.Event, interval: float, errors: list) -> threading.Thread:
    """Run `step` every `interval` seconds until `stop` (errors kept, and the loop goes on)."""

    def loop() -> None:
        while not stop.is_set():
            try:
                step()
            except Unreachable:
                pass
            except Exception as e:  # (kept for the report; the run goes on)
                errors.append(repr(e))
            stop.wait(interval)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


# ---- the checks ---------------------------------------------------------------------------------------


def wanted_state(plane: ControlPlane, live: dict[str, dict]) -> list[str]:
    """What differs from converged: each model at its generation, with one Job for its compile hash, one
    Deployment of its hash with its replicas and batch size and one of its front door, one public Service;
    every child's owner alive; no child of a deleted model. [] once converged."""
    problems: list[str] = []
    models = {m["metadata"]["name"]: m for m in plane.items(MODELS)}
    if sorted(models) != sorted(live):
        problems.append(f"models {sorted(set(models) ^ set(live))[:5]} differ from the workload's")
    owners = {m["metadata"]["uid"] for m in models.values()}
    children = {kind: plane.items(path, MODEL_LABEL) for kind, path in CHILDREN.items()}
    owners |= {j["metadata"]["uid"] for j in children["Job"]}
    by_model: dict[tuple[str, str], list[dict]] = {}
    for kind, objs in children.items():
        for obj in objs:
            meta = obj["metadata"]
            refs = {r["uid"] for r in meta.get("ownerReferences") or []}
            if meta["labels"][MODEL_LABEL] not in live or not refs & owners:
                problems.append(f"{kind} {meta['name']}: an orphan (model {meta['labels'][MODEL_LABEL]})")
            by_model.setdefault((kind, meta["labels"][MODEL_LABEL]), []).append(obj)
    for name, values in live.items():
        model = models.get(name)
        if model is None:
            continue
        status, generation = model.get("status") or {}, model["metadata"]["generation"]
        chash = status.get("compileHash")
        if status.get("observedGeneration") != generation or not chash:
            compiled = next((c for c in status.get("conditions") or [] if c.get("type") == "Compiled"), {})
            jobs = [
                (j["metadata"]["name"], (j.get("status") or {}).get("succeeded"))
                for j in by_model.get(("Job", name), [])
            ]
            problems.append(
                f"{name}: status at generation {status.get('observedGeneration')} of {generation}"
                f" ({status.get('phase')}: {compiled.get('message')}; Jobs (name, succeeded) {jobs})"
            )
            continue
        jobs = Counter(j["metadata"]["labels"].get(HASH_LABEL) for j in by_model.get(("Job", name), []))
        if jobs[chash] != 1 or any(n > 1 for n in jobs.values()):
            problems.append(f"{name}: compile Jobs by hash {dict(jobs)}, its hash {chash}")
        made = by_model.get(("Deployment", name), [])
        by_role = Counter(d["metadata"]["labels"].get(ROLE_LABEL) for d in made)
        deps = [d for d in made if d["metadata"]["labels"].get(ROLE_LABEL) == "unified"]
        services = [s for s in by_model.get(("Service", name), []) if s["metadata"]["name"] == name]
        if by_role != {"unified": 1, "router": 1} or len(services) != 1:  # its pods and their front door
            problems.append(f"{name}: Deployments by role {dict(by_role)}, {len(services)} public Services")
            continue
        (dep,) = deps
        template = dep["spec"]["template"]
        command = template["spec"]["containers"][0]["command"]
        slots = command[command.index("--slots") + 1] if "--slots" in command else None
        got = (template["metadata"]["labels"].get(HASH_LABEL), dep["spec"].get("replicas"), slots)
        if got != (chash, values["replicas"], str(values["batch"])):
            problems.append(
                f"{name}: Deployment at (hash, replicas, slots) {got}, wanted "
                f"{(chash, values['replicas'], str(values['batch']))}"
            )
    return problems


def leaderless_writes(audit: list[dict]) -> list[dict]:
    """Every successful write by an operator replica that did not hold the Lease at the time: each write,
    in the order the API server answered, must come from the replica whose Lease write succeeded last."""
    leading, wrong = "", []
    for call in audit:
        if not call["user"].startswith("operator-") or call["verb"] not in WRITES or call["code"] >= 400:
            continue
        if call["resource"] == "leases":
            leading = call["user"]
        elif call["user"] != leading:
            wrong.append({**call, "leading": leading})
    return wrong


def writes_by_user(audit: list[dict]) -> Counter:
    return Counter(c["user"] for c in audit if c["verb"] in WRITES and c["code"] < 400)


# ---- the run ------------------------------------------------------------------------------------------


@dataclass
class Chaos:
    """What to do: how many models, how long the churn lasts, when each fault comes (seconds from the start
    of the churn)."""

    models: int = 300
    seconds: float = 75.0
    rate: float = 6.0  # workload writes a second
    kill_every: float = 15.0
    api_restarts: tuple[float, ...] = (35.0,)
    watch_expiries: tuple[float, ...] = (55.0,)
    replicas: int = 3
    timing: Timing = field(default_factory=Timing)
    seed: int = 0


@dataclass
class Outcome:
    kills: list[tuple[float, str, float | None]]  # (at, user, seconds until another held the Lease)
    restarts: list[tuple[float, float, float | None]]  # (down at, up at, seconds until converged again)
    lags: list[tuple[float, float]]
    seen: list[tuple[str, int, float, float]]  # (model, generation, written at, seconds until reconciled)
    start: float  # when the churn began (monotonic)
    converged_after: float  # seconds from the end of the churn to every model converged
    problems: list[str]
    leaderless: list[dict]
    exits: list[tuple[str, int]]
    errors: list[str]
    writes: Counter
    operator_writes: Counter
    live: dict[str, dict]  # the models left, with the spec values the workload gave them last
    passes: list[float] = field(default_factory=list)  # seconds of each takeover pass (`takeover_passes`)

    def summary(self) -> dict[str, Any]:
        lags = sorted(s for _, s in self.lags)
        failovers = [s for _, _, s in self.kills if s is not None]

        def pct(values: list[float], q: float) -> float | None:
            return values[min(len(values) - 1, int(q * len(values)))] if values else None

        slowest = sorted(self.seen, key=lambda x: -x[3])[:10]
        return {
            "writes": dict(self.writes),
            "reconcile_lag_s": {
                "n": len(lags),
                "p50": pct(lags, 0.5),
                "p99": pct(lags, 0.99),
                "max": lags[-1] if lags else None,
                "slowest": [  # (seconds from the churn's start: compare with the faults' times below)
                    {"model": n, "generation": g, "written_s": round(w - self.start, 1), "lag_s": round(s, 1)}
                    for n, g, w, s in slowest
                ],
            },
            "kills_s": [round(at - self.start, 1) for at, _, _ in self.kills],
            "api_restarts_s": [round(down - self.start, 1) for down, _, _ in self.restarts],
            "failover_s": {
                "n": len(failovers),
                "p50": statistics.median(failovers) if failovers else None,
                "max": max(failovers, default=None),
            },
            "api_restarts": [{"down_s": up - down, "converged_s": c} for down, up, c in self.restarts],
            "takeover_pass_s": {"n": len(self.passes), "max": max(self.passes, default=None)},
            "converged_after_churn_s": self.converged_after,
            "problems": self.problems[:20],
            "leaderless_writes": len(self.leaderless),
            "replica_exits": Counter(code for _, code in self.exits),
            "errors": self.errors[:10],
        }


def converge(plane: ControlPlane, live: dict[str, dict], jobs: JobController, limit: float) -> float:
    """Seconds until wanted_state holds (the Job controller playing on); AssertionError with what still
    differs after `limit`."""
    started, problems = time.monotonic(), ["not checked"]
    while time.monotonic() - started < limit:
        with contextlib.suppress(Unreachable):
            jobs.step()
            problems = wanted_state(plane, live)
            if not problems:
                return time.monotonic() - started
        time.sleep(0.5)
    raise AssertionError(f"not converged after {limit:.0f} s: {problems[:10]}")


def run_chaos(plane: ControlPlane, chaos: Chaos, say=print, converge_limit: float = 600) -> Outcome:
    """The churn with its faults, then the wait for convergence and the checks (not asserted: see Outcome)."""
    watcher = Watcher(plane)
    jobs = JobController(plane)
    workload = Workload(plane, watcher, chaos.models, chaos.rate, chaos.seed)
    stop, errors = threading.Event(), []
    threads = [
        background(watcher.step, stop, 0.25, errors),
        background(jobs.step, stop, 0.5, errors),
        background(plane.supervise, stop, 0.2, errors),
    ]
    while not plane.holder():
        time.sleep(0.1)
    kills: list[tuple[float, str, float | None]] = []
    restarts: list[tuple[float, float, float | None]] = []
    faults = sorted(
        [(t, "restart") for t in chaos.api_restarts]
        + [(t, "expire") for t in chaos.watch_expiries]
        + [(t, "kill") for t in _every(chaos.kill_every, chaos.seconds)]
    )
    start = time.monotonic()
    next_write = start
    try:
        while True:
            now = time.monotonic() - start
            if now >= chaos.seconds and workload.created_all():
                break
            if faults and faults[0][0] <= now:
                _, what = faults.pop(0)
                if what == "kill":
                    leader = plane.holder()
                    if leader and plane.kill(leader):
                        kills.append((time.monotonic(), leader, None))
                        say(f"[{now:5.1f} s] killed the leader {leader}")
                    else:  # between leaders (a failover, a step-down after an outage): the next one is killed
                        faults = sorted([*faults, (now + 0.5, "kill")])
                elif what == "restart":
                    down, up = plane.restart_api()
                    restarts.append((down, up, None))
                    say(f"[{now:5.1f} s] API server restarted ({up - down:.1f} s without it)")
                else:
                    plane.switch(expireWatches=True)
                    say(f"[{now:5.1f} s] every watch expired (410)")
                continue
            if time.monotonic() >= next_write:
                workload.one()
                next_write += 1 / chaos.rate
            time.sleep(max(0.0, min(next_write - time.monotonic(), 0.05)))
        left = len(workload.live)
        say(f"[{time.monotonic() - start:5.1f} s] churn over: {dict(workload.writes)}; {left} models left")
        converged_after = converge(plane, workload.live, jobs, converge_limit)
        while watcher.unreconciled():  # (converged: the watcher sees it within its next reads)
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    kills = [(at, user, _next_holder(watcher.holders, at, user)) for at, user, _ in kills]
    restarts = [(down, up, _settled(watcher.lags, up)) for down, up, _ in restarts]
    audit = plane.audit()
    return Outcome(
        kills=kills,
        restarts=restarts,
        lags=watcher.lags,
        seen=watcher.seen,
        start=start,
        converged_after=converged_after,
        problems=wanted_state(plane, workload.live),
        leaderless=leaderless_writes(audit),
        exits=plane.exits,
        errors=errors,
        writes=workload.writes,
        operator_writes=writes_by_user(audit),
        live=workload.live,
        passes=takeover_passes(plane.state),
    )


LOGGED_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] ")


def takeover_passes(state: Path) -> list[float]:
    """Seconds from each replica's taking the Lease to its log's "every model reconciled once" (its pass over
    every model as it took over; a replica killed before the end of its pass has none), from the replicas'
    logs (the same clock: one machine)."""
    passes = []
    for log in sorted(state.glob("operator-*.log")):
        took = None
        for line in log.read_text(errors="replace").splitlines():
            at = LOGGED_AT.match(line)
            if at is None:
                continue
            when = datetime.datetime.strptime(at.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if " leads (lease " in line:
                took = when
            elif "leading: every model reconciled once" in line and took is not None:
                passes.append(when - took)
                took = None
    return passes


def _every(period: float, until: float) -> list[float]:
    return [period * i for i in range(1, int(until / period) + 1) if period * i < until]


def _next_holder(holders: list[tuple[float, str]], at: float, killed: str) -> float | None:
    """Seconds from `at` until a replica other than `killed` was seen holding the Lease."""
    return next((t - at for t, user in holders if t >= at and user != killed), None)


def _settled(lags: list[tuple[float, float]], up: float) -> float | None:
    """Seconds from `up` until every write made before it was seen reconciled."""
    done = [written + lag for written, lag in lags if written < up]
    return max(done) - up if done else None


# ---- at rest: requests and writes per model, memory ----------------------------------------------------


def idle_calls(plane: ControlPlane, seconds: float) -> dict[str, float]:
    """The operators' requests (and writes) per model and minute over `seconds` of rest, Lease calls apart."""
    before = len(plane.audit())
    time.sleep(seconds)
    calls = [c for c in plane.audit()[before:] if c["user"].startswith("operator-")]
    models = len(plane.items(MODELS))
    lease = [c for c in calls if c["resource"] == "leases"]
    other = [c for c in calls if c["resource"] != "leases"]
    per = 60 / seconds / max(models, 1)
    return {
        "models": models,
        "seconds": seconds,
        "requests_per_model_minute": len(other) * per,
        "writes_per_model_minute": sum(c["verb"] in WRITES for c in other) * per,
        "lease_requests_per_minute": len(lease) * 60 / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=300, help="how long the churn lasts (0: none)")
    parser.add_argument("--out", default="chaos.json", help="the report's name under bench/results/")
    parser.add_argument("--rate", type=float, default=6.0, help="workload writes a second")
    parser.add_argument("--kill-every", type=float, default=15)
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--memory-models", type=int, default=1000, help="0: no memory step")
    parser.add_argument("--chart-timing", action="store_true", help="lease 15 s, renew 10 s, retry 2 s")
    parser.add_argument(
        "--keep", type=Path, help="keep the runs' folders (operators' and API server's logs, audit logs) here"
    )
    args = parser.parse_args()
    timing = Timing(15, 10, 2) if args.chart_timing else Timing()
    third = args.seconds / 3
    chaos = Chaos(
        models=args.models,
        seconds=args.seconds,
        rate=args.rate,
        kill_every=args.kill_every,
        api_restarts=(third + 5, 2 * third + 5),
        watch_expiries=(third * 1.5,),
        timing=timing,
    )
    report: dict[str, Any] = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "timing": timing.__dict__,
        "chaos": {k: v for k, v in chaos.__dict__.items() if k != "timing"},
    }
    with run_folder(args.keep, "chaos") as tmp:
        plane = ControlPlane(Path(tmp), timing, replicas=chaos.replicas)
        try:
            live: dict[str, dict] = {}
            if chaos.seconds > 0:
                outcome = run_chaos(plane, chaos)
                report["outcome"] = outcome.summary()
                print(json.dumps(report["outcome"], indent=2, default=str), flush=True)
                live = outcome.live
            else:
                plane.supervise()  # (run_chaos keeps them itself)
            live = top_up(plane, live, chaos.models)
            report["restart_at_rest"] = reconverged(plane, live)
            print("restart at rest:", report["restart_at_rest"], flush=True)
            time.sleep(10)
            report["idle"] = idle_calls(plane, args.idle_seconds)
            print("idle:", report["idle"], flush=True)
        finally:
            plane.stop()
    if args.memory_models > 0:
        with run_folder(args.keep, "memory") as tmp:
            report["memory"] = memory_at(Path(tmp), args.memory_models, timing, args.idle_seconds)
            print("memory:", report["memory"], flush=True)
    out = ROOT / "bench" / "results" / args.out
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))


@contextlib.contextmanager
def run_folder(keep: Path | None, name: str):
    """A folder for one step's files: `keep`/`name` (made empty, and kept), else a temporary one."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=f"nf-{name}-") as tmp:
            yield tmp
        return
    folder = keep / name
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"--keep: {folder} is not empty; name a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    yield str(folder)


def top_up(plane: ControlPlane, live: dict[str, dict], models: int) -> dict[str, dict]:
    """`models` models again (the churn deleted some), every one converged."""
    live = dict(live)
    for name in (f"m{i:04d}" for i in range(models * 2)):
        if len(live) >= models:
            break
        if name not in live:
            code, body = plane.call("POST", MODELS, manifest(name))
            assert code == 201, (code, body)
            live[name] = {"batch": 4, "replicas": 1}
    converge(plane, live, JobController(plane), limit=600)
    return live


def reconverged(plane: ControlPlane, live: dict[str, dict]) -> dict[str, Any]:
    """An API-server restart with every model converged, then every model changed at once as soon as it
    answers: seconds from the restart's end until the first change and until every change is reconciled, and
    until the last change was sent (`sent_s`: on a loaded machine the API server takes seconds to take them
    all). The models are read while the changes are sent, so a change reconciled before the last is sent is
    seen then (before, they were read only once all were sent, and `first_s` was never less than `sent_s`)."""
    down, up = plane.restart_api()
    watcher = Watcher(plane)
    stop, errors = threading.Event(), []
    reading = background(watcher.step, stop, 0.25, errors)
    try:
        for name, values in live.items():
            values["replicas"] = 3 - values["replicas"]
            patch = {"spec": {"serving": {"unified": {"replicas": values["replicas"]}}}}
            code, body = plane.call("PATCH", f"{MODELS}/{name}", patch, "application/merge-patch+json")
            assert code == 200, (code, body)
            watcher.wrote(name, body["metadata"]["uid"], body["metadata"]["generation"], time.monotonic())
        sent = time.monotonic()
        while watcher.unreconciled():
            time.sleep(0.1)
    finally:
        stop.set()
        reading.join()
    converge(plane, live, JobController(plane), limit=600)
    done = [written + lag - up for written, lag in watcher.lags]
    return {
        "models": len(live),
        "down_s": up - down,
        "sent_s": sent - up,
        "first_s": min(done),
        "all_s": max(done),
        "errors": errors[:10],
    }


def memory_at(state: Path, models: int, timing: Timing, idle_seconds: float = 60) -> dict[str, Any]:
    """The leading replica's resident memory with `models` NeuronModels reconciled (Jobs succeeded), then
    `idle_seconds` at rest with them (its requests and writes per model, as `idle_calls`; 0: none)."""
    plane = ControlPlane(state, timing, replicas=1)
    try:
        plane.supervise()
        jobs = JobController(plane)
        live = {}
        for i in range(models):
            plane.call("POST", MODELS, manifest(f"m{i:04d}"))
            live[f"m{i:04d}"] = {"batch": 4, "replicas": 1}
        converge(plane, live, jobs, limit=1800)
        (user,) = plane.operators
        before = plane.rss_bytes(user)
        time.sleep(10)
        report: dict[str, Any] = {
            "models": models,
            "rss_mib": round(plane.rss_bytes(user) / 2**20, 1),
            "rss_mib_before_rest": round(before / 2**20, 1),
        }
        if idle_seconds > 0:
            report["idle"] = idle_calls(plane, idle_seconds)
            report["rss_mib_after_idle"] = round(plane.rss_bytes(user) / 2**20, 1)
        return report
    finally:
        plane.stop()


if __name__ == "__main__":
    main()
