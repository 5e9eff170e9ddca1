"""An s3:// model, as the operator builds for it (pure): every engine that has a compile Job reads it (ours in
`neuronfleet compile`; vLLM, TGI and SGLang, whose images have no AWS SDK, from the download an initContainer
of our CPU image leaves on the compile cache, which their compile and serving read as a folder; SGLang, which
compiles as each server starts, gets a compile Job for the download alone); the compile Job and the source
probe run as compile.serviceAccountName
(serving pods never); a failed fetch-model initContainer's termination message is the compile's failure.
Every object is valid Kubernetes (kubernetes-validate, strict)."""

from __future__ import annotations

import hashlib

import kubernetes_validate
import pytest
import yaml
from pydantic import ValidationError
from support import ROOT

from neuronfleet.contract import CACHE_MOUNT, SOURCE_UNAVAILABLE
from neuronfleet.operator import builders, engines, pod_parts, status, validation
from neuronfleet.operator.spec import NeuronModelSpec

KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]
OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")
SAMPLES = {
    "embedded": "smollm2-135m-local-cpu.yaml",
    "vllm": "llama-3.3-70b-vllm-trn2.yaml",
    "tgi": "llama-3.2-3b-tgi-inf2.yaml",
    "sglang": "gpt-oss-120b-sglang-trn3-disaggregated.yaml",
}
URI = "s3://models-bucket/llama/3.3-70b"
SOURCE_DIR = f"{CACHE_MOUNT}/sources/{hashlib.sha256(URI.encode()).hexdigest()[:16]}"


def spec_of(engine: str, uri: str = URI, account: str | None = "model-reader") -> NeuronModelSpec:
    raw = yaml.safe_load((ROOT / "crds" / "samples" / SAMPLES[engine]).read_text())["spec"]
    raw["model"] = {"uri": uri}
    if account:
        raw.setdefault("compile", {})["serviceAccountName"] = account
    return NeuronModelSpec.model_validate(raw)


def objects(spec: NeuronModelSpec) -> list[dict]:
    chash = builders.compile_hash(spec)
    return builders.build_all(OWNER, spec, serving_hash=chash)


def kind(objs: list[dict], name: str) -> list[dict]:
    return [o for o in objs if o["kind"] == name]


def test_the_samples_exist():
    for name in SAMPLES.values():
        assert (ROOT / "crds" / "samples" / name).is_file(), name


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("engine", ["embedded", "vllm", "tgi", "sglang"])
def test_every_engine_takes_an_s3_model_through_its_compile_job(engine, version):
    spec = spec_of(engine)
    assert validation.validate(spec).errors == []
    built = objects(spec)
    for obj in built:
        kubernetes_validate.validate(obj, version, strict=True)
    (job,) = kind(built, "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "model-reader"
    for deployment in kind(built, "Deployment"):  # serving pods never read S3: the default account
        assert "serviceAccountName" not in deployment["spec"]["template"]["spec"]


def test_the_embedded_compile_downloads_itself():
    built = objects(spec_of("embedded"))
    (job,) = kind(built, "Job")
    pod = job["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert pod["containers"][0]["command"][:2] == ["neuronfleet", "compile"]
    (config_map,) = kind(built, "ConfigMap")
    assert f'"uri":"{URI}"' in config_map["data"]["compile.json"].replace(" ", "")


@pytest.mark.parametrize("engine", ["vllm", "tgi", "sglang"])
def test_the_engines_compile_the_folder_a_fetch_model_init_container_leaves_on_the_cache(engine):
    built = objects(spec_of(engine))
    (job,) = kind(built, "Job")
    pod = job["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["image"] == engines.OWN_IMAGES["cpu"]  # our image: the engines' have no AWS SDK
    assert fetch["command"] == ["neuronfleet", "fetch-model", "--uri", URI, "--into", SOURCE_DIR]
    cache = next(m for m in fetch["volumeMounts"] if m["name"] == "cache")
    assert cache["mountPath"] == CACHE_MOUNT and not cache.get("readOnly")
    assert fetch["securityContext"]["readOnlyRootFilesystem"] and fetch["securityContext"]["runAsNonRoot"]
    # its writable places only: no Hub token, no keys (the ServiceAccount's role is the credential)
    assert {e["name"]: e["value"] for e in fetch["env"]} == pod_parts.OWN_WRITABLE_ENV
    (config_map,) = kind(built, "ConfigMap")
    script = config_map["data"]["compile.sh"] + "".join(config_map["data"].values())
    assert SOURCE_DIR in script and URI not in config_map["data"]["compile.sh"]


def test_vllm_serves_from_the_downloaded_folder_on_the_cache_it_mounts():
    built = objects(spec_of("vllm"))
    (deployment,) = [d for d in kind(built, "Deployment") if "unified" in d["metadata"]["name"]]
    pod = deployment["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[command.index("serve") + 1] == SOURCE_DIR  # vllm serve <the folder>
    cache = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "cache")
    assert cache["mountPath"] == CACHE_MOUNT and cache["readOnly"] is True
    assert not any(e["name"].startswith(("HF_", "HUGGING")) for e in pod["containers"][0].get("env", []))


def test_sglang_gets_a_compile_job_for_the_download_alone_and_serves_the_folder():
    """SGLang-Neuron compiles as each server starts: for an s3:// model its Job only fetches (our CPU image,
    no Neuron device, a check that files arrived) and its prefill and decode pods, which hold no S3
    credentials, read the folder from the cache they mount (writable: they keep their compiled graphs there).
    Other sources keep no Job at all."""
    spec = spec_of("sglang")
    assert engines.compiles(spec) and not engines.compiles(spec_of("sglang", uri="hf://openai/gpt-oss-120b"))
    built = objects(spec)
    (job,) = kind(built, "Job")
    pod = job["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    assert main["image"] == engines.OWN_IMAGES["cpu"] and "aws.amazon.com/neuroncore" not in str(main)
    assert "nodeSelector" not in pod and "tolerations" not in pod  # any node: it reads no device
    (config_map,) = kind(built, "ConfigMap")
    assert f"ls -A {SOURCE_DIR}" in config_map["data"]["compile.sh"]
    engine_pods = [
        d for d in kind(built, "Deployment")
        if d["metadata"]["labels"]["neuronfleet.dev/role"] in ("prefill", "decode")
    ]  # fmt: skip
    assert len(engine_pods) == 2
    for deployment in engine_pods:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][container["command"].index("--model-path") + 1] == SOURCE_DIR
        cache = next(m for m in container["volumeMounts"] if m["name"] == "cache")
        assert cache["mountPath"] == CACHE_MOUNT and cache["readOnly"] is False


def test_the_source_probe_runs_as_the_compile_service_account_and_fingerprints_s3():
    spec = spec_of("embedded")
    probe = builders.build_source_probe(OWNER, spec, builders.compile_hash(spec))
    kubernetes_validate.validate(probe, KUBERNETES_VERSIONS[-1], strict=True)
    pod = probe["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "model-reader"
    assert pod["containers"][0]["command"] == ["neuronfleet", "source-fingerprint", "--uri", URI]
    plain = spec_of("embedded", account=None)
    assert (
        "serviceAccountName" not in builders.build_source_probe(OWNER, plain, "h")["spec"]["template"]["spec"]
    )


def test_the_service_account_name_does_not_change_the_compile_hash():
    assert builders.compile_hash(spec_of("vllm")) == builders.compile_hash(spec_of("vllm", account=None))


@pytest.mark.parametrize("bad", ["Model_Reader", "-reader", "a" * 254])
def test_a_bad_service_account_name_is_refused(bad):
    with pytest.raises(ValidationError, match="serviceAccountName"):
        spec_of("embedded", account=bad)


def test_hf_models_keep_the_token_from_the_secret_only():
    raw = yaml.safe_load((ROOT / "crds" / "samples" / SAMPLES["vllm"]).read_text())["spec"]
    spec = NeuronModelSpec.model_validate(raw)
    (job,) = kind(objects(spec), "Job")
    pod = job["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    for env in pod["containers"][0].get("env", []):
        assert "value" not in env or not env["name"].startswith(("HF_", "HUGGING"))


def test_a_failed_fetch_model_init_container_is_the_compile_failure():
    message = (
        f"neuronfleet fetch-model: {SOURCE_UNAVAILABLE} {URI}: access denied (AccessDenied): the compile "
        "Job's credentials need s3:ListBucket"
    )
    pod = {
        "status": {
            "phase": "Failed",
            "initContainerStatuses": [
                {
                    "name": "fetch-model",
                    "state": {
                        "terminated": {
                            "exitCode": 2,
                            "message": message,
                            "finishedAt": "2026-11-30T16:00:00Z",
                        }
                    },
                }
            ],
            "containerStatuses": [{"name": "compile", "state": {"waiting": {"reason": "PodInitializing"}}}],
        }
    }
    assert status.compile_failure([pod]) == message


def test_sglangs_fetch_only_compile_fails_on_an_empty_download_and_marks_a_full_one(tmp_path):
    """SGLang's compile.sh, run by a real sh on a stand-in cache: no files from the download is the compile's
    failure, saying so in the termination message; files there make the manifest (the completion marker)."""
    import os
    import subprocess

    from neuronfleet.contract import TERMINATION_LOG_ENV

    script = engines.compile_files(spec_of("sglang"), "h1")["compile.sh"].replace(CACHE_MOUNT, str(tmp_path))
    (tmp_path / "compile.sh").write_text(script)
    log = tmp_path / "termination-log"
    env = {**os.environ, TERMINATION_LOG_ENV: str(log)}
    run = subprocess.run(["sh", str(tmp_path / "compile.sh")], capture_output=True, text=True, env=env)
    folder = SOURCE_DIR.replace(CACHE_MOUNT, str(tmp_path))
    assert run.returncode == 1 and log.read_text().strip() == f"the download left no files in {folder}"
    os.makedirs(folder)
    (tmp_path / folder / "config.json").write_text("{}")
    run = subprocess.run(["sh", str(tmp_path / "compile.sh")], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and (tmp_path / "artifacts" / "h1" / "manifest.json").is_file()
