"""Local mode end to end (`neuronfleet up`): the real operator, the emulated API server with the process
kubelet, the real runtime, the real model and the real `kubectl`. For the unified and the disaggregated local
samples: apply, the compile Job runs the real compile, the model goes Ready, its endpoint answers a chat
request exactly as the runtime does offline on the compiled weights; a killed serving process is restarted
and traffic continues; a change of what is compiled (the passes compiled ahead by the compile Job, loaded by
the new pod) rolls with no failed request; deleting the NeuronModel
stops its processes; `neuronfleet down` leaves no process behind."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, LocalCluster, metrics_text, run_neuronfleet

from neuronfleet.contract import model_cache_folder
from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.engine import Engine
from neuronfleet.runtime.model.dtypes import resolve_dtype
from neuronfleet.runtime.serving.sampling_params import SamplingParams

UNIFIED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
DISAGGREGATED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
AUTO_DTYPE = resolve_dtype("auto")  # what the samples' dtype (the default, auto) is on this machine
QUESTION = "What is the capital of France?"

pytestmark = pytest.mark.real_model


class Local(LocalCluster):
    """`LocalCluster` with the models' phases, pods and process ids."""

    def phase(self, name: str) -> str:
        return (self.get("nm", name).get("status") or {}).get("phase", "")

    def pods(self, selector: str) -> list[dict]:
        return self.get("pods", "-l", selector)["items"]

    def pids(self) -> list[int]:
        """Every pod process the kubelet started that still runs."""
        out = []
        for pid_file in (self.state / "node" / "pods").glob("*/pid"):
            pid = int(pid_file.read_text())
            try:
                os.kill(pid, 0)
                out.append(pid)
            except ProcessLookupError:
                pass
        return out


def chat(endpoint: str, model: str, max_tokens: int = 16) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    req = urllib.request.Request(
        endpoint + "/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Connection": "close"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _answer(endpoint: str, model: str) -> str | None:
    """An answer, or None while the fleet is still recovering (the router waits for its decode pod)."""
    try:
        return chat(endpoint, model)
    except (urllib.error.URLError, OSError):
        return None


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    state = tmp_path_factory.mktemp("local")
    started = time.monotonic()
    run = run_neuronfleet("up", "--state", str(state), "--detach")
    assert run.returncode == 0, run.stderr + run.stdout
    assert "kubectl --kubeconfig" in run.stdout and (state / "kubeconfig").is_file()
    print(f"up: {time.monotonic() - started:.1f} s")
    fleet = Local(state)
    try:
        yield fleet
    finally:
        down = run_neuronfleet("down", "--state", str(state))
        assert down.returncode == 0, down.stderr
        assert fleet.pids() == [], "a pod process outlived `neuronfleet down`"
        assert not (state / "pids.json").exists()


def offline_answer(local: Local, name: str) -> str:
    """The runtime's own greedy answer on the weights the compile Job produced, in the spec's dtype and
    lengths (what the pods are told)."""
    model = local.get("nm", name)
    claim = local.state / "node" / "volumes" / "default" / f"{name}-compile-cache"
    folder = claim / model_cache_folder(name)  # the model's own folder of the claim: all its pods mount
    n = model["spec"]["neuron"]
    config = RuntimeConfig(slots=1, max_seq_len=n["sequenceLength"], max_input_len=n["maxInputLength"],
                           dtype=n["dtype"], prefix_reuse=False)  # fmt: skip
    engine = Engine.from_model_dir(str(folder / model["status"]["artifacts"]["path"] / "model"), config)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    return engine.generate([ids], SamplingParams(max_tokens=16))[0].text


def test_a_unified_model_compiles_serves_heals_rolls_and_goes(local):
    t0 = time.monotonic()
    local.kubectl("apply", "-f", str(UNIFIED))
    local.wait("the compile Job", lambda: local.get("jobs")["items"])
    local.wait("Ready", lambda: local.phase("smollm2") == "Ready")
    print(f"apply -> Ready: {time.monotonic() - t0:.1f} s")
    model = local.get("nm", "smollm2")
    conditions = {c["type"]: c["status"] for c in model["status"]["conditions"]}
    assert conditions["Validated"] == conditions["Compiled"] == conditions["Ready"] == "True"
    endpoint = model["status"]["endpoint"]
    assert endpoint.startswith("http://127.0.0.1:")
    info = json.loads(urllib.request.urlopen(endpoint + "/info", timeout=HTTP_TIMEOUT).read())
    served = (
        info["model_dtype"],
        info["model_dtype_auto"],
        info["max_input_tokens"],
        info["max_total_tokens"],
    )
    assert served == (AUTO_DTYPE, True, 384, 512)  # dtype auto (the default), maxInputLength, sequenceLength
    want = offline_answer(local, "smollm2")
    assert chat(endpoint, "smollm2") == want
    row = local.kubectl("get", "neuronmodels").stdout.splitlines()[1].split()
    assert row[:2] == ["smollm2", "Ready"] and row[-2] == endpoint
    (pod,) = local.pods("neuronfleet.dev/role=unified")
    log = local.kubectl("logs", pod["metadata"]["name"]).stdout
    # kubectl logs reads the pod's log file: the chat request is there, the kubelet's probes are not
    assert "POST /v1/chat/completions" in log and "GET /ready" not in log and "GET /health" not in log

    # a serving process that dies is restarted by the kubelet, and traffic continues
    pid = int((local.state / "node" / "pods" / f"default_{pod['metadata']['name']}" / "pid").read_text())
    os.kill(pid, 9)

    def serving() -> dict:
        return local.pods("neuronfleet.dev/role=unified")[0]["status"]["containerStatuses"][0]

    local.wait("the restart", lambda: serving()["restartCount"] == 1)
    local.wait("Ready again", lambda: serving()["ready"] and local.phase("smollm2") == "Ready")
    assert chat(endpoint, "smollm2") == want

    # a change of what is compiled: a new compile, then a roll with no failed request. The change is a batch
    # of 2; or, where Inductor can compile (a C++ compiler), a batch of 1 with the passes compiled ahead by
    # the compile Job (neuron.compiledSteps inductor, a small bucket table: 2 graphs, each about 40 s to
    # compile here), which the new pod loads and serves from
    compiles = shutil.which("g++") is not None
    failures: list[str] = []
    answers: list[str] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            try:
                answers.append(chat(endpoint, "smollm2", max_tokens=4))
            except (urllib.error.URLError, OSError, ValueError) as e:
                failures.append(repr(e))
            time.sleep(0.05)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        manifest = yaml.safe_load(UNIFIED.read_text())
        manifest["spec"]["neuron"]["batchSize"] = 2
        if compiles:
            manifest["spec"]["neuron"].update(
                batchSize=1, compiledSteps="inductor", buckets={"context": [384], "generation": [512]}
            )
        old_hash = model["status"]["compileHash"]
        t1 = time.monotonic()
        local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
        local.wait("the roll", lambda: (
            (m := local.get("nm", "smollm2"))["status"].get("compileHash") != old_hash
            and m["status"]["phase"] == "Ready"
            and all(p["metadata"]["labels"]["neuronfleet.dev/compile-hash"] != old_hash
                    for p in local.pods("neuronfleet.dev/role=unified"))
        ))  # fmt: skip
        print(f"change -> rolled: {time.monotonic() - t1:.1f} s")
        time.sleep(1)
    finally:
        stop.set()
        thread.join()
    assert answers and not failures, failures[:3]
    if compiles:  # the new pod loaded the compile Job's 2 graphs, and runs none op by op
        (pod,) = local.pods("neuronfleet.dev/role=unified")
        log = local.kubectl("logs", pod["metadata"]["name"]).stdout
        assert "loaded 2 compiled graphs" in log and "op by op" not in log, log[-3000:]
        assert chat(endpoint, "smollm2")  # (a compiled pass may round differently: an answer, not equal)

    # deleting the model stops its processes
    assert local.pids()
    local.kubectl("delete", "nm", "smollm2", "--timeout=10m")
    local.wait("the pods gone", lambda: local.get("pods")["items"] == [])
    local.wait("the processes gone", lambda: not local.pids())


def test_a_disaggregated_model_serves_through_router_prefill_and_decode(local):
    t0 = time.monotonic()
    local.kubectl("apply", "-f", str(DISAGGREGATED))
    local.wait("Ready", lambda: local.phase("smollm2-pd") == "Ready")
    print(f"apply -> Ready (disaggregated): {time.monotonic() - t0:.1f} s")
    model = local.get("nm", "smollm2-pd")
    assert model["status"]["replicas"] == {
        r: {"desired": 1, "ready": 1, "reached": 1} for r in ("prefill", "decode", "router")
    }
    want = offline_answer(local, "smollm2-pd")
    assert chat(model["status"]["endpoint"], "smollm2-pd") == want
    info = json.loads(
        urllib.request.urlopen(model["status"]["endpoint"] + "/info", timeout=HTTP_TIMEOUT).read()
    )
    # the router loads no model: it says `auto`, which each prefill and decode pod resolves for its own CPU
    assert (info["model_dtype"], info["max_input_tokens"], info["max_total_tokens"]) == ("auto", 384, 512)
    # the answer came through a KV handoff over NIXL (the sample's transport), not a fallback
    (decode,) = local.pods("neuronfleet.dev/role=decode")
    command = decode["spec"]["containers"][0]["command"]
    assert command[command.index("--kv-transport") + 1 :][:3] == ["nixl", "--kv-nixl-backend", "ucx"]
    (svc,) = local.get("services", "-l", "neuronfleet.dev/role=decode")["items"]  # the set's own Service
    service_name = svc["metadata"]["name"]
    slices = local.get("endpointslices", "-l", f"kubernetes.io/service-name={service_name}")["items"]
    port = slices[0]["ports"][0]["port"]
    metrics = metrics_text(f"http://127.0.0.1:{port}")
    moved = [line for line in metrics.splitlines() if line.startswith("neuronfleet:kv_transfer_bytes_total")]
    assert moved and float(moved[0].split()[-1]) > 0
    assert "DevicesEnforced" not in json.dumps(decode["status"])  # cpu pods request no devices
    row = local.kubectl("get", "neuronmodels").stdout.splitlines()[1].split()
    assert row[:2] == ["smollm2-pd", "Ready"] and row[5] == "2/2"  # the router serves none
    # a decode process that dies is restarted; the router takes the pod back and traffic continues
    pid_file = local.state / "node" / "pods" / f"default_{decode['metadata']['name']}" / "pid"
    os.kill(int(pid_file.read_text()), 9)

    def decode_status() -> dict:
        return local.pods("neuronfleet.dev/role=decode")[0]["status"]["containerStatuses"][0]

    local.wait("the decode pod restarted and ready", lambda: decode_status()["restartCount"] == 1
               and decode_status()["ready"])  # fmt: skip
    local.wait("Ready", lambda: local.phase("smollm2-pd") == "Ready")
    endpoint = model["status"]["endpoint"]
    assert local.wait("an answer", lambda: _answer(endpoint, "smollm2-pd")) == want
    secret = local.get("secret", "smollm2-pd-internal")
    assert secret["metadata"]["ownerReferences"][0]["name"] == "smollm2-pd"
    local.kubectl("delete", "nm", "smollm2-pd", "--timeout=10m")
    local.wait("the processes gone", lambda: not local.pids())


def test_down_then_up_keeps_every_object_and_serves_again_without_compiling(local):
    """`neuronfleet down` deletes nothing: the API server keeps its objects in the state folder, so the next
    `up` has the model, its compile Job (done: no compile again) and its Deployment, whose pod the kubelet
    starts again; the model is Ready and answers as before."""
    local.kubectl("apply", "-f", str(UNIFIED))
    local.wait("Ready", lambda: local.phase("smollm2") == "Ready")
    before = local.get("nm", "smollm2")
    # (an earlier test of the session may have killed this model's pod: its Warnings are older than this)
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    jobs = {j["metadata"]["uid"] for j in local.get("jobs")["items"]}
    want = chat(before["status"]["endpoint"], "smollm2")
    down = run_neuronfleet("down", "--state", str(local.state))
    assert down.returncode == 0, down.stderr
    assert local.pids() == []
    up = run_neuronfleet("up", "--state", str(local.state), "--detach")
    assert up.returncode == 0, up.stderr + up.stdout
    after = local.get("nm", "smollm2")
    # its pod starts again: the status counts it ready only once it is (read the model first: the operator
    # writes it ready only after the pod is, and a pod that was ready stays so here; its front door aside)
    running = [
        p
        for p in local.pods("neuronfleet.dev/role=unified")
        if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
    ]
    assert after["status"]["replicas"]["unified"]["ready"] == 0 or running, after["status"]
    assert all(r["reached"] <= r["ready"] or running for r in after["status"]["replicas"].values())
    assert after["metadata"]["uid"] == before["metadata"]["uid"] and after["spec"] == before["spec"]
    assert {j["metadata"]["uid"] for j in local.get("jobs")["items"]} == jobs  # kept, not compiled again
    unified = "neuronfleet.dev/role=unified"
    local.wait("Ready again, its pod running", lambda: local.phase("smollm2") == "Ready"
               and any(p["status"].get("phase") == "Running" for p in local.pods(unified)))  # fmt: skip
    endpoint = local.get("nm", "smollm2")["status"]["endpoint"]
    assert endpoint == before["status"]["endpoint"]  # its Service's local proxy kept its port
    local.wait("an answer", lambda: _answer(endpoint, "smollm2") is not None)
    assert chat(endpoint, "smollm2") == want
    assert {j["metadata"]["uid"] for j in local.get("jobs")["items"]} == jobs
    # a start is not a loss: no Warning that pods were lost (the status said a deploy, then RolledOut)
    events = local.get("events", "--field-selector", "involvedObject.name=smollm2")["items"]
    warnings = [e for e in events if e["type"] == "Warning" and (e.get("lastTimestamp") or "") >= since]
    assert not warnings, [(e["reason"], e["message"], e.get("lastTimestamp")) for e in events]
    local.kubectl("delete", "nm", "smollm2", "--timeout=10m")
    local.wait("the pods gone", lambda: local.get("pods")["items"] == [])
