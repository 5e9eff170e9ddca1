"""The operator's one door to the Kubernetes API: reading, creating, patching and deleting objects, and the
NeuronModel status subresource, over aiohttp with credentials from a kubeconfig or the pod's service account.

Every call the operator makes is declared in RBAC_RULES (API group, resource, verbs); `Kube` refuses any
other, so the chart's RBAC can be derived from this table and checked against it.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import yaml

from . import spec

# (API group, resource) -> verbs the operator uses. The chart's RBAC is exactly this (plus kopf's own).
RBAC_RULES: dict[tuple[str, str], tuple[str, ...]] = {
    (spec.GROUP, spec.PLURAL): ("get", "list", "watch", "patch"),
    (spec.GROUP, f"{spec.PLURAL}/status"): ("patch",),
    ("", "persistentvolumeclaims"): ("get", "create"),  # created only (reconcile.CREATE_ONLY)
    # delete (reconcile: rollout.stale, rollout.superseded_jobs, rollout.retry_due): another serving set's
    # objects once the public Service left it, those of roles no longer in the spec, superseded and retried
    # compile Jobs; list: finding a model's Deployments, Services and PDBs of other sets
    ("", "secrets"): ("get", "create", "delete"),  # the internal token: created once, never changed
    ("", "configmaps"): ("get", "create", "patch"),
    ("", "services"): ("get", "list", "create", "patch", "delete"),
    ("apps", "deployments"): ("get", "list", "watch", "create", "patch", "delete"),
    ("batch", "jobs"): ("get", "list", "watch", "create", "delete"),  # list and watch: kopf's and ours
    ("policy", "poddisruptionbudgets"): ("get", "list", "create", "patch", "delete"),
    ("networking.k8s.io", "networkpolicies"): ("get", "create", "patch", "delete"),
    ("", "events"): ("create",),
    ("", "pods"): ("list",),  # the compile pod's termination message: the artifacts' manifest
}
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
    spec.KIND: (spec.GROUP, spec.VERSION, spec.PLURAL),
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


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


class Kube:
    """An async client limited to the operator's declared calls (RBAC_RULES)."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._session: aiohttp.ClientSession | None = None

    async def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json"}
            if self.credentials.token:
                headers["Authorization"] = f"Bearer {self.credentials.token}"
            connector = aiohttp.TCPConnector(ssl=self.credentials.ssl_context)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @staticmethod
    def _allowed(group: str, resource: str, verb: str) -> None:
        if verb not in RBAC_RULES.get((group, resource), ()):
            raise KubeError(
                403, f"the operator does not {verb} {resource} in group {group!r} (not in RBAC_RULES)"
            )

    async def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json"):
        session = await self.session()
        headers = {"Content-Type": content_type} if body is not None else {}
        async with session.request(
            method, self.credentials.server + path, json=body, headers=headers
        ) as response:
            payload = await response.json(content_type=None)
            if response.status >= 400:
                raise KubeError(response.status, (payload or {}).get("message", str(payload)))
            return payload

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "get")
        try:
            return await self._call("GET", object_path(group, version, resource, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        group, version, resource = API_VERSIONS[kind]
        self._allowed(group, resource, "list")
        path = object_path(group, version, resource, namespace) + "?labelSelector=" + quote(label_selector)
        return (await self._call("GET", path))["items"]

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

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self._allowed(spec.GROUP, f"{spec.PLURAL}/status", "patch")
        path = object_path(spec.GROUP, spec.VERSION, spec.PLURAL, namespace, name) + "/status"
        return await self._call("PATCH", path, {"status": status}, "application/merge-patch+json")
