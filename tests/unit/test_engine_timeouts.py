"""Compile and start timeouts that fit the model (operator/engines/timeouts.py): every Neuron sample and
variants are rendered by the builders, and what the engine is told (the vLLM plugin's and vLLM's variables,
read back against the contract record tests/data/vllm-neuron-sdk2.32.0-names.json), the compile Job's
deadline and each serving pod's startup probe are held to agreeing with each other and with the values the
pinned recipes set; the spec's own timeouts replace the derived ones. Also what a pod is given beside:
SGLang's working directory, compile.json's record of the engine's own Neuron settings."""

from __future__ import annotations

import json
import re

import pytest
from engine_renders import manifest, of_kind, rendered
from support import ROOT

from neuronfleet.contract import COMPILE_CONFIG_FILE, CompileConfig
from neuronfleet.operator import topology, validation
from neuronfleet.operator.engines import timeouts, vllm_plugin

RECORD = json.loads((ROOT / "tests" / "data" / "vllm-neuron-sdk2.32.0-names.json").read_text())
RECIPES = RECORD["timeouts"]  # the values the plugin's recipes at the pin set
SAMPLES = sorted(
    p.name for p in (ROOT / "crds" / "samples").glob("*.yaml") if "instanceType: cpu" not in p.read_text()
)
TRN2 = "llama-3.3-70b-vllm-trn2.yaml"
TRN2_PD = "llama-3.3-70b-vllm-trn2-disaggregated.yaml"
SGLANG_PD = "gpt-oss-120b-sglang-trn3-disaggregated.yaml"
INF2 = "llama-3.1-8b-vllm-inf2.yaml"
ROLE = "neuronfleet.dev/role"
PLUGIN_TIMEOUTS = ("VLLM_NEURON_COMPILATION_TIMEOUT", "NEURON_LIBTORCH_COMPILATION_TIMEOUT",
                   "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "VLLM_ENGINE_READY_TIMEOUT_S")  # fmt: skip


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def servers(objects: list[dict]) -> dict[str, dict]:
    """role -> the serving container of each role but the router."""
    return {
        d["metadata"]["labels"][ROLE]: d["spec"]["template"]["spec"]["containers"][0]
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"][ROLE] != "router"
    }


def compile_job(objects: list[dict]) -> dict | None:
    jobs = of_kind(objects, "Job")
    return jobs[0] if jobs else None


def budget(probe: dict) -> int:
    return probe["periodSeconds"] * probe["failureThreshold"]


def neuron_samples() -> list[str]:
    return [
        s for s in SAMPLES if re.search(r"instanceType: (inf2|trn)", (ROOT / "crds/samples" / s).read_text())
    ]


@pytest.mark.parametrize("name", neuron_samples())
def test_the_startup_probe_outlasts_the_engines_own_start_and_the_job_holds_the_compile(name):
    """Each Neuron pod's startup probe holds the engine's start (so the engine's own timeout, where it has
    one, fires first and says why), by at most the start guard's slack and a period; the vLLM plugin's pods
    are told that start; its compile Job's server may take the whole warm-up compile, within the Job's
    deadline, and each graph at least what the recipes at the pin give one."""
    spec, objects = rendered(manifest(name))
    for role, c in servers(objects).items():
        start = timeouts.start_seconds(spec, compiles_at_start=spec.engine == "sglang")
        probe = c["startupProbe"]
        assert probe["periodSeconds"] == timeouts.NEURON_PROBE_PERIOD_S, (name, role)
        assert start + timeouts.START_SLACK_S <= budget(probe) < start + timeouts.START_SLACK_S + 10, (
            name, role)  # fmt: skip
        env = env_of(c)
        if spec.engine == "vllm" and topology.INSTANCES[spec.neuron.instanceType].platform in (
            "trn2",
            "trn3",
        ):
            assert int(env["VLLM_ENGINE_READY_TIMEOUT_S"]) == start, (name, role)
            assert int(env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"]) >= 1200
            assert "VLLM_NEURON_COMPILATION_TIMEOUT" not in env  # serving pods never compile
        else:  # the other engines document no start variable at their pins (docs/operator.md, Timeouts)
            assert not set(PLUGIN_TIMEOUTS) & set(env), (name, role)
    job = compile_job(objects)
    if job is None:  # (SGLang compiles as each server starts)
        return
    deadline = job["spec"]["activeDeadlineSeconds"]
    assert deadline >= 14400 or spec.compile.activeDeadlineSeconds == deadline
    env = env_of(job["spec"]["template"]["spec"]["containers"][-1])
    if "VLLM_ENGINE_READY_TIMEOUT_S" in env:
        graph = int(env["VLLM_NEURON_COMPILATION_TIMEOUT"])
        assert graph == int(env["NEURON_LIBTORCH_COMPILATION_TIMEOUT"]) == int(
            env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"])  # fmt: skip
        assert graph >= max(int(v) for v in RECIPES["VLLM_NEURON_COMPILATION_TIMEOUT"] if int(v) < 6000)
        passes = len(set(re.findall(r"--tensor-parallel-size (\d+)", of_kind(objects, "ConfigMap")[0]["data"]
                                    ["compile.sh"])))  # fmt: skip
        ready = int(env["VLLM_ENGINE_READY_TIMEOUT_S"])
        assert ready > graph and passes * ready < deadline


def test_a_larger_model_gets_longer_timeouts_and_the_documented_anchors_hold():
    """8B, 70B and 405B on Trn2: longer with the model, never below the recipes' values; GPT-OSS 120B's start
    is its recipe's 5400 s (to the minute), a model of unknown size the largest a recipe sets."""
    seen = []
    for uri in ("hf://meta-llama/Llama-3.1-8B-Instruct", "hf://meta-llama/Llama-3.3-70B-Instruct",
                "hf://meta-llama/Llama-3.1-405B-Instruct"):  # fmt: skip
        spec, _ = validation.parse(manifest(TRN2, {"model": {"uri": uri}}))
        seen.append(
            (timeouts.graph_seconds(spec), timeouts.load_seconds(spec), timeouts.compile_deadline(spec, 1))
        )
    assert seen == sorted(seen) and seen[0] < seen[2]
    assert seen[0][0] >= 2400 and seen[0][1] >= max(int(v) for v in RECIPES["VLLM_ENGINE_READY_TIMEOUT_S"] if
                                                    int(v) < 5400)  # fmt: skip
    assert seen[2][2] > 14400  # a 405B compile would not fit the former fixed deadline
    gpt, _ = validation.parse(manifest(SGLANG_PD))
    assert abs(timeouts.load_seconds(gpt) - 5400) <= 120 and timeouts.graph_seconds(gpt) == 2400
    unknown, _ = validation.parse(manifest(TRN2, {"model": {"uri": "pvc://models/llama", "secretRef": None}}))
    assert timeouts.graph_seconds(unknown) == max(int(v) for v in RECIPES["VLLM_NEURON_COMPILATION_TIMEOUT"])
    assert timeouts.load_seconds(unknown) == max(int(v) for v in RECIPES["VLLM_ENGINE_READY_TIMEOUT_S"])


def test_the_specs_own_timeouts_reach_the_job_the_engine_and_every_role_of_a_disaggregated_model():
    change = {"compile": {"timeoutSeconds": 5000, "activeDeadlineSeconds": 50000},
              "serving": {"startTimeoutSeconds": 7200}}  # fmt: skip
    obj = manifest(TRN2_PD)
    for section, fields in change.items():
        obj["spec"].setdefault(section, {}).update(fields)
    _, objects = rendered(obj)
    job = compile_job(objects)
    assert job["spec"]["activeDeadlineSeconds"] == 50000
    env = env_of(job["spec"]["template"]["spec"]["containers"][-1])
    assert env["VLLM_NEURON_COMPILATION_TIMEOUT"] == env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "5000"
    roles = servers(objects)
    assert set(roles) == {"prefill", "decode"}
    for role, c in roles.items():
        assert env_of(c)["VLLM_ENGINE_READY_TIMEOUT_S"] == "7200", role
        assert env_of(c)["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] == "5000", role
        assert budget(c["startupProbe"]) == 7200 + timeouts.START_SLACK_S, role
    (router,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["labels"][ROLE] == "router"]
    assert (
        budget(router["spec"]["template"]["spec"]["containers"][0]["startupProbe"]) == 3600
    )  # loads nothing


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"compile": {"timeoutSeconds": 3000, "activeDeadlineSeconds": 2000}},
         "compile.activeDeadlineSeconds must be at least compile.timeoutSeconds"),
        ({"serving": {"startTimeoutSeconds": 30}}, "startTimeoutSeconds"),
    ],
)  # fmt: skip
def test_timeouts_that_cannot_hold_are_refused_saying_which(change, words):
    obj = manifest(TRN2)
    for section, fields in change.items():
        obj["spec"].setdefault(section, {}).update(fields)
    report = validation.check(obj)
    assert not report.ok and any(words in e for e in report.errors), report.errors


def test_sglang_starts_python_outside_workspace_with_nothing_mounted_there():
    """SGLang-Neuron's troubleshooting page: torch_neuronx fails to load when Python starts in /workspace or a
    volume is mounted there (sglang.WORKING_DIR)."""
    _, objects = rendered(manifest(SGLANG_PD))
    for role, c in servers(objects).items():
        assert c["workingDir"] == "/tmp" and not c["workingDir"].startswith("/workspace"), role
        assert not [m for m in c["volumeMounts"] if m["mountPath"].startswith("/workspace")], role
        assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), role  # it exists, the pod's own


@pytest.mark.parametrize(
    ("name", "keys"),
    [(TRN2, set(vllm_plugin.DERIVED)), (INF2, {"tp_degree", "batch_size", "seq_len"})],
)
def test_compile_json_records_the_engines_own_neuron_settings(name, keys):
    """The vLLM plugin's neuron_config (no NxD Inference key: the plugin has its own model code), NxD
    Inference's NeuronConfig for vLLM on Inf2/Trn1; none for SGLang-Neuron (TorchNeuron), whose only compile
    Job fetches an s3:// model."""
    buckets = {"context": [1024, 8192], "generation": [4096, 8192]}
    change = {"neuron": {"buckets": buckets, "expertParallel": 8}} if name == TRN2 else {}
    obj = manifest(name, change)
    spec, objects = rendered(obj)
    recorded = compile_json(objects).neuronConfig
    if name == TRN2:
        assert recorded == vllm_plugin.neuron_config(spec) and set(recorded) == keys
        assert not {"tp_degree", "batch_size", "seq_len", "torch_dtype"} & set(recorded)
    else:
        assert keys <= set(recorded)
    _, objects = rendered(manifest(SGLANG_PD, {"model": {"uri": "s3://models/gpt-oss-120b"}}))
    assert compile_json(objects).neuronConfig == {}


def compile_json(objects: list[dict]) -> CompileConfig:
    data = next(o["data"] for o in of_kind(objects, "ConfigMap") if COMPILE_CONFIG_FILE in o.get("data", {}))
    return CompileConfig.model_validate_json(data[COMPILE_CONFIG_FILE])


@pytest.mark.parametrize(
    ("name", "change", "roles"),
    [
        ("smollm2-135m-local-cpu.yaml", {"neuron": {"sequenceLength": 2048}}, {"unified": 205}),
        (
            "smollm2-135m-local-cpu.yaml",
            {"neuron": {"sequenceLength": 128, "maxInputLength": 64}},
            {"unified": 30},
        ),
        ("smollm2-135m-local-cpu-disaggregated.yaml", {}, {"decode": 52, "prefill": 30}),
    ],
)
def test_a_serving_pod_of_our_runtime_is_given_the_time_to_finish_what_it_may_hold(name, change, roles):
    """Every slot generating a whole sequence at DRAIN_TOKENS_PER_S: the server's --grace-period (its drain)
    and, beyond it, the pod's terminationGracePeriodSeconds (the preStop sleep, the drain and a margin); the
    runtime's default where that is longer, and for the roles that hold no generating request."""
    from neuronfleet.operator import builders

    _, objects = rendered(manifest(name, change))
    for deployment in of_kind(objects, "Deployment"):
        role = deployment["metadata"]["labels"][ROLE]
        pod = deployment["spec"]["template"]["spec"]
        command = pod["containers"][0]["command"]
        grace = float(command[command.index("--grace-period") + 1]) if "--grace-period" in command else 30.0
        assert grace == roles.get(role, 30.0), role  # (a front door: the default)
        assert pod["terminationGracePeriodSeconds"] >= builders.ENDPOINT_DRAIN_SECONDS + grace, role
