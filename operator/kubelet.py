"""The process kubelet of local mode (DESIGN.md section 8): inside the emulated API server's process it does
what a node's kubelet and the built-in controllers would, with local processes.

- PersistentVolumeClaims become folders under the state folder (Bound).
- Jobs get a pod at a time until one succeeds or `backoffLimit` pods failed (Complete / Failed conditions).
- Deployments get `replicas` pods of their current template, rolled one extra pod at a time: an old pod goes
  only once a new one is ready; a pod whose process dies is restarted (counted); scaling follows replicas.
- Pods run their container's command as a process on 127.0.0.1: the installed `neuronfleet` stands in for
  the image, each declared container port is mapped to a free port (the `--port`/`--kv-port` arguments are
  rewritten), `--host 0.0.0.0` becomes 127.0.0.1, and every volume mount's container path is mapped to a
  local folder in the arguments and environment (PVCs to their folders; ConfigMaps and Secrets written out;
  emptyDirs per pod). Readiness comes from the readiness probe; logs go to files that `kubectl logs` reads;
  the termination message from `NEURONFLEET_TERMINATION_LOG`. Neuron and EFA requests are recorded in the
  pod's status (condition `DevicesEnforced` False), not enforced.
- Services get EndpointSlices of their ready pods. A ClusterIP Service gets a TCP proxy on 127.0.0.1 whose
  address is published as the Service's `status.loadBalancer.ingress` (the operator reports it as the
  model's endpoint); there is no cluster DNS, so Service names map to the ready pods' "host:port" in a
  hosts file each pod's runtime reads as its static peer map (`NEURONFLEET_PEER_HOSTS_FILE`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .apiserver import error, now

log = logging.getLogger(__name__)

PORT_FLAGS = ("--port", "--kv-port")
DEVICE_RESOURCES = ("aws.amazon.com/neuron", "aws.amazon.com/neuroncore", "vpc.amazonaws.com/efa")
MAX_GRACE_SECONDS = 10.0
SLICE_SERVICE, SLICE_MANAGER = "kubernetes.io/service-name", "endpointslice.kubernetes.io/managed-by"
MANAGER = "process-kubelet.neuronfleet.dev"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences", []))


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def map_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A container path (or `--flag=path`) with its mount's local folder in place of the mount path."""
    flag, eq, rest = value.partition("=") if value.startswith("--") and "=" in value else ("", "", value)
    for mount, local in mounts:  # longest mount paths first
        if rest == mount or rest.startswith(mount + "/"):
            return f"{flag}{eq}{local}{rest[len(mount) :]}"
    return value


def rewrite_command(command: list[str], ports: dict[int, int], mounts: list[tuple[str, Path]]) -> list[str]:
    """The container's command as it runs here: ports mapped, 0.0.0.0 -> 127.0.0.1, container paths mapped."""
    out: list[str] = []
    for i, arg in enumerate(command):
        before = command[i - 1] if i else ""
        if before in PORT_FLAGS and arg.isdigit() and int(arg) in ports:
            arg = str(ports[int(arg)])
        elif before == "--host" and arg in ("0.0.0.0", "::"):
            arg = "127.0.0.1"
        else:
            arg = map_path(arg, mounts)
        out.append(arg)
    if out and out[0] == "neuronfleet":  # the image's entry point: the installed command
        out[0] = shutil.which("neuronfleet") or str(Path(sys.executable).parent / "neuronfleet")
    return out


@dataclass(eq=False)
class LocalPod:
    """A pod's process and what the kubelet knows of it."""

    namespace: str
    name: str
    uid: str
    folder: Path
    log_path: Path
    ports: dict[str, int]  # container port name (or number) -> local port
    port_numbers: dict[int, int]  # container port -> local port
    restart_always: bool
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    ready: bool = False
    exit_code: int | None = None
    message: str = ""
    started_at: str = ""
    tasks: list[asyncio.Task] = field(default_factory=list)
    stopping: bool = False


class ProcessKubelet:
    """Realises the emulated API server's objects as local processes and proxies; `run()` until cancelled."""

    def __init__(self, server, state: Path) -> None:
        self.server, self.state = server, Path(state)
        self.pods: dict[str, LocalPod] = {}  # pod uid -> its process
        self.proxies: dict[str, tuple[asyncio.base_events.Server, int]] = {}  # service uid -> (server, port)
        self.backends: dict[str, list[tuple[str, int]]] = {}  # service uid -> ready (host, port)
        self.hosts_file = self.state / "hosts.json"
        self._turn = 0
        for sub in ("volumes", "pods", "logs"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("{}")
        server.pod_log = self.pod_log  # `kubectl logs` reads the pod's log file

    # ---- the loop ----

    def _wake(self) -> None:
        """Run a sync soon (a process died, a readiness changed)."""
        asyncio.get_running_loop().create_task(self.server._notify())

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.sync()
                except Exception:  # one bad object must not stop the node
                    log.exception("process kubelet: sync failed")
                async with self.server.changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.server.changed.wait(), 0.5)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every process and proxy this kubelet started."""
        await asyncio.gather(*(self._stop(p) for p in list(self.pods.values())))
        self.pods.clear()
        for proxy, _ in self.proxies.values():
            proxy.close()
        self.proxies.clear()

    def objects(self, plural: str, group: str = "", version: str = "v1") -> list[dict[str, Any]]:
        return [
            o
            for (g, v, p, _, _), o in list(self.server.objects.items())
            if (g, v, p) == (group, version, plural)
        ]

    def kind(self, group: str, version: str, plural: str):
        return self.server.kinds[(group, version, plural)]

    async def patch_status(self, group: str, version: str, plural: str, obj: dict, status: dict) -> None:
        meta = obj["metadata"]
        if obj.get("status") == {**(obj.get("status") or {}), **status}:
            return
        with contextlib.suppress(Exception):  # deleted meanwhile
            await self.server.patch(
                self.kind(group, version, plural),
                meta.get("namespace"),
                meta["name"],
                {"status": status},
                "application/merge-patch+json",
                "status",
                {},
            )

    async def sync(self) -> None:
        await self.sync_claims()
        await self.sync_jobs()
        await self.sync_deployments()
        await self.sync_pods()
        await self.sync_services()

    # ---- claims ----

    def claim_folder(self, namespace: str, claim: str) -> Path:
        path = self.state / "volumes" / namespace / claim
        path.mkdir(parents=True, exist_ok=True)
        return path

    async def sync_claims(self) -> None:
        for pvc in self.objects("persistentvolumeclaims"):
            if (pvc.get("status") or {}).get("phase") != "Bound":
                self.claim_folder(pvc["metadata"]["namespace"], pvc["metadata"]["name"])
                spec = pvc.get("spec") or {}
                capacity = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
                status = {
                    "phase": "Bound",
                    "accessModes": spec.get("accessModes", []),
                    "capacity": {"storage": capacity},
                }
                await self.patch_status("", "v1", "persistentvolumeclaims", pvc, status)

    # ---- controllers: Jobs and Deployments make pods ----

    def pods_of(self, owner: dict[str, Any]) -> list[dict[str, Any]]:
        uid = owner["metadata"]["uid"]
        return [p for p in self.objects("pods") if owned_by(p, uid)]

    async def create_pod(
        self, owner: dict[str, Any], kind: str, template: dict[str, Any], extra_labels: dict
    ) -> None:
        meta = owner["metadata"]
        labels = {**(template.get("metadata") or {}).get("labels", {}), **extra_labels}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{meta['name']}-",
                "namespace": meta["namespace"],
                "labels": labels,
                "ownerReferences": [
                    {
                        "apiVersion": owner["apiVersion"],
                        "kind": kind,
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": {**template["spec"], "nodeName": "local"},
        }
        await self.server.create(self.kind("", "v1", "pods"), meta["namespace"], pod, {})

    async def delete_pod(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await self.server.delete(
                self.kind("", "v1", "pods"), pod["metadata"]["namespace"], pod["metadata"]["name"]
            )

    async def sync_jobs(self) -> None:
        for job in self.objects("jobs", "batch"):
            status = job.get("status") or {}
            if any(
                c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                for c in status.get("conditions", [])
            ):
                continue
            pods = self.pods_of(job)
            phases = [(p.get("status") or {}).get("phase") for p in pods]
            succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
            active = len(pods) - succeeded - failed
            new: dict[str, Any] = {"active": active, "succeeded": succeeded, "failed": failed}
            limit = (job.get("spec") or {}).get("backoffLimit", 6)
            if succeeded:
                new["conditions"] = [
                    {
                        "type": "Complete",
                        "status": "True",
                        "reason": "Completed",
                        "message": "the pod's process exited 0",
                    }
                ]
                new["completionTime"] = now()
            elif failed > limit:
                last = next(p for p in reversed(pods) if (p.get("status") or {}).get("phase") == "Failed")
                message = _termination(last)
                new["conditions"] = [
                    {
                        "type": "Failed",
                        "status": "True",
                        "reason": "BackoffLimitExceeded",
                        "message": f"{failed} pods failed; the last: {message}"[:1000],
                    }
                ]
            elif active == 0:
                job_uid = job["metadata"]["uid"]
                await self.create_pod(
                    job,
                    "Job",
                    job["spec"]["template"],
                    {"job-name": job["metadata"]["name"], "controller-uid": job_uid},
                )
                new["active"] = 1
                new.setdefault("startTime", status.get("startTime") or now())
            await self.patch_status("batch", "v1", "jobs", job, new)

    async def sync_deployments(self) -> None:
        for dep in self.objects("deployments", "apps"):
            spec = dep.get("spec") or {}
            replicas = spec.get("replicas", 1)
            current = template_hash(spec["template"])
            pods = [p for p in self.pods_of(dep) if not p["metadata"].get("deletionTimestamp")]
            new = [p for p in pods if p["metadata"]["labels"].get("pod-template-hash") == current]
            old = [p for p in pods if p not in new]
            ready_new = [p for p in new if _ready(p)]
            if len(new) < replicas and len(new) + len(old) < replicas + 1:  # surge one pod at a time
                await self.create_pod(dep, "Deployment", spec["template"], {"pod-template-hash": current})
            for extra in sorted(new, key=_ready)[: max(0, len(new) - replicas)]:
                await self.delete_pod(extra)
            keep_old = max(0, replicas - len(ready_new))  # an old pod goes once a new one is ready
            for pod in sorted(old, key=_ready)[: max(0, len(old) - keep_old)]:
                await self.delete_pod(pod)
            ready = sum(_ready(p) for p in pods)
            status = {
                "observedGeneration": dep["metadata"].get("generation", 1),
                "replicas": len(pods),
                "updatedReplicas": len(new),
                "readyReplicas": ready,
                "availableReplicas": ready,
            }
            await self.patch_status("apps", "v1", "deployments", dep, status)

    # ---- pods: processes ----

    async def sync_pods(self) -> None:
        present = {}
        for pod in self.objects("pods"):
            if (pod.get("spec") or {}).get("nodeName") != "local":
                continue  # made by hand (e.g. by a test): not this node's
            uid = pod["metadata"]["uid"]
            present[uid] = pod
            if uid not in self.pods and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                self.pods[uid] = await self._start(pod)
            local = self.pods.get(uid)
            if local is not None:
                await self.patch_status("", "v1", "pods", pod, self._pod_status(pod, local))
        for uid in [u for u in self.pods if u not in present]:  # deleted: out of every Service, then stopped
            gone = self.pods.pop(uid)
            for backends in self.backends.values():
                backends[:] = [b for b in backends if b[1] not in gone.port_numbers.values()]
            gone.stopping = True
            asyncio.get_running_loop().create_task(self._stop(gone))

    def _volumes(self, pod: dict[str, Any], folder: Path) -> dict[str, Path]:
        ns = pod["metadata"]["namespace"]
        out: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes", []):
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                out[name] = self.claim_folder(ns, volume["persistentVolumeClaim"]["claimName"])
                continue
            path = folder / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                cm = self.server.get("", "v1", "configmaps", ns, volume["configMap"]["name"]) or {}
                for key, value in (cm.get("data") or {}).items():
                    (path / key).write_text(value)
            elif "secret" in volume:
                secret = self.server.get("", "v1", "secrets", ns, volume["secret"]["secretName"]) or {}
                for key, value in (secret.get("data") or {}).items():
                    (path / key).write_bytes(base64.b64decode(value))
                    (path / key).chmod(volume["secret"].get("defaultMode", 0o644) & 0o777 | 0o400)
            out[name] = path
        return out

    def _env(self, pod: dict[str, Any], container: dict[str, Any], mounts) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for item in container.get("env", []):
            source = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = map_path(str(item["value"]), mounts)
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[item["name"]] = {
                    "status.podIP": "127.0.0.1",
                    "metadata.name": pod["metadata"]["name"],
                    "metadata.namespace": ns,
                }.get(path, "")
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.server.get("", "v1", "secrets", ns, ref["name"]) or {}
                value = (secret.get("data") or {}).get(ref["key"])
                if value is not None:
                    env[item["name"]] = base64.b64decode(value).decode()
        return env

    async def _start(self, pod: dict[str, Any]) -> LocalPod:
        meta, spec = pod["metadata"], pod["spec"]
        folder = self.state / "pods" / f"{meta['namespace']}_{meta['name']}"
        folder.mkdir(parents=True, exist_ok=True)
        container = spec["containers"][0]
        ports: dict[str, int] = {}
        numbers: dict[int, int] = {}
        for p in container.get("ports", []):
            local = free_port()
            numbers[p["containerPort"]] = local
            ports[p.get("name") or str(p["containerPort"])] = local
            ports[str(p["containerPort"])] = local
        volumes = self._volumes(pod, folder)
        mounts = sorted(
            (
                (m["mountPath"], volumes[m["name"]])
                for m in container.get("volumeMounts", [])
                if m["name"] in volumes and m["mountPath"] != "/dev/shm"
            ),
            key=lambda m: -len(m[0]),
        )
        local = LocalPod(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            folder=folder,
            log_path=self.state / "logs" / f"{meta['namespace']}_{meta['name']}.log",
            ports=ports,
            port_numbers=numbers,
            restart_always=spec.get("restartPolicy", "Always") == "Always",
        )
        command = rewrite_command(
            [*container.get("command", []), *container.get("args", [])], numbers, mounts
        )
        env = {
            **os.environ,
            **self._env(pod, container, mounts),
            "NEURONFLEET_TERMINATION_LOG": str(folder / "termination-log"),
            "NEURONFLEET_PEER_HOSTS_FILE": str(self.hosts_file),
            "HOME": str(folder),
        }
        local.tasks.append(asyncio.get_running_loop().create_task(self._supervise(local, command, env)))
        probe = container.get("readinessProbe")
        local.tasks.append(asyncio.get_running_loop().create_task(self._probe(local, probe)))
        log.info("pod %s/%s: %s", local.namespace, local.name, " ".join(command))
        return local

    async def _supervise(self, pod: LocalPod, command: list[str], env: dict[str, str]) -> None:
        """Run the process; restart it when it dies (restartPolicy Always), with a growing delay."""
        delay = 1.0
        while not pod.stopping:
            with open(pod.log_path, "ab") as out:
                pod.started_at = now()
                pod.process = await asyncio.create_subprocess_exec(
                    *command,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    cwd=pod.folder,
                    start_new_session=True,
                )
            (pod.folder / "pid").write_text(str(pod.process.pid))
            pod.exit_code = await pod.process.wait()
            pod.ready = False
            termination = pod.folder / "termination-log"
            pod.message = termination.read_text() if termination.is_file() else ""
            if not pod.message and pod.exit_code != 0:  # FallbackToLogsOnError
                pod.message = pod.log_path.read_bytes()[-2048:].decode(errors="replace")
            if pod.stopping or not pod.restart_always:
                return
            pod.restarts += 1
            log.warning(
                "pod %s/%s exited %s; restarting (%d)", pod.namespace, pod.name, pod.exit_code, pod.restarts
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
            pod.exit_code = None
            self._wake()

    async def _probe(self, pod: LocalPod, probe: dict[str, Any] | None) -> None:
        period = float((probe or {}).get("periodSeconds", 1))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while not pod.stopping:
                running = pod.process is not None and pod.process.returncode is None
                ready = running
                if running and probe and "httpGet" in probe:
                    port = pod.ports.get(str(probe["httpGet"]["port"]))
                    try:
                        async with session.get(
                            f"http://127.0.0.1:{port}{probe['httpGet'].get('path', '/')}"
                        ) as r:
                            ready = 200 <= r.status < 400
                    except (aiohttp.ClientError, OSError, TimeoutError):
                        ready = False
                if ready != pod.ready:
                    pod.ready = ready
                    self._wake()
                await asyncio.sleep(min(period, 1.0))

    async def _stop(self, pod: LocalPod) -> None:
        pod.stopping = True
        proc = pod.process
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), MAX_GRACE_SECONDS)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        for task in pod.tasks:
            task.cancel()
        log.info("pod %s/%s stopped", pod.namespace, pod.name)

    def _pod_status(self, pod: dict[str, Any], local: LocalPod) -> dict[str, Any]:
        running = local.process is not None and local.process.returncode is None
        finished = not local.restart_always and local.exit_code is not None
        if finished:
            phase = "Succeeded" if local.exit_code == 0 else "Failed"
            state: dict[str, Any] = {
                "terminated": {
                    "exitCode": local.exit_code,
                    "message": local.message[:4096],
                    "reason": "Completed" if local.exit_code == 0 else "Error",
                }
            }
        elif running:
            phase, state = "Running", {"running": {"startedAt": local.started_at}}
        else:
            phase, state = (
                ("Running" if local.restarts else "Pending"),
                {"waiting": {"reason": "ContainerCreating"}},
            )
        container = pod["spec"]["containers"][0]
        limits = (container.get("resources") or {}).get("limits") or {}
        devices = {k: v for k, v in limits.items() if k in DEVICE_RESOURCES}
        conditions = [{"type": "Ready", "status": "True" if local.ready else "False"}]
        if devices:
            conditions.append(
                {
                    "type": "DevicesEnforced",
                    "status": "False",
                    "reason": "LocalMode",
                    "message": "recorded, not enforced (local mode has no devices): "
                    + ", ".join(f"{k}={v}" for k, v in sorted(devices.items())),
                }
            )
        return {
            "phase": phase,
            "podIP": "127.0.0.1",
            "hostIP": "127.0.0.1",
            "conditions": conditions,
            "containerStatuses": [
                {
                    "name": container["name"],
                    "ready": local.ready,
                    "restartCount": local.restarts,
                    "image": container.get("image", ""),
                    "state": state,
                }
            ],
        }

    # ---- services ----

    async def sync_services(self) -> None:
        hosts: dict[str, list[str]] = {}
        seen = set()
        for svc in self.objects("services"):
            meta, spec = svc["metadata"], svc.get("spec") or {}
            uid = meta["uid"]
            seen.add(uid)
            ready = [
                p
                for p in self.objects("pods")
                if p["metadata"]["namespace"] == meta["namespace"]
                and _ready(p)
                and matches(spec.get("selector") or {}, p["metadata"].get("labels") or {})
                and p["metadata"]["uid"] in self.pods
            ]
            for port in spec.get("ports", []):
                target = str(port.get("targetPort", port["port"]))
                backends = [("127.0.0.1", self.pods[p["metadata"]["uid"]].ports.get(target)) for p in ready]
                backends = [b for b in backends if b[1]]
                key = f"{uid}:{port['port']}"
                self.backends[key] = backends
                for name in (
                    meta["name"],
                    f"{meta['name']}.{meta['namespace']}",
                    f"{meta['name']}.{meta['namespace']}.svc",
                ):
                    hosts[f"{name}:{port['port']}"] = [f"{h}:{p}" for h, p in backends]
                if spec.get("clusterIP") != "None" and key not in self.proxies:
                    self.proxies[key] = await self._proxy(key)
            await self._endpoint_slices(svc, ready)
            if spec.get("clusterIP") != "None" and spec.get("ports"):
                ingress = [
                    {
                        "ip": "127.0.0.1",
                        "ports": [
                            {"port": self.proxies[f"{uid}:{p['port']}"][1], "protocol": "TCP"}
                            for p in spec["ports"]
                        ],
                    }
                ]
                await self.patch_status("", "v1", "services", svc, {"loadBalancer": {"ingress": ingress}})
        for key in [k for k in self.proxies if k.split(":")[0] not in seen]:
            self.proxies.pop(key)[0].close()
            self.backends.pop(key, None)
        text = json.dumps(hosts, sort_keys=True)
        if self.hosts_file.read_text() != text:
            tmp = self.hosts_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.rename(self.hosts_file)

    async def _endpoint_slices(self, svc: dict[str, Any], ready: list[dict[str, Any]]) -> None:
        """One EndpointSlice per ready pod of the Service (each pod has its own local ports)."""
        meta, ns = svc["metadata"], svc["metadata"]["namespace"]
        kind = self.kind("discovery.k8s.io", "v1", "endpointslices")
        wanted = {}
        for pod in ready:
            local = self.pods[pod["metadata"]["uid"]]
            ports = []
            for p in svc["spec"].get("ports", []):
                port = local.ports.get(str(p.get("targetPort", p["port"])))
                if port:
                    ports.append({"name": p.get("name", ""), "port": port, "protocol": "TCP"})
            name = f"{meta['name']}-{pod['metadata']['name']}"[:63].rstrip("-")
            wanted[name] = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": {SLICE_SERVICE: meta["name"], SLICE_MANAGER: MANAGER},
                    "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Service", "name": meta["name"], "uid": meta["uid"]}
                    ],
                },
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": ["127.0.0.1"],
                        "conditions": {"ready": True},
                        "targetRef": {
                            "kind": "Pod",
                            "namespace": ns,
                            "name": pod["metadata"]["name"],
                            "uid": pod["metadata"]["uid"],
                        },
                    }
                ],
                "ports": ports,
            }
        existing = {
            o["metadata"]["name"]
            for o in self.objects("endpointslices", "discovery.k8s.io")
            if o["metadata"]["namespace"] == ns
            and (o["metadata"].get("labels") or {}).get(SLICE_SERVICE) == meta["name"]
            and (o["metadata"].get("labels") or {}).get(SLICE_MANAGER) == MANAGER
        }
        for name in existing - set(wanted):
            with contextlib.suppress(Exception):
                await self.server.delete(kind, ns, name)
        for name in set(wanted) - existing:
            with contextlib.suppress(Exception):
                await self.server.create(kind, ns, wanted[name], {})

    async def _proxy(self, key: str) -> tuple[asyncio.base_events.Server, int]:
        """A TCP proxy on 127.0.0.1 to the Service's ready pods, one after another (like kube-proxy)."""

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            backends = list(self.backends.get(key, []))
            self._turn += 1
            for i in range(len(backends)):
                host, port = backends[(self._turn + i) % len(backends)]
                try:
                    up_reader, up_writer = await asyncio.open_connection(host, port)
                except OSError:
                    continue
                await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
                return
            writer.close()  # no ready pod: the client sees the connection refused-like close

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    # ---- logs ----

    def pod_log(self, namespace: str, name: str) -> str:
        path = self.state / "logs" / f"{namespace}_{name}.log"
        if not path.is_file():
            raise error(404, "NotFound", f'no log for pod "{name}" in namespace "{namespace}"')
        return path.read_text(errors="replace")


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


def _termination(pod: dict[str, Any]) -> str:
    for s in (pod.get("status") or {}).get("containerStatuses", []):
        terminated = (s.get("state") or {}).get("terminated")
        if terminated:
            return terminated.get("message") or f"exit code {terminated.get('exitCode')}"
    return "no termination message"
