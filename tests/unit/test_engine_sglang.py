"""SGLang-Neuron against its pinned contract (operator/engines/sglang.py, PINNED): every name the operator
emits is recorded with a source; each role gets what SGLang's prefill/decode disaggregation documents (NIXL
over libfabric on EFA, the prefill's bootstrap port); the servers compile when they start, so nothing points
them at the read-only cache; Trn3, where SGLang-Neuron 0.1.0 serves LLMs, is in the topology table; what it
cannot do is refused.

SGLang's own parser cannot be read here: the image holds SGLang at commit 43881a7, which PyPI does not publish
(its nearest wheels are 39 MB binary ones), so the values below are the recorded ones of python/sglang/srt/
server_args.py (ServerArgs), named in PINNED."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from support import ROOT

from neuronfleet.contract import CACHE_MOUNT, HF_TOKEN_ENVS, MODEL_MOUNT
from neuronfleet.operator import builders, topology, validation
from neuronfleet.operator.engines import sglang
from neuronfleet.operator.status import compute_status, transitions

SAMPLES = [p for p in sorted((ROOT / "crds" / "samples").glob("*.yaml")) if "engine: sglang" in p.read_text()]
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
# SGLang's ServerArgs (python/sglang/srt/server_args.py): the choices and the int-typed options of the flags
# emitted here; DISAGG_TRANSFER_BACKEND_CHOICES; disaggregation_bootstrap_port's default, 8998
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
TRANSFER_BACKENDS = ["mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp"]
INT_FLAGS = (
    "--port",
    "--tp-size",
    "--max-running-requests",
    "--context-length",
    "--disaggregation-bootstrap-port",
)
DEFAULT_BOOTSTRAP_PORT = 8998


def server_args() -> argparse.ArgumentParser:
    """The flags of PINNED, typed as ServerArgs types them: an unrecorded flag fails the parse."""
    p = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    for fact in sglang.PINNED.facts:
        if fact.kind == "arg" and fact.name.startswith("--"):
            if fact.name in INT_FLAGS:
                p.add_argument(fact.name, type=int)
            elif fact.name == "--dtype":
                p.add_argument(fact.name, choices=DTYPES)
            elif fact.name == "--disaggregation-mode":
                p.add_argument(fact.name, choices=["null", "prefill", "decode"])
            elif fact.name == "--disaggregation-transfer-backend":
                p.add_argument(fact.name, choices=TRANSFER_BACKENDS)
            elif fact.value == "flag":
                p.add_argument(fact.name, action="store_true")
            elif fact.value in ("int", "float"):
                p.add_argument(fact.name, type={"int": int, "float": float}[fact.value])
            elif "|" in fact.value or fact.value.startswith("fp8"):
                p.add_argument(fact.name, choices=fact.value.split("|"))
            else:
                p.add_argument(fact.name)
    return p


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def spec_of(obj: dict):
    spec, errors = validation.parse(obj)
    assert not errors, errors
    return spec


def deployments(obj: dict) -> dict[str, dict]:
    spec = spec_of(obj)
    objects = builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec))
    return {o["metadata"]["labels"]["neuronfleet.dev/role"]: o for o in objects if o["kind"] == "Deployment"}


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def variants() -> list[dict]:
    """The sglang samples, unified too, and with a revision and a model on a claim."""
    out = []
    for path in SAMPLES:
        obj = load(path)
        out.append(obj)
        unified = json.loads(json.dumps(obj))
        unified["spec"]["serving"] = {"unified": {"replicas": 1}}
        unified["spec"]["model"]["revision"] = "refs/pr/3"
        out.append(unified)
        on_claim = json.loads(json.dumps(obj))
        on_claim["spec"]["model"] = {"uri": "pvc://models/gpt-oss"}
        out.append(on_claim)
    return out


@pytest.mark.parametrize("obj", variants(), ids=lambda o: f"{o['spec']['model']['uri']}")
def test_every_role_gets_only_recorded_names_with_the_spec_and_its_roles_values(obj):
    spec = spec_of(obj)
    by_role = deployments(obj)
    engine_roles = {r: d for r, d in by_role.items() if r != "router"}  # the router is ours
    assert engine_roles
    for role, deployment in engine_roles.items():
        c = container(deployment)
        assert " ".join(c["command"][:3]) in {f.name for f in sglang.PINNED.facts}
        args = server_args().parse_args(c["command"][3:])
        env = env_of(c)
        assert set(env) - set(HF_TOKEN_ENVS) <= {f.name for f in sglang.PINNED.facts if f.kind == "env"}
        n = spec.neuron
        assert (args.tp_size, args.max_running_requests, args.context_length) == (
            n.tensorParallel,
            n.batchSize,
            n.sequenceLength,
        )
        assert (args.dtype, args.port, args.served_model_name) == (n.dtype, spec.serving.port, "m")
        assert args.revision == spec.model.revision
        assert args.enable_metrics  # the autoscaler's signals (sglang:* on /metrics)
        # the seed's options: expert parallelism, an fp8 KV cache, the static memory fraction
        assert args.ep_size == n.expertParallel
        assert args.kv_cache_dtype == {"auto": None, "fp8": "fp8_e4m3"}[n.kvCacheDtype]
        assert args.mem_fraction_static == n.memoryFraction
        if spec.model.uri.startswith("pvc://"):
            assert args.model_path == f"{MODEL_MOUNT}/gpt-oss"
        else:
            assert args.model_path == spec.model.uri.removeprefix("hf://")
        assert env["SGLANG_PLATFORM"] == "neuron"
        if role == "unified":
            assert args.disaggregation_mode is None and "SGLANG_DISAGGREGATION_NIXL_BACKEND" not in env
        else:
            assert args.disaggregation_mode == role
            assert args.disaggregation_transfer_backend == "nixl"
            assert env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "LIBFABRIC"  # NIXL over libfabric: EFA
        # the prefill's bootstrap server listens where decode servers and the router look for it
        expected = sglang.BOOTSTRAP_PORT if role == "prefill" else None
        assert args.disaggregation_bootstrap_port == expected
    assert sglang.BOOTSTRAP_PORT == DEFAULT_BOOTSTRAP_PORT


def test_every_recorded_name_has_a_meaning_and_a_public_source():
    assert sglang.PINNED.image == sglang.IMAGE
    assert sglang.IMAGE.endswith(":v0.1.0-neuron-py314-sdk-2.33.0-ubuntu26.04")
    for fact in sglang.PINNED.facts:
        assert fact.meaning and re.search(r"github\.com/|https://", fact.source), fact


def test_no_compile_ahead_but_the_servers_keep_their_graphs_and_downloads_on_the_claim():
    """SGLang-Neuron compiles at each server's start (`compiles` is False but for an s3:// model, whose Job
    only fetches it: tests/unit/test_s3_models.py): the operator builds no compile Job or config and the
    status claims no compile (Compiled=False, NoCompileStep) while the model becomes Ready once its pods are;
    but the model's cache claim exists (its storage class as the spec names it), and every server mounts it
    writable and keeps TorchNeuron's NEFF cache and the Hub's downloads in one folder per image there, so the
    next server (a restart, a scale-up) reuses them."""
    obj = load(SAMPLES[0])
    spec = spec_of(obj)
    assert not sglang.compiles(spec)
    chash = builders.compile_hash(spec)
    objects = builders.build_all(OWNER, spec, internal_token="t")
    kinds = [o["kind"] for o in objects]
    assert "Job" not in kinds and "ConfigMap" not in kinds, kinds
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["storageClassName"] == spec.compile.cache.storageClassName == "fsx-lustre"
    folder = f"{CACHE_MOUNT}/sglang/{hashlib.sha256(sglang.IMAGE.encode()).hexdigest()[:16]}"
    for role, deployment in deployments(obj).items():
        if role == "router":
            continue
        c = container(deployment)
        env = env_of(c)
        assert (env["HF_HOME"], env["TORCH_NEURONX_NEFF_CACHE_DIR"]) == (f"{folder}/hf", f"{folder}/neff")
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == CACHE_MOUNT]
        assert mount["readOnly"] is False
        (volume,) = [
            v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
        ]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    roles = {role: (r, r) for role, r in builders.serving_roles(spec).items()}
    status = compute_status(
        old={}, generation=1, errors=[], compile_hash=chash, serving_hash=chash, job=("succeeded", ""),
        roles=roles, compile_step=False, endpoint="http://m:8000", at="2026-11-30T00:00:00Z",
    )  # fmt: skip
    compiled = next(c for c in status["conditions"] if c["type"] == "Compiled")
    assert (compiled["status"], compiled["reason"]) == ("False", "NoCompileStep")
    assert status["phase"] == "Ready" and status["artifacts"] is None
    serving = sum(r for role, (r, _) in roles.items() if role != "router")  # the router serves no model
    rolled_out = ("Normal", "RolledOut", f"{serving}/{serving} pods ready; serving revision {chash}")
    assert rolled_out in transitions({}, status)


def test_servers_run_as_the_image_expects_with_the_documented_capabilities():
    """The image's own user and root file system; SYS_NICE (the configuration reference's container
    options), IPC_LOCK with EFA (P/D: its troubleshooting page); the pod's first process reaps the server's
    workers (docker's --init there); a memory-backed /dev/shm (its --ipc=host)."""
    for role, deployment in deployments(load(SAMPLES[0])).items():
        if role == "router":
            continue
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        assert "runAsUser" not in pod["securityContext"] and "runAsUser" not in c["securityContext"]
        assert "readOnlyRootFilesystem" not in c["securityContext"]
        assert c["securityContext"]["capabilities"] == {"drop": ["NET_RAW"], "add": ["SYS_NICE", "IPC_LOCK"]}
        assert not c["securityContext"]["allowPrivilegeEscalation"]
        assert pod["shareProcessNamespace"] is True
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_prefill_and_decode_get_the_trn3_cores_and_efa_they_ask_for():
    obj = load(SAMPLES[0])
    spec = spec_of(obj)
    by_role = deployments(obj)
    for role in ("prefill", "decode"):
        pod = by_role[role]["spec"]["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        assert limits["aws.amazon.com/neuroncore"] == str(spec.neuron.tensorParallel)
        assert limits["vpc.amazonaws.com/efa"] == str(spec.serving.kvTransfer.efaInterfaces)
        assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn3.48xlarge"


def test_trn3_in_the_topology_table():
    """16 Trainium3 chips of 8 NeuronCore-v4 and 144 GiB; LNC 2 by default (4 logical cores a chip) or 1."""
    inst = topology.INSTANCES["trn3.48xlarge"]
    assert (inst.devices, inst.physical_cores_per_device, inst.memory_per_device_gib) == (16, 8, 144)
    assert inst.lnc_configurable and inst.total_cores(None) == 64 and inst.total_cores(1) == 128
    assert inst.memory_per_core(None) == 36 * topology.GIB
    obj = load(SAMPLES[0])
    assert validation.neuron_devices(spec_of(obj)) == (2, 8)
    obj["spec"]["neuron"]["logicalCores"] = 1
    assert validation.neuron_devices(spec_of(obj)) == (1, 8)


def edited(change) -> dict:
    obj = load(SAMPLES[0])
    change(obj["spec"])
    return obj


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (edited(lambda s: s["neuron"].update(instanceType="trn2.48xlarge")),
         "engine sglang (SGLang-Neuron 0.1.0) serves LLMs on Trn3 instances (trn3.48xlarge), not "
         "trn2.48xlarge; use one of those, or engine vllm on trn2.48xlarge"),
        (edited(lambda s: s["neuron"].update(instanceType="inf2.48xlarge")),
         "serves LLMs on Trn3 instances (trn3.48xlarge), not inf2.48xlarge"),
        (edited(lambda s: s["serving"]["kvTransfer"].update(transport="tcp")),
         "kvTransfer.transport tcp: SGLang-Neuron moves the KV cache with NIXL over LIBFABRIC (EFA); use "
         "kvTransfer.transport efa"),
        (edited(lambda s: s["neuron"].update(maxInputLength=4096)),
         "neuron.maxInputLength 4096 must be neuron.sequenceLength - 1"),
        (edited(lambda s: s["neuron"].update(tensorParallel=128)),
         "tensorParallel 128 is not a documented degree on trn3.48xlarge"),
    ],
)  # fmt: skip
def test_what_sglang_neuron_cannot_do_is_refused_saying_what_works(obj, message):
    report = validation.check(obj)
    assert any(message in e for e in report.errors), report.errors


def test_the_sample_is_accepted_and_fits_the_instance_it_names():
    report = validation.check(load(SAMPLES[0]))
    assert report.ok, report.errors
    assert report.fit is not None and report.fit.checked
    assert report.fit.needed_bytes_per_core <= report.fit.available_bytes_per_core
