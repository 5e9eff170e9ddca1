"""The emulated API server's state: the registry of kinds, the objects, resourceVersions and the history of
changes that watches replay; the REST semantics of each write (create, update, patch, delete with finalizers
and garbage collection, the status and scale subresources kept apart); and `ClusterClient`, the small typed
interface in-process callers (the process kubelet) use instead of HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import secrets
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator
from typing import Any

from .semantics import (
    BUILTIN,
    MERGE_PATCH,
    PRECREATED_NAMESPACES,
    ApiError,
    Resource,
    admit,
    apply_patch,
    crd_resources,
    dig,
    established,
    not_found,
    now,
    object_matcher,
    spec_changed,
)

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name
CRDS = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")


class Store:
    """Kinds, objects and their history; every write bumps the revision and wakes the watchers."""

    def __init__(self) -> None:
        self.kinds: dict[tuple[str, str, str], Resource] = {}
        self._objects: dict[Key, dict[str, Any]] = {}
        self._revision = itertools.count(1)
        self.last_revision = 0
        self._history: dict[tuple[str, str, str], list[tuple[int, str, dict]]] = defaultdict(list)
        self._changed = asyncio.Condition()
        for resource in BUILTIN:
            self._register(resource)
        for name in PRECREATED_NAMESPACES:
            self._put(("", "v1", "namespaces", None, name), self._new_meta({"metadata": {"name": name}}))

    # ---- registry ----

    def _register(self, r: Resource) -> None:
        self.kinds[(r.group, r.version, r.plural)] = r

    def kind(self, group: str, version: str, plural: str) -> Resource:
        kind = self.kinds.get((group, version, plural))
        if kind is None:
            what = f"{plural}.{group}" if group else plural
            raise ApiError(404, "NotFound", f"the server doesn't have a resource type {what!r}")
        return kind

    # ---- change notification ----

    def _put(self, key: Key, obj: dict[str, Any], event: str = "ADDED") -> dict[str, Any]:
        rv = next(self._revision)
        self.last_revision = rv
        obj["metadata"]["resourceVersion"] = str(rv)
        if event == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        self._history[key[:3]].append((rv, event, copy.deepcopy(obj)))
        return copy.deepcopy(obj)

    async def notify(self) -> None:
        """Wake everyone waiting for a change (watches, the kubelet)."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_for_change(self, timeout: float) -> None:
        """Return at the next change, or after `timeout` seconds."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)

    # ---- reading ----

    def get(self, kind: Resource, ns: str | None, name: str | None) -> dict[str, Any]:
        obj = self._objects.get(self._key(kind, ns, name or ""))
        if obj is None:
            raise not_found(kind, name)
        return copy.deepcopy(obj)

    def select(self, kind: Resource, ns: str | None, params: dict[str, str]) -> list[dict[str, Any]]:
        """The objects of a kind (in one namespace, or all) that match the request's selectors."""
        wanted = object_matcher(params)
        out = []
        for (g, v, p, n, _), obj in sorted(self._objects.items(), key=lambda kv: (kv[0][3] or "", kv[0][4])):
            if (g, v, p) != (kind.group, kind.version, kind.plural) or (ns is not None and n != ns):
                continue
            if wanted(obj):
                out.append(copy.deepcopy(obj))
        return out

    def objects_of(self, kind: Resource) -> list[dict[str, Any]]:
        """Every object of a kind, in every namespace, oldest first."""
        wanted = (kind.group, kind.version, kind.plural)
        return [copy.deepcopy(o) for k, o in list(self._objects.items()) if k[:3] == wanted]

    def watch(
        self, kind: Resource, ns: str | None, name: str | None, params: dict[str, str], timeout: float
    ) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """(event, object) as they happen: from `params["resourceVersion"]` on, or first every current object
        as ADDED; ends after `timeout` seconds. Bad selectors are refused here, before any event."""
        return self._events(kind, ns, name, params, timeout, object_matcher(params))

    async def _events(
        self, kind, ns, name, params, timeout, matches
    ) -> AsyncGenerator[tuple[str, dict], None]:

        def wanted(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            return (
                (ns is None or meta.get("namespace") == ns)
                and (name is None or meta.get("name") == name)
                and matches(obj)
            )

        since = params.get("resourceVersion")
        log = self._history[(kind.group, kind.version, kind.plural)]
        if since in (None, "", "0"):
            for obj in self.select(kind, ns, params):
                if wanted(obj):
                    yield "ADDED", obj
            position = len(log)
        else:
            position = next((i for i, (rv, _, _) in enumerate(log) if rv > int(since)), len(log))
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            while position < len(log):
                _, event, obj = log[position]
                position += 1
                if wanted(obj):
                    yield event, obj
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda p=position: p < len(log)), left)
                except TimeoutError:
                    return

    # ---- writing ----

    def _key(self, kind: Resource, ns: str | None, name: str) -> Key:
        return (kind.group, kind.version, kind.plural, ns, name)

    @staticmethod
    def _new_meta(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        meta.setdefault("generation", 1)
        return obj

    def _check_namespace(self, kind: Resource, ns: str | None) -> None:
        if kind.namespaced and ("", "v1", "namespaces", None, ns) not in self._objects:
            raise ApiError(404, "NotFound", f'namespaces "{ns}" not found', name=ns, kind="namespaces")

    def _establish(self, crd: dict[str, Any]) -> None:
        established(crd)
        for r in crd_resources(crd):
            self._register(r)

    async def create(self, kind: Resource, ns: str | None, body: Any, params: dict[str, str]) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be an object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", f"{kind.kind} is invalid: metadata.name: Required value")
        if kind.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise ApiError(
                    400, "BadRequest", "the namespace of the provided object does not match the namespace "
                    "sent on the request",
                )  # fmt: skip
            ns = ns or meta.get("namespace") or "default"
            meta["namespace"] = ns
            self._check_namespace(kind, ns)
        key = self._key(kind, ns, name)
        if key in self._objects:
            group = f".{kind.group}" if kind.group else ""
            raise ApiError(409, "AlreadyExists", f'{kind.plural}{group} "{name}" already exists', name=name)
        for stale in ("resourceVersion", "uid", "deletionTimestamp"):
            meta.pop(stale, None)
        meta["generation"] = 1
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        if "status" in kind.subresources:
            obj.pop("status", None)  # the status subresource is written through /status only
        obj = admit(kind, obj, params)
        if key[:3] == CRDS:
            self._establish(obj)
        stored = self._put(key, self._new_meta(obj))
        await self.notify()
        return stored

    async def replace(self, kind: Resource, ns, name, body, sub: str | None, params) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of an update must be an object")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        return await self._write(kind, ns, name, copy.deepcopy(body), sub, params, rv)

    async def patch(self, kind: Resource, ns, name, body, content_type: str, sub, params) -> dict[str, Any]:
        new, rv = apply_patch(kind, self.get(kind, ns, name), body, content_type)
        return await self._write(kind, ns, name, new, sub, params, rv)

    async def _write(
        self, kind: Resource, ns: str | None, name: str, new: dict[str, Any], sub: str | None,
        params: dict[str, str], expected_rv: str | None,
    ) -> dict[str, Any]:  # fmt: skip
        key = self._key(kind, ns, name)
        old = self.get(kind, ns, name)
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            group = f".{kind.group}" if kind.group else ""
            raise ApiError(
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
        meta["generation"] = old["metadata"].get("generation", 1) + spec_changed(old, new)
        if sub is None:
            new = admit(kind, new, params)
        if new == old:
            return old  # a no-op write does not bump the resourceVersion
        if key[:3] == CRDS and sub is None:
            self._establish(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            stored = self._put(key, new, "DELETED")
            await self._collect_garbage(meta["uid"])
        else:
            stored = self._put(key, new, "MODIFIED")
        await self.notify()
        return stored

    async def delete(self, kind: Resource, ns: str | None, name: str, policy: str = "Background") -> dict:
        key = self._key(kind, ns, name)
        obj = self.get(kind, ns, name)
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = now()
                obj = self._put(key, obj, "MODIFIED")
                await self.notify()
            return obj
        stored = self._put(key, obj, "DELETED")
        if key[:3] == CRDS:
            for r in crd_resources(obj):
                for child_key in [k for k in self._objects if k[:3] == (r.group, r.version, r.plural)]:
                    self._put(child_key, self._objects[child_key], "DELETED")
                self.kinds.pop((r.group, r.version, r.plural), None)
        if policy == "Orphan":
            self._orphan(meta["uid"])
        else:
            await self._collect_garbage(meta["uid"])
        await self.notify()
        return stored

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Delete the dependents of a deleted owner (and theirs), as the garbage collector does."""
        dependents = [
            k for k, o in self._objects.items()
            if any(r.get("uid") == owner_uid for r in o["metadata"].get("ownerReferences", []))
        ]  # fmt: skip
        for key in dependents:
            if key not in self._objects:
                continue
            kind = self.kinds.get(key[:3])
            if kind is not None:
                await self.delete(kind, key[3], key[4])

    def _orphan(self, owner_uid: str) -> None:
        for key, o in list(self._objects.items()):
            refs = o["metadata"].get("ownerReferences", [])
            if any(r.get("uid") == owner_uid for r in refs):
                o = copy.deepcopy(o)
                o["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != owner_uid]
                self._put(key, o, "MODIFIED")


class ClusterClient:
    """What an in-process controller may do with the store: read objects, create and delete them, patch their
    status, and wait for changes. Kinds are named by (group, version, plural); objects come back as copies."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def list(self, group: str, version: str, plural: str) -> list[dict[str, Any]]:
        """Every object of the kind, in every namespace."""
        return self._store.objects_of(self._store.kind(group, version, plural))

    def get(self, group: str, version: str, plural: str, namespace: str | None, name: str) -> dict | None:
        """The object, or None."""
        try:
            return self._store.get(self._store.kind(group, version, plural), namespace, name)
        except ApiError:
            return None

    async def create(self, group: str, version: str, plural: str, namespace: str, body: dict) -> dict:
        return await self._store.create(self._store.kind(group, version, plural), namespace, body, {})

    async def delete(self, group: str, version: str, plural: str, namespace: str, name: str) -> None:
        await self._store.delete(self._store.kind(group, version, plural), namespace, name)

    async def patch_status(
        self, group: str, version: str, plural: str, namespace: str | None, name: str, status: dict
    ) -> None:
        """Merge `status` into the object's status subresource."""
        kind = self._store.kind(group, version, plural)
        await self._store.patch(kind, namespace, name, {"status": status}, MERGE_PATCH, "status", {})

    async def patch(
        self, group: str, version: str, plural: str, namespace: str | None, name: str, body: dict
    ):
        """Merge-patch the object itself (not a subresource)."""
        kind = self._store.kind(group, version, plural)
        await self._store.patch(kind, namespace, name, body, MERGE_PATCH, None, {})

    async def wait_for_change(self, timeout: float) -> None:
        """Return at the next change to any object, or after `timeout` seconds."""
        await self._store.wait_for_change(timeout)

    def wake(self) -> None:
        """Wake every waiter soon (from outside the store: a process died, a readiness changed)."""
        asyncio.get_running_loop().create_task(self._store.notify())
