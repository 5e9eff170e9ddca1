"""Operator failover benchmark: how long the NeuronModels go without a leader when the leading operator
replica is killed (SIGKILL: no release, the follower waits for the Lease to lapse) and when it stops cleanly
(SIGTERM: it releases the Lease), with the chart's default timings (lease 15 s, renew deadline 10 s, retry
2 s) unless told otherwise.

Two real `neuronfleet operator` processes (each its own user and pod name) run against the emulated API
server with the NeuronModel CRD; each round stops the leader and measures from the signal to the moment the
other replica holds the Lease (read every 0.1 s), then starts the stopped one again as a follower. It prints
p50 and max per kind and writes bench/results/failover.json with the CPU it ran on.

    .venv/bin/python bench/failover.py [--kills 10] [--stops 5] [--lease-duration 15 --renew-deadline 10
        --retry-period 2]

Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
from machine import cpu_name  # bench/machine.py

from neuronfleet.localcluster.guard import set_token, write_private
from neuronfleet.localcluster.tls import Access

ROOT = Path(__file__).resolve().parent.parent
LEASE = "/apis/coordination.k8s.io/v1/namespaces/default/leases/neuronfleet-operator"


class Fleet:
    def __init__(self, state: Path, timing: list[str]) -> None:
        self.state, self.timing = state, timing
        self.api = subprocess.Popen(
            [sys.executable, "-P", "-m", "neuronfleet.localcluster.apiserver", "--kubeconfig",
             str(state / "kubeconfig"), "--token-auth-file", str(state / "tokens.csv"), "--ready-file",
             str(state / "url")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        while not ((state / "url").exists() and (state / "url").read_text()):
            time.sleep(0.1)
        self.access = Access.read(state / "kubeconfig")  # (the URL, the CA, the admin's token)
        self.url = self.access.url
        crd = yaml.safe_load((ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml").read_text())
        self.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        self.procs: dict[str, subprocess.Popen] = {}

    def call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=self.access.headers())  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.access.context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def holder(self) -> str:
        spec = (self.call("GET", LEASE) or {}).get("spec") or {}
        return (spec.get("holderIdentity") or "").rsplit("_", 1)[0]

    def start(self, user: str) -> None:
        config = yaml.safe_load((self.state / "kubeconfig").read_text())
        config["users"][0]["user"]["token"] = set_token(self.state / "tokens.csv", user)  # (its own user)
        kubeconfig = self.state / f"{user}.kubeconfig"
        write_private(kubeconfig, yaml.safe_dump(config))
        cli = str(Path(sys.executable).parent / "neuronfleet")
        self.procs[user] = subprocess.Popen(
            [cli, "operator", "--kubeconfig", str(kubeconfig), "--standalone", *self.timing],
            stdout=(self.state / f"{user}.log").open("a"), stderr=subprocess.STDOUT,
            env={**os.environ, "POD_NAME": user},
        )  # fmt: skip

    def wait_holder(self, want: set[str]) -> str:
        while (who := self.holder()) not in want:
            time.sleep(0.1)
        return who

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
                p.wait()
        self.api.terminate()
        self.api.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--stops", type=int, default=5)
    parser.add_argument("--lease-duration", default="15")
    parser.add_argument("--renew-deadline", default="10")
    parser.add_argument("--retry-period", default="2")
    parser.add_argument("--out", default="failover.json", help="the report's name under bench/results/")
    args = parser.parse_args()
    timing = ["--lease-duration", args.lease_duration, "--renew-deadline", args.renew_deadline,
              "--retry-period", args.retry_period]  # fmt: skip
    results: dict[str, list[float]] = {"kill -9": [], "SIGTERM": []}
    with tempfile.TemporaryDirectory(prefix="nf-failover-") as tmp:
        fleet = Fleet(Path(tmp), timing)
        try:
            for user in ("a", "b"):
                fleet.start(user)
            for kind, sig, rounds in (("kill -9", signal.SIGKILL, args.kills), ("SIGTERM", signal.SIGTERM,
                                                                                args.stops)):  # fmt: skip
                for i in range(rounds):
                    leader = fleet.wait_holder({"a", "b"})
                    time.sleep(3)  # (a steady state: the follower has seen several renewals)
                    other = "b" if leader == "a" else "a"
                    t0 = time.monotonic()
                    fleet.procs[leader].send_signal(sig)
                    fleet.wait_holder({other})
                    results[kind].append(time.monotonic() - t0)
                    fleet.procs[leader].wait()
                    print(f"{kind} #{i + 1}: {other} leads after {results[kind][-1]:.2f} s", flush=True)
                    fleet.start(leader)
        finally:
            fleet.stop()
    summary = {k: {"n": len(v), "p50": statistics.median(v), "max": max(v)} for k, v in results.items() if v}
    for kind, s in summary.items():
        print(f"{kind}: p50 {s['p50']:.2f} s, max {s['max']:.2f} s over {s['n']}")
    out = ROOT / "bench" / "results" / args.out
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "timing": timing, "seconds": results, "summary": summary},
                              indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
