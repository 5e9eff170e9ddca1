"""Autoscaling benchmark in local mode: the built-in autoscaler under load (idle, ramp, burst, idle).

It starts local mode (`neuronfleet up --detach` in a temporary state folder; or uses one already running,
`--state DIR`), `kubectl apply`s crds/samples/smollm2-135m-cpu-autoscaled.yaml (SmolLM2-135M on cpu, builtin
autoscaler, min 1, max 3, metric queue, target 1 waiting request per pod, scale-down after 60 s), waits until
the model is Ready, then drives streamed chat requests at its `status.endpoint`:
  idle (no client), ramp (1 -> --ramp-clients clients, linearly), burst (--burst-clients), idle again;
each client sends requests back to back. Every second it samples the offered load (clients, requests in
flight), the replicas per role (the autoscaler's `status.autoscaling.desired`, the Deployments' replicas and
ready pods), the queue (the sum over the serving pods' `vllm:num_requests_waiting`, read from their /metrics
at the addresses their EndpointSlices give, as the operator reads them) and records every decision
(`status.autoscaling.lastScale`, and the ScaledUp/ScaledDown Events). Each finished request gives its TTFT
and latency. It writes bench/results/autoscale_load.json (samples, decisions, requests sent/answered/failed,
time to scale up: first request of the ramp/burst -> the new pod Ready, direction changes) and
bench/results/autoscale_load.png (load, replicas per role, queue, latency; one figure, shared time axis).

`--scale-to-zero` applies the sample's scale-to-zero variant (min 0, scaleToZero, idleSeconds 30), waits
until the model is at zero before the load, and also measures the cold start from zero (the first request
sent at zero -> its answer) and the requests lost; the results go to autoscale_load_zero.json/.png.

At the end, also on a failure, Ctrl-C or SIGTERM, it deletes the model and, if it started local mode, runs
`neuronfleet down` (a local mode given with --state is left running). The local mode it starts runs each pod
with --threads torch threads (OMP_NUM_THREADS, default 1): up to 3 pods share the machine's cores without
oversubscribing them (with torch's default, one thread per core in every pod, a decode step took seconds).

    bash bench/setup_llamacpp.sh   # the benchmarks' own environment (matplotlib), once
    bench/.venv-llamacpp/bin/python bench/autoscale_load.py [--scale-to-zero] [--idle 45 --ramp 150 ...]

Not a test: the times depend on the machine and its load (a 2-core machine runs up to 3 pods here).
"""

from __future__ import annotations

import argparse
import calendar
import http.client
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_mode import RESULTS, ROOT, LocalMode, neuronfleet, start_main

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-cpu-autoscaled.yaml"
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"
GROUP = "/apis/neuronfleet.dev/v1alpha1"
DECISION_EVENTS = ("ScaledUp", "ScaledDown", "ScaleUpStuck", "ReplicasReverted")
PROMPT = "Tell me a short story about a lighthouse keeper."

# ---- pure parts (tests/unit/test_bench_autoscale_load.py) --------------------------------------------------


@dataclass(frozen=True)
class Phase:
    name: str
    start: float  # seconds from the load's start
    end: float
    clients: tuple[int, int]  # clients at the phase's start and end (linear in between)


def load_pattern(idle: float, ramp: float, burst: float, cooldown: float, ramp_to: int, burst_to: int):
    """The phases: idle, ramp (1 -> ramp_to clients), burst (burst_to clients), idle."""
    edges = [0.0, idle, idle + ramp, idle + ramp + burst, idle + ramp + burst + cooldown]
    shapes = [("idle", (0, 0)), ("ramp", (1, ramp_to)), ("burst", (burst_to, burst_to)), ("idle", (0, 0))]
    return [Phase(n, a, b, c) for (n, c), a, b in zip(shapes, edges, edges[1:], strict=False) if b > a]


def clients_at(phases: list[Phase], t: float) -> int:
    """The offered load at t: the number of clients sending requests back to back."""
    for p in phases:
        if p.start <= t < p.end:
            first, last = p.clients
            return round(first + (last - first) * (t - p.start) / (p.end - p.start))
    return 0


def direction_changes(values: list[int]) -> int:
    """How often a sequence of replica counts turns (up then down, or down then up); flat steps don't."""
    signs = [1 if b > a else -1 for a, b in itertools.pairwise(values) if b != a]
    return sum(1 for a, b in itertools.pairwise(signs) if a != b)


def ready_total(sample: dict[str, Any]) -> int:
    """The ready pods of the scaled roles (those the autoscaler decides on: a front door that never scales,
    such as the router of a model that may scale to zero, is not counted); all roles before any decision."""
    scaled = sample.get("desired") or sample["ready"]
    return sum(n for role, n in sample["ready"].items() if role in scaled)


def scale_up_times(
    samples: list[dict], requests: list[dict], phases: list[Phase], target: float
) -> list[dict]:
    """Per loaded phase (ramp, burst): from its first request to the sample where more pods are ready than
    when it was sent (None if none came), with the ready pods before and after; and from the first sample
    of the phase whose queue per ready pod was above the target (the autoscaler's signal) to the first
    sample after it with more pods ready."""
    out = []
    for p in phases:
        if p.clients == (0, 0):
            continue
        sent = sorted(r["start"] for r in requests if p.start <= r["start"] < p.end)
        if not sent:
            continue
        first = sent[0]
        before = [s for s in samples if s["t"] <= first]
        base = ready_total(before[-1]) if before else 0
        grown = next((s for s in samples if s["t"] > first and ready_total(s) > base), None)
        over = next(
            (s for s in samples if first <= s["t"] < p.end and s["queue"] > target * ready_total(s)), None
        )
        # from the queue over target to the next pod ready after it (at zero, the first pod came sooner)
        grew = over and next((s for s in samples if s["t"] > over["t"]
                              and ready_total(s) > ready_total(over)), None)  # fmt: skip
        out.append({
            "phase": p.name, "first_request_t": round(first, 3), "ready_before": base,
            "ready_after": ready_total(grown) if grown else base,
            "seconds": round(grown["t"] - first, 3) if grown else None,
            "queue_over_target_t": over["t"] if over else None,
            "seconds_from_queue": round(grew["t"] - over["t"], 3) if grew else None,
        })  # fmt: skip
    return out


def cold_start(samples: list[dict], requests: list[dict]) -> dict | None:
    """The first request sent while no pod was ready (scale to zero): its time to the answer, or None."""
    for r in sorted(requests, key=lambda r: r["start"]):
        before = [s for s in samples if s["t"] <= r["start"]]
        if before and ready_total(before[-1]) == 0:
            return {"sent_t": round(r["start"], 3), "answered": r["ok"],
                    "seconds": round(r["end"] - r["start"], 3), "ttft": r["ttft"]}  # fmt: skip
    return None


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's series in a Prometheus text exposition (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def pod_addresses(slices: list[dict]) -> dict[str, str]:
    """Pod name -> host:port of its `http` port in EndpointSlices (ready endpoints), as the operator reads."""
    out = {}
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("name") == "http"), None)
        for e in s.get("endpoints") or []:
            ref, addrs = e.get("targetRef") or {}, e.get("addresses") or []
            if port and addrs and ref.get("kind") == "Pod" and (e.get("conditions") or {}).get("ready", True):
                out[ref["name"]] = f"{addrs[0]}:{port}"
    return out


def summarize(requests: list[dict]) -> dict:
    ok = [r for r in requests if r["ok"]]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    latency = sorted(r["end"] - r["start"] for r in ok)
    pick = lambda xs, q: round(xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)], 3) if xs else None  # noqa: E731
    return {
        "sent": len(requests), "answered": len(ok), "failed": len(requests) - len(ok),
        "errors": [r["error"] for r in requests if not r["ok"]][:10],
        "ttft_p50_s": pick(ttft, 0.5), "ttft_p90_s": pick(ttft, 0.9),
        "latency_p50_s": pick(latency, 0.5), "latency_p90_s": pick(latency, 0.9),
    }  # fmt: skip


# ---- the cluster -------------------------------------------------------------------------------------------


def wait_ready(cluster: LocalMode, name: str, timeout: float) -> dict:
    """The model's status once Ready; a refusal (Validated False) or the timeout ends the run, saying why."""
    deadline = time.monotonic() + timeout
    while True:
        status = cluster.api(f"{GROUP}/namespaces/default/neuronmodels/{name}").get("status") or {}
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        if (conditions.get("Validated") or {}).get("status") == "False":
            raise RuntimeError(f"the model was refused: {conditions['Validated'].get('message')}")
        if status.get("phase") == "Ready":
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"not Ready after {timeout:.0f} s: phase {status.get('phase')}, {conditions}")
        time.sleep(1)


# ---- the load ----------------------------------------------------------------------------------------------


def chat(endpoint: str, name: str, max_tokens: int, t0: float) -> dict:
    """One streamed chat request: start, TTFT, end (seconds from t0), tokens, ok or the error."""
    url = urllib.parse.urlsplit(endpoint)
    body = {"model": name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}  # fmt: skip
    record = {"start": time.time() - t0, "ttft": None, "end": None, "tokens": 0, "ok": False, "error": None}
    try:
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}")
        done = False
        while line := resp.readline():
            line = line.strip()
            if line == b"data: [DONE]":
                done = True
                break
            if line.startswith(b"data: "):
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    record["ttft"] = record["ttft"] or time.time() - t0 - record["start"]
                    record["tokens"] += 1
        conn.close()
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
        record["ok"] = True
    except Exception as e:  # every failure is counted and reported
        record["error"] = repr(e)
    record["end"] = time.time() - t0
    return record


@dataclass
class Load:
    """Clients that follow the pattern: client i sends requests back to back while i < clients_at(t)."""

    endpoint: str
    name: str
    phases: list[Phase]
    max_tokens: int
    t0: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, t0: float) -> None:
        self.t0 = t0
        most = max(max(p.clients) for p in self.phases)
        for i in range(most):
            threading.Thread(target=self._client, args=(i,), daemon=True).start()

    def _client(self, i: int) -> None:
        while not self.stop.is_set():
            if i >= clients_at(self.phases, time.time() - self.t0):
                self.stop.wait(0.2)
                continue
            with self.lock:
                self.in_flight += 1
            record = chat(self.endpoint, self.name, self.max_tokens, self.t0)
            with self.lock:
                self.in_flight -= 1
                self.requests.append(record)


# ---- sampling ----------------------------------------------------------------------------------------------


def sample(cluster: LocalMode, name: str, t: float, load: Load, phases: list[Phase]) -> tuple[dict, dict]:
    """One second's view: offered load, replicas per role (desired, Deployment, ready), queue; and the
    model's status.autoscaling (for its decisions)."""
    model = cluster.api(f"{GROUP}/namespaces/default/neuronmodels/{name}")
    auto = (model.get("status") or {}).get("autoscaling") or {}
    label = f"neuronfleet.dev/model={name}"
    deployments = cluster.api("/apis/apps/v1/namespaces/default/deployments", labelSelector=label)["items"]
    replicas, ready = {}, {}
    for d in deployments:
        role = d["metadata"].get("labels", {}).get("neuronfleet.dev/role", d["metadata"]["name"])
        replicas[role] = replicas.get(role, 0) + d["spec"].get("replicas", 0)
        ready[role] = ready.get(role, 0) + ((d.get("status") or {}).get("readyReplicas") or 0)
    slices = cluster.api("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices")["items"]
    waiting, running = {}, {}
    for pod, address in pod_addresses(slices).items():
        if not pod.startswith(name + "-") or pod.startswith(f"{name}-router-"):
            continue  # another model's, or the front door's (its requests are the serving pods' too)
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=3) as r:
                text = r.read().decode()
            waiting[pod] = metric_sum(text, "vllm:num_requests_waiting")
            running[pod] = metric_sum(text, "vllm:num_requests_running")
        except OSError:
            continue  # a pod going away between the slice and the scrape
    with load.lock:
        in_flight = load.in_flight
    return {
        "t": round(t, 3), "clients": clients_at(phases, t), "in_flight": in_flight,
        "desired": dict(auto.get("desired") or {}), "replicas": replicas, "ready": ready,
        "queue": sum(waiting.values()), "running": sum(running.values()), "waiting_per_pod": waiting,
    }, auto  # fmt: skip


def decision_events(cluster: LocalMode, name: str) -> list[dict]:
    items = cluster.api("/api/v1/namespaces/default/events")["items"]
    events = [
        {k: e.get(k) for k in ("type", "reason", "message", "count", "firstTimestamp", "lastTimestamp")}
        for e in items
        if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") in DECISION_EVENTS
    ]
    return sorted(events, key=lambda e: e["firstTimestamp"] or "")


def wait_for_zero(cluster: LocalMode, name: str, timeout: float) -> float:
    """Seconds until the autoscaler wants no pod of a scaled role and none is ready (the front door stays)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        model = cluster.api(f"{GROUP}/namespaces/default/neuronmodels/{name}")
        desired = ((model.get("status") or {}).get("autoscaling") or {}).get("desired") or {}
        items = cluster.api("/apis/apps/v1/namespaces/default/deployments",
                            labelSelector=f"neuronfleet.dev/model={name}")["items"]  # fmt: skip
        ready = {
            d["metadata"].get("labels", {}).get("neuronfleet.dev/role"): (d.get("status") or {}).get(
                "readyReplicas"
            )
            for d in items
        }
        if desired and not any(desired.values()) and not any(ready.get(role) for role in desired):
            return time.monotonic() - started
        time.sleep(1)
    raise RuntimeError(f"the model did not scale to zero within {timeout:.0f} s")


# ---- the plot ----------------------------------------------------------------------------------------------


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, requests = result["samples"], result["request_log"]
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(11, 10), constrained_layout=True)
    load, reps, queue, lat = axes
    load.step(t, [s["clients"] for s in samples], where="post", label="clients (offered)")
    load.plot(t, [s["in_flight"] for s in samples], label="requests in flight", alpha=0.7)
    load.set_ylabel("load")
    roles = sorted({r for s in samples for r in (*s["ready"], *s["desired"])})
    for role in roles:
        line = reps.step(t, [s["ready"].get(role, 0) for s in samples], where="post", label=f"{role} ready")
        reps.step(t, [s["desired"].get(role, math.nan) for s in samples], where="post", linestyle="--",
                  color=line[0].get_color(), label=f"{role} desired (autoscaler)")  # fmt: skip
    for d in result["decisions"]:
        if d.get("t") is not None:
            for ax in axes:
                ax.axvline(d["t"], color="grey", linewidth=0.8, linestyle=":")
    reps.set_ylabel("replicas")
    reps.yaxis.get_major_locator().set_params(integer=True)
    queue.plot(t, [s["queue"] for s in samples], label="waiting (vllm:num_requests_waiting, all pods)")
    queue.plot(t, [s["running"] for s in samples], label="running", alpha=0.7)
    queue.set_ylabel("requests")
    ok = [r for r in requests if r["ok"]]
    lat.scatter([r["end"] for r in ok], [r["end"] - r["start"] for r in ok], s=6, label="latency")
    lat.scatter([r["end"] for r in ok if r["ttft"]], [r["ttft"] for r in ok if r["ttft"]], s=6, label="TTFT")
    failed = [r for r in requests if not r["ok"]]
    if failed:
        lat.scatter([r["end"] for r in failed], [0] * len(failed), marker="x", color="red", label="failed")
    lat.set_ylabel("seconds (at answer)")
    lat.set_xlabel("seconds since the load started")
    for p in result["phases"]:
        for ax in axes:
            ax.axvspan(p["start"], p["end"], alpha=0.06 if p["name"] == "idle" else 0.14,
                       color="grey" if p["name"] == "idle" else "orange")  # fmt: skip
        load.text((p["start"] + p["end"]) / 2, 1.02, p["name"], transform=load.get_xaxis_transform(),
                  ha="center", va="bottom")  # fmt: skip
    for ax in axes:
        ax.legend(loc="upper left", fontsize=8)
    m = result["measured"]
    r = m["requests"]
    ups = ", ".join(
        f"{u['phase']} {u['seconds_from_queue']:.0f} s"
        for u in m["scale_up"]
        if u["seconds_from_queue"] is not None
    )
    fig.suptitle(
        f"builtin autoscaler, local mode ({result['machine']['cpus']} cores, shared)\n"
        f"queue over target -> new pod ready {ups or 'never'}; requests {r['answered']}/{r['sent']} answered "
        f"({r['failed']} failed); direction changes {m['direction_changes']}"
    )
    fig.savefig(out, dpi=90)


# ---- the run -----------------------------------------------------------------------------------------------


def manifest_for(args) -> dict:
    # the project's environment reads the YAML (this one may be the benchmarks', which need not have PyYAML)
    read = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"
    obj = json.loads(subprocess.run([str(PROJECT_PYTHON), "-P", "-c", read, args.sample], capture_output=True,
                                    text=True, check=True).stdout)  # fmt: skip
    if args.scale_to_zero:
        obj["spec"]["autoscaling"].update(min=0, scaleToZero=True, idleSeconds=args.idle_seconds)
    return obj


def run(args, cluster: LocalMode, obj: dict) -> dict:
    name = obj["metadata"]["name"]
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
    began = time.monotonic()
    status = wait_ready(cluster, name, args.ready_timeout)
    print(f"{name} Ready after {time.monotonic() - began:.0f} s at {status['endpoint']}", flush=True)
    to_zero = wait_for_zero(cluster, name, args.ready_timeout) if args.scale_to_zero else None
    a = args
    phases = load_pattern(a.idle, a.ramp, a.burst, a.cooldown, a.ramp_clients, a.burst_clients)
    load = Load(status["endpoint"], name, phases, args.max_tokens)
    t0 = time.time()
    load.start(t0)
    samples, decisions, seen = [], [], set()
    end = phases[-1].end
    while (t := time.time() - t0) < end or (load.in_flight and t < end + args.drain):
        s, auto = sample(cluster, name, t, load, phases)
        samples.append(s)
        last = auto.get("lastScale")
        key = json.dumps(last, sort_keys=True) if last else None
        if key and key not in seen:
            seen.add(key)
            at = calendar.timegm(time.strptime(last["at"][:19], "%Y-%m-%dT%H:%M:%S"))
            decisions.append({"t": round(at - t0, 1) if at >= t0 - 1 else None, **last})
            print(f"  t={t:6.1f}s decision: {last['reason']}", flush=True)
        if len(samples) % 30 == 0:
            print(f"  t={t:6.1f}s clients {s['clients']} ready {s['ready']} queue {s['queue']:.0f} "
                  f"answered {sum(r['ok'] for r in load.requests)}", flush=True)  # fmt: skip
        time.sleep(max(0.0, 1.0 - (time.time() - t0 - t)))
    load.stop.set()
    with load.lock:
        unfinished = load.in_flight  # still running after --drain: neither answered nor failed
    rounded = lambda r: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}  # noqa: E731
    requests = [rounded(r) for r in load.requests]
    totals = [sum(decisions[0]["from"].values())] if decisions else []
    totals += [sum(d["to"].values()) for d in decisions]
    measured = {
        "requests": {**summarize(requests), "unfinished_after_drain": unfinished},
        "scale_up": scale_up_times(samples, requests, phases, obj["spec"]["autoscaling"].get("target", 2)),
        "direction_changes": direction_changes(totals),
        "direction_changes_ready": direction_changes([ready_total(s) for s in samples]),
        "replicas_path": totals,
    }
    if args.scale_to_zero:
        measured["to_zero_before_load_s"] = round(to_zero, 1)
        measured["cold_start_from_zero"] = cold_start(samples, requests)
        measured["requests_lost"] = measured["requests"]["failed"]
    return {
        "sample": os.path.relpath(Path(args.sample).resolve(), ROOT),
        "autoscaling": obj["spec"]["autoscaling"],
        "phases": [asdict(p) for p in phases], "measured": measured, "decisions": decisions,
        "events": decision_events(cluster, name), "samples": samples, "request_log": requests,
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--state", help="a local mode already running there (left running); default: start one")
    p.add_argument("--sample", default=str(SAMPLE))
    p.add_argument("--scale-to-zero", action="store_true", help="the variant with min 0, scaleToZero")
    p.add_argument("--idle-seconds", type=int, default=30, help="scaleToZero's idleSeconds")
    p.add_argument("--idle", type=float, default=45, help="seconds without load first")
    p.add_argument("--ramp", type=float, default=150, help="seconds of 1 -> --ramp-clients clients")
    p.add_argument("--burst", type=float, default=90, help="seconds of --burst-clients clients")
    p.add_argument("--cooldown", type=float, default=150, help="seconds without load at the end")
    p.add_argument("--ramp-clients", type=int, default=8)
    p.add_argument("--burst-clients", type=int, default=12)
    p.add_argument("--threads", default="1", help="torch threads per pod (OMP_NUM_THREADS) when starting up")
    p.add_argument("--drain", type=float, default=180, help="seconds the last requests get to finish")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--out", help="results path without suffix (default bench/results/autoscale_load[_zero])")
    p.add_argument("--plot-only", metavar="JSON", help="draw the PNG of a results JSON again; run nothing")
    args = p.parse_args(argv)
    if start_main(p, args, plot):
        return 0
    out = Path(args.out or RESULTS / ("autoscale_load_zero" if args.scale_to_zero else "autoscale_load"))
    obj = manifest_for(args)
    own = args.state is None
    state = Path(args.state) if args.state else Path(tempfile.mkdtemp(prefix="autoscale-load-"))
    if own:  # local mode's pods are processes that inherit `up`'s environment, this thread count included
        neuronfleet(
            "up", "--state", str(state), "--detach", env={**os.environ, "OMP_NUM_THREADS": args.threads}
        )
    try:
        cluster = LocalMode(state)
        try:
            result = run(args, cluster, obj)
        finally:
            try:
                cluster.kubectl("delete", "neuronmodel", obj["metadata"]["name"], "--ignore-not-found")
            except Exception as e:  # the teardown goes on: `down` stops every pod anyway
                print(f"deleting the model failed: {e}", file=sys.stderr)
    finally:
        if own:
            neuronfleet("down", "--state", str(state))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["measured"], indent=1))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
