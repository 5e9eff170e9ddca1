"""The operator's one door to the Kubernetes API: reading, creating, patching and deleting objects, the
NeuronModel status subresource, Events, and the few live LISTs (kopf watches: operator/watching.py).
Every request goes through the official client's `ApiClient` (kubernetes_asyncio), logged in by
`login.Login` (a kubeconfig: token, tokenFile, client certificates, exec plugins; or the pod's service
account); answers stay plain dicts.
A request the API server refuses with 401 logs in again (a rotated token file, an expired exec token) and is
sent once more.

Every call the operator makes is declared in RBAC_RULES (API group, resource, verbs), LEASE_RULES or, for a
feature the chart must opt into, OPT_IN_RULES; `Kube` refuses any other, so the chart's RBAC can be derived
from these tables and checked against them.

Reads of a kind kopf watches are answered from its indexes (`watching.Observed`, attached as `cache`: no
request); requests are bounded:
at most MAX_IN_FLIGHT at once and QPS per second on average (bursts of BURST), like client-go's client-side
rate limiter (https://pkg.go.dev/k8s.io/client-go/rest#Config: QPS, Burst).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from kubernetes_asyncio.client import ApiClient

from . import login, spec

if TYPE_CHECKING:
    from .watching import Observed

log = logging.getLogger(__name__)

# (API group, resource) -> verbs the operator uses. The chart's RBAC is exactly this (plus kopf's own).
RBAC_RULES: dict[tuple[str, str], tuple[str, ...]] = {
    (spec.GROUP, spec.PLURAL): ("get", "list", "watch", "patch"),
    (spec.GROUP, f"{spec.PLURAL}/status"): ("patch",),
    # list and watch: kopf's watches (watching.py); get: only on a create's 409 AlreadyExists
    ("", "persistentvolumeclaims"): ("get", "list", "watch", "create"),  # created only (CREATE_ONLY)
    # the model's internal token (reconcile.apply_secret): made once, never changed, never deleted (its
    # model's garbage collection does), read by name (no list or watch: kopf watches no Secret); get
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
    # neuron.deviceAllocation dra (devices.py): each Neuron pod kind's claim template, named by its content
    # (a template's spec cannot change), deleted once no pod kind names it (rollout.stale)
    ("resource.k8s.io", "resourceclaimtemplates"): ("get", "list", "watch", "create", "patch", "delete"),
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
# patch can change its image: cluster-wide, close to running anything anywhere. rbac.readNodes (on by default;
# node_watch.READ_NODES_ENV): what the nodes offer (node_watch.py: kopf's watches, and one LIST of at most one
# object each at start), for the Schedulable condition; cluster-scoped kinds, so a ClusterRole of its own in
# either watch mode, and read only
OPT_IN_RULES: dict[str, dict[tuple[str, str], tuple[str, ...]]] = {
    "podDeletionCost": {("", "pods"): ("patch",)},
    "readNodes": {
        ("", "nodes"): ("list", "watch"),
        ("resource.k8s.io", "resourceslices"): ("list", "watch"),
        ("resource.k8s.io", "deviceclasses"): ("list", "watch"),
    },
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
CONNECTIONS = MAX_IN_FLIGHT + 32  # the client's connections at most: the requests in flight and the watches
REQUEST_TIMEOUT = 300.0  # seconds a request (not a watch) may take in all (aiohttp's session default)
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
    "ResourceClaimTemplate": ("resource.k8s.io", "v1", "resourceclaimtemplates"),
    "Event": ("", "v1", "events"),
    "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
    "ScaledObject": ("keda.sh", "v1alpha1", "scaledobjects"),
    "EndpointSlice": ("discovery.k8s.io", "v1", "endpointslices"),
    "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
    "Lease": ("coordination.k8s.io", "v1", "leases"),
    "Node": ("", "v1", "nodes"),
    "ResourceSlice": ("resource.k8s.io", "v1", "resourceslices"),
    "DeviceClass": ("resource.k8s.io", "v1", "deviceclasses"),
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
    """The API server's refusal: its status code, its message and its answer's headers (Retry-After)."""

    def __init__(self, status: int, message: str, headers: Any = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.headers = status, dict(headers or {})


class NotLeading(KubeError):
    """A write refused because this replica does not lead (leader election)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


def load_credentials(kubeconfig: str | None = None) -> login.Login:
    """The login a `Kube` is made with: from `kubeconfig`, else the operator process's one login
    (`login.operator_login()`: KUBECONFIG, ~/.kube/config or the pod's service account), which kopf's login
    handler shares. login.LoginError when there is none."""
    return login.Login(kubeconfig) if kubeconfig is not None else login.operator_login()


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
    kinds it watches. Requests go through the official client's ApiClient, made on the event loop that first
    sends one (a `Kube` serves one loop: the Lease's thread makes its own)."""

    def __init__(self, credentials: login.Login) -> None:
        """`credentials`: the login its requests are sent with (`load_credentials`)."""
        self.login = credentials
        self.cache: Observed | None = None
        self._api: ApiClient | None = None
        self._transport: tuple | None = None  # what `_api` was made for (login.Credentials.transport)
        self._retired: list[ApiClient] = []  # made for an earlier transport: closed with this client
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._rate = RateLimit(QPS, BURST)
        # leader election: whether this replica may write now (None: always); the Lease's own writes pass
        self.may_write: Callable[[], bool] | None = None

    async def close(self) -> None:
        for client in [*self._retired, *([self._api] if self._api is not None else [])]:
            await client.close()
        self._api, self._retired = None, []

    def _client_for(self, credentials: login.Credentials) -> ApiClient:
        if self._api is None or self._transport != credentials.transport():
            if self._api is not None:  # (watches may still read from it: it is closed with this client)
                self._retired.append(self._api)
            self._api, self._transport = credentials.api_client(CONNECTIONS), credentials.transport()
        return self._api

    async def _send(
        self, method: str, path: str, query: list[tuple[str, str]] | None = None, body: Any = None,
        content_type: str = "application/json", timeout: float | aiohttp.ClientTimeout = REQUEST_TIMEOUT,
    ) -> aiohttp.ClientResponse:  # fmt: skip
        """One request through the official client (its answer unread: the caller reads and releases it);
        an answer 401 logs in again (a rotated token, an expired exec token) and sends it once more."""
        used: login.Credentials | None = None
        while True:
            try:
                credentials = await self.login.credentials(stale=used)
            except login.LoginError as e:
                raise KubeError(401, f"cannot log in: {e}") from None
            headers = {"Accept": "application/json", "Content-Type": content_type}
            response = await self._client_for(credentials).call_api(
                path, method, query_params=query or [], header_params=headers, body=body,
                auth_settings=["BearerToken"], _request_auth=credentials.request_auth(),
                _preload_content=False, _request_timeout=timeout,
            )  # fmt: skip
            if response.status != 401 or used is not None:
                return response
            response.release()
            log.info("the API server refused the credentials of %s (401): logging in again", credentials.user)
            used = credentials

    @staticmethod
    def _allowed(group: str, resource: str, verb: str) -> None:
        declared = [RBAC_RULES, LEASE_RULES, *OPT_IN_RULES.values()]
        if verb not in [v for rules in declared for v in rules.get((group, resource), ())]:
            raise KubeError(
                403, f"the operator does not {verb} {resource} in group {group!r} (not in RBAC_RULES)"
            )

    async def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ):  # fmt: skip
        lease = "/leases" in path
        if method != "GET" and self.may_write is not None and not lease and not self.may_write():
            raise NotLeading("this operator replica does not lead (leader election): it writes nothing")
        for attempt in range(RETRIES + 1):
            # the Lease's own calls never wait behind the reconciles' (client-go gives leader election its
            # own client): a renewal starved by a busy queue would lose the lead
            async with contextlib.nullcontext() if lease else self._in_flight:
                if not lease:
                    await self._rate.take()
                sent = time.monotonic()  # (what the cache's watch delivered after this is not older than it)
                try:
                    async with await self._send(method, path, query, body, content_type) as response:
                        payload = await response.json(content_type=None)
                        status, wait = response.status, retry_after(response.headers, attempt)
                        answered = response.headers
                except aiohttp.ClientConnectionError:
                    if method != "GET" or lease or attempt == RETRIES:  # (a write may have been applied)
                        raise
                    status, payload, wait, answered = 0, None, retry_after({}, attempt), {}
            if status in (429, 503, 0) and attempt < RETRIES:
                await asyncio.sleep(wait)  # (outside the bound on requests in flight)
                continue
            if status >= 400:
                raise KubeError(status, (payload or {}).get("message", str(payload)), answered)
            break
        if self.cache is not None and isinstance(payload, dict) and "metadata" in payload:
            if method in ("POST", "PATCH"):
                self.cache.stored(payload, sent)  # the operator's own write, cached at once
            elif method == "DELETE" and not payload["metadata"].get("finalizers"):
                self.cache.forget(payload, sent)  # gone (an object with finalizers stays until they are done)
        return payload

    async def readable(self, kind: str) -> bool | None:
        """Whether the operator may list `kind` (a cluster-scoped one) here: one LIST of at most one object.
        True; False where the API server refuses it (403); None where it serves no such kind (404)."""
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "list")
        try:
            await self._call("GET", object_path(group, version, resource, None), query=[("limit", "1")])
        except KubeError as e:
            if e.status in (403, 404):
                return None if e.status == 404 else False
            raise
        return True

    async def answers(self) -> bool:
        """The API server answers now (GET /version, with any status), within 5 s."""
        try:
            async with await self._send("GET", "/version", timeout=5) as response:
                await response.read()
                return True
        except (aiohttp.ClientError, OSError, TimeoutError, KubeError):
            return False

    async def get(self, kind: str, namespace: str, name: str, live: bool = False) -> dict[str, Any] | None:
        """The object, or None; from kopf's indexes where they hold the kind, unless `live`."""
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
        query = [("labelSelector", label_selector)] if label_selector else []
        payload = await self._call("GET", path, query=query)
        api_version = f"{group}/{version}" if group else version
        items = [{"apiVersion": api_version, "kind": kind, **o} for o in payload.get("items") or []]
        return items, (payload.get("metadata") or {}).get("resourceVersion")

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
        path = object_path(group, version, resource, namespace, name)
        try:
            await self._call("DELETE", path, query=[("propagationPolicy", "Background")])
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
        path = object_path("", "v1", "pods", namespace, name) + "/log"
        async with self._in_flight:
            await self._rate.take()
            async with await self._send("GET", path, [("tailLines", str(int(tail_lines)))]) as response:
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
