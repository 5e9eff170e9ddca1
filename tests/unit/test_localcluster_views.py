"""The local API server's pure views and bookkeeping: kubectl's durations, the names a real server refuses,
protobuf bodies read, the store's per-kind index (LIST order and namespaces) and its bounded history."""

from __future__ import annotations

import asyncio

import pytest

from neuronfleet.localcluster import protobuf
from neuronfleet.localcluster.admission import check_name, name_problems
from neuronfleet.localcluster.semantics import ApiError, Resource
from neuronfleet.localcluster.store import Expired, Store
from neuronfleet.localcluster.tables import human_duration

CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap", True)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [  # apimachinery pkg/util/duration: HumanDuration
        (-5, "<invalid>"), (-1, "0s"), (0, "0s"), (119, "119s"), (120, "2m"), (125, "2m5s"), (600, "10m"),
        (179 * 60, "179m"), (3 * 3600, "3h"), (3 * 3600 + 120, "3h2m"), (8 * 3600 + 59, "8h"),
        (47 * 3600, "47h"), (48 * 3600, "2d"), (49 * 3600, "2d1h"), (8 * 86400, "8d"),
        (2 * 365 * 86400, "2y"), (2 * 365 * 86400 + 86400, "2y1d"), (9 * 365 * 86400, "9y"),
    ],
)  # fmt: skip
def test_durations_read_as_kubectl_prints_them(seconds, shown):
    assert human_duration(seconds) == shown


def test_names_follow_the_kinds_dns_rules():
    namespaces = Resource("", "v1", "namespaces", "Namespace", False)
    services = Resource("", "v1", "services", "Service", True)
    assert name_problems(namespaces, "team-a") == [] and name_problems(CONFIGMAPS, "a.b-c") == []
    assert name_problems(namespaces, "a.b")  # a label has no dots
    assert name_problems(services, "1abc") and not name_problems(
        CONFIGMAPS, "1abc"
    )  # DNS-1035: a letter first
    assert name_problems(namespaces, "a" * 64) == ["must be no more than 63 characters"]
    with pytest.raises(ApiError) as refused:
        check_name(CONFIGMAPS, "S-Bad_Name")
    assert refused.value.code == 422 and refused.value.details["causes"][0]["field"] == "metadata.name"


def _varint(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def _field(number: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def test_a_protobuf_configmap_reads_as_its_json():
    entry = _field(1, "mode") + _field(2, "unified")
    meta = _field(1, "settings") + _field(2, "") + _field(11, _field(1, "app") + _field(2, "m"))
    raw = _field(1, meta) + _field(2, entry)
    body = protobuf.MAGIC + _field(1, _field(1, "v1") + _field(2, "ConfigMap")) + _field(2, raw)
    assert protobuf.decode(body) == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "labels": {"app": "m"}},  # an empty generateName is absent
        "data": {"mode": "unified"},
    }
    pod = protobuf.MAGIC + _field(1, _field(1, "v1") + _field(2, "Pod")) + _field(2, b"")
    with pytest.raises(ApiError, match="kubectl apply -f FILE") as refused:
        protobuf.decode(pod)
    assert refused.value.code == 415
    unknown = raw + _field(9, "x")  # a field this server does not know, holding a value: refused, not dropped
    body = protobuf.MAGIC + _field(1, _field(1, "v1") + _field(2, "ConfigMap")) + _field(2, unknown)
    with pytest.raises(ApiError, match="field 9 is not one this server reads"):
        protobuf.decode(body)
    with pytest.raises(ApiError, match="does not parse"):
        protobuf.decode(protobuf.MAGIC + b"\x0a\x05ab")  # a field longer than the body


def test_lists_come_sorted_by_namespace_and_name_and_history_is_bounded():
    async def scenario() -> None:
        store = Store(history=3)
        for ns in ("b", "a", "ab"):
            await store.create(Resource("", "v1", "namespaces", "Namespace", False), None,
                               {"metadata": {"name": ns}}, {})  # fmt: skip
        for ns, name in (("b", "z"), ("a", "y"), ("ab", "x"), ("a", "c")):
            await store.create(CONFIGMAPS, ns, {"metadata": {"name": name}}, {})

        def names(ns):
            return [
                (o["metadata"]["namespace"], o["metadata"]["name"]) for o in store.select(CONFIGMAPS, ns, {})
            ]

        assert names(None) == [("a", "c"), ("a", "y"), ("ab", "x"), ("b", "z")]
        assert names("a") == [("a", "c"), ("a", "y")] and names("ab") == [("ab", "x")]
        await store.delete(CONFIGMAPS, "a", "c")
        assert names("a") == [("a", "y")]
        first = store.last_revision
        for n in range(7):  # 3 kept, dropped in blocks of 3 once there are more than 6
            await store.patch(CONFIGMAPS, "b", "z", {"data": {"n": str(n)}}, "application/merge-patch+json",
                              None, {})  # fmt: skip
        stale = store.watch(CONFIGMAPS, None, None, {"resourceVersion": str(first)}, 0)
        with pytest.raises(Expired, match=f"too old resource version: {first}"):
            await anext(stale)
        recent = store.watch(CONFIGMAPS, None, None, {"resourceVersion": str(store.last_revision - 1)}, 0)
        event, obj = await anext(recent)
        assert (event, obj["data"]) == ("MODIFIED", {"n": "6"})
        await recent.aclose()

    asyncio.run(scenario())


def test_a_crds_scale_subresource_reads_and_writes_its_declared_paths():
    from neuronfleet.localcluster.semantics import crd_resources, scale_view, with_replicas

    scale = {"specReplicasPath": ".spec.size", "statusReplicasPath": ".status.count",
             "labelSelectorPath": ".status.selector"}  # fmt: skip
    versions = [{"name": "v1", "subresources": {"status": {}, "scale": scale}}]
    crd = {
        "spec": {"group": "example.dev", "names": {"plural": "pools", "kind": "Pool"}, "versions": versions}
    }
    (pools,) = crd_resources(crd)
    assert "scale" in pools.subresources
    pool = {"metadata": {"name": "p", "namespace": "d", "uid": "u", "resourceVersion": "4"},
            "spec": {"size": 2}, "status": {"count": 1, "selector": "app=p"}}  # fmt: skip
    view = scale_view(pool, pools)
    assert (view["kind"], view["spec"], view["status"]) == (
        "Scale",
        {"replicas": 2},
        {"replicas": 1, "selector": "app=p"},
    )
    assert with_replicas(pool, 5, pools)["spec"] == {"size": 5} and pool["spec"] == {"size": 2}
    with pytest.raises(ApiError, match="must be greater than or equal to 0"):
        with_replicas(pool, -1, pools)


def test_garbage_collection_follows_owner_references_through_the_owner_index():
    async def scenario() -> None:
        store = Store()

        async def make(name: str, owner: dict | None = None) -> dict:
            refs = [{"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
                     "uid": owner["metadata"]["uid"]}] if owner else []  # fmt: skip
            return await store.create(
                CONFIGMAPS, "default", {"metadata": {"name": name, "ownerReferences": refs}}, {}
            )

        def names() -> list[str]:
            return [o["metadata"]["name"] for o in store.select(CONFIGMAPS, "default", {})]

        root = await make("root")
        child = await make("child", root)
        await make("grandchild", child)
        kept = await make("kept")
        orphan = await make("orphan", kept)
        await store.patch(
            CONFIGMAPS,
            "default",
            "orphan",
            {"metadata": {"ownerReferences": None}},
            "application/merge-patch+json",
            None,
            {},
        )  # fmt: skip  (no longer a dependent)
        await store.delete(CONFIGMAPS, "default", "kept")
        assert "orphan" in names()
        await store.delete(CONFIGMAPS, "default", "root")  # background: the whole chain goes
        assert names() == ["orphan"]
        owner = await make("owner")
        await make("dependent", owner)
        await store.delete(CONFIGMAPS, "default", "owner", "Orphan")
        (left,) = [o for o in store.select(CONFIGMAPS, "default", {}) if o["metadata"]["name"] == "dependent"]
        assert left["metadata"]["ownerReferences"] == [] and orphan["metadata"]["name"] == "orphan"
        # written after its owner went (a controller that had not seen the delete yet): collected
        gone = {"metadata": {"name": "gone", "uid": root["metadata"]["uid"]}}
        late = await make("late", gone)
        await store.collect_orphan(CONFIGMAPS, late)  # (what the API server does after a client's write)
        assert late["metadata"]["name"] == "late" and "late" not in names()  # the write succeeded, then GC
        survivor = await make("survivor", left)  # an owner that exists: kept
        await store.collect_orphan(CONFIGMAPS, survivor)
        assert "survivor" in names() and survivor["metadata"]["ownerReferences"][0]["name"] == "dependent"

    asyncio.run(scenario())
