"""Autoscaling reads each engine's own metrics (each engine module's METRICS, with its sources): the builtin
autoscaler's scrape of an SGLang or TGI pod gives the same load as our runtime's names would, an HPA or a
KEDA ScaledObject names the engine's metric, and a signal an engine does not export is refused at validation,
saying what would work."""

from __future__ import annotations

import re

import pytest
import yaml
from support import ROOT

from neuronfleet.operator import pod_metrics, scaling, validation
from neuronfleet.operator.engines import metric_names, sglang, tgi

# /metrics bodies in the engines' exposition (names as their pinned sources register them; values made up)
SGLANG_BODY = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",engine_type="unified"} 6.0
sglang:num_queue_reqs{model_name="m",engine_type="unified"} 3.0
sglang:token_usage{model_name="m",engine_type="unified"} 0.5
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 10.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
sglang:time_to_first_token_seconds_count{model_name="m"} 10.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 99.0
"""
TGI_BODY = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 2
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 4
tgi_request_duration_bucket{le="1.0"} 5
"""


def obj(name: str, autoscaling: dict, **serving) -> dict:
    o = yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())
    o["spec"]["autoscaling"] = {"enabled": True, **autoscaling}
    o["spec"]["serving"].update(serving)
    return o


def spec_of(o: dict):
    spec, errors = validation.parse(o)
    assert not errors, errors
    return spec


def test_an_sglang_pods_metrics_read_as_the_same_load():
    spec = spec_of(obj("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {}))
    scrape = pod_metrics.read(SGLANG_BODY, "m", metric_names(spec, "decode"))
    assert scrape.gauges[pod_metrics.WAITING] == 3.0  # not the 99 of a name SGLang does not use for it
    assert scrape.gauges[pod_metrics.RUNNING] == 6.0 and scrape.gauges[pod_metrics.KV_USAGE] == 0.5
    load = pod_metrics.load(scrape, None, slots=8)
    assert (load.waiting, load.running, load.occupancy) == (3.0, 6.0, 9 / 8)
    assert load.ttft_p90 == pytest.approx(0.1 + 0.9 * (9 - 2) / 8)  # Prometheus' histogram_quantile
    assert metric_names(spec, "router") is pod_metrics.NEURONFLEET  # the router is ours


def test_a_tgi_pods_metrics_read_as_queue_and_occupancy():
    spec = spec_of(obj("llama-3.2-3b-tgi-inf2.yaml", {"metric": "queue"}))
    load = pod_metrics.load(pod_metrics.read(TGI_BODY, "m", metric_names(spec, "unified")), None, slots=4)
    assert (load.waiting, load.running, load.occupancy, load.ttft_p90) == (2.0, 4.0, 1.5, None)


@pytest.mark.parametrize(
    ("name", "autoscaling", "message"),
    [
        ("llama-3.2-3b-tgi-inf2.yaml", {"metric": "ttft", "ttftSLOMilliseconds": 500},
         r"autoscaling.metric ttft: engine tgi's unified pods export no time-to-first-token histogram for "
         r"provider builtin to read; use metric queue or occupancy"),
        ("llama-3.2-3b-tgi-inf2.yaml", {"provider": "keda", "prometheusAddress": "http://p:9090"},
         r"autoscaling.metric occupancy: engine tgi's unified pods export no KV-cache-use metric for "
         r"provider keda to read; use metric queue"),
    ],
)  # fmt: skip
def test_a_signal_the_engine_does_not_export_is_refused_saying_what_works(name, autoscaling, message):
    report = validation.check(obj(name, autoscaling))
    assert any(re.search(message, e) for e in report.errors), report.errors


@pytest.mark.parametrize("metric", ["queue", "occupancy"])
def test_tgi_scales_on_what_it_exports(metric):
    assert validation.check(obj("llama-3.2-3b-tgi-inf2.yaml", {"metric": metric})).ok


def test_hpa_and_keda_name_the_engines_own_metrics():
    unified = {
        "unified": {"replicas": 1},
        "mode": "unified",
        "prefill": None,
        "decode": None,
        "kvTransfer": None,
    }
    o = obj("gpt-oss-120b-sglang-trn3-disaggregated.yaml", {"provider": "hpa", "metric": "queue"}, **unified)
    o["spec"]["replicas"] = 1
    o["spec"]["serving"] = {k: v for k, v in o["spec"]["serving"].items() if v is not None}
    spec = spec_of(o)
    assert validation.validate(spec).ok, validation.validate(spec).errors
    hpa = scaling.build_hpa(spec, {"name": "m", "namespace": "ns"})
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == sglang.METRICS.waiting
    o["spec"]["autoscaling"] = {"enabled": True, "provider": "keda", "prometheusAddress": "http://p:9090",
                                "metric": "ttft", "ttftSLOMilliseconds": 800}  # fmt: skip
    (trigger,) = scaling.keda_triggers(spec_of(o), "ns", "m")
    assert f"rate({sglang.METRICS.ttft}_bucket{{" in trigger["metadata"]["query"]
    tgi_spec = spec_of(obj("llama-3.2-3b-tgi-inf2.yaml", {"provider": "keda", "metric": "queue",
                                                          "prometheusAddress": "http://p:9090"}))  # fmt: skip
    (trigger,) = scaling.keda_triggers(tgi_spec, "ns", "m")
    assert trigger["metadata"]["query"].startswith(f"sum({tgi.METRICS.waiting}{{")


def test_the_builtin_policy_reads_each_roles_pods_by_their_engines_names():
    spec = spec_of(obj("llama-3.3-70b-vllm-trn2-disaggregated.yaml", {}))
    policy = scaling.policy(spec)
    assert set(policy.metrics) == {"prefill", "decode"}
    assert all(names.waiting == "vllm:num_requests_waiting" for names in policy.metrics.values())
