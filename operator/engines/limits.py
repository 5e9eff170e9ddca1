"""Each engine's limits, declared once: those that need only the object as `spec_base.Rule`s over the
whole spec (`RULES`: the CRD carries their CEL, so the API server refuses a model that breaks one at `kubectl
apply`, and `engines.unsupported` runs their Python twins for validation), the rest in Python
(`override_refusals`).

Who serves a spec (`served_by`): its engine, or for engine vllm the contract of its instance family (the
table `vllm.CONTRACT_OF`, which the CEL reads as a map literal, `SERVED_BY_CEL`). The settings only some of
them take are one table (`SETTINGS_TAKEN_BY` and the lines after it); each refusal names the server and, where
it helps, the value and what would be right, in words made from one template for the API server's
messageExpression and the Python twin alike (`_rule`). Other rules read an engine's own tables, from its
module (`ENGINE_MODULES`, `SERVER_MODULES`), written into the CEL as literals: the metric names its pods
export (`METRICS`: a signal a provider would find none of, `UNEXPORTED`), the models it runs a compile Job
for (`COMPILE_JOB_SOURCES`: the Job's settings are refused where it runs none) and whether its buckets are
the spec's limits (`BUCKETS_ARE_LIMITS`: the largest bucket must be the limit).

What stays in Python, and why: every check of `neuron.overrides` (NxDI fields for an engine that reads none, a
field neuronfleet derives, vLLM's `num_seqs_buckets` against the batch). The field is kept as written
(x-kubernetes-preserve-unknown-fields), and Kubernetes' CEL sees no field of such an object, neither its keys
nor its size (k8s.io/apiserver pkg/cel/common/schemas.go SchemaDeclType, v1.30: "The CEL declaration for
objects with XPreserveUnknownFields does not expose unknown fields"), so a rule reading it does not compile.
Pure."""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .. import parallelism, topology
from ..pod_metrics import NEURONFLEET, Names
from ..spec import (
    DISAGGREGATED_CEL,
    DTYPE_CEL,
    FORMER_COMPILE_DEADLINE,
    MAX_INPUT_CEL,
    TRANSPORT_CEL,
    Autoscaling,
    Compile,
    NeuronModelSpec,
    NeuronSettings,
    Sampling,
)
from ..spec_base import Rule
from . import embedded, sglang, tgi, vllm, vllm_nxdi


@dataclass(frozen=True)
class Server:
    """What serves a spec, as refusals word it: `where` names it in a refusal, `named` in a suggestion."""

    where: str
    named: str


SERVERS = {
    "embedded": Server("engine embedded (neuronfleet's runtime)", "engine embedded"),
    "vllm_plugin": Server("the vLLM Neuron plugin (engine vllm on Trn2/Trn3)", "engine vllm on Trn2/Trn3"),
    "vllm_nxdi": Server("engine vllm on Inf2/Trn1 (NxD Inference)", "engine vllm on Inf2/Trn1"),
    "tgi": Server("TGI's Neuron export (optimum-neuron)", "engine tgi on Inf2/Trn1"),
    "sglang": Server("SGLang-Neuron", "engine sglang on Trn3"),
}
# (every engine but vllm serves itself; vllm's contracts serve it)
assert set(SERVERS) == {"embedded", "tgi", "sglang", *vllm.CONTRACTS}
# Each engine's module, and each server's (engines.ENGINES is the first: it asserts so), whose tables the
# rules below read: an engine's metric names, the models it runs a compile Job for, whether its buckets are
# the spec's limits
ENGINE_MODULES: dict[str, ModuleType] = {"embedded": embedded, "vllm": vllm, "tgi": tgi, "sglang": sglang}
SERVER_MODULES: dict[str, ModuleType] = {"embedded": embedded, "tgi": tgi, "sglang": sglang, **vllm.CONTRACTS}

SERVED_BY_CEL = f"(self.engine == 'vllm' ? {vllm.CONTRACT_CEL}[self.neuron.instanceType] : self.engine)"


def served_by(spec: NeuronModelSpec) -> str:
    """Who serves the spec: its engine, or for vllm its instance family's contract (in CEL: SERVED_BY_CEL)."""
    return vllm.CONTRACT_OF[spec.neuron.instanceType] if spec.engine == "vllm" else spec.engine


def _cel_string(text: str) -> str:
    return json.dumps(text)  # a CEL string literal (CEL takes JSON's escapes)


def _cel_map(table: dict[str, str]) -> str:
    return "{" + ", ".join(f"{_cel_string(k)}: {_cel_string(v)}" for k, v in table.items()) + "}"


# A value a refusal's words hold: (its CEL, a string expression; its Python, from the parsed spec)
Value = tuple[str, Callable[[NeuronModelSpec], Any]]


def _by_contract(servers: tuple[str, ...]) -> bool:
    """Whether telling `servers` apart needs vllm's contract (else the engine says it)."""
    return bool(set(servers) & set(vllm.CONTRACTS))


def _only(servers: tuple[str, ...]) -> str:
    """CEL: the spec is served by one of `servers`."""
    return f"{SERVED_BY_CEL if _by_contract(servers) else 'self.engine'} in {list(servers)!r}"


def _where(servers: tuple[str, ...]) -> Value:
    """The {where} of a refusal only `servers` make: the server that makes it."""
    key = SERVED_BY_CEL if _by_contract(servers) else "self.engine"
    return (
        f"{_cel_map({k: SERVERS[k].where for k in servers})}[{key}]",
        lambda s: SERVERS[served_by(s)].where,
    )


def _cel_words(words: str, values: dict[str, str]) -> str:
    """`words` (a str.format template) as a CEL string expression, each {name} the CEL of values[name]."""
    parts = []
    for text, name, _, _ in string.Formatter().parse(words):
        parts += [_cel_string(text)] if text else []
        parts += [values[name]] if name is not None else []
    return " + ".join(parts)


def _rule(
    cel: str,
    check: Callable[[NeuronModelSpec], bool],
    words: str,
    message: str | None = None,
    **values: Value,
) -> Rule:
    """A rule refused in `words` (a str.format template), each {name} filled in with values[name]: by the API
    server (its messageExpression) and by the Python twin alike; `message` is the API server's static one,
    its fallback (default: the words, where they hold no value)."""
    if not values:
        return Rule(cel, message or words, check)
    assert message is not None, "words with values need a static message"
    return Rule(
        cel,
        message,
        check,
        lambda s: words.format(**{k: str(py(s)) for k, (_, py) in values.items()}),
        _cel_words(words, {k: c for k, (c, _) in values.items()}),
    )


# ---- settings only some servers take (left unset, every server takes the spec) -----------------------------

# neuron's settings: what each is, and who takes it
SETTINGS_TAKEN_BY = {
    "expertParallel": ("expert parallelism", ("vllm_plugin", "sglang")),
    "kvCacheDtype": ("a KV cache type", ("vllm_plugin", "sglang")),
    "memoryFraction": ("a device memory fraction", ("sglang",)),
    "hostKVCache": ("our runtime's host KV store", ("embedded",)),
}
ROLE_TENSOR_PARALLEL_TAKEN_BY = ("vllm_plugin",)  # serving.prefill/decode.tensorParallel other than neuron's
SAMPLING_TAKEN_BY = ("embedded",)  # serving.sampling (the operator passes it to our runtime only)
CONNECTOR_TAKEN_BY = ("vllm_plugin",)  # serving.kvTransfer.connector (vLLM's KV connector)
# NxD Inference's settings (quantization, buckets, LNC, overrides), which these compile their own way
NXDI_SETTINGS_REFUSED_BY = ("tgi", "sglang")
NXDI_INSTEAD = "engine vllm"


def _taken_only_by(takers: tuple[str, ...], unset_cel: str, unset: Callable[[NeuronModelSpec], bool],
                   words: str) -> Rule:  # fmt: skip
    """A setting only `takers` take: refused, unless left unset, for any other server; `words` hold {where}
    (the server) and {use} (the takers)."""
    words = words.replace("{use}", " or ".join(SERVERS[t].named for t in takers))
    return _rule(
        f"({unset_cel}) || {_only(takers)}",
        lambda s: unset(s) or served_by(s) in takers,
        words,
        words.format(where="this model's engine"),
        where=_where(tuple(k for k in SERVERS if k not in takers)),
    )


def _setting_rule(name: str, what: str, takers: tuple[str, ...]) -> Rule:
    default = NeuronSettings.model_fields[name].default
    unset_cel = f"!has(self.neuron.{name})" if default is None else f"self.neuron.{name} == {default!r}"
    return _taken_only_by(
        takers,
        unset_cel,
        lambda s: getattr(s.neuron, name) == default,
        f"neuron.{name}: {{where}} has no setting for {what}; remove it, or use {{use}}",
    )


def _role_tensor_parallel_rule(role: str) -> Rule:
    own = f"self.serving.{role}"
    return _taken_only_by(
        ROLE_TENSOR_PARALLEL_TAKEN_BY,
        f"!{DISAGGREGATED_CEL} || !has({own}) || !has({own}.tensorParallel) || "
        f"{own}.tensorParallel == self.neuron.tensorParallel",
        lambda s: (
            getattr(s.serving, role) is None
            or getattr(s.serving, role).tensorParallel in (None, s.neuron.tensorParallel)
        ),
        f"serving.{role}.tensorParallel: {{where}} runs neuron.tensorParallel in every role; remove it, or "
        "use {use}",
    )


def _nxdi_setting_rule(unset_cel: str, unset: Callable[[NeuronModelSpec], bool], words: str,
                       **values: Value) -> Rule:  # fmt: skip
    """An NxD Inference setting, which NXDI_SETTINGS_REFUSED_BY have none for; `words` hold {where} (the
    server), {use} (what takes it) and the `values`' names."""
    words = words.replace("{use}", NXDI_INSTEAD)
    static = words.replace(" {value}", "").format(where="engine " + " or ".join(NXDI_SETTINGS_REFUSED_BY))
    return _rule(
        f"({unset_cel}) || !({_only(NXDI_SETTINGS_REFUSED_BY)})",
        lambda s: unset(s) or s.engine not in NXDI_SETTINGS_REFUSED_BY,
        words,
        static,
        where=_where(NXDI_SETTINGS_REFUSED_BY),
        **values,
    )


# ---- what one server cannot take ---------------------------------------------------------------------------

SEQUENCE = "self.neuron.sequenceLength"
PROMPT_LIMIT: Value = (f"string({MAX_INPUT_CEL})", lambda s: s.neuron.maxInputLength)
CONTEXT_BUT_ONE: Value = (f"string({SEQUENCE} - 1)", lambda s: s.neuron.sequenceLength - 1)
SEQUENCE_LENGTH: Value = (f"string({SEQUENCE})", lambda s: s.neuron.sequenceLength)
INSTANCE: Value = ("self.neuron.instanceType", lambda s: s.neuron.instanceType)
TRANSPORT: Value = (TRANSPORT_CEL, lambda s: s.serving.kvTransfer.transport)
EXPERT_PARALLEL: Value = ("string(self.neuron.expertParallel)", lambda s: s.neuron.expertParallel)
TENSOR_PARALLEL: Value = ("string(self.neuron.tensorParallel)", lambda s: s.neuron.tensorParallel)


def _cel_list(items: str) -> str:
    """CEL: a list of integers as Python prints it, [1, 2]."""
    return f"'[' + {items}.map(b, string(b)).join(', ') + ']'"


def _prompt_limit_rule(engine: str, why: str) -> Rule:
    """An engine that bounds a prompt by its context length only: neuron.maxInputLength is that, but one."""
    words = (
        f"neuron.maxInputLength {{value}} must be neuron.sequenceLength - 1 ({{limit}}) for engine {engine}: "
        f"{why}"
    )
    static = words.replace(" {value}", "").replace(" ({limit})", "").replace("{limit}", "to that")
    return _rule(
        f"self.engine != '{engine}' || {MAX_INPUT_CEL} == {SEQUENCE} - 1",
        lambda s: s.engine != engine or s.neuron.maxInputLength == s.neuron.sequenceLength - 1,
        words,
        static,
        value=PROMPT_LIMIT,
        limit=CONTEXT_BUT_ONE,
    )


def _platform_rule(engine: str, platforms: tuple[str, ...], words: str) -> Rule:
    """An engine that serves some instance families only; `words` hold {names} (the instance types it serves)
    and {instance} (the spec's)."""
    served = [name for name, i in topology.INSTANCES.items() if i.platform in platforms]
    words = words.replace("{names}", ", ".join(served))
    return _rule(
        f"self.engine != '{engine}' || self.neuron.instanceType == 'cpu' || self.neuron.instanceType in "
        f"{served!r}",
        lambda s: s.engine != engine or s.neuron.instanceType == "cpu" or s.neuron.instanceType in served,
        words,
        words.replace(", not {instance}", "").replace(" on {instance}", ""),
        instance=INSTANCE,
    )


def _role_tensor_parallel(role: str) -> Value:
    """A role's tensor parallelism (parallelism.role_tensor_parallel)."""
    own = f"self.serving.{role}"
    return (
        f"(has({own}) && has({own}.tensorParallel) ? {own}.tensorParallel : self.neuron.tensorParallel)",
        lambda s: parallelism.role_tensor_parallel(s, role),
    )


def _plugin_role_expert_parallel_rule(role: str) -> Rule:
    tp_cel, tp = _role_tensor_parallel(role)
    words = f"neuron.expertParallel {{ep}} must divide serving.{role}.tensorParallel {{tp}}"
    return _rule(
        f"{SERVED_BY_CEL} != 'vllm_plugin' || !{DISAGGREGATED_CEL} || !has(self.neuron.expertParallel) || "
        f"{tp_cel} % self.neuron.expertParallel == 0",
        lambda s: (
            served_by(s) != "vllm_plugin"
            or s.serving.mode != "disaggregated"
            or not s.neuron.expertParallel
            or tp(s) % s.neuron.expertParallel == 0
        ),
        words,
        f"neuron.expertParallel must divide serving.{role}.tensorParallel",
        ep=EXPERT_PARALLEL,
        tp=(f"string({tp_cel})", tp),
    )


def _model_type_rule(model_type: str) -> Rule:
    """TGI's export of a model the table of well-known models says is of a type optimum-neuron cannot export
    (matched as topology.known_model matches: hf:// and the id, case-insensitive)."""
    ids = [name for name, shape in topology.KNOWN_MODELS.items() if shape.model_type == model_type]
    pattern = "^hf://(?i:" + "|".join(name.replace(".", "\\\\.") for name in ids) + ")$"
    export = tgi.PINNED.versions["optimum-neuron"]
    words = (
        f"model {{uri}} is a {model_type} model, which optimum-neuron {export} "
        f"(TGI's Neuron export) cannot export; it exports {', '.join(tgi.MODEL_TYPES)} models, or use "
        f"{NXDI_INSTEAD}"
    )
    return _rule(
        f"self.engine != 'tgi' || !self.model.uri.matches('{pattern}')",
        lambda s: (
            s.engine != "tgi"
            or (shape := topology.known_model(s.model.uri)) is None
            or shape.model_type != model_type
        ),
        words,
        words.format(uri=" or ".join(f"hf://{name}" for name in ids)),
        uri=("self.model.uri", lambda s: s.model.uri),
    )


# ---- what an engine's tables say: the signals its pods export, the models it runs a Job for, its buckets ---

# The field of an engine's metric names (`pod_metrics.Names`, its module's METRICS) a signal is read from
# (scaling.signal_metric reads it); the builtin autoscaler reads occupancy as requests over slots instead,
# from either of BUILTIN_OCCUPANCY_FIELDS, an HPA or a ScaledObject as the KV cache in use
SIGNAL_FIELD = {"queue": "waiting", "occupancy": "kv_usage", "ttft": "ttft"}
BUILTIN_OCCUPANCY_FIELDS = ("running", "waiting")
SIGNAL_WHAT = {
    "queue": "waiting-requests metric",
    "occupancy": "KV-cache-use metric",
    "ttft": "time-to-first-token histogram",
}
_METRICS = get_args(Autoscaling.model_fields["metric"].annotation)
_PROVIDERS = get_args(Autoscaling.model_fields["provider"].annotation)
assert set(SIGNAL_FIELD) == set(SIGNAL_WHAT) == set(_METRICS)


def exports(names: Names, metric: str, provider: str) -> bool:
    """Whether pods exporting `names` export `metric` as `provider` reads it."""
    fields = (
        BUILTIN_OCCUPANCY_FIELDS
        if (metric, provider) == ("occupancy", "builtin")
        else (SIGNAL_FIELD[metric],)
    )
    return any(getattr(names, f) is not None for f in fields)


# engine -> "METRIC PROVIDER" of each signal its own pods export nothing for, as that provider reads it (a
# router's pods are ours: they export every signal); engines that export all are left out. In CEL: a map.
UNEXPORTED: dict[str, list[str]] = {
    engine: missing
    for engine, module in ENGINE_MODULES.items()
    if (missing := [f"{m} {p}" for m in _METRICS for p in _PROVIDERS if not exports(module.METRICS, m, p)])
}
assert all(exports(NEURONFLEET, m, p) for m in _METRICS for p in _PROVIDERS)
# "ENGINE PROVIDER" -> the metrics those pods export for that provider, which a refusal suggests
_USABLE = {
    f"{engine} {p}": " or ".join(m for m in ("queue", "occupancy") if f"{m} {p}" not in missing)
    or "queue with provider builtin"
    for engine, missing in UNEXPORTED.items()
    for p in _PROVIDERS
}
_SIGNAL_CEL = "self.autoscaling.metric + ' ' + self.autoscaling.provider"
_UNIFIED_CEL = "self.serving.mode == 'unified'"


def _signal(s: NeuronModelSpec) -> str:
    return f"{s.autoscaling.metric} {s.autoscaling.provider}"


def _signals_named(pairs: list[str]) -> str:
    """The "METRIC PROVIDER" pairs in words: metric occupancy with provider hpa or keda, metric ttft."""
    named = []
    for metric in _METRICS:
        providers = [p for p in _PROVIDERS if f"{metric} {p}" in pairs]
        if providers:
            every = len(providers) == len(_PROVIDERS)
            named.append(f"metric {metric}" + ("" if every else f" with provider {' or '.join(providers)}"))
    return ", ".join(named)


def _unexported_signal_rule() -> Rule:
    """Autoscaling on a signal the engine's pods do not export for the provider (TTFT comes from the entry
    pods: a disaggregated model's routers are ours, and export it)."""
    words = (
        "autoscaling.metric {metric}: engine {engine}'s {role} pods export no {what} for provider {provider} "
        "to read; use metric {instead}"
    )
    missing = "; ".join(f"engine {e} for {_signals_named(pairs)}" for e, pairs in UNEXPORTED.items())
    table = json.dumps(UNEXPORTED)  # (a JSON object of lists of strings is a CEL map literal)
    return _rule(
        f"!self.autoscaling.enabled || (self.autoscaling.metric == 'ttft' && !({_UNIFIED_CEL})) || "
        f"!(self.engine in {table}) || !(({_SIGNAL_CEL}) in {table}[self.engine])",
        lambda s: (
            not s.autoscaling.enabled
            or (s.autoscaling.metric == "ttft" and s.serving.mode != "unified")
            or _signal(s) not in UNEXPORTED.get(s.engine, ())
        ),
        words,
        f"autoscaling.metric: the engine's pods export no such signal for the provider to read (none from "
        f"{missing}); use a metric they export",
        metric=("self.autoscaling.metric", lambda s: s.autoscaling.metric),
        engine=("self.engine", lambda s: s.engine),
        role=(
            f"({_UNIFIED_CEL} ? 'unified' : 'decode')",
            lambda s: "unified" if s.serving.mode == "unified" else "decode",
        ),
        what=(
            f"{_cel_map(SIGNAL_WHAT)}[self.autoscaling.metric]",
            lambda s: SIGNAL_WHAT[s.autoscaling.metric],
        ),
        provider=("self.autoscaling.provider", lambda s: s.autoscaling.provider),
        instead=(
            f"{_cel_map(_USABLE)}[self.engine + ' ' + self.autoscaling.provider]",
            lambda s: _USABLE[f"{s.engine} {s.autoscaling.provider}"],
        ),
    )


# engine -> the model sources it runs a compile Job for (its module's COMPILE_JOB_SOURCES); every other
# engine runs one for every model (engines.compiles)
COMPILE_JOB_ONLY_FOR: dict[str, tuple[str, ...]] = {
    e: m.COMPILE_JOB_SOURCES for e, m in ENGINE_MODULES.items() if hasattr(m, "COMPILE_JOB_SOURCES")
}
assert all(
    getattr(m, "COMPILES", True) and (e in COMPILE_JOB_ONLY_FOR or not hasattr(m, "compiles"))
    for e, m in ENGINE_MODULES.items()
), "an engine that runs no compile Job for some models declares which it runs one for: COMPILE_JOB_SOURCES"
# The compile Job's settings (compile.cache is the model's claim, which every engine's pods mount)
COMPILE_JOB_FIELDS = tuple(name for name in Compile.model_fields if name != "cache")
_RUNS_COMPILE_JOB_CEL = " && ".join(
    f"(self.engine != '{e}' || "
    + " || ".join(f"self.model.uri.startsWith({_cel_string(source)})" for source in sources)
    + ")"
    for e, sources in COMPILE_JOB_ONLY_FOR.items()
)


def runs_compile_job(s: NeuronModelSpec) -> bool:
    """Whether the engine runs a compile Job for the spec's model (in CEL: _RUNS_COMPILE_JOB_CEL)."""
    return s.engine not in COMPILE_JOB_ONLY_FOR or s.model.uri.startswith(COMPILE_JOB_ONLY_FOR[s.engine])


def _default_cel(path: str, field: FieldInfo) -> str:
    """CEL: the field at `path` holds its default (the API server fills the defaults in before the rules)."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return " && ".join(_default_cel(f"{path}.{n}", f) for n, f in type(value).model_fields.items())
        assert value in ({}, []), (path, value)
        return f"size({path}) == 0"
    return f"!has({path})" if field.default is None else f"{path} == {json.dumps(field.default)}"


def _at_default(section: BaseModel, name: str) -> bool:
    """Whether a section's field holds its default (in CEL: _default_cel)."""
    default = type(section).model_fields[name].get_default(call_default_factory=True)
    value = getattr(section, name)
    return value.model_dump() == default.model_dump() if isinstance(value, BaseModel) else value == default


# A compile field's default before it was derived, which objects stored then carry: as good as unset
FORMER_COMPILE_DEFAULTS = {"activeDeadlineSeconds": FORMER_COMPILE_DEADLINE}


def _compile_job_field_rule(name: str) -> Rule:
    """A compile Job's setting where the engine runs no compile Job (a field is used or refused, never
    dropped)."""
    path = f"self.compile.{name}"
    default_cel = _default_cel(path, Compile.model_fields[name])
    if name in FORMER_COMPILE_DEFAULTS:
        default_cel = f"{default_cel} || {path} == {FORMER_COMPILE_DEFAULTS[name]}"
    words = (
        f"compile.{name}: engine {{engine}} runs no compile Job for this model (it compiles as each server "
        f"starts; a Job only fetches a model from {{sources}}); remove compile.{name}"
    )
    sources = {e: " or ".join(s) for e, s in COMPILE_JOB_ONLY_FOR.items()}
    return _rule(
        f"{_RUNS_COMPILE_JOB_CEL} || ({default_cel})",
        lambda s: (
            runs_compile_job(s)
            or _at_default(s.compile, name)
            or getattr(s.compile, name) == FORMER_COMPILE_DEFAULTS.get(name, object())
        ),
        words,
        words.format(engine=" or ".join(sources), sources=" or ".join(sorted(set(sources.values())))),
        engine=("self.engine", lambda s: s.engine),
        sources=(f"{_cel_map(sources)}[self.engine]", lambda s: sources[s.engine]),
    )


# The servers whose buckets the spec's limits bound: the largest context bucket is the prompt limit, the
# largest generation bucket the sequence length (not those whose buckets are their own kind, a module's
# BUCKETS_ARE_LIMITS = False, nor those that take no buckets at all: NXDI_SETTINGS_REFUSED_BY)
BUCKETS_BOUNDED_BY = tuple(
    k
    for k, m in SERVER_MODULES.items()
    if getattr(m, "BUCKETS_ARE_LIMITS", True) and k not in NXDI_SETTINGS_REFUSED_BY
)


def _largest_bucket_rule(kind: str, limit_name: str, limit: Value, limit_words: Value) -> Rule:
    """The largest bucket of `kind` (when the buckets are increasing: else the spec's rule refuses them)
    must be the spec's limit, or requests the spec accepts would fit no bucket; `limit`: that limit's CEL
    (an integer) and Python, `limit_words` it in a refusal."""
    items = f"self.neuron.buckets.{kind}"
    last = f"{items}[size({items}) - 1]"
    words = (
        f"the largest neuron.buckets.{kind} bucket ({{last}}) must equal neuron.{limit_name} {{limit}}, or "
        f"requests that the spec accepts would fit no bucket: end neuron.buckets.{kind} with {{end}}, or "
        f"leave it empty (derived from neuron.{limit_name})"
    )
    limit_cel, limit_of = limit
    return _rule(
        f"!({_only(BUCKETS_BOUNDED_BY)}) || size({items}) == 0 || !{items}.isSorted() || "
        f"{last} == {limit_cel}",
        lambda s: (
            served_by(s) not in BUCKETS_BOUNDED_BY
            or not (b := getattr(s.neuron.buckets, kind))
            or b != sorted(b)
            or b[-1] == limit_of(s)
        ),
        words,
        f"the largest neuron.buckets.{kind} bucket must equal neuron.{limit_name}, or requests that the spec "
        f"accepts would fit no bucket",
        last=(f"string({last})", lambda s: getattr(s.neuron.buckets, kind)[-1]),
        limit=limit_words,
        end=(f"string({limit_cel})", limit_of),
    )


PROMPT_LIMIT_VALUED: Value = (
    f"string({MAX_INPUT_CEL}) + (has(self.neuron.maxInputLength) ? '' : ' (the default of engine ' + "
    "self.engine + ', not set)')",
    lambda s: (
        f"{s.neuron.maxInputLength}"
        + (
            ""
            if "maxInputLength" in s.neuron.model_fields_set
            else f" (the default of engine {s.engine}, not set)"
        )
    ),
)

_UNEXPORTABLE = sorted(
    {m.model_type for m in topology.KNOWN_MODELS.values() if m.model_type not in tgi.MODEL_TYPES}
)
_PLUGIN_WHERE = SERVERS["vllm_plugin"].where
_PLUGIN_QUANTIZATION = (
    f"neuron.quantization {{value}} is NxD Inference's (engine vllm on Inf2/Trn1); {_PLUGIN_WHERE} reads "
    "pre-quantized checkpoints and quantizes to mxfp4 or mxfp8 itself: remove neuron.quantization, or set "
    'neuron.overrides {{"quantization": "mxfp8"}}'
)
_SAMPLING_SET = " || ".join(f"has(self.serving.sampling.{name})" for name in Sampling.model_fields)
_AUTO_CAST = list(tgi.AUTO_CAST_TYPES)
_NXDI = vllm_nxdi.PINNED.versions
_NXDI_VERSIONS = (
    f"vLLM {_NXDI['vllm']}, vllm-neuron {_NXDI['vllm-neuron']} over NxD Inference, the last image for them"
)

RULES: tuple[Rule, ...] = (
    # settings only some servers take
    *(_setting_rule(name, what, takers) for name, (what, takers) in SETTINGS_TAKEN_BY.items()),
    _role_tensor_parallel_rule("prefill"),
    _role_tensor_parallel_rule("decode"),
    _taken_only_by(
        SAMPLING_TAKEN_BY,
        f"!({_SAMPLING_SET})",
        lambda s: not s.serving.sampling.generation_config(),
        "serving.sampling: the operator does not yet pass sampling defaults to {where}; remove it, or use "
        "{use}",
    ),
    _taken_only_by(
        CONNECTOR_TAKEN_BY,
        "!has(self.serving.kvTransfer.connector)",
        lambda s: s.serving.kvTransfer.connector is None,
        "serving.kvTransfer.connector names vLLM's KV connector, which {where} has not; remove it, or use "
        "{use}",
    ),
    _nxdi_setting_rule(
        "self.neuron.quantization == 'none'",
        lambda s: s.neuron.quantization == "none",
        "neuron.quantization {value}: {where} has no setting for it; use none or {use}",
        value=("self.neuron.quantization", lambda s: s.neuron.quantization),
    ),
    _nxdi_setting_rule(
        "size(self.neuron.buckets.context) == 0 && size(self.neuron.buckets.generation) == 0",
        lambda s: not s.neuron.buckets.context and not s.neuron.buckets.generation,
        "neuron.buckets: {where} compiles its own length buckets; remove them or use {use}",
    ),
    _nxdi_setting_rule(
        "!has(self.neuron.logicalCores)",
        lambda s: s.neuron.logicalCores is None,
        "neuron.logicalCores: {where} has no setting for it; remove it or use {use}",
    ),
    # the prompt limit of the engines that bound a prompt by the context only
    _prompt_limit_rule(
        "vllm",
        "vLLM bounds a prompt only by --max-model-len (neuron.sequenceLength), leaving one token to "
        "generate, so a lower limit would not be enforced; set neuron.maxInputLength {limit}",
    ),
    _prompt_limit_rule(
        "sglang",
        "SGLang bounds a prompt by the context length only (--context-length), so a lower limit would not be "
        f"enforced; remove neuron.maxInputLength (its default is that) or use {NXDI_INSTEAD}",
    ),
    # the instance families an engine serves
    _platform_rule(
        "tgi",
        tgi.PLATFORMS,
        f"engine tgi (TGI {tgi.PINNED.versions['text-generation-inference']}'s Neuron backend) runs on "
        "Inferentia2 and Trainium1 instances ({names}), not {instance}; use one of those, or engine vllm on "
        "{instance}",
    ),
    _platform_rule(
        "sglang",
        sglang.PLATFORMS,
        f"engine sglang (SGLang-Neuron {sglang.PINNED.versions['sglang-neuron']}) serves LLMs on Trn3 "
        f"instances ({{names}}), not {{instance}}; use one of those, or {NXDI_INSTEAD} on {{instance}}",
    ),
    # vLLM over NxD Inference (Inf2, Trn1)
    _rule(
        f"{SERVED_BY_CEL} != 'vllm_nxdi' || !{DISAGGREGATED_CEL}",
        lambda s: served_by(s) != "vllm_nxdi" or s.serving.mode != "disaggregated",
        f"serving.mode disaggregated: engine vllm on Inf2 and Trn1 ({_NXDI_VERSIONS}) has no KV-cache "
        "connector (its Known Issues: disaggregated inference only on the legacy vLLM fork); use "
        "serving.mode unified, or engine vllm on Trn2 or Trn3, whose plugin moves the KV cache with NIXL "
        "over EFA",
    ),
    # the vLLM Neuron plugin (Trn2, Trn3)
    _rule(
        f"{SERVED_BY_CEL} != 'vllm_plugin' || self.neuron.quantization == 'none'",
        lambda s: served_by(s) != "vllm_plugin" or s.neuron.quantization == "none",
        _PLUGIN_QUANTIZATION,
        _PLUGIN_QUANTIZATION.replace(" {value}", "").format(),
        value=("self.neuron.quantization", lambda s: s.neuron.quantization),
    ),
    # (its context buckets are prefill token counts, at most neuron.sequenceLength: the spec's rule that they
    # lie within neuron.maxInputLength, sequenceLength - 1 for vllm, says more)
    _rule(
        f"{SERVED_BY_CEL} != 'vllm_plugin' || self.neuron.buckets.generation.all(b, b % 128 == 0 && b < "
        f"{SEQUENCE})",
        lambda s: (
            served_by(s) != "vllm_plugin"
            or all(b % 128 == 0 and b < s.neuron.sequenceLength for b in s.neuron.buckets.generation)
        ),
        f"neuron.buckets.generation {{buckets}}: {_PLUGIN_WHERE} takes them as decode context lengths "
        "(decode_context_length_buckets), each a multiple of 128 below neuron.sequenceLength ({length}); "
        "{bad} are not",
        f"neuron.buckets.generation: {_PLUGIN_WHERE} takes them as decode context lengths "
        "(decode_context_length_buckets), each a multiple of 128 below neuron.sequenceLength",
        buckets=(_cel_list("self.neuron.buckets.generation"), lambda s: s.neuron.buckets.generation),
        length=SEQUENCE_LENGTH,
        bad=(
            _cel_list(f"self.neuron.buckets.generation.filter(b, b % 128 != 0 || b >= {SEQUENCE})"),
            lambda s: [b for b in s.neuron.buckets.generation if b % 128 or b >= s.neuron.sequenceLength],
        ),
    ),
    *(
        _rule(
            f"!({_only((server,))}) || !has(self.neuron.expertParallel) || self.neuron.tensorParallel % "
            "self.neuron.expertParallel == 0",
            lambda s, server=server: (
                served_by(s) != server
                or not s.neuron.expertParallel
                or s.neuron.tensorParallel % s.neuron.expertParallel == 0
            ),
            f"neuron.expertParallel {{ep}} must divide neuron.tensorParallel {{tp}} ({why})",
            f"neuron.expertParallel must divide neuron.tensorParallel ({why})",
            ep=EXPERT_PARALLEL,
            tp=TENSOR_PARALLEL,
        )
        for server, why in (
            ("vllm_plugin", "ep_degree divides the world size"),
            ("sglang", "SGLang's --ep-size"),
        )
    ),
    _plugin_role_expert_parallel_rule("prefill"),
    _plugin_role_expert_parallel_rule("decode"),
    _rule(
        f"!({_only(('vllm_plugin', 'sglang'))}) || !{DISAGGREGATED_CEL} || {TRANSPORT_CEL} == 'efa'",
        lambda s: (
            served_by(s) not in ("vllm_plugin", "sglang")
            or s.serving.mode != "disaggregated"
            or s.serving.kvTransfer.transport == "efa"
        ),
        "kvTransfer.transport {transport}: {where} moves the KV cache with NIXL over LIBFABRIC (EFA); use "
        "kvTransfer.transport efa",
        "kvTransfer.transport: engines vllm and sglang move the KV cache with NIXL over LIBFABRIC (EFA); use "
        "kvTransfer.transport efa",
        transport=TRANSPORT,
        where=_where(("vllm_plugin", "sglang")),
    ),
    _rule(
        f"{SERVED_BY_CEL} != 'vllm_plugin' || !{DISAGGREGATED_CEL} || {TRANSPORT_CEL} != 'efa' || "
        "self.serving.kvTransfer.efaInterfaces > 0",
        lambda s: (
            served_by(s) != "vllm_plugin"
            or s.serving.mode != "disaggregated"
            or s.serving.kvTransfer.transport != "efa"
            or s.serving.kvTransfer.efaInterfaces > 0
        ),
        "kvTransfer.efaInterfaces 0: NIXL's LIBFABRIC backend reads the KV cache over the pods' EFA devices; "
        "request at least 1",
    ),
    # TGI's Neuron backend (Inf2, Trn1)
    _rule(
        f"self.engine != 'tgi' || {DTYPE_CEL} in {_AUTO_CAST!r}",
        lambda s: s.engine != "tgi" or s.neuron.dtype in tgi.AUTO_CAST_TYPES,
        "neuron.dtype {dtype}: engine tgi casts to bfloat16 or float16 (HF_AUTO_CAST_TYPE, the export's "
        "--auto_cast_type); choose one of those",
        "neuron.dtype: engine tgi casts to bfloat16 or float16 (HF_AUTO_CAST_TYPE, the export's "
        "--auto_cast_type); choose one of those",
        dtype=(DTYPE_CEL, lambda s: s.neuron.dtype),
    ),
    _rule(
        "self.engine != 'tgi' || !has(self.model.revision) || self.model.uri.startsWith('hf://')",
        lambda s: s.engine != "tgi" or s.model.revision is None or s.model.uri.startswith("hf://"),
        "model.revision applies to hf:// models only, not {uri}; remove it",
        "model.revision applies to hf:// models only; remove it",
        uri=("self.model.uri", lambda s: s.model.uri),
    ),
    *(_model_type_rule(t) for t in _UNEXPORTABLE),
    # what the engine's tables say: the signals its pods export, the models it runs a compile Job for, and
    # whether its buckets are the spec's limits
    _unexported_signal_rule(),
    *(_compile_job_field_rule(name) for name in COMPILE_JOB_FIELDS),
    _largest_bucket_rule(
        "context", "maxInputLength", (MAX_INPUT_CEL, lambda s: s.neuron.maxInputLength), PROMPT_LIMIT_VALUED
    ),
    _largest_bucket_rule(
        "generation", "sequenceLength", (SEQUENCE, lambda s: s.neuron.sequenceLength), SEQUENCE_LENGTH
    ),
)


def override_refusals(spec: NeuronModelSpec) -> list[str]:
    """Refusals of neuron.overrides, which CEL cannot read (the module's docstring): NxD Inference's fields
    for a server that reads none of them, and, for engine vllm, a field neuronfleet derives from the spec or
    vLLM's sequence buckets past the batch."""
    n, by, out = spec.neuron, served_by(spec), []
    if by in NXDI_SETTINGS_REFUSED_BY and n.overrides:
        out.append(
            f"neuron.overrides are NxDI NeuronConfig fields, which {SERVERS[by].where} does not read; remove "
            f"them or use {NXDI_INSTEAD}"
        )
    derived = vllm.CONTRACTS[by].DERIVED if by in vllm.CONTRACTS else {}
    for key in sorted(set(n.overrides) & set(derived)):
        out.append(
            f"neuron.overrides.{key} is set by neuronfleet for engine vllm from {derived[key]}; remove it"
        )
    seqs = n.overrides.get("num_seqs_buckets")
    if by == "vllm_plugin" and isinstance(seqs, list) and seqs and seqs[-1] != n.batchSize:
        out.append(
            f"neuron.overrides.num_seqs_buckets {seqs}: the largest must equal neuron.batchSize "
            f"({n.batchSize}, --max-num-seqs)"
        )
    return out
