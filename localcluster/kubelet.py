"""The process kubelet of local mode: beside the emulated API server, through its in-process `ClusterClient`,
it does what a node's kubelet and the built-in controllers would, with local processes.

- PersistentVolumeClaims become folders under the state folder (Bound).
- Jobs get a pod at a time until one succeeds or `backoffLimit` pods failed (Complete / Failed conditions);
  a finished Job with `ttlSecondsAfterFinished` is deleted that long after (the TTL-after-finished
  controller), its pods by garbage collection.
- Deployments get `replicas` pods of their current template, rolled one extra pod at a time: an old pod goes
  only once a new one is ready; a pod whose process dies is restarted (counted); scaling follows replicas.
- Pods run their container's command as a local process (`processes`): ports mapped, volume mounts mapped to
  local folders (PVCs to their folders, a subPath to the folder inside; ConfigMaps and Secrets written out,
  the node's folders and the Secrets' files readable by this user only; emptyDirs per pod), probes at
  their declared periods (`probes`), logs per container instance with per-line times that `kubectl logs`
  reads (`pod_log`, `podlogs`), the termination message from `NEURONFLEET_TERMINATION_LOG`. A deleted pod
  leaves its Services at once, then runs its preStop `sleep` hook, then gets SIGTERM (`processes.stop`).
- What happens is recorded as Events, in the kubelet's and the Job controller's words (`events`).
- The node registers itself as Node `neuronfleet-local` (`node_object`), with the labels and the extended
  resources its settings name (`NodeSettings`: `neuronfleet up --node-label`, `--node-resource`), as a real
  kubelet and its device plugins advertise them: what the operator's Schedulable condition reads. Its
  extended resources are recorded, not enforced: pods asking for more still run.
- Services get EndpointSlices of their ready pods. A ClusterIP Service gets a TCP proxy on 127.0.0.1 whose
  address is published as the Service's `status.loadBalancer.ingress` (the operator reports it as the
  model's endpoint). There is no cluster DNS: every Service name (`name`, `name.ns`, `name.ns.svc`, with its
  port) maps to its ready pods' addresses in a hosts file, which each pod's runtime reads as its static peer
  map (`NEURONFLEET_PEER_HOSTS_FILE`, the env form of `neuronfleet serve --peer-hosts-file`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from neuronfleet.contract import PEER_HOSTS_FILE_ENV, TERMINATION_LOG_ENV

from . import jobs, podlogs
from .events import Recorder, reference
from .guard import private_folder, write_private
from .node_settings import NodeSettings
from .ports import loopback_port
from .probes import Prober, Target
from .processes import (
    POD_IP,
    LocalPod,
    kill,
    map_path,
    mounted_folders,
    pod_status,
    rewrite_command,
    stop,
    supervise,
)
from .semantics import ApiError, now
from .store import ClusterClient

log = logging.getLogger(__name__)

SLICE_SERVICE, SLICE_MANAGER = "kubernetes.io/service-name", "endpointslice.kubernetes.io/managed-by"
MANAGER = "process-kubelet.neuronfleet.dev"
SYNC_INTERVAL = 0.5  # seconds between syncs when nothing changes


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences", []))


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- the node ---------------------------------------------------------------------------------------------

NODE_NAME = "neuronfleet-local"
MAX_PODS = "110"  # the kubelet's default --max-pods
ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}  # GOARCH's names


def node_object(settings: NodeSettings, name: str = NODE_NAME) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Node this kubelet registers and its status: the well-known labels of this machine (hostname, os,
    arch) under the settings' own, capacity and allocatable of its CPUs, memory and pods plus the settings'
    extended resources, and a Ready condition."""
    machine = platform.machine().lower()
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
              "kubernetes.io/arch": ARCH.get(machine, machine)}  # fmt: skip
    labels.update(settings.labels)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
    resources = {"cpu": str(os.cpu_count() or 1), "memory": f"{memory}Ki", "pods": MAX_PODS}
    resources.update(settings.resources)
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {}}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
             "message": "kubelet is posting ready status", "lastHeartbeatTime": now(),
             "lastTransitionTime": now()}  # fmt: skip
    status = {"capacity": dict(resources), "allocatable": dict(resources), "conditions": [ready]}
    return node, status


class ProcessKubelet:
    """Realises the cluster's objects as local processes and proxies; `run()` until cancelled."""

    def __init__(self, cluster: ClusterClient, state: Path, node: NodeSettings | None = None) -> None:
        self.cluster, self.state = cluster, Path(state)
        self.node = node or NodeSettings()
        self.pods: dict[str, LocalPod] = {}  # pod uid -> its process
        self.retiring: set[LocalPod] = set()  # deleted pods in their preStop hook or grace period
        self.proxies: dict[
            str, tuple[asyncio.base_events.Server, int]
        ] = {}  # service uid:port -> (server, port)
        self.backends: dict[str, list[tuple[str, int]]] = {}  # service uid:port -> ready (host, port)
        self.hosts_file = self.state / "hosts.json"
        self.events = Recorder(cluster, "kubelet")
        self.job_events = Recorder(cluster, "job-controller")
        self._turn = 0
        for sub in ("", "volumes", "pods", "logs"):  # (the pods' Secrets and logs: this user's only)
            private_folder(self.state / sub)
        self.hosts_file.write_text("{}")

    # ---- the loop ----

    async def register(self) -> None:
        """The node's Node, made, or (a restart: the API server keeps objects) given this run's labels and
        resources; what others set on it besides (a test's device plugin) stays."""
        node, status = node_object(self.node)
        if self.cluster.get("", "v1", "nodes", None, NODE_NAME) is None:
            await self.cluster.create("", "v1", "nodes", None, node)
        else:
            await self.cluster.patch("", "v1", "nodes", None, NODE_NAME, {"metadata": node["metadata"]})
        await self.cluster.patch_status("", "v1", "nodes", None, NODE_NAME, status)

    async def run(self) -> None:
        await self.register()
        try:
            while True:
                try:
                    await self.sync()
                except Exception:  # one bad object must not stop the node
                    log.exception("process kubelet: sync failed")
                await self.cluster.wait_for_change(SYNC_INTERVAL)
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Stop every process and proxy this kubelet started, deleted pods still in their preStop hook too (no
        hooks now: nothing routes to them)."""
        await asyncio.gather(*(stop(p, hooks=False) for p in [*self.pods.values(), *self.retiring]))
        self.pods.clear()
        self.retiring.clear()
        await self.events.settle()
        await self.job_events.settle()
        for proxy, _ in self.proxies.values():
            proxy.close()
        self.proxies.clear()

    async def patch_status(self, group: str, version: str, plural: str, obj: dict, status: dict) -> None:
        meta = obj["metadata"]
        if obj.get("status") == {**(obj.get("status") or {}), **status}:
            return
        with contextlib.suppress(Exception):  # deleted meanwhile
            await self.cluster.patch_status(
                group, version, plural, meta.get("namespace"), meta["name"], status
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
        for pvc in self.cluster.list("", "v1", "persistentvolumeclaims"):
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
        return [p for p in self.cluster.list("", "v1", "pods") if owned_by(p, uid)]

    async def create_pod(
        self, owner: dict[str, Any], kind: str, template: dict[str, Any], extra_labels: dict
    ) -> str:
        """Create a pod of the owner's template; its name."""
        meta = owner["metadata"]
        labels = {**(template.get("metadata") or {}).get("labels", {}), **extra_labels}
        owner_ref = {"apiVersion": owner["apiVersion"], "kind": kind, "name": meta["name"],
                     "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}  # fmt: skip
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{meta['name']}-",
                "namespace": meta["namespace"],
                "labels": labels,
                "ownerReferences": [owner_ref],
            },
            "spec": {**template["spec"], "nodeName": "local"},
        }
        return (await self.cluster.create("", "v1", "pods", meta["namespace"], pod))["metadata"]["name"]

    async def delete_pod(self, pod: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):
            await self.cluster.delete("", "v1", "pods", pod["metadata"]["namespace"], pod["metadata"]["name"])

    async def sync_jobs(self) -> None:
        for job in self.cluster.list("batch", "v1", "jobs"):
            status = job.get("status") or {}
            if jobs.finished(job):
                await self._expire(job)
                continue
            pods = self.pods_of(job)
            phases = [(p.get("status") or {}).get("phase") for p in pods]
            succeeded, failed = phases.count("Succeeded"), phases.count("Failed")
            active = len(pods) - succeeded - failed
            new: dict[str, Any] = {"active": active, "succeeded": succeeded, "failed": failed}
            limit = (job.get("spec") or {}).get("backoffLimit", 6)
            if succeeded:
                new["conditions"] = [jobs.condition("Complete", "Completed", "the pod's process exited 0")]
                new["completionTime"], new["active"] = now(), 0
                self.job_events.record(reference(job), "Normal", "Completed", "Job completed")
            elif matched := jobs.fail_job_rule(job, pods):
                new["conditions"], new["active"] = [jobs.condition("Failed", "PodFailurePolicy", matched)], 0
                self.job_events.record(reference(job), "Warning", "PodFailurePolicy", matched)
            elif failed > limit:
                # as the Job controller says it (pkg/controller/job): the pods' own reasons stay on the pods
                what = "Job has reached the specified backoff limit"
                new["conditions"], new["active"] = [jobs.condition("Failed", "BackoffLimitExceeded", what)], 0
                self.job_events.record(reference(job), "Warning", "BackoffLimitExceeded", what)
            elif active == 0:
                template = job["spec"]["template"]
                created = await self.create_pod(job, "Job", template, jobs.pod_labels(job))
                self.job_events.record(
                    reference(job), "Normal", "SuccessfulCreate", f"Created pod: {created}"
                )
                new["active"] = 1
                new.setdefault("startTime", status.get("startTime") or now())
            await self.patch_status("batch", "v1", "jobs", job, new)

    async def _expire(self, job: dict[str, Any]) -> None:
        """The TTL-after-finished controller: a finished Job with `spec.ttlSecondsAfterFinished` is deleted
        that long after it finished (`jobs.expired`), its pods with it (the garbage collector deletes them by
        their owner reference)."""
        if not jobs.expired(job, time.time()):
            return
        meta = job["metadata"]
        log.info("job %s/%s: finished, ttl %s s: deleted", meta["namespace"], meta["name"],
                 job["spec"]["ttlSecondsAfterFinished"])  # fmt: skip
        with contextlib.suppress(Exception):  # deleted meanwhile
            await self.cluster.delete("batch", "v1", "jobs", meta["namespace"], meta["name"])

    async def sync_deployments(self) -> None:
        for dep in self.cluster.list("apps", "v1", "deployments"):
            spec = dep.get("spec") or {}
            replicas = spec.get("replicas", 1)
            current = template_hash(spec["template"])
            pods = [p for p in self.pods_of(dep) if not p["metadata"].get("deletionTimestamp")]
            new = [p for p in pods if p["metadata"]["labels"].get("pod-template-hash") == current]
            old = [p for p in pods if p not in new]
            ready_new = [p for p in new if _ready(p)]
            if len(new) < replicas and len(new) + len(old) < replicas + 1:  # surge one pod at a time
                await self.create_pod(dep, "Deployment", spec["template"], {"pod-template-hash": current})
            for extra in sorted(new, key=deletion_rank)[: max(0, len(new) - replicas)]:
                await self.delete_pod(extra)
            keep_old = max(0, replicas - len(ready_new))  # an old pod goes once a new one is ready
            for pod in sorted(old, key=deletion_rank)[: max(0, len(old) - keep_old)]:
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
        for pod in self.cluster.list("", "v1", "pods"):
            if (pod.get("spec") or {}).get("nodeName") != "local":
                continue  # made by hand (e.g. by a test): not this node's
            uid = pod["metadata"]["uid"]
            present[uid] = pod
            if uid not in self.pods and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                self.pods[uid] = await self._start(pod)
            local = self.pods.get(uid)
            if local is not None:
                await self.patch_status("", "v1", "pods", pod, pod_status(pod, local))
        # deleted: out of every Service, then its hook, then stopped
        for uid in [u for u in self.pods if u not in present]:
            gone = self.pods.pop(uid)
            for backends in self.backends.values():
                backends[:] = [b for b in backends if b[1] not in gone.port_numbers.values()]
            gone.stopping = True
            asyncio.get_running_loop().create_task(self._retire(gone))

    async def _retire(self, gone: LocalPod) -> None:
        self.retiring.add(gone)
        try:
            await stop(gone)
        finally:  # cancelled in its hook (the node stopping): `shutdown` still stops its process
            if not gone.running:
                self.retiring.discard(gone)
        self.events.forget(gone.uid)

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
                cm = self.cluster.get("", "v1", "configmaps", ns, volume["configMap"]["name"]) or {}
                for key, value in (cm.get("data") or {}).items():
                    (path / key).write_text(value)
            elif "secret" in volume:
                # the declared mode's owner bits only (the pod's process runs as this user; no other
                # user on the machine reads a Secret), each file made 0600 and replaced whole
                private_folder(path)
                secret = self.cluster.get("", "v1", "secrets", ns, volume["secret"]["secretName"]) or {}
                for key, value in (secret.get("data") or {}).items():
                    write_private(path / key, base64.b64decode(value))
                    (path / key).chmod(volume["secret"].get("defaultMode", 0o644) & 0o700 | 0o400)
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
                    "status.podIP": POD_IP,
                    "metadata.name": pod["metadata"]["name"],
                    "metadata.namespace": ns,
                }.get(path, "")
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = self.cluster.get("", "v1", "secrets", ns, ref["name"]) or {}
                value = (secret.get("data") or {}).get(ref["key"])
                if value is not None:
                    env[item["name"]] = base64.b64decode(value).decode()
        return env

    async def _start(self, pod: dict[str, Any]) -> LocalPod:
        meta, spec = pod["metadata"], pod["spec"]
        folder = self.state / "pods" / f"{meta['namespace']}_{meta['name']}"  # logs: as /var/log/pods
        folder.mkdir(parents=True, exist_ok=True)
        container = spec["containers"][0]
        ports: dict[str, int] = {}
        numbers: dict[int, int] = {}
        for p in container.get("ports", []):
            local = loopback_port()
            numbers[p["containerPort"]] = local
            ports[p.get("name") or str(p["containerPort"])] = local
            ports[str(p["containerPort"])] = local
        volumes = self._volumes(pod, folder)
        mounts = mounted_folders(container, volumes)
        local = LocalPod(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta["uid"],
            folder=folder,
            log_dir=self.state / "logs" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}",
            ports=ports,
            port_numbers=numbers,
            restart_policy=spec.get("restartPolicy", "Always"),
            grace_seconds=float(spec.get("terminationGracePeriodSeconds", 30)),
            pre_stop=(container.get("lifecycle") or {}).get("preStop"),
            container=container["name"],
        )
        involved = reference(pod, f"spec.containers{{{container['name']}}}")
        local.event = lambda type_, reason, message: self.events.record(involved, type_, reason, message)
        command = rewrite_command(
            [*container.get("command", []), *container.get("args", [])], numbers, mounts
        )
        env = {
            **os.environ,
            **self._env(pod, container, mounts),
            TERMINATION_LOG_ENV: str(folder / "termination-log"),
            PEER_HOSTS_FILE_ENV: str(self.hosts_file),
            "HOME": str(folder),
        }
        local.prober = Prober(
            container,
            Target(
                running=lambda: local.running,
                instance=lambda: local.instance,
                started_at=lambda: local.started_mono,
                port=local.ports.get,
                host=POD_IP,
                kill=lambda why: kill(local, why),
                changed=self.cluster.wake,
                container=container["name"],
                event=local.event,
            ),
        )
        local.prober.start()
        loop = asyncio.get_running_loop()
        local.tasks.append(loop.create_task(supervise(local, command, env, self.cluster.wake)))
        log.info("pod %s/%s: %s", local.namespace, local.name, " ".join(command))
        return local

    # ---- services ----

    async def sync_services(self) -> None:
        hosts: dict[str, list[str]] = {}
        seen = set()
        all_pods = self.cluster.list("", "v1", "pods")
        for svc in self.cluster.list("", "v1", "services"):
            meta, spec = svc["metadata"], svc.get("spec") or {}
            uid = meta["uid"]
            seen.add(uid)
            ready = [
                p
                for p in all_pods
                if p["metadata"]["namespace"] == meta["namespace"]
                and _ready(p)
                and not p["metadata"].get("deletionTimestamp")  # terminating: no new connection (kube-proxy)
                and matches(spec.get("selector") or {}, p["metadata"].get("labels") or {})
                and p["metadata"]["uid"] in self.pods
            ]
            published = [  # the local ports its proxy had (kept over a restart of the fleet: `down`, `up`)
                q.get("port") or 0
                for i in ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
                for q in i.get("ports") or []
            ]
            for index, port in enumerate(spec.get("ports", [])):
                target = str(port.get("targetPort", port["port"]))
                backends = [(POD_IP, self.pods[p["metadata"]["uid"]].ports.get(target)) for p in ready]
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
                    before = published[index] if index < len(published) else 0
                    self.proxies[key] = await self._proxy(key, before)
            await self._endpoint_slices(svc, ready)
            if spec.get("clusterIP") != "None" and spec.get("ports"):
                ports = [
                    {"port": self.proxies[f"{uid}:{p['port']}"][1], "protocol": "TCP"} for p in spec["ports"]
                ]
                ingress = [{"ip": "127.0.0.1", "ports": ports}]
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
        wanted = {}
        for pod in ready:
            local = self.pods[pod["metadata"]["uid"]]
            ports = []
            for p in svc["spec"].get("ports", []):
                port = local.ports.get(str(p.get("targetPort", p["port"])))
                if port:
                    ports.append({"name": p.get("name", ""), "port": port, "protocol": "TCP"})
            name = f"{meta['name']}-{pod['metadata']['name']}"[:63].rstrip("-")
            target = {
                "kind": "Pod",
                "namespace": ns,
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            }
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
                "endpoints": [{"addresses": [POD_IP], "conditions": {"ready": True}, "targetRef": target}],
                "ports": ports,
            }
        existing = {
            o["metadata"]["name"]
            for o in self.cluster.list("discovery.k8s.io", "v1", "endpointslices")
            if o["metadata"]["namespace"] == ns
            and (o["metadata"].get("labels") or {}).get(SLICE_SERVICE) == meta["name"]
            and (o["metadata"].get("labels") or {}).get(SLICE_MANAGER) == MANAGER
        }
        for name in existing - set(wanted):
            with contextlib.suppress(Exception):
                await self.cluster.delete("discovery.k8s.io", "v1", "endpointslices", ns, name)
        for name in set(wanted) - existing:
            with contextlib.suppress(Exception):
                await self.cluster.create("discovery.k8s.io", "v1", "endpointslices", ns, wanted[name])

    async def _proxy(self, key: str, port: int = 0) -> tuple[asyncio.base_events.Server, int]:
        """A TCP proxy on 127.0.0.1 to the Service's ready pods, one after another (like kube-proxy); on
        `port` if it is free (the one the Service had before a restart), else on a free one."""

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

        try:
            server = await asyncio.start_server(handle, "127.0.0.1", port or loopback_port())
        except OSError:  # taken meanwhile: the model's endpoint moves (the operator reports the new one)
            server = await asyncio.start_server(handle, "127.0.0.1", loopback_port())
        return server, server.sockets[0].getsockname()[1]

    # ---- logs ----

    def pod_log(self, namespace: str, name: str, query: dict[str, str]) -> AsyncIterator[bytes]:
        """`kubectl logs`: the container's log under the request's PodLogOptions (`podlogs`), from the current
        instance or, with `previous`, the one before; refused as the kubelet words it
        (pkg/kubelet/kubelet_pods.go, validateContainerLogStatus) and the API server checks the container
        (pkg/registry/core/pod/strategy.go, LogLocation). Checked before the first byte is sent."""
        pod = self.cluster.get("", "v1", "pods", namespace, name)
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found', name=name, kind="pods")
        options = podlogs.LogOptions.from_query(query)
        container = pod["spec"]["containers"][0]["name"]
        if options.container and options.container != container:
            raise ApiError(400, "BadRequest", f"container {options.container} is not valid for pod {name}")
        local = self.pods.get(pod["metadata"]["uid"])
        if options.previous:
            if local is None or local.last_state is None:
                what = f'previous terminated container "{container}" in pod "{name}" not found'
                raise ApiError(400, "BadRequest", what)
            return podlogs.follow(local.log_file(local.last_instance), options, lambda: False)
        if local is None or local.instance < 0:
            raise ApiError(
                400, "BadRequest",
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating',
            )  # fmt: skip
        instance = local.instance
        return podlogs.follow(
            local.log_file(instance), options, lambda: local.instance == instance and local.writing
        )


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


def deletion_rank(pod: dict[str, Any]) -> tuple:
    """A sort key putting first the pod a scale-down deletes first, in the ReplicaSet controller's order
    (Kubernetes 1.32, pkg/controller/controller_utils.go `ActivePodsWithRanks.Less`; the annotation:
    https://kubernetes.io/docs/concepts/workloads/controllers/replicaset/#pod-deletion-cost): unscheduled,
    then by phase (Pending, Unknown, Running), not ready, the lower `pod-deletion-cost`, ready the shorter
    time, more restarts, created later. (Every local pod is on the one node, so the controller's
    co-location rank is equal for all.) A real API server refuses a cost that is not an int32; here one
    counts as 0."""
    meta, status = pod["metadata"], pod.get("status") or {}
    try:
        cost = int((meta.get("annotations") or {}).get(DELETION_COST, "0"))
    except ValueError:
        cost = 0
    if not -(2**31) <= cost < 2**31:
        cost = 0
    conditions = status.get("conditions") or []
    ready_at = next((c.get("lastTransitionTime") or "" for c in conditions if c.get("type") == "Ready"), "")
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or [])
    created = meta.get("creationTimestamp") or ""
    return (
        bool((pod.get("spec") or {}).get("nodeName")),
        PHASE_RANK.get(status.get("phase", "Pending"), 3),
        _ready(pod),
        cost,
        _Descending(ready_at),  # ready later (shorter) first
        -restarts,
        _Descending(created),  # newer first
    )


class _Descending(str):
    """A string that sorts in reverse (RFC 3339 timestamps: later first)."""

    def __lt__(self, other: str) -> bool:
        return str.__gt__(self, other)

    def __gt__(self, other: str) -> bool:
        return str.__lt__(self, other)
