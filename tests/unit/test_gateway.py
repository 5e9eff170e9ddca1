"""serving.gateway: the spec's refusals, and the InferencePool and HTTPRoute the operator builds, checked
against the pinned Gateway API Inference Extension and Gateway API CRDs (tests/data: their openAPIV3Schema
with jsonschema, and their CEL rules evaluated as the emulated API server does); the pool selects what the
model's Service selects, the endpoint picker's role labels on the serving pods."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml
from support import ROOT

from neuronfleet.localcluster import semantics
from neuronfleet.operator import builders, crd, gateway, kube, validation

POOL_CRD = ROOT / "tests" / "data" / "gie-v1.6.0-inferencepools.yaml"
ROUTE_CRD = ROOT / "tests" / "data" / "gateway-api-v1.6.1-httproutes.yaml"
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
UNIFIED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
DISAGGREGATED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
GATEWAY = {
    "endpointPicker": {"name": "m-epp"},
    "httpRoute": {
        "parentRefs": [{"name": "inference-gateway", "namespace": "gw", "sectionName": "http"}],
        "hostnames": ["llm.example.com"],
        "path": "/v1",
    },
}


def schema(path, version: str = "v1") -> dict:
    crd_doc = yaml.safe_load(path.read_text())
    (found,) = [v for v in crd_doc["spec"]["versions"] if v["name"] == version]
    return found["schema"]["openAPIV3Schema"]


def accepted(obj: dict, path) -> None:
    """The pinned CRD's schema (OpenAPI v3.0: JSON Schema draft 4 semantics) and its CEL rules."""
    s = schema(path)
    jsonschema.Draft4Validator(s).validate(obj)
    assert semantics.cel_violations(obj, s, "") == []


def manifest(path, **serving) -> dict:
    obj = yaml.safe_load(path.read_text())
    obj["spec"]["serving"] = {**obj["spec"].get("serving", {}), **serving}
    return obj


def built(obj: dict) -> dict[str, list[dict]]:
    spec, errors = validation.parse(obj)
    assert not errors, errors
    out: dict[str, list[dict]] = {}
    for o in builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec)):
        out.setdefault(o["kind"], []).append(o)
    return out


def test_the_crd_data_is_the_pinned_releases():
    assert POOL_CRD.read_text().splitlines()[0] == (
        "# Source: https://github.com/kubernetes-sigs/gateway-api-inference-extension/blob/v1.6.0/config/crd/"
        "bases/inference.networking.k8s.io_inferencepools.yaml"
    )
    assert ROUTE_CRD.read_text().splitlines()[0] == (
        "# Source: https://github.com/kubernetes-sigs/gateway-api/blob/v1.6.1/config/crd/standard/"
        "gateway.networking.k8s.io_httproutes.yaml"
    )
    pool = yaml.safe_load(POOL_CRD.read_text())
    assert pool["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    route = yaml.safe_load(ROUTE_CRD.read_text())
    assert route["metadata"]["annotations"]["gateway.networking.k8s.io/bundle-version"] == "v1.6.1"
    assert route["metadata"]["annotations"]["gateway.networking.k8s.io/channel"] == "standard"


def test_a_unified_model_pools_its_serving_pods_for_the_endpoint_picker():
    objects = built(manifest(UNIFIED, gateway=GATEWAY))
    (pool,) = objects["InferencePool"]
    (service,) = [s for s in objects["Service"] if s["metadata"]["name"] == "m"]
    accepted(pool, POOL_CRD)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "m" and pool["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    # the same pods as the model's Service: the unified serving pods, on the serving port
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["selector"]["matchLabels"]["neuronfleet.dev/role"] == "unified"
    assert pool["spec"]["targetPorts"] == [{"number": service["spec"]["ports"][0]["port"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service", "name": "m-epp", "port": {"number": 9002}, "failureMode": "FailClose",
    }  # fmt: skip
    (deployment,) = objects["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["llm-d.ai/role"] == "prefill-decode"
    assert all(pod_labels[k] == v for k, v in pool["spec"]["selector"]["matchLabels"].items())


def test_the_http_route_sends_the_gateways_requests_to_the_pool():
    objects = built(manifest(UNIFIED, gateway=GATEWAY))
    (route,) = objects["HTTPRoute"]
    accepted(route, ROUTE_CRD)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway",
         "namespace": "gw", "sectionName": "http"}
    ]  # fmt: skip
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "m"}
    ]


def test_without_a_route_only_the_pool_and_without_a_gateway_nothing_and_no_role_labels():
    objects = built(manifest(UNIFIED, gateway={"endpointPicker": {"name": "epp", "port": 9100,
                                                                  "failureMode": "FailOpen"}}))  # fmt: skip
    assert "HTTPRoute" not in objects
    (pool,) = objects["InferencePool"]
    accepted(pool, POOL_CRD)
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    plain = built(manifest(UNIFIED))
    assert "InferencePool" not in plain and "HTTPRoute" not in plain
    for deployment in plain["Deployment"]:  # the pods and their front door
        assert (
            "llm-d.ai/role" not in deployment["spec"]["template"]["metadata"]["labels"]
        )  # no roll on upgrade


def test_a_disaggregated_model_pools_its_routers_and_labels_prefill_and_decode_pods():
    objects = built(manifest(DISAGGREGATED, gateway=GATEWAY))
    (pool,) = objects["InferencePool"]
    accepted(pool, POOL_CRD)
    (service,) = [s for s in objects["Service"] if s["metadata"]["name"] == "m"]
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["selector"]["matchLabels"]["neuronfleet.dev/role"] == "router"
    roles = {
        d["metadata"]["labels"]["neuronfleet.dev/role"]: d["spec"]["template"]["metadata"]["labels"].get(
            "llm-d.ai/role"
        )
        for d in objects["Deployment"]
    }
    # llm-d v0.8.0's filters: prefill pods for its prefill profile, decode pods for its decode one; the
    # routers carry none (a P/D profile finds no prefill pod among them: our router splits the request)
    assert roles == {"prefill": "prefill", "decode": "decode", "router": None}


def test_a_scale_to_zero_model_pools_its_front_door():
    obj = manifest(UNIFIED, gateway=GATEWAY)
    obj["spec"]["autoscaling"] = {"enabled": True, "min": 0, "max": 2, "scaleToZero": True}
    objects = built(obj)
    (pool,) = objects["InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"]["neuronfleet.dev/role"] == "router"


def test_the_pool_follows_the_selector_the_rollout_chose():
    objects = built(manifest(DISAGGREGATED, gateway=GATEWAY))
    (pool,) = objects["InferencePool"]
    old = {**pool["spec"]["selector"]["matchLabels"], "neuronfleet.dev/set": "abc123"}
    moved = gateway.with_selector(pool, old)
    assert moved["spec"]["selector"]["matchLabels"] == old
    assert pool["spec"]["selector"]["matchLabels"]["neuronfleet.dev/set"] != "abc123"  # a copy
    accepted(moved, POOL_CRD)


def test_what_a_spec_change_deletes():
    def spec_of(gw):
        spec, errors = validation.parse(manifest(UNIFIED, **({"gateway": gw} if gw else {})))
        assert not errors
        return spec

    assert gateway.unwanted(spec_of(None)) == ["InferencePool", "HTTPRoute"]
    assert gateway.unwanted(spec_of({"endpointPicker": {"name": "e"}})) == ["HTTPRoute"]
    assert gateway.unwanted(spec_of(GATEWAY)) == []


@pytest.mark.parametrize(
    ("gw", "message"),
    [
        ({}, "spec.serving.gateway.endpointPicker: Field required"),
        ({"endpointPicker": {"name": "Bad_Name"}},
         "spec.serving.gateway.endpointPicker.name: must be a DNS-1123 label"),
        ({"endpointPicker": {"name": "e", "failureMode": "Open"}},
         "spec.serving.gateway.endpointPicker.failureMode: must be one of 'FailOpen' or 'FailClose', got "
         "'Open'"),
        ({"endpointPicker": {"name": "e", "port": 0}},
         "spec.serving.gateway.endpointPicker.port: Input should be greater than or equal to 1"),
        ({"endpointPicker": {"name": "e"}, "httpRoute": {"parentRefs": []}},
         "spec.serving.gateway.httpRoute.parentRefs: List should have at least 1 item"),
        ({"endpointPicker": {"name": "e"}, "httpRoute": {"parentRefs": [{"name": "g"}], "path": "v1"}},
         "spec.serving.gateway.httpRoute.path: String should match pattern '^/"),
        ({"endpointPicker": {"name": "e"},
          "httpRoute": {"parentRefs": [{"name": "g"}], "hostnames": ["A b"]}},
         "spec.serving.gateway.httpRoute.hostnames.0: String should match pattern"),
        ({"endpointPicker": {"name": "e"}, "httpRoute": {"parentRefs": [{"name": "g"}, {"name": "g"}]}},
         "spec.serving.gateway.httpRoute: serving.gateway.httpRoute.parentRefs must name each Gateway (and "
         "listener) once; named twice: g"),
        ({"endpointPicker": {"name": "e"}, "route": {}}, "spec.serving.gateway.route: unknown field"),
    ],
)  # fmt: skip
def test_a_bad_gateway_section_is_refused_saying_what_is_wrong(gw, message):
    spec, errors = validation.parse(manifest(UNIFIED, gateway=gw))
    assert spec is None
    assert any(e.startswith(message) for e in errors), errors


def test_the_crd_enforces_the_same_parent_rule_as_python():
    """The NeuronModel CRD's CEL twin of the parentRefs rule, evaluated as the emulated API server does."""
    generated = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    route_schema = generated["properties"]["spec"]["properties"]["serving"]["properties"]["gateway"][
        "properties"]["httpRoute"]  # fmt: skip
    twice = {"parentRefs": [{"name": "g"}, {"name": "g", "namespace": "a"}, {"name": "g"}]}
    once = {"parentRefs": [{"name": "g"}, {"name": "g", "namespace": "a"}, {"name": "g", "sectionName": "s"}]}
    assert semantics.cel_violations(copy.deepcopy(once), route_schema, "r") == []
    (violation,) = semantics.cel_violations(twice, route_schema, "r")
    assert "must name each Gateway (and listener) once" in violation


def test_rbac_grows_by_exactly_what_the_gateway_objects_need():
    assert kube.RBAC_RULES[("inference.networking.k8s.io", "inferencepools")] == (
        "get",
        "create",
        "patch",
        "delete",
    )
    assert kube.RBAC_RULES[("gateway.networking.k8s.io", "httproutes")] == (
        "get",
        "create",
        "patch",
        "delete",
    )
    for kind in gateway.KINDS:
        group, version, _ = kube.API_VERSIONS[kind]
        assert f"{group}/{version}" in (
            "inference.networking.k8s.io/v1", "gateway.networking.k8s.io/v1"
        )  # fmt: skip


def test_the_engines_registry_has_every_static_family_the_picker_reads():
    """The families `engine_metrics` registers (the load gauges are the engine's: the live scrape in
    tests/integration/test_gateway_protocol.py checks all of them), rendered and parsed as Prometheus text."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from neuronfleet.runtime.serving.engine_metrics import KV_BLOCK_TOKENS, StepMetrics

    registry = CollectorRegistry()
    StepMetrics(registry, "m", slots=4, max_seq_len=512)
    found = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    read = yaml.safe_load((ROOT / "tests" / "data" / "gie-v1.5.0-epp-scraped-metrics.yaml").read_text())
    for m in read["metrics"]:
        if m["name"] in ("vllm:lora_requests_info", "vllm:cache_config_info"):
            (sample,) = found[m["name"]].samples
            assert found[m["name"]].type == m["type"] == "gauge"
            assert set(m["labels"]) <= set(sample.labels)
    (cache,) = found["vllm:cache_config_info"].samples
    assert cache.labels["block_size"] == str(KV_BLOCK_TOKENS)
    assert int(cache.labels["num_gpu_blocks"]) * KV_BLOCK_TOKENS == 4 * 512
