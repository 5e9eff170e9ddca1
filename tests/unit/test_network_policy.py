"""Every model's NetworkPolicies (serving.networkPolicy, on by default), as a cluster that enforces them would
apply them (tests/network_policies.py evaluates Kubernetes' rules; local mode enforces none): objects from
the real builders, the operator's peers from the real chart (rendered by Helm's engine) as the operator reads
them.
The operator reaches every serving pod's `http` port (where the builtin autoscaler reads /metrics), so does
the Prometheus the chart names (where the PodMonitor scrapes), and nothing else of them; a pod of another
namespace, or of another model, reaches only the public pods' serving port (through the model's Service or a
gateway's InferencePool); the model's own pods reach every port of each other. And the evaluator itself, on
the Kubernetes documentation's examples."""

from __future__ import annotations

import functools
import itertools

import helm_python as helm  # helm-python-sdk, installed by scripts/setup.sh
import kubernetes_validate
import pytest
import yaml
from network_policies import Pod, admits, pods_of, selects
from support import ROOT

from neuronfleet.operator import builders, network_policy, validation

CHART = ROOT / "charts" / "neuronfleet"
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))
RELEASE_NAMESPACE = "neuronfleet-system"
MODELS_NAMESPACE = "team-a"
KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]
PROMETHEUS = {  # kube-prometheus-stack's Prometheus pods, in namespace monitoring
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
}
VALUES = {"networkPolicy": {"metricsFrom": [PROMETHEUS]}, "podMonitor": {"enabled": True}}


@functools.cache
def chart() -> tuple[Pod, network_policy.Peers, dict]:
    """The rendered chart's operator pod, the peers its operator reads from its environment, and the
    PodMonitor of the model pods."""
    with helm.Chart.load(str(CHART)) as loaded:
        manifests = loaded.render(VALUES, name="nf", namespace=RELEASE_NAMESPACE, is_install=True)
    objects = [
        d for p, t in sorted(manifests.items()) if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d
    ]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    (operator,) = pods_of(deployment)
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    return operator, network_policy.Peers.from_setting(env[network_policy.SETTING_ENV]), monitor


def model(path, name: str, **serving) -> tuple[list[dict], list[Pod]]:
    """A model's objects (as the operator builds them, with the chart's peers) and its serving pods, two of
    each role."""
    obj = yaml.safe_load(path.read_text())
    obj["spec"]["serving"] = {**(obj["spec"].get("serving") or {}), **serving}
    spec, errors = validation.parse(obj)
    assert spec is not None and not errors, errors
    owner = builders.Owner(name, MODELS_NAMESPACE, "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
    objects = builders.build_all(
        owner, spec, builders.compile_hash(spec), internal_token="t", peers=chart()[1]
    )
    pods = [p for o in objects if o["kind"] == "Deployment" for p in pods_of(o, 2)]
    return objects, pods


def public_pods(objects: list[dict], name: str, pods: list[Pod]) -> list[Pod]:
    """The pods the model's Service selects (its clients' way in)."""
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    return [p for p in pods if selects({"matchLabels": service["spec"]["selector"]}, p.labels)]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_clients_reach_the_public_port_the_operator_and_prometheus_the_metrics_the_model_everything(path):
    operator, _, monitor = chart()
    objects, pods = model(path, "m")
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert {p["metadata"]["name"] for p in policies} == {"m-pods", "m-public"}
    for version in KUBERNETES_VERSIONS:
        for policy in policies:
            kubernetes_validate.validate(policy, version, strict=True)
    others, other_pods = model(path, "other")
    policies += [o for o in others if o["kind"] == "NetworkPolicy"]
    public = public_pods(objects, "m", pods)
    assert public and all(p.ports.get("http") for p in pods)
    prometheus = Pod("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
    impostor = Pod("prometheus-0", "elsewhere", {"app.kubernetes.io/name": "prometheus"})  # not its namespace
    stranger = Pod("curl", "elsewhere", {"app": "curl"})
    neighbour = Pod("curl", MODELS_NAMESPACE, {"app": "curl"})  # the model's namespace, not the model
    # the PodMonitor scrapes the `http` port of every serving pod (of any namespace: cluster mode)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    scraped = [p for p in pods if selects(monitor["spec"]["selector"], p.labels)]
    assert endpoint["port"] == "http" and scraped == pods
    for target in pods:
        for name, port in target.ports.items():
            where = f"{target.name}:{name}"
            metrics = name == "http"  # where /metrics is served (the autoscaler's scrape, the PodMonitor's)
            assert admits(policies, operator, target, port) == metrics, where
            assert admits(policies, prometheus, target, port) == metrics, where
            clients = metrics and target in public
            for source in (impostor, stranger, neighbour, *other_pods):
                assert admits(policies, source, target, port) == clients, (source.name, where)
            for source in pods:  # the model's own pods: every port (KV, KV events, internal endpoints)
                assert admits(policies, source, target, port), (source.name, where)
    theirs = public_pods(others, "other", other_pods)  # and this model's pods reach another's as clients do
    for target, (name, port) in ((t, n) for t in other_pods for n in t.ports.items()):
        assert admits(policies, pods[0], target, port) == (target in theirs and name == "http"), target.name


def test_the_public_policy_follows_the_service_through_a_switch_and_a_gateway_reaches_the_pools_pods():
    """A gateway's InferencePool selects the public Service's pods on the serving port: its proxy and endpoint
    picker reach them as clients do (clientsFrom empty: from anywhere), and nothing else."""
    sample = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
    gateway = {"endpointPicker": {"name": "epp", "port": 9002}}
    objects, pods = model(sample, "m", gateway=gateway)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    picker = Pod("epp-0", "gateway-system", {"app": "epp"})
    pooled = [p for p in pods if selects(pool["spec"]["selector"], p.labels)]
    assert pooled == public_pods(objects, "m", pods)
    (target_port,) = [p["number"] for p in pool["spec"]["targetPorts"]]
    for target, (name, port) in ((t, n) for t in pods for n in t.ports.items()):
        assert admits(policies, picker, target, port) == (target in pooled and port == target_port), name


def test_turned_off_a_model_has_no_policy_and_its_pods_take_every_connection():
    objects, pods = model(SAMPLES[0], "m", networkPolicy=False)
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]
    stranger = Pod("curl", "elsewhere", {"app": "curl"})
    assert all(admits([], stranger, t, port) for t in pods for port in t.ports.values())


def test_clients_from_the_chart_are_the_only_clients():
    """networkPolicy.clientsFrom: only those peers reach the public pods (the operator and Prometheus reach
    /metrics as before)."""
    ingress = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
    peers = network_policy.Peers(operator=chart()[1].operator, clients=(ingress,))
    sample = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
    spec, _ = validation.parse(yaml.safe_load(sample.read_text()))
    owner = builders.Owner("m", MODELS_NAMESPACE, "u")
    objects = builders.build_all(owner, spec, builders.compile_hash(spec), peers=peers)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = [p for o in objects if o["kind"] == "Deployment" for p in pods_of(o)]
    (target,) = public_pods(objects, "m", pods)
    port = target.ports["http"]
    assert admits(policies, Pod("controller", "ingress-nginx", {}), target, port)
    assert not admits(policies, Pod("curl", "elsewhere", {}), target, port)
    assert admits(policies, chart()[0], target, port)


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("[]", "expected a JSON object"),
        ('{"metrics": {"podSelector": {}}}', "metrics must be a list of NetworkPolicyPeers"),
        ('{"clients": [{"pods": {}}]}', "clients must be a list"),
        ('{"operators": []}', "keys among operator, metrics and clients"),
        ("{", "not JSON"),
    ],
)
def test_a_bad_setting_is_refused_saying_what_is_wrong(text, complaint):
    with pytest.raises(ValueError, match=complaint):
        network_policy.Peers.from_setting(text)
    assert network_policy.Peers.from_setting(None) == network_policy.Peers.from_setting("  ")


# ---- the evaluator, on the Kubernetes documentation's examples -------------------------------------------
# https://kubernetes.io/docs/concepts/services-networking/network-policies/ ("The NetworkPolicy resource",
# "Behavior of to and from selectors", "Targeting a range of ports")

DOCS_POLICY = {
    "metadata": {"name": "test-network-policy", "namespace": "default"},
    "spec": {
        "podSelector": {"matchLabels": {"role": "db"}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{
            "from": [
                {"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}},
                {"namespaceSelector": {"matchLabels": {"project": "myproject"}}},
                {"podSelector": {"matchLabels": {"role": "frontend"}}},
            ],
            "ports": [{"protocol": "TCP", "port": 6379}],
        }],
        "egress": [
            {"to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}], "ports": [{"protocol": "TCP", "port": 5978}]}
        ],
    },
}  # fmt: skip


def test_the_evaluator_follows_the_documentations_example():
    db = Pod("db", "default", {"role": "db"})
    frontend = Pod("web", "default", {"role": "frontend"}, ip="10.1.0.1")
    assert admits([DOCS_POLICY], frontend, db, 6379) and not admits([DOCS_POLICY], frontend, db, 80)
    mine = {"mine": {"project": "myproject"}}
    other_ns = Pod("x", "mine", {}, ip="10.1.0.2")
    assert admits([DOCS_POLICY], other_ns, db, 6379, mine) and not admits([DOCS_POLICY], other_ns, db, 6379)
    assert not admits([DOCS_POLICY], Pod("web", "prod", {"role": "frontend"}, ip="10.1.0.3"), db, 6379)
    assert admits([DOCS_POLICY], Pod("x", "prod", {}, ip="172.17.2.9"), db, 6379)  # in the block
    assert not admits([DOCS_POLICY], Pod("x", "prod", {}, ip="172.17.1.9"), db, 6379)  # its exception
    assert admits([DOCS_POLICY], Pod("x", "prod", {}, ip="10.1.0.4"), frontend, 80)  # not selected: open


def test_one_peer_with_both_selectors_is_an_and_two_peers_an_or():
    target = Pod("t", "default", {"app": "t"}, {"http": 8000})

    def policy(peers):
        return {
            "metadata": {"name": "p", "namespace": "default"},
            "spec": {"podSelector": {}, "ingress": [{"from": peers, "ports": [{"port": "http"}]}]},
        }

    both = policy([{"namespaceSelector": {"matchLabels": {"user": "alice"}}, "podSelector": {"matchLabels": {
        "role": "client"}}}])  # fmt: skip
    either = policy([{"namespaceSelector": {"matchLabels": {"user": "alice"}}},
                     {"podSelector": {"matchLabels": {"role": "client"}}}])  # fmt: skip
    labels = {"alice": {"user": "alice"}}
    client_in_alice = Pod("c", "alice", {"role": "client"})
    other_in_alice = Pod("o", "alice", {})
    client_here = Pod("c", "default", {"role": "client"})
    assert admits([both], client_in_alice, target, 8000, labels)
    assert not admits([both], other_in_alice, target, 8000, labels)
    assert not admits([both], client_here, target, 8000, labels)
    assert all(
        admits([either], p, target, 8000, labels) for p in (client_in_alice, other_in_alice, client_here)
    )
    assert not admits([either], client_in_alice, target, 9000, labels)  # `http` names 8000 on the target


def test_a_port_range_and_a_policy_of_egress_only():
    target = Pod("t", "default", {"app": "t"})
    ranged = {
        "metadata": {"name": "r", "namespace": "default"},
        "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 32000, "endPort": 32768}]}]},
    }
    source = Pod("s", "default", {})
    edges = [admits([ranged], source, target, p) for p in (31999, 32000, 32768, 32769)]
    assert edges == [False, True, True, False]
    egress_only = {"metadata": {"name": "e", "namespace": "default"},
                   "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}  # fmt: skip
    assert admits([egress_only], source, target, 1)
    deny_all = {"metadata": {"name": "d", "namespace": "default"}, "spec": {"podSelector": {}}}
    assert not any(admits([deny_all], a, b, 1) for a, b in itertools.permutations([source, target]))
