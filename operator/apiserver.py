"""An emulated Kubernetes API server, for tests and the local mode, built on kmock's Kubernetes scaffold (its
request type, its Kubernetes errors, its aiohttp handler) with URL parsing, discovery and an object store of
its own, made faithful where the operator and `kubectl` depend on it. (kmock's own parser takes
/api/v1/namespaces for a namespaced path, and its emulator merges dicts without resourceVersions.)

What it does like a real API server: uid, resourceVersion (409 Conflict on a stale write), generation (bumped
when anything but metadata and status changes), creationTimestamp; 201 on create, generateName; GET, LIST
(label and field selectors), WATCH (from a resourceVersion, with timeouts); PUT, merge patch, JSON patch,
strategic merge patch (lists of named items merged by name) and apply patches (as merges); the status and
scale subresources kept apart from the main resource; finalizers and deletionTimestamp; ownerReference
garbage collection (background or orphan); namespaces that must exist; CustomResourceDefinitions that add
resources, whose openAPIV3Schema is enforced on create and update (defaults applied, unknown fields pruned or
refused under fieldValidation=Strict, types and bounds checked, x-kubernetes-validations evaluated as CEL);
server-side tables (`kubectl get` columns, a CRD's additionalPrinterColumns).

What it does not: authentication and authorization (every request is admitted), admission webhooks, field
managers of server-side apply, the built-in controllers (the process kubelet in the local mode plays them).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import json
import re
import secrets
import signal
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import jsonschema
import kmock
from kmock._internal import rendering

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name


@dataclass
class Resource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # openAPIV3Schema of a custom resource
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


BUILTIN = [
    Resource("", "v1", "namespaces", "Namespace", False, ("status",), ("ns",)),
    Resource("", "v1", "pods", "Pod", True, ("status", "log"), ("po",)),
    Resource("", "v1", "services", "Service", True, ("status",), ("svc",)),
    Resource("", "v1", "endpoints", "Endpoints", True, (), ("ep",)),
    Resource("", "v1", "configmaps", "ConfigMap", True, (), ("cm",)),
    Resource("", "v1", "secrets", "Secret", True),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", True, (), ("sa",)),
    Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("status",), ("pvc",)),
    Resource("", "v1", "events", "Event", True, (), ("ev",)),
    Resource("apps", "v1", "deployments", "Deployment", True, ("status", "scale"), ("deploy",)),
    Resource("apps", "v1", "replicasets", "ReplicaSet", True, ("status", "scale"), ("rs",)),
    Resource("batch", "v1", "jobs", "Job", True, ("status",)),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",), ("pdb",)),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, (), ("netpol",)),
    Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True),
    Resource("events.k8s.io", "v1", "events", "Event", True, (), ("ev",)),
    Resource(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("status",),
        ("crd", "crds"),
    ),
]
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
PRECREATED_NAMESPACES = ("default", "kube-system", "kube-public")
SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-neuronfleet-emulated",
    "platform": "linux/amd64",
}


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def error(code: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=code, reason=reason, message=message, details=details or None)


# ---- patches ---------------------------------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A merge patch in which lists of objects that carry a `name` (containers, env, ports, volumes...)
    merge item by item on that name, as Kubernetes' strategic merge does for those fields."""
    if isinstance(patch, dict) and isinstance(target, dict):
        out = dict(target)
        for key, value in patch.items():
            if key.startswith("$"):  # directives ($patch, $retainKeys...): not modelled
                continue
            out[key] = None if value is None else strategic_merge_patch(target.get(key), value)
            if value is None:
                out.pop(key)
        return out
    named = (
        isinstance(patch, list)
        and isinstance(target, list)
        and all(isinstance(i, dict) and "name" in i for i in [*patch, *target])
    )
    if named:
        by_name = {i["name"]: i for i in target}
        order = [i["name"] for i in target]
        for item in patch:
            if item.get("$patch") == "delete":
                by_name.pop(item["name"], None)
                continue
            if item["name"] not in by_name:
                order.append(item["name"])
            by_name[item["name"]] = strategic_merge_patch(by_name.get(item["name"], {}), item)
        return [by_name[n] for n in order if n in by_name]
    return copy.deepcopy(patch)


# ---- selectors -------------------------------------------------------------------------------------------

_SELECTOR_TERM = re.compile(
    r"^\s*(?P<neg>!)?\s*(?P<key>[A-Za-z0-9_./-]+)\s*"
    r"(?:(?P<op>==|=|!=)\s*(?P<value>[A-Za-z0-9_.-]*)|\s+(?P<setop>in|notin)\s*\((?P<values>[^)]*)\))?\s*$"
)


def _split_terms(selector: str) -> list[str]:
    terms, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        terms.append(current)
    return terms


def label_matcher(selector: str | None):
    """A predicate for a label selector (=, ==, !=, in, notin, key, !key); 400 when it does not parse."""
    checks = []
    for term in _split_terms(selector or ""):
        m = _SELECTOR_TERM.match(term)
        if not m:
            raise error(400, "BadRequest", f"unable to parse requirement: {term.strip()!r}")
        key, neg = m["key"], bool(m["neg"])
        if m["op"]:
            value, equal = m["value"], m["op"] != "!="
            checks.append(lambda labels, k=key, v=value, e=equal: (labels.get(k) == v) == e)
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            inside = m["setop"] == "in"
            checks.append(
                lambda labels, k=key, vs=values, i=inside: (
                    (k in labels and labels[k] in vs) == i if i else not (k in labels and labels[k] in vs)
                )
            )
        else:
            checks.append(lambda labels, k=key, n=neg: (k in labels) != n)
    return lambda labels: all(c(labels) for c in checks)


def field_matcher(selector: str | None):
    """A predicate for a field selector on dotted paths (metadata.name=x, status.phase!=Running)."""
    checks = []
    for term in _split_terms(selector or ""):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not m:
            raise error(400, "BadRequest", f"unable to parse field selector: {term.strip()!r}")
        path, op, value = m.groups()
        checks.append(lambda obj, p=path, v=value, e=op != "!=": (str(dig(obj, p.split("."))) == v) == e)
    return lambda obj: all(c(obj) for c in checks)


def dig(obj: Any, path: list[str]) -> Any:
    for part in path:
        if not isinstance(obj, dict):
            return ""
        obj = obj.get(part, "")
    return "" if obj is None else obj


# ---- schemas ---------------------------------------------------------------------------------------------


def apply_defaults(obj: Any, schema: dict[str, Any]) -> Any:
    """Fill in the schema's defaults where fields are absent (recursively, defaults included)."""
    if isinstance(obj, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(obj[name], sub)
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for name in obj:
            obj[name] = apply_defaults(obj[name], schema["additionalProperties"])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(item, schema["items"]) for item in obj]
    return obj


def prune(obj: Any, schema: dict[str, Any], path: str, unknown: list[str]) -> Any:
    """Drop fields the schema does not declare (recording their paths), unless it preserves them."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return obj
    if isinstance(obj, dict) and "properties" in schema:
        out = {}
        for name, value in obj.items():
            if name in schema["properties"]:
                out[name] = prune(value, schema["properties"][name], f"{path}.{name}", unknown)
            else:
                unknown.append(f"{path}.{name}")
        return out
    if isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: prune(v, schema["additionalProperties"], f"{path}.{k}", unknown) for k, v in obj.items()}
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [prune(v, schema["items"], f"{path}[{i}]", unknown) for i, v in enumerate(obj)]
    return obj


def cel_violations(obj: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Evaluate x-kubernetes-validations (CEL, with `self` bound to the node) throughout the object."""
    import cel

    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            ok = cel.evaluate(rule["rule"], {"self": obj})
        except Exception as e:  # a rule that cannot evaluate refuses, as the API server does
            ok, rule = False, {**rule, "message": f"{rule.get('message', rule['rule'])} ({e})"}
        if ok is not True:
            out.append(f"{path or '<root>'}: Invalid value: {rule.get('message') or rule['rule']}")
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in obj:
                out += cel_violations(obj[name], sub, f"{path}.{name}" if path else name)
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            out += cel_violations(item, schema["items"], f"{path}[{i}]")
    return out


def schema_errors(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI v3.0 bounds (boolean exclusiveMinimum)
    errors = []
    for e in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in e.absolute_path) or "<root>"
        errors.append(f"{where}: Invalid value: {e.message}")
    return errors or cel_violations(obj, schema, "")


# ---- tables ----------------------------------------------------------------------------------------------


def age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def json_path(obj: dict[str, Any], path: str) -> Any:
    value = dig(obj, [p for p in path.strip(".").split(".") if p])
    return None if value == "" else value


# ---- the server ------------------------------------------------------------------------------------------


class EmulatedAPIServer(kmock.KubernetesScaffold):
    """The registry of kinds, the store, discovery and the REST semantics."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.kinds: dict[tuple[str, str, str], Resource] = {}
        self.objects: dict[Key, dict[str, Any]] = {}
        self.revision = itertools.count(1)
        self.last_revision = 0
        self.history: dict[tuple[str, str, str], list[tuple[int, str, dict]]] = defaultdict(list)
        self.changed = asyncio.Condition()
        self.audit_log: str | None = None  # a file: one JSON line per resource request (user, verb, resource)
        for resource in BUILTIN:
            self.register(resource)
        for name in PRECREATED_NAMESPACES:
            self._store(("", "v1", "namespaces", None, name), self._new_meta({"metadata": {"name": name}}))

    # ---- registry ----

    def register(self, r: Resource) -> None:
        self.kinds[(r.group, r.version, r.plural)] = r

    def unregister(self, group: str, version: str, plural: str) -> None:
        self.kinds.pop((group, version, plural), None)

    def _crd_resources(self, crd: dict[str, Any]) -> list[Resource]:
        spec = crd["spec"]
        names = spec["names"]
        out = []
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            out.append(
                Resource(
                    group=spec["group"],
                    version=version["name"],
                    plural=names["plural"],
                    kind=names["kind"],
                    namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    subresources=tuple(version.get("subresources", {})),
                    short_names=tuple(names.get("shortNames", [])),
                    schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                    printer_columns=version.get("additionalPrinterColumns", []),
                    categories=tuple(names.get("categories", [])),
                )
            )
        return out

    # ---- serving ----

    async def serve(
        self, host: str = "127.0.0.1", port: int = 0
    ) -> tuple[aiohttp.web.Server, asyncio.Server]:
        """Listen on host:port (0: a free port); returns the low-level server and the listening socket."""
        await self.__aenter__()  # kmock renders errors as Status objects only inside its context
        handler = aiohttp.web.Server(self)
        listener = await asyncio.get_running_loop().create_server(handler, host, port)
        return handler, listener

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Parse the URL the way the API server does (kmock's parser takes /api/v1/namespaces for a
        namespaced path), then handle; errors become Status objects."""
        await raw.read()
        try:
            request = self._parse(raw)
            return await self._handle(request)
        except kmock.KubernetesError as e:
            return await self._render_error(e)
        except Exception as e:  # a bug here answers 500 and the server keeps going
            return await self._render_error(e)

    def _parse(self, raw: aiohttp.web.BaseRequest) -> rendering.Request:
        segs = [s for s in raw.path.split("/") if s]
        group = version = plural = ns = name = sub = None
        if segs[:1] == ["api"] and len(segs) >= 2:
            group, version, rest = "", segs[1], segs[2:]
        elif segs[:1] == ["apis"] and len(segs) >= 3:
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            rest = []
        if rest[:1] == ["namespaces"] and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
            ns, rest = rest[1], rest[2:]
        if rest:
            plural, name, sub = [*rest, None, None][:3]
        resource = (
            kmock.resource(group, version, plural) if group is not None and version and plural else None
        )
        return rendering.Request(
            method=kmock.method(raw.method.upper()),
            url=raw.url,
            params=dict(raw.query),
            headers=dict(raw.headers),
            resource=resource,
            namespace=ns,
            name=name,
            subresource=sub,
            raw_request=raw,
        )

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            code, reason, message, details = exc.status, exc.reason, exc.message, exc.details or {}
        else:
            import logging

            logging.getLogger(__name__).exception("emulated API server: internal error")
            code, reason, message, details = 500, "InternalError", f"internal error: {exc!r}", {}
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        status.update(message=message, reason=reason, details=details, code=code)
        return aiohttp.web.json_response(status, status=code)

    # ---- discovery (legacy lists) and the OpenAPI v3 index kubectl reads for server-side validation ----

    def _group_versions(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for g, v, _ in self.kinds:
            if g and v not in out[g]:
                out[g].append(v)
        return out

    async def _serve_apis(self, request: rendering.Request) -> rendering.Payload:
        def entry(group: str, versions: list[str]) -> dict[str, Any]:
            gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}

        groups = [entry(g, vs) for g, vs in sorted(self._group_versions().items())]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    async def _serve_group(self, request: rendering.Request) -> rendering.Payload:
        group = request.url.path.strip("/").split("/")[1]
        versions = self._group_versions().get(group)
        if not versions:
            raise error(404, "NotFound", f"the server could not find the requested resource (group {group})")
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": gvs,
            "preferredVersion": gvs[0],
        }

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        segs = request.url.path.strip("/").split("/")
        group, version = ("", segs[1]) if segs[0] == "api" else (segs[1], segs[2])
        kinds = [r for (g, v, _), r in sorted(self.kinds.items()) if (g, v) == (group, version)]
        if not kinds:
            raise error(
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
                kind = "Scale" if sub == "scale" else r.kind
                sub_verbs = ["get"] if sub == "log" else ["get", "patch", "update"]
                resources.append(
                    {
                        "name": f"{r.plural}/{sub}",
                        "singularName": "",
                        "namespaced": r.namespaced,
                        "kind": kind,
                        "verbs": sub_verbs,
                    }
                )
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    def _openapi(self, path: str) -> dict[str, Any]:
        """/openapi/v3: an index of group versions; /openapi/v3/<gv>: for each kind, a PATCH operation
        declaring the fieldValidation parameter, which is how kubectl learns it may validate server-side."""
        if path == "/openapi/v3":
            index = {}
            for g, v in {(g, v) for g, v, _ in self.kinds}:
                prefix = f"apis/{g}/{v}" if g else f"api/{v}"
                index[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={self.last_revision}"}
            return {"paths": index}
        prefix = path.removeprefix("/openapi/v3/")
        parts = prefix.split("/")
        group, version = (parts[1], parts[2]) if parts[0] == "apis" and len(parts) == 3 else ("", parts[-1])
        kinds = [r for (g, v, _), r in self.kinds.items() if (g, v) == (group, version)]
        if not kinds:
            raise error(404, "NotFound", f"no OpenAPI document for {prefix}")
        param = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
        paths = {}
        for r in kinds:
            scope = (
                f"/{prefix}/namespaces/{{namespace}}/{r.plural}" if r.namespaced else f"/{prefix}/{r.plural}"
            )
            gvk = {"group": group, "version": version, "kind": r.kind}
            op = {"parameters": [param], "x-kubernetes-group-version-kind": gvk, "responses": {}}
            paths[scope] = {"post": op}
            paths[f"{scope}/{{name}}"] = {"patch": op, "put": op}
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
            "paths": paths,
        }

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        path = request.url.path
        if path.startswith("/openapi/v3"):
            return self._json(self._openapi(path))
        if path == "/openapi/v2":
            raise error(404, "NotFound", "this emulated API server publishes OpenAPI v3 only")
        segs = [s for s in path.split("/") if s]
        if path == "/version":
            return self._json(SERVER_VERSION)
        if segs == ["api"]:
            return self._json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if segs == ["apis"]:
            return self._json(await self._serve_apis(request))
        if len(segs) == 2 and segs[0] == "apis":
            return self._json(await self._serve_group(request))
        if (len(segs) == 2 and segs[0] == "api") or (len(segs) == 3 and segs[0] == "apis"):
            return self._json(await self._serve_version(request))
        if request.resource is None or raw is None:
            raise error(404, "NotFound", f"the server could not find the requested resource ({path})")
        res = request.resource
        kind = self.kinds.get((str(res.group or ""), str(res.version or ""), str(res.plural or "")))
        if kind is None:
            what = f"{res.plural}.{res.group}" if res.group else str(res.plural)
            raise error(404, "NotFound", f"the server doesn't have a resource type {what!r}")
        sub = request.subresource
        if sub and sub not in kind.subresources:
            raise error(404, "NotFound", f"the server could not find the requested resource ({sub})")
        method = request.method.value.upper()
        params = dict(request.params)
        self._audit(raw, kind, sub, method, request.name, params)
        ns = request.namespace if kind.namespaced else None
        if kind.namespaced is False and request.namespace:
            raise error(404, "NotFound", f"{kind.plural} is not namespaced")
        if params.get("watch") in ("true", "1"):
            return await self._watch(raw, kind, ns, request.name, params)
        if method == "GET" and request.name is None:
            return self._json(self._list(kind, ns, params, raw.headers.get("Accept", "")))
        if method == "GET" and sub == "log":
            return aiohttp.web.Response(text=self.pod_log(ns or "", request.name or ""))
        if method == "GET":
            obj = self._get(kind, ns, request.name)
            if sub == "scale":
                return self._json(self._scale_view(kind, obj))
            if "as=Table" in raw.headers.get("Accept", ""):
                return self._json(self._table(kind, [obj]))
            return self._json(obj)
        body = await self._body(raw, method)
        if method == "POST" and request.name is None:
            return self._json(await self.create(kind, ns, body, params), status=201)
        if method == "PUT":
            return self._json(await self.replace(kind, ns, request.name, body, sub, params))
        if method == "PATCH":
            content_type = raw.headers.get("Content-Type", "application/merge-patch+json").split(";")[0]
            return self._json(await self.patch(kind, ns, request.name, body, content_type, sub, params))
        if method == "DELETE" and request.name is not None:
            policy = params.get("propagationPolicy") or (body or {}).get("propagationPolicy") or "Background"
            return self._json(await self.delete(kind, ns, request.name, policy))
        if method == "DELETE":
            items = [o for o in self._list(kind, ns, params, "")["items"]]
            for o in items:
                await self.delete(
                    kind, ns or o["metadata"].get("namespace"), o["metadata"]["name"], "Background"
                )
            return self._json({"kind": f"{kind.kind}List", "apiVersion": kind.api_version, "items": items})
        raise error(405, "MethodNotAllowed", f"{method} is not supported on this path")

    def _audit(self, raw, kind: Resource, sub: str | None, method: str, name: str | None, params) -> None:
        """Who did what to which resource, in RBAC's words (the token names the user), like an audit log."""
        if self.audit_log is None:
            return
        if method == "GET":
            verb = "watch" if params.get("watch") in ("true", "1") else "get" if name else "list"
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, "")
            verb = verb or ("delete" if name else "deletecollection")
        user = raw.headers.get("Authorization", "").removeprefix("Bearer ").strip() or "anonymous"
        resource = f"{kind.plural}/{sub}" if sub else kind.plural
        with open(self.audit_log, "a") as f:
            f.write(
                json.dumps({"user": user, "verb": verb, "group": kind.group, "resource": resource}) + "\n"
            )

    @staticmethod
    def _json(payload: Any, status: int = 200) -> aiohttp.web.Response:
        return aiohttp.web.json_response(payload, status=status)

    @staticmethod
    async def _body(raw: aiohttp.web.BaseRequest, method: str) -> Any:
        content_type = raw.headers.get("Content-Type", "")
        if "protobuf" in content_type:
            raise error(
                415, "UnsupportedMediaType",
                "this emulated API server reads JSON and YAML only, not protobuf; send the object as a "
                "manifest (kubectl apply -f FILE) instead of a typed kubectl create",
            )  # fmt: skip
        text = await raw.text()
        if not text:
            return None
        try:
            if "yaml" in content_type:
                import yaml

                return yaml.safe_load(text)
            return json.loads(text)
        except ValueError as e:
            raise error(400, "BadRequest", f"the request body does not parse: {e}") from None

    # ---- store ----

    def _key(self, kind: Resource, ns: str | None, name: str) -> Key:
        return (kind.group, kind.version, kind.plural, ns, name)

    def _new_meta(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        meta.setdefault("generation", 1)
        return obj

    def _store(self, key: Key, obj: dict[str, Any], event: str = "ADDED") -> dict[str, Any]:
        rv = next(self.revision)
        self.last_revision = rv
        obj["metadata"]["resourceVersion"] = str(rv)
        if event == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history[key[:3]].append((rv, event, copy.deepcopy(obj)))
        return copy.deepcopy(obj)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def _get(self, kind: Resource, ns: str | None, name: str | None) -> dict[str, Any]:
        obj = self.objects.get(self._key(kind, ns, name or ""))
        if obj is None:
            group = kind.group or ""
            raise error(
                404, "NotFound", f'{kind.plural}{"." + group if group else ""} "{name}" not found',
                name=name, group=group, kind=kind.plural,
            )  # fmt: skip
        return copy.deepcopy(obj)

    def get(self, group: str, version: str, plural: str, namespace: str | None, name: str) -> dict | None:
        """The stored object, or None (for in-process callers such as the process kubelet)."""
        obj = self.objects.get((group, version, plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def _check_namespace(self, kind: Resource, ns: str | None) -> None:
        if kind.namespaced and ("", "v1", "namespaces", None, ns) not in self.objects:
            raise error(404, "NotFound", f'namespaces "{ns}" not found', name=ns, kind="namespaces")

    def _admit(self, kind: Resource, obj: dict[str, Any], params: dict[str, str]) -> dict[str, Any]:
        """Schema enforcement for custom resources: defaults, pruning (or Strict refusal), validation."""
        if kind.schema is None:
            return obj
        meta = obj.get("metadata")
        unknown: list[str] = []
        obj = prune(apply_defaults(obj, kind.schema), kind.schema, "", unknown)
        obj["metadata"] = meta
        obj.setdefault("apiVersion", kind.api_version)
        obj.setdefault("kind", kind.kind)
        name = (meta or {}).get("name")
        if unknown and params.get("fieldValidation") == "Strict":
            fields = ", ".join(f'unknown field "{u.lstrip(".")}"' for u in unknown)
            raise error(422, "Invalid", f'{kind.kind}.{kind.group} "{name}" is invalid: {fields}')
        errors = schema_errors({k: v for k, v in obj.items() if k != "metadata"}, kind.schema)
        if errors:
            causes = []
            for e in errors:
                where, _, message = e.partition(": ")
                causes.append({"reason": "FieldValueInvalid", "field": where, "message": message})
            raise error(
                422, "Invalid", f'{kind.kind}.{kind.group} "{name}" is invalid: ' + "; ".join(errors),
                name=name, group=kind.group, kind=kind.kind, causes=causes,
            )  # fmt: skip
        return obj

    async def create(self, kind: Resource, ns: str | None, body: Any, params: dict[str, str]) -> dict:
        if not isinstance(body, dict):
            raise error(400, "BadRequest", "the body of a create must be an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise error(422, "Invalid", f"{kind.kind} is invalid: metadata.name: Required value")
        if kind.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise error(
                    400, "BadRequest", "the namespace of the provided object does not match the namespace "
                    "sent on the request",
                )  # fmt: skip
            ns = ns or meta.get("namespace") or "default"
            meta["namespace"] = ns
            self._check_namespace(kind, ns)
        key = self._key(kind, ns, name)
        if key in self.objects:
            group = f".{kind.group}" if kind.group else ""
            raise error(409, "AlreadyExists", f'{kind.plural}{group} "{name}" already exists', name=name)
        for stale in ("resourceVersion", "uid", "deletionTimestamp"):
            meta.pop(stale, None)
        meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        if "status" in kind.subresources:
            obj.pop("status", None)  # the status subresource is written through /status only
        obj = self._admit(kind, obj, params)
        if kind.plural == "customresourcedefinitions":
            self._admit_crd(obj)
        stored = self._store(key, self._new_meta(obj))
        await self._notify()
        return stored

    def _admit_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        try:
            expected = f"{spec['names']['plural']}.{spec['group']}"
        except (KeyError, TypeError):
            raise error(
                422, "Invalid", "CustomResourceDefinition is invalid: spec.names and spec.group are required"
            ) from None
        if crd["metadata"]["name"] != expected:
            raise error(
                422, "Invalid", f"CustomResourceDefinition is invalid: metadata.name must be {expected}"
            )
        for r in self._crd_resources(crd):
            self.register(r)
        crd["status"] = {
            "acceptedNames": spec["names"],
            "storedVersions": [v["name"] for v in spec.get("versions", []) if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": "Emulated", "lastTransitionTime": now()}
                for t in ("NamesAccepted", "Established")
            ],
        }

    def _spec_changed(self, old: dict[str, Any], new: dict[str, Any]) -> bool:
        strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        return strip(old) != strip(new)

    async def _write(
        self, kind: Resource, ns: str | None, name: str, new: dict[str, Any], sub: str | None,
        params: dict[str, str], expected_rv: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        key = self._key(kind, ns, name)
        old = self._get(kind, ns, name)
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            group = f".{kind.group}" if kind.group else ""
            raise error(
                409, "Conflict",
                f'Operation cannot be fulfilled on {kind.plural}{group} "{name}": the object has been '
                "modified; please apply your changes to the latest version and try again",
                name=name, group=kind.group, kind=kind.plural,
            )  # fmt: skip
        if sub == "status":  # only the status moves
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            if merged["status"] is None:
                merged.pop("status")
            new = merged
        elif sub == "scale":
            replicas = dig(new, ["spec", "replicas"])
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["replicas"] = replicas
        elif "status" in kind.subresources:  # the main resource keeps its status
            if "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for fixed in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if fixed in old["metadata"]:
                meta[fixed] = old["metadata"][fixed]
            else:
                meta.pop(fixed, None)
        new["apiVersion"], new["kind"] = kind.api_version, kind.kind
        meta["generation"] = old["metadata"].get("generation", 1) + self._spec_changed(old, new)
        if sub is None:
            new = self._admit(kind, new, params)
        if new == old:
            return old  # a no-op write does not bump the resourceVersion
        if kind.plural == "customresourcedefinitions" and sub is None:
            self._admit_crd(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            stored = self._store(key, new, "DELETED")
            await self._collect_garbage(meta["uid"])
        else:
            stored = self._store(key, new, "MODIFIED")
        await self._notify()
        return stored

    async def replace(self, kind, ns, name, body, sub, params) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise error(400, "BadRequest", "the body of an update must be an object")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        return await self._write(kind, ns, name, copy.deepcopy(body), sub, params, rv)

    async def patch(self, kind, ns, name, body, content_type, sub, params) -> dict[str, Any]:
        old = self._get(kind, ns, name)
        if content_type == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(old, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise error(422, "Invalid", f"the JSON patch does not apply: {e}") from None
            rv = None
        elif content_type in ("application/merge-patch+json", "application/apply-patch+yaml"):
            new = merge_patch(old, body)
            rv = ((body or {}).get("metadata") or {}).get("resourceVersion")
        elif content_type == "application/strategic-merge-patch+json":
            if kind.schema is not None:
                raise error(
                    415, "UnsupportedMediaType", "strategic merge patch is not supported for custom resources"
                )
            new = strategic_merge_patch(old, body)
            rv = ((body or {}).get("metadata") or {}).get("resourceVersion")
        else:
            raise error(415, "UnsupportedMediaType", f"the patch type {content_type} is not supported")
        return await self._write(kind, ns, name, new, sub, params, rv)

    async def delete(self, kind: Resource, ns: str | None, name: str, policy: str = "Background") -> dict:
        key = self._key(kind, ns, name)
        obj = self._get(kind, ns, name)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                obj = self._store(key, obj, "MODIFIED")
                await self._notify()
            return obj
        stored = self._store(key, obj, "DELETED")
        if kind.plural == "customresourcedefinitions":
            for r in self._crd_resources(obj):
                for child_key in [k for k in self.objects if k[:3] == (r.group, r.version, r.plural)]:
                    self._store(child_key, self.objects[child_key], "DELETED")
                self.unregister(r.group, r.version, r.plural)
        if policy == "Orphan":
            await self._orphan(meta["uid"])
        else:
            await self._collect_garbage(meta["uid"])
        await self._notify()
        return stored

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Delete the dependents of a deleted owner (and theirs), as the garbage collector does."""
        dependents = [
            k for k, o in self.objects.items()
            if any(r.get("uid") == owner_uid for r in o["metadata"].get("ownerReferences", []))
        ]  # fmt: skip
        for key in dependents:
            if key not in self.objects:
                continue
            kind = self.kinds.get(key[:3])
            if kind is not None:
                await self.delete(kind, key[3], key[4])

    async def _orphan(self, owner_uid: str) -> None:
        for key, o in list(self.objects.items()):
            refs = o["metadata"].get("ownerReferences", [])
            if any(r.get("uid") == owner_uid for r in refs):
                o = copy.deepcopy(o)
                o["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != owner_uid]
                self._store(key, o, "MODIFIED")

    # ---- reading ----

    def _select(self, kind: Resource, ns: str | None, params: dict[str, str]) -> list[dict[str, Any]]:
        labels, fields = (
            label_matcher(params.get("labelSelector")),
            field_matcher(params.get("fieldSelector")),
        )
        out = []
        for (g, v, p, n, _), obj in sorted(self.objects.items(), key=lambda kv: (kv[0][3] or "", kv[0][4])):
            if (g, v, p) != (kind.group, kind.version, kind.plural) or (ns is not None and n != ns):
                continue
            if labels(obj["metadata"].get("labels") or {}) and fields(obj):
                out.append(copy.deepcopy(obj))
        return out

    def _list(self, kind: Resource, ns: str | None, params: dict[str, str], accept: str) -> dict[str, Any]:
        items = self._select(kind, ns, params)
        if "as=Table" in accept:
            return self._table(kind, items)
        return {
            "apiVersion": kind.api_version,
            "kind": f"{kind.kind}List",
            "metadata": {"resourceVersion": str(self.last_revision)},
            "items": items,
        }

    def _scale_view(self, kind: Resource, obj: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")},
            "spec": {"replicas": dig(obj, ["spec", "replicas"]) or 0},
            "status": {"replicas": dig(obj, ["status", "replicas"]) or 0},
        }

    def _table(self, kind: Resource, items: list[dict[str, Any]]) -> dict[str, Any]:
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name"}]
        extra = kind.printer_columns or self._builtin_columns(kind)
        columns += [
            {
                "name": c["name"],
                "type": c.get("type", "string"),
                "format": "",
                "description": c.get("description", ""),
            }
            for c in extra
        ]
        if not any(c["name"] == "Age" for c in extra):
            columns.append({"name": "Age", "type": "string", "format": "", "description": "Age"})
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for c in extra:
                value = c["fn"](obj) if "fn" in c else json_path(obj, c["jsonPath"])
                if c.get("type") == "date":
                    value = age(value)
                cells.append("" if value is None else value)
            if not any(c["name"] == "Age" for c in extra):
                cells.append(age(obj["metadata"].get("creationTimestamp")))
            partial = {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadata",
                "metadata": obj["metadata"],
            }
            rows.append({"cells": cells, "object": partial})
        return {
            "apiVersion": "meta.k8s.io/v1",
            "kind": "Table",
            "metadata": {"resourceVersion": str(self.last_revision)},
            "columnDefinitions": columns,
            "rows": rows,
        }

    @staticmethod
    def _builtin_columns(kind: Resource) -> list[dict[str, Any]]:
        def statuses(o):
            return dig(o, ["status", "containerStatuses"]) or []

        def ready_pods(o):
            ready = sum(bool(s.get("ready")) for s in statuses(o))
            return f"{ready}/{len(dig(o, ['spec', 'containers']) or [])}"

        def ready_replicas(o):
            return f"{dig(o, ['status', 'readyReplicas']) or 0}/{dig(o, ['spec', 'replicas']) or 0}"

        def restarts(o):
            return sum(s.get("restartCount", 0) for s in statuses(o))

        def job_status(o):
            done = [c["type"] for c in dig(o, ["status", "conditions"]) or [] if c.get("status") == "True"]
            return done[0] if done else "Running"

        def completions(o):
            return f"{dig(o, ['status', 'succeeded']) or 0}/{dig(o, ['spec', 'completions']) or 1}"

        table = {
            "pods": [
                {"name": "Ready", "fn": ready_pods},
                {"name": "Status", "jsonPath": ".status.phase"},
                {
                    "name": "Restarts",
                    "type": "integer",
                    "fn": lambda o: sum(s.get("restartCount", 0) for s in statuses(o)),
                },
            ],
            "deployments": [
                {"name": "Ready", "fn": ready_replicas},
                {"name": "Up-to-date", "type": "integer", "jsonPath": ".status.updatedReplicas"},
                {"name": "Available", "type": "integer", "jsonPath": ".status.availableReplicas"},
            ],
            "jobs": [{"name": "Status", "fn": job_status}, {"name": "Completions", "fn": completions}],
            "services": [
                {"name": "Type", "jsonPath": ".spec.type"},
                {"name": "Cluster-IP", "jsonPath": ".spec.clusterIP"},
            ],
            "persistentvolumeclaims": [{"name": "Status", "jsonPath": ".status.phase"}],
        }
        return table.get(kind.plural, [])

    async def _watch(self, raw, kind: Resource, ns: str | None, name: str | None, params: dict[str, str]):
        labels, fields = (
            label_matcher(params.get("labelSelector")),
            field_matcher(params.get("fieldSelector")),
        )
        timeout = float(params.get("timeoutSeconds") or 1800)
        since = params.get("resourceVersion")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)

        def wanted(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            return (
                (ns is None or meta.get("namespace") == ns)
                and (name is None or meta.get("name") == name)
                and labels(meta.get("labels") or {})
                and fields(obj)
            )

        async def send(event: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": event, "object": obj}).encode() + b"\n")

        log = self.history[(kind.group, kind.version, kind.plural)]
        if since in (None, "", "0"):
            for obj in self._select(kind, ns, params):
                if wanted(obj):
                    await send("ADDED", obj)
            position = len(log)
        else:
            position = next((i for i, (rv, _, _) in enumerate(log) if rv > int(since)), len(log))
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                while position < len(log):
                    _, event, obj = log[position]
                    position += 1
                    if wanted(obj):
                        await send(event, obj)
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait_for(lambda p=position: p < len(log)), left)
                    except TimeoutError:
                        break
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    # ---- hooks for the process kubelet (local mode) ----

    def pod_log(self, namespace: str, name: str) -> str:
        """Container log of a pod; the process kubelet overrides where logs live."""
        raise error(404, "NotFound", f'no log for pod "{name}" in namespace "{namespace}"')


def kubeconfig(server_url: str, namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig for kubectl and kopf that points at the emulated server (no credentials needed)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "neuronfleet-local", "cluster": {"server": server_url}}],
        "users": [{"name": "neuronfleet-local", "user": {"token": "emulated"}}],
        "contexts": [
            {
                "name": "neuronfleet-local",
                "context": {
                    "cluster": "neuronfleet-local",
                    "user": "neuronfleet-local",
                    "namespace": namespace,
                },
            }
        ],
        "current-context": "neuronfleet-local",
    }


async def run(
    host: str,
    port: int,
    kubeconfig_path: str | None,
    ready_file: str | None,
    audit_log: str | None = None,
    kubelet_state: str | None = None,
) -> None:
    server = EmulatedAPIServer()
    server.audit_log = audit_log
    kubelet = None
    if kubelet_state:  # local mode: this process also runs the pods
        from .kubelet import ProcessKubelet

        kubelet = asyncio.get_running_loop().create_task(ProcessKubelet(server, Path(kubelet_state)).run())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    _, listener = await server.serve(host, port)
    bound = listener.sockets[0].getsockname()[1]
    url = f"http://{host}:{bound}"
    if kubeconfig_path:
        import yaml

        with open(kubeconfig_path, "w") as f:
            yaml.safe_dump(kubeconfig(url), f)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(url)
    print(f"emulated Kubernetes API server on {url}", flush=True)
    await stop.wait()
    if kubelet is not None:  # stops every pod process it started
        kubelet.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await kubelet


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="An emulated Kubernetes API server (neuronfleet).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--kubeconfig", help="write a kubeconfig pointing at the server here")
    parser.add_argument("--ready-file", help="write the server's URL here once it listens")
    parser.add_argument("--audit-log", help="append one JSON line per resource request here")
    parser.add_argument("--kubelet-state", help="also run the process kubelet, its state in this folder")
    args = parser.parse_args(argv)
    if args.kubelet_state:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(
        run(args.host, args.port, args.kubeconfig, args.ready_file, args.audit_log, args.kubelet_state)
    )


if __name__ == "__main__":
    main()
