"""A model's last pod is not a single point of loss, and scaling restarts no pod, in local mode
(`neuronfleet up`: the real operator, process kubelet, runtime and `kubectl`; the SmolLM2 cpu sample, one
unified pod behind the front door every unified model has, docs/front-door.md):

- scaling 1 -> 3 -> 1 through spec.replicas (`kubectl scale neuronmodel`) changes the Deployment's replicas
  only: the first pod stays (its uid, its restart count), so does the front door's, and at every count the
  front door routes kv-aware (a repeated prompt goes to the pod that holds it: reason `prefix`);
- its only pod deleted, then its replacement's process killed with SIGKILL, while the official `openai` client
  (one, reused, `max_retries=0`, streaming and not, one request every 0.3 s) sends requests: none fails; the
  requests sent while no pod was ready are held by the front door and answered by the replacement (its
  `router_hold_seconds` counts them; none refused). The held times are printed (docs/benchmarks.md);
- chaos: serving pods killed with SIGKILL again and again, each while a stream is mid-way, under the load of
  the official `openai` client (one, reused, `max_retries=0`; one thread streaming, one not, greedy, back to
  back), for the one-replica model, the same model at three replicas behind its front door, and the
  prefill/decode sample (its decode pod and its prefill pod): no request fails, and every answer equals,
  token for token, the same request answered by an undisturbed pod before the kills; streams were resumed
  (`router_retries{kind="resume"}`).

The models run in float32 (EXACT_DTYPE): the references and the resumed answers are compared exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import yaml
from support import CEILING, EXACT_DTYPE, ROOT, LocalCluster, local_mode, metric

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
DISAGGREGATED = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu-disaggregated.yaml"
NAME, PD_NAME = "smollm2", "smollm2-pd"
LABEL = f"neuronfleet.dev/model={NAME}"
PAUSE = 0.3  # seconds between a client's requests (the trial)

pytestmark = pytest.mark.real_model


def apply_exact(cluster: LocalCluster, sample) -> None:
    """A local sample applied in float32, as users apply it otherwise."""
    model = yaml.safe_load(sample.read_text())
    model["spec"]["neuron"]["dtype"] = EXACT_DTYPE
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(model))


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    with local_mode(tmp_path_factory.mktemp("local")) as cluster:
        apply_exact(cluster, SAMPLE)
        cluster.wait("Ready", lambda: status(cluster).get("phase") == "Ready")
        yield cluster


def status(local: LocalCluster, name: str = NAME) -> dict:
    return local.get("nm", name).get("status") or {}


def pods(local: LocalCluster, role: str, model: str = NAME) -> list[dict]:
    items = local.get("pods", "-l", f"neuronfleet.dev/model={model},neuronfleet.dev/role={role}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict) -> bool:
    """Whether the pod says it is Ready (a pod the kubelet has not reached yet has no status)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def kept(pod: dict) -> tuple[str, int]:
    """What a restart or a replacement changes: the pod's uid and its container's restart count."""
    (container,) = pod["status"]["containerStatuses"]
    return pod["metadata"]["uid"], container.get("restartCount", 0)


def templates(local: LocalCluster) -> dict[str, dict]:
    return {
        d["metadata"]["name"]: d["spec"]["template"] for d in local.get("deployments", "-l", LABEL)["items"]
    }


def prefix_decisions(endpoint: str) -> float:
    return metric(endpoint, "neuronfleet:router_routing_decisions_total", reason="prefix")


def test_scaling_1_3_1_keeps_the_first_pod_and_routes_kv_aware_at_every_count(local):
    from openai import OpenAI

    endpoint = status(local)["endpoint"]
    client = OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0, timeout=CEILING)
    (first,) = pods(local, "unified")
    (door,) = pods(local, "router")
    before, door_before = kept(first), kept(door)
    first_templates = templates(local)
    assert set(first_templates) == {f"{NAME}-unified", f"{NAME}-router"}
    prompt = [{"role": "user", "content": "Remember the colour blue. " * 20 + "Which colour?"}]
    for replicas in (1, 3, 1):
        local.kubectl("scale", "nm", NAME, f"--replicas={replicas}")
        local.wait(
            f"{replicas} unified pods ready",
            lambda n=replicas: len(pods(local, "unified")) == n and all(map(ready, pods(local, "unified"))),
        )
        running = {p["metadata"]["uid"]: kept(p) for p in pods(local, "unified")}
        assert running[before[0]] == before, (replicas, running)  # the first pod: never replaced, restarted
        assert [kept(p) for p in pods(local, "router")] == [door_before]
        # kv-aware at this count: the second of two turns with one prompt goes where its prefix is held
        routed = prefix_decisions(endpoint)
        for _ in range(2):
            client.chat.completions.create(model=NAME, messages=prompt, max_tokens=2)
        assert prefix_decisions(endpoint) >= routed + 1, replicas
    assert templates(local) == first_templates  # the replicas changed, never a pod template


class Requests:
    """One official client (reused, no retries) sending a chat request every PAUSE seconds, streaming and not
    in turn, until stopped; each request's (start, end, error). `between` is held while no request is in
    flight: a kill under it lands between two requests (a stream cut mid-way is resume's, not this test's)."""

    def __init__(self, endpoint: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0, timeout=CEILING)
        self.done: list[tuple[float, float, str | None]] = []
        self.between, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, stream: bool) -> None:
        messages = [{"role": "user", "content": "Tell me a story"}]
        if not stream:
            self.client.chat.completions.create(model=NAME, messages=messages, max_tokens=4)
            return
        chunks = self.client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, stream=True)
        finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finished, "the stream ended without a finish reason"

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            with self.between:
                start, error = time.monotonic(), None
                try:
                    self._one(stream=n % 2 == 1)
                except Exception as e:  # every failure is kept, as the client saw it
                    error = repr(e)
                self.done.append((start, time.monotonic(), error))
            n += 1
            self.stop.wait(PAUSE)

    def answered_after(self, at: float) -> int:
        return sum(1 for start, _, error in self.done if start >= at and error is None)


def test_the_only_pods_loss_fails_no_request_the_replacement_answers_the_held_ones(local):
    endpoint = status(local)["endpoint"]
    (lone,) = pods(local, "unified")
    held_before = metric(endpoint, "neuronfleet:router_hold_seconds_count")
    load = Requests(endpoint)
    load.thread.start()
    try:
        local.wait("answers before", lambda: load.answered_after(0) >= 3)
        # 1. deleted (a node drained, a roll of its only pod): a new pod replaces it
        deleted = time.monotonic()
        local.kubectl("delete", "pod", lone["metadata"]["name"], "--wait=false")

        def replaced() -> list[dict]:
            return [p for p in pods(local, "unified") if p["metadata"]["uid"] != lone["metadata"]["uid"]]

        local.wait("the replacement ready", lambda: replaced() and ready(replaced()[0]))
        local.wait("answers from the replacement", lambda: load.answered_after(deleted) >= 3)
        # (its replacement started beside it as it drained: held only if it was not ready first); the deleted
        # pod gone (it serves through its preStop sleep and drains), the replacement is the only pod
        local.wait("the deleted pod gone", lambda: all(
            p["metadata"]["uid"] != lone["metadata"]["uid"]
            for p in local.get("pods", "-l", f"{LABEL},neuronfleet.dev/role=unified")["items"]
        ))  # fmt: skip
        held_deleted = metric(endpoint, "neuronfleet:router_hold_seconds_count") - held_before
        # 2. its process killed (an OOM kill, a device error): the kubelet starts it again in the same pod
        (pod,) = replaced()
        pid_file = local.pid_file(pod)
        with load.between:  # between two requests: the next ones find no ready pod
            killed = time.monotonic()
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        local.wait("the restart", lambda: kept(local.get("pod", pod["metadata"]["name"]))[1] == 1
                   and ready(local.get("pod", pod["metadata"]["name"])))  # fmt: skip
        local.wait("answers after the restart", lambda: load.answered_after(killed) >= 3)
    finally:
        load.stop.set()
        load.thread.join()
    failed = [error for _, _, error in load.done if error]
    assert not failed, failed[:5]
    held_killed = metric(endpoint, "neuronfleet:router_hold_seconds_count") - held_before - held_deleted
    held_for = metric(endpoint, "neuronfleet:router_hold_seconds_sum")
    refused = metric(endpoint, "neuronfleet:router_hold_rejected_total")
    after_kill = [end - start for start, end, _ in load.done if end >= killed]
    print(f"\nlone pod lost: {len(load.done)} requests, 0 failed; held: {held_deleted:.0f} after the delete, "
          f"{held_killed:.0f} after the SIGKILL ({held_for:.1f} s in all); the longest request after the "
          f"kill {max(after_kill):.1f} s")  # fmt: skip
    # the requests sent after the kill found no ready pod: held at the front door, none refused
    assert held_killed >= 1 and refused == 0, (held_killed, refused)


# ---- chaos: pods killed again and again under load -------------------------------------------------------

# prompts whose greedy answers never come near a tie in their first 40 tokens (float32, transformers: the
# top logit leads the second by 0.05 or more at every step), so that an exact comparison tests the resume,
# not rounding: a pod that prefills the prompt and the tokens sent computes what decoding them did, not
# bit for bit
PROMPTS = (
    "Describe a busy market on a summer morning.",
    "Write a short letter to a future astronaut.",
    "Explain how a rainbow forms.",
)
CHAOS_TOKENS = 40  # long enough for a kill to land mid-stream


class ChaosLoad:
    """The official `openai` client (one, reused, `max_retries=0`) sending greedy chat requests back to back
    from two threads, one streaming and one not, round PROMPTS, until stopped: each answer (prompt, streamed,
    text or None, the error the client saw or None). `chunks`: the chunks of the stream in flight so far."""

    def __init__(self, endpoint: str, model: str) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0, timeout=CEILING)
        self.model = model
        self.answers: list[tuple[str, bool, str | None, str | None]] = []
        self.chunks = -1
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in (True, False)]

    def ask(self, prompt: str, stream: bool) -> str:
        request = dict(model=self.model, messages=[{"role": "user", "content": prompt}],
                       max_tokens=CHAOS_TOKENS, temperature=0)  # fmt: skip
        if not stream:
            return self.client.chat.completions.create(**request).choices[0].message.content or ""
        pieces, finished = [], None
        self.chunks = 0
        try:
            for chunk in self.client.chat.completions.create(**request, stream=True):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finished = chunk.choices[0].finish_reason or finished
                    self.chunks += 1
        finally:
            self.chunks = -1
        assert finished, "the stream ended without a finish reason"
        return "".join(pieces)

    def _run(self, stream: bool) -> None:
        n = 0
        while not self.stop.is_set():
            prompt = PROMPTS[n % len(PROMPTS)]
            try:
                text, error = self.ask(prompt, stream), None
            except Exception as e:  # every failure is kept, as the client saw it
                text, error = None, repr(e)
            self.answers.append((prompt, stream, text, error))
            n += 1

    def __enter__(self) -> ChaosLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(CEILING)

    def mid_stream(self) -> None:
        """Return once the stream in flight is mid-way (some tokens sent, most still to come)."""
        deadline = time.monotonic() + CEILING
        while not 3 <= self.chunks <= CHAOS_TOKENS // 2:
            assert time.monotonic() < deadline, "no stream was seen mid-way"
            time.sleep(0.01)

    def answered(self) -> int:
        return sum(1 for *_, error in self.answers if error is None)


def references(endpoint: str, model: str) -> dict[str, str]:
    """Each prompt's answer from an undisturbed pod, streamed and not (the two must agree)."""
    load = ChaosLoad(endpoint, model)
    out = {}
    for prompt in PROMPTS:
        out[prompt] = load.ask(prompt, stream=False)
        assert load.ask(prompt, stream=True) == out[prompt], prompt
    return out


def carrying(local: LocalCluster, pod: dict) -> bool:
    """Whether the serving pod runs a request now (its /metrics)."""
    try:
        return metric(local.pod_url(pod), "vllm:num_requests_running") > 0
    except OSError:
        return False


def kill(local: LocalCluster, pod: dict) -> tuple[str, int]:
    """SIGKILL the pod's process (an OOM kill, a device error): its (name, restart count once restarted)."""
    restarts = kept(local.get("pod", pod["metadata"]["name"]))[1]
    os.killpg(int(local.pid_file(pod).read_text()), signal.SIGKILL)
    return pod["metadata"]["name"], restarts + 1


def restarted(local: LocalCluster, name: str, count: int) -> bool:
    pod = local.get("pod", name)
    return kept(pod)[1] >= count and ready(pod)


def check_answers(load: ChaosLoad, want: dict[str, str], what: str) -> None:
    failed = [error for *_, error in load.answers if error]
    assert not failed, (what, len(load.answers), failed[:5])
    differ = [(p, s, text) for p, s, text, _ in load.answers if text != want[p]]
    assert not differ, (what, differ[:3], want)
    streamed = sum(1 for _, s, *_ in load.answers if s)
    print(
        f"\n{what}: {len(load.answers)} requests ({streamed} streamed), 0 failed, every answer as undisturbed"
    )


def resumes(endpoint: str) -> float:
    return metric(endpoint, "neuronfleet:router_retries_total", kind="resume")


def test_chaos_the_one_replica_model_loses_nothing_to_repeated_kills(local):
    endpoint = status(local)["endpoint"]
    local.kubectl("scale", "nm", NAME, "--replicas=1")
    local.wait(
        "one unified pod", lambda: len(pods(local, "unified")) == 1 and ready(pods(local, "unified")[0])
    )
    want = references(endpoint, NAME)
    resumed = resumes(endpoint)
    with ChaosLoad(endpoint, NAME) as load:
        for _ in range(2):
            load.mid_stream()
            (pod,) = pods(local, "unified")
            name, count = kill(local, pod)
            local.wait("the killed pod restarted", lambda n=name, c=count: restarted(local, n, c))
            answered = load.answered()
            local.wait("answers after the restart", lambda a=answered: load.answered() >= a + 2)
    check_answers(load, want, "one replica, its pod killed twice mid-stream")
    assert resumes(endpoint) >= resumed + 1  # a stream went on on the restarted pod


def test_chaos_three_replicas_behind_the_front_door_lose_nothing_to_repeated_kills(local):
    endpoint = status(local)["endpoint"]
    local.kubectl("scale", "nm", NAME, "--replicas=3")
    local.wait("three unified pods ready", lambda: [ready(p) for p in pods(local, "unified")] == [True] * 3)
    want = references(endpoint, NAME)
    resumed = resumes(endpoint)
    with ChaosLoad(endpoint, NAME) as load:
        for _ in range(3):
            load.mid_stream()
            victims = [p for p in pods(local, "unified") if carrying(local, p)]  # the stream's pod among them
            killed = [kill(local, p) for p in victims]
            for name, count in killed:
                local.wait("the killed pod restarted", lambda n=name, c=count: restarted(local, n, c))
            answered = load.answered()
            local.wait("answers after the restarts", lambda a=answered: load.answered() >= a + 2)
    check_answers(load, want, "three replicas, the pods carrying requests killed three times")
    assert resumes(endpoint) >= resumed + 1
    local.kubectl("scale", "nm", NAME, "--replicas=1")


def test_chaos_the_prefill_decode_model_loses_nothing_to_repeated_kills(local):
    apply_exact(local, DISAGGREGATED)
    local.wait("the disaggregated model Ready", lambda: status(local, PD_NAME).get("phase") == "Ready")
    endpoint = status(local, PD_NAME)["endpoint"]
    want = references(endpoint, PD_NAME)
    resumed = resumes(endpoint)
    with ChaosLoad(endpoint, PD_NAME) as load:
        for role in ("decode", "prefill", "decode"):
            load.mid_stream()
            (pod,) = pods(local, role, PD_NAME)
            name, count = kill(local, pod)
            local.wait(f"the killed {role} pod restarted", lambda n=name, c=count: restarted(local, n, c))
            answered = load.answered()
            local.wait("answers after the restart", lambda a=answered: load.answered() >= a + 2)
    check_answers(
        load, want, "prefill/decode, its decode pod killed twice and its prefill pod once mid-stream"
    )
    assert resumes(endpoint) >= resumed + 1
