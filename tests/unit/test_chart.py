"""The Helm chart, rendered by Helm's own engine (helm-python-sdk, Helm's Go SDK): lint clean in strict mode,
every object valid Kubernetes (kubernetes-validate, strict, oldest and newest supported versions) for several
value sets, RBAC exactly the operator's declared API calls (kube.RBAC_RULES) in cluster and namespaced mode,
the CRD in crds/ exactly the generated one, the app version the package's, bad values refused by the schema;
and the Dockerfile's structure (targets, pinned bases, non-root users)."""

from __future__ import annotations

import re
import tomllib

import helm_python as helm  # helm-python-sdk, installed by scripts/setup.sh
import kubernetes_validate
import pytest
import yaml
from support import ROOT

import neuronfleet
from neuronfleet.contract import TORCHNEURON_PINNED
from neuronfleet.operator import crd, kube, leader, leadership, watching

RELEASE_NAMESPACE = "neuronfleet-system"

CHART = ROOT / "charts" / "neuronfleet"
KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]  # oldest and newest this project supports (Chart.yaml kubeVersion)

VALUE_SETS = {
    "defaults": {},
    "namespaced": {"watch": {"mode": "namespaces", "namespaces": ["team-a", "team-b"]}},
    "monitoring": {
        "metrics": {"port": 9090, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 0},
    },
    "network-policy-and-opt-ins": {
        "networkPolicy": {
            "metricsFrom": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
            "clientsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
        },
        "rbac": {"podDeletionCost": True},
    },
    "custom-images": {
        "image": {"repository": "registry.example.com/ml/neuronfleet-operator", "tag": "0.1.0-rc1"},
        "runtimeImages": {
            "cpu": "registry.example.com/ml/runtime-cpu:0.1.0",
            "neuron": "registry.example.com/ml/runtime-neuron:0.1.0",
        },
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "logLevel": "debug",
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
    },
}


def render(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="nf", namespace=RELEASE_NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(manifests.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def operator_env(objects: list[dict]) -> dict[str, str | None]:
    """The operator container's environment in the rendered chart."""
    (deployment,) = kinds(objects, "Deployment")
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def kinds(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def rule_set(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def declared(*opt_ins: str) -> set[tuple[str, str, str]]:
    """RBAC_RULES, and the OPT_IN_RULES of the chart values `opt_ins`."""
    tables = [kube.RBAC_RULES, *(kube.OPT_IN_RULES[name] for name in opt_ins)]
    return {(g, r, verb) for table in tables for (g, r), verbs in table.items() for verb in verbs}


def test_the_chart_lints_clean_in_strict_mode():
    for values in VALUE_SETS.values():
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.31.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report.get("errors", [])
        assert not problems, problems


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(name, version):
    objects = render(VALUE_SETS[name])
    assert kinds(objects, "Deployment")
    for obj in objects:
        if (
            obj["apiVersion"] == "monitoring.coreos.com/v1"
        ):  # the Prometheus Operator's CRD: not in the schemas
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_operator_pod_is_locked_down():
    (deployment,) = kinds(render({}), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # highly available: two replicas that elect a leader, rolled one at a time, on different nodes if they can
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert (
        env["NEURONFLEET_LEADER_ELECT"] == "true"
        and env["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
    )
    settings = leader.settings({k: v for k, v in env.items() if isinstance(v, str)} | {"POD_NAMESPACE": "nf"})
    assert settings.enabled and settings.timing == leadership.Timing() and settings.namespace == "nf"
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert (
        anti["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
    (budget,) = kinds(render({}), "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
    assert security["capabilities"] == {"drop": ["ALL"]} and not security["privileged"]
    assert container["image"] == f"ghcr.io/neuronfleet/operator:{neuronfleet.__version__}"
    assert container["livenessProbe"]["httpGet"]["port"] == "health" and container["readinessProbe"]
    assert container["resources"]["limits"]["memory"]
    assert "--all-namespaces" in container["args"] and "--standalone" in container["args"]


def leader_election_role(objects: list[dict]) -> dict:
    (role,) = [r for r in kinds(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    return role


def nodes_roles(objects: list[dict]) -> list[dict]:
    """rbac.readNodes' ClusterRole (what the nodes offer), in either watch mode."""
    return [r for r in kinds(objects, "ClusterRole") if r["metadata"]["name"].endswith("-nodes")]


def operator_roles(objects: list[dict]) -> list[dict]:
    """The operator's own (Cluster)Roles: neither the Lease's nor rbac.readNodes'."""
    lease, nodes = leader_election_role(objects), nodes_roles(objects)
    return [
        r for r in kinds(objects, "ClusterRole") + kinds(objects, "Role") if r is not lease and r not in nodes
    ]


def test_rbac_is_exactly_what_the_operator_calls_cluster_wide_or_per_namespace():
    objects = render({})
    lease = {(g, r, v) for (g, r), verbs in kube.LEASE_RULES.items() for v in verbs}
    role = leader_election_role(objects)  # the Lease, in the release's namespace only
    assert rule_set(role["rules"]) == lease and role["metadata"]["namespace"] == RELEASE_NAMESPACE
    (role,) = [r for r in kinds(objects, "ClusterRole") if r not in nodes_roles(objects)]
    kopf = {(g, r, v) for (g, r), verbs in watching.KOPF_RULES.items() for v in verbs}
    assert rule_set(role["rules"]) == declared() | kopf
    assert not any(
        "*" in x for rule in role["rules"] for x in rule["apiGroups"] + rule["resources"] + rule["verbs"]
    )
    (binding,) = [
        b for b in kinds(objects, "ClusterRoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    (account,) = kinds(objects, "ServiceAccount")
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]

    objects = render(VALUE_SETS["namespaced"])
    assert kinds(objects, "ClusterRole") == nodes_roles(objects)  # (what the nodes offer: cluster-scoped)
    roles = [r for r in kinds(objects, "Role") if r is not leader_election_role(objects)]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(rule_set(r["rules"]) == declared() for r in roles)
    bindings = [
        b for b in kinds(objects, "RoleBinding") if not b["metadata"]["name"].endswith("-leader-election")
    ]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    (deployment,) = kinds(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_no_rule_reads_every_secret_or_patches_pods_unless_a_value_opts_in(name):
    """Secrets: get (by name) and create only, never list, watch or delete; pods: patch only with
    rbac.podDeletionCost, which also tells the operator it may (NEURONFLEET_POD_DELETION_COST); the rules
    are then exactly RBAC_RULES and that opt-in's OPT_IN_RULES, cluster-wide (with kopf's KOPF_RULES) or in
    each watched namespace."""
    from neuronfleet.operator import autoscale_loop

    values = VALUE_SETS[name]
    opted = bool(values.get("rbac", {}).get("podDeletionCost"))
    objects = render(values)
    roles = operator_roles(objects)
    assert roles
    for role in roles:
        rules = rule_set(role["rules"])
        kopf = {(g, r, v) for (g, r), verbs in watching.KOPF_RULES.items() for v in verbs}
        wanted = declared(*(["podDeletionCost"] if opted else [])) | (
            kopf if role["kind"] == "ClusterRole" else set()
        )
        assert rules == wanted, role["metadata"]
        assert not {("", "secrets", v) for v in ("list", "watch", "delete", "deletecollection")} & rules
        assert (("", "pods", "patch") in rules) == opted
    assert autoscale_loop.pod_deletion_cost(operator_env(objects)) == opted
    with pytest.raises(ValueError, match=r"rbac\.podDeletionCost"):
        autoscale_loop.pod_deletion_cost({autoscale_loop.POD_DELETION_COST_ENV: "yes"})


@pytest.mark.parametrize("mode", ["defaults", "namespaced"])
def test_reading_nodes_is_a_read_only_cluster_role_that_a_value_turns_off(mode):
    """rbac.readNodes (on by default): a ClusterRole of exactly OPT_IN_RULES["readNodes"] (list and watch,
    nothing else), bound to the operator's ServiceAccount, in cluster and namespaced mode alike (nodes are
    cluster-scoped), and NEURONFLEET_READ_NODES true; off: neither, and the operator told so."""
    from neuronfleet.operator import node_watch

    objects = render(VALUE_SETS[mode])
    (role,) = nodes_roles(objects)
    assert rule_set(role["rules"]) == declared("readNodes") - declared()
    assert {verb for _, _, verb in rule_set(role["rules"])} == {"list", "watch"}
    (binding,) = [
        b for b in kinds(objects, "ClusterRoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]
    ]
    (account,) = kinds(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": RELEASE_NAMESPACE}
    ]
    assert node_watch.reads_nodes(operator_env(objects))
    values = {**VALUE_SETS[mode], "rbac": {"readNodes": False}}
    objects = render(values)
    assert not nodes_roles(objects) and not node_watch.reads_nodes(operator_env(objects))
    assert not any(b["roleRef"]["name"].endswith("-nodes") for b in kinds(objects, "ClusterRoleBinding"))
    with pytest.raises(ValueError, match=r"rbac\.readNodes"):
        node_watch.reads_nodes({node_watch.READ_NODES_ENV: "yes"})


def test_the_security_page_lists_exactly_the_rules_and_opt_ins():
    """docs/security.md's table of the operator's permissions is RBAC_RULES with kopf's KOPF_RULES, its
    opt-ins OPT_IN_RULES."""
    text = (ROOT / "docs" / "security.md").read_text()
    table, opt_ins = text.split("## The operator's permissions", 1)[1].split("Opt-ins", 1)
    rows = re.findall(r"^\| ([\w.()-]+) \| ([\w/]+) \| ([\w, ]+) \| .* \|$", table, re.M)
    listed = {("" if g == "(core)" else g, r, v.strip()) for g, r, verbs in rows for v in verbs.split(",")}
    kopf = {(g, r, v) for (g, r), verbs in watching.KOPF_RULES.items() for v in verbs}
    assert listed == declared() | kopf
    assert set(re.findall(r"^\| `rbac\.(\w+)` \|", opt_ins, re.M)) == set(kube.OPT_IN_RULES)


def test_the_network_policy_values_reach_the_operator_as_the_peers_it_reads():
    """NEURONFLEET_NETWORK_POLICY: this release's operator pods (its selector labels, in its namespace), and
    the values' metricsFrom and clientsFrom as they are."""
    from neuronfleet.operator import network_policy

    objects = render(VALUE_SETS["network-policy-and-opt-ins"])
    (deployment,) = kinds(objects, "Deployment")
    peers = network_policy.Peers.from_setting(operator_env(objects)[network_policy.SETTING_ENV])
    selector = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NAMESPACE}},
                "podSelector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}}  # fmt: skip
    assert peers.operator == (selector,)
    assert list(peers.metrics) == VALUE_SETS["network-policy-and-opt-ins"]["networkPolicy"]["metricsFrom"]
    assert list(peers.clients) == VALUE_SETS["network-policy-and-opt-ins"]["networkPolicy"]["clientsFrom"]
    default = network_policy.Peers.from_setting(operator_env(render({}))[network_policy.SETTING_ENV])
    assert default.operator == (selector,) and default.metrics == default.clients == ()


def test_value_sets_reach_the_objects():
    objects = render(VALUE_SETS["monitoring"])
    (monitor,) = kinds(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (service,) = kinds(objects, "Service")
    assert service["spec"]["ports"][0]["port"] == 9090
    (pdb,) = kinds(objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 0
    objects = render(VALUE_SETS["custom-images"])
    assert not kinds(objects, "ServiceAccount")
    (deployment,) = kinds(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry.example.com/ml/neuronfleet-operator:0.1.0-rc1"
    assert pod["serviceAccountName"] == "existing-sa" and pod["imagePullSecrets"] == [{"name": "regcred"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NEURONFLEET_RUNTIME_IMAGE_CPU"] == "registry.example.com/ml/runtime-cpu:0.1.0"
    assert env["NEURONFLEET_RUNTIME_IMAGE_NEURON"] == "registry.example.com/ml/runtime-neuron:0.1.0"
    assert "--verbose" in container["args"]


def test_the_device_allocation_and_the_lnc_label_reach_the_operator_as_the_settings_it_reads():
    """neuron.deviceAllocation (devicePlugin by default) and neuron.lncNodeLabel (none by default) reach the
    operator as the variables operator/devices.py reads (a value it could not use: the schema refuses it,
    below)."""
    from neuronfleet.operator import devices

    env = operator_env(render({}))
    assert env[devices.DEVICE_ALLOCATION_ENV] == "devicePlugin" and devices.LNC_NODE_LABEL_ENV not in env
    env = operator_env(render({"neuron": {"deviceAllocation": "dra", "lncNodeLabel": "example.com/lnc"}}))
    assert (
        env[devices.DEVICE_ALLOCATION_ENV] == "dra" and env[devices.LNC_NODE_LABEL_ENV] == "example.com/lnc"
    )


def test_the_neuron_scheduler_is_named_only_where_the_chart_says_the_cluster_runs_it():
    """Default: no scheduler setting reaches the operator (its pods use the cluster's default scheduler);
    neuron.schedulerName: the operator's NEURONFLEET_NEURON_SCHEDULER, which pod_parts reads."""
    from neuronfleet.operator import pod_parts

    assert pod_parts.NEURON_SCHEDULER_ENV not in operator_env(render({}))
    named = operator_env(render({"neuron": {"schedulerName": "my-scheduler"}}))
    assert named[pod_parts.NEURON_SCHEDULER_ENV] == "my-scheduler"


def test_the_hub_settings_reach_the_operator_as_the_variables_it_reads():
    """huggingFaceHub.endpoint and offline: the Hub's own variables, which operator/hub.py reads."""
    from neuronfleet.operator import hub

    default = operator_env(render({}))
    assert hub.ENDPOINT_ENV not in default and hub.OFFLINE_ENV not in default
    mirror = {"huggingFaceHub": {"endpoint": "https://hub.mirror.example", "offline": True}}
    env = operator_env(render(mirror))
    assert env[hub.ENDPOINT_ENV] == "https://hub.mirror.example" and env[hub.OFFLINE_ENV] == "1"


def test_the_autoscalers_interval_reaches_the_operator_as_the_setting_it_reads():
    from neuronfleet.operator import scaling

    def env(objects):
        (deployment,) = kinds(objects, "Deployment")
        return {
            e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        }

    assert scaling.tick_seconds(env(render({}))) == scaling.TICK_SECONDS
    assert scaling.tick_seconds(env(render({"autoscaler": {"intervalSeconds": 5}}))) == 5.0


def test_the_privileged_image_leave_reaches_the_operator_as_the_setting_it_reads():
    """security.allowPrivilegedImageOverride: off unless the administrator sets it (validation reads it)."""
    from neuronfleet.operator import validation

    assert not validation.allows_privileged_image(operator_env(render({})))
    allowed = operator_env(render({"security": {"allowPrivilegedImageOverride": True}}))
    assert validation.allows_privileged_image(allowed)


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"neuron": {"schedulerName": "My Scheduler"}}, "schedulerName"),
        ({"watch": {"mode": "everywhere"}}, "mode"),
        ({"watch": {"mode": "namespaces", "namespaces": []}}, "namespaces"),
        ({"watch": {"mode": "cluster", "namespaces": ["a"]}}, "namespaces"),
        ({"metrics": {"port": 70000}}, "port"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"leaderElection": {"leaseDurationSeconds": 0}}, "leaseDurationSeconds"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"serviceAccount": {"create": "yes"}}, "create"),
        ({"autoscaler": {"intervalSeconds": 0}}, "intervalSeconds"),
        ({"huggingFaceHub": {"endpoint": "hub.example"}}, "endpoint"),
        ({"networkPolicy": {"metricsFrom": [{"pods": {"matchLabels": {"a": "b"}}}]}}, "metricsFrom"),
        ({"networkPolicy": {"clientsFrom": {"ipBlock": {"cidr": "10.0.0.0/8"}}}}, "clientsFrom"),
        ({"rbac": {"podDeletionCost": "yes"}}, "podDeletionCost"),
        ({"security": {"allowPrivilegedImageOverride": "yes"}}, "allowPrivilegedImageOverride"),
        ({"neuron": {"deviceAllocation": "claims"}}, "deviceAllocation"),
        ({"neuron": {"lncNodeLabel": "not a label"}}, "lncNodeLabel"),
        # our images are the Dockerfile's targets: another key is refused, not ignored
        ({"runtimeImages": {"inf2": "registry.example.com/n:1"}}, "inf2"),
    ],
)
def test_values_that_break_the_schema_are_refused(values, complaint):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError) as e:
        chart.validate_schema(chart.merge_values(values))
    assert complaint in str(e.value)
    with pytest.raises(helm.HelmError):
        render(values)


def test_chart_version_crd_and_notes_follow_the_code():
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["appVersion"] == neuronfleet.__version__ == meta["version"]
    assert (CHART / "crds" / crd.CRD_FILE).read_text() == crd.render_crd(), (
        "charts/neuronfleet/crds/ differs from the generated CRD: run `neuronfleet crd`"
    )
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render({}, name="nf", namespace="ops")["neuronfleet/templates/NOTES.txt"]
    assert "kubectl -n ops rollout status deployment/nf-neuronfleet" in notes


def test_the_dockerfile_builds_three_pinned_non_root_targets_and_only_runtime_neuron_has_the_neuron_sdk():
    """The operator, our runtime on CPU (routers, instanceType cpu) and our runtime over TorchNeuron (engine
    embedded on trn2 and trn3), each from a pinned base, as a user other than root; only runtime-neuron
    installs the Neuron SDK, at the torch-neuronx version the runtime's NEFF key and the engine matrix name
    (pyproject.toml's `neuron` extra)."""
    text = (ROOT / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    targets = {}
    for stage in stages:
        head, _, body = stage.partition("\n")
        base, _, name = head.partition(" AS ")
        targets[name.strip()] = (base.strip(), body)
    assert set(targets) == {"sources", "operator", "runtime-cpu", "runtime-neuron"}
    for name, (base, body) in targets.items():
        if name == "sources":  # a build stage, never an image
            continue
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], resolved)
        image, _, tag = resolved.rpartition(":")
        assert image and tag and tag != "latest" and "/" not in tag, (name, resolved)
        users = re.findall(r"^USER (\S+)", body, re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), (name, users)
        assert "HEALTHCHECK" not in body
    for name in ("operator", "runtime-cpu"):  # (what it runs: the next stage's comments and ARGs aside)
        steps = [line for line in targets[name][1].splitlines() if not line.startswith(("#", "ARG"))]
        assert not re.search(r"neuronx|\[neuron\]|NEURON_", "\n".join(steps)), name
    assert "'.[neuron]'" in targets["runtime-neuron"][1]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"torch-neuronx=={TORCHNEURON_PINNED['torch-neuronx']}" in extras["neuron"]
    assert f"torch=={TORCHNEURON_PINNED['torch']}" in (ROOT / "constraints.txt").read_text().split()
    assert not re.search(r"(?i)(token|password|secret)\s*=", text)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "models", "tests"} <= set(ignored)


@pytest.mark.parametrize("values", [{}, {"wakePort": 9099}])
def test_the_wake_endpoint_is_served_and_reached_through_the_operators_service(values):
    """`--wake-port` on the operator, its port on the operator's Service, and NEURONFLEET_WAKE_URL (what the
    routers of a scale-to-zero model are given) naming that Service and port."""
    objects = render(values)
    (service,) = kinds(objects, "Service")
    (deployment,) = kinds(objects, "Deployment")
    port = values.get("wakePort", 8082)
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    assert f"--wake-port={port}" in c["args"]
    assert {"name": "wake", "containerPort": port, "protocol": "TCP"} in c["ports"]
    assert {"name": "wake", "port": port, "targetPort": "wake", "protocol": "TCP"} in service["spec"]["ports"]
    url = {e["name"]: e.get("value") for e in c["env"]}["NEURONFLEET_WAKE_URL"]
    meta = service["metadata"]
    assert url == f"http://{meta['name']}.{meta['namespace']}.svc:{port}"


def test_the_notes_warn_of_a_pod_monitor_whose_prometheus_the_network_policies_do_not_admit():
    def notes(values: dict) -> str:
        with helm.Chart.load(str(CHART)) as chart:
            return chart.render(values, name="nf", namespace="ops")["neuronfleet/templates/NOTES.txt"]

    scraping = {"podMonitor": {"enabled": True}}
    assert "networkPolicy.metricsFrom names no Prometheus" in notes(scraping)
    named = {**scraping, "networkPolicy": {"metricsFrom": [{"namespaceSelector": {}}]}}
    assert "metricsFrom" not in notes(named) and "metricsFrom" not in notes({})
