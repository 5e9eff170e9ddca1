"""The local cluster's pure Kubernetes semantics (selectors, patches, schema defaults and pruning, tables,
Status errors) and the store as in-process callers see it through `ClusterClient`."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import yaml
from support import ROOT

from neuronfleet.localcluster.semantics import (
    APPLY_PATCH,
    JSON_PATCH,
    STRATEGIC_MERGE_PATCH,
    ApiError,
    Resource,
    admit,
    apply_defaults,
    apply_patch,
    established,
    field_matcher,
    label_matcher,
    merge_patch,
    prune,
    strategic_merge_patch,
)
from neuronfleet.localcluster.store import ClusterClient, Store
from neuronfleet.localcluster.tables import table

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"

PODS = Resource("", "v1", "pods", "Pod", True, ("status", "log"))
SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "replicas": {"type": "integer", "default": 1, "minimum": 0},
                "ports": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"port": {"type": "integer", "default": 80}}},
                },
                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            },
        }
    },
}
WIDGETS = Resource("example.dev", "v1", "widgets", "Widget", True, ("status",), schema=SCHEMA)


@pytest.mark.parametrize(
    ("selector", "labels", "match"),
    [
        ("app=a", {"app": "a"}, True),
        ("app==a,tier!=db", {"app": "a", "tier": "db"}, False),
        ("app in (a, b)", {"app": "b"}, True),
        ("app notin (a,b)", {"app": "b"}, False),
        ("app notin (a,b)", {}, True),
        ("app", {"app": ""}, True),
        ("!app", {"app": "x"}, False),
        ("", {"anything": "x"}, True),
    ],
)
def test_label_selectors_match_like_the_api_server(selector, labels, match):
    assert label_matcher(selector)(labels) is match


def test_a_selector_that_does_not_parse_is_a_400_with_a_status_body():
    with pytest.raises(ApiError) as refused:
        label_matcher("app=(a")
    status = refused.value.status()
    assert refused.value.code == 400 and status["kind"] == "Status" and status["reason"] == "BadRequest"
    assert status["code"] == 400 and "unable to parse requirement" in status["message"]


def test_field_selectors_read_dotted_paths():
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Running"}}
    assert field_matcher("metadata.name=p,status.phase!=Failed")(pod)
    assert not field_matcher("status.phase=Pending")(pod)
    assert field_matcher("spec.nodeName=")(pod)  # an absent field is the empty string


def test_merge_patch_deletes_with_null_and_replaces_lists():
    old = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert merge_patch(old, {"a": {"b": None, "d": 3}, "l": [3]}) == {"a": {"c": 2, "d": 3}, "l": [3]}
    assert old == {"a": {"b": 1, "c": 2}, "l": [1, 2]}  # the target is not changed in place


def test_strategic_merge_merges_named_items_and_deletes_on_directive():
    old = {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}
    patch = {"containers": [{"name": "b", "image": "2"}, {"name": "c"}, {"name": "a", "$patch": "delete"}]}
    assert strategic_merge_patch(old, patch) == {"containers": [{"name": "b", "image": "2"}, {"name": "c"}]}


def test_patch_types_and_their_refusals():
    old = {"metadata": {"name": "w", "resourceVersion": "5"}, "spec": {"replicas": 1}}
    new, rv = apply_patch(
        PODS, old, {"metadata": {"resourceVersion": "4"}, "spec": {"replicas": 2}}, APPLY_PATCH
    )
    assert new["spec"] == {"replicas": 2} and rv == "4"  # an apply patch is a merge that may expect a version
    new, rv = apply_patch(PODS, old, [{"op": "replace", "path": "/spec/replicas", "value": 3}], JSON_PATCH)
    assert new["spec"]["replicas"] == 3 and rv is None
    with pytest.raises(ApiError) as bad:
        apply_patch(PODS, old, [{"op": "remove", "path": "/spec/absent"}], JSON_PATCH)
    assert bad.value.code == 422
    with pytest.raises(ApiError) as custom:
        apply_patch(WIDGETS, old, {}, STRATEGIC_MERGE_PATCH)
    assert custom.value.code == 415
    with pytest.raises(ApiError) as unknown:
        apply_patch(PODS, old, {}, "text/plain")
    assert unknown.value.code == 415


def test_defaults_fill_nested_items_and_pruning_records_unknown_fields():
    obj = apply_defaults({"spec": {"ports": [{}, {"port": 8}]}}, SCHEMA)
    assert obj == {"spec": {"replicas": 1, "ports": [{"port": 80}, {"port": 8}]}}
    unknown: list[str] = []
    pruned = prune({"spec": {"replicas": 1, "typo": 2, "extra": {"kept": 1}}, "junk": 1}, SCHEMA, "", unknown)
    assert pruned == {"spec": {"replicas": 1, "extra": {"kept": 1}}}
    assert sorted(unknown) == [".junk", ".spec.typo"]


def test_admission_prunes_or_refuses_strictly_and_validates():
    obj = {"metadata": {"name": "w"}, "spec": {"typo": 1}}
    assert admit(WIDGETS, dict(obj), {})["spec"] == {"replicas": 1}
    with pytest.raises(ApiError, match=r'unknown field "spec\.typo"'):
        admit(WIDGETS, dict(obj), {"fieldValidation": "Strict"})
    with pytest.raises(ApiError) as invalid:
        admit(WIDGETS, {"metadata": {"name": "w"}, "spec": {"replicas": -1}}, {})
    assert invalid.value.code == 422 and invalid.value.details["causes"][0]["field"] == "spec.replicas"


def test_a_crd_must_be_named_plural_dot_group():
    names = {"plural": "widgets", "kind": "Widget"}
    crd = {"metadata": {"name": "widgets.example.dev"}, "spec": {"group": "example.dev", "names": names}}
    assert {c["type"] for c in established(crd)["status"]["conditions"]} == {"NamesAccepted", "Established"}
    crd["metadata"]["name"] = "widgets"
    with pytest.raises(ApiError, match=r"metadata\.name must be widgets\.example\.dev"):
        established(crd)


def test_tables_have_name_the_kinds_columns_and_age():
    pod = {
        "metadata": {"name": "p", "creationTimestamp": "2020-01-01T00:00:00Z"},
        "spec": {"containers": [{"name": "c"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"ready": True, "restartCount": 2, "state": {"running": {}}}],
        },
    }
    out = table(PODS, [pod], 7)
    shown = [c["name"] for c in out["columnDefinitions"] if c["priority"] == 0]  # the rest: -o wide
    assert shown == ["Name", "Ready", "Status", "Restarts", "Age"]
    assert out["rows"][0]["cells"][:4] == ["p", "1/1", "Running", "2"]  # restarts are text, as kubectl's
    assert re.fullmatch(r"\d+y(\d+d)?", out["rows"][0]["cells"][4])  # past two years: years and days
    assert out["metadata"]["resourceVersion"] == "7"


def test_the_cluster_client_creates_lists_patches_status_and_wakes_waiters():
    async def scenario() -> None:
        client = ClusterClient(Store())
        waiter = asyncio.create_task(client.wait_for_change(600))
        await asyncio.sleep(0)
        pod = {
            "metadata": {"generateName": "p-"},
            "spec": {"containers": [{"name": "c"}]},
            "status": {"x": 1},
        }
        created = await client.create("", "v1", "pods", "default", pod)
        await asyncio.wait_for(waiter, 600)  # woken by the create, not by the timeout
        name = created["metadata"]["name"]
        assert name.startswith("p-") and "status" not in created  # status is written through /status only
        await client.patch_status("", "v1", "pods", "default", name, {"phase": "Running"})
        (listed,) = client.list("", "v1", "pods")
        assert listed["status"] == {"phase": "Running"} and listed["metadata"]["generation"] == 1
        listed["status"]["phase"] = "changed"  # a copy: the store is not changed through it
        assert client.get("", "v1", "pods", "default", name)["status"] == {"phase": "Running"}
        await client.delete("", "v1", "pods", "default", name)
        assert client.get("", "v1", "pods", "default", name) is None and client.list("", "v1", "pods") == []

    asyncio.run(scenario())


async def with_model(store: Store) -> ClusterClient:
    """A client of `store`, which now holds the NeuronModel CRD and the local sample as default/m."""
    from neuronfleet.operator import crd, spec

    client = ClusterClient(store)
    await client.create("apiextensions.k8s.io", "v1", "customresourcedefinitions", None, crd.build_crd())
    model = yaml.safe_load(SAMPLE.read_text())
    model["metadata"] = {"name": "m"}
    await client.create(spec.GROUP, spec.VERSION, spec.PLURAL, "default", model)
    return client


def test_a_restarted_store_has_every_object_but_the_nodes_and_asks_old_watches_to_list_again():
    from neuronfleet.localcluster.store import Expired
    from neuronfleet.operator import spec

    async def scenario() -> None:
        first = Store()
        client = await with_model(first)
        await client.patch_status(spec.GROUP, spec.VERSION, spec.PLURAL, "default", "m", {"phase": "Ready"})
        await client.create(
            "", "v1", "configmaps", "default", {"metadata": {"name": "c"}, "data": {"k": "v"}}
        )
        await client.create(
            "", "v1", "pods", "default", {"metadata": {"name": "p"}, "spec": {"containers": []}}
        )
        saved = json.loads(json.dumps(first.snapshot()))  # as the file holds it
        before = first.last_revision

        second = Store()
        second.restore(saved)
        again = ClusterClient(second)
        restored = again.get(spec.GROUP, spec.VERSION, spec.PLURAL, "default", "m")
        written = ClusterClient(first).get(spec.GROUP, spec.VERSION, spec.PLURAL, "default", "m")
        assert restored["status"] == {"phase": "Ready"} and restored["spec"] == written["spec"]
        assert again.get("", "v1", "configmaps", "default", "c")["data"] == {"k": "v"}
        assert again.get("", "v1", "pods", "default", "p") is None  # the node's: its kubelet makes them again
        assert int(restored["metadata"]["resourceVersion"]) > before  # versions go on, never back
        kind = second.kind(spec.GROUP, spec.VERSION, spec.PLURAL)
        with pytest.raises(Expired):  # a watch from before the restart lists again
            await anext(second.watch(kind, "default", None, {"resourceVersion": str(before - 1)}, 5))
        # a write goes on from there
        await again.patch(spec.GROUP, spec.VERSION, spec.PLURAL, "default", "m", {"spec": {"replicas": 2}})
        assert again.get(spec.GROUP, spec.VERSION, spec.PLURAL, "default", "m")["spec"]["replicas"] == 2

    asyncio.run(scenario())


def test_a_scale_past_the_schemas_maximum_is_refused_as_the_schema_says():
    from neuronfleet.operator import spec

    async def scenario() -> None:
        store = Store()
        client = await with_model(store)
        kind = store.kind(spec.GROUP, spec.VERSION, spec.PLURAL)
        scale = {"spec": {"replicas": 100000}}
        with pytest.raises(ApiError) as refused:
            await store.patch(kind, "default", "m", scale, "application/merge-patch+json", "scale", {})
        assert refused.value.code == 422 and "spec.replicas" in str(refused.value), str(refused.value)
        assert "1000" in str(refused.value)
        await store.patch(kind, "default", "m", {"spec": {"replicas": 7}}, "application/merge-patch+json",
                          "scale", {})  # fmt: skip
        assert client.get(spec.GROUP, spec.VERSION, spec.PLURAL, "default", "m")["spec"]["replicas"] == 7

    asyncio.run(scenario())
