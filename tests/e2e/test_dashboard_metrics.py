"""The chart's Grafana dashboard against what neuronfleet really exports: in local mode (`neuronfleet up`:
the real operator, kubelet, runtime and model), the disaggregated sample compiles, serves a few chat requests
through its P/D router, and then its prefill, decode and router pods' /metrics and the operator's /metrics
are scraped; every metric name any dashboard query names (parsed as PromQL; histogram and counter suffixes
resolved by the metric's declared type) must be declared by one of them, and the series the model panels
plot after such traffic must have samples. The Neuron hardware row reads the Neuron exporter, which local mode
does not run: its names are held against the exporter's record (tests/unit/test_chart_monitoring.py)."""

from __future__ import annotations

import json
import time
import urllib.request

import dashboard_queries
import pytest
from support import HTTP_TIMEOUT, ROOT, LocalCluster, chat, local_mode, metrics_text

DISAGGREGATED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
MODEL = "smollm2-pd"
# series that the traffic below must have produced (names only a declared family would hide)
MUST_HAVE_SAMPLES = (
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "neuronfleet:kv_transfer_seconds_count",
    "neuronfleet:router_requests_held",
    "neuronfleet:slots_busy",
    "vllm:prefix_cache_queries_total",
    "neuronfleet_operator_model_replicas",
    "neuronfleet_operator_compile_seconds_count",
    "neuronfleet_operator_compiles_total",
    "neuronfleet_operator_reconciles_total",
)

pytestmark = pytest.mark.real_model


def pod_urls(local: LocalCluster) -> dict[str, str]:
    """role -> base URL of the model's pod of that role (its `http` port, from the EndpointSlices)."""
    roles = {
        p["metadata"]["name"]: p["metadata"]["labels"]["neuronfleet.dev/role"]
        for p in local.get("pods", "-l", f"neuronfleet.dev/model={MODEL}")["items"]
    }
    out = {}
    for s in local.get("endpointslices")["items"]:
        port = next((p["port"] for p in s.get("ports") or [] if p.get("name") == "http"), None)
        for e in s.get("endpoints") or []:
            pod = (e.get("targetRef") or {}).get("name")
            if port and pod in roles:
                out[roles[pod]] = f"http://{e['addresses'][0]}:{port}"
    return out


def test_every_metric_the_dashboard_names_is_exported_by_a_live_server_router_and_operator(tmp_path):
    with local_mode(tmp_path / "state") as local:
        local.kubectl("apply", "-f", str(DISAGGREGATED))
        local.wait("Ready", lambda: (local.get("nm", MODEL).get("status") or {}).get("phase") == "Ready")
        endpoint = local.get("nm", MODEL)["status"]["endpoint"]
        for _ in range(3):  # the same prompt again: its prefix is found in a slot's cache
            status, text = chat(endpoint, MODEL, tokens=8)
            assert status == 200, text
        urls = local.wait(
            "the prefill, decode and router pods' addresses",
            lambda: (u := pod_urls(local)) and set(u) == {"prefill", "decode", "router"} and u,
        )
        operator = (local.state / "operator-metrics-url").read_text().strip()
        # the operator's status of the model (replicas) is written on a pass after Ready: wait for the series
        local.wait(
            "the operator's replicas series",
            lambda: (
                "neuronfleet_operator_model_replicas{"
                in urllib.request.urlopen(operator, timeout=HTTP_TIMEOUT).read().decode()
            ),
        )
        scraped = {role: metrics_text(url) for role, url in urls.items()}
        scraped["operator"] = urllib.request.urlopen(operator, timeout=HTTP_TIMEOUT).read().decode()
    declared: dict[str, set[str]] = {}  # sample name -> who declares it
    sampled: set[str] = set()
    for who, text in scraped.items():
        for name, has_sample in dashboard_queries.exported(text).items():
            declared.setdefault(name, set()).add(who)
            if has_sample:
                sampled.add(name)
    dashboard = dashboard_queries.load()
    missing = {}
    named: set[str] = set()
    ours = list(dashboard_queries.queries(dashboard, without_rows=(dashboard_queries.NEURON_ROW,)))
    for where, expr in ours:
        names = dashboard_queries.metric_names(expr)
        named |= names
        if absent := sorted(names - set(declared)):
            missing[where] = absent
    assert not missing, f"dashboard queries name metrics nobody exports: {json.dumps(missing, indent=1)}"
    assert set(MUST_HAVE_SAMPLES) <= named  # (the list is about this dashboard)
    without = [n for n in MUST_HAVE_SAMPLES if n not in sampled]
    assert not without, f"no samples after the traffic: {without}"
    # the metrics come from where the panels expect them: TTFT from the router, handoffs from the decode pod
    assert "router" in declared["vllm:time_to_first_token_seconds_bucket"]
    assert "decode" in declared["neuronfleet:kv_transfer_seconds_count"]
    assert declared["neuronfleet_operator_compile_seconds_count"] == {"operator"}
    print(
        f"{len(named)} metric names in {len(ours)} queries "
        f"(the {dashboard_queries.NEURON_ROW} row's left out); "
        f"declared by {sorted(scraped)}; {time.strftime('%X')}"
    )
