"""What each engine step did (`StepReport`) and the Prometheus metrics made from it (pure; no torch), and
the static facts an inference gateway's endpoint picker reads beside the load gauges (`protocol_info`).

The local engine registers `StepMetrics` in the server's registry (`AsyncEngine.register_metrics`) and calls
it on the engine thread after every step.

The model-server protocol (docs/gateway.md): the Gateway API Inference Extension's endpoint picker (v1.5.0,
pkg/epp/server/options.go and pkg/epp/backend/metrics/metrics.go; the list is tests/data/
gie-v1.5.0-epp-scraped-metrics.yaml) reads the gauges vllm:num_requests_waiting, vllm:num_requests_running and
vllm:kv_cache_usage_perc (`AsyncEngine.load_gauges`), and the families vllm:lora_requests_info and
vllm:cache_config_info (here); a family it misses is an error at every scrape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# tokens per KV block as the picker's prefix-cache scorer counts them: a slot holds one sequence's KV cache
# contiguously and reuses any prompt prefix found in it, token by token, so any block size describes it;
# vLLM's default (16) keeps the scorer's hashing as fine as it is for vLLM pods
KV_BLOCK_TOKENS = 16
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

    def __init__(self, registry: CollectorRegistry, model_name: str, slots: int, max_seq_len: int) -> None:
        protocol_info(registry, model_name, slots, max_seq_len)
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


def protocol_info(registry: CollectorRegistry, model_name: str, slots: int, max_seq_len: int) -> None:
    """vllm:cache_config_info (labels block_size and num_gpu_blocks: the KV cache, slots x max_seq_len
    tokens, in KV_BLOCK_TOKENS blocks, so kv_cache_usage_perc is the share of those in use) and
    vllm:lora_requests_info (no adapters: max_lora 0, none running or waiting; its value the time the server
    started, as vLLM's is the time of its last change), both gauges as vLLM exports them."""
    blocks = slots * max_seq_len // KV_BLOCK_TOKENS
    labels = {"model_name": model_name, "block_size": str(KV_BLOCK_TOKENS), "num_gpu_blocks": str(blocks)}
    Gauge("vllm:cache_config_info", "Information of the KV cache config.", list(labels), registry=registry)\
        .labels(**labels).set(1)  # fmt: skip
    Gauge(
        "vllm:lora_requests_info", "Running stats on LoRA requests.",
        ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=registry,
    ).labels(max_lora="0", running_lora_adapters="", waiting_lora_adapters="").set(time.time())  # fmt: skip
