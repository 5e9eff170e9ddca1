"""The emulated Kubernetes API server's HTTP face, for tests and the local mode: URL routing, discovery, the
OpenAPI documents (`openapi`; /openapi/v2 in JSON or protobuf: `openapi_v2`, `openapi_proto`), request
bodies (JSON, YAML, the protobuf of typed kubectl creates: `protobuf`), tables (`tables`), watch streams,
Status errors, an audit log and a clean stop, on aiohttp, over the object store (`store`) and the semantics
(`semantics`); every request passes `guard` first: its Host must name this server, it must carry a bearer
token of the token table (401 Unauthorized otherwise, but for /healthz, /livez, /readyz and /version), and
a body must be in a media type the API decodes (415 otherwise).

What it does like a real API server: uid, resourceVersion (409 Conflict on a stale write), generation (bumped
when anything but metadata and status changes), creationTimestamp; 201 on create, generateName; GET, LIST
(label and field selectors), WATCH (from a resourceVersion, with timeouts); PUT, merge patch, JSON patch,
strategic merge patch (lists of named items merged by name) and apply patches (as merges); the status and
scale subresources kept apart from the main resource (/scale reads and writes an autoscaling/v1 Scale);
finalizers and deletionTimestamp; ownerReference garbage collection (background or orphan); namespaces that
must exist; names checked by the kind's DNS rule; defaults of built-in kinds (a Job's selector and pod
labels, a Service's cluster IP from 10.96.0.0/12); CustomResourceDefinitions that add resources, whose
openAPIV3Schema is enforced on create and update (defaults applied, unknown fields pruned or refused under
fieldValidation=Strict, types and bounds checked, x-kubernetes-validations evaluated as CEL); server-side
tables on LIST, GET and every watch event (`kubectl get` columns, a CRD's additionalPrinterColumns); a
bounded watch history (410 Expired beyond it).

What it does not: authorization (every user the token table names may do anything), admission webhooks, field
managers of server-side apply, the built-in controllers (the process kubelet in the local mode plays them),
protobuf bodies of kinds other than Namespace, Secret, ConfigMap, ServiceAccount, Service, Deployment and
Job (and of fields of theirs not known in `protobuf`: refused with 415, not dropped), paged LISTs (`limit` is
ignored; everything comes in one page).

`python -m neuronfleet.localcluster.apiserver` runs it (with `--kubelet-state`, the process kubelet too).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import signal
import ssl
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp.web

from . import openapi, openapi_proto, openapi_v2, protobuf, tls
from .guard import (
    ADMIN,
    Tokens,
    admin_table,
    authenticate,
    check_body_type,
    check_host,
    format_tokens,
    media_type,
    write_private,
)
from .semantics import ApiError, Resource, scale_view
from .store import HISTORY, Expired, Store
from .tables import table
from .tls import kubeconfig

if TYPE_CHECKING:
    from .node_settings import NodeSettings

log = logging.getLogger(__name__)

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
SHUTDOWN_GRACE = 10.0  # seconds a request in flight may take to finish once the server is told to stop
SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-neuronfleet-emulated",
    "platform": "linux/amd64",
}


@dataclass
class ResourcePath:
    """What a resource URL names: /api/v1/namespaces/NS/pods/NAME/log is ("", "v1", "pods", NS, NAME,
    "log")."""

    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    subresource: str | None

    @classmethod
    def parse(cls, path: str) -> ResourcePath | None:
        """None for a path that names no resource (discovery, /version...). /api/v1/namespaces/x is the
        namespace x, not the namespaced path of x."""
        segs = [s for s in path.split("/") if s]
        if segs[:1] == ["api"] and len(segs) >= 2:
            group, version, rest = "", segs[1], segs[2:]
        elif segs[:1] == ["apis"] and len(segs) >= 3:
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            return None
        ns = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
            ns, rest = rest[1], rest[2:]
        if not rest:
            return None
        plural, name, sub = [*rest, None, None][:3]
        return cls(group, version, plural, ns, name, sub)


class EmulatedAPIServer:
    """Answers Kubernetes REST requests from a store to the users `tokens` names (by default one fresh token,
    for ADMIN: `tokens.token_of(ADMIN)`); `pod_logs(namespace, name, query)` (the log's chunks) backs
    `kubectl logs` where something runs the pods."""

    def __init__(
        self,
        store: Store | None = None,
        pod_logs: Callable[[str, str, dict[str, str]], AsyncIterator[bytes]] | None = None,
        audit_log: str | None = None,
        fault_switches: bool = False,
        tokens: Tokens | None = None,
    ) -> None:
        self.store = store or Store()
        self.tokens = tokens or Tokens(table=admin_table())
        # /openapi/v2 for one revision of the kinds: (revision, ETag, body by content type)
        self._v2_cache: tuple[tuple[str, int], str, dict[str, bytes]] | None = None
        self.pod_logs = pod_logs
        self.audit_log = audit_log  # a file: one JSON line per resource request (user, verb, resource)
        self.faults = Faults() if fault_switches else None

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0, context: ssl.SSLContext | None = None
    ) -> str:
        """Listen on host:port (0: a free port), over HTTPS with a TLS `context` (kubectl sends a token over
        HTTPS only: `tls`); returns the server's URL (`stop` ends it)."""
        self.handler, self.context = aiohttp.web.Server(self), context
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(self.handler, host, port, ssl=context)
        self.address = (host, self.listener.sockets[0].getsockname()[1])
        return f"{'https' if context else 'http'}://{host}:{self.address[1]}"

    async def outage(self, seconds: float) -> None:
        """What a restart does to the clients (a fault switch): every connection is dropped, none is taken for
        `seconds`, and no resourceVersion so far can be resumed from; the objects stay (as etcd keeps them),
        and so does what runs beside the server (the process kubelet and its pods, as a node's do)."""
        await asyncio.sleep(OUTAGE_DELAY)  # (the switch's own answer goes out first)
        self.listener.close()
        for connection in self.handler.connections:
            connection.force_close()
        await self.store.expire_watches()
        await asyncio.sleep(seconds)
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(self.handler, *self.address, ssl=self.context)

    async def stop(self) -> None:
        """No new connections, every watch ends (its stream closes cleanly), idle kept-alive connections close
        at once, and requests in flight get a grace period, then are cancelled."""
        self.listener.close()
        await self.store.close()
        for connection in self.handler.connections:  # (aiohttp would wait the grace for idle ones too)
            connection.close()
        await self.handler.shutdown(SHUTDOWN_GRACE)

    async def __call__(self, request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """One request; refusals become Status objects, and a bug here answers 500 and the server goes on.
        A request from elsewhere than this server's own Host, or without a valid token, is refused before its
        body is read."""
        code = 500
        try:
            check_host(request.headers.get("Host"), self.address[1], self.address[0])
            request["user"] = authenticate(request.headers.get("Authorization"), request.path, self.tokens)
            if await request.read():
                check_body_type(request.method, request.headers.get("Content-Type"))
            if self.faults is not None and request.path == FAULTS_PATH:
                return self._json(await self.faults.switch(json.loads(await request.read() or b"{}"), self))
            if self.faults is not None and (refusal := self.faults.refusal(request)) is not None:
                code = refusal.status
                return refusal
            response = await self._handle(request)
            code = response.status
            return response
        except ApiError as e:
            code = e.code
            return self._json(e.status(), status=e.code)
        except aiohttp.web.HTTPRequestEntityTooLarge as e:  # (the body, past aiohttp's client_max_size)
            code = e.status
            refusal = ApiError(code, "RequestEntityTooLarge", e.text or e.reason)
            return self._json(refusal.status(), status=code)
        except Exception as e:
            log.exception("emulated API server: internal error")
            failure = ApiError(500, "InternalError", f"internal error: {e!r}")
            return self._json(failure.status(), status=500)
        finally:
            if "audit" in request:  # (an audit log's ResponseComplete stage, with the code)
                self._audit_line({**request["audit"], "code": code})

    # ---- discovery (legacy lists) and the OpenAPI v3 index kubectl reads for server-side validation ----

    def _group_versions(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for g, v, _ in self.store.kinds:
            if g and v not in out[g]:
                out[g].append(v)
        return out

    def _apis(self) -> dict[str, Any]:
        def entry(group: str, versions: list[str]) -> dict[str, Any]:
            gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}

        groups = [entry(g, vs) for g, vs in sorted(self._group_versions().items())]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def _group(self, group: str) -> dict[str, Any]:
        versions = self._group_versions().get(group)
        if not versions:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource (group {group})"
            )
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": gvs,
            "preferredVersion": gvs[0],
        }

    def _resource_list(self, group: str, version: str) -> dict[str, Any]:
        kinds = [r for (g, v, _), r in sorted(self.store.kinds.items()) if (g, v) == (group, version)]
        if not kinds:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({group}/{version})"
            )
        resources = []
        for r in kinds:
            main = {
                "name": r.plural,
                "singularName": r.kind.lower(),
                "namespaced": r.namespaced,
                "kind": r.kind,
            }
            main["verbs"] = VERBS
            if r.short_names:
                main["shortNames"] = list(r.short_names)
            if r.categories:
                main["categories"] = list(r.categories)
            resources.append(main)
            for sub in r.subresources:
                entry = {
                    "name": f"{r.plural}/{sub}",
                    "singularName": "",
                    "namespaced": r.namespaced,
                    "kind": "Scale" if sub == "scale" else r.kind,
                    "verbs": ["get"] if sub == "log" else ["get", "patch", "update"],
                }
                if sub == "scale":  # another group's kind, so named with it (apiextensions-apiserver's
                    # discovery controller, k8s v1.32: Group autoscaling, Version v1, Kind Scale)
                    entry = {**entry, "group": "autoscaling", "version": "v1"}
                resources.append(entry)
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    def _openapi_v2(self, request: aiohttp.web.BaseRequest) -> aiohttp.web.Response:
        """/openapi/v2 as the real handler serves it (kube-openapi pkg/handler/handler.go): JSON or, for
        kubectl's client-side validation, protobuf, by Accept (406 for neither); one ETag for both (the
        SHA-512 of the JSON), `Vary: Accept`, and 304 to an If-None-Match that names it (so kubectl's HTTP
        cache keeps the document until a kind changes). Both encodings are built once per change of kinds."""
        content_type = openapi_v2.media_type(request.headers.get("Accept", ""))
        if content_type is None:
            raise ApiError(
                406, "NotAcceptable",
                f"/openapi/v2 is served as {openapi_v2.JSON} or {openapi_v2.PROTOBUF}, not "
                f"{request.headers.get('Accept')}",
            )  # fmt: skip
        revision = (self.store.instance, self.store.kinds_revision)
        if self._v2_cache is None or self._v2_cache[0] != revision:
            doc = openapi_v2.document(list(self.store.kinds.values()), SERVER_VERSION["gitVersion"])
            body = json.dumps(doc).encode()
            etag = '"' + hashlib.sha512(body).hexdigest().upper() + '"'
            self._v2_cache = (
                revision,
                etag,
                {openapi_v2.JSON: body, openapi_v2.PROTOBUF: openapi_proto.encode(doc)},
            )
        _, etag, bodies = self._v2_cache
        headers = {"ETag": etag, "Vary": "Accept"}
        wanted = {t.strip().removeprefix("W/") for t in request.headers.get("If-None-Match", "").split(",")}
        if etag in wanted or "*" in wanted:
            return aiohttp.web.Response(status=304, headers=headers)
        return aiohttp.web.Response(body=bodies[content_type], content_type=content_type, headers=headers)

    def _openapi(self, request: aiohttp.web.BaseRequest) -> dict[str, Any]:
        """/openapi/v3 (index) and /openapi/v3/<group version>."""
        path, version = request.path.rstrip("/"), SERVER_VERSION["gitVersion"]
        if path == "/openapi/v3":
            group_versions = sorted({(g, v) for g, v, _ in self.store.kinds})
            return openapi.v3_index(group_versions, f"{self.store.instance}-{self.store.kinds_revision}")
        prefix = path.removeprefix("/openapi/v3/")
        parts = prefix.split("/")
        group, version_ = (parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3 else ("", parts[-1])
        in_gv = [r for (g, v, _), r in sorted(self.store.kinds.items()) if (g, v) == (group, version_)]
        if not in_gv or (parts[0] == "api" and len(parts) != 2):
            raise ApiError(404, "NotFound", f"no OpenAPI document for {prefix}")
        return openapi.v3_document(group, version_, in_gv, version)

    # ---- resources ----

    async def _handle(self, request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        path = request.path
        if path.rstrip("/") == "/openapi/v2":
            return self._openapi_v2(request)
        if path.startswith("/openapi/v3"):
            return self._json(self._openapi(request))
        segs = [s for s in path.split("/") if s]
        if path.rstrip("/") == "/version":
            return self._json(SERVER_VERSION)
        if path in ("/healthz", "/livez", "/readyz"):  # (as kube-apiserver's: 200 "ok")
            return aiohttp.web.Response(text="ok")
        if segs == ["api"]:
            return self._json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if segs == ["apis"]:
            return self._json(self._apis())
        if len(segs) == 2 and segs[0] == "apis":
            return self._json(self._group(segs[1]))
        if len(segs) == 2 and segs[0] == "api":
            return self._json(self._resource_list("", segs[1]))
        if len(segs) == 3 and segs[0] == "apis":
            return self._json(self._resource_list(segs[1], segs[2]))
        target = ResourcePath.parse(path)
        if target is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")
        kind = self.store.kind(target.group, target.version, target.plural)
        name, sub = target.name, target.subresource
        if sub and sub not in kind.subresources:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({sub})")
        method = request.method.upper()
        params = dict(request.query)
        self._audit(request, kind, sub, method, name, params)
        ns = target.namespace if kind.namespaced else None
        if not kind.namespaced and target.namespace:
            raise ApiError(404, "NotFound", f"{kind.plural} is not namespaced")
        store, accept = self.store, request.headers.get("Accept", "")
        if params.get("watch") in ("true", "1"):
            return await self._watch(request, kind, ns, name, params)
        if method == "GET" and name is None and sub is None:
            items = store.select(kind, ns, params)
            if "as=Table" in accept:
                return self._json(table(kind, items, store.last_revision, include=_include(params)))
            meta = {"resourceVersion": str(store.last_revision)}
            return self._json(
                {"apiVersion": kind.api_version, "kind": f"{kind.kind}List", "metadata": meta, "items": items}
            )
        if method == "GET" and sub == "log":
            return await self._pod_log(request, kind, ns or "", name, params)
        if method == "GET":
            obj = store.get(kind, ns, name)
            if sub == "scale":
                return self._json(scale_view(obj, kind))
            if "as=Table" in accept:
                return self._json(table(kind, [obj], store.last_revision, include=_include(params)))
            return self._json(obj)
        body = await self._body(request)
        if method == "POST" and name is None:
            created = await store.create(kind, ns, body, params)
            await store.collect_orphan(kind, created)  # written after its owner went: collected
            return self._json(created, status=201)
        if method in ("PUT", "PATCH") and name is not None:
            if method == "PUT":
                stored = await store.replace(kind, ns, name, body, sub, params)
            else:
                content_type = media_type(request.headers.get("Content-Type"))
                stored = await store.patch(kind, ns, name, body, content_type, sub, params)
            if sub is None:
                await store.collect_orphan(kind, stored)
            return self._json(scale_view(stored, kind) if sub == "scale" else stored)
        if method == "DELETE" and name is not None:
            policy = params.get("propagationPolicy") or (body or {}).get("propagationPolicy") or "Background"
            return self._json(await store.delete(kind, ns, name, policy))
        if method == "DELETE":
            items = store.select(kind, ns, params)
            for o in items:
                await store.delete(
                    kind, ns or o["metadata"].get("namespace"), o["metadata"]["name"], "Background"
                )
            return self._json({"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "items": items})
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on this path")

    async def _watch(self, request, kind: Resource, ns: str | None, name: str | None, params: dict[str, str]):
        """A stream of JSON lines ({"type", "object"}) until the timeout, the client leaves or the server
        stops. With `Accept: ...;as=Table` each object is a Table of one row, and only the first carries the
        column definitions (the API server's watch encoder sets NoHeaders after the first event:
        k8s.io/apiserver pkg/endpoints/handlers/watch.go, watchEmbeddedEncoder). A resourceVersion older than
        the history kept ends the stream with an ERROR event holding a 410 Expired Status, as the watch cache
        answers (k8s.io/apiserver pkg/storage/cacher, "too old resource version"); clients list again."""
        timeout = float(params.get("timeoutSeconds") or 1800)
        events = self.store.watch(kind, ns, name, params, timeout)  # selectors are checked before the stream
        as_table = "as=Table" in request.headers.get("Accept", "")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        headers = True
        try:
            async for event, obj in events:
                if as_table:
                    version = obj["metadata"].get("resourceVersion", "")
                    obj = table(kind, [obj], version, headers=headers, include=_include(params))
                    headers = False
                await response.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")
        except (Expired, ApiError) as e:
            error = e if isinstance(e, ApiError) else ApiError(410, "Expired", str(e))
            with contextlib.suppress(ConnectionResetError):  # (the client may have left meanwhile)
                await response.write(json.dumps({"type": "ERROR", "object": error.status()}).encode() + b"\n")
        except ConnectionResetError:
            pass  # the client left
        finally:
            await events.aclose()
        return response

    async def _pod_log(self, request, kind: Resource, ns: str, name: str, params: dict[str, str]):
        """`kubectl logs`: the node's answer to the PodLogOptions in the query (refusals come before the first
        byte), streamed as text while it follows (`follow=true`) until the container ends or the client
        leaves."""
        self.store.get(kind, ns, name)  # 404 for a pod that does not exist
        if self.pod_logs is None:
            raise ApiError(400, "BadRequest", f'pod "{name}" has no node here (no process kubelet runs)')
        chunks = self.pod_logs(ns, name, params)
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        try:
            async for chunk in chunks:
                if request.transport is None or request.transport.is_closing():
                    break  # the client left
                if chunk:
                    await response.write(chunk)
        except ConnectionResetError:
            pass  # the client left
        finally:
            await chunks.aclose()
        return response

    def _audit(self, request, kind: Resource, sub: str | None, method: str, name: str | None, params) -> None:
        """Who did what to which resource, in RBAC's words (the user the token names), like an audit log: one
        line once the request is answered, with its status code (written by `__call__`)."""
        if self.audit_log is None:
            return
        if method == "GET":
            verb = "watch" if params.get("watch") in ("true", "1") else "get" if name else "list"
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, "")
            verb = verb or ("delete" if name else "deletecollection")
        user = request["user"].name
        resource = f"{kind.plural}/{sub}" if sub else kind.plural
        entry = {"user": user, "verb": verb, "group": kind.group, "resource": resource, "name": name}
        if verb == "watch":  # long-running: logged as it starts
            self._audit_line({**entry, "code": 200})
        else:
            request["audit"] = entry

    def _audit_line(self, entry: dict[str, Any]) -> None:
        with open(self.audit_log, "a") as f:
            f.write(json.dumps(entry) + "\n")

    @staticmethod
    def _json(payload: Any, status: int = 200) -> aiohttp.web.Response:
        return aiohttp.web.json_response(payload, status=status)

    @staticmethod
    async def _body(request: aiohttp.web.BaseRequest) -> Any:
        content_type = media_type(request.headers.get("Content-Type"))  # (one `guard` admitted; none: JSON)
        if content_type.endswith("protobuf"):
            return protobuf.decode(await request.read())
        text = await request.text()
        if not text:
            return None
        try:
            if content_type.endswith("yaml"):
                import yaml

                return yaml.safe_load(text)
            return json.loads(text)
        except ValueError as e:
            raise ApiError(400, "BadRequest", f"the request body does not parse: {e}") from None


FAULTS_PATH = "/neuronfleet/faults"
OUTAGE_DELAY = 0.2  # seconds from the outage switch's answer to the outage


def _include(params) -> str:
    """A Table's `includeObject` (Metadata, Object or None; Metadata when not said or not one of them)."""
    value = params.get("includeObject", "Metadata")
    return value if value in ("Metadata", "Object", "None") else "Metadata"


class Faults:
    """Failures a real API server has, injected on request (`--fault-switches`; for tests only, never in
    `neuronfleet up`): POST FAULTS_PATH with
    - `{"refuse": N, "status": 429, "retryAfter": 1, "user": NAME}`: the next N resource requests (of that
      user, as the token table names it; any without one) are refused with that status and Retry-After, as
      API Priority and Fairness (429) or an overloaded server (503) refuses them;
    - `{"expireWatches": true}`: every watch ends with 410 Expired and no resourceVersion so far can be
      resumed from, as after a compaction and a restarted watch cache;
    - `{"outage": SECONDS}`: the server goes away for its clients as in a restart
      (`EmulatedAPIServer.outage`), its objects and the process kubelet kept.
    The answer is the switches' state (`refused`: how many were refused so far)."""

    def __init__(self) -> None:
        self.refuse, self.status, self.retry_after, self.user, self.refused = 0, 429, 1, None, 0
        self.outage: asyncio.Task | None = None

    async def switch(self, body: dict[str, Any], server: EmulatedAPIServer) -> dict[str, Any]:
        if "refuse" in body:
            self.refuse, self.status = int(body["refuse"]), int(body.get("status", 429))
            self.retry_after, self.user = int(body.get("retryAfter", 1)), body.get("user")
        if body.get("expireWatches"):
            await server.store.expire_watches()
        if body.get("outage"):
            self.outage = asyncio.get_running_loop().create_task(server.outage(float(body["outage"])))
        return {"refuse": self.refuse, "status": self.status, "refused": self.refused}

    def refusal(self, request: aiohttp.web.BaseRequest) -> aiohttp.web.Response | None:
        if self.refuse <= 0 or not request.path.startswith(("/api/", "/apis/")):
            return None
        if self.user and request["user"].name != self.user:
            return None
        self.refuse, self.refused = self.refuse - 1, self.refused + 1
        reason = {429: "TooManyRequests", 503: "ServiceUnavailable"}.get(self.status, "InternalError")
        error = ApiError(self.status, reason, "the server is busy (a fault switch); try again later")
        return aiohttp.web.json_response(
            error.status(), status=self.status, headers={"Retry-After": str(self.retry_after)}
        )


async def run(
    host: str,
    port: int,
    kubeconfig_path: str | None,
    ready_file: str | None,
    audit_log: str | None = None,
    kubelet_state: str | None = None,
    watch_history: int = HISTORY,
    data_file: str | None = None,
    fault_switches: bool = False,
    tokens: Tokens | None = None,
    identity: tuple[ssl.SSLContext, bytes] | None = None,
    node: NodeSettings | None = None,
) -> None:
    """Serve over HTTPS (`identity`: the TLS context and its CA's certificate, `tls.server_context`; made now
    where not given) until SIGTERM or SIGINT, to the users `tokens` names (`load_tokens`); with
    `kubelet_state`, also run the process kubelet (it stops every pod process it started on the way out), its
    node advertising what `node` says;
    with `data_file`, the objects are read from it at the start and kept in it (`persist`) until the end. The
    kubeconfig, the data file and the kubelet's folders are readable by this user only (`guard`)."""
    from .kubelet import ProcessKubelet
    from .store import ClusterClient

    store = Store(history=watch_history)
    saving = None
    if data_file:
        if Path(data_file).exists():
            store.restore(json.loads(Path(data_file).read_text()))
        saving = asyncio.get_running_loop().create_task(persist(store, Path(data_file)))
    kubelet = ProcessKubelet(ClusterClient(store), Path(kubelet_state), node) if kubelet_state else None
    server = EmulatedAPIServer(
        store,
        pod_logs=kubelet.pod_log if kubelet else None,
        audit_log=audit_log,
        fault_switches=fault_switches,
        tokens=tokens,
    )
    running = asyncio.get_running_loop().create_task(kubelet.run()) if kubelet else None
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    context, ca = identity or tls.server_context(None, None, host)
    url = await server.serve(host, port, context)
    if kubeconfig_path:
        import yaml

        config = kubeconfig(url, server.tokens.token_of(ADMIN), ca)
        write_private(Path(kubeconfig_path), yaml.safe_dump(config))
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(url)
    print(f"emulated Kubernetes API server on {url}", flush=True)
    await stop.wait()
    # Stop: the kubelet first (it stops its pods; cancelled before the store wakes its waiters, as a
    # notify racing the cancellation of its wait left it waiting for ever), then the server.
    if running is not None:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    await server.stop()
    if saving is not None:
        saving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await saving
        write_private(Path(data_file), json.dumps(store.snapshot()))  # the last writes


PERSIST_SECONDS = 1.0  # the most a kill -9 of the server loses of its writes


async def persist(store: Store, path: Path) -> None:
    """Keep the store's objects in `path` (the Secrets' data too: 0600, `write_private` replaces it whole or
    not at all): after a write, at most every PERSIST_SECONDS."""
    saved = store.last_revision
    while True:
        await asyncio.sleep(PERSIST_SECONDS)
        if store.last_revision != saved:
            saved = store.last_revision
            text = json.dumps(store.snapshot())  # (here: no write comes between)
            await asyncio.to_thread(write_private, path, text)


def load_tokens(token_file: str | None) -> Tokens:
    """The token table: the file's, re-read whenever it changes (where it does not exist it is made, 0600,
    with one fresh token for ADMIN), else one fresh token for ADMIN held in memory (the kubeconfig's)."""
    if token_file is None:
        return Tokens(table=admin_table())
    path = Path(token_file)
    if not path.exists():
        write_private(path, format_tokens(admin_table()))
    return Tokens(path)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="An emulated Kubernetes API server (neuronfleet).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument(
        "--kubeconfig", help=f"write a kubeconfig pointing at the server here, with {ADMIN}'s token (0600)"
    )
    parser.add_argument(
        "--tls-cert-file",
        help="the server's certificate, then its CA's (PEM); made, with the key, where missing (tls.py). "
        "Without it and --tls-private-key-file, a certificate made for this run only",
    )
    parser.add_argument("--tls-private-key-file", help="the server certificate's key (PEM; made 0600)")
    parser.add_argument(
        "--token-auth-file",
        help="the bearer tokens accepted, as kube-apiserver's static token file (CSV token,user,uid), read "
        f"again whenever it changes; made with one fresh token for {ADMIN} where it does not exist. "
        f"Without it, one fresh token for {ADMIN}, which only the --kubeconfig holds",
    )
    parser.add_argument("--ready-file", help="write the server's URL here once it listens")
    parser.add_argument("--audit-log", help="append one JSON line per resource request here")
    parser.add_argument("--kubelet-state", help="also run the process kubelet, its state in this folder")
    from .node_settings import add_node_arguments

    add_node_arguments(parser)
    parser.add_argument("--data-file", help="keep the objects in this file, over restarts (as etcd would)")
    parser.add_argument(
        "--fault-switches", action="store_true",
        help=f"for tests: POST {FAULTS_PATH} refuses requests (429/503), expires watches, or makes an "
        "outage as a restart does (Faults)",
    )  # fmt: skip
    parser.add_argument(
        "--watch-history", type=int, default=HISTORY,
        help="changes kept per kind for watches that resume from a resourceVersion (older: 410 Expired)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.kubeconfig or args.token_auth_file):
        parser.error("--kubeconfig or --token-auth-file is needed: without either, no client holds a token")
    try:
        tokens = load_tokens(args.token_auth_file)
    except (OSError, ValueError) as e:
        parser.error(f"--token-auth-file: {e}")
    if args.kubeconfig and tokens.token_of(ADMIN) is None:
        parser.error(f"--token-auth-file names no user {ADMIN}, whose token the --kubeconfig is written with")
    if bool(args.tls_cert_file) != bool(args.tls_private_key_file):
        parser.error("--tls-cert-file and --tls-private-key-file go together")
    files = (
        (Path(args.tls_cert_file), Path(args.tls_private_key_file)) if args.tls_cert_file else (None, None)
    )
    try:
        identity = tls.server_context(*files, args.host)
    except (OSError, ValueError, ssl.SSLError) as e:
        parser.error(f"the server's certificate: {e}")
    from .node_settings import node_settings

    try:
        node = node_settings(args.node_label, args.node_resource)
    except ValueError as e:
        parser.error(str(e))
    if args.kubelet_state:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(
        run(
            args.host,
            args.port,
            args.kubeconfig,
            args.ready_file,
            args.audit_log,
            args.kubelet_state,
            args.watch_history,
            args.data_file,
            args.fault_switches,
            tokens,
            identity,
            node,
        )
    )


if __name__ == "__main__":
    main()
