"""TGI's Neuron backend against its pinned contract (operator/engines/tgi.py, PINNED): the export command is
parsed by optimum-neuron's own CLI parser, read from the installed optimum-neuron of the image's version; the
serving environment must equal the shapes that export compiles (TGI refuses a model whose NeuronConfig
differs); every name the operator emits is recorded with a source; the compile Job runs on a Neuron node, with
the root read-only and the engine's writable places mounted; what the export cannot take is refused."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import re
import shlex
import subprocess
import types
from pathlib import Path

import pytest
import yaml
from support import ROOT

from neuronfleet.contract import CACHE_MOUNT, HF_TOKEN_ENVS, MODEL_MOUNT, TERMINATION_LOG_ENV
from neuronfleet.operator import builders, validation
from neuronfleet.operator.engines import tgi

SAMPLES = [p for p in sorted((ROOT / "crds" / "samples").glob("*.yaml")) if "engine: tgi" in p.read_text()]
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")


def export_parser() -> argparse.ArgumentParser:
    """optimum-neuron's `optimum-cli export neuron` parser (parse_args_neuronx), taken from the installed
    package's source and run as it is; TasksManager, which it needs only for a help text, is an empty stand-in
    (optimum-neuron's own dependencies, torch among them, are not installed)."""
    path = Path(
        str(
            importlib.metadata.distribution("optimum-neuron").locate_file(
                "optimum/commands/export/neuronx.py"
            )
        )
    )
    tree = ast.parse(path.read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_args_neuronx")
    namespace = {
        "Path": Path,
        "TasksManager": types.SimpleNamespace(
            _TRANSFORMERS_TASKS_TO_MODEL_LOADERS={}, _DIFFUSERS_TASKS_TO_MODEL_LOADERS={}
        ),
    }
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(path), "exec"), namespace)
    parser = argparse.ArgumentParser(prog="optimum-cli export neuron", exit_on_error=False)
    namespace["parse_args_neuronx"](parser)
    return parser


def spec_of(obj: dict):
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def variants() -> list[dict]:
    """The tgi samples, and each with the fields they leave at their defaults set: float16, a revision, a
    model on a claim."""
    out = []
    for path in SAMPLES:
        obj = load(path)
        out.append(obj)
        changed = json.loads(json.dumps(obj))
        changed["spec"]["neuron"].update(dtype="float16", batchSize=2, maxInputLength=1000)
        changed["spec"]["model"]["revision"] = "refs/pr/7"
        out.append(changed)
        on_claim = json.loads(json.dumps(obj))
        on_claim["spec"]["model"] = {"uri": "pvc://models/llama/3b"}
        out.append(on_claim)
    return out


def rendered(obj: dict) -> dict[str, list[dict]]:
    spec = spec_of(obj)
    out: dict[str, list[dict]] = {}
    for o in builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec)):
        out.setdefault(o["kind"], []).append(o)
    return out


def script_lines(objects: dict) -> list[list[str]]:
    """compile.sh's commands, split as the shell splits them ($OUT stays a word of its own)."""
    script = next(o["data"]["compile.sh"] for o in objects["ConfigMap"] if "compile.sh" in o["data"])
    lines = (shlex.split(line, comments=True) for line in script.splitlines())
    return [words for words in lines if words]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def pinned(kind: str) -> set[str]:
    return {f.name for f in tgi.PINNED.facts if f.kind == kind}


def test_the_parser_read_is_the_pinned_images_optimum_neuron():
    assert importlib.metadata.version("optimum-neuron") == tgi.PINNED.versions["optimum-neuron"]
    options = export_parser()._option_string_actions
    assert {"--batch_size", "--sequence_length", "--num_cores", "--auto_cast_type"} <= set(options)
    assert options["--auto_cast_type"].choices == ["bf16", "fp16", "tf32"]


def unified_deployment(objects: dict[str, list[dict]]) -> dict:
    """The TGI servers' Deployment (the other is their front door, our router)."""
    by_role = {d["metadata"]["labels"]["neuronfleet.dev/role"]: d for d in objects["Deployment"]}
    assert sorted(by_role) == ["router", "unified"]
    return by_role["unified"]


@pytest.mark.parametrize(
    "obj", variants(), ids=lambda o: f"{o['spec']['model']['uri']}-{o['spec']['neuron'].get('dtype')}"
)
def test_the_export_compiles_exactly_the_shapes_the_server_is_told(obj):
    """optimum-neuron's parser takes the export line as it stands (an unknown flag or a bad value fails), and
    what it parses equals the launcher's environment, which tgi_env.check_env_and_neuron_config_compatibility
    and the router hold to the exported NeuronConfig."""
    spec = spec_of(obj)
    objects = rendered(obj)
    export = next(
        words for words in script_lines(objects) if words[:3] == ["optimum-cli", "export", "neuron"]
    )
    args = export_parser().parse_args(export[3:])
    deployment = unified_deployment(objects)
    env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
    assert args.task == "text-generation" and args.output == Path("$OUT/model")
    assert args.batch_size == int(env["MAX_BATCH_SIZE"]) == spec.neuron.batchSize
    assert args.sequence_length == int(env["MAX_TOTAL_TOKENS"]) == spec.neuron.sequenceLength
    assert args.num_cores == int(env["HF_NUM_CORES"]) == spec.neuron.tensorParallel
    assert (
        args.auto_cast_type
        == env["HF_AUTO_CAST_TYPE"]
        == {"bfloat16": "bf16", "float16": "fp16"}[spec.neuron.dtype]
    )
    # tgi_env.check_env_and_neuron_config_compatibility: MAX_INPUT_TOKENS below the sequence length
    assert int(env["MAX_INPUT_TOKENS"]) == spec.neuron.maxInputLength < args.sequence_length
    prefill = int(env["MAX_BATCH_PREFILL_TOKENS"])
    assert prefill == args.batch_size * int(env["MAX_INPUT_TOKENS"])  # neuron_config_to_env's value
    assert prefill >= int(env["MAX_INPUT_TOKENS"])  # the v2 router refuses less
    # a Hub model is downloaded first: the export reads the checkpoint folder, so it keeps the weights
    if spec.model.uri.startswith("hf://"):
        download = next(words for words in script_lines(objects) if words[0] == "python3")
        assert download[2:] == [
            spec.model.uri.removeprefix("hf://"),
            spec.model.revision or "",
            "$OUT/checkpoint",
        ]
        assert args.model == "$OUT/checkpoint"
    else:
        assert args.model == f"{MODEL_MOUNT}/llama/3b"
        assert not any(words[0] == "python3" for words in script_lines(objects))


@pytest.mark.parametrize("obj", variants(), ids=lambda o: o["spec"]["model"]["uri"])
def test_every_name_the_operator_emits_is_recorded_with_a_source(obj):
    objects = rendered(obj)
    deployment = unified_deployment(objects)
    serving = deployment["spec"]["template"]["spec"]["containers"][0]
    launcher = serving["command"][4:]  # after the start guard (/bin/sh -c GUARD tgi-start-guard)
    assert launcher[0] in pinned("arg")
    assert {w for w in launcher[1:] if w.startswith("--")} <= pinned("arg")
    assert set(env_of(serving)) <= pinned("env")  # and no token: the export holds the weights
    (job,) = objects["Job"]
    compile_env = set(env_of(job["spec"]["template"]["spec"]["containers"][0])) - set(HF_TOKEN_ENVS)
    assert compile_env <= pinned("env")
    for words in script_lines(objects):
        if words[:3] == ["optimum-cli", "export", "neuron"]:
            assert " ".join(words[:3]) in pinned("arg")
            assert {w for w in words if w.startswith("--")} <= pinned("arg")
    downloads = [
        o["data"][tgi.DOWNLOAD_SCRIPT] for o in objects["ConfigMap"] if tgi.DOWNLOAD_SCRIPT in o["data"]
    ]
    for source in downloads:
        call = next(
            n
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "snapshot_download"
        )
        assert {f"snapshot_download.{k.arg}" for k in call.keywords} <= pinned("config")
    for fact in tgi.PINNED.facts:
        assert fact.meaning and re.search(r"github\.com/|https://", fact.source), fact


def test_the_compile_job_runs_on_a_neuron_node_with_a_read_only_root_and_the_writable_places():
    """optimum-neuron 0.3.0 exports LLMs on Neuron devices only: the Job asks the device plugin for the
    serving pods' cores on a node of the serving instance type, the Neuron taint tolerated. It and the serving
    pods run as the image is built (root, its root file system writable), with no capability added."""
    obj = load(SAMPLES[0])
    spec = spec_of(obj)
    objects = rendered(obj)
    (job,) = objects["Job"]
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    cores = str(spec.neuron.tensorParallel)
    assert container["resources"]["limits"]["aws.amazon.com/neuroncore"] == cores
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == spec.neuron.instanceType
    assert any(t["key"] == "aws.amazon.com/neuron" for t in pod["tolerations"])
    deployment = unified_deployment(objects)
    for pod_spec, c in (
        (pod, container),
        (deployment["spec"]["template"]["spec"], deployment["spec"]["template"]["spec"]["containers"][0]),
    ):  # the image's own user (it declares none: root) and its writable root; no added capability
        assert "runAsUser" not in pod_spec["securityContext"] and "runAsUser" not in c["securityContext"]
        assert "readOnlyRootFilesystem" not in c["securityContext"]
        assert c["securityContext"]["capabilities"] == {"drop": ["NET_RAW"]}
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert "HOME" not in env_of(c)
    assert not set(env_of(deployment["spec"]["template"]["spec"]["containers"][0])) & set(HF_TOKEN_ENVS)


STAND_IN = """#!/bin/sh
# a stand-in for the TGI Neuron image's {tool}: records its arguments; {effect}
echo "$0 $*" >> "{log}"
{body}
"""


def run_compile_script(tmp_path: Path, export_exit: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The rendered compile.sh, run with stand-ins for the image's python3 (the download writes a checkpoint)
    and optimum-cli (the export writes model.pt, or fails), the cache claim under tmp_path."""
    obj = load(SAMPLES[0])
    spec = spec_of(obj)
    chash = builders.compile_hash(spec)
    script = next(o["data"]["compile.sh"] for o in rendered(obj)["ConfigMap"] if "compile.sh" in o["data"])
    script = script.replace(CACHE_MOUNT, str(tmp_path / "cache"))
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    tools = {
        "python3": ("downloads into its last argument", 'mkdir -p "$4" && echo "{}" > "$4/config.json"'),
        "optimum-cli": (
            "exports into its last argument",
            f"[ {export_exit} -eq 0 ] || exit {export_exit}\n"
            'for a; do out="$a"; done; mkdir -p "$out" && touch "$out/model.pt"',
        ),
    }
    for tool, (effect, body) in tools.items():
        (bin_dir / tool).write_text(STAND_IN.format(tool=tool, effect=effect, log=calls, body=body))
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", TERMINATION_LOG_ENV: str(tmp_path / "termination-log")}
    run = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=env)
    return run, tmp_path / "cache" / "artifacts" / chash, calls


def test_a_compile_downloads_exports_keeps_the_export_only_and_writes_the_manifest_last(tmp_path):
    run, out, calls = run_compile_script(tmp_path, export_exit=0)
    assert run.returncode == 0, run.stderr
    assert [line.split()[0].rsplit("/", 1)[1] for line in calls.read_text().splitlines()] == [
        "python3",
        "optimum-cli",
    ]
    assert (out / "model" / "model.pt").exists() and not (out / "checkpoint").exists()
    assert json.loads((out / "manifest.json").read_text())["engine"] == "tgi"
    assert json.loads((tmp_path / "termination-log").read_text())["cacheHit"] is False


def test_a_failed_export_leaves_no_manifest_so_the_next_attempt_exports_again(tmp_path):
    run, out, _ = run_compile_script(tmp_path, export_exit=3)
    assert run.returncode == 3
    assert not (out / "manifest.json").exists() and not (out / "model").exists()


def edited(**changes) -> dict:
    obj = load(SAMPLES[0])
    for key, value in changes.items():
        section, field = key.split("__")
        obj["spec"][section][field] = value
    return obj


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (edited(model__uri="hf://mistralai/Mistral-7B-Instruct-v0.3"),
         "model hf://mistralai/Mistral-7B-Instruct-v0.3 is a mistral model, which optimum-neuron 0.3.0 "
         "(TGI's Neuron export) cannot export; it exports granite, llama, mixtral, phi3, qwen2, qwen3"),
        (edited(neuron__instanceType="trn2.48xlarge"),
         "engine tgi (TGI 3.3.5's Neuron backend) runs on Inferentia2 and Trainium1 instances"),
        (edited(neuron__dtype="float32"), "engine tgi casts to bfloat16 or float16"),
        (edited(neuron__quantization="int8"), "neuron.quantization int8: TGI's Neuron export"),
        (edited(model__uri="pvc://models/llama", model__revision="v1"),
         "model.revision applies to hf:// models only, not pvc://models/llama; remove it"),
    ],
)  # fmt: skip
def test_what_the_export_cannot_take_is_refused_saying_what_works(obj, message):
    report = validation.check(obj)
    assert any(message in e for e in report.errors), report.errors


def test_the_models_the_export_takes_are_accepted():
    for uri in ("hf://Qwen/Qwen2.5-7B-Instruct", "hf://meta-llama/Llama-3.1-8B-Instruct", "pvc://models/any"):
        obj = edited(model__uri=uri, neuron__instanceType="inf2.8xlarge")
        assert validation.check(obj).ok, (uri, validation.check(obj).errors)


def test_the_serving_pod_never_starts_tgi_without_a_complete_export(tmp_path):
    """TGI's Neuron backend exports a folder that is not an export itself, at start, with the environment's
    shapes (tgi_env.py): the start guard runs the launcher only once this hash's manifest exists (written
    last by the compile), else leaves the reason as the termination message and exits 1."""
    spec = spec_of(load(SAMPLES[0]))
    chash = builders.compile_hash(spec)
    c = tgi.serve(spec, "unified", chash, 8080, None)
    guard = c.command[2].replace(CACHE_MOUNT, str(tmp_path))
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    run = subprocess.run(["/bin/sh", "-c", guard, "tgi-start-guard", "echo", "started"], capture_output=True,
                         text=True, env=env)  # fmt: skip
    assert run.returncode == 1 and "started" not in run.stdout
    assert log.read_text().startswith(
        f"compiled artifacts missing at {tmp_path}/artifacts/{chash}: manifest.json"
    )
    folder = tmp_path / "artifacts" / chash
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"engine": "tgi", "compileHash": "another"}))
    run = subprocess.run(
        ["/bin/sh", "-c", guard, "g", "echo", "started"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 1 and f"manifest.json of compile hash {chash}" in log.read_text()
    (folder / "manifest.json").write_text(json.dumps({"engine": "tgi", "compileHash": chash}))
    run = subprocess.run(
        ["/bin/sh", "-c", guard, "g", "echo", "started"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0 and run.stdout.strip() == "started"


def test_a_tgi_model_is_accepted_saying_once_that_the_engine_is_legacy():
    """Validated=True with reason LegacyEngine and a Normal Event the first time; no repeat after."""
    from neuronfleet.operator.status import compute_status, transitions

    obj = yaml.safe_load((ROOT / "crds" / "samples" / "llama-3.2-3b-tgi-inf2.yaml").read_text())
    spec = spec_of(obj)
    assert validation.validate(spec).ok
    reason, notice = builders.engines.notice(spec)
    assert reason == "LegacyEngine"
    assert notice.startswith("engine tgi is legacy") and tgi.IMAGE in notice

    def status(old: dict) -> dict:
        return compute_status(
            old=old, generation=1, errors=[], compile_hash="h", serving_hash=None, job=("running", ""),
            roles={"unified": (1, 0)}, notice=(reason, notice), endpoint=None, at="2026-12-03T00:00:00Z",
        )  # fmt: skip

    first = status({})
    validated = next(c for c in first["conditions"] if c["type"] == "Validated")
    assert (validated["status"], validated["reason"], validated["message"]) == (
        "True",
        "LegacyEngine",
        notice,
    )
    assert ("Normal", "LegacyEngine", notice) in transitions({}, first)
    assert not [t for t in transitions(first, status(first)) if t[1] == "LegacyEngine"]
    other = yaml.safe_load((ROOT / "crds" / "samples" / "llama-3.1-8b-vllm-inf2.yaml").read_text())
    assert builders.engines.notice(spec_of(other)) is None
