"""The emulated API server's state: the registry of kinds, the objects (indexed by kind, kept in
namespace/name order for LIST), resourceVersions and the bounded history of changes that watches replay; the
REST semantics of each write (create, update, patch, delete with finalizers and garbage collection, the status
and scale subresources kept apart, cluster IPs allocated); and `ClusterClient`, the small typed interface
in-process callers (the process kubelet) use instead of HTTP.

Stored objects are never changed in place: every write stores a new version, so LIST answers and the history
share them without copying. `snapshot` and `restore` carry the objects over a restart of the server (as etcd
does for a real one), the node's own (pods, EndpointSlices) excepted: its kubelet makes them again.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import ipaddress
import itertools
import secrets
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator
from typing import Any

from .admission import check_labels, check_name, default_on_create
from .semantics import (
    BUILTIN,
    MERGE_PATCH,
    PRECREATED_NAMESPACES,
    ApiError,
    Resource,
    admit,
    apply_patch,
    crd_resources,
    established,
    not_found,
    now,
    object_matcher,
    scale_view,
    spec_changed,
    with_replicas,
)

Key = tuple[str, str, str, str | None, str]  # group, version, plural, namespace, name
KindKey = tuple[str, str, str]
CRDS = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
SERVICES = ("", "v1", "services")
SCALE = Resource("autoscaling", "v1", "scale", "Scale", True)  # what a patch of /scale patches
NODE_KINDS = {("", "v1", "pods"), ("discovery.k8s.io", "v1", "endpointslices")}  # not kept over a restart
HISTORY = 5000  # events a kind keeps for watches that resume from a resourceVersion (the watch cache's job)


class Expired(Exception):
    """A watch asked for changes older than the history kept: the client must list again (410 Gone)."""


class _Log:
    """A kind's recent changes, (resourceVersion, event, object), in order; positions are absolute (they stay
    valid while old entries are dropped), and at most 2 * `keep` entries are kept."""

    def __init__(self, keep: int = HISTORY, compacted_rv: int = 0) -> None:
        self.keep = keep
        self.entries: list[tuple[int, str, dict[str, Any]]] = []
        self.first = 0  # the position of entries[0]
        self.compacted_rv = compacted_rv  # the resourceVersion of the newest dropped entry

    @property
    def end(self) -> int:
        return self.first + len(self.entries)

    def append(self, rv: int, event: str, obj: dict[str, Any]) -> None:
        self.entries.append((rv, event, obj))
        if len(self.entries) > 2 * self.keep:
            self.compacted_rv = self.entries[self.keep - 1][0]
            del self.entries[: self.keep]
            self.first += self.keep

    def at(self, position: int) -> tuple[int, str, dict[str, Any]]:
        if position < self.first:
            raise Expired("the watch fell behind the history kept; list again")
        return self.entries[position - self.first]

    def after(self, rv: int) -> int:
        """The position of the first change newer than `rv`; Expired when older changes were dropped."""
        if rv < self.compacted_rv:
            raise Expired(f"too old resource version: {rv} ({self.compacted_rv})")
        i = bisect.bisect_right(self.entries, rv, key=lambda e: e[0])
        return self.first + i


class Store:
    """Kinds, objects and their history; every write bumps the revision and wakes the watchers."""

    def __init__(self, history: int = HISTORY) -> None:
        self.kinds: dict[KindKey, Resource] = {}
        self.kinds_revision = 0  # changes whenever a kind comes, goes or changes (the OpenAPI hash)
        self.instance = uuid.uuid4().hex[:12]  # tells this server's documents from an earlier one's
        self._objects: dict[Key, dict[str, Any]] = {}
        self._by_kind: dict[KindKey, dict[tuple[str, str], dict[str, Any]]] = defaultdict(dict)
        self._sorted: dict[KindKey, list[tuple[str, str]]] = {}  # (namespace, name) keys, while valid
        self._dependents: dict[str, set[Key]] = defaultdict(set)  # owner uid -> keys of its dependents
        self._uids: set[str] = set()  # the uids of the objects that exist (the owners the collector knows)
        self._revision = itertools.count(1)
        self.last_revision = 0
        self._restored_rv = 0  # a watch from before this resourceVersion (a restart) lists again
        self._watch_epoch = 0  # bumped by `expire_watches`: every watch running then ends with 410
        self._history: dict[KindKey, _Log] = defaultdict(lambda: _Log(history, self._restored_rv))
        self._changed = asyncio.Condition()
        self.closed = False
        for resource in BUILTIN:
            self._register(resource)
        for name in PRECREATED_NAMESPACES:
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            self._put(("", "v1", "namespaces", None, name), self._new_meta(namespace))

    # ---- registry ----

    # ---- over a restart ----

    def snapshot(self) -> dict[str, Any]:
        """What a restart keeps: the revision and every object but the node's (cheap: stored versions are
        never changed in place, so this shares them; serialize it before the next write if it must not
        change)."""
        kept = [obj for key, obj in self._objects.items() if key[:3] not in NODE_KINDS]
        return {"revision": self.last_revision, "objects": kept}

    def restore(self, saved: dict[str, Any]) -> None:
        """A new store's objects from a `snapshot`: custom resource definitions first (their kinds), then
        the rest in the order they were written; objects of kinds no longer served are dropped. Resource
        versions go on from the saved revision, and a watch from before the restart lists again (410)."""
        revision = int(saved.get("revision", 0))
        self._revision = itertools.count(max(revision, self.last_revision) + 1)

        def order(o: dict[str, Any]) -> tuple[bool, int]:  # CRDs first, then as written
            return o.get("kind") != "CustomResourceDefinition", int(o["metadata"].get("resourceVersion", 0))

        for obj in sorted(saved.get("objects", []), key=order):
            group, _, version = obj["apiVersion"].rpartition("/")
            kind = next((k for k in self.kinds.values() if (k.group, k.version, k.kind) == (group, version,
                         obj["kind"])), None)  # fmt: skip
            if kind is None:
                continue
            meta = obj["metadata"]
            self._put(self._key(kind, meta.get("namespace"), meta["name"]), obj)
            if kind.plural == "customresourcedefinitions":
                self._establish(obj)
        self._restored_rv = self.last_revision
        self._history.clear()  # (the restored objects are no change a watch replays)

    async def expire_watches(self) -> None:
        """End every watch with 410 Expired and make every resourceVersion so far too old to resume from, as
        an etcd compaction with a restarted watch cache does (a fault switch for tests: apiserver)."""
        self._restored_rv = self.last_revision
        self._history.clear()
        self._watch_epoch += 1
        await self.notify()

    def _register(self, r: Resource) -> None:
        self.kinds[(r.group, r.version, r.plural)] = r
        self.kinds_revision += 1

    def kind(self, group: str, version: str, plural: str) -> Resource:
        kind = self.kinds.get((group, version, plural))
        if kind is None:
            what = f"{plural}.{group}" if group else plural
            raise ApiError(404, "NotFound", f"the server doesn't have a resource type {what!r}")
        return kind

    # ---- change notification ----

    def _put(self, key: Key, obj: dict[str, Any], event: str = "ADDED") -> dict[str, Any]:
        """Record a new version of an object. Stored versions are never changed in place (a write stores a
        new object), so the store, the history and LIST answers share them without copies."""
        rv = next(self._revision)
        self.last_revision = rv
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}
        kind, inner = key[:3], (key[3] or "", key[4])
        self._index_owners(key, self._objects.get(key), None if event == "DELETED" else obj)
        uid = obj["metadata"].get("uid")
        if event == "DELETED":
            self._objects.pop(key, None)
            self._by_kind[kind].pop(inner, None)
            self._sorted.pop(kind, None)
            self._uids.discard(uid)
        else:
            if key not in self._objects:
                self._sorted.pop(kind, None)
            if uid:
                self._uids.add(uid)
            self._objects[key] = obj
            self._by_kind[kind][inner] = obj
        self._history[kind].append(rv, event, obj)
        return copy.deepcopy(obj)

    def _index_owners(self, key: Key, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """Keep `_dependents` (owner uid -> keys of the objects that name it) up to date."""

        def owners(o: dict[str, Any] | None) -> set[str]:
            refs = (o or {}).get("metadata", {}).get("ownerReferences") or []
            return {r["uid"] for r in refs if r.get("uid")}

        before, after = owners(old), owners(new)
        for uid in before - after:
            self._dependents[uid].discard(key)
            if not self._dependents[uid]:
                del self._dependents[uid]
        for uid in after - before:
            self._dependents[uid].add(key)

    async def close(self) -> None:
        """End every watch (the server is stopping)."""
        self.closed = True
        await self.notify()

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

    def _keys(self, kind: KindKey) -> list[tuple[str, str]]:
        """The kind's (namespace, name) keys in order, sorted again only after an object came or went."""
        keys = self._sorted.get(kind)
        if keys is None:
            keys = self._sorted[kind] = sorted(self._by_kind[kind])
        return keys

    def select(self, kind: Resource, ns: str | None, params: dict[str, str]) -> list[dict[str, Any]]:
        """The objects of a kind (in one namespace, or all) that match the request's selectors, by namespace
        and name. They are the stored versions themselves: read them, never change them."""
        wanted = object_matcher(params)
        kk = (kind.group, kind.version, kind.plural)
        keys, objects = self._keys(kk), self._by_kind[kk]
        if ns is not None:
            lo = bisect.bisect_left(keys, (ns, ""))
            hi = bisect.bisect_left(keys, (ns + "\0", ""))
            keys = keys[lo:hi]
        return [o for o in (objects[k] for k in keys) if wanted(o)]

    def objects_of(self, kind: Resource) -> list[dict[str, Any]]:
        """Every object of a kind, in every namespace, oldest first (copies)."""
        objects = self._by_kind[(kind.group, kind.version, kind.plural)]
        return [copy.deepcopy(o) for o in list(objects.values())]

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
            position = log.end
        else:
            try:
                position = log.after(int(since))
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid resource version: {since!r}") from None
        deadline = asyncio.get_running_loop().time() + timeout
        epoch = self._watch_epoch
        while not self.closed:
            if self._watch_epoch != epoch:
                raise Expired("the watch cache was reset; list again")
            while position < log.end:
                _, event, obj = log.at(position)
                position += 1
                if wanted(obj):
                    yield event, obj
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            async with self._changed:
                try:
                    ready = lambda p=position: p < log.end or self.closed or self._watch_epoch != epoch  # noqa: E731
                    await asyncio.wait_for(self._changed.wait_for(ready), left)
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
        check_name(kind, name)
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
        obj = default_on_create(kind, self._new_meta(obj))
        check_labels(kind, obj)
        if key[:3] == SERVICES:
            self._allocate_cluster_ip(obj)
        stored = self._put(key, obj)
        await self.notify()
        return stored

    async def collect_orphan(self, kind: Resource, obj: dict[str, Any]) -> None:
        """After a client's write: an object written with owner references none of whose owners exists (its
        owner was deleted while the writer did not know yet) is deleted, as the garbage collector deletes
        dependents whose owners are all gone (https://kubernetes.io/docs/concepts/architecture/
        garbage-collection/); the write itself succeeded, as on a real cluster. (Not for the in-process
        controllers' own writes: they follow the store, not a stale cache.)"""
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        key = self._key(kind, meta.get("namespace"), meta["name"])
        if refs and not any(r.get("uid") in self._uids for r in refs) and key in self._objects:
            await self.delete(kind, meta.get("namespace"), meta["name"])

    def _allocate_cluster_ip(self, service: dict[str, Any]) -> None:
        """A free address from the service range 10.96.0.0/12 (kube-apiserver's default
        --service-cluster-ip-range), as the allocator gives one; "None" (headless) and a requested free
        address are kept."""
        spec = service["spec"]
        used = {(o.get("spec") or {}).get("clusterIP") for o in self._by_kind[SERVICES].values()}
        wanted = spec.get("clusterIP")
        if wanted == "None" or (spec.get("type") == "ExternalName" and not wanted):
            if wanted == "None":
                spec["clusterIPs"] = ["None"]
            return
        if wanted:
            if wanted in used:
                raise ApiError(
                    422, "Invalid",
                    f'Service "{service["metadata"]["name"]}" is invalid: spec.clusterIPs: Invalid value: '
                    f'["{wanted}"]: failed to allocate IP {wanted}: provided IP is already allocated',
                )  # fmt: skip
        else:
            base = int(ipaddress.IPv4Address("10.96.0.0"))
            while True:  # the range's first address is the kubernetes Service's; 2^20 addresses in all
                wanted = str(ipaddress.IPv4Address(base + secrets.randbelow((1 << 20) - 2) + 2))
                if wanted not in used:
                    break
        spec["clusterIP"], spec["clusterIPs"] = wanted, [wanted]
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")

    async def replace(self, kind: Resource, ns, name, body, sub: str | None, params) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of an update must be an object")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        return await self._write(kind, ns, name, copy.deepcopy(body), sub, params, rv)

    async def patch(self, kind: Resource, ns, name, body, content_type: str, sub, params) -> dict[str, Any]:
        """A patch of the object, or with sub="scale" of its Scale (the object's replicas follow)."""
        old = self.get(kind, ns, name)
        if sub == "scale":
            new, rv = apply_patch(SCALE, scale_view(old, kind), body, content_type)
        else:
            new, rv = apply_patch(kind, old, body, content_type)
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
            new = with_replicas(old, (new.get("spec") or {}).get("replicas"), kind)
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
        if key[:3] == SERVICES and sub is None:
            self._keep_cluster_ip(old, new)
        meta["generation"] = old["metadata"].get("generation", 1) + spec_changed(old, new)
        if sub is None:
            new = admit(kind, new, params)
            check_labels(kind, new)
        elif sub == "scale":  # the object the new replicas make is checked against the schema too
            new = admit(kind, new, {})
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

    @staticmethod
    def _keep_cluster_ip(old: dict[str, Any], new: dict[str, Any]) -> None:
        """An update keeps the allocated cluster IP (the Service strategy's PatchAllocatedValues); changing
        it is refused, as the field is immutable."""
        before, spec = (old.get("spec") or {}), new.setdefault("spec", {})
        if not before.get("clusterIP"):
            return
        if spec.get("clusterIP") in (None, ""):
            spec["clusterIP"] = before["clusterIP"]
            spec["clusterIPs"] = before.get("clusterIPs", [before["clusterIP"]])
        elif spec["clusterIP"] != before["clusterIP"]:
            raise ApiError(
                422, "Invalid",
                f'Service "{old["metadata"]["name"]}" is invalid: spec.clusterIPs[0]: Invalid value: '
                f'["{spec["clusterIP"]}"]: may not change once set',
            )  # fmt: skip
        for field in ("ipFamilies", "ipFamilyPolicy"):
            if field in before:
                spec.setdefault(field, before[field])

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
                for ns_name, child in list(self._by_kind[(r.group, r.version, r.plural)].items()):
                    self._put(self._key(r, ns_name[0] or None, ns_name[1]), child, "DELETED")
                self.kinds.pop((r.group, r.version, r.plural), None)
                self.kinds_revision += 1
        if policy == "Orphan":
            self._orphan(meta["uid"])
        else:
            await self._collect_garbage(meta["uid"])
        await self.notify()
        return stored

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Delete the dependents of a deleted owner (and theirs), as the garbage collector does."""
        for key in sorted(self._dependents.get(owner_uid, ()), key=str):
            if key not in self._objects:
                continue
            kind = self.kinds.get(key[:3])
            if kind is not None:
                await self.delete(kind, key[3], key[4])

    def _orphan(self, owner_uid: str) -> None:
        for key in sorted(self._dependents.get(owner_uid, ()), key=str):
            o = copy.deepcopy(self._objects[key])
            refs = o["metadata"].get("ownerReferences", [])
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

    async def create(self, group: str, version: str, plural: str, namespace: str | None, body: dict) -> dict:
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
