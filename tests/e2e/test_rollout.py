"""Every change to a NeuronModel rolls safely, in local mode (`neuronfleet up`: the emulated API server, the
process kubelet, the real operator and runtime, the real SmolLM2 model, the real `kubectl`), under a loop of
chat requests through the model's public endpoint: a change that needs a compile (batchSize) leaves the
Deployment exactly as it is until the new artifacts exist, then rolls once (never the old artifacts with the
new arguments); unified -> disaggregated and back switch the Service only when the new set answers, then
delete the old one (the model's token Secret stays); a replicas change starts or stops pods at once (no
template changes: none restarts), and back down. Not one request fails, from clients that open a connection
per request, the official `openai` client (one, reused, no retries: its pool keeps connections alive) and a
plain kept-alive HTTP/1.1 connection (a draining pod serves what arrives on open connections and tells them to
close)."""

from __future__ import annotations

import itertools
import threading
import time
import urllib.request

import pytest
import yaml
from support import CEILING, HTTP_TIMEOUT, ROOT, ChatLoad, LocalCluster, local_mode, metric

UNIFIED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
NAME = "smollm2"

pytestmark = pytest.mark.real_model


class Local(LocalCluster):
    def model(self) -> dict:
        return self.get("nm", NAME)

    def apply(self, manifest: dict) -> None:
        self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))

    def roles(self) -> list[str]:
        """The role of each Deployment."""
        return [d["metadata"]["labels"]["neuronfleet.dev/role"] for d in self.get("deployments")["items"]]

    def serving_set(self) -> str:
        """The set the public Service selects."""
        return self.get("service", NAME)["spec"]["selector"]["neuronfleet.dev/set"]

    def ready_at(self, generation: int) -> bool:
        """The model's status has seen this generation and says Ready."""
        status = self.model().get("status") or {}
        return status.get("observedGeneration") == generation and status.get("phase") == "Ready"


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    with local_mode(tmp_path_factory.mktemp("local"), Local) as cluster:
        yield cluster


class Templates:
    """Every (Deployment, generation, compile hash, --slots) the cluster held, polled while changes roll."""

    def __init__(self, local: Local) -> None:
        self.local, self.seen = local, set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def poll(self) -> None:
        for d in self.local.get("deployments")["items"]:
            cmd = d["spec"]["template"]["spec"]["containers"][0]["command"]
            slots = cmd[cmd.index("--slots") + 1] if "--slots" in cmd else None
            labels = d["spec"]["template"]["metadata"]["labels"]
            self.seen.add((d["metadata"]["name"], d["metadata"]["generation"],
                           labels["neuronfleet.dev/compile-hash"], slots))  # fmt: skip

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            time.sleep(0.5)

    def of(self, name: str) -> list[tuple]:
        return sorted(s[1:] for s in self.seen if s[0] == name)


def test_every_change_rolls_once_with_no_failed_request(local):
    manifest = yaml.safe_load(UNIFIED.read_text())
    local.apply(manifest)
    local.wait("Ready", lambda: local.ready_at(1))
    endpoint = local.model()["status"]["endpoint"]
    first_hash = local.model()["status"]["compileHash"]
    traffic = ChatLoad(endpoint, NAME, workers=3, tokens=4, clients=("urllib", "openai", "kept-alive"))
    templates = Templates(local)
    traffic.__enter__()
    templates.thread.start()
    timings = {}
    try:
        # 1. a change that needs a compile: one roll, after the compile, to the new hash and its arguments
        t0 = time.monotonic()
        manifest["spec"]["neuron"]["batchSize"] = 2
        local.apply(manifest)
        local.wait("rolled to the new compile", lambda: local.ready_at(2)
                   and local.model()["status"]["compileHash"] != first_hash)  # fmt: skip
        timings["batchSize 4 -> 2 (compile, then roll)"] = time.monotonic() - t0
        second_hash = local.model()["status"]["compileHash"]
        templates.poll()
        seen = templates.of(f"{NAME}-unified")
        assert [(h, slots) for _, h, slots in seen] == [(first_hash, "4"), (second_hash, "2")], seen
        assert seen[1][0] == seen[0][0] + 1  # one template change: one roll

        # 2. unified -> disaggregated: the Service moves to the new set once it answers; the old one goes
        t0 = time.monotonic()
        manifest["spec"]["serving"] = {
            "mode": "disaggregated",
            "prefill": {"replicas": 1}, "decode": {"replicas": 1}, "kvTransfer": {"transport": "tcp"},
        }  # fmt: skip
        local.apply(manifest)
        local.wait("disaggregated and Ready", lambda: local.ready_at(3)
                   and "unified" not in local.roles())  # fmt: skip
        timings["unified -> disaggregated"] = time.monotonic() - t0
        selector = local.get("service", NAME)["spec"]["selector"]
        assert selector["neuronfleet.dev/role"] == "router"
        assert sorted(local.roles()) == ["decode", "prefill", "router"]
        first_set = local.serving_set()

        # 3. a compile change while disaggregated: a new version-isolated set (back to batchSize 4, whose
        # artifacts exist: a cache hit), whose router names only its own set's prefill and decode Services
        t0 = time.monotonic()
        manifest["spec"]["neuron"]["batchSize"] = 4
        local.apply(manifest)
        local.wait("the new set serves", lambda: local.ready_at(4) and local.serving_set() != first_set)
        local.wait("the old set gone", lambda: len(local.roles()) == 3)
        timings["batchSize 2 -> 4 disaggregated (cache hit, new set)"] = time.monotonic() - t0
        assert local.model()["status"]["compileHash"] == first_hash
        (router,) = local.get("deployments", "-l", "neuronfleet.dev/role=router")["items"]
        new_set = router["metadata"]["labels"]["neuronfleet.dev/set"]
        cmd = router["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[cmd.index("--prefill") + 1] == f"dns://{NAME}-prefill-{new_set}:8000"
        assert cmd[cmd.index("--decode") + 1] == f"dns://{NAME}-decode-{new_set}:8000"

        # 4. disaggregated -> unified
        t0 = time.monotonic()
        manifest["spec"]["serving"] = {"mode": "unified", "unified": {"replicas": 1}}
        local.apply(manifest)
        local.wait("unified and Ready", lambda: local.ready_at(5)
                   and sorted(local.roles()) == ["router", "unified"])  # fmt: skip
        timings["disaggregated -> unified"] = time.monotonic() - t0
        # the pods and their front door (every unified model's, docs/front-door.md), which the Service selects
        assert local.get("service", NAME)["spec"]["selector"]["neuronfleet.dev/role"] == "router"
        unified_template = local.get("deployment", f"{NAME}-unified")["spec"]["template"]
        # the model's token Secret stays, the one every pod of the model mounted from the first
        (secret,) = local.get("secret", "-l", f"neuronfleet.dev/model={NAME}")["items"]
        assert secret["metadata"]["name"] == f"{NAME}-internal"

        # 5. a change that needs no compile: the replicas, no template change (no Job, no pod restarted)
        t0 = time.monotonic()
        jobs = {j["metadata"]["name"] for j in local.get("jobs")["items"]}
        manifest["spec"]["serving"]["unified"]["replicas"] = 2
        local.apply(manifest)
        local.wait(
            "two replicas ready",
            lambda: local.ready_at(6) and local.model()["status"]["readyReplicas"] == "2/2",
        )  # (the serving pods; their front door is not counted)
        timings["replicas 1 -> 2"] = time.monotonic() - t0
        assert {j["metadata"]["name"] for j in local.get("jobs")["items"]} <= jobs

        # 6. and back down: a pod goes while kept-alive clients have connections to it
        t0 = time.monotonic()
        manifest["spec"]["serving"]["unified"]["replicas"] = 1
        local.apply(manifest)
        unified = ("pods", "-l", "neuronfleet.dev/role=unified")
        local.wait("one pod left", lambda: local.ready_at(7) and len(local.get(*unified)["items"]) == 1)
        timings["replicas 2 -> 1"] = time.monotonic() - t0
        answered = traffic.answered
        local.wait("answers after the scale-down", lambda: traffic.answered >= answered + 3)
        # 1 -> 2 -> 1 changed the replicas only: the pods' template is the one step 4 made
        assert local.get("deployment", f"{NAME}-unified")["spec"]["template"] == unified_template
    finally:
        traffic.__exit__()
        templates.stop.set()
        templates.thread.join()
    print("timings:", {k: f"{v:.1f} s" for k, v in timings.items()}, f"answers: {traffic.by_client}")
    # every disaggregated set was made once and never rolled: one template per Deployment, one compile hash
    # for its prefill, decode and router
    sets: dict[str, set] = {}
    for name, generation, chash, _ in templates.seen:
        if name not in (f"{NAME}-unified", f"{NAME}-router"):  # (the unified pods and their front door)
            assert generation == 1, (name, templates.of(name))
            sets.setdefault(name.rsplit("-", 1)[1], set()).add(chash)
    assert len(sets) == 2 and all(len(hashes) == 1 for hashes in sets.values()), sets
    assert not traffic.failed, traffic.failed[:5]
    assert all(traffic.by_client.get(k) for k in ("urllib", "openai", "kept-alive")), traffic.by_client
    # events: progress as Normal, no Warning on the way
    events = [e for e in local.get("events")["items"] if e["involvedObject"]["kind"] == "NeuronModel"]
    assert {"CompileStarted", "Compiled", "Rolling", "RolledOut"} <= {e["reason"] for e in events}
    warnings = [(e["reason"], e["message"]) for e in events if e["type"] == "Warning"]
    assert not warnings, warnings
    local.kubectl("delete", "nm", NAME, "--timeout=10m")
    local.wait("the pods gone", lambda: local.get("pods")["items"] == [])


def router_decisions(endpoint: str) -> dict[str, float]:
    """The front door's routing decisions by reason (its own /metrics, through the model's Service)."""
    with urllib.request.urlopen(endpoint + "/metrics", timeout=HTTP_TIMEOUT) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("neuronfleet:router_routing_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_a_conversations_turns_follow_its_history_and_move_when_its_pod_goes(local):
    """Two pods behind the model's front door (kv-aware routing, docs/routing.md). Each conversation's later
    turns go to the pod that served its earlier ones (reason prefix); when a pod goes, its conversations move
    to the other one (reason load) and not one request fails, from the official client without retries."""
    from openai import OpenAI

    manifest = yaml.safe_load(UNIFIED.read_text())
    manifest["metadata"]["name"] = "chat"
    manifest["spec"]["serving"]["unified"]["replicas"] = 2
    # room for the turns a busy machine takes before the front door sees the pod go (each adds ~20 tokens)
    manifest["spec"]["neuron"].update(sequenceLength=2048, maxInputLength=1536)
    local.apply(manifest)
    local.wait("two pods behind a front door", lambda: (local.get("nm", "chat").get("status") or {}).get(
        "readyReplicas") == "2/2" and local.get("service", "chat")["spec"]["selector"][
        "neuronfleet.dev/role"] == "router")  # fmt: skip
    endpoint = local.get("nm", "chat")["status"]["endpoint"]
    client = OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0, timeout=CEILING)
    histories = [[{"role": "system", "content": f"You are helper {n}. " + "Remember the colour blue. " * 30}]
                 for n in range(4)]  # fmt: skip

    def turn(history: list[dict], question: str) -> None:
        history.append({"role": "user", "content": question})
        answer = client.chat.completions.create(model="chat", messages=history, max_tokens=4)
        history.append({"role": "assistant", "content": answer.choices[0].message.content or ""})

    before = router_decisions(endpoint)
    for n in range(3):
        for history in histories:
            turn(history, f"Question {n}: which colour?")
    after = router_decisions(endpoint)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefix", "load", "overload")}
    assert grew == {"prefix": 8, "load": 4, "overload": 0}, grew  # each conversation's later turns: its pod

    # one pod goes, one that served conversations (each conversation goes to its home pod, a hash: all four
    # may share one): they move to the other pod, every turn answered
    pods = local.get("pods", "-l", "neuronfleet.dev/role=unified,neuronfleet.dev/model=chat")["items"]
    gone = max(pods, key=lambda p: metric(local.pod_url(p), "vllm:prompt_tokens_total"))
    local.kubectl("delete", "pod", gone["metadata"]["name"], "--wait=false")
    before = router_decisions(endpoint)
    for n in itertools.count(3):  # (the front door sees the pod leave at its next peer refresh, 2 s)
        for history in histories:
            turn(history, f"Question {n}: which colour?")
        after = router_decisions(endpoint)
        grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("prefix", "load")}
        # (one decision a turn, and one more for a turn the going pod refused, taken by the other at once)
        assert grew["prefix"] + grew["load"] >= 4 * (n - 2), grew
        if grew["load"] or n == 30:
            break
    assert grew["load"] >= 1, grew  # the conversations of the pod that went started again on the other
    local.kubectl("delete", "nm", "chat", "--timeout=10m")
    local.wait("the pods gone", lambda: local.get("pods", "-l", "neuronfleet.dev/model=chat")["items"] == [])
