"""The chart's Grafana dashboard as the tests read it: its PromQL queries (panels and variables), the metric
names each names (parsed by promql-parser, Prometheus' grammar), and the sample names a /metrics text can
carry (a histogram's _bucket, _sum and _count, a counter's _total), so that a test can check the one against
the other; and, for the Neuron hardware row, whose metrics are the Neuron exporter's, the labels each selector
and each grouping names, to check against the exporter's record."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import promql_parser
from prometheus_client.parser import text_string_to_metric_families
from support import ROOT

DASHBOARD = ROOT / "charts" / "neuronfleet" / "dashboards" / "neuronfleet.json"
# Grafana's built-in interval variables, as Grafana replaces them before the query reaches Prometheus
GRAFANA_INTERVALS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\)$")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


# the row whose panels read the Neuron exporter (neuron-monitor-prometheus.py), not neuronfleet's own metrics
NEURON_ROW = "Neuron hardware"


def rows(dashboard: dict) -> dict[str, list[dict]]:
    """Each row's title -> the panels under it, in the dashboard's order."""
    out: dict[str, list[dict]] = {}
    current: list[dict] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            current = out.setdefault(panel["title"], [])
        else:
            current.append(panel)
    return out


def queries(dashboard: dict, without_rows: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (label_values(SELECTOR, LABEL): its
    selector), Grafana's interval variables replaced as Grafana does; the panels of `without_rows` left
    out."""
    skipped = {id(p) for title in without_rows for p in rows(dashboard)[title]}
    for panel in dashboard["panels"]:
        if id(panel) in skipped:
            continue
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", promql(target["expr"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            match = LABEL_VALUES.match(text)
            assert match, f"variable {var['name']}: {text!r} is not label_values(SELECTOR, LABEL)"
            yield f"variable {var['name']}", promql(match["selector"])


def promql(expr: str) -> str:
    for name, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    return expr


def metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (a selector's name or its __name__ matcher)."""
    names: set[str] = set()
    for node in _nodes(promql_parser.parse(expr)):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    assert m.value and "=~" not in str(m.op), f"a __name__ matcher that is not exact: {m}"
                    names.add(m.value)
    return names


def selectors(expr: str) -> list[tuple[str, frozenset[str]]]:
    """Each vector selector of a PromQL expression: its metric name and the labels its matchers name."""
    return [
        (node.name, frozenset(m.name for m in node.matchers.matchers if m.name != "__name__"))
        for node in _nodes(promql_parser.parse(expr))
        if isinstance(node, promql_parser.VectorSelector)
    ]


def grouping_labels(expr: str) -> set[str]:
    """The labels an expression groups or matches by: aggregations' by/without, binary operators'
    on/ignoring and group_left/group_right."""
    out: set[str] = set()
    for node in _nodes(promql_parser.parse(expr)):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            out |= set(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                out |= set(node.modifier.matching.labels)
            out |= set(node.modifier.group_labels or ())
    return out


def _nodes(node) -> Iterator[object]:
    """Every node of a parsed PromQL expression, depth first."""
    yield node
    if isinstance(node, promql_parser.MatrixSelector):
        yield from _nodes(node.vector_selector)
    elif isinstance(node, promql_parser.BinaryExpr):
        yield from _nodes(node.lhs)
        yield from _nodes(node.rhs)
    elif isinstance(node, promql_parser.Call):
        for arg in node.args:
            yield from _nodes(arg)
    elif isinstance(node, promql_parser.AggregateExpr):
        yield from _nodes(node.expr)
        if node.param is not None:
            yield from _nodes(node.param)
    elif isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        yield from _nodes(node.expr)
    else:
        assert isinstance(
            node, (promql_parser.VectorSelector, promql_parser.NumberLiteral, promql_parser.StringLiteral)
        ), f"a PromQL node this walk does not know: {type(node).__name__}"


# the sample names each metric type exposes (the Prometheus text format; prometheus_client's _created too)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported(text: str) -> dict[str, bool]:
    """The sample names a /metrics text declares (by its families' TYPE), each with whether it has a
    sample yet (a labelled metric none of whose label sets occurred has none)."""
    out: dict[str, bool] = {}
    for family in text_string_to_metric_families(text):
        present = {s.name for s in family.samples}
        for suffix in SUFFIXES.get(family.type, ("",)):
            out[family.name + suffix] = family.name + suffix in present
    return out
