"""vLLM on Inf2 and Trn1 (the plugin over NxD Inference) against its pinned contract
(operator/engines/vllm_nxdi.py `PINNED`): every vLLM sample on those instances, and variants that switch on
each optional setting, is rendered by the builders, and every argument, config key and environment variable of
the serving pod and of the compile Job is read back with a parser built from the recorded facts (their names
and values), not from the code that emits them: an unrecorded name, or a value of another type or outside the
recorded choices, fails. Every recorded fact is emitted by some rendering (none is stale), names its source at
a version, and is found in the record of the pin's sources (tests/data/vllm-nxdi-sdk2.31.1-names.json: where
each name appears in the v2.31.1 user and API guides and the vllm 0.16.0 wheel).

vLLM's own parser is not used: the vllm 0.16.0 wheel is 508 MB and its modules import vLLM's torch; the
plugin is not on PyPI (docs/engine-vllm.md says what was read).

Also: the compile Job runs on the serving instance type with the serving pods' Neuron cores and the Neuron
taint tolerated; the containers run as the image's own user, with the capabilities its quickstart adds; the
serving start guard (run with /bin/sh against a folder) starts vLLM only on complete artifacts of its hash,
and otherwise exits 1 with the reason in the termination log; what the engine cannot do is refused at
validation with a message."""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
from pathlib import Path

import engine_renders
import pytest
from engine_renders import check_env, check_value, manifest, of_kind, rendered, serving_deployment
from support import ROOT

from neuronfleet.contract import CACHE_MOUNT, TERMINATION_LOG_ENV
from neuronfleet.operator import builders, pod_parts, validation
from neuronfleet.operator.engines import vllm_nxdi as vllm
from neuronfleet.operator.engines.common import Fact

SAMPLES = sorted(
    p.name
    for p in (ROOT / "crds" / "samples").glob("*.yaml")
    if "engine: vllm" in p.read_text() and re.search(r"instanceType: (inf2|trn1)", p.read_text())
)
RECORD = json.loads((ROOT / "tests" / "data" / "vllm-nxdi-sdk2.31.1-names.json").read_text())["names"]
# Variants of the samples that switch on every optional setting (revision, buckets, quantization, LNC, a user
# override, a pvc:// model): each must validate, and its rendering is checked like the samples'.
VARIANTS = {
    "inf2 fp8, buckets, revision, override": (
        "llama-3.1-8b-vllm-inf2.yaml",
        {"neuron": {"quantization": "fp8", "dtype": "float16", "overrides": {"fused_qkv": True},
                    "buckets": {"context": [1024, 8191], "generation": [4096, 8192]}},
         "model": {"revision": "v1"}},
    ),
    "trn1 int8": ("llama-3.1-70b-vllm-trn1.yaml", {"neuron": {"quantization": "int8"}}),
    "trn1 pvc model": (
        "llama-3.1-70b-vllm-trn1.yaml", {"model": {"uri": "pvc://models/llama-3.1-70b", "secretRef": None}},
    ),
}  # fmt: skip


def cases() -> list[tuple[str, dict]]:
    return engine_renders.cases(SAMPLES, VARIANTS)


# ---- a reader built from the recorded facts ---------------------------------------------------------------


def facts(kind: str) -> dict[str, Fact]:
    return {f.name: f for f in vllm.PINNED.facts if f.kind == kind}


def value_type(fact: Fact):
    """argparse `type` for a recorded value kind."""
    return {"int": int, "json": json.loads, "str": str, "path": str}[fact.value]


def parser() -> argparse.ArgumentParser:
    """`vllm serve` as recorded: only the pinned flags, each with its recorded value kind or choices."""
    p = argparse.ArgumentParser(prog="vllm serve", exit_on_error=False, allow_abbrev=False)
    for name, fact in facts("arg").items():
        if not name.startswith("--"):
            p.add_argument(name.replace("-", "_"), type=value_type(fact))
        elif fact.value == "flag":
            p.add_argument(name, action="store_true")
        elif "|" in fact.value:
            p.add_argument(name, choices=fact.value.split("|"))
        else:
            p.add_argument(name, type=value_type(fact))
    return p


def check_override(override: dict, spec, seen: set[str]) -> None:
    """override_neuron_config: recorded NxDI fields, and the spec's own overrides passed through as given."""
    recorded = facts("config")
    for key, value in override.items():
        if key in spec.neuron.overrides:
            assert value == spec.neuron.overrides[key]
            continue
        fact = recorded.get(f"{vllm.OVERRIDE}.{key}")
        assert fact is not None, f"override_neuron_config.{key} is not recorded in PINNED"
        check_value(fact, value)
        seen.add(fact.name)


def check_additional_config(config: dict, spec, seen: set[str]) -> None:
    assert set(config) <= set(facts("config")), f"unrecorded --additional-config keys: {set(config)}"
    seen.add(vllm.OVERRIDE)
    check_override(config[vllm.OVERRIDE], spec, seen)


def check_serving(deployment: dict, spec, seen: set[str]) -> None:
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][4:6] == ["vllm", "serve"]
    args = c["command"][6:]
    parsed, unknown = parser().parse_known_args(args)
    assert unknown == [], f"unrecorded vllm serve arguments: {unknown}"
    seen.update(a for a in args if a.startswith("--"))
    seen.add("model_tag")
    check_additional_config(parsed.additional_config, spec, seen)
    check_env(c["env"], facts("env"), seen)


def kwarg_facts() -> dict[str, Fact]:
    """vllm.LLM's keywords are the engine arguments' names (`--max-num-seqs` -> max_num_seqs; a
    `--no-X` switch -> X=False): the recorded flags under those names."""
    out = {}
    for name, fact in facts("arg").items():
        if name.startswith("--"):
            out[name.removeprefix("--no-").removeprefix("--").replace("-", "_")] = fact
    return out


def check_compile(objects: list[dict], spec, seen: set[str]) -> None:
    script = next(o["data"]["compile_vllm.py"] for o in of_kind(objects, "ConfigMap"))
    values = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(script).body
        if isinstance(node, ast.Assign) and node.targets[0].id in ("MODEL", "REVISION", "ENGINE_ARGS")
    }
    recorded = kwarg_facts()
    for key, value in values["ENGINE_ARGS"].items():
        fact = recorded.get(key)
        assert fact is not None, f"LLM({key}=...) is not a recorded engine argument"
        if fact.value == "flag":
            assert value is False, (key, value)  # the recorded switch is the --no- form
        elif fact.value == "json":
            check_additional_config(value, spec, seen)
        else:
            check_value(fact, value)
    job = of_kind(objects, "Job")[0]
    check_env(job["spec"]["template"]["spec"]["containers"][0]["env"], facts("env"), seen)


@pytest.mark.parametrize(("label", "obj"), cases(), ids=[c[0] for c in cases()])
def test_every_name_the_engine_emits_is_recorded_with_its_values(label, obj):
    spec, objects = rendered(obj)
    seen: set[str] = set()
    check_serving(serving_deployment(objects), spec, seen)
    check_compile(objects, spec, seen)


def test_every_recorded_fact_is_emitted_somewhere_and_names_a_versioned_source():
    seen: set[str] = set()
    for _, obj in cases():
        spec, objects = rendered(obj)
        check_serving(serving_deployment(objects), spec, seen)
        check_compile(objects, spec, seen)
    assert {f.name for f in vllm.PINNED.facts} == seen
    versioned = re.compile(r"(@(v|release-)?\d+\.\d+|/v\d+\.\d+|\b\d+\.\d+\.\d+\b|@c63afe0)")
    for fact in vllm.PINNED.facts:
        assert fact.meaning and versioned.search(fact.source), fact
    assert vllm.PINNED.image.split(":")[1].startswith(vllm.PINNED.versions["vllm"])
    assert f"sdk{vllm.PINNED.versions['neuron-sdk']}" in vllm.PINNED.image


def test_removed_and_unread_names_are_never_emitted():
    """vLLM 0.10 removed --device; the plugin reads additional_config's override_neuron_config, not
    neuron_config; the compile passes neither either."""
    for _, obj in cases():
        _, objects = rendered(obj)
        c = serving_deployment(objects)["spec"]["template"]["spec"]["containers"][0]
        assert "--device" not in c["command"] and "--kv-transfer-config" not in c["command"]
        config = json.loads(c["command"][c["command"].index("--additional-config") + 1])
        assert list(config) == ["override_neuron_config"]
        script = of_kind(objects, "ConfigMap")[0]["data"]["compile_vllm.py"]
        assert "device" not in script and "'neuron_config'" not in script


# ---- the compile Job and the serving pods -----------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLES)
def test_the_compile_job_runs_where_a_serving_pod_runs_with_its_neuron_cores(name):
    """vllm.LLM compiles while it loads the model onto Neuron devices: the Job asks for the serving pods'
    cores on their instance type, tolerates the Neuron taint and uses the Neuron scheduler extension."""
    spec, objects = rendered(manifest(name))
    job = of_kind(objects, "Job")[0]["spec"]["template"]["spec"]
    serving = serving_deployment(objects)["spec"]["template"]["spec"]
    compile_c, serving_c = job["containers"][0], serving["containers"][0]
    cores = str(spec.neuron.tensorParallel)
    assert compile_c["resources"]["limits"]["aws.amazon.com/neuroncore"] == cores
    assert compile_c["resources"]["requests"]["aws.amazon.com/neuroncore"] == cores
    assert serving_c["resources"]["limits"]["aws.amazon.com/neuroncore"] == cores
    assert job["nodeSelector"]["node.kubernetes.io/instance-type"] == spec.neuron.instanceType
    assert pod_parts.NEURON_TAINT in job["tolerations"]
    assert "schedulerName" not in job and "schedulerName" not in serving  # the chart names none by default
    # the compile writes the cache; serving pods read it only
    mounts = {m["name"]: m for m in compile_c["volumeMounts"]}
    assert mounts["cache"]["readOnly"] is False
    serving_mounts = {m["mountPath"]: m for m in serving_c["volumeMounts"]}
    assert serving_mounts[CACHE_MOUNT]["readOnly"] is True
    # the image's own user (it declares none: root) and root file system, the capabilities of its quickstart
    for pod, c in ((job, compile_c), (serving, serving_c)):
        assert "runAsUser" not in pod["securityContext"] and "runAsNonRoot" not in pod["securityContext"]
        sc = c["securityContext"]
        # (no allowPrivilegeEscalation: Kubernetes counts a container with SYS_ADMIN as one that escalates)
        assert not {"runAsUser", "readOnlyRootFilesystem", "allowPrivilegeEscalation"} & set(sc)
        assert sc["capabilities"] == {"drop": ["NET_RAW"], "add": ["SYS_ADMIN", "IPC_LOCK"]}
        assert all(RECORD.get(cap) for cap in sc["capabilities"]["add"])
        assert not any(e["name"] == "HOME" for e in c["env"])
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]


def run_script(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", script, "sh", *args], capture_output=True, text=True, env=env)


def guard_of(spec, cache: Path) -> tuple[str, list[str], str]:
    """The serving pod's start guard, its vLLM command, and its artifacts folder, with the cache mount moved
    to `cache`."""
    chash = builders.compile_hash(spec)
    c = vllm.serve(spec, "unified", chash, 8000, "m")
    return c.command[2].replace(CACHE_MOUNT, str(cache)), c.command[4:], f"{cache}/artifacts/{chash}"


def complete_artifacts(spec, art: str) -> None:
    """What compile.sh leaves after vLLM compiled: the NxDI model (traced model, NeuronConfig, sharded
    weights of every rank) and the manifest, last."""
    chash = builders.compile_hash(spec)
    model = Path(art) / "model"
    (model / "weights").mkdir(parents=True)
    (model / "model.pt").write_bytes(b"traced")
    (model / "neuron_config.json").write_text("{}")
    for rank in range(spec.neuron.tensorParallel):
        (model / "weights" / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(b"w")
    (Path(art) / "manifest.json").write_text(json.dumps({"engine": "vllm", "compileHash": chash}) + "\n")


def test_the_serving_pod_never_starts_vllm_without_complete_artifacts(tmp_path):
    spec, _ = rendered(manifest("llama-3.1-70b-vllm-trn1.yaml"))
    guard, _, art = guard_of(spec, tmp_path / "cache")
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    # nothing compiled: exit 1, and the reason, naming the folder and what is missing, in the termination log
    run = run_script(guard, "echo", "started", env=env)
    assert run.returncode == 1 and "started" not in run.stdout
    message = log.read_text()
    assert message.startswith(f"compiled artifacts missing at {art}: manifest.json model/model.pt")
    assert "vLLM is not started" in message and message.strip() in run.stderr
    # a compile that stopped before its manifest (the last file written): still refused
    complete_artifacts(spec, art)
    (Path(art) / "manifest.json").unlink()
    log.unlink()
    run = run_script(guard, "echo", "started", env=env)
    assert run.returncode == 1 and log.read_text().startswith(
        f"compiled artifacts missing at {art}: manifest.json;"
    )
    # a manifest of another hash in the folder: refused
    (Path(art) / "manifest.json").write_text('{"engine": "vllm", "compileHash": "0000000000000000"}\n')
    run = run_script(guard, "echo", "started", env=env)
    assert run.returncode == 1 and "manifest.json of compile hash" in log.read_text()
    # a rank's weights missing: refused
    (Path(art) / "manifest.json").unlink()
    (Path(art) / "model" / "weights" / "tp31_sharded_checkpoint.safetensors").unlink()
    complete = {"engine": "vllm", "compileHash": builders.compile_hash(spec)}
    (Path(art) / "manifest.json").write_text(json.dumps(complete) + "\n")
    run = run_script(guard, "echo", "started", env=env)
    assert run.returncode == 1 and "model/weights/tp31_sharded_checkpoint.safetensors" in log.read_text()


def test_the_serving_pod_execs_vllm_with_its_arguments_on_complete_artifacts(tmp_path):
    spec, _ = rendered(manifest("llama-3.1-70b-vllm-trn1.yaml"))
    guard, command, art = guard_of(spec, tmp_path / "cache")
    complete_artifacts(spec, art)
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    # `printf '%s\n'` stands in for vllm: it prints each argument it was given, one a line
    run = run_script(guard, "printf", "%s\\n", *command, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == command and not log.exists()


def test_the_compile_script_writes_the_manifest_only_after_a_complete_compile(tmp_path):
    """compile.sh with a stand-in for the image's python: one that compiles nothing fails with the reason
    and leaves no manifest; one that writes the NxDI model lets the manifest be written."""
    spec, objects = rendered(manifest("llama-3.1-70b-vllm-trn1.yaml"))
    chash = builders.compile_hash(spec)
    script = of_kind(objects, "ConfigMap")[0]["data"]["compile.sh"].replace(
        CACHE_MOUNT, str(tmp_path / "cache")
    )
    art = tmp_path / "cache" / "artifacts" / chash
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    log = tmp_path / "termination-log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    python.write_text('#!/bin/sh\necho "compiled nothing into $NEURON_COMPILED_ARTIFACTS"\n')
    python.chmod(0o755)
    run = run_script(script, env=env)
    assert run.returncode == 1 and not (art / "manifest.json").exists()
    assert log.read_text().startswith(f"vLLM finished without compiled artifacts in {art}/model: model.pt")
    ranks = spec.neuron.tensorParallel
    python.write_text(
        '#!/bin/sh\nset -e\nM="$NEURON_COMPILED_ARTIFACTS"\nmkdir -p "$M/weights"\n'
        'touch "$M/model.pt" "$M/neuron_config.json"\n'
        f'i=0; while [ $i -lt {ranks} ]; do touch "$M/weights/tp${{i}}_sharded_checkpoint.safetensors"; '
        "i=$((i+1)); done\n"
    )
    run = run_script(script, env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(log.read_text()) == {"engine": "vllm", "compileHash": chash, "cacheHit": False}
    assert not (tmp_path / "cache" / "artifacts" / f"{chash}.work").exists()  # the scratch folder is gone
    guard, _, _ = guard_of(spec, tmp_path / "cache")
    assert run_script(guard, "true", env=env).returncode == 0  # what the compile left, serving accepts


# ---- refused up front -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"serving": {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                      "unified": None}},
         r"serving.mode disaggregated: engine vllm on Inf2 and Trn1 .* has no KV-cache connector .* or "
         r"engine vllm on Trn2 or Trn3"),
        ({"neuron": {"kvCacheDtype": "fp8"}},
         r"neuron.kvCacheDtype: engine vllm on Inf2/Trn1 \(NxD Inference\) has no setting for a KV "
         r"cache type"),
        ({"neuron": {"maxInputLength": 6144}},
         r"neuron.maxInputLength 6144 must be neuron.sequenceLength - 1 \(8191\) for engine vllm: vLLM "
         r"bounds a prompt only by --max-model-len"),
        ({"neuron": {"overrides": {"tp_degree": 8}}},
         r"neuron.overrides.tp_degree is set by neuronfleet for engine vllm from neuron.tensorParallel"),
        ({"neuron": {"overrides": {"save_sharded_checkpoint": False}}},
         r"neuron.overrides.save_sharded_checkpoint is set by neuronfleet"),
    ],
)  # fmt: skip
def test_what_vllm_cannot_honour_is_refused_saying_what_works(change, message):
    report = validation.check(manifest("llama-3.1-70b-vllm-trn1.yaml", change))
    assert not report.ok
    assert any(re.search(message, e) for e in report.errors), report.errors


def test_every_emitted_name_is_found_in_the_record_of_the_pins_sources():
    for _, obj in cases():
        spec, objects = rendered(obj)
        seen: set[str] = set()
        check_serving(serving_deployment(objects), spec, seen)
        check_compile(objects, spec, seen)
        names = {n.removeprefix(f"{vllm.OVERRIDE}.") for n in seen} - {"model_tag"}
        missing = sorted(n for n in names if not RECORD.get(n))
        assert not missing, f"emitted but not found in the pin's sources: {missing}"
