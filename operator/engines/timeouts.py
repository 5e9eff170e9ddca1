"""How long a model's compile and its servers' start may take, pure: derived from the model's size and
anchored on the values the engines' pinned documentation runs its recipes with, unless the spec names its own
(`compile.timeoutSeconds`, `compile.activeDeadlineSeconds`, `serving.startTimeoutSeconds`). The engines put
them into their own variables where they have them (`vllm_plugin`); the builders into the compile Job's
deadline and the startup probe's budget (`engines.compile_deadline`, `engines.startup_probe`).

The anchors (aws-neuron/aws-neuron-sdk@v2.32.0, vllm-neuron/docs/), each a value a recipe of the pinned plugin
sets, whose defaults are 600 s ("the default 600-second budget", tutorials/tutorial-llama3-70b.md:216):
- one graph's compile: 1200 s in every quickstart and in the 8B-120B recipes (getting-started/
  quickstart-online-serving.md:30-31, tutorials/tutorial-llama3-70b.md:70-71: "cold compilation can exceed the
  default 600-second budget (typically 15-20 minutes)"), 2400 s for GPT-OSS disaggregated
  (tutorials/tutorial-di-1p1d-xpyd.md:111, tutorials/tutorial-gpt-oss.md:193), 6000 s for a 32B multimodal
  model (tutorials/tutorial-epd-1e-1pd-xeypd.md:193). Here: the largest of a language model's, 2400 s, up to
  120B parameters, then 20 s per billion (2400 s at 120B); 6000 s for a model of unknown size.
- a server's start (VLLM_ENGINE_READY_TIMEOUT_S): 1800 s for GPT-OSS 20B, 5400 s for 120B
  (tutorials/tutorial-di-1p1d-xpyd.md:113 and :343; tutorials/tutorial-gpt-oss.md:195). Here: 45 s per
  billion parameters (5400 s at 120B), at least 1800 s; 5400 s for a model of unknown size.
A compile is a server's start that compiles every graph: the start, plus the graphs' compiles in rounds of the
plugin's parallel compile workers (8 by default: design/compilation/cpu_compilation.md:48-49), at least two
(prefill and decode). The compile Job's deadline holds every pass (one per tensor parallelism the plugin
compiles) and the model's download, and is never shorter than the fixed 14400 s it was before it was
derived.
"""

from __future__ import annotations

import math

from neuronfleet.contract import GRACE_PERIOD

from .. import topology
from ..spec import FORMER_COMPILE_DEADLINE, NeuronModelSpec

GRAPH_FLOOR_S = 2400  # the largest per-graph compile timeout a language model's recipe sets (above)
GRAPH_S_PER_BILLION = 20  # past 120B parameters (2400 s at 120B)
GRAPH_UNKNOWN_S = 6000  # the largest any recipe sets (a 32B multimodal model's)
START_FLOOR_S = 1800  # GPT-OSS 20B's VLLM_ENGINE_READY_TIMEOUT_S
START_S_PER_BILLION = 45  # 5400 s at GPT-OSS 120B
START_UNKNOWN_S = 5400  # the largest a recipe sets
COMPILE_WORKERS = 8  # NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS' default (cpu_compilation.md:48-49)
MIN_ROUNDS = 2  # a prefill and a decode graph at least
# The download of the weights into the compile cache: not documented by any engine; an allowance of 100 MB/s
# (a Hub or S3 download on one connection is often slower, but the engines download in parallel), 10 minutes
# at least, and the bytes of a 32 GiB model when its size is unknown (as host_resources assumes)
DOWNLOAD_BYTES_PER_S = 100_000_000
DOWNLOAD_FLOOR_S = 600
UNKNOWN_MODEL_BYTES = 32 << 30
# What a serving pod does beside the engine's own start, within the startup probe's budget: the start guard
# copies the compiled graphs into its local cache, and the HTTP server starts once the engine is ready
START_SLACK_S = 300
NEURON_PROBE_PERIOD_S = 10  # a Neuron pod's startup probe: every 10 s (loads take minutes)
CPU_PROBE = (2, 1800)  # a cpu model or a router loads in seconds: checked often (Ready soon after), 3600 s
# A draining serving pod of our runtime finishes the requests it holds (and hands back, with 503, those it has
# not started and could not finish: runtime/engine/admission.py): each slot's request may still generate up to
# neuron.sequenceLength tokens, the slots in parallel, one token a step. The slowest a slot generates that the
# grace period allows for, in tokens a second: docs/benchmarks.md ("Serving") measures a slot of our CPU
# engine at 32 busy slots on two cores at 10.6 (int8) to 17.7 tokens/s (inter-token latency p50 57 to 95 ms)
DRAIN_TOKENS_PER_S = 10


def _minutes(seconds: float) -> int:
    """Whole minutes, rounded up."""
    return int(math.ceil(seconds / 60) * 60)


def _billions(spec: NeuronModelSpec) -> float | None:
    shape = topology.model_shape(spec.model.uri, spec.model.shape)
    return None if shape is None else shape.parameters / 1e9


def graph_seconds(spec: NeuronModelSpec) -> int:
    """The longest one graph's compile may take: compile.timeoutSeconds, else derived from the model's
    size."""
    if spec.compile.timeoutSeconds is not None:
        return spec.compile.timeoutSeconds
    billions = _billions(spec)
    if billions is None:
        return GRAPH_UNKNOWN_S
    return _minutes(max(GRAPH_FLOOR_S, GRAPH_S_PER_BILLION * billions))


def load_seconds(spec: NeuronModelSpec) -> int:
    """A server's start that compiles nothing (it loads compiled graphs and the weights), derived from the
    model's size."""
    billions = _billions(spec)
    if billions is None:
        return START_UNKNOWN_S
    return _minutes(max(START_FLOOR_S, START_S_PER_BILLION * billions))


def compile_rounds(spec: NeuronModelSpec) -> int:
    """The rounds of parallel compile workers one pass takes: the spec's buckets (each a graph) over the
    workers, at least MIN_ROUNDS (buckets the engine derives itself are not counted here)."""
    graphs = len(spec.neuron.buckets.context) + len(spec.neuron.buckets.generation)
    return max(MIN_ROUNDS, math.ceil(graphs / COMPILE_WORKERS))


def compile_pass_seconds(spec: NeuronModelSpec) -> int:
    """A server's start that compiles every graph (the compile Job's server, once per tensor parallelism; an
    engine that compiles as each server starts): its load and the graphs' compiles."""
    return load_seconds(spec) + graph_seconds(spec) * compile_rounds(spec)


def start_seconds(spec: NeuronModelSpec, compiles_at_start: bool) -> int:
    """The longest a serving pod's engine may take to start: serving.startTimeoutSeconds, else a load (or,
    for an engine that compiles as it starts, a compile pass)."""
    if spec.serving.startTimeoutSeconds is not None:
        return spec.serving.startTimeoutSeconds
    return compile_pass_seconds(spec) if compiles_at_start else load_seconds(spec)


def download_seconds(spec: NeuronModelSpec) -> int:
    shape = topology.model_shape(spec.model.uri, spec.model.shape)
    per = topology.BYTES_PER_DTYPE.get(spec.neuron.dtype, 2)  # (auto: bfloat16 on Neuron, as checkpoints)
    size = UNKNOWN_MODEL_BYTES if shape is None else shape.parameters * per
    return _minutes(max(DOWNLOAD_FLOOR_S, size / DOWNLOAD_BYTES_PER_S))


def compile_deadline(spec: NeuronModelSpec, passes: int) -> int:
    """The compile Job's activeDeadlineSeconds: compile.activeDeadlineSeconds, else the download and
    `passes` compile passes, at least FORMER_COMPILE_DEADLINE."""
    if spec.compile.activeDeadlineSeconds is not None:
        return spec.compile.activeDeadlineSeconds
    need = download_seconds(spec) + passes * compile_pass_seconds(spec)
    return max(FORMER_COMPILE_DEADLINE, need)


def drain_seconds(spec: NeuronModelSpec) -> int:
    """The grace period a unified or decode pod of our runtime needs to finish what it may hold: every slot
    generating a whole sequence (neuron.sequenceLength tokens at DRAIN_TOKENS_PER_S), never less than the
    runtime's default (GRACE_PERIOD)."""
    return max(int(GRACE_PERIOD), math.ceil(spec.neuron.sequenceLength / DRAIN_TOKENS_PER_S))


def startup_probe(spec: NeuronModelSpec, neuron: bool, start: int | None) -> tuple[int, int]:
    """A serving container's startup probe (periodSeconds, failureThreshold), whose budget (their product)
    holds the engine's start (`start`, seconds; None for a router) and START_SLACK_S: the kubelet never
    restarts a pod the engine itself would still wait for. A cpu pod or a router: CPU_PROBE, or, with
    serving.startTimeoutSeconds, that budget."""
    if start is None:
        return CPU_PROBE
    if not neuron:
        period = CPU_PROBE[0]
        if spec.serving.startTimeoutSeconds is None:
            return CPU_PROBE
        return period, math.ceil(start / period)
    return NEURON_PROBE_PERIOD_S, math.ceil((start + START_SLACK_S) / NEURON_PROBE_PERIOD_S)
