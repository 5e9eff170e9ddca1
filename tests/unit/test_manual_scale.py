"""Manual changes of an autoscaled model's replicas (operator/manual_scale.py, provider builtin): a change of
spec.replicas by someone else adopted or refused as autoscaling.onManualChange says, and a Deployment's
replicas set by someone else told apart from the operator's own write, whatever the value."""

from __future__ import annotations

import copy

import pytest
import yaml
from support import ROOT

from neuronfleet.operator import builders, manual_scale, validation

OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())


UNIFIED = load("smollm2-135m-local-cpu.yaml")
DISAGGREGATED = load("smollm2-135m-local-cpu-disaggregated.yaml")


def parsed(base: dict, replicas: int | None = None, **autoscaling):
    obj = copy.deepcopy(base)
    obj["metadata"]["name"] = "m"
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    obj["spec"]["autoscaling"] = autoscaling
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


BUILTIN = {"enabled": True, "min": 1, "max": 4}

# (spec.replicas, autoscaling beyond BUILTIN, status.autoscaling.specReplicas, what is decided:
#  None, ("adopt", desired) or ("refuse", back to))
UNIFIED_CASES = [
    (3, {}, None, None),  # nothing seen yet: the first pass records it
    (3, {}, 3, None),  # unchanged
    (None, {}, 0, None),  # unset reads 0, as the scale subresource reads it
    (3, {}, 1, ("adopt", {"unified": 3})),  # onManualChange defaults to adopt
    (9, {}, 1, ("adopt", {"unified": 4})),  # within max
    (0, {}, 2, ("adopt", {"unified": 1})),  # within min
    (3, {"onManualChange": "adopt"}, None, None),
    (3, {"onManualChange": "refuse"}, 1, ("refuse", 1)),
    (3, {"onManualChange": "refuse"}, 0, ("refuse", None)),  # it was unset: unset again
    (3, {"onManualChange": "refuse", "dryRun": True}, 1, None),  # dry run: the spec's replicas run
    (3, {"enabled": False}, 1, None),  # not autoscaled: spec.replicas are the replicas
    (3, {"provider": "hpa"}, 1, None),  # the HPA writes spec.replicas itself
]


@pytest.mark.parametrize("replicas,extra,seen,decided", UNIFIED_CASES)
def test_a_change_of_spec_replicas_is_adopted_or_refused_as_the_spec_says(replicas, extra, seen, decided):
    spec = parsed(UNIFIED, replicas, **{**BUILTIN, **extra})
    status = {"autoscaling": {"desired": {"unified": 2}} | ({} if seen is None else {"specReplicas": seen})}
    change = manual_scale.spec_change(spec, "m", status)
    if decided is None:
        assert change is None
    elif decided[0] == "adopt":
        assert isinstance(change, manual_scale.Adopt) and change.desired == decided[1], change
        assert change.replicas == replicas and "adopted" in change.message
    else:
        assert isinstance(change, manual_scale.Refuse) and change.replicas == decided[1], change


def test_before_any_decision_the_replicas_running_are_the_spec_s_as_last_seen_not_the_manual_change_s():
    spec = parsed(UNIFIED, 3, **BUILTIN, onManualChange="refuse")  # serving.unified.replicas 1
    assert manual_scale.current(spec, {"autoscaling": {"specReplicas": 0}}) == {"unified": 1}
    refused = manual_scale.spec_change(spec, "m", {"autoscaling": {"specReplicas": 2}})
    assert refused.current == {"unified": 2} and refused.replicas == 2
    adopted = manual_scale.spec_change(
        parsed(UNIFIED, 3, **BUILTIN), "m", {"autoscaling": {"specReplicas": 0}}
    )
    assert (adopted.before, adopted.desired) == ({"unified": 1}, {"unified": 3})


def test_a_refusal_says_how_to_change_the_bounds_instead():
    spec = parsed(UNIFIED, 3, **BUILTIN, onManualChange="refuse")
    change = manual_scale.spec_change(
        spec, "m", {"autoscaling": {"specReplicas": 1, "desired": {"unified": 2}}}
    )
    assert change.message == (
        "spec.replicas was set to 3 by someone other than the operator; autoscaling.onManualChange is "
        "refuse, so it is put back to 1: the builtin autoscaler sets the replicas (unified 2 now) within "
        "autoscaling.min 1 and max 4. To change how many run, change those bounds (kubectl patch neuronmodel "
        'm --type merge -p \'{"spec":{"autoscaling":{"min":3}}}\'), or set autoscaling.onManualChange '
        "adopt"
    )


def test_an_adoption_says_what_the_autoscaler_now_wants_within_the_bounds():
    spec = parsed(UNIFIED, 9, **BUILTIN)
    change = manual_scale.spec_change(
        spec, "m", {"autoscaling": {"specReplicas": 2, "desired": {"unified": 2}}}
    )
    assert change.message == (
        "spec.replicas 2 -> 9, set by someone other than the operator, adopted: the autoscaler now wants "
        "unified 4 (within autoscaling.min 1 and max 4) (was unified 2) and scales on from there"
    )


# disaggregated: spec.replicas are decode pods; prefill follows serving.prefill : serving.decode (1:1 in
# the sample) within prefillDecodeRatio and prefill's bounds
@pytest.mark.parametrize(
    "replicas,extra,desired",
    [
        (3, {}, {"decode": 3, "prefill": 3}),
        (4, {"prefillDecodeRatio": {"min": 0.25, "max": 0.5}}, {"decode": 4, "prefill": 2}),
        (3, {"prefillDecodeRatio": {"min": 0.25, "max": 0.5}}, {"decode": 3, "prefill": 2}),  # rounded up
        (4, {"prefill": {"min": 1, "max": 2}}, {"decode": 4, "prefill": 2}),
        (7, {"max": 5}, {"decode": 5, "prefill": 5}),
    ],
)
def test_a_disaggregated_model_adopts_decode_pods_with_prefill_following_the_ratio(replicas, extra, desired):
    spec = parsed(DISAGGREGATED, replicas, **{**BUILTIN, **extra})
    change = manual_scale.spec_change(spec, "m", {"autoscaling": {"specReplicas": 1}})
    assert change.before == {"decode": 1, "prefill": 1}  # no decision yet: the spec's as last seen
    assert isinstance(change, manual_scale.Adopt) and change.desired == desired, change


def deployment(replicas: int | None, written: str | None = None, uid: str = OWNER.uid) -> dict:
    meta = {
        "name": "m-unified",
        "namespace": "ns",
        "labels": {"neuronfleet.dev/model": "m", "neuronfleet.dev/role": "unified"},
        "ownerReferences": [{"kind": "NeuronModel", "name": "m", "uid": uid, "controller": True}],
    }
    if written is not None:
        meta["annotations"] = {manual_scale.REPLICAS_ANNOTATION: written}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {"replicas": replicas}}


# (the Deployment as the cluster holds it: replicas, the annotation; the replicas the operator wants now;
#  reported?) The operator last wrote 2 in each case with the annotation
DEPLOYMENT_CASES = [
    (deployment(2, "2"), 2, False),  # as written and wanted
    (deployment(2, "2"), 3, False),  # a decision 2 -> 3 not yet applied: the operator's own 2
    (deployment(3, "2"), 2, True),  # kubectl scale deployment --replicas 3
    # an edit back to the replicas before the last decision (lastScale.from 2, to 3): missed before, when
    # that value was taken for the operator's own
    (deployment(2, "3"), 3, True),
    (deployment(5, "3"), 5, False),  # set by someone to exactly what is wanted: nothing to put back
    (deployment(3, None), 2, False),  # written before the annotation existed: taken as the operator's
    (deployment(3, "2", uid="another"), 2, False),  # not ours: the Conflict condition's business
    (None, 2, False),  # not made yet
]


@pytest.mark.parametrize("existing,want,reported", DEPLOYMENT_CASES)
def test_a_deployment_s_replicas_set_by_someone_else_are_reported_whatever_the_value(
    existing, want, reported
):
    wanted = manual_scale.marked(deployment(want))
    message = manual_scale.deployment_change(existing, wanted)
    assert (message is not None) == reported, message
    if reported:
        have = existing["spec"]["replicas"]
        assert message.startswith(f"Deployment m-unified had replicas {have}, set by someone other than")
        assert message.endswith(f"put back to {want}")


def test_the_operator_records_the_replicas_it_writes_on_the_deployment():
    built = deployment(3)
    marked = manual_scale.marked(built)
    assert marked["metadata"]["annotations"] == {manual_scale.REPLICAS_ANNOTATION: "3"}
    assert "annotations" not in built["metadata"]  # the built object itself is left as it was


def role_deployment(role: str, replicas: int) -> dict:
    labels = {"neuronfleet.dev/model": "m", "neuronfleet.dev/role": role}
    return {
        "kind": "Deployment",
        "metadata": {"name": f"m-{role}", "labels": labels},
        "spec": {"replicas": replicas},
    }


def roles_in_order(objects: list[dict]) -> list[str]:
    return [o["metadata"]["labels"]["neuronfleet.dev/role"] for o in objects if o["kind"] == "Deployment"]


# (replicas now, replicas wanted, ratio bounds, the order the Deployments take them in)
ORDER_CASES = [
    ({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}, (0.5, 1.0), ["decode", "prefill", "router"]),
    ({"prefill": 2, "decode": 2}, {"prefill": 1, "decode": 1}, (0.5, 1.0), ["prefill", "decode", "router"]),
    ({"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 4}, (0.5, 1.0), ["prefill", "decode", "router"]),
    ({"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}, None, ["prefill", "decode", "router"]),
    ({"prefill": 1}, {"prefill": 2, "decode": 2}, (0.5, 1.0), ["prefill", "decode", "router"]),  # new set
]


@pytest.mark.parametrize("before,wanted,ratio,order", ORDER_CASES)
def test_the_deployments_take_their_replicas_in_an_order_that_keeps_the_ratio_between_writes(
    before, wanted, ratio, order
):
    objects = [role_deployment(r, wanted[r]) for r in ("prefill", "decode")] + [role_deployment("router", 1)]
    ordered = manual_scale.ratio_ordered(objects, before, ratio)
    assert roles_in_order(ordered) == order
    assert sorted(map(id, ordered)) == sorted(map(id, objects))  # the same objects, none lost
    if ratio is not None and set(before) == {"prefill", "decode"}:  # every point on the way is within
        first, second = roles_in_order(ordered)[:2]
        middle = {first: wanted[first], second: before[second]}
        assert ratio[0] <= middle["prefill"] / middle["decode"] <= ratio[1], middle
