"""The chart's monitoring objects, rendered by Helm's engine (helm-python-sdk).

The Grafana dashboard ConfigMap (on by default, labelled for Grafana's sidecar, holding the dashboard file
charts/neuronfleet/dashboards/neuronfleet.json as it is) and the model pods' PodMonitor (off by default) are
present only when enabled; the ConfigMap is valid Kubernetes (kubernetes-validate, strict), the PodMonitor and
the operator's ServiceMonitor are valid against the Prometheus Operator's CRDs of a pinned release
(tests/data/prometheus-operator/; unknown fields refused as a strict API server refuses them); the dashboard
has a datasource variable, namespace and model variables, and every query is PromQL naming a metric. The
Neuron exporter's PodMonitor (off by default) selects the exporter where the Neuron SDK's DaemonSet runs it,
and every metric and label the dashboard's Neuron hardware panels query is in the exporter's record
(tests/data/neuron-monitor-sdk2.32.0-metrics.json), the labels they join on made by the two PodMonitors."""

from __future__ import annotations

import json
import re

import dashboard_queries
import helm_python as helm  # helm-python-sdk, installed by scripts/setup.sh
import kubernetes_validate
import pytest
import yaml
from support import ROOT

from neuronfleet.localcluster import semantics

CHART = ROOT / "charts" / "neuronfleet"
# Prometheus Operator v0.93.0's CRDs, as published (the source URL is in tests/data/README.md)
CRDS = ROOT / "tests" / "data" / "prometheus-operator"
KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]  # Chart.yaml's kubeVersion range, oldest and newest
NEURON_MONITOR = json.loads((ROOT / "tests" / "data" / "neuron-monitor-sdk2.32.0-metrics.json").read_text())


def render(values: dict, namespace: str = "monitoring") -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="nf", namespace=namespace, is_install=True)
    return [
        d for p, t in sorted(manifests.items()) if p.endswith(".yaml") for d in yaml.safe_load_all(t) if d
    ]


def kinds(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def crd_problems(obj: dict) -> list[str]:
    """What the pinned Prometheus Operator CRD of obj's kind refuses: unknown fields, then schema errors."""
    crd = yaml.safe_load((CRDS / f"monitoring.coreos.com_{obj['kind'].lower()}s.yaml").read_text())
    (version,) = [
        v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == obj["apiVersion"]
    ]
    schema = version["schema"]["openAPIV3Schema"]
    unknown: list[str] = []
    semantics.prune(obj, schema, "", unknown)
    return [f"unknown field {u}" for u in unknown] + semantics.schema_errors(obj, schema)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_dashboard_configmap_is_on_by_default_and_holds_the_dashboard_file(version):
    (config_map,) = kinds(render({}), "ConfigMap")
    kubernetes_validate.validate(config_map, version, strict=True)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["neuronfleet.json"]) == dashboard_queries.load()
    assert config_map["data"]["neuronfleet.json"] == dashboard_queries.DASHBOARD.read_text().rstrip("\n")


def test_the_dashboard_configmap_follows_its_values_and_is_absent_when_disabled():
    values = {
        "label": "example.com/dashboard",
        "labelValue": "neuron",
        "namespace": "grafana",
        "annotations": {"grafana_folder": "LLM"},
    }
    (config_map,) = kinds(render({"dashboards": values}), "ConfigMap")
    meta = config_map["metadata"]
    assert meta["labels"]["example.com/dashboard"] == "neuron" and "grafana_dashboard" not in meta["labels"]
    assert meta["namespace"] == "grafana" and meta["annotations"] == {"grafana_folder": "LLM"}
    kubernetes_validate.validate(config_map, KUBERNETES_VERSIONS[-1], strict=True)
    assert not kinds(render({"dashboards": {"enabled": False}}), "ConfigMap")


def test_the_pod_monitor_is_off_by_default_and_valid_against_the_prometheus_operator_crd_when_on():
    assert not kinds(render({}), "PodMonitor")
    objects = render({"podMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}}})
    (monitor,) = kinds(objects, "PodMonitor")
    assert crd_problems(monitor) == []
    spec = monitor["spec"]
    assert monitor["metadata"]["labels"]["release"] == "prom" and spec["namespaceSelector"] == {"any": True}
    roles = next(e for e in spec["selector"]["matchExpressions"] if e["key"] == "neuronfleet.dev/role")
    assert roles == {
        "key": "neuronfleet.dev/role",
        "operator": "In",
        "values": ["unified", "prefill", "decode", "router"],
    }
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "15s")
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_neuronfleet_dev_role"], "targetLabel": "role"} in (
        endpoint["relabelings"]
    )
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint[
        "relabelings"
    ]
    namespaced = {"podMonitor": {"enabled": True}, "watch": {"mode": "namespaces", "namespaces": ["a", "b"]}}
    (monitor,) = kinds(render(namespaced), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]} and crd_problems(monitor) == []


def test_the_crd_check_refuses_what_the_prometheus_operator_would():
    (monitor,) = kinds(render({"podMonitor": {"enabled": True}}), "PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["portName"] = "http"  # not a field (it is `port`)
    monitor["spec"]["podMetricsEndpoints"][0]["scheme"] = "tcp"  # http or https only
    problems = crd_problems(monitor)
    assert "unknown field .spec.podMetricsEndpoints[0].portName" in problems
    assert any(p.startswith("spec.podMetricsEndpoints.0.scheme") for p in problems), problems


def test_the_operator_service_monitor_keeps_its_series_namespace_label():
    (monitor,) = kinds(
        render({"metrics": {"port": 8080, "serviceMonitor": {"enabled": True}}}), "ServiceMonitor"
    )
    assert crd_problems(monitor) == []
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"dashboards": {"label": "not a label"}}, "label"),
        ({"dashboards": {"labelValue": "x" * 64}}, "labelValue"),
        ({"dashboards": {"namespace": "Grafana"}}, "namespace"),
        ({"dashboards": {"enable": True}}, "enable"),
        ({"podMonitor": {"interval": "soon"}}, "interval"),
        ({"podMonitor": {"enabled": "yes"}}, "enabled"),
        ({"neuronMonitor": {"port": "8000"}}, "port"),
        ({"neuronMonitor": {"port": 0}}, "port"),
        ({"neuronMonitor": {"matchLabels": {"app": "not a value"}}}, "matchLabels"),
        ({"neuronMonitor": {"namespace": "Neuron"}}, "namespace"),
        ({"neuronMonitor": {"selector": {"app": "x"}}}, "selector"),
    ],
)
def test_monitoring_values_that_break_the_schema_are_refused(values, complaint):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError) as e:
        chart.validate_schema(chart.merge_values(values))
    assert complaint in str(e.value)


def test_the_dashboard_has_its_variables_and_every_query_is_promql_naming_a_metric():
    dashboard = dashboard_queries.load()
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "neuronfleet"  # Grafana 11 and later
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    assert {"namespace", "model"} <= set(variables)
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
    named = {}
    for where, expr in dashboard_queries.queries(dashboard):
        named[where] = dashboard_queries.metric_names(expr)  # raises on a query that is not PromQL
        assert named[where], f"{where} names no metric: {expr}"
    rows = dashboard_queries.rows(dashboard)
    assert list(rows) == ["Models", dashboard_queries.NEURON_ROW, "Operator"]
    model_panels = rows["Models"] + rows[dashboard_queries.NEURON_ROW]
    assert len(rows["Models"]) >= 10
    for panel in model_panels:  # each model panel honours the namespace and model variables
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], target["expr"]
            assert re.search(r'model(_name)?=~"\$model"', target["expr"]), target["expr"]
    with pytest.raises(ValueError, match="unclosed"):
        dashboard_queries.metric_names("sum(rate(x[5m])")


def test_the_neuron_monitor_pod_monitor_is_off_by_default_and_selects_the_sdk_daemonset_when_on():
    assert not kinds(render({}), "PodMonitor")
    objects = render({"neuronMonitor": {"enabled": True, "labels": {"release": "prom"}}})
    (monitor,) = kinds(objects, "PodMonitor")
    assert crd_problems(monitor) == []
    assert monitor["metadata"]["name"].endswith("-neuron-monitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    daemonset = NEURON_MONITOR["deployment"]["sdk_daemonset"]  # what the defaults select
    assert monitor["spec"]["selector"] == {"matchLabels": daemonset["matchLabels"]}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [daemonset["namespace"]]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["portNumber"], endpoint["path"]) == (daemonset["port"], daemonset["path"])
    assert endpoint["interval"] == "30s"
    assert "port" not in endpoint  # the SDK's DaemonSet names no port
    # an exporter run elsewhere: its namespace, its labels, a named port
    elsewhere = {
        "enabled": True,
        "namespace": "kube-system",
        "matchLabels": {"app.kubernetes.io/name": "neuron-helm-chart-exporter"},
        "port": "neuron-monitor",
    }
    (monitor,) = kinds(render({"neuronMonitor": elsewhere}), "PodMonitor")
    assert crd_problems(monitor) == []
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kube-system"]}
    assert monitor["spec"]["selector"] == {"matchLabels": elsewhere["matchLabels"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "neuron-monitor" and "portNumber" not in endpoint
    both = render({"neuronMonitor": {"enabled": True}, "podMonitor": {"enabled": True}})
    assert len(kinds(both, "PodMonitor")) == 2


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str]:
    """Prometheus' `replace` relabeling (its default action), as the Prometheus Operator passes a monitor's
    relabelings on: the source labels' values joined by `;`, the regex anchored at both ends, the target label
    set to the replacement with its $N groups (default $1) where the regex matches, removed where that is
    empty; nothing where it does not match."""
    out = dict(labels)
    for rule in rules:
        assert rule.get("action", "replace") == "replace", rule
        value = ";".join(out.get(name, "") for name in rule["sourceLabels"])
        if match := re.fullmatch(rule.get("regex", "(.*)"), value):
            result = re.sub(r"\$(\d+)", lambda g: match.group(int(g.group(1))), rule.get("replacement", "$1"))
            if result:
                out[rule["targetLabel"]] = result
            else:
                out.pop(rule["targetLabel"], None)
    return out


def scraped(sample: dict[str, str], target: dict[str, str]) -> dict[str, str]:
    """A scraped sample's labels with its target's attached, honorLabels off: a sample label the target also
    has is kept as exported_<name> (Prometheus' scrape_config honor_labels)."""
    out = {(f"exported_{k}" if k in target else k): v for k, v in sample.items()}
    return {**out, **target}


def test_the_labels_the_neuron_panels_join_on_are_made_by_the_two_pod_monitors():
    objects = render({"neuronMonitor": {"enabled": True}, "podMonitor": {"enabled": True}})
    monitors = {m["metadata"]["name"].rsplit("-", 1)[-1]: m for m in kinds(objects, "PodMonitor")}
    (model_endpoint,) = monitors["models"]["spec"]["podMetricsEndpoints"]
    (neuron_endpoint,) = monitors["monitor"]["spec"]["podMetricsEndpoints"]
    node_meta = {"__meta_kubernetes_pod_node_name": "ip-10-0-0-7"}
    # a model pod's target (its `up` series): namespace and pod from the Prometheus Operator, node and model
    # from our relabelings
    model_pod = relabel(
        {
            **node_meta,
            "__meta_kubernetes_pod_label_neuronfleet_dev_model": "llama",
            "__meta_kubernetes_pod_label_neuronfleet_dev_role": "unified",
        },
        model_endpoint["relabelings"],
    )
    model_pod |= {"namespace": "models", "pod": "llama-unified-0"}
    assert set(NEURON_MONITOR["model_pod_labels"]) - {"about"} <= set(model_pod)
    # the exporter pod's target: the exporter's own namespace and pod, and the node it runs on
    exporter_target = relabel(node_meta, neuron_endpoint["relabelings"])
    exporter_target |= {"namespace": "neuron-monitor", "pod": "neuron-monitor-x7k2p"}
    assert exporter_target["node"] == model_pod["node"]  # the join by node
    # a core the exporter's k8s info names a pod for: pod and namespace become that pod's (the join by pod)
    core = {
        "neuroncore": "3",
        "pod_name": "llama-unified-0",
        "namespace": "models",
        "container_name": "engine",
    }
    series = relabel(scraped(core, exporter_target), neuron_endpoint["metricRelabelings"])
    assert (series["namespace"], series["pod"], series["node"]) == (
        "models",
        "llama-unified-0",
        "ip-10-0-0-7",
    )
    # without k8s info: the exporter's pod and namespace stay, the node joins
    series = relabel(scraped({"neuroncore": "3"}, exporter_target), neuron_endpoint["metricRelabelings"])
    assert (series["namespace"], series["pod"], series["node"]) == (
        "neuron-monitor",
        "neuron-monitor-x7k2p",
        "ip-10-0-0-7",
    )
    made = {r["targetLabel"] for r in neuron_endpoint["relabelings"] + neuron_endpoint["metricRelabelings"]}
    assert set(NEURON_MONITOR["scrape_labels"]) - {"about"} == made


def test_every_metric_and_label_the_neuron_panels_query_is_in_the_exporter_record():
    dashboard = dashboard_queries.load()
    metrics = NEURON_MONITOR["metrics"]
    scrape_labels = set(NEURON_MONITOR["scrape_labels"]) - {"about"}
    model_pod_labels = set(NEURON_MONITOR["model_pod_labels"]) - {"about"}
    for name, metric in metrics.items():  # each name and label recorded with where it was read
        assert metric["type"] in {"gauge", "counter"} and metric["sources"], name
        assert all(metric["labels"].values()), name
    panels = dashboard_queries.rows(dashboard)[dashboard_queries.NEURON_ROW]
    assert [p["title"] for p in panels] == [
        "NeuronCore utilization",
        "Device memory (HBM) in use",
        "Neuron errors",
    ]
    used: set[str] = set()
    for panel in panels:
        for target in panel["targets"]:
            expr = dashboard_queries.promql(target["expr"])
            allowed = set()
            for name, labels in dashboard_queries.selectors(expr):
                if name == "up":  # the model's pods, as the chart's PodMonitor labels their targets
                    assert labels == {"namespace", "neuronmodel"}, expr
                    assert 'namespace=~"$namespace"' in expr and 'neuronmodel=~"$model"' in expr
                    allowed |= model_pod_labels
                    continue
                assert name in metrics, f"{panel['title']}: {name} is not in the exporter's record"
                known = set(metrics[name]["labels"]) | scrape_labels
                assert labels <= known, f"{panel['title']}: {name} selects by {sorted(labels - known)}"
                allowed |= known
                used.add(name)
            grouping = dashboard_queries.grouping_labels(expr)
            assert grouping <= allowed, f"{panel['title']}: groups by {sorted(grouping - allowed)}: {expr}"
            legend = set(re.findall(r"{{(\w+)}}", target["legendFormat"]))
            assert legend <= grouping, f"{panel['title']}: legend names {sorted(legend - grouping)}"
    assert used == set(metrics)  # the record holds what the panels read, no more
    # each panel joins by pod where the exporter names pods, or by node only
    for panel in panels:
        joins = [
            dashboard_queries.grouping_labels(dashboard_queries.promql(t["expr"])) for t in panel["targets"]
        ]
        assert all({"node"} <= j or {"namespace", "pod"} <= j for j in joins), panel["title"]
