"""What a re-list of everything costs the operator: one `neuronfleet operator` replica (leader election on)
against the emulated API server with `--models` NeuronModels converged (their Jobs succeeded: each model has
its children: Job, compile pod, Deployment, Service, ConfigMap, ...), then every watch
expired at once (410 Gone: the operator lists every kind again, as after an API-server restart whose watch
history is lost), `--rounds` times. Per round: the CPU seconds the operator and the API server spent from the
expiry until the operator was quiet again (under 0.05 CPU-s a second for 3 s), and the operator's CPU in 10 s
at rest before it.

    .venv/bin/python -P bench/operator_relist.py [--models 300] [--rounds 3] [--out operator_relist.json]

Prints the figures and writes bench/results/<out> with the CPU it ran on. Not a test: numbers depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/: not on sys.path under -P)
import chaos  # bench/chaos.py
from machine import cpu_name, cpu_seconds  # bench/machine.py

ROOT = Path(__file__).resolve().parents[1]


def quiet_after(pid: int, limit: float = 120) -> float:
    """Seconds until the process is quiet (under 0.05 CPU-s a second for 3 s in a row), at most `limit`."""
    started, calm, last = time.monotonic(), 0, cpu_seconds(pid)
    while time.monotonic() - started < limit:
        time.sleep(1)
        now = cpu_seconds(pid)
        calm, last = (calm + 1 if now - last < 0.05 else 0), now
        if calm >= 3:
            return time.monotonic() - started - 3
    return limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="operator_relist.json", help="its name under bench/results/")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="nf-relist-") as tmp:
        plane = chaos.ControlPlane(Path(tmp), chaos.Timing(), replicas=1)
        try:
            plane.supervise()
            live = {}
            for i in range(args.models):
                name = f"m{i:04d}"
                code, body = plane.call("POST", chaos.MODELS, chaos.manifest(name))
                assert code == 201, (code, body)
                live[name] = {"batch": 4, "replicas": 1}
            chaos.converge(plane, live, chaos.JobController(plane), limit=1800)
            (operator,) = plane.operators.values()
            assert plane.api is not None
            children = [plane.items(path, chaos.MODEL_LABEL) for path in chaos.CHILDREN.values()]
            objects = args.models + sum(map(len, children))
            for i in range(args.rounds):
                quiet_after(operator.pid)
                rest = cpu_seconds(operator.pid)
                time.sleep(10)
                rest = cpu_seconds(operator.pid) - rest
                op, api = cpu_seconds(operator.pid), cpu_seconds(plane.api.pid)
                plane.switch(expireWatches=True)
                took = quiet_after(operator.pid)
                rounds.append({
                    "operator_cpu_s": round(cpu_seconds(operator.pid) - op, 2),
                    "apiserver_cpu_s": round(cpu_seconds(plane.api.pid) - api, 2),
                    "quiet_after_s": round(took, 1),
                    "operator_cpu_s_10s_at_rest": round(rest, 2),
                })  # fmt: skip
                print(f"round {i + 1}: {rounds[-1]}", flush=True)
        finally:
            plane.stop()
    summary = {
        key: statistics.median(r[key] for r in rounds)
        for key in ("operator_cpu_s", "apiserver_cpu_s", "quiet_after_s", "operator_cpu_s_10s_at_rest")
    }
    print(f"{args.models} models ({objects} objects with theirs): median of {args.rounds}: {summary}")
    out = ROOT / "bench" / "results" / args.out
    out.parent.mkdir(exist_ok=True)
    report = {"cpu": cpu_name(), "models": args.models, "objects": objects, "rounds": rounds}
    out.write_text(json.dumps({**report, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
