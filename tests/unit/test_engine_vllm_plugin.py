"""vLLM on Trn2 and Trn3 (the vLLM Neuron plugin, Neuron SDK 2.32.0) against its pinned contract
(operator/engines/vllm_plugin.py `PINNED`): every vLLM sample on those instances, and variants that switch on
each optional setting (buckets, expert parallelism, an fp8 KV cache, LNC 1, a pvc:// model, Trn3, prefill and
decode with tensor parallelisms of their own), is rendered by the builders, and every argument, config key and
environment variable of the serving pods and the compile Job is read back with a parser built from the
recorded facts, not from the code that emits them. Every recorded fact is emitted by some rendering, names a
versioned source, and is found in the record of the pin's sources
(tests/data/vllm-neuron-sdk2.32.0-names.json: where each name appears in the plugin's documentation at SDK
v2.32.0).

The documented disaggregated deployment is checked against the plugin's tutorial as it is written (the
kv-transfer-config objects and the environment below are quoted from it), not against the code's output; the
compile script and the serving start guard run with /bin/sh against folders, with stand-ins for `vllm`."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import engine_renders
import pytest
from engine_renders import check_env, check_value, manifest, of_kind, rendered
from support import ROOT, free_port

from neuronfleet.contract import CACHE_MOUNT, TERMINATION_LOG_ENV
from neuronfleet.operator import builders, validation
from neuronfleet.operator.engines import vllm, vllm_plugin
from neuronfleet.operator.engines.common import Fact

SAMPLES = sorted(
    p.name
    for p in (ROOT / "crds" / "samples").glob("*.yaml")
    if "engine: vllm" in p.read_text() and re.search(r"instanceType: trn[23]", p.read_text())
)
RECORDED = json.loads((ROOT / "tests" / "data" / "vllm-neuron-sdk2.32.0-names.json").read_text())
RECORD = RECORDED["names"]
COMPILER_TARGETS = RECORDED["neuronx-cc --target"]["values"]  # the compiler's documented targets
TRN2 = "llama-3.3-70b-vllm-trn2.yaml"
TRN2_PD = "llama-3.3-70b-vllm-trn2-disaggregated.yaml"
VARIANTS = {
    "trn2 buckets, expert parallelism, fp8 KV cache, an override": (
        TRN2,
        {"neuron": {"buckets": {"context": [1024, 8192], "generation": [4096, 8192]}, "expertParallel": 8,
                    "kvCacheDtype": "fp8", "overrides": {"num_seqs_buckets": [1, 4, 16]}}},
    ),
    "trn2 LNC 1 (in the DRA claim), pvc model": (
        TRN2,
        {"neuron": {"logicalCores": 1, "tensorParallel": 64, "deviceAllocation": "dra"},
         "model": {"uri": "pvc://models/llama-3.3-70b", "secretRef": None}},
    ),
    "trn3": (TRN2, {"neuron": {"instanceType": "trn3.48xlarge"}}),
    "trn3 disaggregated, GPT-OSS (sliding window)": (
        TRN2_PD,
        {"neuron": {"instanceType": "trn3.48xlarge", "expertParallel": 2},
         "model": {"uri": "hf://openai/gpt-oss-120b", "secretRef": None}},
    ),
    "trn2 disaggregated, one tensor parallelism, connector named": (
        TRN2_PD,
        {"serving": {"prefill": {"replicas": 1}, "decode": {"replicas": 3},
                     "kvTransfer": {"transport": "efa", "efaInterfaces": 2,
                                    "connector": "NeuronNixlConnector"}}},
    ),
}  # fmt: skip

# The plugin's disaggregated-inference tutorial (aws-neuron/aws-neuron-sdk@v2.32.0:vllm-neuron/docs/tutorials/
# tutorial-di-1p1d-xpyd.md, the prefill and decode commands) and its design page (design/vllm/
# disaggregated-inference.md, "NeuronNixlConnector"), as written there
DOCUMENTED_KV = {
    "prefill": {"kv_role": "kv_producer", "kv_buffer_device": "cuda",
                "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}},
    "decode": {"kv_role": "kv_consumer", "kv_buffer_device": "cuda",
               "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}},
}  # fmt: skip
DOCUMENTED_CONNECTORS = {"NixlConnector", "NeuronNixlConnector"}
DOCUMENTED_DI_ENV = {"FI_EFA_ENABLE_SHM_TRANSFER": "0"}  # "required for single-node DI"


def cases() -> list[tuple[str, dict]]:
    return engine_renders.cases(SAMPLES, VARIANTS)


def engine_pods(objects: list[dict]) -> dict[str, dict]:
    """role -> the pod spec of the vLLM servers (not our router)."""
    return {
        d["metadata"]["labels"]["neuronfleet.dev/role"]: d["spec"]["template"]["spec"]
        for d in of_kind(objects, "Deployment")
        if d["metadata"]["labels"]["neuronfleet.dev/role"] != "router"
    }


# ---- a reader built from the recorded facts ---------------------------------------------------------------


def facts(kind: str) -> dict[str, Fact]:
    return {f.name: f for f in vllm_plugin.PINNED.facts if f.kind == kind}


def parser() -> argparse.ArgumentParser:
    """`vllm serve` as recorded: only the pinned flags, each with its recorded value kind or choices."""
    p = argparse.ArgumentParser(prog="vllm serve", exit_on_error=False, allow_abbrev=False)
    types = {"int": int, "json": json.loads, "str": str, "path": str}
    for name, fact in facts("arg").items():
        if not name.startswith("--"):
            p.add_argument(name, type=str)
        elif fact.value == "flag":
            p.add_argument(name, action="store_true")
        elif "|" in fact.value or fact.value not in types:
            p.add_argument(name, choices=fact.value.split("|"))
        else:
            p.add_argument(name, type=types[fact.value])
    return p


def check_server(pod: dict, spec, seen: set[str]) -> argparse.Namespace:
    c = pod["containers"][0]
    assert c["command"][:2] == ["/bin/sh", "-c"] and c["command"][4:6] == ["vllm", "serve"]
    args = c["command"][6:]
    parsed, unknown = parser().parse_known_args(args)
    assert unknown == [], f"unrecorded vllm serve arguments: {unknown}"
    seen.update(a for a in args if a.startswith("--"))
    seen.add("model_tag")
    recorded = facts("config")
    if parsed.additional_config is not None:
        assert list(parsed.additional_config) == [vllm_plugin.NEURON_CONFIG]
        seen.add(vllm_plugin.NEURON_CONFIG)
        for key, value in parsed.additional_config[vllm_plugin.NEURON_CONFIG].items():
            if key in spec.neuron.overrides:
                assert value == spec.neuron.overrides[key]
                continue
            fact = recorded.get(f"{vllm_plugin.NEURON_CONFIG}.{key}")
            assert fact is not None, f"neuron_config.{key} is not recorded in PINNED"
            check_value(fact, value)
            seen.add(fact.name)
    if parsed.kv_transfer_config is not None:
        for key, value in parsed.kv_transfer_config.items():
            if isinstance(value, dict):
                for sub, subvalue in value.items():
                    check_value(recorded[f"{key}.{sub}"], subvalue)
                    seen.add(f"{key}.{sub}")
            else:
                check_value(recorded[key], value)
                seen.add(key)
    if parsed.kv_events_config is not None:
        for key, value in parsed.kv_events_config.items():
            check_value(recorded[f"kv_events.{key}"], value)
            seen.add(f"kv_events.{key}")
    check_env(c["env"], facts("env"), seen)
    return parsed


def check_compile(objects: list[dict], seen: set[str]) -> dict[str, object]:
    (job,) = of_kind(objects, "Job")
    return check_env(job["spec"]["template"]["spec"]["containers"][0]["env"], facts("env"), seen)


@pytest.mark.parametrize(("label", "obj"), cases(), ids=[c[0] for c in cases()])
def test_every_name_the_engine_emits_is_recorded_with_its_values_and_found_in_the_pins_sources(label, obj):
    spec, objects = rendered(obj)
    seen: set[str] = set()
    for pod in engine_pods(objects).values():
        check_server(pod, spec, seen)
    check_compile(objects, seen)
    names = {n.split(".")[-1] for n in seen} - {"model_tag"}
    missing = sorted(n for n in names if not RECORD.get(n))
    assert not missing, f"emitted but not found in the pin's sources: {missing}"


def test_every_recorded_fact_is_emitted_somewhere_and_names_a_versioned_source():
    seen: set[str] = set()
    for _, obj in cases():
        spec, objects = rendered(obj)
        for pod in engine_pods(objects).values():
            check_server(pod, spec, seen)
        check_compile(objects, seen)
    assert {f.name for f in vllm_plugin.PINNED.facts} - {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"} <= seen
    versioned = re.compile(r"(@v?\d+\.\d+|\b\d+\.\d+\.\d+\b|/v\d+\.\d+)")
    for fact in vllm_plugin.PINNED.facts:
        assert fact.meaning and versioned.search(fact.source), fact
    pinned = vllm_plugin.PINNED
    assert pinned.image.split(":")[1].startswith(pinned.versions["vllm-neuron"])
    assert f"sdk{pinned.versions['neuron-sdk']}" in pinned.image


def test_the_hub_token_reaches_the_compile_only():
    """The compile downloads a Hub model into the artifacts; serving pods load that folder, no Hub."""
    spec, objects = rendered(manifest(TRN2))
    (job,) = of_kind(objects, "Job")
    assert {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"} <= {
        e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    for pod in engine_pods(objects).values():
        c = pod["containers"][0]
        assert not {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"} & {e["name"] for e in c["env"]}
        assert c["command"][6] == f"{builders.engines.artifacts_dir(builders.compile_hash(spec))}/model"


# ---- the documented disaggregated deployment ------------------------------------------------------------


@pytest.mark.parametrize("label", [TRN2_PD, "trn3 disaggregated, GPT-OSS (sliding window)"])
def test_prefill_and_decode_pods_are_the_documented_di_servers_behind_our_router(label):
    obj = manifest(TRN2_PD) if label == TRN2_PD else manifest(*VARIANTS[label])
    spec, objects = rendered(obj)
    pods = engine_pods(objects)
    assert set(pods) == {"prefill", "decode"}
    for role, pod in pods.items():
        c = pod["containers"][0]
        parsed = check_server(pod, spec, set())
        kv = dict(parsed.kv_transfer_config)
        connector = kv.pop("kv_connector")
        assert kv == DOCUMENTED_KV[role] and connector in DOCUMENTED_CONNECTORS
        # GPT-OSS slides its attention: the design page requires NeuronNixlConnector for it
        assert (connector == "NeuronNixlConnector") == ("gpt-oss" in spec.model.uri)
        assert parsed.tensor_parallel_size == validation.role_tensor_parallel(spec, role)
        env = {e["name"]: e for e in c["env"]}
        assert all(env[k]["value"] == v for k, v in DOCUMENTED_DI_ENV.items())
        # the side channel advertises the pod's own address (the decode pods reach it there)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert {"name": "nixl", "containerPort": port, "protocol": "TCP"} in c["ports"]
        assert "NEURON_SKIP_EFA_AFFINITY" not in env  # these pods have their EFA devices
        efa = str(spec.serving.kvTransfer.efaInterfaces)
        assert c["resources"]["requests"]["vpc.amazonaws.com/efa"] == efa == c["resources"]["limits"][
            "vpc.amazonaws.com/efa"]  # fmt: skip
        assert c["resources"]["limits"]["aws.amazon.com/neuroncore"] == str(parsed.tensor_parallel_size)
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    (router,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["labels"]["neuronfleet.dev/role"]
                 == "router"]  # fmt: skip
    container = router["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:2] == ["neuronfleet", "serve"] and command[command.index("--role") + 1] == "router"
    assert command[command.index("--peer-protocol") + 1] == "vllm"
    # kv-aware (the default): the prefill servers publish KV-cache events at the port they declare, and the
    # router follows them there with the tokenizer of the folder the servers load, mounted read-only
    prefill = engine_pods(objects)["prefill"]["containers"][0]
    events = parser().parse_known_args(prefill["command"][6:])[0].kv_events_config
    port = int(events["endpoint"].rsplit(":", 1)[1])
    assert events["enable_kv_cache_events"] is True and events["endpoint"] == f"tcp://*:{port}"
    replay = int(events["replay_endpoint"].rsplit(":", 1)[1])
    assert events["replay_endpoint"] == f"tcp://*:{replay}"
    assert {"name": "kv-events", "containerPort": port, "protocol": "TCP"} in prefill["ports"]
    assert {"name": "kv-replay", "containerPort": replay, "protocol": "TCP"} in prefill["ports"]
    side_channel = next(e["value"] for e in prefill["env"] if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_PORT")
    assert int(side_channel) not in (port, replay)  # they all listen in the same engine process
    assert json.loads(command[command.index("--peer-kv-events") + 1]) == events  # the pods' own config
    model = command[command.index("--model") + 1]
    assert model == prefill["command"][6]
    mount = next(m for m in container["volumeMounts"] if model.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    decode = engine_pods(objects)["decode"]["containers"][0]
    assert parser().parse_known_args(decode["command"][6:])[0].kv_events_config is None  # (decode: none)


def test_the_unified_server_starts_without_efa_devices():
    """The image's quickstart: without EFA on the host the server fails to start unless
    NEURON_SKIP_EFA_AFFINITY=1."""
    _, objects = rendered(manifest(TRN2))
    env = {e["name"]: e.get("value") for e in engine_pods(objects)["unified"]["containers"][0]["env"]}
    assert env["NEURON_SKIP_EFA_AFFINITY"] == "1"


# ---- the compile: ahead, on CPU where the compiler targets the platform -----------------------------------


def test_a_trn2_compile_runs_on_a_cpu_node_holding_no_neuron_core():
    _spec, objects = rendered(manifest(TRN2_PD))
    (job,) = of_kind(objects, "Job")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = check_compile(objects, set())
    assert env["VLLM_NEURON_CPU_COMPILE"] == "1" and env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn2"
    assert "trn2" in COMPILER_TARGETS  # the compiler's documented targets at this SDK
    assert not any(k.startswith("aws.amazon.com/") for k in c["resources"].get("limits", {}))
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    assert "tolerations" not in pod and "schedulerName" not in pod
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]  # the server's workers share it
    assert int(c["resources"]["requests"]["cpu"]) >= 8 and c["resources"]["requests"]["memory"].endswith("Gi")
    # the same LNC as the serving pods: the graphs are compiled for it
    serving_env = {e["name"]: e.get("value") for e in engine_pods(objects)["decode"]["containers"][0]["env"]}
    assert env["NEURON_LOGICAL_NC_CONFIG"] == serving_env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    # the script compiles each tensor parallelism the pods run (prefill 16, decode 32)
    script = of_kind(objects, "ConfigMap")[0]["data"]["compile.sh"]
    assert re.findall(r"--tensor-parallel-size (\d+)", script) == ["16", "32"]
    assert "--kv-transfer-config" not in script


def test_a_trn3_compile_runs_on_a_cpu_node_too_targeting_trn3():
    """The plugin's CPU compile takes the installed compiler's targets, and the pinned compiler targets trn3
    (the record's sources): the Job holds no Neuron core, as Trn2's."""
    _spec, objects = rendered(manifest(*VARIANTS["trn3"]))
    (job,) = of_kind(objects, "Job")
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = check_compile(objects, set())
    assert env["VLLM_NEURON_CPU_COMPILE"] == "1" and env["NEURON_PLATFORM_TARGET_OVERRIDE"] == "trn3"
    assert "trn3" in COMPILER_TARGETS and "trn3" in RECORDED["neuronx-cc --target"]["source"]
    assert not any(k.startswith("aws.amazon.com/") for k in c["resources"].get("limits", {}))
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    assert "tolerations" not in pod and "schedulerName" not in pod
    assert "capabilities" not in c["securityContext"] or "add" not in c["securityContext"]["capabilities"]


def run_script(script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", script, "sh", *args], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip


STANDIN_VLLM = """#!{python}
\"\"\"STAND-IN for `vllm serve` in a compile (not vLLM): writes one compile cache entry per tensor parallelism
under $VLLM_CACHE_ROOT/neuron/compile_cache, then {mode}.\"\"\"
import http.server, os, sys
args = sys.argv[1:]
tp = args[args.index("--tensor-parallel-size") + 1]
entry = os.path.join(os.environ["VLLM_CACHE_ROOT"], "neuron", "compile_cache", "key-tp" + tp)
os.makedirs(entry, exist_ok=True)
open(os.path.join(entry, "model.neff"), "w").write("neff")
mode = {mode!r}
if mode == "fail":
    sys.exit(3)
if mode == "serve":
    port = int(args[args.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def compile_env(tmp_path: Path, mode: str) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    standin = bin_dir / "vllm"
    standin.write_text(STANDIN_VLLM.format(python=sys.executable, mode=mode))
    standin.chmod(0o755)
    os.symlink(sys.executable, bin_dir / "python3") if not (bin_dir / "python3").exists() else None
    log = tmp_path / "termination-log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", TERMINATION_LOG_ENV: str(log),
           "VLLM_CACHE_ROOT": str(tmp_path / "local-cache")}  # fmt: skip
    return env, log


def local_script(text: str, tmp_path: Path) -> str:
    port = free_port()
    return (
        text.replace(CACHE_MOUNT, str(tmp_path / "cache"))
        .replace(vllm_plugin.LOCAL_CACHE_ROOT, str(tmp_path / "local-cache"))
        .replace(f"--port {vllm_plugin.COMPILE_PORT}", f"--port {port}")
        .replace(f"127.0.0.1:{vllm_plugin.COMPILE_PORT}/", f"127.0.0.1:{port}/")
    )


@pytest.mark.parametrize("mode", ["serve", "exit"])
def test_the_compile_script_keeps_every_tensor_parallelisms_graphs_then_writes_the_manifest(tmp_path, mode):
    """With a stand-in server that warms up and answers /health (then is stopped), or that exits by itself:
    the graphs of both tensor parallelisms are copied into artifacts/<hash>/neff and the manifest is written;
    the serving start guard then accepts the artifacts."""
    obj = manifest(TRN2_PD, {"model": {"uri": "pvc://models/llama", "secretRef": None}})
    spec, objects = rendered(obj)
    chash = builders.compile_hash(spec)
    (tmp_path / "models").mkdir()
    script = local_script(of_kind(objects, "ConfigMap")[0]["data"]["compile.sh"], tmp_path).replace(
        builders.engines.model_reference(spec), str(tmp_path / "models")
    )
    env, log = compile_env(tmp_path, mode)
    run = run_script(script, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    art = tmp_path / "cache" / "artifacts" / chash
    assert sorted(p.name for p in (art / "neff").iterdir()) == ["key-tp16", "key-tp32"]
    assert json.loads(log.read_text()) == {"engine": "vllm", "compileHash": chash, "cacheHit": False}
    assert not (tmp_path / "cache" / "artifacts" / f"{chash}.work").exists()


def test_a_server_that_fails_while_compiling_fails_the_compile_saying_so(tmp_path):
    obj = manifest(TRN2, {"model": {"uri": "pvc://models/llama", "secretRef": None}})
    spec, objects = rendered(obj)
    (tmp_path / "models").mkdir()
    script = local_script(of_kind(objects, "ConfigMap")[0]["data"]["compile.sh"], tmp_path).replace(
        builders.engines.model_reference(spec), str(tmp_path / "models")
    )
    env, log = compile_env(tmp_path, "fail")
    run = run_script(script, env=env)
    art = tmp_path / "cache" / "artifacts" / builders.compile_hash(spec)
    assert run.returncode == 1 and not (art / "manifest.json").exists()
    assert (
        log.read_text().strip() == "vLLM exited while compiling at tensor parallelism 64 (its log is above)"
    )


def test_the_start_guard_serves_only_compiled_graphs_copied_into_the_pods_local_cache(tmp_path):
    spec, _ = rendered(manifest(TRN2))
    chash = builders.compile_hash(spec)
    c = vllm.serve(spec, "unified", chash, 8000, "m")
    guard = local_script(c.command[2], tmp_path)
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    art = tmp_path / "cache" / "artifacts" / chash
    run = run_script(guard, "echo", "started", env=env)
    assert run.returncode == 1 and "started" not in run.stdout
    assert log.read_text().startswith(f"compiled artifacts missing at {art}: manifest.json model/config.json")
    (art / "model").mkdir(parents=True)
    (art / "model" / "config.json").write_text("{}")
    (art / "manifest.json").write_text(json.dumps({"engine": "vllm", "compileHash": chash}) + "\n")
    run = run_script(guard, "echo", "started", env=env)
    assert run.returncode == 1 and log.read_text().startswith(f"no compiled graphs in {art}/neff")
    (art / "neff" / "key-a").mkdir(parents=True)
    (art / "neff" / "key-a" / "model.neff").write_text("neff")
    log.unlink()
    run = run_script(guard, "printf", "%s\\n", *c.command[4:], env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == c.command[4:] and not log.exists()
    assert (
        tmp_path / "local-cache" / "neuron" / "compile_cache" / "key-a" / "model.neff"
    ).read_text() == "neff"
    env_of = {e: v for e, v in c.env.items()}
    assert env_of["VLLM_NEURON_DISABLE_WARMUP_COMPILE"] == "1" and env_of["VLLM_CACHE_ROOT"] == (
        vllm_plugin.LOCAL_CACHE_ROOT)  # fmt: skip


# ---- refused up front -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"neuron": {"maxInputLength": 6144}},
         r"neuron.maxInputLength 6144 must be neuron.sequenceLength - 1 \(16383\) for engine vllm"),
        ({"neuron": {"quantization": "int8"}},
         r"neuron.quantization int8 is NxD Inference's .* quantizes to mxfp4 or mxfp8"),
        ({"neuron": {"buckets": {"generation": [1000, 16384]}}},
         r"decode context lengths .* each a multiple of 128 below neuron.sequenceLength \(16384\); \[1000, "
         r"16384\] are not"),
        ({"neuron": {"expertParallel": 3}}, r"neuron.expertParallel 3 must divide neuron.tensorParallel 64"),
        ({"neuron": {"memoryFraction": 0.8}}, r"neuron.memoryFraction: the vLLM Neuron plugin .* has no "
         r"setting for a device memory fraction"),
        ({"neuron": {"overrides": {"ep_degree": 4}}},
         r"neuron.overrides.ep_degree is set by neuronfleet for engine vllm from neuron.expertParallel"),
        ({"neuron": {"overrides": {"num_seqs_buckets": [1, 8]}}},
         r"num_seqs_buckets \[1, 8\]: the largest must equal neuron.batchSize \(16, --max-num-seqs\)"),
    ],
)  # fmt: skip
def test_what_the_plugin_cannot_honour_is_refused_saying_what_works(change, message):
    report = validation.check(manifest(TRN2, change))
    assert not report.ok
    assert any(re.search(message, e) for e in report.errors), report.errors


@pytest.mark.parametrize(
    ("kv", "message"),
    [
        ({"transport": "tcp"}, r"kvTransfer.transport tcp: .* NIXL over LIBFABRIC \(EFA\); use kvTransfer"),
        ({"transport": "efa", "efaInterfaces": 0}, r"kvTransfer.efaInterfaces 0: NIXL's LIBFABRIC backend"),
    ],
)
def test_disaggregation_without_efa_is_refused(kv, message):
    report = validation.check(manifest(TRN2_PD, {"serving": {"kvTransfer": kv}}))
    assert any(re.search(message, e) for e in report.errors), report.errors


def test_a_role_tensor_parallelism_the_instance_cannot_place_is_refused_naming_the_field():
    report = validation.check(
        manifest(TRN2_PD, {"serving": {"decode": {"replicas": 1, "tensorParallel": 96}}})
    )
    assert any(e.startswith("serving.decode.tensorParallel 96 is not a documented degree") for e in
               report.errors), report.errors  # fmt: skip


def test_the_engine_contract_follows_the_instance_family():
    for instance, contract in (("trn2.48xlarge", "vllm_plugin"), ("trn3.48xlarge", "vllm_plugin"),
                               ("inf2.48xlarge", "vllm_nxdi"), ("trn1.32xlarge", "vllm_nxdi")):  # fmt: skip
        obj = manifest(TRN2, {"neuron": {"instanceType": instance, "tensorParallel": 8}})
        spec, _ = validation.parse(obj)
        assert vllm.contract(spec).__name__.rsplit(".", 1)[1] == contract


@pytest.mark.parametrize(("label", "obj"), cases(), ids=[c[0] for c in cases()])
def test_every_variant_renders_objects_that_validate_strictly(label, obj):
    import kubernetes_validate

    _, objects = rendered(obj)
    for o in objects:
        for version in ("1.31.0", "1.37.0"):  # the oldest and newest this project supports
            dra = o["apiVersion"] == "resource.k8s.io/v1"  # DRA's claim templates: Kubernetes 1.34+ only
            kubernetes_validate.validate(o, max(version, "1.34.0") if dra else version, strict=True)
