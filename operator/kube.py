"""The operator's one door to the Kubernetes API: reading, creating, patching and deleting objects, the
NeuronModel status subresource, Events, and the LISTs and WATCHes behind the operator's caches, over aiohttp
with credentials from a kubeconfig or the pod's service account.

Every call the operator makes is declared in RBAC_RULES (API group, resource, verbs), LEASE_RULES or, for a
feature the chart must opt into, OPT_IN_RULES; `Kube` refuses any other, so the chart's RBAC can be derived
from these tables and checked against them.

Reads of a kind the attached `cache.Cache` watches are answered from it (no request); requests are bounded:
at most MAX_IN_FLIGHT at once and QPS per second on average (bursts of BURST), like client-go's client-side
rate limiter (https://pkg.go.dev/k8s.io/client-go/rest#Config: QPS, Burst).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import aiohttp
import yaml

from . import spec

if TYPE_CHECKING:
    from .cache import Cache

# (API group, resource) -> verbs the operator uses. The chart's RBAC is exactly this (plus kopf's own).
RBAC_RULES: dict[tuple[str, str], tuple[str, ...]] = {
    (spec.GROUP, spec.PLURAL): ("get", "list", "watch", "patch"),
    (spec.GROUP, f"{spec.PLURAL}/status"): ("patch",),
    # list and watch: the operator's caches (cache.py); get: only on a create's 409 AlreadyExists
    ("", "persistentvolumeclaims"): ("get", "list", "watch", "create"),  # created only (CREATE_ONLY)
    # the model's internal token (reconcile.apply_secret): made once, never changed, never deleted (its
    # model's garbage collection does), read by name (no list or watch: the cache holds no Secret); get
    # also reads an hf:// model's secretRef, by name, for its length check at apply (reconcile.model_limit)
    ("", "secrets"): ("get", "create"),
    ("", "configmaps"): ("get", "list", "watch", "create", "patch"),
    # delete (reconcile: rollout.stale, rollout.superseded_jobs, rollout.retry_due): another serving set's
    # objects once the public Service left it, those of roles no longer in the spec, NetworkPolicies no
    # longer asked for, superseded and retried compile Jobs
    ("", "services"): ("get", "list", "watch", "create", "patch", "delete"),
    ("apps", "deployments"): ("get", "list", "watch", "create", "patch", "delete"),
    ("batch", "jobs"): ("get", "list", "watch", "create", "delete"),
    ("policy", "poddisruptionbudgets"): ("get", "list", "watch", "create", "patch", "delete"),
    ("networking.k8s.io", "networkpolicies"): ("get", "list", "watch", "create", "patch", "delete"),
    ("", "events"): ("create",),
    # the compile pod's termination message (the artifacts' manifest); why serving pods are not ready
    ("", "pods"): ("list", "watch"),
    # a running compile pod's progress lines (reconcile.compile_progress): the tail of its log, read only
    ("", "pods/log"): ("get",),
    # autoscaling.provider hpa or keda (scaling.build_autoscaler): made, kept as built, deleted when the
    # provider changes; get: apply's read (these kinds are not cached)
    ("autoscaling", "horizontalpodautoscalers"): ("get", "create", "patch", "delete"),
    ("keda.sh", "scaledobjects"): ("get", "create", "patch", "delete"),
    # provider builtin (autoscale_loop.py): the serving pods' addresses and ports to read /metrics from, as a
    # real cluster's Service routing and Prometheus' endpointslice discovery find them
    ("discovery.k8s.io", "endpointslices"): ("list",),
    # serving.gateway (gateway.py): made, kept as built, deleted when a spec change drops them; get: apply's
    # read and that check (these kinds are not cached: a cluster may not serve them)
    ("inference.networking.k8s.io", "inferencepools"): ("get", "create", "patch", "delete"),
    ("gateway.networking.k8s.io", "httproutes"): ("get", "create", "patch", "delete"),
}
# Granted only where a chart value opts in (the value's name -> rules), used only where the operator is told
# so: rbac.podDeletionCost, a scale-down's pod-deletion-cost annotations (autoscale_loop.
# POD_DELETION_COST_ENV) so that the idlest pods go first; without it the ReplicaSet controller chooses. A pod
# patch can change its image: cluster-wide, close to running anything anywhere
OPT_IN_RULES: dict[str, dict[tuple[str, str], tuple[str, ...]]] = {
    "podDeletionCost": {("", "pods"): ("patch",)},
}
# Leader election (leader.py), in the operator's own namespace only (the chart's Role there): the Lease, and
# the Events that say who leads
LEASE_RULES: dict[tuple[str, str], tuple[str, ...]] = {
    ("coordination.k8s.io", "leases"): ("get", "create", "update"),
    ("", "events"): ("create",),
}
# A request refused for load (429: API Priority and Fairness; 503) is sent again, after its Retry-After (at
# most RETRY_WAIT_MAX s) or a doubling wait, up to RETRIES times; so is a read whose connection failed
RETRIES, RETRY_WAIT_MAX = 5, 10.0
MAX_IN_FLIGHT = 16  # requests at once (watches not counted: they wait for changes, not for the server)
QPS, BURST = 100.0, 200  # requests per second on average, and in a burst (watches included)
API_VERSIONS = {  # kind -> (group, version, resource)
    "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),
    "ConfigMap": ("", "v1", "configmaps"),
    "Pod": ("", "v1", "pods"),
    "Service": ("", "v1", "services"),
    "Deployment": ("apps", "v1", "deployments"),
    "Job": ("batch", "v1", "jobs"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "Secret": ("", "v1", "secrets"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
    "Event": ("", "v1", "events"),
    "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
    "ScaledObject": ("keda.sh", "v1alpha1", "scaledobjects"),
    "EndpointSlice": ("discovery.k8s.io", "v1", "endpointslices"),
    "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
    "Lease": ("coordination.k8s.io", "v1", "leases"),
    spec.KIND: (spec.GROUP, spec.VERSION, spec.PLURAL),
}


def unreachable(error: BaseException) -> bool:
    """The error says the API server could not be reached (not that it answered with an error)."""
    return isinstance(error, aiohttp.ClientConnectionError | OSError | TimeoutError)


def retry_after(headers: Any, attempt: int) -> float:
    """Seconds to wait before the next try: the answer's Retry-After (seconds), else 0.5 s doubling."""
    try:
        wait = float(headers.get("Retry-After", ""))
    except ValueError:
        wait = 0.5 * 2**attempt
    return min(max(wait, 0.0), RETRY_WAIT_MAX)


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class NotLeading(KubeError):
    """A write refused because this replica does not lead (leader election)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


@dataclass
class Credentials:
    server: str
    token: str | None = None
    ssl_context: ssl.SSLContext | bool | None = None


def _data_file(data: str, suffix: str) -> str:
    f = tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False)  # noqa: SIM115 (lives with the process)
    f.write(base64.b64decode(data))
    f.close()
    return f.name


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """From a kubeconfig (KUBECONFIG or ~/.kube/config), else the in-cluster service account."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    if Path(path).is_file():
        cfg = yaml.safe_load(Path(path).read_text())
        ctx_name = cfg.get("current-context")
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next((u["user"] for u in cfg.get("users", []) if u["name"] == ctx.get("user")), {})
        ssl_ctx: ssl.SSLContext | bool | None = None
        if cluster["server"].startswith("https"):
            if cluster.get("insecure-skip-tls-verify"):
                ssl_ctx = False
            else:
                ca = cluster.get("certificate-authority") or (
                    _data_file(cluster["certificate-authority-data"], ".crt")
                    if "certificate-authority-data" in cluster
                    else None
                )
                ssl_ctx = ssl.create_default_context(cafile=ca)
                cert = user.get("client-certificate") or (
                    _data_file(user["client-certificate-data"], ".crt")
                    if "client-certificate-data" in user
                    else None
                )
                key = user.get("client-key") or (
                    _data_file(user["client-key-data"], ".key") if "client-key-data" in user else None
                )
                if cert and key:
                    ssl_ctx.load_cert_chain(cert, key)
        return Credentials(cluster["server"].rstrip("/"), user.get("token"), ssl_ctx)
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    if host and sa.is_dir():
        ctx = ssl.create_default_context(cafile=str(sa / "ca.crt"))
        return Credentials(f"https://{host}:{port}", (sa / "token").read_text().strip(), ctx)
    raise KubeError(0, f"no kubeconfig at {path} and not running in a cluster")


def object_path(
    group: str, version: str, resource: str, namespace: str | None, name: str | None = None
) -> str:
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{resource}"
    return base + (f"/{name}" if name else "")


class RateLimit:
    """A token bucket: `take` returns at once while tokens are left, else when the next one is due."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps, self.burst = qps, burst
        self._tokens, self._at = float(burst), None

    async def take(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            elapsed = 0.0 if self._at is None else now - self._at
            self._tokens, self._at = min(self.burst, self._tokens + elapsed * self.qps), now
            if self._tokens >= 1:
                self._tokens -= 1
                return
            await asyncio.sleep((1 - self._tokens) / self.qps)


class Kube:
    """An async client limited to the operator's declared calls (RBAC_RULES); reads come from `cache` for the
    kinds it watches."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self.cache: Cache | None = None
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._rate = RateLimit(QPS, BURST)
        # leader election: whether this replica may write now (None: always); the Lease's own writes pass
        self.may_write: Callable[[], bool] | None = None

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json"}
            if self.credentials.token:
                headers["Authorization"] = f"Bearer {self.credentials.token}"
            connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context, limit=MAX_IN_FLIGHT + 32)
            # a watch event is one line holding a whole object: room for large ones
            self._session = aiohttp.ClientSession(headers=headers, connector=connector, read_bufsize=1 << 22)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @staticmethod
    def _allowed(group: str, resource: str, verb: str) -> None:
        declared = [RBAC_RULES, LEASE_RULES, *OPT_IN_RULES.values()]
        if verb not in [v for rules in declared for v in rules.get((group, resource), ())]:
            raise KubeError(
                403, f"the operator does not {verb} {resource} in group {group!r} (not in RBAC_RULES)"
            )

    async def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json"):
        lease = "/leases" in path
        if method != "GET" and self.may_write is not None and not lease and not self.may_write():
            raise NotLeading("this operator replica does not lead (leader election): it writes nothing")
        session = await self.session()
        headers = {"Content-Type": content_type} if body is not None else {}
        for attempt in range(RETRIES + 1):
            # the Lease's own calls never wait behind the reconciles' (client-go gives leader election its
            # own client): a renewal starved by a busy queue would lose the lead
            async with contextlib.nullcontext() if lease else self._in_flight:
                if not lease:
                    await self._rate.take()
                try:
                    async with session.request(
                        method, self.credentials.server + path, json=body, headers=headers
                    ) as response:
                        payload = await response.json(content_type=None)
                        status, wait = response.status, retry_after(response.headers, attempt)
                except aiohttp.ClientConnectionError:
                    if method != "GET" or lease or attempt == RETRIES:  # (a write may have been applied)
                        raise
                    status, payload, wait = 0, None, retry_after({}, attempt)
            if status in (429, 503, 0) and attempt < RETRIES:
                await asyncio.sleep(wait)  # (outside the bound on requests in flight)
                continue
            if status >= 400:
                raise KubeError(status, (payload or {}).get("message", str(payload)))
            break
        if self.cache is not None and isinstance(payload, dict) and "metadata" in payload:
            if method in ("POST", "PATCH"):
                self.cache.stored(payload)  # the operator's own write, cached at once
            elif method == "DELETE" and not payload["metadata"].get("finalizers"):
                self.cache.forget(payload)  # gone (an object with finalizers stays until they are done)
        return payload

    async def answers(self) -> bool:
        """The API server answers now (GET /version, with any status), within 5 s."""
        session = await self.session()
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with session.get(self.credentials.server + "/version", timeout=timeout) as response:
                await response.read()
                return True
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def get(self, kind: str, namespace: str, name: str, live: bool = False) -> dict[str, Any] | None:
        """The object, or None; from the cache where it watches the kind, unless `live`."""
        if not live and self.cache is not None and self._cached(kind, namespace):
            return await self.cache.get(kind, namespace, name)
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "get")
        try:
            return await self._call("GET", object_path(group, version, resource, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def _cached(self, kind: str, namespace: str | None) -> bool:
        return self.cache is not None and self.cache.watches(kind, namespace)

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        group, _, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "list")
        if self.cache is not None and self._cached(kind, namespace):
            cached = await self.cache.list(kind, namespace, label_selector)
            if cached is not None:
                return cached
        return (await self.list_all(kind, namespace, label_selector))[0]

    async def list_all(
        self, kind: str, namespace: str | None, label_selector: str
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A live LIST (in one namespace, or all): the items, each with its kind, and the list's
        resourceVersion, from which a watch continues."""
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "list")
        path = object_path(group, version, resource, namespace)
        if label_selector:
            path += "?labelSelector=" + quote(label_selector)
        payload = await self._call("GET", path)
        api_version = f"{group}/{version}" if group else version
        items = [{"apiVersion": api_version, "kind": kind, **o} for o in payload.get("items") or []]
        return items, (payload.get("metadata") or {}).get("resourceVersion")

    async def watch(
        self, kind: str, namespace: str | None, label_selector: str, resource_version: str, timeout: float
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) of each change after `resource_version` until the server ends the request after
        `timeout` seconds; type ERROR carries a Status (410: the resourceVersion is too old)."""
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "watch")
        query = {"watch": "true", "resourceVersion": resource_version, "timeoutSeconds": str(int(timeout))}
        query["allowWatchBookmarks"] = "true"
        if label_selector:
            query["labelSelector"] = label_selector
        path = object_path(group, version, resource, namespace) + "?" + urlencode(query)
        session = await self.session()
        await self._rate.take()
        limit = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=timeout + 60)
        async with session.get(self.credentials.server + path, timeout=limit) as response:
            if response.status >= 400:
                payload = await response.json(content_type=None)
                if response.status == 410:
                    yield "ERROR", payload
                    return
                raise KubeError(response.status, (payload or {}).get("message", str(payload)))
            async for line in response.content:
                if line.strip():
                    event = json.loads(line)
                    yield event["type"], event["object"]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        group, version, resource = API_VERSIONS[obj["kind"]]
        self._allowed(group, resource, "create")
        path = object_path(group, version, resource, obj["metadata"]["namespace"])
        return await self._call("POST", path, obj)

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "patch")
        path = object_path(group, version, resource, namespace, name)
        return await self._call("PATCH", path, patch, "application/merge-patch+json")

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete an object, its dependents in the background (the garbage collector; Jobs would orphan
        their pods by default: https://kubernetes.io/docs/concepts/workloads/controllers/job/#job-termination-and-cleanup);
        False when it was gone already."""
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "delete")
        path = object_path(group, version, resource, namespace, name) + "?propagationPolicy=Background"
        try:
            await self._call("DELETE", path)
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    async def replace_lease(self, lease: dict[str, Any]) -> dict[str, Any]:
        """PUT a Lease as read and changed: its resourceVersion makes a write that lost a race a 409."""
        self._allowed("coordination.k8s.io", "leases", "update")
        meta = lease["metadata"]
        path = object_path("coordination.k8s.io", "v1", "leases", meta["namespace"], meta["name"])
        return await self._call("PUT", path, lease)

    async def pod_log(self, namespace: str, name: str, tail_lines: int) -> str | None:
        """The last `tail_lines` lines of a pod's log (its only container), or None when the pod is gone or
        its container has not started (https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/
        pod-v1/#get-read-log-of-the-specified-pod: tailLines; plain text)."""
        self._allowed("", "pods/log", "get")
        path = object_path("", "v1", "pods", namespace, name) + f"/log?tailLines={int(tail_lines)}"
        session = await self.session()
        async with self._in_flight:
            await self._rate.take()
            async with session.get(self.credentials.server + path) as response:
                if response.status in (400, 404):  # gone, or (400) waiting to start: no log yet
                    return None
                if response.status >= 400:
                    payload = await response.json(content_type=None)
                    raise KubeError(response.status, (payload or {}).get("message", str(payload)))
                return await response.text(errors="replace")

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self._allowed(spec.GROUP, f"{spec.PLURAL}/status", "patch")
        path = object_path(spec.GROUP, spec.VERSION, spec.PLURAL, namespace, name) + "/status"
        return await self._call("PATCH", path, {"status": status}, "application/merge-patch+json")

    async def post_event(self, about: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about an object (https://kubernetes.io/docs/reference/kubernetes-api/
        cluster-resources/event-v1/): type Normal or Warning, a reason, a message."""
        meta = about["metadata"]
        at = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": about.get("apiVersion", spec.API_VERSION),
                "kind": about.get("kind", spec.KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": (message or reason)[:1024],
            "source": {"component": "neuronfleet-operator"},
            "reportingComponent": "neuronfleet-operator",
            "firstTimestamp": at,
            "lastTimestamp": at,
            "count": 1,
        }
        await self.create(event)
