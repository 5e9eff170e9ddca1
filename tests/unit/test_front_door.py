"""The front door of a unified model (operator/front_door.py, builders): a router every unified model has
(but one whose gateway pool is its pods) that never scales to zero, holds requests while no pod is ready and
(provider builtin) wakes the operator when the model may scale to zero, routing kv-aware at every replica
count; scaling changes no pod template; strictly valid Kubernetes, its command the one `neuronfleet serve`
parses."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from support import ROOT

from neuronfleet import cli
from neuronfleet.contract import INTERNAL_TOKEN_FILE, ServeConfig
from neuronfleet.operator import builders, front_door, scaling, validation

OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]  # oldest and newest this project supports
WAKE = "http://neuronfleet-metrics.neuronfleet-system.svc:8082"
ZERO = {"enabled": True, "provider": "builtin", "min": 0, "max": 2, "scaleToZero": True, "idleSeconds": 30}


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())


UNIFIED = load("smollm2-135m-local-cpu.yaml")
DISAGGREGATED = load("smollm2-135m-local-cpu-disaggregated.yaml")


def parsed(base: dict, autoscaling: dict, **serving):
    obj = copy.deepcopy(base)
    obj["metadata"]["name"] = "m"
    obj["spec"]["autoscaling"] = autoscaling
    obj["spec"]["serving"].update(serving)
    report = validation.check(obj)
    assert report.ok, report.errors
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


def objects(spec, wake: str | None = WAKE, replicas: dict | None = None) -> dict[tuple[str, str], dict]:
    serving = scaling.with_replicas(spec, replicas)
    chash = builders.compile_hash(spec)
    built = builders.build_all(
        OWNER, spec, chash, internal_token="t", serving_spec=serving, compile_job=False, wake_base=wake
    )
    return {(o["kind"], o["metadata"]["name"]): o for o in built}


def serve_args(deployment: dict) -> ServeConfig:
    """The router's command as `neuronfleet serve` parses it (the contract both sides share)."""
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["neuronfleet", "serve"], command
    parsed = cli.build_parser().parse_args(command[1:])
    return ServeConfig.from_namespace(parsed)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_a_unified_model_that_scales_to_zero_gets_a_front_door_that_stays(version):
    spec = parsed(UNIFIED, ZERO, router={"replicas": 2})
    # at zero (the autoscaler's decision): no unified pod, the routers stay
    built = objects(spec, replicas={"unified": 0})
    for obj in built.values():
        kubernetes_validate.validate(obj, version, strict=True)
    unified, router = built[("Deployment", "m-unified")], built[("Deployment", "m-router")]
    assert unified["spec"]["replicas"] == 0
    assert router["spec"]["replicas"] == 2  # serving.router.replicas, never scaled
    assert ("PodDisruptionBudget", "m-router") in built
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert (labels["neuronfleet.dev/role"], labels["neuronfleet.dev/set"]) == ("router", "unified")
    # the model's Service selects the routers; the unified pods' headless Service is the routers' peers
    public = built[("Service", "m")]
    assert public["spec"]["selector"] == {
        "neuronfleet.dev/model": "m", "neuronfleet.dev/role": "router", "neuronfleet.dev/set": "unified",
    }  # fmt: skip
    peers = built[("Service", "m-unified")]
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["selector"] == {
        "neuronfleet.dev/model": "m", "neuronfleet.dev/role": "unified", "neuronfleet.dev/set": "unified",
    }  # fmt: skip
    assert unified["spec"]["template"]["metadata"]["labels"].items() >= peers["spec"]["selector"].items()
    port = spec.serving.port
    assert peers["spec"]["ports"] == [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]
    # the router: a front door (the model's token, no model files but the unified pods' tokenizer: routed
    # kv-aware, it follows their KV-cache events), holding 4 x slots x max, waking the operator
    args = serve_args(router)
    assert (args.role, args.unified) == ("router", [f"dns://m-unified:{port}"])
    assert (
        args.model == serve_args(unified).model
        and args.peer_kv_events == serve_args(unified).kv_events_config
    )
    assert serve_args(unified).kv_events_config is not None
    assert (args.prefill, args.decode, args.internal_token_file) == (None, None, INTERNAL_TOKEN_FILE)
    assert args.hold_requests == 4 * spec.neuron.batchSize * 2 == 32
    assert args.hold_seconds == 600.0
    assert args.wake_url == f"{WAKE}/wake/ns/m"
    assert args.served_model_name == "m" and args.port == port
    pod = router["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["cache", "tmp", "internal-token"]
    c = pod["containers"][0]
    assert {m["name"]: m.get("readOnly", False) for m in c["volumeMounts"]} == {
        "cache": True, "tmp": False, "internal-token": True}  # fmt: skip
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["image"].endswith("cpu") or "cpu" in c["image"], c["image"]
    assert "aws.amazon.com/neuroncore" not in str(c["resources"])
    # the status counts the router beside the unified pods
    assert builders.serving_roles(scaling.with_replicas(spec, {"unified": 0})) == {"unified": 0, "router": 2}


def test_keda_gets_the_front_door_without_a_wake_url_and_no_base_url_means_no_wake():
    keda = {**ZERO, "provider": "keda", "prometheusAddress": "http://prometheus.monitoring.svc:9090"}
    args = serve_args(objects(parsed(UNIFIED, keda))[("Deployment", "m-router")])
    assert (args.hold_requests, args.wake_url) == (32, None)
    args = serve_args(objects(parsed(UNIFIED, ZERO), wake=None)[("Deployment", "m-router")])
    assert (args.hold_requests, args.wake_url) == (32, None)


def test_every_unified_model_has_a_front_door_that_holds_but_one_whose_gateway_pool_is_its_pods():
    # one fixed pod (the default sample): a front door that routes kv-aware and holds while no pod is ready
    # (the lone pod lost or replaced), one pod's slots x 4, no wake (nothing scales to zero)
    for autoscaling, most in (({"enabled": False}, 1), ({"enabled": True, "min": 1, "max": 2}, 2)):
        spec = parsed(UNIFIED, autoscaling)
        built = objects(spec)
        for obj in built.values():
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
        assert built[("Service", "m")]["spec"]["selector"]["neuronfleet.dev/role"] == "router"
        assert ("Service", "m-unified") in built and builders.serving_roles(spec) == {
            "unified": 1,
            "router": 1,
        }
        door = serve_args(built[("Deployment", "m-router")])
        assert door.unified == ["dns://m-unified:8000"] and door.wake_url is None
        assert (door.hold_requests, door.hold_seconds) == (4 * spec.neuron.batchSize * most, 600.0)
        # the margin a quarter of the slots, at least 2; a pod's cache its slots at the sequence length, and
        # as much again in our runtime's host KV store (its default size)
        cache = 2 * 4 * 512
        assert (door.routing, door.routing_load_margin, door.routing_cache_tokens) == ("kv-aware", 2, cache)
        # kv-aware at one pod too: it follows the pods' KV-cache events, which they publish at every count
        unified = serve_args(built[("Deployment", "m-unified")])
        assert unified.kv_events_config is not None and door.peer_kv_events == unified.kv_events_config
    # by load alone: still a front door (it holds), no KV-cache events
    spec = parsed(UNIFIED, {"enabled": False}, routing={"policy": "least-loaded"})
    built = objects(spec)
    door = serve_args(built[("Deployment", "m-router")])
    assert (door.routing, door.model, door.peer_kv_events, door.hold_requests) == (
        "least-loaded",
        None,
        None,
        16,
    )
    assert serve_args(built[("Deployment", "m-unified")]).kv_events_config is None
    # behind a gateway's endpoint picker (no scale to zero) the pool and the Service select the pods
    plain = parsed(UNIFIED, {"enabled": True, "min": 1, "max": 2}, gateway={"endpointPicker": {"name": "e"}})
    built = objects(plain)
    assert ("Deployment", "m-router") not in built and ("Service", "m-unified") not in built
    assert built[("Service", "m")]["spec"]["selector"]["neuronfleet.dev/role"] == "unified"
    assert builders.serving_roles(plain) == {"unified": 1}
    # spec.replicas (the scale subresource) counts too, and the margin follows the spec when it says
    spec = parsed(UNIFIED, {"enabled": False}, routing={"loadMargin": 0})
    spec = spec.model_copy(update={"replicas": 3})
    assert serve_args(objects(spec)[("Deployment", "m-router")]).routing_load_margin == 0


def pod_templates(spec, replicas: dict | None = None) -> dict[str, dict]:
    """Role -> its Deployment's pod template, and the Deployments' replicas, as rendered for `spec`."""
    built = objects(spec, replicas=replicas)
    deployments = {o["metadata"]["name"]: o for (kind, _), o in built.items() if kind == "Deployment"}
    return {n: d["spec"]["template"] for n, d in deployments.items()}, {
        n: d["spec"]["replicas"] for n, d in deployments.items()
    }


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_scaling_changes_replicas_only_never_a_pod_template(engine):
    """1 -> 3 -> 1 by spec.replicas (kubectl scale), by serving.unified.replicas, by the autoscaler's
    decision, and a change of the autoscaling bounds: the serving pods' template stays the same (no pod
    restarts: a model load of minutes on Neuron), kv-aware at every count; the front door's too but for the
    bound it holds."""
    # vLLM's Neuron plugin (Trn2) publishes KV-cache events too
    base = load("llama-3.3-70b-vllm-trn2.yaml") if engine == "vllm" else UNIFIED
    fixed = parsed(base, {"enabled": False})
    declared = base["spec"]["serving"].get("unified") or {}
    renders = [pod_templates(fixed.model_copy(update={"replicas": n})) for n in (None, 1, 3, 1)] + [
        pod_templates(parsed(base, {"enabled": False}, unified={**declared, "replicas": n}))
        for n in (1, 3, 1)
    ]
    templates = [t for t, _ in renders]
    assert [r["m-unified"] for _, r in renders] == [1, 1, 3, 1, 1, 3, 1]
    assert all(t == templates[0] for t in templates), "a replica count reached a pod template"
    unified = templates[0]["m-unified"]
    config = ServeConfig.from_namespace(
        cli.build_parser().parse_args(unified["spec"]["containers"][0]["command"][1:])
    ) if engine == "embedded" else None  # fmt: skip
    if config is not None:
        assert config.kv_events_config is not None  # published at one pod already
    else:
        assert "--kv-events-config" in unified["spec"]["containers"][0]["command"]
    # autoscaled: the autoscaler's replicas and its bounds reach no serving pod's template
    scaled = [
        pod_templates(parsed(base, {"enabled": True, "min": low, "max": high}), {"unified": n})
        for low, high, n in ((1, 2, 1), (1, 4, 3), (1, 4, 1), (2, 8, 3), (0, 3, 1))
    ]
    assert all(t["m-unified"] == unified for t, _ in scaled)
    assert [r["m-unified"] for _, r in scaled] == [1, 3, 1, 3, 1]
    # the front door: the same at every count; its hold bound (slots x max) is all the bounds change in it
    doors = [t["m-router"] for t, _ in scaled]
    assert doors[1] == doors[2] and all(
        d == templates[0]["m-router"] for d in (t["m-router"] for t in templates)
    )
    holds = [serve_args({"spec": {"template": d}}).hold_requests for d in doors]
    assert holds == [4 * fixed.neuron.batchSize * m for m in (2, 4, 4, 8, 3)]


def test_a_disaggregated_models_routers_hold_always_and_wake_only_when_it_scales_to_zero():
    def router(autoscaling: dict) -> ServeConfig:
        spec = parsed(DISAGGREGATED, autoscaling)
        built = objects(spec)
        for obj in built.values():
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
        (deployment,) = [o for (kind, _), o in built.items() if kind == "Deployment" and "-router" in _]
        return serve_args(deployment)

    held = router({**ZERO, "max": 3})
    assert held.prefill and held.decode and held.unified is None
    assert held.hold_requests == 4 * 4 * 3 and held.wake_url == f"{WAKE}/wake/ns/m"
    # not at zero: it holds while no decode pod is ready (its last one lost or replaced), wakes no one
    plain = router({"enabled": True, "min": 1, "max": 3})
    assert (plain.hold_requests, plain.wake_url) == (4 * 4 * 3, None)
    assert router({"enabled": False}).hold_requests == 4 * 4


def test_the_wake_url_is_under_the_operators_base_url():
    assert (
        front_door.wake_url("http://op:8082/", "default", "smollm2") == "http://op:8082/wake/default/smollm2"
    )
