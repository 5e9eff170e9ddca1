"""What the nodes offer a model's pods (operator/node_offers.py), as tables: a Node, a ResourceSlice and a
DeviceClass as kept; what the rendered pods of the samples ask (device plugin and DRA); the Schedulable
condition for each way a pod would wait (no node of its type or label, no Neuron or EFA device plugin, a
missing DRA driver or DeviceClass, too few cores or interfaces), the scheduler extension advised, and nothing
said where the nodes are not read; the plan's condition and its Events; what the watch queues (only changes
of what a node offers, never its heartbeats); and the names and commands the messages give, held to the
record of their sources (tests/data/node-offers-names.json)."""

from __future__ import annotations

import asyncio
import datetime
import json
import re

import pytest
import yaml
from support import ROOT, wait_until_async

from neuronfleet.operator import builders, node_offers, node_watch, planner
from neuronfleet.operator.node_offers import (
    DEVICE_PLUGIN_MISSING,
    DEVICES_OFFERED,
    DRA_DRIVER_MISSING,
    EFA,
    EFA_DEVICE_PLUGIN_MISSING,
    INSTANCE_TYPE,
    NEURONCORE,
    NO_LABELLED_NODES,
    NO_NODES,
    NODES_TOO_SMALL,
    SCHEDULER_EXTENSION_ADVISED,
    DeviceClassOffer,
    NodeOffer,
    Offers,
    PodNeeds,
    SliceOffer,
)
from neuronfleet.operator.status import transitions

SAMPLES = ROOT / "crds" / "samples"
DI = SAMPLES / "llama-3.3-70b-vllm-trn2-disaggregated.yaml"  # prefill 16 and decode 32 cores, 4 EFA each
DRA = SAMPLES / "llama-3.3-70b-vllm-trn2-dra.yaml"  # one claim of 16 neuron.aws.com devices
CPU = SAMPLES / "smollm2-135m-local-cpu.yaml"
TRN2 = "trn2.48xlarge"
LNC_LABEL = "neuronfleet.dev/lnc"
AT = "2026-12-06T12:00:00Z"
RECORD = json.loads((ROOT / "tests" / "data" / "node-offers-names.json").read_text())


def body(path, **spec) -> dict:
    obj = yaml.safe_load(path.read_text())
    obj["metadata"].update(uid="uid-1", generation=1)
    for section, fields in spec.items():
        obj["spec"].setdefault(section, {}).update(fields)
    return obj


def rendered(path, **spec) -> list[dict]:
    """The model's objects as the operator renders them once compiled (Deployments, claim templates)."""
    parsed = planner.parse(body(path, **spec))
    assert parsed.valid, parsed.errors
    return builders.build_all(parsed.owner, parsed.spec, parsed.chash)


def needs(path, **spec) -> list[PodNeeds]:
    return node_offers.pod_needs(rendered(path, **spec))


def node(name="n1", instance_type=TRN2, labels=(), **allocatable) -> NodeOffer:
    resources = {"neuroncore": NEURONCORE, "efa": EFA, "neuron": node_offers.NEURON_DEVICE}
    kept = tuple(sorted({(INSTANCE_TYPE, instance_type), *labels}))
    return NodeOffer(name, kept, tuple((resources[k], v) for k, v in allocatable.items()))


def offers(*nodes: NodeOffer, slices=None, classes=None) -> Offers:
    by_type: dict[str, list[NodeOffer]] = {}
    for n in nodes:
        by_type.setdefault(n.label(INSTANCE_TYPE) or "", []).append(n)
    kept = frozenset({INSTANCE_TYPE, LNC_LABEL})
    return Offers(by_type, kept, slices, classes)


NEURON_CLASS = {"neuron.aws.com": [DeviceClassOffer(("neuron.aws.com",))]}
BOTH_CLASSES = {**NEURON_CLASS, "efa.networking.k8s.aws": [DeviceClassOffer(("dra.net",))]}


# ---- what is kept ----------------------------------------------------------------------------------------


def test_a_node_keeps_its_instance_type_the_selected_labels_and_the_device_plugins_resources_only():
    obj = {
        "metadata": {"name": "ip-10-0-0-1", "labels": {INSTANCE_TYPE: TRN2, LNC_LABEL: "1", "zone": "a"},
                     "annotations": {"big": "x" * 1000}},
        "status": {"allocatable": {"cpu": "191", "memory": "2000Gi", NEURONCORE: "64", EFA: "16",
                                   "aws.amazon.com/neuron": "0", "hugepages-2Mi": "0"},
                   "images": [{"names": ["x"], "sizeBytes": 1}] * 50},
    }  # fmt: skip
    instance_type, offer = node_offers.node_offer(obj, [INSTANCE_TYPE, LNC_LABEL])
    assert instance_type == TRN2
    assert offer == NodeOffer(
        "ip-10-0-0-1", ((INSTANCE_TYPE, TRN2), (LNC_LABEL, "1")), ((NEURONCORE, 64), (EFA, 16))
    )
    # no instance-type label: kept under ""; a count that does not parse is taken as offered
    key, offer = node_offers.node_offer({"metadata": {"name": "x"}, "status": {"allocatable": {EFA: "1k"}}})
    assert key == "" and offer.offers(EFA) == node_offers.MANY


def test_a_resource_slice_and_a_device_class_keep_their_driver_node_and_count():
    neuron = {"spec": {"driver": "neuron.aws.com", "nodeName": "n1", "pool": {"name": "n1"},
                       "devices": [{"name": f"neurondevice{i}"} for i in range(16)]}}  # fmt: skip
    assert node_offers.slice_offer(neuron) == ("n1", SliceOffer("neuron.aws.com", 16))
    shared = {"spec": {"driver": "x.example.com", "allNodes": True, "devices": [{"name": "d"}]}}
    assert node_offers.slice_offer(shared) == (node_offers.ALL_NODES, SliceOffer("x.example.com", 1))
    # the Neuron chart's DeviceClass (neuron-helm-charts dra-driver-deviceclass.yaml), and one serving an
    # extended resource through DRA (Kubernetes 1.34 spec.extendedResourceName)
    cls = {"metadata": {"name": "neuron.aws.com"},
           "spec": {"selectors": [{"cel": {"expression": 'device.driver == "neuron.aws.com"'}}]}}  # fmt: skip
    assert node_offers.device_class_offer(cls) == ("neuron.aws.com", DeviceClassOffer(("neuron.aws.com",)))
    cls = {
        "metadata": {"name": "c"},
        "spec": {
            "extendedResourceName": NEURONCORE,
            "selectors": [
                {"cel": {"expression": "device.driver == 'neuron.aws.com' && device.attributes['x'].y == 1"}}
            ],
        },
    }
    assert node_offers.device_class_offer(cls) == ("c", DeviceClassOffer(("neuron.aws.com",), NEURONCORE))


# ---- what the pods ask -----------------------------------------------------------------------------------


def test_the_rendered_pods_say_what_they_ask_with_the_device_plugin_and_with_dra():
    di = needs(DI)
    assert [(n.who, dict(n.resources), n.claims) for n in di] == [
        ("the prefill pods", {NEURONCORE: 16, EFA: 4}, ()),
        ("the decode pods", {NEURONCORE: 32, EFA: 4}, ()),
    ]  # (the router asks no device; vLLM on Trn2 compiles on a CPU node)
    assert all(dict(n.selector)[INSTANCE_TYPE] == TRN2 and n.scheduler == "" for n in di)
    (dra,) = needs(DRA)
    assert dra.resources == () and dra.claims == (node_offers.ClaimNeed("neuron.aws.com", 16),)
    (scheduled, *_) = needs(DI, scheduling={"schedulerName": "my-scheduler"})
    assert scheduled.scheduler == "my-scheduler"
    assert needs(CPU) == []


def test_a_pod_asks_its_containers_sum_or_an_init_containers_most_and_each_claim_request():
    pod = {"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {"spec": {
        "nodeSelector": {INSTANCE_TYPE: TRN2},
        "containers": [{"resources": {"limits": {NEURONCORE: "2"}}},
                       {"resources": {"limits": {NEURONCORE: "3"}}}],
        "initContainers": [{"resources": {"limits": {NEURONCORE: "8", EFA: "1"}}}],
        "resourceClaims": [{"name": "a", "resourceClaimTemplateName": "t"},
                           {"name": "b", "resourceClaimName": "c"}],
    }}}}  # fmt: skip
    template = {"kind": "ResourceClaimTemplate", "metadata": {"name": "t"}, "spec": {"spec": {"devices": {
        "requests": [{"name": "n", "exactly": {"deviceClassName": "neuron.aws.com", "allocationMode": "All"}},
                     {"name": "e", "deviceClassName": "efa.networking.k8s.aws", "count": 2},  # (v1beta1)
                     {"name": "f", "firstAvailable": [{"deviceClassName": "x"}]}]}}}}  # fmt: skip
    (asked,) = node_offers.pod_needs([pod, template])
    assert asked.who == "the pods of Job j" and dict(asked.resources) == {NEURONCORE: 8, EFA: 1}
    assert asked.claims == (
        node_offers.ClaimNeed("neuron.aws.com", None),
        node_offers.ClaimNeed("efa.networking.k8s.aws", 2),
    )


# ---- the condition ---------------------------------------------------------------------------------------


def verdict(asked: list[PodNeeds], offer: Offers | None) -> node_offers.Verdict | None:
    return node_offers.schedulable(asked, offer)


def test_nothing_is_said_where_the_nodes_are_not_read_or_no_pod_asks_for_a_device():
    assert verdict(needs(DI), None) is None
    assert verdict(needs(CPU), offers(node(neuroncore=64))) is None


@pytest.mark.parametrize(
    "case, path, spec, nodes, slices, classes, status, reason, said",
    [
        ("no node of its instance type (an autoscaler may add one): unknown", DI, {},
         [node(instance_type="trn1.32xlarge", neuroncore=32)], None, None, None, NO_NODES,
         ["no node of instance type trn2.48xlarge is in the cluster now", "node autoscaler"]),
        ("no Neuron device plugin on the nodes", DI, {}, [node(efa=16)], None, None, False,
         DEVICE_PLUGIN_MISSING,
         ["the prefill pods (16 aws.amazon.com/neuroncore each) and the decode pods (32 aws.amazon.com/"
          "neuroncore each): no node of instance type trn2.48xlarge offers aws.amazon.com/neuroncore",
          "helm upgrade --install neuron-helm-chart oci://public.ecr.aws/neuron/neuron-helm-chart",
          "neuronInstances"]),
        ("the nodes run the Neuron DRA driver, the pods ask the device plugin", DI, {}, [node(efa=16)],
         {"n1": [SliceOffer("neuron.aws.com", 16)]}, NEURON_CLASS, False, DEVICE_PLUGIN_MISSING,
         ["they run the Neuron DRA driver", "neuron.deviceAllocation: dra"]),
        ("no EFA device plugin (neither the Neuron chart nor the EKS AMIs install it)", DI, {},
         [node(neuroncore=64), node("n2", neuroncore=64)], None, None, False, EFA_DEVICE_PLUGIN_MISSING,
         ["(4 vpc.amazonaws.com/efa each)",
          "no node of instance type trn2.48xlarge offers vpc.amazonaws.com/efa",
          "helm install efa eks/aws-efa-k8s-device-plugin -n kube-system",
          "neither the Neuron helm chart nor the EKS AL2023 and Bottlerocket AMIs install it"]),
        ("a trn2.48xlarge whose first card is ENA offers 15 EFA, the pods ask 16", DI,
         {"serving": {"kvTransfer": {"transport": "efa", "efaInterfaces": 16}}},
         [node(neuroncore=64, efa=15)], None, None, False, NODES_TOO_SMALL,
         ["nodes of instance type trn2.48xlarge offer at most 15 vpc.amazonaws.com/efa"]),
        ("every device there: the extension is advised for pods sharing a node", DI, {},
         [node(neuroncore=64, efa=16)], None, None, True, SCHEDULER_EXTENSION_ADVISED,
         ["nodes of instance type trn2.48xlarge offer 64 aws.amazon.com/neuroncore", "scheduler.enabled=true",
          "neuron.schedulerName to my-scheduler",
          "is required for scheduling Pods that request more than one"]),
        ("every device there and the pods name the extension's scheduler", DI,
         {"scheduling": {"schedulerName": "my-scheduler"}}, [node(neuroncore=64, efa=16)], None, None, True,
         DEVICES_OFFERED,
         ["up to 64 aws.amazon.com/neuroncore, 16 vpc.amazonaws.com/efa per node of trn2.48xlarge"]),
        ("DRA: no DeviceClass neuron.aws.com", DRA, {}, [node()], {}, {}, False, DRA_DRIVER_MISSING,
         ["DeviceClass neuron.aws.com does not exist", "--set draDriver.enabled=true",
          "never on a node that runs the Neuron device plugin"]),
        ("DRA: the class is there, the nodes publish no device of its driver (they run the device plugin)",
         DRA, {}, [node(neuroncore=64)], {}, NEURON_CLASS, False, DRA_DRIVER_MISSING,
         ["no node of instance type trn2.48xlarge publishes devices of DRA driver neuron.aws.com",
          "they run a device plugin", "neuron.deviceAllocation: devicePlugin"]),
        ("DRA: the nodes publish fewer devices than the claim asks", DRA, {}, [node()],
         {"n1": [SliceOffer("neuron.aws.com", 8)]}, NEURON_CLASS, False, NODES_TOO_SMALL,
         ["(16 neuron.aws.com devices each)", "publish at most 8 neuron.aws.com devices"]),
        ("DRA: the driver runs on the nodes", DRA, {}, [node()], {"n1": [SliceOffer("neuron.aws.com", 16)]},
         NEURON_CLASS, True, DEVICES_OFFERED, []),
        ("DRA with EFA: no EFA DRA driver (DRANET)", DI, {"neuron": {"deviceAllocation": "dra"}}, [node()],
         {"n1": [SliceOffer("neuron.aws.com", 16)]}, NEURON_CLASS, False, DRA_DRIVER_MISSING,
         ["DeviceClass efa.networking.k8s.aws does not exist", "helm install aws-dranet eks/aws-dranet"]),
        ("DRA with EFA: both drivers there", DI, {"neuron": {"deviceAllocation": "dra"}}, [node()],
         {"n1": [SliceOffer("neuron.aws.com", 16), SliceOffer("dra.net", 16)]}, BOTH_CLASSES, True,
         DEVICES_OFFERED, []),
        ("DRA is not read (no resource.k8s.io/v1 served): the claims are not judged", DRA, {}, [node()], None,
         None, True, DEVICES_OFFERED, []),
    ],
)  # fmt: skip
def test_the_condition_says_what_the_nodes_lack(
    case, path, spec, nodes, slices, classes, status, reason, said
):
    got = verdict(needs(path, **spec), offers(*nodes, slices=slices, classes=classes))
    assert (got.status, got.reason) == (status, reason), (case, got)
    for words in said:
        assert words in got.message, (case, words, got.message)
    assert len(got.message) <= node_offers.MESSAGE_LIMIT


def test_more_cores_than_a_node_has_names_lnc_and_a_label_no_node_carries_is_unknown():
    asked = [PodNeeds("the unified pods", ((INSTANCE_TYPE, TRN2),), ((NEURONCORE, 128),))]
    got = verdict(asked, offers(node(neuroncore=64)))
    assert (got.status, got.reason) == (False, NODES_TOO_SMALL) and "LNC" in got.message
    asked = [PodNeeds("the unified pods", ((INSTANCE_TYPE, TRN2), (LNC_LABEL, "1")), ((NEURONCORE, 128),))]
    got = verdict(asked, offers(node(neuroncore=64, labels=[(LNC_LABEL, "2")])))
    assert (got.status, got.reason) == (None, NO_LABELLED_NODES) and "neuronfleet.dev/lnc=1" in got.message
    got = verdict(asked, offers(node(neuroncore=64), node("n2", neuroncore=128, labels=[(LNC_LABEL, "1")])))
    assert got.status is True  # (one node runs LNC=1; a pod taking all its cores needs no extension)
    # a selector on a label the watch does not keep is not judged (never a false alarm)
    asked = [PodNeeds("p", ((INSTANCE_TYPE, TRN2), ("team", "a")), ((NEURONCORE, 1),))]
    assert verdict(asked, offers(node(neuroncore=64))).status is True


def test_a_node_that_just_joined_may_still_be_registering_its_devices():
    asked = needs(DI)
    young = NodeOffer("n1", ((INSTANCE_TYPE, TRN2),), ((EFA, 16),), created="2026-12-06T11:59:00Z")
    got = verdict_at(asked, offers(young), AT)
    assert (got.status, got.reason) == (None, node_offers.NODES_STARTING)
    assert "joined less than 5 minutes ago and offers no aws.amazon.com/neuroncore yet" in got.message
    old = NodeOffer("n1", ((INSTANCE_TYPE, TRN2),), ((EFA, 16),), created="2026-12-06T11:50:00Z")
    assert verdict_at(asked, offers(old), AT).reason == DEVICE_PLUGIN_MISSING
    assert (
        verdict_at(asked, offers(old, young), AT).reason == node_offers.NODES_STARTING
    )  # (it may offer them)
    ready = NodeOffer(
        "n2", ((INSTANCE_TYPE, TRN2),), ((NEURONCORE, 64), (EFA, 16)), created="2026-12-06T11:50:00Z"
    )
    assert verdict_at(asked, offers(young, ready), AT).status is True  # (another node offers them)
    (dra,) = needs(DRA)
    got = verdict_at([dra], offers(young, slices={}, classes=NEURON_CLASS), AT)
    assert got.reason == node_offers.NODES_STARTING and "neuron.aws.com device yet" in got.message


def verdict_at(asked: list[PodNeeds], offer: Offers, at: str) -> node_offers.Verdict | None:
    return node_offers.schedulable(asked, offer, at)


def test_a_device_class_that_serves_an_extended_resource_offers_it_through_dra():
    asked = [PodNeeds("p", ((INSTANCE_TYPE, TRN2),), ((NEURONCORE, 64),), scheduler="s")]
    classes = {"c": [DeviceClassOffer(("neuron.aws.com",), NEURONCORE)]}
    got = verdict(asked, offers(node(), slices={"n1": [SliceOffer("neuron.aws.com", 64)]}, classes=classes))
    assert (got.status, got.reason) == (True, DEVICES_OFFERED)


def test_the_worst_finding_decides_and_every_finding_is_said():
    asked = [
        PodNeeds("the prefill pods", ((INSTANCE_TYPE, TRN2),), ((NEURONCORE, 16), (EFA, 4))),
        PodNeeds("the compile pod", ((INSTANCE_TYPE, "inf2.48xlarge"),), ((NEURONCORE, 24),)),
    ]
    got = verdict(asked, offers(node(neuroncore=64)))
    assert (got.status, got.reason) == (False, EFA_DEVICE_PLUGIN_MISSING)
    assert got.message.index("vpc.amazonaws.com/efa") < got.message.index("inf2.48xlarge")
    assert "scheduler extension" in got.message


# ---- the plan: the condition before the compile ends, and its Events ------------------------------------


def test_the_plan_says_it_before_the_serving_pods_exist_and_says_nothing_without_nodes():
    model = body(DI)
    parsed = planner.parse(model)
    plan = planner.plan(
        model, parsed, planner.Observed(nodes=offers(node(neuroncore=64))), AT, planner.Settings()
    )
    (cond,) = [c for c in plan.status["conditions"] if c["type"] == node_offers.CONDITION]
    assert (cond["status"], cond["reason"]) == ("False", EFA_DEVICE_PLUGIN_MISSING)  # (still compiling)
    assert ("Warning", EFA_DEVICE_PLUGIN_MISSING, cond["message"]) in transitions({}, plan.status)
    plan_off = planner.plan(model, parsed, planner.Observed(), AT, planner.Settings())
    assert node_offers.CONDITION not in {c["type"] for c in plan_off.status["conditions"]}
    # the nodes get the EFA device plugin: Unknown is never a Warning, a recovery is said once
    model["status"] = plan.status
    fixed = offers(node(neuroncore=64, efa=16))
    later = planner.plan(
        model, parsed, planner.Observed(nodes=fixed), "2026-12-06T12:01:00Z", planner.Settings()
    )
    (cond,) = [c for c in later.status["conditions"] if c["type"] == node_offers.CONDITION]
    assert (cond["status"], cond["reason"]) == ("True", SCHEDULER_EXTENSION_ADVISED)
    assert cond["lastTransitionTime"] == "2026-12-06T12:01:00Z"
    assert [e[1] for e in transitions(plan.status, later.status) if e[1] == SCHEDULER_EXTENSION_ADVISED]
    again = planner.plan(
        {**model, "status": later.status}, parsed, planner.Observed(nodes=fixed), AT, planner.Settings()
    )
    assert not [e for e in transitions(later.status, again.status) if e[1] == SCHEDULER_EXTENSION_ADVISED]
    none = planner.plan(model, parsed, planner.Observed(nodes=offers()), AT, planner.Settings())
    (cond,) = [c for c in none.status["conditions"] if c["type"] == node_offers.CONDITION]
    assert cond["status"] == "Unknown" and not [
        e for e in transitions(plan.status, none.status) if e[0] == "Warning" and e[1] == NO_NODES
    ]


# ---- the watch: what it queues ----------------------------------------------------------------------------


def test_the_watch_queues_the_models_of_a_type_only_when_what_a_node_offers_changes(monkeypatch):
    monkeypatch.setattr(node_watch, "QUIET", 0.01)
    watch = node_watch.NodeWatch(["Node", "ResourceSlice", "DeviceClass"], [LNC_LABEL])
    queued: list = []
    watch.on_change = queued.append

    def a_node(name: str, instance_type: str, cores: str, heartbeat: str) -> dict:
        return {"metadata": {"name": name, "labels": {INSTANCE_TYPE: instance_type}},
                "status": {"allocatable": {NEURONCORE: cores},
                           "conditions": [{"type": "Ready", "lastHeartbeatTime": heartbeat}]}}  # fmt: skip

    async def deliver(kind: str, event: str | None, obj: dict) -> None:
        if event != "DELETED":
            await watch._index(body=obj, param=kind)
        await watch._event(
            type=event, body=obj, param=kind, **{f"nf_offer_{k.lower()}": {} for k in watch.kinds}
        )

    async def scenario() -> None:
        await deliver("Node", None, a_node("n1", TRN2, "0", "t0"))  # the first list: nothing queued
        await deliver("Node", "MODIFIED", a_node("n1", TRN2, "0", "t1"))  # a heartbeat: nothing
        await asyncio.sleep(0.05)
        assert queued == []
        await deliver("Node", "MODIFIED", a_node("n1", TRN2, "64", "t2"))  # the device plugin registered
        await deliver("Node", "ADDED", a_node("n2", "inf2.48xlarge", "24", "t2"))
        await asyncio.sleep(0.05)
        assert queued == [{TRN2, "inf2.48xlarge"}]  # (one pass for both)
        slice_ = {"metadata": {"name": "s"}, "spec": {"driver": "dra.net", "nodeName": "n1", "devices": [{}]}}
        await deliver("ResourceSlice", "ADDED", slice_)
        await asyncio.sleep(0.05)
        assert queued[-1] == {TRN2}
        await deliver("DeviceClass", "ADDED", {"metadata": {"name": "efa.networking.k8s.aws"}, "spec": {}})
        await asyncio.sleep(0.05)
        assert queued[-1] is None  # (every model looks again)
        await deliver("Node", "DELETED", a_node("n2", "inf2.48xlarge", "24", "t3"))
        await asyncio.sleep(0.05)
        assert queued[-1] == {"inf2.48xlarge"}
        watch.stop()

    asyncio.run(scenario())


def test_the_watch_looks_again_at_a_new_nodes_type_once_it_has_settled(monkeypatch):
    monkeypatch.setattr(node_offers, "SETTLE_SECONDS", 2.5)  # (ages count whole seconds)
    monkeypatch.setattr(node_watch, "QUIET", 0.01)
    watch = node_watch.NodeWatch(["Node"])
    queued: list = []
    watch.on_change = queued.append
    now = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    new = {
        "metadata": {"name": "n1", "creationTimestamp": now, "labels": {INSTANCE_TYPE: TRN2}},
        "status": {},
    }

    async def scenario() -> None:
        await watch._index(body=new, param="Node")
        await watch._event(type=None, body=new, param="Node", nf_offer_node={})  # (kopf's first list)
        assert queued == []
        await wait_until_async(lambda: queued, "the settled node's type to be queued", ceiling=10)
        assert queued == [{TRN2}]  # though nothing changed on it
        watch.stop()

    asyncio.run(scenario())


# ---- the names the messages give, held to their sources --------------------------------------------------


def test_every_name_and_command_the_messages_give_is_in_the_record_of_its_sources():
    texts = [node_offers.NEURON_DEVICE_PLUGIN_HOW, node_offers.EFA_DEVICE_PLUGIN_HOW,
             node_offers.SCHEDULER_EXTENSION_HOW, *node_offers.DRA_HOW.values()]  # fmt: skip
    said = " ".join(texts)
    for name in RECORD["names"]:
        assert RECORD["names"][name], name
    matched = (NEURONCORE, EFA, node_offers.NEURON_DEVICE, node_offers.NEURON_DRIVER, node_offers.EFA_DRIVER,
               node_offers.NEURON_DEVICE_CLASS, node_offers.EFA_DEVICE_CLASS)  # fmt: skip
    for name in matched:
        assert name in RECORD["names"], name
    for command in re.findall(r"`([^`]+)`", said):
        for part in re.split(r" && ", command):
            assert part in RECORD["names"], part
    for option in re.findall(r"--set [\w.]+=\w+", said):
        assert option.removeprefix("--set ") in RECORD["names"], option
    for quoted in re.findall(r'it "([^"]+)"', said):  # the sources' own words
        assert quoted in RECORD["names"], quoted
