"""One serving pod's `/metrics` (Prometheus text exposition) read into the load signals the autoscaler
decides on: waiting and running requests, slot occupancy, KV cache use, the role's own queue, requests held
at the router, and time-to-first-token and inter-token-latency p90 over the window between two scrapes.

Pure: text in, numbers out; no HTTP and no Prometheus client (the operator image keeps the pure layer free of
it). The names are the ones our runtime exports (runtime/engine/engine.py's load gauges,
runtime/serving/server.py's histograms, runtime/kv/roles.py's role queue; the router's held requests are issue
16 item 3's gauge); tests/unit/test_autoscaler.py checks them against a real runtime registry.

The format is Prometheus' text-based exposition format 0.0.4
(https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format): one sample per line,
`name{label="value",...} value [timestamp]`, `#` lines are comments (HELP, TYPE), label values escape `\\`,
`\"` and `\n`, and a histogram is its cumulative `_bucket{le=...}` series plus `_count` and `_sum`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# the runtime's names (see the module docstring for where each is registered)
WAITING = "vllm:num_requests_waiting"  # engine: requests waiting for a slot
RUNNING = "vllm:num_requests_running"  # engine: requests in slots; router: routed and not finished
KV_USAGE = "vllm:kv_cache_usage_perc"  # engine: share of KV cache tokens in use (1 = full)
SLOTS_BUSY = "neuronfleet:slots_busy"  # engine: slots holding a request
ROLE_QUEUE = "neuronfleet:role_queue_requests"  # prefill: being prefilled; decode: waiting for their KV
HELD = "neuronfleet:router_requests_held"  # router at zero replicas: requests held at the front door
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"

GAUGES = (WAITING, RUNNING, KV_USAGE, SLOTS_BUSY, ROLE_QUEUE, HELD)
HISTOGRAMS = (TTFT, ITL)


@dataclass(frozen=True)
class Names:
    """An engine's own names for the signals (None: it exports no such metric), read into ours. Each
    engine's module says its names and their source for its pinned version."""

    waiting: str | None  # gauge: requests waiting for a slot
    running: str | None  # gauge: requests in slots
    kv_usage: str | None  # gauge, 0-1: KV cache in use
    ttft: str | None  # histogram, seconds: time to first token

    def renames(self) -> dict[str, str]:
        """engine name -> ours, for the names that differ."""
        ours = _OURS
        return {
            theirs: ours[k] for k, theirs in vars(self).items() if theirs is not None and theirs != ours[k]
        }

    def unused(self) -> set[str]:
        """Our names of the signals this engine names otherwise or not at all (a sample so named is not
        it)."""
        return {_OURS[k] for k, theirs in vars(self).items() if theirs != _OURS[k]}


_OURS = {"waiting": WAITING, "running": RUNNING, "kv_usage": KV_USAGE, "ttft": TTFT}


# Our runtime's (the embedded engine and every router): vLLM's names for the common four, and our own
NEURONFLEET = Names(WAITING, RUNNING, KV_USAGE, TTFT)

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LINE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
_LABEL = re.compile(rf'\s*({_NAME})\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsError(ValueError):
    """A /metrics body that is not Prometheus text exposition; says the line and what was expected."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """Every sample of a text exposition body, in order; comments and blank lines skipped."""
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise MetricsError(
                f"/metrics line {number} is not a sample: {line[:120]!r}; expected "
                '`name{label="value",...} value [timestamp]` (Prometheus text format 0.0.4)'
            )
        name, body, value, _timestamp = match.groups()
        samples.append(Sample(name, _labels(body or "", number), _float(value, number)))
    return samples


def _labels(body: str, number: int) -> dict[str, str]:
    labels, at = {}, 0
    while at < len(body.rstrip()):
        match = _LABEL.match(body, at)
        if match is None:
            raise MetricsError(
                f'/metrics line {number}: bad label set {{{body[:120]}}}; expected name="value" pairs'
            )
        labels[match.group(1)] = re.sub(
            r"\\.", lambda m: _UNESCAPE.get(m.group(0), m.group(0)), match.group(2)
        )
        at = match.end()
    return labels


def _float(text: str, number: int) -> float:
    try:
        return float(text)  # also "+Inf", "-Inf", "NaN", as the format writes them
    except ValueError:
        raise MetricsError(f"/metrics line {number}: value {text!r} is not a number") from None


@dataclass(frozen=True)
class Histogram:
    """A cumulative histogram as scraped: (upper bound, observations <= bound) ascending, ending at +Inf."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made between `earlier` and this scrape (a counter reset, e.g. a restarted pod,
        makes the window this scrape's whole content, as Prometheus' increase() treats resets)."""
        if (
            earlier is None
            or earlier.count > self.count
            or [b for b, _ in earlier.buckets] != [b for b, _ in self.buckets]
        ):
            return self
        counts = tuple((b, c - e) for (b, c), (_, e) in zip(self.buckets, earlier.buckets, strict=True))
        return Histogram(counts, self.count - earlier.count, self.total - earlier.total)

    def quantile(self, q: float) -> float | None:
        """The q-quantile by linear interpolation inside its bucket, as Prometheus' histogram_quantile()
        does (https://prometheus.io/docs/prometheus/latest/querying/functions/#histogram_quantile); a
        quantile in the +Inf bucket is the highest finite bound. None when nothing was observed."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile {q} must be between 0 and 1")
        if self.count <= 0 or not self.buckets:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True)
class Scrape:
    """What one read of a pod's /metrics says (gauges as found; None when the pod does not export one)."""

    gauges: dict[str, float]
    histograms: dict[str, Histogram]


def read(text: str, model_name: str | None = None, names: Names = NEURONFLEET) -> Scrape:
    """The autoscaler's gauges (summed over their other labels, e.g. a role) and histograms
    from one /metrics body, for one model (all models when `model_name` is None), the engine's `names` read
    as ours."""
    gauges: dict[str, float] = {}
    parts: dict[str, dict[str, float]] = {name: {} for name in HISTOGRAMS}
    buckets: dict[str, list[tuple[float, float]]] = {name: [] for name in HISTOGRAMS}
    renames, unused = names.renames(), names.unused()
    for s in parse(text):
        if model_name is not None and s.labels.get("model_name", model_name) != model_name:
            continue
        base, suffix = s.name, ""
        for end in ("_bucket", "_count", "_sum"):
            if s.name.endswith(end) and s.name[: -len(end)] in renames:
                base, suffix = s.name[: -len(end)], end
        if base in renames:
            s = Sample(renames[base] + suffix, s.labels, s.value)
        elif base in unused:
            continue  # a name of ours this engine does not use for the signal
        if s.name in GAUGES:
            gauges[s.name] = gauges.get(s.name, 0.0) + s.value
            continue
        for name in HISTOGRAMS:
            if s.name == f"{name}_bucket":
                if "le" not in s.labels:
                    raise MetricsError(f"{s.name} sample without its le label")
                buckets[name].append((_float(s.labels["le"], 0), s.value))
            elif s.name in (f"{name}_count", f"{name}_sum"):
                parts[name][s.name.rsplit("_", 1)[1]] = s.value
    histograms = {
        name: Histogram(
            tuple(sorted(buckets[name])), parts[name].get("count", 0.0), parts[name].get("sum", 0.0)
        )
        for name in HISTOGRAMS
        if buckets[name]
    }
    return Scrape(gauges, histograms)


@dataclass(frozen=True)
class PodLoad:
    """One pod's load, as the autoscaler uses it. `occupancy` counts waiting requests too, so it goes past
    1 when the pod is saturated (a full pod with a queue is not "at 100%", it is over)."""

    waiting: float = 0.0  # requests queued for a slot, plus the role's own queue where larger (prefill)
    running: float = 0.0
    slots: int = 1
    kv_usage: float = 0.0
    held: float = 0.0  # requests held at the front door (router pods only)
    ttft_p90: float | None = None  # seconds, over the window between the two scrapes
    itl_p90: float | None = None
    requests: float = 0.0  # first tokens observed in the window

    @property
    def occupancy(self) -> float:
        return (self.running + self.waiting) / self.slots

    @property
    def busy(self) -> bool:
        return self.waiting + self.running + self.held > 0


def load(later: Scrape, earlier: Scrape | None, slots: int) -> PodLoad:
    """A pod's load from its latest scrape, with latency p90s over the window since `earlier` (None: since
    the pod started). `slots` is the pod's batch size (the runtime does not export it; the spec says it)."""
    if slots < 1:
        raise ValueError(f"slots {slots} must be at least 1 (the pod's static batch size)")
    g = later.gauges
    windows = {
        name: h.minus(earlier.histograms.get(name) if earlier else None)
        for name, h in later.histograms.items()
    }
    ttft, itl = windows.get(TTFT), windows.get(ITL)
    return PodLoad(
        waiting=max(g.get(WAITING, 0.0), g.get(ROLE_QUEUE, 0.0)),
        running=g.get(SLOTS_BUSY, g.get(RUNNING, 0.0)),
        slots=slots,
        kv_usage=g.get(KV_USAGE, 0.0),
        held=g.get(HELD, 0.0),
        ttft_p90=ttft.quantile(0.9) if ttft else None,
        itl_p90=itl.quantile(0.9) if itl else None,
        requests=ttft.count if ttft else 0.0,
    )
