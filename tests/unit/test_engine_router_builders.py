"""What the operator renders for the router of a disaggregated SGLang model (and would for vLLM, whose pinned
image validation refuses disaggregated for now): our router speaking the engine's own P/D protocol
(`--peer-protocol`), with no model, no compiled artifacts and no shared memory mounted, but the model's token
(every pod of our runtime reads it); SGLang's prefill pods reachable at their bootstrap port through the
headless Service and past the NetworkPolicy. The embedded engine's router is unchanged (our own protocol, the
model, the token)."""

from __future__ import annotations

import yaml
from support import ROOT

from neuronfleet.cli import build_parser
from neuronfleet.contract import INTERNAL_TOKEN_DIR, INTERNAL_TOKEN_FILE, KV_EVENTS_CONFIG, ServeConfig
from neuronfleet.operator import builders, engines, validation
from neuronfleet.operator.engines import sglang, vllm_plugin
from neuronfleet.operator.engines.common import OWN_IMAGES
from neuronfleet.operator.spec import NeuronModelSpec

OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
SAMPLES = ROOT / "crds" / "samples"
SGLANG = "gpt-oss-120b-sglang-trn3-disaggregated.yaml"
EMBEDDED = "smollm2-135m-local-cpu-disaggregated.yaml"


def parsed(name: str):
    spec, errors = validation.parse(yaml.safe_load((SAMPLES / name).read_text()))
    assert not errors and spec is not None
    return spec


def rendered(name: str):
    spec = parsed(name)
    chash = builders.compile_hash(spec)
    objects = builders.build_all(OWNER, spec, serving_hash=chash, internal_token="t")
    return spec, builders.serving_set(spec, chash), objects


def deployment(objects: list[dict], role: str) -> dict:
    (dep,) = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["labels"]["neuronfleet.dev/role"] == role
    ]
    return dep


def serve_options(dep: dict) -> ServeConfig:
    command = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["neuronfleet", "serve"]
    return ServeConfig.from_namespace(build_parser().parse_args(command[1:]))


def test_an_engines_router_speaks_its_protocol_and_mounts_only_its_token_and_tmp():
    spec, rev, objects = rendered(SGLANG)
    router = deployment(objects, "router")
    config = serve_options(router)
    assert (config.role, config.peer_protocol, config.model) == ("router", "sglang", None)
    port = spec.serving.port
    peers = ([f"dns://m-prefill-{rev}:{port}"], [f"dns://m-decode-{rev}:{port}"])
    assert (config.prefill, config.decode) == peers
    assert config.bootstrap_port == sglang.BOOTSTRAP_PORT
    assert config.internal_token_file == INTERNAL_TOKEN_FILE and config.served_model_name == "m"
    pod = router["spec"]["template"]["spec"]  # its token (our runtime), its /tmp: no model files
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "internal-token"]
    mounts = pod["containers"][0]["volumeMounts"]
    token = {"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True}
    assert mounts == [{"name": "tmp", "mountPath": "/tmp"}, token]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    # a vLLM model's router would speak vLLM's protocol (validation refuses disaggregated vLLM for the
    # pinned image: operator/engines/vllm.unsupported)
    vllm = spec.model_copy(update={"engine": "vllm"})
    config = engines.serve_config(vllm, "router", "h", model="m", namespace=OWNER.namespace, set_suffix=rev)
    assert (config.peer_protocol, config.bootstrap_port) == ("vllm", None)
    assert (config.prefill, config.decode) == peers
    # routed kv-aware (the default), it follows the prefill servers' KV-cache events with the tokenizer of the
    # folder they load; by load alone it reads no model files
    assert vllm.serving.routing.policy == "kv-aware"
    assert (config.model, config.peer_kv_events) == (vllm_plugin.model_dir(vllm, "h"), KV_EVENTS_CONFIG)
    by_load = vllm.model_copy(deep=True)
    by_load.serving.routing.policy = "least-loaded"
    config = engines.serve_config(
        by_load, "router", "h", model="m", namespace=OWNER.namespace, set_suffix=rev
    )
    assert (config.model, config.peer_kv_events) == (None, None)


def test_sglang_prefill_pods_are_reachable_at_their_bootstrap_port():
    _, rev, objects = rendered(SGLANG)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    prefill_ports = {p["name"]: p for p in services[f"m-prefill-{rev}"]["spec"]["ports"]}
    boot = sglang.BOOTSTRAP_PORT
    assert prefill_ports["bootstrap"] == {
        "name": "bootstrap",
        "port": boot,
        "targetPort": boot,
        "protocol": "TCP",
    }
    assert [p["name"] for p in services[f"m-decode-{rev}"]["spec"]["ports"]] == ["http"]
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "m-pods"]
    own = policy["spec"]["ingress"][0]
    assert "ports" not in own  # every port, the bootstrap port included, for the model's own pods
    assert own["from"] == [{"podSelector": {"matchLabels": {"neuronfleet.dev/model": "m"}}}]
    embedded = parsed(SGLANG).model_copy(update={"engine": "embedded"})  # no bootstrap port for our pods
    for o in builders.build_peer_services(OWNER, embedded, "h"):
        assert [p["name"] for p in o["spec"]["ports"]] == ["http"]


def test_the_embedded_engines_router_keeps_our_protocol_with_the_model_and_token():
    *_, objects = rendered(EMBEDDED)
    router = deployment(objects, "router")
    config = serve_options(router)
    assert config.peer_protocol == "neuronfleet" and config.model and config.internal_token_file
    names = {v["name"] for v in router["spec"]["template"]["spec"]["volumes"]}
    assert {"cache", "internal-token"} <= names


def test_every_engines_router_runs_the_cpu_image_on_no_neuron_device():
    """A router holds no model and uses no Neuron core, so whatever the engine it runs our CPU image (the
    Neuron one would pull the Neuron SDK onto a node that has no device) and requests no neuroncore."""
    for sample in (
        "gpt-oss-120b-sglang-trn3-disaggregated.yaml",
        "smollm2-135m-local-cpu-disaggregated.yaml",
    ):
        spec = NeuronModelSpec.model_validate(
            yaml.safe_load((ROOT / "crds" / "samples" / sample).read_text())["spec"]
        )
        chash = builders.compile_hash(spec)
        router = next(
            o for o in builders.build_all(builders.Owner("m", "ns"), spec, chash, internal_token="t")
            if o["kind"] == "Deployment" and o["metadata"]["labels"]["neuronfleet.dev/role"] == "router"
        )  # fmt: skip
        c = router["spec"]["template"]["spec"]["containers"][0]
        assert c["image"] == OWN_IMAGES["cpu"], sample
        assert "aws.amazon.com/neuroncore" not in (c.get("resources") or {}).get("limits", {}), sample
