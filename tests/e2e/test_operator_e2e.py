"""The operator run with kopf against the emulated API server, driven by kubectl: compile Job first, then
Deployments and Services; status and conditions; a spec change compiles first and then rolls; drift is
corrected; deletion removes the children; a restarted operator creates no duplicates."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import yaml
from support import (
    HTTP_TIMEOUT,
    OPERATOR_USER,
    ROOT,
    OperatorCluster,
    free_port,
)

from neuronfleet.operator.kube import LEASE_RULES, RBAC_RULES
from neuronfleet.operator.watching import KOPF_RULES

# Our runtime's sample (engine embedded serves on cpu; no kubelet runs its pods here: the test plays the Job
# and Deployment controllers), and a Neuron sample for the refusals
SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
NEURON_SAMPLE = ROOT / "crds" / "samples" / "llama-3.1-8b-vllm-inf2.yaml"
CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"


class Cluster(OperatorCluster):
    """`OperatorCluster` with operators started, waited on and stopped as processes."""

    def wait_for(self, what: str, check: Callable[[], object]) -> object:
        """Wait while the newest operator lives and works."""
        return self.operators[-1].wait_until(check, what)

    def wait_for_resume(self) -> None:
        """Until the newest operator leads and has reconciled every model once (it logs so)."""
        log = self.operators[-1].log
        said = "leading: every model reconciled once"
        self.wait_for("every model reconciled", lambda: said in log.read_text())


@pytest.fixture()
def cluster(tmp_path):
    api = Cluster(tmp_path)
    yield api
    api.stop()
    # least privilege, observed: every call the operator (kopf and our client) made is in RBAC_RULES, which
    # the chart's RBAC equals (tests/unit/test_chart.py)
    calls = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    used = {(c["group"], c["resource"], c["verb"]) for c in calls if c["user"] == OPERATOR_USER}
    declared = {(g, r, v) for (g, r), verbs in (RBAC_RULES | LEASE_RULES | KOPF_RULES).items() for v in verbs}
    assert used and used <= declared, sorted(used - declared)


def without_rules(node):
    """A CRD (or a part of it) without its x-kubernetes-validations."""
    if isinstance(node, dict):
        return {k: without_rules(v) for k, v in node.items() if k != "x-kubernetes-validations"}
    return [without_rules(v) for v in node] if isinstance(node, list) else node


def get(api, *args: str) -> dict | None:
    return api.kubectl.get(*args)


def items(api, kind: str) -> list[dict]:
    return get(api, kind)["items"]


def condition(model: dict, type_: str) -> dict:
    return next(c for c in model["status"]["conditions"] if c["type"] == type_)


def compile_pod(api, job: str, manifest: dict) -> None:
    """What the kubelet leaves of a finished compile pod: its termination message, the artifacts' manifest;
    labelled as the Job controller labels its pods (the template's labels and job-name)."""
    template = json.loads(api.kubectl("get", "job", job, "-o", "json").stdout)["spec"]["template"]
    meta = {"name": f"{job}-x1", "labels": {**template["metadata"]["labels"], "job-name": job}}
    containers = [{"name": "compile", "image": "runtime"}]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"restartPolicy": "Never", "containers": containers},
    }
    api.kubectl("apply", "-f", "-", stdin=json.dumps(pod))
    terminated = {"exitCode": 0, "reason": "Completed", "message": json.dumps(manifest)}
    status = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "compile", "state": {"terminated": terminated}}],
    }
    patch_status(api, "pod", f"{job}-x1", status)


def patch_status(api, kind: str, name: str, status: dict) -> None:
    patch = json.dumps({"status": status})
    api.kubectl("patch", kind, name, "--subresource", "status", "--type", "merge", "-p", patch)


def mark_job(api, name: str, outcome: str = "Complete") -> None:
    status = {
        "conditions": [{"type": outcome, "status": "True", "reason": "Emulated", "message": "by the test"}]
    }
    if outcome == "Complete":
        status["succeeded"] = 1
    patch_status(api, "job", name, status)


def mark_ready(api, deployment: str, replicas: int) -> None:
    """What the Deployment controller writes once its latest spec has rolled out and every pod is ready."""
    generation = get(api, "deployment", deployment)["metadata"]["generation"]
    status = {"replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}
    patch_status(api, "deployment", deployment, {**status, "observedGeneration": generation})


def role_deployment(api, role: str, serving_set: str = "") -> dict | None:
    """The one Deployment of a role (a disaggregated set's names carry its revision); `serving_set`: a
    selector of its set (`!=unified`: not the unified model's front door)."""
    found = get(api, "deployments", "-l", f"neuronfleet.dev/role={role}"
                + (f",neuronfleet.dev/set{serving_set}" if serving_set else ""))["items"]  # fmt: skip
    assert len(found) <= 1, [d["metadata"]["name"] for d in found]
    return found[0] if found else None


def sample(path=SAMPLE) -> dict:
    """The sample in namespace default; a unified one with two replicas, routed by load, behind the front door
    every unified model has (serving, it is tested in test_rollout and test_lone_pod)."""
    obj = yaml.safe_load(path.read_text())
    obj["metadata"]["namespace"] = "default"
    if obj["spec"]["serving"]["mode"] == "unified":
        obj["spec"]["serving"]["unified"]["replicas"] = 2
        obj["spec"]["serving"]["routing"] = {"policy": "least-loaded"}
    return obj


def manifest(path=SAMPLE, **neuron) -> str:
    obj = sample(path)
    obj["spec"]["neuron"].update(neuron)
    return yaml.safe_dump(obj)


def test_apply_compile_deploy_roll_drift_restart_and_delete(cluster):
    api = cluster
    operator = api.start_operator()
    api.kubectl("apply", "-f", "-", stdin=manifest())
    # 1. the compile Job (and its cache and config) appear; nothing serves yet
    jobs = api.wait_for("the compile Job", lambda: items(api, "jobs"))
    assert len(jobs) == 1 and items(api, "deployments") == []
    first_job = jobs[0]["metadata"]["name"]
    model = api.wait_for(
        "status", lambda: (m := get(api, "nm", "smollm2")).get("status", {}).get("phase") and m
    )
    assert model["status"]["phase"] == "Compiling"
    assert condition(model, "Validated")["status"] == "True"
    assert condition(model, "Compiled")["reason"] == "Compiling"
    assert [p["metadata"]["name"] for p in items(api, "pvc")] == ["smollm2-compile-cache"]
    # 2. the compile completes: Deployment, Service and PDB appear, pointing at the compiled hash
    compile_pod(api, first_job, {"bytes": 1234, "compiledAt": "2026-11-29T00:00:00Z", "cacheHit": False})
    mark_job(api, first_job)
    dep = api.wait_for("the Deployment", lambda: get(api, "deployment", "smollm2-unified"))
    chash = dep["metadata"]["labels"]["neuronfleet.dev/compile-hash"]
    assert first_job.endswith(chash[:10])
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"memory": "2Gi"}  # the spec's; cpu: no Neuron devices
    assert f"artifacts/{chash}" in " ".join(container["command"])
    assert get(api, "service", "smollm2") and get(api, "pdb", "smollm2-unified")
    owner_uid = get(api, "nm", "smollm2")["metadata"]["uid"]
    assert dep["metadata"]["ownerReferences"][0]["uid"] == owner_uid
    # 3. pods become ready: Ready, with the printer columns filled
    assert get(api, "deployment", "smollm2-router")["spec"]["replicas"] == 1  # its front door
    mark_ready(api, "smollm2-unified", 2)
    mark_ready(api, "smollm2-router", 1)
    api.wait_for("Ready", lambda: get(api, "nm", "smollm2")["status"].get("phase") == "Ready")
    model = get(api, "nm", "smollm2")
    assert model["status"]["artifacts"] == {
        "path": f"artifacts/{chash}/", "bytes": 1234, "compiledAt": "2026-11-29T00:00:00Z", "cacheHit": False
    }  # fmt: skip
    assert condition(model, "Compiled")["reason"] == "Compiled"
    assert model["status"]["replicas"] == {
        "unified": {"desired": 2, "ready": 2, "reached": 2},
        "router": {"desired": 1, "ready": 1, "reached": 1},
    }
    assert model["status"]["observedGeneration"] == model["metadata"]["generation"]
    row = api.kubectl("get", "neuronmodels").stdout.splitlines()[1].split()
    assert row[:6] == ["smollm2", "Ready", "embedded", "cpu", "1", "2/2"]  # (serving pods: no router)
    assert row[6] == "http://smollm2.default.svc:8000"
    events = {(e["type"], e["reason"]): e["message"] for e in items(api, "events")}
    assert events[("Normal", "CompileStarted")].startswith(f"compiling {chash}")
    assert events[("Normal", "Compiled")] == f"artifacts/{chash}/ is complete"
    assert events[("Normal", "RolledOut")] == f"2/2 pods ready; serving artifacts/{chash}/"
    assert not [e for e in events if e[0] == "Warning"], events
    # 4. drift: a hand edit of the Deployment is put back
    api.kubectl("patch", "deployment", "smollm2-unified", "--type", "merge", "-p", '{"spec":{"replicas":5}}')
    api.wait_for(
        "drift corrected", lambda: get(api, "deployment", "smollm2-unified")["spec"]["replicas"] == 2
    )
    # 5. a restarted operator makes no writes and no duplicates
    operator.stop()
    before = {
        o["metadata"]["name"]: o["metadata"]["resourceVersion"]
        for k in ("jobs", "deployments", "services", "configmaps")
        for o in items(api, k)
    }
    operator = api.start_operator()
    api.wait_for_resume()
    after = {
        o["metadata"]["name"]: o["metadata"]["resourceVersion"]
        for k in ("jobs", "deployments", "services", "configmaps")
        for o in items(api, k)
    }
    assert after == before
    # 6. a spec change that alters the hash compiles first while the Deployment stays exactly as it is (never
    # the old artifacts with the new arguments), then rolls once
    before_change = get(api, "deployment", "smollm2-unified")
    api.kubectl("apply", "-f", "-", stdin=manifest(batchSize=2))
    jobs = api.wait_for("the second compile Job", lambda: len(items(api, "jobs")) == 2 and items(api, "jobs"))
    second_job = next(j["metadata"]["name"] for j in jobs if j["metadata"]["name"] != first_job)
    model = api.wait_for("the status of the new generation", lambda: (
        (m := get(api, "nm", "smollm2"))["status"]["observedGeneration"] == m["metadata"]["generation"]
        and m
    ))  # fmt: skip
    dep = get(api, "deployment", "smollm2-unified")
    assert dep["metadata"]["labels"]["neuronfleet.dev/compile-hash"] == chash  # still the old artifacts
    assert dep["metadata"]["resourceVersion"] == before_change["metadata"]["resourceVersion"]  # untouched
    assert model["status"]["phase"] == "Rolling"  # not Ready: the change is not served yet
    assert (
        condition(model, "Compiled")["status"] == "False"
        and condition(model, "Progressing")["status"] == "True"
    )
    compile_pod(api, second_job, {"bytes": 99, "cacheHit": True})  # another model compiled it before
    mark_job(api, second_job)
    new_hash = second_job.rsplit("-", 1)[1]
    api.wait_for(
        "the roll",
        lambda: get(api, "deployment", "smollm2-unified")["metadata"]["labels"][
            "neuronfleet.dev/compile-hash"
        ].startswith(new_hash),
    )
    assert "--slots" in (
        cmd := get(api, "deployment", "smollm2-unified")["spec"]["template"]["spec"]["containers"][0][
            "command"
        ]
    )
    assert cmd[cmd.index("--slots") + 1] == "2"
    rolled = get(api, "deployment", "smollm2-unified")
    assert rolled["metadata"]["generation"] == before_change["metadata"]["generation"] + 1  # one roll
    mark_ready(api, "smollm2-unified", 2)
    mark_ready(api, "smollm2-router", 1)  # (its hold bound follows the slots: it rolled too)
    api.wait_for("Ready again", lambda: get(api, "nm", "smollm2")["status"].get("phase") == "Ready")
    # the superseded hash's compile Job goes once the new hash serves
    api.wait_for(
        "the old Job gone", lambda: [j["metadata"]["name"] for j in items(api, "jobs")] == [second_job]
    )
    model = api.wait_for(
        "CacheHit",
        lambda: (m := get(api, "nm", "smollm2")) and condition(m, "Compiled")["reason"] == "CacheHit" and m,
    )
    assert model["status"]["artifacts"]["cacheHit"] is True
    # 7. deleting the NeuronModel removes every child
    api.kubectl("delete", "nm", "smollm2", "--timeout=10m")
    for kind in ("jobs", "deployments", "services", "configmaps", "pvc", "pdb"):
        api.wait_for(f"{kind} gone", lambda k=kind: items(api, k) == [])


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"neuron": {"tensorParallel": 3}}, "tensorParallel 3 is not a documented degree on inf2.48xlarge"),
        (  # what is not built: our runtime has no Neuron backend on Inf2
            {"engine": "embedded"},
            "engine embedded has no Neuron backend for inf2.48xlarge (neuronfleet's runtime serves on cpu, "
            "and on trn2 and trn3 with TorchNeuron, experimental; its compile for inf2.48xlarge would fail); "
            "on inf2.48xlarge use engine vllm or tgi, or instanceType cpu for engine embedded",
        ),
    ],
    ids=["topology", "embedded-on-neuron"],
)
def test_a_spec_that_cannot_be_served_fails_validation_and_creates_nothing(cluster, change, refusal):
    """Refused at apply by the CRD's rule; a model stored before the CRD had the rule (created here under the
    CRD without its rules, then the CRD applied as it is) is refused by the operator: Validated=False."""
    api = cluster
    obj = sample(NEURON_SAMPLE)
    obj["spec"]["neuron"].update(change.get("neuron", {}))
    obj["spec"].update({k: v for k, v in change.items() if k != "neuron"})
    at_apply = api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj), check=False)
    assert at_apply.returncode != 0 and "is invalid" in at_apply.stderr, at_apply.stderr
    crd = yaml.safe_load(CRD.read_text())
    api.kubectl("apply", "-f", "-", stdin=json.dumps(without_rules(crd)))  # the CRD before its rules
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    api.kubectl("apply", "-f", str(CRD))  # the CRD as it is: what is stored stays as it was
    api.start_operator()
    model = api.wait_for("status", lambda: (m := get(api, "nm", "llama-3-1-8b")).get("status") and m)
    assert model["status"]["phase"] == "Failed"
    validated = condition(model, "Validated")
    assert validated["status"] == "False" and refusal in validated["message"]
    assert items(api, "jobs") == [] and items(api, "deployments") == []
    events = [(e["type"], e["reason"], e["message"]) for e in items(api, "events")
              if e["involvedObject"]["kind"] == "NeuronModel"]  # fmt: skip
    assert [e[:2] for e in events] == [("Warning", "Refused")] and refusal in events[0][2]
    assert condition(model, "Progressing")["status"] == "False"  # a refused model does not claim progress


def test_an_hf_models_length_is_checked_against_its_config_on_the_hub_before_any_compile(cluster):
    """The operator reads an hf:// model's config.json from the Hub (a fake one here, gated as Llama's is)
    with the token of the model's secretRef: a sequenceLength past its max_position_embeddings is refused
    at apply, once, with what is allowed, and no compile Job is made; set within it, the model compiles.
    One read per repository, however often the model reconciles."""
    import base64

    from fake_hub import FakeHub

    hub = FakeHub()
    try:
        repo = "meta-llama/Llama-3.1-8B-Instruct"
        hub.add_config(repo, {"max_position_embeddings": 4096})  # (a shorter model than Llama: the fake's)
        hub.gated[repo] = "hf_secret_token"
        api = cluster
        api.start_operator(env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"})
        token = base64.b64encode(b"hf_secret_token").decode()
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": {"token": token},
                  "metadata": {"name": "hf-token", "namespace": "default"}}  # fmt: skip
        api.kubectl("apply", "-f", "-", stdin=json.dumps(secret))
        api.kubectl("apply", "-f", "-", stdin=manifest(NEURON_SAMPLE))  # sequenceLength 8192
        model = api.wait_for("status", lambda: (m := get(api, "nm", "llama-3-1-8b")).get("status") and m)
        said = (
            "neuron.sequenceLength 8192 is past the model's max_position_embeddings (4096, from "
            f"hf://{repo}'s config.json on the Hub): set it to 4096 or less"
        )
        validated = condition(model, "Validated")
        assert validated["status"] == "False" and validated["message"].count(said) == 1, validated
        assert model["status"]["phase"] == "Failed" and items(api, "jobs") == []
        assert hub.asked(repo) == [(f"/{repo}/resolve/main/config.json", "Bearer hf_secret_token")]
        assert "hf_secret_token" not in api.operators[-1].log.read_text()
        within = {"spec": {"neuron": {"sequenceLength": 4096, "maxInputLength": 4095}}}
        api.kubectl("patch", "nm", "llama-3-1-8b", "--type=merge", "-p", json.dumps(within))
        api.wait_for("the compile Job", lambda: items(api, "jobs"))
        model = get(api, "nm", "llama-3-1-8b")
        assert condition(model, "Validated")["status"] == "True"
        assert len(hub.asked(repo)) == 1  # kept: the model reconciled again without asking
    finally:
        hub.stop()


def test_a_failed_compile_is_reported_with_the_jobs_reason(cluster):
    api = cluster
    operator = api.start_operator()
    api.kubectl("apply", "-f", "-", stdin=manifest())
    job = api.wait_for("the compile Job", lambda: items(api, "jobs"))[0]["metadata"]["name"]
    operator.stop()  # restarted while compiling: no second Job
    api.start_operator()
    api.wait_for_resume()
    assert [j["metadata"]["name"] for j in items(api, "jobs")] == [job]
    mark_job(api, job, "Failed")
    model = api.wait_for(
        "Failed", lambda: (m := get(api, "nm", "smollm2"))["status"].get("phase") == "Failed" and m
    )
    compiled = condition(model, "Compiled")
    assert (
        compiled["status"] == "False"
        and compiled["reason"] == "CompileFailed"
        and "by the test" in compiled["message"]
    )
    assert condition(model, "Degraded")["status"] == "True"
    assert condition(model, "Progressing")["status"] == "False"
    assert items(api, "deployments") == []
    events = {(e["type"], e["reason"]) for e in items(api, "events")}
    assert ("Warning", "CompileFailed") in events and ("Normal", "CompileStarted") in events

    def compile_jobs() -> list[dict]:
        return [j for j in items(api, "jobs") if j["metadata"]["labels"]["neuronfleet.dev/role"] == "compile"]

    # its source is fingerprinted (a Job no kubelet runs here), to compile again when it changes
    probe = api.wait_for(
        "the source probe", lambda: [j for j in items(api, "jobs") if j not in compile_jobs()]
    )
    assert probe[0]["metadata"]["name"] == job.replace("-compile-", "-source-")
    # a failed compile stays failed on its own; a retry annotation (documented in the README) compiles again
    uid = compile_jobs()[0]["metadata"]["uid"]
    api.kubectl("annotate", "neuronmodel", "smollm2", "neuronfleet.dev/retry=first")
    api.wait_for(
        "a new compile Job", lambda: [j["metadata"]["uid"] for j in compile_jobs()] not in ([uid], [])
    )
    (retried,) = compile_jobs()
    assert retried["metadata"]["name"] == job
    assert retried["metadata"]["annotations"]["neuronfleet.dev/attempt"].endswith("/first")
    api.wait_for("Compiling again", lambda: get(api, "nm", "smollm2")["status"]["phase"] == "Compiling")
    reasons = [e["reason"] for e in items(api, "events")]
    assert "CompileRetried" in reasons


def test_a_disaggregated_model_gets_its_token_secret_once_and_its_network_policies(cluster, tmp_path):
    """Prefill, decode and router Deployments read one token from the Secret the operator creates once (a
    later reconcile or spec change leaves it alone: the operator reads it by name, it caches no Secret); the
    NetworkPolicies fence the model's pods; the operator serves its own metrics."""
    import urllib.request

    api = cluster
    port = free_port()
    proc = api.start_operator("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    obj = sample()
    obj["spec"]["serving"] = {
        "mode": "disaggregated",
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "kvTransfer": {"transport": "tcp"},
    }
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    job = api.wait_for("the compile Job", lambda: items(api, "jobs"))[0]["metadata"]["name"]
    secret = api.wait_for("the token Secret", lambda: get(api, "secret", "smollm2-internal"))
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "NeuronModel"
    compile_pod(api, job, {"bytes": 1})
    mark_job(api, job)
    for role in ("prefill", "decode", "router"):
        dep = api.wait_for(role, lambda r=role: role_deployment(api, r))
        volumes = dep["spec"]["template"]["spec"]["volumes"]
        assert {"secretName": "smollm2-internal", "defaultMode": 0o440} in [v.get("secret") for v in volumes]
    for name in ("smollm2-pods", "smollm2-public"):  # on by default
        assert get(api, "networkpolicy", name)["spec"]["policyTypes"] == ["Ingress"]
    obj["spec"]["neuron"]["batchSize"] = 2  # a change: everything else is patched, the Secret is not
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    api.wait_for("the second compile Job", lambda: len(items(api, "jobs")) == 2)
    after = get(api, "secret", "smollm2-internal")
    assert after["data"] == secret["data"]
    assert after["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    # read by name once, created once, then taken as made: no Secret is listed, watched or read again
    calls = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    on_secrets = [c["verb"] for c in calls if c["user"] == OPERATOR_USER and c["resource"] == "secrets"]
    assert on_secrets == ["get", "create"], on_secrets
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT) as r:
        text = r.read().decode()
    assert 'neuronfleet_operator_reconciles_total{outcome="ok"}' in text
    import re

    by_phase = dict(re.findall(r'^neuronfleet_operator_models\{phase="(\w+)"\} (\S+)$', text, re.M))
    assert sum(float(v) for v in by_phase.values()) == 1 and "Compiling" in by_phase  # one model, now past it
    assert proc.poll() is None


def test_dra_claim_templates_are_made_owned_and_named_by_the_pods_that_use_them(cluster):
    """neuron.deviceAllocation dra: the emulated API server serves resource.k8s.io/v1 ResourceClaimTemplates,
    the operator makes one per pod kind that asks for devices (here the embedded engine's prefill and decode
    pods over EFA, on cpu: EFA interfaces only), owned by the model, and the pods name it in their claims."""
    api = cluster
    api.start_operator()
    obj = sample(ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml")
    obj["spec"]["neuron"]["deviceAllocation"] = "dra"
    obj["spec"]["image"] = "registry.example/neuronfleet-runtime-efa:1"  # our runtime over EFA
    obj["spec"]["serving"]["kvTransfer"] = {"transport": "efa", "efaInterfaces": 2}
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    job = api.wait_for("the compile Job", lambda: items(api, "jobs"))[0]["metadata"]["name"]
    compile_pod(api, job, {"bytes": 1})
    mark_job(api, job)
    for role in ("prefill", "decode"):
        pod = api.wait_for(role, lambda r=role: role_deployment(api, r))["spec"]["template"]["spec"]
        (claim,) = pod["resourceClaims"]
        assert pod["containers"][0]["resources"]["claims"] == [{"name": claim["name"]}]
        assert "vpc.amazonaws.com/efa" not in pod["containers"][0]["resources"].get("limits", {})
        made = api.wait_for("its claim template", lambda c=claim: get(
            api, "resourceclaimtemplate", c["resourceClaimTemplateName"]))  # fmt: skip
        assert made["metadata"]["ownerReferences"][0]["kind"] == "NeuronModel"
        (efas,) = made["spec"]["spec"]["devices"]["requests"]
        assert (
            efas["exactly"]["deviceClassName"] == "efa.networking.k8s.aws" and efas["exactly"]["count"] == 2
        )
    assert role_deployment(api, "router")["spec"]["template"]["spec"].get("resourceClaims") is None


def test_mode_switches_move_the_service_only_to_a_ready_set_then_delete_the_old_one(cluster):
    """unified -> disaggregated -> unified at one compile hash: the new set appears beside the old one (its
    Secret before its pods), the public Service keeps selecting the old set until every Deployment of the new
    one has rolled out, then moves, and only then are the old set's objects (Deployments, headless Services,
    PDBs) deleted; the model's Secret and NetworkPolicies stay."""
    api = cluster
    api.start_operator()
    obj = sample()
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    job = api.wait_for("the compile Job", lambda: items(api, "jobs"))[0]["metadata"]["name"]
    compile_pod(api, job, {"bytes": 1})
    mark_job(api, job)
    api.wait_for("the unified Deployment", lambda: get(api, "deployment", "smollm2-unified"))
    mark_ready(api, "smollm2-unified", 2)
    mark_ready(api, "smollm2-router", 1)
    api.wait_for("Ready", lambda: get(api, "nm", "smollm2")["status"].get("phase") == "Ready")
    unified = get(api, "service", "smollm2")["spec"]["selector"]
    assert (unified["neuronfleet.dev/role"], unified["neuronfleet.dev/set"]) == ("router", "unified")

    def selector() -> dict:
        return get(api, "service", "smollm2")["spec"]["selector"]

    # unified -> disaggregated
    obj["spec"]["serving"] = {"mode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                              "kvTransfer": {"transport": "tcp"}}  # fmt: skip
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    roles = ("prefill", "decode", "router")
    deps = api.wait_for("the new set", lambda: (d := {r: role_deployment(api, r, "!=unified") for r in roles})
                        and all(d.values()) and d)  # fmt: skip
    secret = get(api, "secret", "smollm2-internal")
    assert all(
        secret["metadata"]["creationTimestamp"] <= d["metadata"]["creationTimestamp"] for d in deps.values()
    )
    rev = deps["router"]["metadata"]["labels"]["neuronfleet.dev/set"]
    assert {d["metadata"]["name"] for d in deps.values()} == {f"smollm2-{r}-{rev}" for r in deps}
    assert get(api, "service", f"smollm2-prefill-{rev}")["spec"]["clusterIP"] == "None"
    model = get(api, "nm", "smollm2")
    assert model["status"]["phase"] == "Rolling" and selector() == unified  # the old set still serves
    assert get(api, "deployment", "smollm2-unified") is not None
    for role in ("prefill", "decode"):
        mark_ready(api, deps[role]["metadata"]["name"], 1)
    api.wait_for("the status", lambda: get(api, "nm", "smollm2")["status"]["replicas"].get(
        "prefill", {}).get("ready") == 1)  # fmt: skip
    assert selector() == unified  # the router is not ready: the Service has not moved
    mark_ready(api, deps["router"]["metadata"]["name"], 1)
    api.wait_for("the Service moved", lambda: selector()["neuronfleet.dev/set"] == rev)
    assert selector()["neuronfleet.dev/role"] == "router"
    api.wait_for("the unified set gone", lambda: get(api, "deployment", "smollm2-unified") is None
                 and get(api, "deployment", "smollm2-router") is None
                 and get(api, "pdb", "smollm2-unified") is None)  # fmt: skip
    api.wait_for("Ready", lambda: get(api, "nm", "smollm2")["status"].get("phase") == "Ready")
    # disaggregated -> unified: the same, the other way
    obj["spec"]["serving"] = {"mode": "unified", "unified": {"replicas": 1}}
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(obj))
    api.wait_for("the unified Deployment", lambda: get(api, "deployment", "smollm2-unified"))
    assert selector()["neuronfleet.dev/set"] == rev
    api.wait_for("its front door", lambda: get(api, "deployment", "smollm2-router"))
    mark_ready(api, "smollm2-unified", 1)
    mark_ready(api, "smollm2-router", 1)
    api.wait_for("the Service moved back", lambda: selector()["neuronfleet.dev/set"] == "unified")
    api.wait_for(
        "the disaggregated set gone",
        lambda: not any(role_deployment(api, r, "!=unified") for r in roles),
    )
    api.wait_for(
        "its Services gone",
        lambda: [s["metadata"]["name"] for s in items(api, "services")] == ["smollm2", "smollm2-unified"],
    )  # fmt: skip  (the model's, and its front door's peers)
    assert get(api, "secret", "smollm2-internal")["metadata"]["uid"] == secret["metadata"]["uid"]
    public = get(api, "networkpolicy", "smollm2-public")["spec"]["podSelector"]["matchExpressions"]
    assert public == [{"key": "neuronfleet.dev/role", "operator": "In", "values": ["router"]}]
    events = [(e["type"], e["reason"]) for e in items(api, "events")]
    assert ("Normal", "Rolling") in events and not [e for e in events if e[0] == "Warning"], events
