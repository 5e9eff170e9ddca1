"""Validation of a NeuronModel, pure: the checks the operator runs at reconcile (its Validated condition), and
that `neuronfleet validate` and `render` run on manifests.

The rules that need only the object are the spec's (`spec_base.Rule`, declared beside their sections) and
the engines' (`engines.limits`): the API server refuses an object that breaks one at apply (the CRD's CEL),
and their Python twins run here too, for what does not pass through the API server (a manifest on disk, an
object stored before the CRD had the rule): the instance topology (tensor parallelism allowed there, whole
devices the Neuron scheduler extension accepts, cores on one node, EFA), the engine an instance type runs, the
buckets' order, fields that apply to another mode, and each engine's limits (its platforms, the model
families it exports, the settings it has no flag for, its prompt limit and KV transport, the autoscaling
signals its pods export, the compile Job's settings where it runs none, the largest bucket where it bounds
them). What stays here needs more than the object, or more than CEL can read: neuron.overrides against the
engine (a free-form tree, `engines.limits.override_refusals`), an image named for an engine whose pods run
privileged (the operator's setting), the model's own length limit (read from the Hugging Face Hub), a pod's
CPU or memory request (the spec's or derived) beyond what a node of its instance type can give it
(`host_resources.allocatable_refusals`, against `topology.pod_allocatable`), and a fit estimate: weights in
the dtype plus the KV cache for batch x sequence length x layers, per core, against a core's memory (from the
table of well-known models). A refusal says what is wrong and what would fit; an unknown model's fit is
reported as not checked, never guessed. `parse` words the schema's refusals, each naming its field."""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from neuronfleet.contract import (
    MAX_COMPILED_GRAPHS,
    TORCHNEURON_FAMILIES,
    compiled_buckets,
    instance_family,
    length_refusal,
)

from . import devices, engines, host_resources, names, topology
from .parallelism import neuron_devices as neuron_devices  # (callers read them here)
from .parallelism import role_tensor_parallel as role_tensor_parallel
from .parallelism import tensor_parallel_degrees
from .spec import (
    EMBEDDED_ON_NEURON,
    EMBEDDED_TORCHNEURON,
    PATTERN_MEANINGS,
    PLACEABLE,
    NeuronModelSpec,
    valued,
)
from .spec_base import broken_rules

USABLE_MEMORY = 0.9  # share of a core's memory for weights and KV cache; the rest: runtime, scratch, graphs
# The operator's setting (the chart's security.allowPrivilegedImageOverride): whether a model may name its own
# image for an engine whose pods run privileged (`privileged_image_errors`)
PRIVILEGED_IMAGE_ENV = "NEURONFLEET_ALLOW_PRIVILEGED_IMAGE_OVERRIDE"


@dataclass
class Fit:
    checked: bool
    reason: str  # why not checked, or a one-line summary
    weights_bytes_per_core: int = 0
    kv_bytes_per_core: int = 0
    available_bytes_per_core: int = 0

    @property
    def needed_bytes_per_core(self) -> int:
        return self.weights_bytes_per_core + self.kv_bytes_per_core


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    fit: Fit | None = None
    notes: list[str] = field(default_factory=list)  # what the user of an accepted spec should know

    @property
    def ok(self) -> bool:
        return not self.errors


def gib(n: float) -> str:
    return f"{n / topology.GIB:.1f} GiB"


def model_shape(spec: NeuronModelSpec) -> topology.ModelShape | None:
    return topology.model_shape(spec.model.uri, spec.model.shape)


def estimate_fit(spec: NeuronModelSpec, tensor_parallel: int | None = None, batch: int | None = None) -> Fit:
    n = spec.neuron
    inst = topology.INSTANCES.get(n.instanceType)
    if inst is None:
        return Fit(False, "not checked: instanceType cpu has no Neuron memory (host memory serves)")
    shape = model_shape(spec)
    if shape is None:
        return Fit(
            False,
            f"not checked: {spec.model.uri} is not in the table of well-known models; give spec.model.shape "
            "(parameters, layers, kvHeads, headDim) to check it",
        )
    tp = tensor_parallel or n.tensorParallel
    batch = batch or n.batchSize
    weight_bytes = topology.BYTES_PER_QUANTIZED_WEIGHT.get(n.quantization, topology.BYTES_PER_DTYPE[n.dtype])
    kv_bytes = topology.BYTES_PER_DTYPE[n.dtype]
    weights = math.ceil(shape.parameters * weight_bytes / tp)
    kv_heads_per_core = math.ceil(shape.kv_heads / tp)  # KV heads are replicated when TP exceeds them
    kv = 2 * shape.layers * kv_heads_per_core * shape.head_dim * n.sequenceLength * batch * kv_bytes
    available = int(inst.memory_per_core(n.logicalCores) * USABLE_MEMORY)
    fit = Fit(True, "", weights, kv, available)
    fit.reason = (
        f"{gib(fit.needed_bytes_per_core)} per core (weights {gib(weights)} + KV cache {gib(kv)}) of "
        f"{gib(available)} usable"
    )
    return fit


def _fits(spec: NeuronModelSpec, tp: int, batch: int) -> bool:
    f = estimate_fit(spec, tp, batch)
    return f.needed_bytes_per_core <= f.available_bytes_per_core


def _suggest(spec: NeuronModelSpec, inst: topology.Instance) -> str:
    n = spec.neuron
    options = []
    tps = [t for t in _placeable_tp(spec, inst) if t > n.tensorParallel and _fits(spec, t, n.batchSize)]
    if tps:
        options.append(f"tensorParallel {tps[0]}")
    batches = [b for b in range(n.batchSize - 1, 0, -1) if _fits(spec, n.tensorParallel, b)]
    if batches:
        options.append(f"batchSize {batches[0]}")
    return " or ".join(options) if options else "a larger instance type"


def _placeable_tp(spec: NeuronModelSpec, inst: topology.Instance) -> tuple[int, ...]:
    lnc = spec.neuron.logicalCores
    return PLACEABLE[f"{inst.name}/{'' if lnc is None else lnc}"]


def _either(names: list[str]) -> str:
    return " or ".join(filter(None, (", ".join(names[:-1]), names[-1]))) if names else ""


def _all(items: list[str]) -> str:
    return " and ".join(filter(None, (", ".join(items[:-1]), items[-1]))) if items else ""


def _compile_cache_only(spec: dict) -> None:
    spec["compile"] = {k: v for k, v in spec["compile"].items() if k == "cache"}


def _variants(spec: NeuronModelSpec) -> list[tuple[tuple[str, ...], dict]]:
    """The spec as another engine would take it: as it is, and with what only engine embedded reads taken
    out (serving.sampling, model.tokenizer, a compile Job's settings but its cache) and the prompt limit
    left to that engine or at sequenceLength - 1 (which vLLM needs); each with the changes it makes, in
    words, fewest first."""
    base = spec.model_dump(exclude_unset=True)
    removable = []  # (words, the spec without it)
    if spec.serving.sampling.generation_config():
        removable.append(("remove serving.sampling (only engine embedded takes it)",
                          lambda d: d["serving"].pop("sampling", None)))  # fmt: skip
    if spec.model.tokenizer is not None:
        removable.append(("remove model.tokenizer (only engine embedded's compile applies it)",
                          lambda d: d["model"].pop("tokenizer", None)))  # fmt: skip
    if set(base.get("compile") or {}) - {"cache"}:
        removable.append(("keep only compile.cache of the compile settings (not every engine runs a "
                          "compile Job)",
                          _compile_cache_only))  # fmt: skip
    limits: list[tuple[tuple[str, ...], Callable[[dict], Any]]] = [((), lambda d: None)]
    if "maxInputLength" in base["neuron"]:
        limits.append((("remove neuron.maxInputLength (each engine has its own default)",),
                       lambda d: d["neuron"].pop("maxInputLength")))  # fmt: skip
    length = spec.neuron.sequenceLength - 1
    if spec.neuron.maxInputLength != length:
        limits.append(((f"set neuron.maxInputLength {length} (neuron.sequenceLength - 1)",),
                       lambda d: d["neuron"].update(maxInputLength=length)))  # fmt: skip
    out = []
    for n in range(len(removable) + 1):
        for chosen in itertools.combinations(removable, n):
            for limit_words, limit in limits:
                variant = copy.deepcopy(base)
                for _, remove in chosen:
                    remove(variant)
                limit(variant)
                out.append(((*(w for w, _ in chosen), *limit_words), variant))
    return sorted(out, key=lambda v: len(v[0]))


def _engines_that_run(spec: NeuronModelSpec) -> dict[str, tuple[str, ...]]:
    """The engines other than embedded that serve a spec like this one (its model, instance type, shapes and
    serving mode) where the embedded engine cannot, each with the changes of what only our runtime reads
    that it needs (`_variants`; none: the spec as it is): those whose refusals of their best variant are
    only the ones every engine shares (a tensor parallelism or a fit the instance does not allow, no EFA
    there...). A KV transport the spec does not name is that engine's default."""
    variants = _variants(spec)
    best: dict[str, tuple[set[str], tuple[str, ...]]] = {}
    for engine in engines.ENGINES:
        if engine == "embedded":
            continue
        for changes, variant in variants:
            try:
                other = NeuronModelSpec.model_validate({**variant, "engine": engine})
            except ValueError:  # pydantic's ValidationError: this variant breaks a rule of the spec
                continue
            errors = set(validate(other).errors)
            if engine not in best or len(errors) < len(best[engine][0]):
                best[engine] = (errors, changes)
    shared = set.intersection(*(e for e, _ in best.values())) if best else set()
    return {engine: changes for engine, (errors, changes) in best.items() if errors == shared}


def _what_runs_on(spec: NeuronModelSpec, instance: str) -> str:
    others = _engines_that_run(spec)
    if not others:
        return (
            f"no engine serves serving.mode {spec.serving.mode} on {instance} yet: change serving.mode, or "
            "use instanceType cpu for engine embedded"
        )
    needs = "".join(
        f"; with engine {engine}, {_all(list(changes))}" for engine, changes in others.items() if changes
    )
    return f"on {instance} use engine {_either(list(others))}, or instanceType cpu for engine embedded{needs}"


def compiled_graph_count(neuron: Any) -> int:
    """The graphs neuron.compiledSteps compiles for the spec's batch size and bucket tables (the contract's
    `compiled_buckets`, as the compile Job runs it)."""
    prefill, decode = sorted(set(neuron.buckets.context)), sorted(set(neuron.buckets.generation))
    return len(compiled_buckets(neuron.batchSize, prefill, decode))


def compiled_steps_refusals(spec: NeuronModelSpec) -> list[str]:
    """neuron.compiledSteps where it cannot work: inductor with another engine or on a Neuron instance type;
    neuron with another engine, or off Trn2 and Trn3 (unified only is the CRD's rule, EMBEDDED_TORCHNEURON;
    a tensor parallelism above 1 runs a rank per NeuronCore); quantized weights, bucket tables not given, or
    tables that make more graphs than a compile should (each said with what would be right)."""
    n = spec.neuron
    if n.compiledSteps == "off":
        return []
    family = instance_family(n.instanceType)
    if n.compiledSteps == "inductor" and (spec.engine != "embedded" or n.instanceType != "cpu"):
        return [
            f"neuron.compiledSteps {n.compiledSteps} compiles our runtime's passes for CPUs: it takes engine "
            f"embedded on instanceType cpu, not engine {spec.engine} on {n.instanceType}; set it to off"
            + (" (on trn2 and trn3 engine embedded takes neuron)" if family in TORCHNEURON_FAMILIES else "")
        ]
    if n.compiledSteps == "neuron" and (spec.engine != "embedded" or family not in TORCHNEURON_FAMILIES):
        return [
            "neuron.compiledSteps neuron runs our runtime's passes on Trainium with TorchNeuron: it "
            f"takes engine embedded on trn2 or trn3, not engine {spec.engine} on {n.instanceType}; "
            + ("set it to inductor or off" if n.instanceType == "cpu" else "set it to off")
        ]
    if n.quantization != "none":
        return [
            f"neuron.compiledSteps {n.compiledSteps} takes float weights; quantization {n.quantization} runs "
            "on torch's CPU kernels only: set quantization none"
            + (", or compiledSteps off" if n.compiledSteps == "inductor" else "")
        ]
    if not n.buckets.context or not n.buckets.generation:
        return [
            f"neuron.compiledSteps {n.compiledSteps} compiles a graph per bucket: give "
            "neuron.buckets.context and neuron.buckets.generation (a few lengths each, e.g. context [128, "
            f"{n.maxInputLength or 3072}] and generation [{n.sequenceLength}]); the derived tables make over "
            "a thousand graphs"
        ]
    decode = sorted(set(n.buckets.generation))
    if decode[-1] != n.sequenceLength:
        return [
            f"neuron.buckets.generation {decode} must end at neuron.sequenceLength ({n.sequenceLength}) for "
            f"neuron.compiledSteps {n.compiledSteps}: a decode graph per length, the longest holding a whole "
            "sequence"
        ]
    graphs = compiled_graph_count(n)
    if graphs > MAX_COMPILED_GRAPHS:
        return [
            f"neuron.compiledSteps {n.compiledSteps}: batchSize {n.batchSize} and these buckets make "
            f"{graphs} graphs, more than {MAX_COMPILED_GRAPHS}: give fewer neuron.buckets.context or "
            "generation, or a smaller batchSize"
        ]
    return []


def _embedded_on_neuron(spec: NeuronModelSpec) -> str:
    """The refusal of engine embedded on a Neuron instance type without its backend, naming the engines that
    serve such a spec."""
    named = "engine embedded" + ("" if "engine" in spec.model_fields_set else " (the default, not set)")
    instance = spec.neuron.instanceType
    return (
        f"{named} has no Neuron backend for {instance} (neuronfleet's runtime serves on cpu, and on trn2 and "
        f"trn3 with TorchNeuron, experimental; its compile for {instance} would fail); "
        f"{_what_runs_on(spec, instance)}"
    )


def _embedded_torchneuron(spec: NeuronModelSpec) -> str:
    """The refusal of engine embedded on trn2 or trn3 without what its TorchNeuron path needs, naming the
    engines that serve such a spec there."""
    named = "engine embedded" + ("" if "engine" in spec.model_fields_set else " (the default, not set)")
    instance = spec.neuron.instanceType
    need = (
        "serving.mode disaggregated moves KV caches from host memory, not yet the device's: use serving.mode "
        "unified"
        if spec.serving.mode == "disaggregated"
        else "set neuron.compiledSteps neuron (the compile Job warms a graph per bucket)"
    )
    return (
        f"{named} on {instance} is experimental (TorchNeuron, not yet run on a device) and serves unified "
        f"only: {need}; or {_what_runs_on(spec, instance)}"
    )


@dataclass(frozen=True)
class ModelLimit:
    """What was read of the model itself before any compile (`hub.HubConfigs` for hf:// models): the longest
    sequence its config allows, and where that was read."""

    length: int
    where: str


def allows_privileged_image(environ: Mapping[str, str]) -> bool:
    """The operator's PRIVILEGED_IMAGE_ENV setting: true or false (the default); another value is refused
    with what would be right."""
    raw = environ.get(PRIVILEGED_IMAGE_ENV, "false")
    if raw not in ("true", "false"):
        raise ValueError(f"{PRIVILEGED_IMAGE_ENV}={raw!r}: must be true or false (the default)")
    return raw == "true"


def privileged_image_errors(spec: NeuronModelSpec, allowed: bool) -> list[str]:
    """Refusals of an image named for an engine other than ours (`image`, `compile.image`) unless the
    operator's administrator `allowed` it: that engine's pods run their image as the user it declares, with
    the capabilities its documentation adds (pod_parts.security), so whoever may create a NeuronModel would
    run any image so. Our runtime's pods (engine embedded) run any image unprivileged: no refusal."""
    if spec.engine == "embedded" or allowed:
        return []
    caps = engines.documented_capabilities(spec)
    how = "as the user the image declares (root for the pinned images)" + (
        f", with {' and '.join(caps)}" if caps else ""
    )
    return [
        f"{name} {value}: engine {spec.engine}'s pods run their image {how}, so an image named here would "
        "run privileged; the operator takes one only where its administrator allows it (the chart value "
        f"security.allowPrivilegedImageOverride: true, {PRIVILEGED_IMAGE_ENV}=true for the operator; "
        f"docs/security.md); remove {name} to run the pinned {engines.ENGINES[spec.engine].image(spec)}"
        for name, value in (("image", spec.image), ("compile.image", spec.compile.image))
        if value
    ]


def validate(
    spec: NeuronModelSpec, limit: ModelLimit | None = None, allow_privileged_image: bool | None = None
) -> Report:
    """Every refusal for a parsed spec (empty when it can be served), and the memory fit; with the model's
    own `limit` where it was read; an engine's image named in the spec as the operator's setting allows
    (`allow_privileged_image`, default: its PRIVILEGED_IMAGE_ENV)."""
    if allow_privileged_image is None:
        allow_privileged_image = allows_privileged_image(os.environ)
    r = Report()
    n = spec.neuron
    inst = topology.INSTANCES.get(n.instanceType)
    r.errors += broken_rules(  # (the CRD's, at apply)
        spec, {EMBEDDED_ON_NEURON: _embedded_on_neuron, EMBEDDED_TORCHNEURON: _embedded_torchneuron}
    )
    r.errors += engines.unsupported(spec)  # the engine's limits (the CRD's too, but overrides): never dropped
    r.errors += privileged_image_errors(spec, allow_privileged_image)
    r.errors += devices.refusals(spec)  # a logical-core setting no node is found for (the chart's settings)
    r.errors += compiled_steps_refusals(spec)
    if (said := engines.notice(spec)) is not None:
        r.notes.append(f"{said[0]}: {said[1]}")
    if n.compiledSteps != "off" and n.buckets.context and n.buckets.generation:
        graphs = compiled_graph_count(n)
        r.notes.append(
            f"neuron.compiledSteps {n.compiledSteps}: the compile Job compiles {graphs} graphs"
            + (
                " (about 20 s each on 2 CPU cores for a 135M model: docs/benchmarks.md)"
                if n.compiledSteps == "inductor"
                else " on a node of the instance type"
            )
        )
    if not r.errors:  # a pod's CPU or memory request more than its node can give (once the shape is valid)
        r.errors += host_resources.allocatable_refusals(spec)
    if limit is not None and n.sequenceLength > limit.length:
        r.errors.append(length_refusal(n.sequenceLength, limit.length, limit.where))
    for tp in tensor_parallel_degrees(spec):  # a role's own tensor parallelism must fit too
        fit = estimate_fit(spec, tp)
        if (
            tp != n.tensorParallel
            and fit.checked
            and fit.needed_bytes_per_core > fit.available_bytes_per_core
        ):
            r.errors.append(
                f"the model does not fit a prefill or decode pod at tensor parallelism {tp}: it needs "
                f"{fit.reason}; give that role a larger serving.*.tensorParallel"
            )
    r.fit = estimate_fit(spec)
    if r.fit.checked and r.fit.needed_bytes_per_core > r.fit.available_bytes_per_core and inst is not None:
        r.errors.append(
            f"the model does not fit: it needs {r.fit.reason} on {inst.name} at "
            f"{', '.join(valued(n, f) for f in ('tensorParallel', 'batchSize', 'sequenceLength'))}; try "
            f"{_suggest(spec, inst)}"
        )
    return r


def parse(obj: dict) -> tuple[NeuronModelSpec | None, list[str]]:
    """A NeuronModel manifest's spec, or the schema errors, each naming its field."""
    from pydantic import ValidationError

    from .spec import API_VERSION, KIND

    errors = []
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        return None, [
            f"not a {KIND} of {API_VERSION}: apiVersion {obj.get('apiVersion')!r}, kind {obj.get('kind')!r}"
        ]
    if not isinstance(obj.get("spec"), dict):
        return None, ["spec: required, an object"]
    try:
        return NeuronModelSpec.model_validate(obj["spec"]), []
    except ValidationError as e:
        for err in e.errors():
            loc = ["spec", *(str(p) for p in err["loc"])]
            where = ".".join(loc)
            if loc[-1] == "[key]":  # a map's key (a label key, a resource name)
                where = f"{'.'.join(loc[:-2])} key {loc[-2]!r}"
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                message = "unknown field"
            elif err["type"] in ("literal_error", "enum") and "expected" in err.get("ctx", {}):
                message = f"must be one of {err['ctx']['expected']}, got {err['input']!r}"
            elif err["type"] == "string_pattern_mismatch" and err["ctx"]["pattern"] in PATTERN_MEANINGS:
                message = f"must be {PATTERN_MEANINGS[err['ctx']['pattern']]}, got {err['input']!r}"
            errors.append(f"{where}: {message}")
    return None, errors


def check(obj: dict, limit: ModelLimit | None = None, allow_privileged_image: bool | None = None) -> Report:
    """Parse and validate one manifest: schema errors first, then its name (`names.name_errors`: its
    children's names must fit Kubernetes' limits), then the checks of `validate` (with the model's `limit`
    where it was read, and the operator's `allow_privileged_image`)."""
    spec, errors = parse(obj)
    name = (obj.get("metadata") or {}).get("name")
    errors = (names.name_errors(name) if isinstance(name, str) else []) + errors
    if spec is None:
        return Report(errors=errors)
    report = validate(spec, limit, allow_privileged_image)
    report.errors = errors + report.errors
    return report
