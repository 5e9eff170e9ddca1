"""One sample on a cluster, end to end, as a user meets it: the manifest passes `neuronfleet validate`, is
applied, becomes Ready within the compile's deadline, answers chat requests through the official `openai`
client (greedy: streamed and whole answers agree), for a disaggregated model routes through prefill and
decode pods (the router's and the decode pods' /metrics), and once deleted leaves nothing with its label.

A real cluster: `pytest tests/cluster --kubeconfig K --sample FILE` (options in conftest.py); without them,
local mode with the cpu samples (CI)."""

from __future__ import annotations

import time

import openai
import pytest

QUESTION = "What is the capital of France?"
ROUTED = "neuronfleet:router_peers_healthy"  # the router's peers in rotation, by role


def ready(cluster, namespace: str, name: str) -> dict:
    """The model once its status says Ready for its current generation; a Failed model fails at once with
    its conditions (a refusal, a failed compile), never after the whole deadline."""
    seen: list[str] = []

    def check() -> dict | None:
        model = cluster.get("neuronmodel", name, "-n", namespace)
        status = model.get("status") or {}
        phase = status.get("phase", "")
        if not seen or seen[-1] != phase:
            seen.append(phase)
            print(f"{time.strftime('%H:%M:%S')} {namespace}/{name}: {phase or '(no status yet)'}")
        if phase == "Failed":
            conditions = "\n".join(
                f"  {c['type']}={c['status']} {c['reason']}: {c.get('message', '')}"
                for c in status.get("conditions", [])
            )
            pytest.fail(f"{namespace}/{name} failed:\n{conditions}\n{cluster.diagnose(namespace)}")
        current = status.get("observedGeneration") == model["metadata"]["generation"]
        return model if phase == "Ready" and current else None

    return cluster.wait(f"{namespace}/{name} to be Ready", check, cluster.ready_timeout)


def test_a_sample_becomes_ready_answers_and_leaves_nothing_behind(cluster, applied):
    namespace, name = applied["metadata"]["namespace"], applied["metadata"]["name"]
    spec = applied["spec"]
    t0 = time.monotonic()
    model = ready(cluster, namespace, name)
    print(f"apply -> Ready: {time.monotonic() - t0:.0f} s")
    conditions = {c["type"]: c["status"] for c in model["status"]["conditions"]}
    assert conditions["Validated"] == conditions["Ready"] == "True", conditions
    disaggregated = spec.get("serving", {}).get("mode") == "disaggregated"
    # a unified model's front door (a router) is there but where its gateway pool is its pods and it does not
    # scale to zero (docs/front-door.md)
    gateway_pool = spec.get("serving", {}).get("gateway") and not spec.get("autoscaling", {}).get(
        "scaleToZero"
    )
    roles = (
        ("prefill", "decode", "router")
        if disaggregated
        else ("unified",)
        if gateway_pool
        else ("unified", "router")
    )
    assert set(model["status"]["replicas"]) == set(roles)
    assert all(r["ready"] == r["desired"] for r in model["status"]["replicas"].values()), model["status"]

    with cluster.endpoint(model) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0)
        messages = [{"role": "user", "content": QUESTION}]
        whole = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0)
        answer = whole.choices[0].message.content
        print(f"{name} answers: {answer!r}")
        assert answer and whole.choices[0].finish_reason in ("stop", "length")
        assert 1 <= whole.usage.completion_tokens <= 16 and whole.usage.prompt_tokens >= 1
        stream = client.chat.completions.create(
            model=name, messages=messages, max_tokens=16, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == answer  # greedy: the same tokens, whole or streamed

        if disaggregated:  # the requests went through the router to prefill and decode pods
            import urllib.request

            with urllib.request.urlopen(f"{base}/metrics", timeout=600) as r:
                router = r.read().decode()
            for role in ("prefill", "decode"):
                assert f'{ROUTED}{{model_name="{name}",role="{role}"}}' in router, router[-2000:]
                healthy = [line for line in router.splitlines() if line.startswith(ROUTED) and role in line]
                assert float(healthy[0].split()[-1]) >= 1, healthy
    if disaggregated and spec.get("engine", "embedded") == "embedded":
        # the handoff itself, counted where it lands: KV bytes received, no request prefilled by decode
        port = spec.get("serving", {}).get("port", 8000)
        pods = cluster.get("pods", "-n", namespace, "-l", f"neuronfleet.dev/model={name},"
                           "neuronfleet.dev/role=decode")["items"]  # fmt: skip
        moved = sum(cluster.pod_metric(p, port, "neuronfleet:kv_transfer_bytes_total") for p in pods)
        fallbacks = sum(cluster.pod_metric(p, port, "neuronfleet:kv_fallbacks_total") for p in pods)
        assert moved > 0 and fallbacks == 0, (moved, fallbacks)

    made = {kind_name.split("/")[0] for kind_name in cluster.leftovers(namespace, name)}
    assert made >= {"Deployment", "Service", "Pod", "ConfigMap"}, made  # what the check below must not find
    cluster.kubectl("delete", "neuronmodel", name, "-n", namespace, "--timeout=15m")
    t1 = time.monotonic()
    cluster.wait(
        f"every object of {namespace}/{name} gone", lambda: not cluster.leftovers(namespace, name), 900
    )
    print(f"delete -> nothing left: {time.monotonic() - t1:.0f} s")
