"""The operator's metrics the dashboard reads that are made from a pass's results: replicas per model and
role (from status.replicas, removed with the model) and compile Jobs (cache hit or miss, duration from the
Job's startTime and completionTime), read back from the exposition text Prometheus scrapes."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from neuronfleet.operator import metrics


def samples(name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def replicas(model: str) -> dict[tuple[str, str], float]:
    return {
        (d["role"], d["state"]): v
        for k, v in samples("neuronfleet_operator_model_replicas").items()
        if (d := dict(k))["model"] == model and d["namespace"] == "team-a"
    }


def test_replicas_follow_the_status_and_go_with_the_model():
    status = {"prefill": {"desired": 1, "ready": 0, "reached": 0}, "decode": {"desired": 2, "ready": 2}}
    metrics.model_replicas("team-a", "m1", status)
    assert replicas("m1") == {("prefill", "desired"): 1, ("prefill", "ready"): 0, ("decode", "desired"): 2,
                              ("decode", "ready"): 2}  # fmt: skip
    metrics.model_replicas("team-a", "m1", {"decode": {"desired": 3, "ready": 2}})  # prefill gone
    assert replicas("m1") == {("decode", "desired"): 3, ("decode", "ready"): 2}
    metrics.model_replicas("team-a", "m1", None)
    assert replicas("m1") == {}


def test_compiles_count_cache_hits_and_misses_and_their_job_durations():
    def value(name: str, cache: str) -> float:
        return samples(name).get((("cache", cache),), 0.0)

    before = {(n, c): value(n, c) for n in ("neuronfleet_operator_compiles_total",
              "neuronfleet_operator_compile_seconds_sum", "neuronfleet_operator_compile_seconds_count")
              for c in ("hit", "miss")}  # fmt: skip
    job = {"status": {"startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:25:30Z"}}
    metrics.compile_succeeded(job, {"bytes": 1, "cacheHit": False})
    metrics.compile_succeeded({"status": {}}, {"cacheHit": True})  # no times: counted, no duration
    metrics.compile_succeeded({"status": {"startTime": "yesterday", "completionTime": 3}}, None)  # unreadable
    after = {k: value(*k) - v for k, v in before.items()}
    assert after == {
        ("neuronfleet_operator_compiles_total", "miss"): 2, ("neuronfleet_operator_compiles_total", "hit"): 1,
        ("neuronfleet_operator_compile_seconds_sum", "miss"): 1530.0,
        ("neuronfleet_operator_compile_seconds_count", "miss"): 1,
        ("neuronfleet_operator_compile_seconds_sum", "hit"): 0,
        ("neuronfleet_operator_compile_seconds_count", "hit"): 0,
    }  # fmt: skip


def test_every_outcome_the_dashboard_plots_has_a_series_before_it_happens():
    """A series that appears only on its first event reads "no data" on a dashboard, not 0."""
    for name, label, values in (
        ("neuronfleet_operator_reconciles_total", "outcome", ("ok", "error")),
        ("neuronfleet_operator_autoscaler_scrapes_total", "outcome", ("ok", "failed")),
        ("neuronfleet_operator_compiles_total", "cache", ("hit", "miss")),
        ("neuronfleet_operator_compile_seconds_count", "cache", ("hit", "miss")),
    ):
        assert {dict(k)[label] for k in samples(name)} >= set(values), name
