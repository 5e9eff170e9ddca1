"""The chart's monitoring objects, rendered by Helm's engine (helm-python-sdk).

The Grafana dashboard ConfigMap (on by default, labelled for Grafana's sidecar, holding the dashboard file
charts/neuronfleet/dashboards/neuronfleet.json as it is) and the model pods' PodMonitor (off by default) are
present only when enabled; the ConfigMap is valid Kubernetes (kubernetes-validate, strict), the PodMonitor and
the operator's ServiceMonitor are valid against the Prometheus Operator's CRDs of a pinned release
(tests/data/prometheus-operator/; unknown fields refused as a strict API server refuses them); the dashboard
has a datasource variable, namespace and model variables, and every query is PromQL naming a metric."""

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
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Models", "Operator"]
    first_operator = next(i for i, p in enumerate(dashboard["panels"]) if p["title"] == "Operator")
    model_panels = dashboard["panels"][1:first_operator]
    assert len(model_panels) >= 10
    for panel in model_panels:  # each model panel honours the namespace and model variables
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], target["expr"]
            assert re.search(r'model(_name)?=~"\$model"', target["expr"]), target["expr"]
    with pytest.raises(ValueError, match="unclosed"):
        dashboard_queries.metric_names("sum(rate(x[5m])")
