"""The objects the operator creates: valid Kubernetes (kubernetes-validate, strict), owned and labelled,
device-plugin aware, least privilege, engines' contracts; and the compile hash."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support import ROOT

from neuronfleet.contract import (
    CACHE_MOUNT,
    CONFIG_MOUNT,
    GRACE_PERIOD,
    HF_TOKEN_ENVS,
    INTERNAL_TOKEN_DIR,
    INTERNAL_TOKEN_FILE,
    KV_PORT,
    TERMINATION_LOG_ENV,
)
from neuronfleet.operator import builders, engines, pod_parts, validation
from neuronfleet.operator.engines.timeouts import START_SLACK_S
from neuronfleet.operator.spec import SecretKeyRef

SAMPLES_DIR = ROOT / "crds" / "samples"
SAMPLES = sorted(SAMPLES_DIR.glob("*.yaml"))
KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]  # oldest and newest this project supports
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")


def parsed(path: Path):
    spec, errors = validation.parse(yaml.safe_load(path.read_text()))
    assert not errors
    return spec


def sample(name: str):
    return parsed(ROOT / "crds" / "samples" / name)


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_object_is_valid_kubernetes_and_owned(path, version):
    spec = parsed(path)
    objects = builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec))
    for obj in objects:
        dra = obj["apiVersion"] == "resource.k8s.io/v1"  # DRA's claim templates: Kubernetes 1.34+ only
        kubernetes_validate.validate(obj, max(version, "1.34.0") if dra else version, strict=True)
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "neuronfleet.dev/v1alpha1",
                "kind": "NeuronModel",
                "name": "m",
                "uid": OWNER.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "neuronfleet-operator"
        assert meta["labels"]["neuronfleet.dev/model"] == "m"


def test_before_the_first_compile_only_the_cache_config_secret_policies_and_compile_job_exist():
    spec = sample("smollm2-135m-local-cpu.yaml")
    kinds = [o["kind"] for o in builders.build_all(OWNER, spec, internal_token="t")]
    assert kinds == ["PersistentVolumeClaim", "ConfigMap", "Secret", "NetworkPolicy", "NetworkPolicy", "Job"]


def test_a_pod_that_loads_in_seconds_is_probed_often_and_a_neuron_pod_as_long_as_its_engine_starts():
    """A cpu model's pods and every router load in seconds: their startup probe runs every 2 s, so they are
    Ready soon after loading, within an hour; a pod that loads onto Neuron devices is probed every 10 s for as
    long as its engine may take to start (engines.timeouts), and the start guard's slack."""
    cpu = sample("smollm2-135m-local-cpu-disaggregated.yaml")
    neuron = sample("llama-3.3-70b-vllm-trn2-disaggregated.yaml")
    for spec, loads_on_neuron in ((cpu, {"prefill": False, "decode": False, "router": False}),
                                  (neuron, {"prefill": True, "decode": True, "router": False})):  # fmt: skip
        chash = builders.compile_hash(spec)
        for dep in by_kind(builders.build_all(OWNER, spec, serving_hash=chash))["Deployment"]:
            role = dep["metadata"]["labels"]["neuronfleet.dev/role"]
            probe = container(dep)["startupProbe"]
            assert probe["periodSeconds"] == (10 if loads_on_neuron[role] else 2), role
            start = engines.start_timeout(spec, role) if loads_on_neuron[role] else 3600 - START_SLACK_S
            assert probe["periodSeconds"] * probe["failureThreshold"] >= start + START_SLACK_S, role


def test_unified_deployment_asks_the_device_plugin_and_the_neuron_scheduler():
    spec = sample("llama-3.1-8b-vllm-inf2.yaml")
    chash = builders.compile_hash(spec)
    objs = by_kind(builders.build_all(OWNER, spec, serving_hash=chash))
    (dep,) = [d for d in objs["Deployment"] if d["metadata"]["labels"]["neuronfleet.dev/role"] == "unified"]
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert dep["spec"]["replicas"] == 2
    assert c["resources"]["limits"]["aws.amazon.com/neuroncore"] == "8"
    assert c["resources"]["requests"]["aws.amazon.com/neuroncore"] == "8"
    assert "vpc.amazonaws.com/efa" not in c["resources"]["limits"]
    assert "schedulerName" not in pod  # the operator names no scheduler the cluster may not run
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "inf2.48xlarge"
    assert pod_parts.NEURON_TAINT in pod["tolerations"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= (
        engines.start_timeout(spec, "unified") + START_SLACK_S)  # fmt: skip
    # still serving through the preStop sleep while the endpoints drop the pod, then draining: the grace
    # period holds both
    assert c["lifecycle"] == {"preStop": {"sleep": {"seconds": builders.ENDPOINT_DRAIN_SECONDS}}}
    assert pod["terminationGracePeriodSeconds"] > builders.ENDPOINT_DRAIN_SECONDS + GRACE_PERIOD
    sc = c["securityContext"]  # vLLM's image runs as its own user (root), with its documented capabilities
    assert "runAsNonRoot" not in sc and "allowPrivilegeEscalation" not in sc  # (SYS_ADMIN escalates)
    assert sc["capabilities"] == {"drop": ["NET_RAW"], "add": ["SYS_ADMIN", "IPC_LOCK"]}
    # CPU and memory: a third (8 of inf2.48xlarge's 24 cores) of what a pod may request of its node, worked
    # out here by hand (docs/resources.md): 192 vCPUs less the EKS AMI's kube-reserved CPU (6% of the first
    # core, 1% of the second, 0.5% of the next two, 0.25% of the other 188: 550m) and the DaemonSets' 520m;
    # 768 GiB less the 7.5% a node does not report, kube-reserved (255 MiB + 11 MiB x 737 pods), the 100 MiB
    # eviction threshold and the DaemonSets' 1232 MiB
    assert c["resources"]["requests"]["cpu"] == str(int((192_000 - 550 - 520) / 3 / 1000))  # 63
    node_mib = int(768 * 1024 * 0.925) - (255 + 11 * 737) - 100 - 1232
    assert c["resources"]["requests"]["memory"] == f"{-(-node_mib // (3 * 1024))}Gi"  # 234Gi, rounded up
    cache_mount = next(m for m in c["volumeMounts"] if m["name"] == "cache")
    assert cache_mount["readOnly"] is True  # serving pods only read the artifacts
    # two pods: the public Service selects their front door (kv-aware routing), which finds them by theirs
    services = {s["metadata"]["name"]: s for s in objs["Service"]}
    assert services["m"]["spec"]["selector"]["neuronfleet.dev/role"] == "router"
    assert services["m-unified"]["spec"]["clusterIP"] == "None"
    assert objs["PodDisruptionBudget"][0]["spec"]["maxUnavailable"] == 1
    # our runtime (engine embedded, which serves on cpu): its command, its readiness, a read-only root, and
    # no Neuron devices or Neuron nodes
    cpu = sample("smollm2-135m-local-cpu.yaml")
    chash = builders.compile_hash(cpu)
    dep, door = by_kind(builders.build_all(OWNER, cpu, serving_hash=chash))["Deployment"]
    assert [d["metadata"]["labels"]["neuronfleet.dev/role"] for d in (dep, door)] == ["unified", "router"]
    # (the pods, then every unified model's front door)
    c = container(dep)
    assert c["command"][:4] == ["neuronfleet", "serve", "--model", f"{engines.artifacts_dir(chash)}/model"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "aws.amazon.com/neuroncore" not in c["resources"]["limits"]
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]


def disaggregated_efa():
    """GPT-OSS 120B on trn3.48xlarge with SGLang-Neuron: prefill and decode pods with KV caches over EFA, a
    router in front (a disaggregated Neuron path validation accepts: our runtime's Neuron path serves unified
    only, vLLM's is tests/unit/test_engine_vllm_plugin.py's)."""
    spec = sample("gpt-oss-120b-sglang-trn3-disaggregated.yaml")
    assert validation.validate(spec).ok and spec.serving.kvTransfer.transport == "efa"
    return spec


def test_disaggregated_roles_get_efa_headless_services_and_a_router():
    spec = disaggregated_efa()
    objs = by_kind(builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec)))
    deps = {d["metadata"]["labels"]["neuronfleet.dev/role"]: d for d in objs["Deployment"]}
    assert set(deps) == {"prefill", "decode", "router"}
    for role in ("prefill", "decode"):
        limits = container(deps[role])["resources"]["limits"]
        assert limits["vpc.amazonaws.com/efa"] == "4" and limits["aws.amazon.com/neuroncore"] == "8"
    router = container(deps["router"])
    assert "aws.amazon.com/neuroncore" not in router["resources"]["limits"]
    # a version-isolated set: every object of the set carries its revision, and the router names only
    # its own set's headless Services
    rev = builders.serving_set(spec, builders.compile_hash(spec))
    assert len(rev) == 8 and {d["metadata"]["name"] for d in deps.values()} == {
        f"m-{role}-{rev}" for role in deps
    }
    cmd = router["command"]
    assert cmd[cmd.index("--prefill") + 1] == f"dns://m-prefill-{rev}:8000"
    assert cmd[cmd.index("--decode") + 1] == f"dns://m-decode-{rev}:8000"
    assert "nodeSelector" not in deps["router"]["spec"]["template"]["spec"]
    services = {s["metadata"]["name"]: s for s in objs["Service"]}
    assert services["m"]["spec"]["selector"] == {
        "neuronfleet.dev/model": "m", "neuronfleet.dev/role": "router", "neuronfleet.dev/set": rev
    }  # fmt: skip
    for role in ("prefill", "decode"):
        headless = services[f"m-{role}-{rev}"]
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["selector"]["neuronfleet.dev/set"] == rev
        assert deps[role]["spec"]["selector"]["matchLabels"] == headless["spec"]["selector"]
    # another compile hash is another set: nothing of it shares a name or selects the other's pods
    other = builders.serving_set(spec, "f" * 16)
    assert other != rev
    again = by_kind(builders.build_all(OWNER, spec, serving_hash="f" * 16))
    assert not {o["metadata"]["name"] for o in again["Deployment"]} & {
        d["metadata"]["name"] for d in deps.values()
    }


def test_engines_follow_their_documented_contracts():
    tgi = sample("llama-3.2-3b-tgi-inf2.yaml")
    c = engines.serve_container(tgi, "unified", "h", 8000)
    assert {k: v for k, v in c.env.items() if k != "HOME"} == {
        "HF_NUM_CORES": "2",
        "HF_AUTO_CAST_TYPE": "bf16",
        "MAX_BATCH_SIZE": "4",
        "MAX_TOTAL_TOKENS": "4096",
        "MAX_INPUT_TOKENS": "3072",
        "MAX_BATCH_PREFILL_TOKENS": str(4 * 3072),
        "PORT": "8000",
    }
    assert c.command[:2] == ["/bin/sh", "-c"]  # the start guard, then TGI
    assert c.command[4:] == ["/tgi-entrypoint.sh", "--model-id", f"{engines.artifacts_dir('h')}/model"]
    vllm = sample("llama-3.1-70b-vllm-trn1.yaml")  # the plugin over NxD Inference
    c = engines.serve_container(vllm, "unified", "h", 8000)
    assert c.env["NEURON_COMPILED_ARTIFACTS"] == f"{engines.artifacts_dir('h')}/model"
    assert c.command[:2] == ["/bin/sh", "-c"]  # the start guard, then vLLM
    assert c.command[4:7] == ["vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct"]
    assert c.command[c.command.index("--tensor-parallel-size") + 1] == "32"
    config = json.loads(c.command[c.command.index("--additional-config") + 1])["override_neuron_config"]
    assert config["save_sharded_checkpoint"] is True
    vllm = sample("llama-3.3-70b-vllm-trn2.yaml")  # the vLLM Neuron plugin, compiled ahead
    c = engines.serve_container(vllm, "unified", "h", 8000)
    assert c.env["NEURON_LOGICAL_NC_CONFIG"] == "2" and c.env["VLLM_NEURON_DISABLE_WARMUP_COMPILE"] == "1"
    assert c.command[4:7] == ["vllm", "serve", f"{engines.artifacts_dir('h')}/model"]
    assert c.command[c.command.index("--tensor-parallel-size") + 1] == "64"
    sglang = sample("gpt-oss-120b-sglang-trn3-disaggregated.yaml")
    c = engines.serve_container(sglang, "decode", "h", 8000)
    assert c.env["SGLANG_PLATFORM"] == "neuron"
    assert c.env["SGLANG_DISAGGREGATION_NIXL_BACKEND"] == "LIBFABRIC"
    assert c.command[c.command.index("--disaggregation-mode") + 1] == "decode"
    assert c.command[c.command.index("--disaggregation-transfer-backend") + 1] == "nixl"


def test_compile_job_writes_the_hashes_folder_and_finishes_at_once_on_a_cache_hit(tmp_path):
    spec = sample("llama-3.2-3b-tgi-inf2.yaml")
    existing = spec.compile.cache.model_copy(update={"claimName": "artifacts", "storageClassName": None})
    spec = spec.model_copy(update={"compile": spec.compile.model_copy(update={"cache": existing})})
    chash = builders.compile_hash(spec)
    objs = by_kind(builders.build_all(OWNER, spec))
    job = objs["Job"][0]
    assert job["metadata"]["name"] == f"m-compile-{chash[:10]}"
    assert job["spec"]["backoffLimit"] == 2
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["/bin/sh", f"{CONFIG_MOUNT}/compile.sh"]
    assert "PersistentVolumeClaim" not in objs  # an existing claim is named
    cache = next(v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache")
    assert cache["persistentVolumeClaim"]["claimName"] == "artifacts"
    # the script itself: a cache hit exits 0 without running the compile step
    script = objs["ConfigMap"][0]["data"]["compile.sh"].replace(CACHE_MOUNT, str(tmp_path))
    out = tmp_path / "artifacts" / chash
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"engine": "tgi", "compileHash": chash}) + "\n")
    log = tmp_path / "termination-log"
    env = {"PATH": "/usr/bin:/bin", TERMINATION_LOG_ENV: str(log)}
    run = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "cache hit" in run.stdout
    assert json.loads(log.read_text()) == {"engine": "tgi", "compileHash": chash, "cacheHit": True}


def test_the_hugging_face_token_comes_only_from_the_secret_and_only_where_it_is_used():
    """The compile Job downloads the model; serving pods of our runtime, TGI and vLLM on Trn2/Trn3 read only
    the compiled folder, so get no token; vLLM over NxD Inference and SGLang name the Hub id at serve time, so
    get it (not their router)."""
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    for name, served_with_token in (
        ("smollm2-135m-local-cpu.yaml", set()),
        ("llama-3.1-70b-vllm-trn1.yaml", {"unified"}),
        ("llama-3.3-70b-vllm-trn2.yaml", set()),
    ):
        spec = sample(name)
        spec.model.secretRef = spec.model.secretRef or SecretKeyRef(name="hf-token")
        seen = {}
        for obj in builders.build_all(OWNER, spec, serving_hash="x"):
            pod = obj.get("spec", {}).get("template", {}).get("spec")
            if pod:
                env = {e["name"]: e for e in pod["containers"][0]["env"]}
                seen[obj["metadata"]["labels"]["neuronfleet.dev/role"]] = env.get("HF_TOKEN")
        assert seen.pop("compile") == token, name
        assert {role for role, env in seen.items() if env} == served_with_token, name
        assert all(env in (None, token) for env in seen.values())


def test_compile_hash_changes_with_what_is_compiled_and_only_that():
    spec = sample("llama-3.1-8b-vllm-inf2.yaml")
    h = builders.compile_hash(spec)
    assert h == builders.compile_hash(copy.deepcopy(spec)) and len(h) == 16
    same = spec.model_copy(deep=True)
    same.serving.unified.replicas = 5
    same.autoscaling.max = 10
    assert builders.compile_hash(same) == h
    for change in (
        lambda s: setattr(s.neuron, "batchSize", 4),
        lambda s: setattr(s.neuron, "dtype", "float16"),
        lambda s: setattr(s.model, "revision", "main"),
        lambda s: setattr(s, "engine", "tgi"),
        lambda s: setattr(s.neuron.buckets, "context", [1024, 6144]),
    ):
        other = spec.model_copy(deep=True)
        change(other)
        assert builders.compile_hash(other) != h


def test_render_prints_the_objects_and_refuses_a_bad_manifest(tmp_path):
    path = ROOT / "crds" / "samples" / "llama-3.1-8b-vllm-inf2.yaml"
    run = subprocess.run(
        [sys.executable, "-P", "-m", "neuronfleet.cli", "render", str(path), "--namespace", "prod"],
        capture_output=True,
        text=True,
        check=True,
    )
    docs = list(yaml.safe_load_all(run.stdout))
    assert [d["kind"] for d in docs] == [
        "PersistentVolumeClaim",
        "ConfigMap",
        "Secret",
        "NetworkPolicy",
        "NetworkPolicy",
        "Job",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
        "Deployment",
        "Service",
    ]  # fmt: skip (its 2 pods: a front door that routes kv-aware before them, and their headless Service)
    assert {d["metadata"]["namespace"] for d in docs} == {"prod"}
    # applicable as they are: no ownerReference to an owner that does not exist (the garbage collector would
    # delete such an object at once), and each valid Kubernetes
    assert not [d["metadata"]["name"] for d in docs if "ownerReferences" in d["metadata"]]
    for d in docs:
        kubernetes_validate.validate(d, KUBERNETES_VERSIONS[-1], strict=True)
    bad = yaml.safe_load(path.read_text())
    bad["spec"]["neuron"]["tensorParallel"] = 3
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    run = subprocess.run(
        [sys.executable, "-P", "-m", "neuronfleet.cli", "render", str(tmp_path / "bad.yaml")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "tensorParallel 3 is not a documented degree" in run.stderr


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_model_gets_its_token_secret_and_every_pod_of_our_runtime_reads_it_from_a_file(path):
    """Every model, every engine: the Secret holding the model's internal token; every pod that runs our
    runtime (`neuronfleet serve`: the embedded engine's pods, every engine's routers and front doors) mounts
    it read-only (0440, the pod's fsGroup its group, so the non-root process reads it) and is given
    `--internal-token-file`; the token itself is in no Deployment (not in arguments, not in env); an engine's
    own server mounts none."""
    import base64

    spec = parsed(path)
    objs = by_kind(builders.build_all(OWNER, spec, builders.compile_hash(spec), internal_token="t0k3n"))
    (secret,) = objs["Secret"]
    assert secret["metadata"]["name"] == "m-internal" and secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["token"]).decode() == "t0k3n"
    ours = 0
    for dep in objs["Deployment"]:
        pod, c = dep["spec"]["template"]["spec"], container(dep)
        assert "t0k3n" not in json.dumps(dep)  # the token itself is only in the Secret
        volumes = [v for v in pod["volumes"] if v["name"] == "internal-token"]
        if c["command"][:2] != ["neuronfleet", "serve"]:
            assert not volumes and "--internal-token-file" not in c["command"]
            continue
        ours += 1
        assert c["command"][c["command"].index("--internal-token-file") + 1] == INTERNAL_TOKEN_FILE
        mode = {"secretName": "m-internal", "defaultMode": 0o440}
        assert volumes == [{"name": "internal-token", "secret": mode}]
        mount = {"name": "internal-token", "mountPath": INTERNAL_TOKEN_DIR, "readOnly": True}
        assert mount in c["volumeMounts"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] and security["fsGroup"] == security["runAsUser"] != 0
    roles = [d["metadata"]["labels"]["neuronfleet.dev/role"] for d in objs["Deployment"]]
    assert ours == (len(roles) if spec.engine == "embedded" else roles.count("router"))
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(secret, version, strict=True)


def test_disaggregated_pods_advertise_their_ip_for_kv_and_drop_every_capability_but_efas():
    """Decode pods advertise their pod IP for KV; our pods drop every capability, read-only root; EFA pods
    add IPC_LOCK."""
    obj = yaml.safe_load((SAMPLES_DIR / "smollm2-135m-local-cpu-disaggregated.yaml").read_text())
    obj["spec"]["serving"]["kvTransfer"] = {"transport": "tcp"}  # (the sample's is nixl)
    spec, _ = validation.parse(obj)
    objs = by_kind(builders.build_all(OWNER, spec, builders.compile_hash(spec), internal_token="t0k3n"))
    deps = {d["metadata"]["labels"]["neuronfleet.dev/role"]: d for d in objs["Deployment"]}
    for role, dep in deps.items():
        c = container(dep)
        caps = c["securityContext"]["capabilities"]
        assert caps["drop"] == ["ALL"]
        assert caps.get("add", []) == [], role  # KV over tcp: no EFA
        assert (
            c["securityContext"]["readOnlyRootFilesystem"]
            and not c["securityContext"]["allowPrivilegeEscalation"]
        )
    decode = container(deps["decode"])
    assert decode["command"][decode["command"].index("--kv-port") + 1] == str(KV_PORT)
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in decode["env"]
    # pods with EFA devices (KV over EFA: the vLLM and SGLang engines) add IPC_LOCK to what their engine's
    # documentation adds (SGLang: SYS_NICE); our router drops every capability
    efa = disaggregated_efa()
    for dep in by_kind(builders.build_all(OWNER, efa, builders.compile_hash(efa)))["Deployment"]:
        role = dep["metadata"]["labels"]["neuronfleet.dev/role"]
        caps = container(dep)["securityContext"]["capabilities"]
        engine_caps = {"drop": ["NET_RAW"], "add": ["SYS_NICE", "IPC_LOCK"]}
        assert caps == (engine_caps if role != "router" else {"drop": ["ALL"]}), role
    # no Secret without a caller's token (`neuronfleet render` and the operator pass one)
    assert "Secret" not in by_kind(builders.build_all(OWNER, sample("smollm2-135m-local-cpu.yaml"), "h"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_the_source_probe_is_valid_reads_only_the_source_and_takes_the_token_only_for_the_hub(path):
    """The Job that fingerprints a failed compile's source: strictly valid, owned, our CPU image on any node
    (no Neuron resources or placement), the model's claim read-only for pvc://, the Hub token (from the
    Secret) only for hf://."""
    spec = parsed(path)
    job = builders.build_source_probe(OWNER, spec, "abcdef0123456789")
    kubernetes_validate.validate(job, KUBERNETES_VERSIONS[-1], strict=True)
    assert job["metadata"]["name"] == "m-source-abcdef0123"
    assert job["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"][:4] == ["neuronfleet", "source-fingerprint", "--uri", spec.model.uri]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert not [k for k in c["resources"].get("limits", {}) if k.startswith(("aws.amazon.com", "vpc."))]
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    if spec.model.uri.startswith("pvc://"):
        assert claims == [
            {"claimName": spec.model.uri.removeprefix("pvc://").split("/")[0], "readOnly": True}
        ]
    else:
        assert claims == []  # not even the compile cache
    tokens = [e for e in c["env"] if e["name"] in HF_TOKEN_ENVS]
    assert bool(tokens) == (spec.model.uri.startswith("hf://") and spec.model.secretRef is not None)
    assert all("valueFrom" in e for e in tokens)


@pytest.mark.parametrize(
    ("kv", "flags", "efa"),
    [
        ({"transport": "nixl"}, ["--kv-transport", "nixl", "--kv-nixl-backend", "ucx"], False),
        (
            {"transport": "nixl", "backend": "libfabric"},
            ["--kv-transport", "nixl", "--kv-nixl-backend", "libfabric"],
            True,
        ),
        ({"transport": "efa", "efaInterfaces": 2}, ["--kv-transport", "efa"], True),
    ],
)
def test_embedded_nixl_pods_carry_what_their_backend_needs(kv, flags, efa):
    """The embedded engine's NIXL pods: the transport and backend on the command line; over EFA (LIBFABRIC)
    the EFA devices (requests = limits), IPC_LOCK (libfabric pins registered memory) and the EFA provider's
    shared-memory path off (the Neuron DI tutorial: P and D may share a node); no tcp KV port or pod IP
    (NIXL's metadata carries its addresses). Strictly valid Kubernetes."""
    obj = yaml.safe_load(
        (ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml").read_text()
    )
    obj["spec"]["serving"]["kvTransfer"] = kv
    obj["spec"]["image"] = "registry.example/neuronfleet-runtime-efa:1"
    spec, errors = validation.parse(obj)
    assert not errors and validation.validate(spec).ok, validation.validate(spec).errors
    deps = {
        d["metadata"]["labels"]["neuronfleet.dev/role"]: d
        for d in by_kind(builders.build_all(OWNER, spec, builders.compile_hash(spec)))["Deployment"]
    }
    for role in ("prefill", "decode"):
        c = container(deps[role])
        at = c["command"].index("--kv-transport")
        assert c["command"][at : at + len(flags)] == flags, c["command"]
        assert "--kv-port" not in c["command"] and "kv" not in [p["name"] for p in c["ports"]]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert "POD_IP" not in env
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        caps = c["securityContext"]["capabilities"]
        if efa:
            assert (
                limits["vpc.amazonaws.com/efa"]
                == requests["vpc.amazonaws.com/efa"]
                == str(kv.get("efaInterfaces", 1))
            )
            assert caps.get("add") == ["IPC_LOCK"] and env["FI_EFA_ENABLE_SHM_TRANSFER"] == "0"
        else:
            assert "vpc.amazonaws.com/efa" not in limits and "add" not in caps
            assert "FI_EFA_ENABLE_SHM_TRANSFER" not in env
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(deps[role], version, strict=True)
    assert "--kv-transport" not in container(deps["router"])["command"]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_pod_states_its_security_and_mounts_only_its_models_folder_of_the_cache(path):
    """Every pod (compile Job, source probe, serving Deployments): no ServiceAccount token; our images'
    containers non-root, read-only root, no capability (but IPC_LOCK with EFA), no escalation, RuntimeDefault
    seccomp, HOME, TMPDIR and caches in their /tmp emptyDir; an engine's image: its own user, no raw sockets,
    only the capabilities its documentation adds, no escalation but beside SYS_ADMIN (where Kubernetes counts
    it as escalating, and refuses `false` spelled CAP_SYS_ADMIN); of the cache claim, only the model's own
    folder."""
    spec = parsed(path)
    chash = builders.compile_hash(spec)
    objects = [*builders.build_all(OWNER, spec, chash), builders.build_source_probe(OWNER, spec, chash)]
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Job", "Deployment")]
    assert pods
    for pod in pods:
        assert pod["automountServiceAccountToken"] is False
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            sc, where = c["securityContext"], f"{path.name} {c['name']}"
            assert sc["privileged"] is False and sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            added = set(sc["capabilities"].get("add", []))
            ours = c["image"] in engines.OWN_IMAGES.values() or (spec.engine == "embedded" and not spec.image)
            if ours:
                assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["fsGroup"] == 10001
                assert sc["runAsNonRoot"] and sc["runAsUser"] == sc["runAsGroup"] == 10001, where
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
                assert sc["capabilities"]["drop"] == ["ALL"] and added <= {"IPC_LOCK"}, where
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert {k: env[k] for k in pod_parts.OWN_WRITABLE_ENV} == pod_parts.OWN_WRITABLE_ENV, where
                tmp = next(m for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
                assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"]), where
            else:
                assert "runAsUser" not in sc and "runAsUser" not in pod["securityContext"], where
                assert sc["capabilities"]["drop"] == ["NET_RAW"], where
                assert added <= {*engines.documented_capabilities(spec), "IPC_LOCK"}, where  # (with EFA)
                assert ("allowPrivilegeEscalation" in sc) == ("SYS_ADMIN" not in added), where
            if sc.get("allowPrivilegeEscalation") is False:  # what the API server refuses
                assert not added & {"SYS_ADMIN", "CAP_SYS_ADMIN"}, where
            for mount in c.get("volumeMounts", []):
                if mount["name"] == "cache":
                    assert mount["mountPath"] == CACHE_MOUNT and mount["subPath"] == "models/m", where
