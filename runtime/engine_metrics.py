"""What each engine step did (`StepReport`) and the Prometheus metrics made from it (pure; no torch).

The local engine registers `StepMetrics` in the server's registry (`AsyncEngine.register_metrics`) and calls
it on the engine thread after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # seconds


@dataclass(frozen=True)
class StepReport:
    """What one engine step did, for observers such as the step metrics (called on the engine thread)."""

    prefill_requests: int  # requests admitted (prefilled) in this step
    decode_requests: int  # requests that decoded one token
    seconds: float  # the whole step
    queue_seconds: list[float] = field(default_factory=list)  # arrival to admission, per admitted request
    prompt_tokens: int = 0  # of the admitted requests
    reused_prompt_tokens: int = 0  # of those, found in their slots' caches and not prefilled again


class StepMetrics:
    """Queue time, prefix cache use, batch occupancy and step time (vLLM's names where it has them)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, slots: int) -> None:
        labels = {"model_name": model_name}
        names = list(labels)
        self.labels, self.slots = labels, slots
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens of admitted requests, looked up in the slots' caches.",
            names,
            registry=registry,
        ).labels(**labels)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in a slot's cache (a reused prefix), not prefilled.",
            names,
            registry=registry,
        ).labels(**labels)
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time from arrival to a slot.", names, buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(**labels)  # fmt: skip
        self.occupancy = Histogram(
            "neuronfleet:batch_occupancy",
            "Share of the static batch's slots that ran in a step.",
            names,
            buckets=(0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0),
            registry=registry,
        ).labels(**labels)
        self.step_time = Histogram(
            "neuronfleet:step_duration_seconds",
            "Engine step time; kind=prefill for steps that admitted requests (their decode rows ride along), "
            "kind=decode for decode-only steps.",
            [*names, "kind"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, report: StepReport) -> None:
        for seconds in report.queue_seconds:
            self.queue_time.observe(seconds)
        self.prefix_queries.inc(report.prompt_tokens)
        self.prefix_hits.inc(report.reused_prompt_tokens)
        self.occupancy.observe((report.prefill_requests + report.decode_requests) / self.slots)
        kind = "prefill" if report.prefill_requests else "decode"
        self.step_time.labels(**self.labels, kind=kind).observe(report.seconds)
